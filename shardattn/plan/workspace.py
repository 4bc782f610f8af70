"""Per-rank workspace bounds: what the Runtime reserves once for a configuration.

Every buffer a step of one mode needs is bounded here from the configuration alone, so the
Runtime can reserve it at start-up and graph-visible buffers never move. Notation (per rank):

* ``M`` max batched tokens of a step, ``W`` world size of the mode's group, ``H`` query heads of
  the model, ``Hl = H / tp_size`` heads a rank holds under head tensor parallelism.
* ``D`` head dim (576 for MLA), ``Dv`` value dim (512), ``K`` top-k, ``G`` queries per group.
* ``N`` tokens the grouped kernel handles in one pass on a rank, ``Nmax`` the most tokens a
  rank can hold in a step (``N`` plus the alignment slack of :func:`zigzag_split`, which may
  put up to ``2G - 1`` tokens more than ``ceil(T / W)`` on one rank). A rank holding more than
  ``N`` tokens runs the grouped kernel in passes of at most ``N`` over the same union buffer.

Modes:

* ``shardq``: tokens split over ``W`` (= TP) ranks, every rank runs all ``H`` heads;
  ``N = ceil(ceil(M / W) / G) * G``. The step is pipelined in place (no ``send`` / ``recv``
  items): ``packed_q`` receives the queries, ``out`` / ``lse`` are the output send buffers. A
  one-chunk step also stages in them: ``out`` holds, before the kernel, the queries it sends
  (``min(M, (W-1) * Nmax)`` tokens of ``H / W`` heads at ``D``: more than its outputs once
  ``(W-1) / W * D > Dv``, the DSA dims from ten ranks on), ``packed_q``, after it, the outputs and
  LSEs it receives; each item is the larger of its two uses.
  ``topk_rows`` holds the rank's rows of the top-k (gathered from the step's ``[T, K]``).
  Unpipelined (one chunk, the default) the four buffers are all live while the kernel runs (it
  reads the queries, the rows and the union while writing the outputs), so none can share bytes
  with another.
* ``headtp``: no token split; a rank runs all ``M`` tokens with ``H / W`` heads; ``N = ceil(M / G) * G``
  (the union of ``M`` tokens is ``ceil(M / G)`` groups of ``G * K`` entries). The
  kernel reads the caller's rows and writes the caller's result, so the union is all it takes.
* ``pcp``: tokens split over ``W`` PCP ranks (``Hl`` heads each); the new KV rows are
  all-gathered (``W * Nmax`` rows). (The Runtime's PCP step takes only the union from the
  workspace; the other items bound what it allocates per step.)
* GQA prefill (``spec.kind == "gqa"``): ``headtp`` has no item (FA4 allocates its output); ``pcp``
  bounds the own and all-gathered K and V (``2 * Hkv * D`` per token) and the outputs. The Runtime
  reserves none of them: FA4 allocates its outputs, the PCP step its gather, per step (prefill
  steps are never captured in a CUDA graph).
* ``dcp-decode``: ``M`` decode query tokens; a rank gathers the ``Hl`` heads of its ``W`` DCP
  peers (``W * Hl`` heads) and attends over its KV shard, then the collector merges. Sized to
  what the step exchanges: partials in the output dtype (bf16), and each rank receives only the
  ``Hl`` heads it returns (the all-to-all collector), not every rank's full partial in fp32. The
  merged result is the caller's (a new tensor), not a workspace item. GLM-5 at ``W = 8``,
  ``M = 1024``: 0.362 GB (1.85 GB when sized as fp32 partials of ``W * H`` heads).
* ``headtp-decode``: ``M`` decode query tokens, ``H / W`` heads, no peers: the kernel writes the
  caller's result, so only the converted top-k rows (sparse MLA) are scratch.

Steps never run at the same time on a rank, so a Runtime lays every step's items over one arena
of the largest step's bytes (:mod:`shardattn.runtime.workspace`), and inside a step two
items share bytes when they are never live at the same time (:data:`ITEM_LIFETIMES`,
:func:`arena_offsets`). The DCP decode step: the queries (gathered, then copied head-major) are
dead once the kernel has run, so the packed send buffer reuses their bytes; the converted rows
are dead after the kernel too, and the partial after packing, so the receive buffer reuses
theirs. ShardQ's unpipelined step holds all its items while the kernel runs: nothing to share.

Union entries are int32 (24-bit row + 8 membership bits); a group of ``g <= G`` queries has room
for ``g * K`` entries, so the union of ``N`` tokens needs ``N * K * 4`` bytes. Example (the
contract): GLM-5, 65,536 batched tokens, TP4, ``G = 2``, top-k 2048: ``N = 16,384`` and the union
is ``16,384 / 2`` groups ``* 4,096`` entries ``* 4 B = 134,217,728 B``.

>>> from shardattn.plan.spec import get_preset
>>> wb = workspace_bounds(get_preset("glm5"), max_batched_tokens=65536, world_size=4, mode="shardq", group_size=2)
>>> wb.group_size, wb.rank_tokens, wb.union
(2, 16384, 134217728)
"""

