"""One Runtime driven like an inference engine drives it: prefills and many decode steps in turn, each
of another shape (batch sizes down to 0 and 1, drafts, padding tokens, top-k widths and lengths,
requests in another order or absent), every output and LSE compared with an fp64 oracle written
here from the contracts, so that state one step leaves in the workspace or the plans cannot pass
into the next unnoticed.

The oracle: a query's keys are the valid entries of its row (``[0, topk_length)``, inside the
request or the cache, a row listed twice once); softmax over them at the Runtime's scale, the sink
a logit without value; LSE natural log; a query with no key ``(0, -inf)`` (``(0, sink)``).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
import torch.distributed as dist

from shardattn.plan.dcp_shard import shard_kv_cache
from shardattn.plan.routing import Route
from shardattn.plan.spec import ModelSpec
from shardattn.runtime.options import DecodeOptions, PrefillOptions
from shardattn.runtime.runtime import Runtime
from tests.fp8_oracle import fp8_rows_decode, fp8_rows_oracle

SCALE = 0.27  # not head_dim ** -0.5: a Runtime that used another scale fails
SMALL = ModelSpec("sparse_mla", 6, 1, 24, 16, 12, 4, dtype="float32", softmax_scale=0.5)
DSA = ModelSpec("sparse_mla", 4, 1, 576, 512, 12, 4, dtype="bfloat16", softmax_scale=0.5)  # fp8_ds_mla's dims
PAGES, REQUESTS = 40, 5


def _at(length: torch.Tensor | None, i: int) -> int | None:
    """Token ``i``'s ``topk_length`` (``None``: the whole row)."""
    return None if length is None else int(length[i])


def _key_rows(row: list[int], length: int | None, limit: int) -> list[int]:
    """The valid entries of a top-k row, first occurrences, in order (entries in ``[0, limit)``)."""
    keys: list[int] = []
    for entry in row[: len(row) if length is None else max(0, length)]:
        if 0 <= entry < limit and entry not in keys:
            keys.append(entry)
    return keys


def _attend(q: np.ndarray, kv: np.ndarray, keys: list[int], v_dim: int, scale: float, sinks: np.ndarray | None):
    """``q [H, D]`` over ``kv[keys]`` (keys ``kv[:, :D]``, values ``kv[:, :v_dim]``, or for a wider
    ``kv`` than ``D``, ``kv[:, D:]``) -> ``(out [H, v_dim], lse [H])`` in fp64."""
    h, d = q.shape
    values = kv[:, :v_dim] if kv.shape[1] == d else kv[:, d:]
    out, lse = np.zeros((h, v_dim)), np.full(h, -math.inf)
    for head in range(h):
        logits = [float(q[head] @ kv[k, :d]) * scale for k in keys]
        if sinks is not None:
            logits.append(float(sinks[head]))
        if not logits:
            continue
        m = max(logits)
        z = sum(math.exp(x - m) for x in logits)
        lse[head] = m + math.log(z)
        for k, x in zip(keys, logits):
            out[head] += math.exp(x - lse[head]) * values[k]
    return out, lse


