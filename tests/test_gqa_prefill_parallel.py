"""GQA prefill steps on 1-4 gloo ranks (head-TP and PCP) against the independent fp64 oracle of
tests/oracle.py; PCP's per-rank composition through FA4 (a CPU stand-in, and FA4 itself on a GPU)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from shardattn.ops.gqa_prefill import gqa_prefill
from shardattn.ops.gqa_prefill_kernels import FA4SegmentKernel
from shardattn.ops.gqa_prefill_segments import PagedPrefix, attend_segments
from shardattn.parallel.comm import Comm
from shardattn.parallel.gqa_head_tp import gqa_prefill_head_tp, head_tp_kv_heads
from shardattn.parallel.gqa_prefill import gqa_prefill_pcp, pcp_segments
from shardattn.plan import pcp_plan
from tests.fake_fa4 import FakeFA4
from tests.oracle import gqa_prefill_oracle
from tests.parallel_helpers import WORLD_IDS, WORLD_SIZES, assert_rank_errors, assert_within_reference_error, catch


def make_step(
    seed: int,
    seq_lens: list[int],
    prefix_lens: list[int] | None,
    *,
    hq: int = 4,
    hkv: int = 2,
    d: int = 16,
    page: int = 3,
    window_left: int = -1,
    sinks: bool = True,
    dtype: torch.dtype = torch.float32,
) -> dict:
    """A prefill step: new tokens in token order; the prefixes in a paged cache with shuffled pages."""
    g = torch.Generator().manual_seed(seed)
    t = sum(seq_lens)
    prefix = [0] * len(seq_lens) if prefix_lens is None else prefix_lens
    need = [-(-p // page) for p in prefix]
    pages = sum(need) + 1
    order = torch.randperm(pages, generator=g).tolist()
    table = torch.full((len(seq_lens), max([*need, 0]) + 1), -1, dtype=torch.int32)
    for b, n in enumerate(need):
        for j in range(n):
            table[b, j] = order.pop()
    return {
        "seq_lens": seq_lens,
        "prefix_lens": prefix,
        "q": torch.randn(t, hq, d, generator=g).to(dtype),
        "k": torch.randn(t, hkv, d, generator=g).to(dtype),
        "v": torch.randn(t, hkv, d, generator=g).to(dtype),
        "k_cache": torch.randn(pages, page, hkv, d, generator=g).to(dtype),
        "v_cache": torch.randn(pages, page, hkv, d, generator=g).to(dtype),
        "block_table": table,
        "sinks": torch.randn(hq, generator=g) if sinks else None,
        "window_left": window_left,
        "scale": d**-0.5 * 1.3,
    }


def oracle(case: dict) -> tuple[torch.Tensor, torch.Tensor]:
    return gqa_prefill_oracle(
        case["q"], case["k"], case["v"], case["seq_lens"], scale=case["scale"], prefix_lens=case["prefix_lens"],
        k_cache=case["k_cache"], v_cache=case["v_cache"], block_table=case["block_table"],
        window_left=case["window_left"], sinks=case["sinks"],
    )  # fmt: skip


def cu_of(seq_lens: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(seq_lens, dtype=torch.long).cumsum(0).tolist()], dtype=torch.int32)


def assert_close(out: torch.Tensor, lse: torch.Tensor, out64: torch.Tensor, lse64: torch.Tensor, what: str) -> None:
    assert out.shape == out64.shape and lse.shape == lse64.shape and lse.dtype == torch.float32, what
    assert bool(torch.isfinite(out).all()) and bool(torch.isfinite(lse).all()), what
    torch.testing.assert_close(out.double(), out64, atol=3e-5, rtol=0, msg=what)
    torch.testing.assert_close(lse.double(), lse64, atol=3e-5, rtol=0, msg=what)


# -- head-TP -------------------------------------------------------------------------------------


def _run_head_tp(group: dist.ProcessGroup, case: dict, in_cache: bool = False) -> tuple:
    comm = Comm(group)
    w, r = comm.world_size, comm.rank
    hq, hkv = case["q"].shape[1], case["k"].shape[1]
    hl = hq // w
    lo, hi = head_tp_kv_heads(hq, hkv, w, r)
    if in_cache:  # the new keys written into the cache already: k = v = None, as the op takes them
        from tests.test_runtime_gqa_prefill import keys_in_cache

        case = keys_in_cache(case)
    k, v = (None, None) if in_cache else (case["k"][:, lo:hi], case["v"][:, lo:hi])
    out, lse = gqa_prefill_head_tp(
        case["q"][:, r * hl : (r + 1) * hl], k, v, cu_of(case["seq_lens"]), comm,
        num_kv_heads=hkv, k_cache=case["k_cache"][:, :, lo:hi], v_cache=case["v_cache"][:, :, lo:hi],
        block_table=case["block_table"], prefix_lens=torch.tensor(case["prefix_lens"], dtype=torch.int32),
        sinks=case["sinks"], window_left=case["window_left"], scale=case["scale"], return_lse=True,
    )  # fmt: skip
    return out, lse, dict(comm.counts)


HEAD_TP = [  # (world, q heads, KV heads): KV heads split, one each, or replicated
    (1, 4, 2),
    (2, 4, 2),
    (2, 8, 4),
    (3, 6, 3),
    (4, 8, 2),
    (4, 12, 2),
]


@pytest.mark.distributed
@pytest.mark.parametrize(("world", "hq", "hkv"), HEAD_TP, ids=[f"world{w}-{h}q-{k}kv" for w, h, k in HEAD_TP])
@pytest.mark.parametrize("window_left", [-1, 4], ids=["no-window", "window4"])
@pytest.mark.parametrize("in_cache", [False, True], ids=["kv-given", "kv-in-cache"])
def test_head_tp_equals_oracle(dist_pool, world: int, hq: int, hkv: int, window_left: int, in_cache: bool) -> None:
    case = make_step(world + hq, [7, 0, 5], [4, 6, 0], hq=hq, hkv=hkv, window_left=window_left)
    results = dist_pool.run(_run_head_tp, case, in_cache, world_size=world)
    out64, lse64 = oracle(case)
    hl = hq // world
    for r, (out, lse, counts) in enumerate(results):
        heads = slice(r * hl, (r + 1) * hl)
        assert_close(out, lse, out64[:, heads], lse64[:, heads], f"rank {r} of {world}")
        assert counts == {}, f"rank {r}: a head-TP step is a local call, it issued {counts}"


def _head_tp_heads_that_do_not_fit(group: dist.ProcessGroup) -> list[tuple[str, str]]:
    kv, cu = torch.randn(4, 1, 16), torch.tensor([0, 4], dtype=torch.int32)
    return [catch(gqa_prefill_head_tp, torch.randn(4, h, 16), kv, kv, cu, group, num_kv_heads=4) for h in (3, 0)]


@pytest.mark.distributed
def test_head_tp_blames_q_for_heads_that_do_not_fit_the_kv_heads(dist_pool) -> None:
    """The model's head count is q's heads over the ranks: the error named num_heads, no argument."""
    for three, none in dist_pool.run(_head_tp_heads_that_do_not_fit, world_size=2):
        assert three == (
            "ValueError",
            "q's query heads (3 per rank, 6 over 2 ranks) must be a multiple of num_kv_heads (4)",
        )
        assert none == ("ValueError", "q must hold at least one query head, got shape [4, 0, 16]")


def test_head_tp_kv_heads_cover_what_each_rank_reads() -> None:
    """Every query head of a rank reads a KV head inside the rank's range, for every legal layout."""
    for hq, hkv in ((64, 8), (8, 8), (12, 2), (16, 1)):
        for w in (1, 2, 4, 8, 16):
            if hq % w or (hkv >= w and hkv % w) or (hkv < w and w % hkv):
                continue
            for r in range(w):
                lo, hi = head_tp_kv_heads(hq, hkv, w, r)
                reads = {h // (hq // hkv) for h in range(r * hq // w, (r + 1) * hq // w)}
                assert reads == set(range(lo, hi)), (hq, hkv, w, r)
    with pytest.raises(ValueError, match=r"3 head-TP ranks must be a multiple of num_kv_heads \(2\)"):
        head_tp_kv_heads(12, 2, 3, 0)


# -- PCP -----------------------------------------------------------------------------------------


def _run_pcp(group: dist.ProcessGroup, case: dict, gather_output: bool) -> tuple:
    comm = Comm(group)
    plan = pcp_plan(case["seq_lens"], comm.world_size, prefix_lens=case["prefix_lens"])
    ids = plan.shard.token_ids(comm.rank)
    out, lse = gqa_prefill_pcp(
        case["q"][ids], case["k"][ids], case["v"][ids], plan, comm, k_cache=case["k_cache"],
        v_cache=case["v_cache"], block_table=case["block_table"], sinks=case["sinks"],
        window_left=case["window_left"], scale=case["scale"], gather_output=gather_output,
    )  # fmt: skip
    return out, lse, ids, dict(comm.counts)


def _check_pcp(results: list, case: dict, gather_output: bool) -> None:
    out64, lse64 = oracle(case)
    for r, (out, lse, ids, counts) in enumerate(results):
        sel = slice(None) if gather_output else ids
        what = f"rank {r} of {len(results)}"
        assert out.dtype == case["q"].dtype, what
        assert_close(out, lse, out64[sel], lse64[sel], what)
        assert counts == {"all_gather": 2 if gather_output else 1, "agreement": 1}, (what, counts)


PCP_CASES = {
    "no-prefix": ([9, 4, 13], None, -1),
    "prefix-read-in-place": ([9, 4, 13], [5, 0, 8], -1),
    "prefix-and-window": ([9, 4, 13], [5, 0, 8], 3),
    "window-wider-than-prefix": ([6, 11], [2, 7], 20),
}


class _PlanReads(TorchDispatchMode):
    """Records every dispatched op that takes a tensor of the plan (by storage) as an input."""

    def __init__(self, plan_tensors: list[torch.Tensor]) -> None:
        super().__init__()
        self.plan = {t.untyped_storage().data_ptr() for t in plan_tensors}
        self.reads: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        leaves = tree_leaves((args, kwargs))
        if any(isinstance(x, torch.Tensor) and x.untyped_storage().data_ptr() in self.plan for x in leaves):
            self.reads.append(str(func))
        return func(*args, **(kwargs or {}))


def _planned_pcp_body(group: dist.ProcessGroup, case: dict, gather_output: bool) -> tuple:
    """A layer of a planned PCP step (the rank's ``pcp_segments`` made once) reads no tensor of the
    plan: every copy to the device and the longest prefix were made with the per-step plan."""
    comm = Comm(group)
    plan = pcp_plan(case["seq_lens"], comm.world_size, prefix_lens=case["prefix_lens"])
    ids = plan.shard.token_ids(comm.rank)
    mine = pcp_segments(plan, comm.rank, "cpu")
    plan_tensors = [plan.kv_row, plan.need_stop] + [x for x in vars(plan.shard).values() if torch.is_tensor(x)]
    q, k, v = case["q"][ids], case["k"][ids], case["v"][ids]
    with _PlanReads(plan_tensors) as spy:
        out, lse = gqa_prefill_pcp(
            q, k, v, plan, comm, k_cache=case["k_cache"],
            v_cache=case["v_cache"], block_table=case["block_table"], sinks=case["sinks"],
            window_left=case["window_left"], scale=case["scale"], gather_output=gather_output, check=False,
            segments=mine,
        )  # fmt: skip
    return out, lse, ids, {"all_gather": comm.counts["all_gather"], "agreement": 1}, spy.reads


@pytest.mark.distributed
@pytest.mark.parametrize("name", ["prefix-read-in-place", "prefix-and-window"])
@pytest.mark.parametrize("gather_output", [False, True], ids=["own-tokens", "token-order"])
def test_planned_pcp_layer_reads_no_plan_tensor(dist_pool, name: str, gather_output: bool) -> None:
    """Regression: every PCP layer copied the plan's prefix lengths and KV rows to the device and read
    ``int(prefix_lens.max())`` back; with the rank's :func:`pcp_segments` a layer touches none of the
    plan's tensors, and its result is the oracle's."""
    case = make_step(5, *PCP_CASES[name][:2], window_left=PCP_CASES[name][2])
    results = dist_pool.run(_planned_pcp_body, case, gather_output, world_size=2)
    for rank, res in enumerate(results):
        assert res[4] == [], (rank, res[4])
    _check_pcp([res[:4] for res in results], case, gather_output)


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", WORLD_SIZES, ids=WORLD_IDS)
@pytest.mark.parametrize("name", list(PCP_CASES))
@pytest.mark.parametrize("gather_output", [False, True], ids=["own-tokens", "token-order"])
def test_pcp_equals_oracle(dist_pool, world_size: int, name: str, gather_output: bool) -> None:
    seq_lens, prefix, window = PCP_CASES[name]
    case = make_step(world_size, seq_lens, prefix, window_left=window)
    _check_pcp(dist_pool.run(_run_pcp, case, gather_output, world_size=world_size), case, gather_output)


@pytest.mark.distributed
def test_pcp_empty_requests_and_ranks_that_own_nothing(dist_pool) -> None:
    for seq_lens, prefix in (([0], [4]), ([2, 0], [0, 3]), ([1, 0, 1], [5, 2, 0])):
        case = make_step(5, seq_lens, prefix)
        for gather_output in (False, True):
            results = dist_pool.run(_run_pcp, case, gather_output, world_size=3)
            assert any(len(ids) == 0 for _, _, ids, _ in results), "a rank should own nothing here"
            _check_pcp(results, case, gather_output)


@pytest.mark.distributed
def test_pcp_bf16_within_the_reference_error(dist_pool) -> None:
    """bf16: each rank's error stays within twice the single-process op's (plus the rounding of the
    prefix partial, which is merged in bf16)."""
    case = make_step(11, [10, 3, 14], [6, 9, 0], dtype=torch.bfloat16)
    results = dist_pool.run(_run_pcp, case, False, world_size=3)
    out64, lse64 = oracle(case)
    ref_out, ref_lse = gqa_prefill(
        case["q"], case["k"], case["v"], cu_of(case["seq_lens"]), k_cache=case["k_cache"], v_cache=case["v_cache"],
        block_table=case["block_table"], prefix_lens=torch.tensor(case["prefix_lens"], dtype=torch.int32),
        sinks=case["sinks"], scale=case["scale"], return_lse=True,
    )  # fmt: skip
    vmax = float(torch.cat([case["v"].flatten(), case["v_cache"].flatten()]).float().abs().max())
    for r, (out, lse, ids, _) in enumerate(results):
        what = f"rank {r}"
        assert_within_reference_error(out, out64[ids], ref_out[ids], what=what + " out", partial_max=vmax)
        assert_within_reference_error(lse, lse64[ids], ref_lse[ids], what=what + " lse")


@pytest.mark.distributed
@settings(max_examples=6, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    world=st.integers(1, 4),
    reqs=st.lists(st.tuples(st.integers(0, 9), st.integers(0, 8)), min_size=1, max_size=3),
    window=st.sampled_from([-1, -1, 0, 2, 7]),
    page=st.sampled_from([1, 3, 4]),
    seed=st.integers(0, 2**16),
)
def test_pcp_drawn_batches(dist_pool, nproc, world, reqs, window, page, seed) -> None:
    world = min(world, nproc)
    case = make_step(
        seed, [n for n, _ in reqs], [p for _, p in reqs], hq=4, hkv=1 + seed % 2, page=page, window_left=window,
        sinks=seed % 3 != 0,
    )  # fmt: skip
    _check_pcp(dist_pool.run(_run_pcp, case, seed % 2 == 1, world_size=world), case, seed % 2 == 1)


def _bad(group: dist.ProcessGroup, problem: str) -> tuple[str, str]:
    rank, w = dist.get_rank(group), dist.get_world_size(group)
    case = make_step(1, [7, 5], [3, 0])
    plan = pcp_plan(case["seq_lens"], w, prefix_lens=case["prefix_lens"])
    ids = plan.shard.token_ids(rank)
    q, k, v = case["q"][ids], case["k"][ids], case["v"][ids]
    kw = dict(k_cache=case["k_cache"], v_cache=case["v_cache"], block_table=case["block_table"], window_left=-1)
    if problem == "k-dtype-on-rank-1" and rank == 1:
        k = k.double()
    elif problem == "window-on-rank-2" and rank == 2:
        kw["window_left"] = 4
    elif problem == "prefix-without-cache":
        kw |= dict(k_cache=None, v_cache=None, block_table=None)
    elif problem == "fa4-on-cpu":
        kw["backend"] = "fa4"
    elif problem == "segments-of-the-next-rank":  # same token count (4 each), another share: wrong rows
        kw["segments"] = pcp_segments(plan, (rank + 1) % w, "cpu")
    elif problem.startswith("segments-of-another-plan"):  # with check=False too: the step's hot path
        kw["segments"] = pcp_segments(pcp_plan([6, 6], w, prefix_lens=case["prefix_lens"]), rank, "cpu")
        kw["check"] = not problem.endswith("unchecked")
    if problem == "check-1-on-rank-1" and rank == 1:  # a truthy int: read as True before
        kw["check"] = 1
    if problem == "kernel-not-a-kernel":  # an AttributeError in the middle of the step before
        kw["kernel"] = "fa4"
    return catch(gqa_prefill_pcp, q, k, v, plan, group, **kw)


REJECTED = "ValueError: GQA PCP plan and inputs: rank(s) [1] of 3 rejected their inputs"


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("problem", "expect"),
    [
        ("k-dtype-on-rank-1", [REJECTED, "TypeError: k_new must have dtype in (float32), got float64", REJECTED]),
        ("window-on-rank-2", ["ValueError: GQA PCP plan and inputs: rank(s) [2] disagree"] * 3),
        ("prefix-without-cache", ["ValueError: the plan has cached prefixes (prefix_lens=[3, 0])"] * 3),
        ("fa4-on-cpu", ["ValueError: backend='fa4' is unavailable: FA4 needs CUDA tensors"] * 3),
        ("segments-of-the-next-rank", [f"ValueError: segments are rank {r}'s share" for r in (1, 2, 0)]),
        ("segments-of-another-plan", ["ValueError: segments are another plan's share"] * 3),
        ("check-1-on-rank-1", [REJECTED, "TypeError: check must be a bool, got int (1)", REJECTED]),
        ("segments-of-another-plan-unchecked", ["ValueError: segments are another plan's share"] * 3),
        ("kernel-not-a-kernel", ["TypeError: kernel must be a SegmentKernel (segment_kernel's), got str"] * 3),
    ],
    ids=lambda x: x if isinstance(x, str) else "",
)
def test_pcp_bad_input_raises_on_every_rank(dist_pool, problem: str, expect: list) -> None:
    assert_rank_errors(dist_pool.run(_bad, problem, world_size=3), expect)