from __future__ import annotations

from dataclasses import dataclass

from shardattn._checks import check_choice, check_int
from shardattn.plan._common import check_world_size
from shardattn.plan.kv_format import kv_format_name, kv_row_bytes
from shardattn.plan.pipeline import CHUNK_ALIGN, MAX_CHUNKS
from shardattn.plan.routing import prefill_group_size
from shardattn.plan.spec import DTYPE_BYTES, ModelSpec

__all__ = [
    "ARENA_ALIGN",
    "ITEM_LIFETIMES",
    "WORKSPACE_ITEMS",
    "WORKSPACE_MODES",
    "WorkspaceBounds",
    "arena_offsets",
    "workspace_bounds",
]

WORKSPACE_MODES = ("shardq", "headtp", "pcp", "dcp-decode", "headtp-decode")
WORKSPACE_ITEMS = (
    "union",
    "union_offsets",
    "topk_rows",
    "packed_q",
    "out",
    "lse",
    "send",
    "recv",
    "split_partials",
)
_INDEX_BYTES = 4
_F32 = 4
#: Bytes: every item of an arena starts at a multiple.
ARENA_ALIGN = 256
#: ``{mode: {item: (first, last)}}``: the phases of a step in which an item is live (written or
#: read), where items of the mode can share bytes; an item not listed is live for the whole step.
#: ``dcp-decode`` (:mod:`shardattn.parallel.dcp`): 0 all-gather q, 1 head-major copy, 2 convert the
#: top-k, 3 kernel (split partials merged inside it), 4 pack the partial, 5 all-to-all, 6 merge.
ITEM_LIFETIMES: dict[str, dict[str, tuple[int, int]]] = {
    "dcp-decode": {
        "packed_q": (0, 3),
        "topk_rows": (2, 3),
        "out": (3, 4),
        "lse": (3, 4),
        "split_partials": (3, 3),
        "send": (4, 5),
        "recv": (5, 6),
    },
}


@dataclass(frozen=True)
class WorkspaceBounds:
    """Itemised per-rank byte bounds of one configuration (see the module docstring).

    Items (bytes; 0 where the mode has no such buffer):
        union: grouped top-k union entries (int32), one pass of ``rank_tokens`` tokens.
        union_offsets: per-group start and length of the union (int32).
        topk_rows: the rank's top-k indices, converted to KV rows / local positions (int32).
        packed_q: query rows the kernel reads (all-to-all or all-gather output, or 0 if the
            caller's query is used in place). ShardQ: at least the outputs and LSEs a one-chunk
            step receives, staged there after its kernel.
        out: the kernel's output before it moves (ShardQ send buffer, DCP partial; out dtype);
            0 where the kernel writes the caller's result. ShardQ: at least the queries a
            one-chunk step sends, staged there before its kernel.
        lse: its fp32 log-sum-exp.
        send: collective send buffers (packed partials, own KV rows).
        recv: collective receive buffers (every rank's partial of my heads, gathered KV).
        split_partials: fp32 split-KV decode partials (out and LSE per split).
    """

    mode: str
    world_size: int
    group_size: int
    rank_tokens: int
    rank_tokens_max: int
    heads: int
    union: int
    union_offsets: int
    topk_rows: int
    packed_q: int
    out: int
    lse: int
    send: int
    recv: int
    split_partials: int
    formulas: tuple[tuple[str, str], ...] = ()

    @property
    def items(self) -> dict[str, int]:
        """``{item: bytes}`` in the fixed order of ``WORKSPACE_ITEMS``."""
        return {name: getattr(self, name) for name in WORKSPACE_ITEMS}

    @property
    def total(self) -> int:
        return sum(self.items.values())

    def table(self) -> list[dict[str, object]]:
        """One row per item (``item``, ``bytes``, ``MiB``, ``formula``) and a ``total`` row."""
        f = dict(self.formulas)
        rows: list[dict[str, object]] = [
            {"item": k, "bytes": v, "MiB": round(v / 2**20, 3), "formula": f.get(k, "")} for k, v in self.items.items()
        ]
        rows.append({"item": "total", "bytes": self.total, "MiB": round(self.total / 2**20, 3), "formula": ""})
        return rows


