"""Shared helpers of the parallel-step tests (tests/test_comm.py, test_collector.py, test_shardq.py, ...).

Tolerances: a step's output is compared with the independent fp64 oracle (tests/oracle.py), and
its error must stay within twice the error of the single-process low-precision reference (the
same kernel on the same inputs in one process) against that oracle, plus a small floor::

    err(step vs oracle) <= 2 * err(reference vs oracle) + eps

The low-precision reference must itself agree with the oracle to a few units in the last place
of its dtype, so a wrong reference (which a step built on it would copy) cannot widen the bound.
"""

from __future__ import annotations

import datetime
import math
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from shardattn.ops.sparse_mla import sparse_mla_attention
from tests.oracle import sparse_mla_oracle, topk_rows_oracle

WORLD_SIZES = [1, 2, 3, 4]
#: The multiple of the low-precision reference's error a step may reach. GPU tests raise it to 4:
#: the Triton kernels round the softmax probabilities to bf16 before the P @ V product, a second
#: bf16 rounding that the torch reference (fp32 probabilities) does not have.
REFERENCE_ERROR_FACTOR = 2.0
WORLD_IDS = [f"world{w}" for w in WORLD_SIZES]
#: How far (in units of its dtype's eps, times the largest magnitude) the single-process
#: low-precision reference may sit from the fp64 oracle.
REFERENCE_ULPS = 4.0


#: Collective timeout (seconds) of :func:`short_timeout_group`: a test whose ranks would wait on a
#: rank that raised fails in seconds, not at the pool's timeout.
SHORT_TIMEOUT_S = 2.0


def short_timeout_group(group: dist.ProcessGroup, timeout_s: float = SHORT_TIMEOUT_S) -> dist.ProcessGroup:
    """A new gloo group of every rank, whose collectives time out after ``timeout_s``. Every process
    of the world takes part in creating a group: ``group`` must be the pool's whole world (a test
    that runs on ``dist_pool`` without ``world_size``)."""
    world = dist.get_world_size()
    if dist.get_world_size(group) != world:
        raise ValueError(f"short_timeout_group needs the whole world of {world} ranks: run the test on every rank")
    dist.barrier(group=group)  # arrive together: the short timeout also bounds the group's set-up
    return dist.new_group(list(range(world)), backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))


def rank_1_rejected(world: int, what: str, error: str) -> list[str]:
    """What :func:`assert_rank_errors` expects of a step (its agreement naming ``what``) where only rank
    1 passes a bad input: ``error`` on rank 1 and, at once, the agreement's error on every other rank."""
    peers = f"ValueError: {what}: rank(s) [1] of {world} rejected their inputs"
    return [error if r == 1 else peers for r in range(world)]