# -- PCP's per-rank composition through FA4 ------------------------------------------------------


def _pcp_rank_through_fa4(case: dict, world: int, rank: int, kernel: FA4SegmentKernel, device: str) -> tuple:
    """What rank ``rank`` of a PCP step computes, with the all-gathered buffer built here."""
    dev = {n: (t.to(device) if isinstance(t, torch.Tensor) else t) for n, t in case.items()}
    plan = pcp_plan(case["seq_lens"], world, prefix_lens=case["prefix_lens"])
    ids = plan.shard.token_ids(rank)
    rows = plan.shard.padded_gather_index  # [W * P] token at each gathered row, -1 padding
    gathered = torch.zeros(rows.numel(), 2, *case["k"].shape[1:], dtype=case["k"].dtype)
    gathered[rows >= 0, 0] = case["k"][rows[rows >= 0]]
    gathered[rows >= 0, 1] = case["v"][rows[rows >= 0]]
    gathered = gathered.to(device)
    mine = pcp_segments(plan, rank, device)
    prefix = None
    if max(case["prefix_lens"]) > 0:
        prefix = PagedPrefix(dev["k_cache"], dev["v_cache"], dev["block_table"], mine.prefix_lens, mine.max_prefix)
    out, lse = attend_segments(
        dev["q"][ids.to(device)], gathered[:, 0], gathered[:, 1], mine.segments, kernel=kernel, prefix=prefix,
        window_left=case["window_left"], sinks=dev["sinks"], scale=case["scale"], new_rows=mine.kv_row,
    )  # fmt: skip
    return out.cpu(), lse.cpu(), ids