@dataclasses.dataclass
class _World:
    """The whole paged cache every request lives in (values in fp64, and as the Runtime stores them)."""

    spec: ModelSpec
    fp8: bool
    gen: torch.Generator

    def __post_init__(self) -> None:
        self.dtype = getattr(torch, self.spec.dtype)  # of the step's queries and cache (set per step)
        self.grouped = False  # prefill steps take the routes a GPU takes
        self.bad: int | None = None  # a rank that passes a bad argument before the step (then a good one)
        rows, d = PAGES * self.spec.page_size, self.spec.head_dim
        x = torch.randn(rows, d, generator=self.gen, dtype=torch.float64).float().double()
        if self.fp8:
            packed, _ = fp8_rows_oracle(x.numpy())
            self.stored = torch.from_numpy(packed)
            self.values = fp8_rows_decode(packed)
        else:
            self.stored = x.to(getattr(torch, self.spec.dtype))
            self.values = self.stored.double().numpy()
        # each request's pages, in a shuffled order (pages of requests interleave in the cache)
        self.table = torch.randperm(PAGES, generator=self.gen).to(torch.int32).view(REQUESTS, -1)

    def cache(self) -> tuple[torch.Tensor, np.ndarray]:
        """The cache as this step stores it (in the step's dtype; FP8 rows as they are; flat ``[R, row]``
        or, one step in two, paged ``[pages, page, row]``) and its values ``[R, row]``."""
        stored = self.stored if self.fp8 else self.stored.to(self.dtype)
        values = self.values if self.fp8 else stored.double().numpy()
        if bool(self.ints(0, 2)):
            stored = stored.view(PAGES, self.spec.page_size, -1)
        return stored, values

    def rand(self, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=self.gen, dtype=torch.float64)

    def ints(self, lo: int, hi: int, *shape: int) -> torch.Tensor:
        return torch.randint(lo, hi, shape, generator=self.gen, dtype=torch.int32)

    def row_of(self, req: int, pos: int) -> int:
        page = self.spec.page_size
        return int(self.table[req, pos // page]) * page + pos % page


def _err(got: torch.Tensor, want: np.ndarray) -> float:
    a, b = got.double().numpy(), want
    fa, fb = np.isfinite(a), np.isfinite(b)
    if got.shape != want.shape or not np.array_equal(fa, fb) or not np.array_equal(a[~fa], b[~fb]):
        return math.inf
    return float(np.abs(a[fa] - b[fb]).max()) if fa.any() else 0.0


def _refused(step, q: torch.Tensor, bad: int | None, rank: int, tokens: int) -> None:
    """Where ``bad`` names a rank, that rank runs ``step`` with a ``topk_length`` of the wrong shape
    (the others with theirs): it must raise naming the argument, and the Runtime must run the next
    step as if it had not been called."""
    if bad is None:
        return
    length = torch.zeros(tokens + 1, dtype=torch.int32) if rank == bad else None
    try:
        step(q, True, length)
    except ValueError as e:  # the peers of a step with collectives raise too, naming the rank
        assert rank != bad or "topk_length" in str(e), e
    else:
        assert rank != bad, "a topk_length of the wrong shape ran"


def _run_layers(step, w, spec, rank: int, tokens: int, layers: int, owned: int | None = None) -> list:
    """:func:`_refused` first (``owned``: the rank's tokens a ``topk_length`` has, default all),
    then ``layers`` layers of fresh ``[tokens, H, D]`` queries as an engine runs them (the first
    agrees, the later ones do not; it holds each layer's output while it runs the next):
    ``[(q, out, lse)]`` a layer."""
    _refused(step, w.rand(tokens, spec.num_heads, spec.head_dim), w.bad, rank, tokens if owned is None else owned)
    got = []
    for layer in range(layers):
        q = w.rand(tokens, spec.num_heads, spec.head_dim)
        out, lse = step(q, layer == 0)
        got.append((q, out, lse))
    return got


def _layers_error(
    rt: Runtime,
    got: list,
    ids: list[int],
    heads: slice,
    keys_of: list[list[int]],
    values: np.ndarray,
    sinks: torch.Tensor | None,
    return_lse: bool,
) -> float:
    """The largest error of every layer's ``(q, out, lse)`` against the oracle, read after the last
    layer ran (the tokens ``ids`` of ``q``, the rank's ``heads``)."""
    worst = 0.0
    sk = None if sinks is None else sinks.double().numpy()
    for q, out, lse in got:
        assert out is not None and (lse is None) == (not return_lse)
        qd = q.to(out.dtype).double().numpy()
        want = [_attend(qd[i], values, keys_of[i], rt.spec.v_dim, rt.scale, sk) for i in ids]
        want_out = np.stack([o[heads] for o, _ in want]) if want else np.zeros(tuple(out.shape))
        want_lse = np.stack([s[heads] for _, s in want]) if want else np.zeros((0, out.shape[1]))
        worst = max(worst, _err(out, want_out), 0.0 if lse is None else _err(lse, want_lse))
    return worst


def _decode_step(
    rt: Runtime, w: _World, sinks: torch.Tensor | None, rank: int, world: int, layers: int
) -> tuple[float, str, torch.dtype]:
    """One decode step of ``layers`` layers on a random batch: ``(largest error, what it was, dtype)``."""
    spec, page = w.spec, w.spec.page_size
    capacity = w.table.shape[1] * page
    # a batch of some of the requests, in some order (block-table rows), each with some drafts
    batch = torch.randperm(REQUESTS, generator=w.gen)[: int(w.ints(1, REQUESTS + 1))].tolist()
    seq = [int(x) for x in w.ints(1, capacity + 1, len(batch))]
    drafts = [int(x) for x in w.ints(0, 3, len(batch))]  # 0: the request has no query this step
    req = [b for b, n in enumerate(drafts) for _ in range(n)]
    pad = int(w.ints(0, 2))  # padding tokens (request ids outside the batch)
    req += [len(batch) + 3] * pad
    t = min(len(req), rt.max_decode_tokens)
    req = req[:t]
    width = int(w.ints(1, rt.topk + 1))
    pos = w.ints(-2, capacity + 3, t, width)
    if t and width > 1 and bool(w.ints(0, 2)):  # a repeated position
        pos[:, -1] = pos[:, 0]
    unique = all(len(set(r)) == len(r) for r in pos.tolist()) and bool(w.ints(0, 2))
    length = w.ints(-2, width + 3, t) if bool(w.ints(0, 2)) else None
    table = w.table[batch]
    seq_lens = torch.tensor(seq, dtype=torch.int32)
    req_ids = torch.tensor(req, dtype=torch.int32)
    stored, values = w.cache()
    if rt.decode_is_dcp:
        cache, local_table = shard_kv_cache(stored, table, seq_lens, rt.layout, rank, page_size=page)
    else:
        cache, local_table = stored, table
    h = spec.num_heads // world

    # an engine's layers: the first agrees (check), the later ones do not
    def step(q: torch.Tensor, check: bool, length: torch.Tensor | None = length):
        return rt.decode(
            q[:, rank * h : (rank + 1) * h].to(w.dtype).contiguous(), cache, local_table, seq_lens,
            topk_pos=pos, req_ids=req_ids, topk_length=length, topk_unique=unique, sinks=sinks, check=check,
        )  # fmt: skip

    got = _run_layers(step, w, spec, rank, t, layers)
    keys_of = []
    for i in range(t):
        b = req[i]
        keys: list[int] = []
        if 0 <= b < len(batch):
            lim = min(seq[b], capacity)
            keys = [w.row_of(batch[b], p) for p in _key_rows(pos[i].tolist(), _at(length, i), lim)]
        keys_of.append(keys)
    ids, heads = list(range(t)), slice(rank * h, (rank + 1) * h)
    err = _layers_error(rt, got, ids, heads, keys_of, values, sinks, rt.decode_options.return_lse)
    what = f"decode t={t} width={width} unique={unique} length={length is not None} batch={batch} seq={seq}"
    return err, what, w.dtype


def _prefill_step(
    rt: Runtime, w: _World, sinks: torch.Tensor | None, rank: int, world: int, layers: int
) -> tuple[float, str, torch.dtype]:
    """One prefill step of ``layers`` layers on a random batch: ``(largest error, what it was, dtype)``."""
    spec, page = w.spec, w.spec.page_size
    capacity = w.table.shape[1] * page
    n = int(w.ints(1, 4))
    batch = torch.randperm(REQUESTS, generator=w.gen)[:n].tolist()
    qlens = [int(x) for x in w.ints(0, 8, n)]  # 0: a request without new tokens
    if bool(w.ints(0, 3) == 0):
        qlens = [1] * n  # fewer tokens than ranks: some own none
    prefix = [int(w.ints(0, capacity - ql + 1)) for ql in qlens]
    t = sum(qlens)
    req = [b for b, ql in enumerate(qlens) for _ in range(ql)]
    width = int(w.ints(1, rt.topk + 1))
    length = w.ints(-2, width + 3, t) if bool(w.ints(0, 2)) else None
    table = w.table[batch]
    stored, values = w.cache()
    rows_total = PAGES * page
    plan = rt.plan_prefill(qlens, prefix, kv_rows=rows_total)
    if w.grouped and (plan.step != "pcp" or bool(w.ints(0, 2))):  # PCP: one step in two
        # the route a GPU takes (on the CPU the planner routes every call to the torch reference, which
        # builds no union): the union is built in the workspace, step after step, in one or more passes
        g = [1, 2, 4, 8][int(w.ints(0, 4))]
        route = Route("per-query", 1, "as on a GPU") if g == 1 else Route("grouped", g, "as on a GPU")
        plan = dataclasses.replace(plan, route=route)
    if plan.step == "pcp":
        pos = w.ints(-2, capacity + 3, t, width)
        seq = [p + ql for p, ql in zip(prefix, qlens)]
        starts = np.cumsum([0, *qlens])
        own = torch.tensor([w.row_of(batch[req[i]], prefix[req[i]] + i - int(starts[req[i]])) for i in range(t)])
        mine = plan.tokens_of(rank)

        def step(q: torch.Tensor, check: bool, length: torch.Tensor | None = None if length is None else length[mine]):
            return rt.prefill(
                q[mine].to(w.dtype), stored, topk_pos=pos[mine], kv_new=stored.view(rows_total, -1)[own[mine]],
                block_table=table, plan=plan, topk_length=length, sinks=sinks, check=check,
            )  # fmt: skip

        got = _run_layers(step, w, spec, rank, t, layers, owned=len(mine))
        ids, heads = mine.tolist(), slice(None)
        keys_of = [
            [w.row_of(batch[req[i]], p) for p in _key_rows(pos[i].tolist(), _at(length, i), seq[req[i]])]
            for i in range(t)
        ]
    else:
        rows = w.ints(-2, rows_total + 3, t, width)
        if width > 1:
            rows[::2, -1] = rows[::2, 0]
        h = spec.num_heads // world

        def step(q: torch.Tensor, check: bool, length: torch.Tensor | None = length):
            return rt.prefill(
                q[:, rank * h : (rank + 1) * h].to(w.dtype).contiguous(), stored, rows, plan=plan,
                topk_length=length, sinks=sinks, check=check,
            )  # fmt: skip

        got = _run_layers(step, w, spec, rank, t, layers)
        ids, heads = list(range(t)), slice(rank * h, (rank + 1) * h)
        keys_of = [_key_rows(rows[i].tolist(), _at(length, i), rows_total) for i in range(t)]
    err = _layers_error(rt, got, ids, heads, keys_of, values, sinks, rt.prefill_options.return_lse)
    what = f"prefill {plan.step} t={t} mine={len(ids)} width={width} qlens={qlens} prefix={prefix}"
    return err, what, w.dtype


def _long_run_body(
    group,
    mode: str,
    kv: str,
    with_sinks: bool,
    interleave: int,
    steps: int,
    seed: int,
    options: dict | None = None,
    grouped: bool = False,
) -> dict:
    """``steps`` steps of one Runtime (every fourth a prefill where the mode has one); the steps whose
    error is past the dtype's tolerance, with what they were."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    fp8 = kv == "fp8"
    spec = DSA if kv in ("fp8", "bf16") else SMALL
    spec = dataclasses.replace(spec, has_sinks=with_sinks)
    rt = Runtime(
        spec, group, mode=mode, max_batched_tokens=24, max_decode_tokens=8, scale=SCALE,
        prefill_options=PrefillOptions(min_shard_tokens=1, **(options or {})),
        decode_options=DecodeOptions(dcp_interleave=interleave), kv_dtype="fp8_ds_mla" if fp8 else None,
    )  # fmt: skip
    w = _World(spec, fp8, torch.Generator().manual_seed(seed))  # the same on every rank
    w.grouped = grouped
    sinks = (w.rand(spec.num_heads) * 2).float() if with_sinks else None
    has_prefill = mode != "dcp-decode"
    errors: list[tuple[float, str, torch.dtype]] = []
    for i in range(steps):
        # a float cache's steps also come in another dtype than the spec's (they bypass the workspace)
        w.dtype = torch.bfloat16 if not fp8 and kv == "fp32" and i % 5 == 3 else getattr(torch, spec.dtype)
        w.bad = (i // 7) % world if i % 7 == 6 else None
        if has_prefill and i % 4 == 0:
            errors.append(_prefill_step(rt, w, sinks, rank, world, 1 + i % 3))
        else:
            errors.append(_decode_step(rt, w, sinks, rank, world, 1 + i % 3))
    tol = {torch.float32: 2e-5, torch.bfloat16: 3e-2}
    return {"worst": max(e[:2] for e in errors), "bad": [e for e in errors if not e[0] <= tol[e[2]]]}


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("mode", "kv", "with_sinks", "interleave", "world_size"),
    [
        ("mixed", "fp32", False, 1, 2),
        ("mixed", "fp32", True, 2, 3),
        ("dcp-decode", "fp32", True, 4, 2),
        ("shardq", "fp32", True, 1, 2),
        ("headtp", "fp32", False, 1, 3),
        ("pcp", "fp32", True, 1, 2),
        ("pcp", "fp32", False, 1, 3),
        ("mixed", "bf16", True, 1, 2),
        ("mixed", "fp8", True, 2, 2),
        ("pcp", "fp8", False, 1, 2),
    ],
    ids=lambda v: str(v),
)
def test_long_mixed_run_matches_the_oracle_at_every_step(dist_pool, mode, kv, with_sinks, interleave, world_size):
    results = dist_pool.run(_long_run_body, mode, kv, with_sinks, interleave, 24, 7, world_size=world_size)
    for rank, res in enumerate(results):
        assert not res["bad"], (rank, res["bad"])


@pytest.mark.distributed
@pytest.mark.parametrize(
    "options",
    [{"chunks": 2}, {"chunks": 3, "taper": True}, {"chunks": 2, "one_union": True}, {"return_lse": False}],
    ids=lambda v: ",".join(f"{k}={x}" for k, x in v.items()),
)
def test_long_shardq_run_with_pipeline_options_matches_the_oracle(dist_pool, options: dict) -> None:
    results = dist_pool.run(_long_run_body, "shardq", "fp32", True, 1, 16, 11, options, world_size=2)
    for rank, res in enumerate(results):
        assert not res["bad"], (rank, res["bad"])


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("mode", "kv", "options", "world_size"),
    [
        ("shardq", "fp32", {}, 2),
        ("shardq", "fp32", {"chunks": 2, "one_union": True}, 3),
        ("shardq", "fp32", {"chunks": 3, "taper": True}, 2),
        ("headtp", "fp32", {}, 2),
        ("pcp", "fp32", {}, 3),
        ("mixed", "fp8", {"chunks": 2}, 2),
        ("pcp", "fp8", {}, 2),
    ],
    ids=str,
)
def test_long_run_on_the_gpu_routes_matches_the_oracle(dist_pool, mode, kv, options, world_size) -> None:
    """Prefill steps on the routes a GPU takes (grouped, per query): the union workspace is built
    step after step (on the CPU the planner's reference route builds none)."""
    results = dist_pool.run(_long_run_body, mode, kv, True, 1, 24, 13, options, True, world_size=world_size)
    for rank, res in enumerate(results):
        assert not res["bad"], (rank, res["bad"])