def catch(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[str, str]:
    """Run ``fn`` and return ``("ok", "")`` or ``(exception type name, message)``; for bad-input tests."""
    try:
        fn(*args, **kwargs)
    except (TypeError, ValueError) as e:
        return type(e).__name__, str(e)
    except Exception:  # anything else is a bug: report it whole
        return "unexpected", traceback.format_exc()
    return "ok", ""


def assert_rank_errors(results: list[tuple[str, str]], expect: list[str]) -> None:
    """Each rank's :func:`catch` result, written ``"kind: message"``, starts with that rank's
    expected text (one entry per rank)."""
    assert len(results) == len(expect), f"{len(results)} ranks answered, {len(expect)} expected"
    for r, ((kind, msg), want) in enumerate(zip(results, expect)):
        assert f"{kind}: {msg}".startswith(want), f"rank {r}: {kind}: {msg}"


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest absolute difference over finite entries (both tensors must be -inf at the same places)."""
    a, b = a.double(), b.double()
    fa, fb = torch.isfinite(a), torch.isfinite(b)
    assert torch.equal(fa, fb), "finite / infinite entries differ"
    assert torch.equal(a[~fa], b[~fb]), "infinite entries differ"
    if not bool(fa.any()):
        return 0.0
    return float((a[fa] - b[fa]).abs().max())


def assert_within_reference_error(
    got: torch.Tensor,
    ref64: torch.Tensor,
    ref_lowp: torch.Tensor,
    *,
    what: str,
    eps: float = 1e-5,
    partial_max: float = 0.0,
) -> None:
    """``err(got vs fp64) <= 2 * err(low-precision reference vs fp64) + rounding of partials + eps``.

    ``ref64`` is the independent fp64 oracle; ``ref_lowp`` must be within :data:`REFERENCE_ULPS`
    of it (module docstring).

    ``partial_max``: for steps that merge partial outputs rounded to ``got.dtype`` (DCP, the
    collector), the largest magnitude a partial can have (the largest value-row entry: a partial is
    a convex combination of value rows); rounding each partial adds at most half an ulp of it,
    ``finfo(dtype).eps / 2 * partial_max``. LSEs are merged in fp32 and get no such term.
    """
    assert got.shape == ref64.shape == ref_lowp.shape, (what, got.shape, ref64.shape, ref_lowp.shape)
    assert not bool(torch.isnan(got).any()), f"{what}: NaN in the step's output"
    base = max_err(ref_lowp, ref64)
    err = max_err(got, ref64)
    finite = ref64[torch.isfinite(ref64)]
    scale = max(1.0, float(finite.abs().max())) if finite.numel() else 1.0
    ref_budget = (REFERENCE_ULPS * torch.finfo(ref_lowp.dtype).eps + eps) * scale
    assert base <= ref_budget, f"{what}: single-process reference {base:.3g} from the oracle (> {ref_budget:.3g})"
    rounding = torch.finfo(got.dtype).eps / 2 * partial_max if got.dtype.is_floating_point else 0.0
    bound = REFERENCE_ERROR_FACTOR * base + rounding + eps * scale
    assert err <= bound, (
        f"{what}: error {err:.3g} > {REFERENCE_ERROR_FACTOR:g} * reference error {base:.3g} "
        f"+ partial rounding {rounding:.3g} "
        f"+ {eps * scale:.3g}"
    )


def junk_rows(
    g: torch.Generator, t: int, k: int, hi: int, junk: list[int], invalid: float, empty_every: int
) -> torch.Tensor:
    """``[t, k]`` int32 indices drawn from ``[0, hi)``; each entry is replaced with probability
    ``invalid`` by one of ``junk`` (invalid values: negative, or ``>= hi``), and about
    ``t // empty_every`` rows (at least one when ``t > 0``) are all ``-1`` (no valid key)."""
    rows = torch.randint(0, hi, (t, k), generator=g, dtype=torch.int32)
    bad = torch.tensor(junk, dtype=torch.int32)[torch.randint(0, len(junk), (t, k), generator=g)]
    rows = torch.where(torch.rand(t, k, generator=g) < invalid, bad, rows)
    if t:
        rows[torch.randint(0, t, (max(1, t // empty_every),), generator=g)] = -1
    return rows


def topk_lengths(g: torch.Generator, t: int, k: int) -> torch.Tensor:
    """``[t]`` int32 per-token counts of leading top-k entries to use (a step's ``topk_length``),
    each drawn from ``[0, k + 1]``: for ``k >= 3`` mostly a cut inside the row; ``k + 1`` is past
    the row (the whole row, by contract). One drawn row is ``0`` (no key) and another ``k`` (the
    whole row) whenever ``t >= 2``. With :func:`junk_rows`, invalid entries fall on both sides of
    the cut."""
    lengths = torch.randint(0, k + 2, (t,), generator=g, dtype=torch.int32)
    ends = torch.randperm(t, generator=g)[:2]
    lengths[ends[:1]] = 0
    lengths[ends[1:]] = k
    return lengths


def paged_mla_references(case: dict, kv_lens: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The single-process answers to a paged sparse-MLA case (keys ``q``, ``cache``, ``table``,
    ``pos``, ``req_ids``, ``block_size``, ``topk_length``, ``scale``, ``dv``, ``sinks``), on the
    rows the oracle converts from its top-k positions (``kv_lens``: ``[B]`` keys per request).

    Returns ``(out, lse)`` of the low-precision reference, ``(out, lse)`` of the fp64 oracle, and
    the largest value-row magnitude (``partial_max`` of :func:`assert_within_reference_error`).
    """
    rows = topk_rows_oracle(
        case["pos"], case["req_ids"], case["table"], block_size=case["block_size"], seq_lens=kv_lens,
        topk_length=case["topk_length"],
    )  # fmt: skip
    q, kv = case["q"], case["cache"]
    kw = dict(scale=case["scale"], v_dim=case["dv"], sinks=case["sinks"])
    ref_out, ref_lse = sparse_mla_attention(q, kv, rows, **kw)
    out64, lse64 = sparse_mla_oracle(q, kv, rows, **kw)
    vmax = float(kv[:, : case["dv"]].float().abs().max()) if kv.numel() else 0.0
    return ref_out, ref_lse, out64, lse64, vmax


def neg_inf_like(x: torch.Tensor) -> torch.Tensor:
    return torch.full_like(x, -math.inf)


def paged(per_request: list[torch.Tensor], block_size: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Lay out each request's rows ``[L_b, ...]`` in a paged cache with shuffled pages.

    Returns ``(cache [num_pages, block_size, ...], block_table [B, M] int32)``; unused table
    entries are ``-1``, and one spare page (never referenced) is always present.
    """
    trailing = per_request[0].shape[1:]
    need = [-(-int(x.shape[0]) // block_size) for x in per_request]
    total = sum(need) + 1
    order = torch.randperm(total, generator=gen)
    cache = torch.randn(total, block_size, *trailing, generator=gen).to(per_request[0].dtype)  # junk fill
    table = torch.full((len(per_request), max([*need, 0]) + 1), -1, dtype=torch.int32)
    next_page = 0
    for b, rows in enumerate(per_request):
        for j in range(need[b]):
            page = int(order[next_page])
            next_page += 1
            table[b, j] = page
            chunk = rows[j * block_size : (j + 1) * block_size]
            cache[page, : chunk.shape[0]] = chunk
    return cache, table


def fp8_rows(rows: torch.Tensor, block_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows [R, 576]`` as ``fp8_ds_mla`` rows (``[R, 656]``, or paged ``[R / block_size,
    block_size, 656]``) and those rows as a step reads them, dequantised to ``rows``' dtype (exact):
    the cache a rank holds and the whole-cache reference's view of it."""
    from shardattn.ops.kv_fp8 import dequantize_kv, quantize_kv

    packed = quantize_kv(rows)
    if block_size is not None:
        packed = packed.view(-1, block_size, packed.shape[-1])
    return packed, dequantize_kv(packed, rows.dtype).reshape(rows.shape)