@pytest.mark.parametrize("name", list(PCP_CASES))
def test_pcp_rank_composition_through_fa4_stand_in(name: str) -> None:
    seq_lens, prefix, window = PCP_CASES[name]
    case = make_step(3, seq_lens, prefix, hq=2, hkv=1, d=8, window_left=window, dtype=torch.bfloat16)
    out64, lse64 = oracle(case)
    for world in (2, 3):
        for rank in range(world):
            out, lse, ids = _pcp_rank_through_fa4(case, world, rank, FA4SegmentKernel(FakeFA4()), "cpu")
            torch.testing.assert_close(out.double(), out64[ids], atol=2e-2, rtol=0)
            torch.testing.assert_close(lse.double(), lse64[ids], atol=2e-2, rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(PCP_CASES))
def test_pcp_rank_composition_on_fa4_gpu(name: str) -> None:
    from shardattn.kernels import fa4

    q = torch.zeros(1, 8, 64, device="cuda", dtype=torch.bfloat16)
    ok, why = fa4.fa4_supports(q, q[:, :1])
    if not ok:
        pytest.skip(why)
    seq_lens, prefix, window = PCP_CASES[name]
    case = make_step(
        4, [n * 9 for n in seq_lens], None if prefix is None else [p * 7 for p in prefix], hq=8, hkv=2, d=64,
        page=16, window_left=window if window < 0 else window * 5, dtype=torch.bfloat16,
    )  # fmt: skip
    out64, lse64 = oracle(case)
    for world in (2, 4):
        for rank in range(world):
            out, lse, ids = _pcp_rank_through_fa4(case, world, rank, FA4SegmentKernel(), "cuda")
            torch.testing.assert_close(out.double(), out64[ids], atol=2e-2, rtol=0)
            torch.testing.assert_close(lse.double(), lse64[ids], atol=2e-2, rtol=0)