def arena_offsets(
    sizes: dict[str, int], lifetimes: dict[str, tuple[int, int]] | None = None, *, align: int = ARENA_ALIGN
) -> tuple[dict[str, int], int]:
    """Byte offsets of a step's items in one buffer, items live at the same time never overlapping.

    First fit, largest item first: each item takes the lowest aligned offset where it overlaps no
    item already placed whose lifetime meets its own.

    Args:
        sizes: ``{item: bytes}`` (items of 0 bytes are left out).
        lifetimes: ``{item: (first, last)}`` phases (inclusive); an item not listed is live in
            every phase. Default: all live together (items laid one after another).
        align: every offset is a multiple.
    Returns:
        ``({item: offset}, bytes the buffer needs)``.
    Raises:
        ValueError / TypeError: ``sizes`` or ``lifetimes`` not a dict, a negative or non-int size, a
            lifetime that is not a ``(first, last)`` pair of ints with ``first <= last``.

    >>> arena_offsets({"a": 100, "b": 50, "c": 60}, {"a": (0, 1), "b": (2, 2), "c": (1, 2)}, align=1)
    ({'a': 0, 'c': 100, 'b': 0}, 160)
    """
    check_int("align", align, minimum=1)
    if not isinstance(sizes, dict):
        raise TypeError(f"sizes must be a dict of item -> bytes, got {type(sizes).__name__}")
    for item, n in sizes.items():
        check_int(f"sizes[{item!r}]", n, minimum=0)
    if lifetimes is not None and not isinstance(lifetimes, dict):
        raise TypeError(f"lifetimes must be a dict of item -> (first, last) or None, got {type(lifetimes).__name__}")
    live: dict[str, tuple[int, int]] = {}
    for item, span in (lifetimes or {}).items():
        if not (isinstance(span, tuple) and len(span) == 2):
            raise TypeError(f"lifetimes[{item!r}] must be a (first, last) pair of ints, got {span!r}")
        first, last = (check_int(f"lifetimes[{item!r}][{i}]", x) for i, x in enumerate(span))
        if first > last:
            raise ValueError(f"lifetimes[{item!r}] must have first <= last, got {(first, last)}")
        live[item] = (first, last)
    everything = (-(2**62), 2**62)
    order = sorted((k for k, n in sizes.items() if n), key=lambda k: (-sizes[k], k))
    placed: list[tuple[str, int, int]] = []  # item, start, end (bytes)
    offsets: dict[str, int] = {}
    for item in order:
        first, last = live.get(item, everything)
        clash = [
            (a, b)
            for other, a, b in placed
            if not (live.get(other, everything)[1] < first or last < live.get(other, everything)[0])
        ]
        n = -(-sizes[item] // align) * align
        for start in sorted({0, *(b for _, b in clash)}):
            if all(start + n <= a or b <= start for a, b in clash):
                break
        offsets[item] = start
        placed.append((item, start, start + n))
    return offsets, max((b for _, _, b in placed), default=0)


def _pad16(nbytes: int) -> int:
    """Bytes rounded up to the 16-byte segments the collector packs."""
    return -(-nbytes // 16) * 16


def _dtype_bytes(name: str, value: str | None, default: str) -> int:
    value = default if value is None else value
    check_choice(name, value, tuple(DTYPE_BYTES))
    return DTYPE_BYTES[value]


def workspace_bounds(
    spec: ModelSpec,
    *,
    max_batched_tokens: int,
    world_size: int,
    mode: str,
    tp_size: int | None = None,
    group_size: int | None = None,
    topk: int | None = None,
    num_kv_splits: int = 1,
    q_dtype: str | None = None,
    kv_dtype: str | None = None,
    out_dtype: str | None = None,
) -> WorkspaceBounds:
    """Per-rank workspace bounds of ``spec`` for a step of ``mode``.

    Args:
        spec: the model (heads, dims, top-k, dtype).
        max_batched_tokens: ``M``, the most new tokens in a step.
        world_size: ``W``: TP size for ``shardq`` / ``headtp``, PCP or DCP size otherwise.
        mode: one of ``WORKSPACE_MODES``.
        tp_size: head tensor parallelism (``Hl = H / tp_size`` heads a rank holds); default 1 for
            ``pcp``, and ``world_size`` for ``dcp-decode`` (ignored by ``headtp-decode``, whose
            ``world_size`` is the TP size) (the DCP group is the TP group: a rank
            holds ``H / W`` heads, gathers all ``H`` and gets its ``H / W`` back merged).
        group_size: ``G`` in (1, 2, 4, 8); default: the largest a device may route for the
            kernel's heads per rank in that mode, the grouped Gluon kernel's
            (:func:`~shardattn.plan.routing.prefill_group_size` with ``gluon=True``: ``64 / heads``
            rounded down to a power of two, at most 8, so 8 / 16 / 32 heads give 8 / 4 / 2), 1
            above 32 heads; 1 for the decode modes.
        topk: ``K``; default ``spec.topk`` (0 for dense GQA).
        num_kv_splits: split-KV chunks of the decode kernel (``dcp-decode``); 1 = no split.
        q_dtype, kv_dtype, out_dtype: dtype names; default ``spec.dtype``. ``kv_dtype`` is a KV row
            format of :data:`shardattn.plan.kv_format.KV_FORMATS` (``"fp8_ds_mla"``: 656-byte rows).

    With ``group_size`` given, every item is non-decreasing in ``max_batched_tokens``, the
    heads, dims, ``topk``, ``group_size``, ``num_kv_splits`` and the dtype sizes; in
    ``world_size`` and ``tp_size`` every item is monotone (a per-rank share shrinks, a gathered
    buffer grows) but the total of ``pcp`` / ``dcp-decode`` need not be. (With the default
    ``group_size`` the heads also pick ``G``, which rounds ``N``.)
    """
    if not isinstance(spec, ModelSpec):
        raise TypeError(f"spec must be a ModelSpec, got {type(spec).__name__}")
    m = check_int("max_batched_tokens", max_batched_tokens, minimum=0)
    w = check_world_size(world_size)
    check_choice("mode", mode, WORKSPACE_MODES)
    if tp_size is None:
        tp_size = w if mode == "dcp-decode" else 1
    tp = check_int("tp_size", tp_size, minimum=1)
    s = check_int("num_kv_splits", num_kv_splits, minimum=1)
    k = spec.topk if topk is None else check_int("topk", topk, minimum=0)
    bq = _dtype_bytes("q_dtype", q_dtype, spec.dtype)
    bo = _dtype_bytes("out_dtype", out_dtype, spec.dtype)
    h, d, dv = spec.num_heads, spec.head_dim, spec.v_dim
    kv_row = kv_row_bytes(kv_format_name("kv_dtype", spec.dtype if kv_dtype is None else kv_dtype), d, dv)
    if mode in ("shardq", "headtp", "headtp-decode"):
        if h % w:
            raise ValueError(f"num_heads ({h}) must be divisible by world_size ({w}) in mode {mode!r}")
        kernel_heads = h if mode == "shardq" else h // w
        tp = w
    else:
        if h % tp:
            raise ValueError(f"num_heads ({h}) must be divisible by tp_size ({tp})")
        kernel_heads = h // tp if mode == "pcp" else w * (h // tp)
    decode = mode in ("dcp-decode", "headtp-decode")
    if group_size is None:
        # the largest G a device may route (the grouped Gluon kernel's on sm_90), so any device fits
        g = 1 if decode else (prefill_group_size(kernel_heads, gluon=True) or 1)
    else:
        g = check_int("group_size", group_size, minimum=1)
        check_choice("group_size", g, (1, 2, 4, 8))
    slack = 0 if g == 1 else 2 * g - 1
    item: dict[str, tuple[int, str]] = {}

    if decode:
        n = n_max = m
    elif mode == "headtp":  # every token, in whole groups (the union of T tokens is [ceil(T/G), G*K])
        n = n_max = -(-m // g) * g
    else:
        per_rank = -(-m // w)  # ceil(M / W)
        n = -(-per_rank // g) * g  # rounded up to whole groups
        n_max = n + slack
    if not decode and k:
        item["union"] = (n * k * _INDEX_BYTES, "N * K * 4 (N/G groups of G*K int32 entries)")
        item["union_offsets"] = (2 * n * _INDEX_BYTES, "2 * N * 4 (start and length per group, room for G = 1)")
    if k and mode != "headtp":  # head-TP prefill reads the caller's rows
        item["topk_rows"] = (n_max * k * _INDEX_BYTES, "Nmax * K * 4 (the rank's top-k rows, converted or gathered)")
    hl = h // tp
    if mode == "shardq":
        # pipelined in place (parallel.shardq): queries are sent from the caller's tensor and outputs
        # land in the result, so the only buffers are the chunks' receive (q) and send (out, lse)
        # buffers, each chunk's starting on a CHUNK_ALIGN boundary. A one-chunk step also stages in
        # them, one piece per peer: the queries it sends (at most min(M, (W-1)*Nmax) tokens of H/W
        # heads) in the output send buffer, the outputs and LSEs it receives in the query receive one
        pad, staged = MAX_CHUNKS * CHUNK_ALIGN, min(m, (w - 1) * n_max) * hl
        item["packed_q"] = (
            max(n_max * h * d * bq + pad, staged * (dv * bo + _F32) + 2 * w * CHUNK_ALIGN),
            "max(Nmax * H * D * q_bytes + C*256 (query receive buffers), "
            "min(M, (W-1)*Nmax) * H/W * (Dv * out_bytes + 4) + 2*W*256 (received outputs and LSEs, one chunk))",
        )
        item["out"] = (
            max(n_max * h * dv * bo + pad, staged * d * bq + w * CHUNK_ALIGN),
            "max(Nmax * H * Dv * out_bytes + C*256 (output send buffers), "
            "min(M, (W-1)*Nmax) * H/W * D * q_bytes + W*256 (the queries sent, one chunk))",
        )
        item["lse"] = (n_max * h * _F32 + pad, "Nmax * H * 4 + C*256 (LSE send buffers)")
    elif mode in ("headtp", "headtp-decode"):
        if mode == "headtp-decode" and s > 1:
            item["split_partials"] = (m * hl * s * (dv + 1) * _F32, "M * (H/W) * S * (Dv + 1) * 4")
    elif mode == "pcp":
        gathered = m + w * (slack + 1) - 1  # >= W * Nmax for any step, and monotone in W
        item["out"] = (n_max * hl * dv * bo, "Nmax * Hl * Dv * out_bytes")
        item["lse"] = (n_max * hl * _F32, "Nmax * Hl * 4")
        if spec.kind == "gqa":  # a token's K and V of every KV head; G = 1, so the padded share is ceil(M / W)
            row, what = 2 * spec.num_kv_heads * kv_row, "2 * Hkv * D * kv_bytes"
            item["send"] = (n_max * row, f"Nmax * {what} (own new K and V)")
            item["recv"] = (w * n_max * row, f"W * Nmax * {what} (all-gathered K and V)")
        else:
            item["send"] = (n_max * kv_row, "Nmax * kv_row_bytes (own new KV rows: D * kv_bytes, 656 in fp8_ds_mla)")
            item["recv"] = (gathered * kv_row, "(M + W*(slack+1) - 1) * kv_row_bytes (all-gathered KV rows)")
    else:  # dcp-decode: what the step and its all-to-all collector really hold
        hc = w * hl
        part = _pad16(m * hl * dv * bo) + _pad16(m * hl * _F32)  # one rank's heads: partial out + LSE
        item["packed_q"] = (
            2 * m * hc * d * bq,
            "2 * M * W*Hl * D * q_bytes (all-gathered query heads, rank-major, and their head-major copy)",
        )
        item["out"] = (m * hc * dv * bo, "M * W*Hl * Dv * out_bytes (the partial output over the shard)")
        item["lse"] = (m * hc * _F32, "M * W*Hl * 4 (partial LSE)")
        item["send"] = (w * part, "W * (M * Hl * Dv * out_bytes + M * Hl * 4) (partials packed per destination)")
        item["recv"] = (w * part, "W * (M * Hl * Dv * out_bytes + M * Hl * 4) (every rank's partial of my heads)")
        if s > 1:
            item["split_partials"] = (m * hc * s * (dv + 1) * _F32, "M * W*Hl * S * (Dv + 1) * 4")
    values = {name: item.get(name, (0, ""))[0] for name in WORKSPACE_ITEMS}
    return WorkspaceBounds(
        mode=mode,
        world_size=w,
        group_size=g,
        rank_tokens=n,
        rank_tokens_max=n_max,
        heads=kernel_heads,
        formulas=tuple((name, f) for name, (_, f) in item.items()),
        **values,
    )
