"""GQA prefill (shardattn.ops.gqa_prefill): the torch path and the FA4 composition (through a CPU
stand-in of FA4, tests/fake_fa4.py) against the independent fp64 oracle of tests/oracle.py; the
route and its reasons; the FA4 adapter's boundary conversions and warm-up; FA4 on a GPU."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import pytest
import torch

from shardattn.kernels import fa4, fa4_warmup
from shardattn.ops.gqa_prefill import fa4_variants, gqa_prefill, gqa_prefill_route
from shardattn.ops.gqa_prefill_kernels import FA4SegmentKernel
from shardattn.ops.gqa_prefill_reference import segment_attention_reference
from shardattn.ops.gqa_prefill_segments import PagedPrefix, Segments, attend_segments, plan_segments
from tests.fake_fa4 import FakeFA4
from tests.oracle import gqa_prefill_oracle


@dataclass(frozen=True)
class Case:
    name: str
    seq_lens: tuple[int, ...]
    prefix_lens: tuple[int, ...] | None = None
    hq: int = 4
    hkv: int = 2
    d: int = 16
    page: int = 4
    window_left: int = -1
    sinks: bool = False


CASES = [
    Case("one_request", (9,)),
    Case("ragged_with_empty_requests", (5, 0, 11, 1, 0)),
    Case("sinks", (6, 10), sinks=True),
    Case("mqa_sinks", (7, 3), hq=4, hkv=1, sinks=True),
    Case("window_3", (12, 4), window_left=3),
    Case("window_0_sees_itself", (5, 3), window_left=0, sinks=True),
    Case("window_wider_than_request", (6, 2), window_left=40),
    Case("prefix_scattered_pages", (5, 3, 0), (7, 0, 9), sinks=True),
    Case("prefix_page_aligned_and_empty_new", (4, 0, 2), (8, 5, 0)),
    Case("prefix_with_window", (6, 4, 3), (9, 2, 0), window_left=5, sinks=True),
    Case("prefix_window_longer_than_prefix", (3, 5), (2, 6), window_left=30),
    Case("prefix_window_0", (4, 2), (6, 3), window_left=0),
    Case("no_tokens_at_all", (0, 0), (3, 0)),
]


def make_case(case: Case, dtype: torch.dtype = torch.float32, seed: int = 0) -> dict:
    """Inputs of a case: new tokens in token order, the prefixes in a paged cache with shuffled pages
    (unused table entries -1, a spare page of junk)."""
    g = torch.Generator().manual_seed(seed)
    t = sum(case.seq_lens)
    x = {
        "q": torch.randn(t, case.hq, case.d, generator=g).to(dtype),
        "k": torch.randn(t, case.hkv, case.d, generator=g).to(dtype),
        "v": torch.randn(t, case.hkv, case.d, generator=g).to(dtype),
        "cu": torch.tensor([0, *torch.tensor(case.seq_lens).cumsum(0).tolist()], dtype=torch.int32),
        "sinks": torch.randn(case.hq, generator=g) * 2 if case.sinks else None,
        "scale": case.d**-0.5,
    }
    if case.prefix_lens is not None:
        need = [-(-p // case.page) for p in case.prefix_lens]
        pages = sum(need) + 1
        order = torch.randperm(pages, generator=g).tolist()
        table = torch.full((len(need), max(need) + 1), -1, dtype=torch.int32)
        for b, n in enumerate(need):
            for j in range(n):
                table[b, j] = order.pop()
        shape = (pages, case.page, case.hkv, case.d)
        x |= {
            "k_cache": torch.randn(shape, generator=g).to(dtype),
            "v_cache": torch.randn(shape, generator=g).to(dtype),
            "block_table": table,
            "prefix_lens": torch.tensor(case.prefix_lens, dtype=torch.int32),
        }
    return x


def op_kwargs(x: dict, case: Case) -> dict:
    kw = dict(sinks=x["sinks"], window_left=case.window_left, scale=x["scale"], return_lse=True)
    for name in ("k_cache", "v_cache", "block_table", "prefix_lens"):
        if name in x:
            kw[name] = x[name]
    return kw


def oracle(x: dict, case: Case) -> tuple[torch.Tensor, torch.Tensor]:
    return gqa_prefill_oracle(
        x["q"], x["k"], x["v"], list(case.seq_lens), scale=x["scale"], prefix_lens=case.prefix_lens,
        k_cache=x.get("k_cache"), v_cache=x.get("v_cache"), block_table=x.get("block_table"),
        window_left=case.window_left, sinks=x["sinks"],
    )  # fmt: skip


def keys_in_cache(x: dict, case: Case, seed: int = 9) -> dict:
    """``x`` with a new paged cache (fresh shuffled pages, junk elsewhere) holding every request's
    prefix followed by its new tokens' keys: what an engine's cache write leaves before attention."""
    g = torch.Generator().manual_seed(seed)
    prefix = list(case.prefix_lens or [0] * len(case.seq_lens))
    need = [-(-(p + n) // case.page) for p, n in zip(prefix, case.seq_lens)]
    pages = sum(need) + 1
    order = torch.randperm(pages, generator=g).tolist()
    table = torch.full((len(need), max(need) + 1), -1, dtype=torch.int32)
    shape = (pages, case.page, case.hkv, case.d)
    kc, vc = torch.randn(shape, generator=g).to(x["q"].dtype), torch.randn(shape, generator=g).to(x["q"].dtype)
    cu = x["cu"].tolist()
    for b, n in enumerate(need):
        for j in range(n):
            table[b, j] = order.pop()
        for t in range(prefix[b] + case.seq_lens[b]):
            page, slot = table[b, t // case.page], t % case.page
            if t < prefix[b]:
                old = x["block_table"][b, t // case.page]
                kc[page, slot], vc[page, slot] = x["k_cache"][old, slot], x["v_cache"][old, slot]
            else:
                kc[page, slot], vc[page, slot] = x["k"][cu[b] + t - prefix[b]], x["v"][cu[b] + t - prefix[b]]
    lens = torch.tensor(prefix, dtype=torch.int32)
    return x | {"k_cache": kc, "v_cache": vc, "block_table": table, "prefix_lens": lens}


def assert_close(got: tuple, want: tuple, atol: float, what: str) -> None:
    out, lse = got
    out64, lse64 = want
    assert out.shape == out64.shape and lse.shape == lse64.shape and lse.dtype == torch.float32, what
    assert bool(torch.isfinite(out).all()), f"{what}: non-finite output"
    assert torch.equal(torch.isfinite(lse), torch.isfinite(lse64)), f"{what}: -inf rows differ"
    torch.testing.assert_close(out.double(), out64, atol=atol, rtol=0, msg=what)
    fin = torch.isfinite(lse64)
    torch.testing.assert_close(lse.double()[fin], lse64[fin], atol=atol, rtol=0, msg=what)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_reference_path_equals_oracle(case: Case) -> None:
    x = make_case(case)
    got = gqa_prefill(x["q"], x["k"], x["v"], x["cu"], **op_kwargs(x, case))
    assert got[1].is_contiguous()
    assert_close(got, oracle(x, case), 2e-5, case.name)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_keys_in_cache_equal_oracle(case: Case) -> None:
    """``k = v = None``: the new keys already in the paged cache, one paged call (reference path and
    the FA4 stand-in), against the oracle of the same attention."""
    x = make_case(case)
    cached = keys_in_cache(x, case)
    kw = op_kwargs(cached, case)
    got = gqa_prefill(x["q"], None, None, x["cu"], **kw)
    assert_close(got, oracle(x, case), 2e-5, case.name)
    xb = make_case(case, torch.bfloat16, seed=2)
    cached = keys_in_cache(xb, case)
    fake = FakeFA4()
    prefix = PagedPrefix(cached["k_cache"], cached["v_cache"], cached["block_table"], cached["prefix_lens"], 10**6)
    got = attend_segments(
        xb["q"], None, None, Segments.for_requests(xb["cu"]), kernel=FA4SegmentKernel(fake), prefix=prefix,
        window_left=case.window_left, sinks=xb["sinks"], scale=xb["scale"],
    )  # fmt: skip
    assert_close(got, oracle(xb, case), 2e-2, case.name)
    assert [c["paged"] for c in fake.calls] == [True] * bool(sum(case.seq_lens))


@pytest.mark.parametrize("case", CASES[2:4] + CASES[7:10], ids=[c.name for c in CASES[2:4] + CASES[7:10]])
def test_reference_path_bf16(case: Case) -> None:
    x = make_case(case, torch.bfloat16, seed=1)
    got = gqa_prefill(x["q"], x["k"], x["v"], x["cu"], **op_kwargs(x, case))
    assert got[0].dtype == torch.bfloat16
    assert_close(got, oracle(x, case), 2e-2, case.name)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_fa4_composition_equals_oracle(case: Case) -> None:
    """The op's FA4 path (adapter conversions, key buffer, prefix call, LSE merge) on a CPU stand-in."""
    x = make_case(case, torch.bfloat16, seed=2)
    fake = FakeFA4()
    prefix = None
    if case.prefix_lens is not None:
        prefix = PagedPrefix(x["k_cache"], x["v_cache"], x["block_table"], x["prefix_lens"], 10**6)
    got = attend_segments(
        x["q"], x["k"], x["v"], Segments.for_requests(x["cu"]), kernel=FA4SegmentKernel(fake),
        prefix=prefix, window_left=case.window_left, sinks=x["sinks"], scale=x["scale"],
    )  # fmt: skip
    assert_close(got, oracle(x, case), 2e-2, case.name)
    split = case.prefix_lens is not None and case.window_left < 0 and sum(case.seq_lens) > 0
    assert [c["paged"] for c in fake.calls] == ([True, False] if split else [False] * bool(sum(case.seq_lens)))
    for call in fake.calls:
        assert call["return_lse"] and call["sink"] == (case.sinks and not call["paged"])
        assert call["causal"] == (not call["paged"])
        assert call["window_size"] == ((case.window_left if case.window_left >= 0 else None), None)


def test_prefix_forms_agree_and_reference_chunks() -> None:
    """The split form (prefix in place + merge) and the combined form with a window wider than
    every prefix describe the same attention; a tiny chunk bound changes nothing."""
    case = Case("p", (6, 5), (7, 3), sinks=True)
    x = make_case(case)
    split = gqa_prefill(x["q"], x["k"], x["v"], x["cu"], **op_kwargs(x, case))
    wide = gqa_prefill(x["q"], x["k"], x["v"], x["cu"], **(op_kwargs(x, case) | {"window_left": 1000}))
    torch.testing.assert_close(split, wide, atol=1e-6, rtol=0)
    q, k, v = x["q"], x["k"], x["v"]
    args = (q, k, v, x["cu"], (x["cu"][1:] - x["cu"][:-1]))
    kw = dict(cu_k=x["cu"], causal=True, window_left=2, sinks=x["sinks"], scale=0.3)
    whole = segment_attention_reference(*args, **kw)
    chunked = segment_attention_reference(*args, **kw, chunk_bytes=1)
    torch.testing.assert_close(whole, chunked, atol=1e-6, rtol=0)


def test_empty_segments_and_missing_keys_give_the_merge_identity() -> None:
    """A segment with no visible key: ``(0, -inf)``, or ``(0, sink)`` with sinks (as FA4)."""
    q = torch.randn(3, 2, 8)
    k = torch.randn(4, 1, 8)
    cu = torch.tensor([0, 2, 3], dtype=torch.int32)
    lens = torch.tensor([0, 4], dtype=torch.int32)
    cu_k = torch.tensor([0, 0, 0], dtype=torch.int32)
    kw = dict(cu_k=cu_k, causal=True, window_left=-1, scale=1.0)
    out, lse = segment_attention_reference(q, k, k, cu, lens, sinks=None, **kw)
    assert float(out[:2].abs().sum()) == 0 and bool(lse[:2].isneginf().all()) and bool(lse[2].isfinite().all())
    sinks = torch.tensor([0.5, -1.0])
    out, lse = segment_attention_reference(q, k, k, cu, lens, sinks=sinks, **kw)
    assert float(out[:2].abs().sum()) == 0 and torch.equal(lse[:2], sinks.expand(2, 2))


def test_route_reasons_on_cpu() -> None:
    q, k = torch.zeros(4, 8, 64), torch.zeros(4, 1, 64)
    route = gqa_prefill_route(q, k)
    assert route.path == "reference" and "needs CUDA tensors" in route.reason
    assert gqa_prefill_route(q, k, backend="reference").reason == "backend='reference': torch reference"
    with pytest.raises(ValueError, match=r"^backend='fa4' is unavailable: FA4 needs CUDA tensors"):
        gqa_prefill(q, k, k, torch.tensor([0, 4], dtype=torch.int32), backend="fa4")


def test_fa4_boundary_conversions() -> None:
    lse_ht = torch.arange(6.0).view(2, 3)
    lse_ht[1, 2] = float("-inf")
    assert torch.equal(fa4.lse_tokens_major(lse_ht), lse_ht.t())
    assert fa4.lse_tokens_major(lse_ht).data_ptr() == lse_ht.data_ptr()  # a view: no copy
    table = torch.tensor([[5, -1, 2], [-1, -1, -1]], dtype=torch.int32)
    assert fa4.page_table_for_fa4(table, 4).tolist() == [[3, 0, 2], [0, 0, 0]]
    with_window = fa4._window(7)
    assert with_window == (7, None) and fa4._window(-1) == (None, None)


def test_warm_up_runs_every_variant_with_the_real_argument_forms() -> None:
    variants = fa4_variants(
        dtype=torch.bfloat16, num_heads=4, num_kv_heads=2, head_dim=16, sinks=True, page_size=4, max_segments=300
    )
    assert len(variants) == len(set(variants)) == 12
    fake = FakeFA4(compute=False)
    assert fa4_warmup.warm_up([*variants, variants[0]], "cpu", fn=fake) == 12
    assert len(fake.compiled) == 12  # each variant is its own compile key
    seen = {
        (c["paged"], c["causal"], c["window_size"][0] is not None, c["sink"], c["return_lse"], c["seqused"])
        for c in fake.calls
    }
    assert seen == {
        (False, True, False, True, True, False), (True, True, False, True, True, True),
        (False, True, True, True, True, False), (False, True, True, True, True, True),
        (True, True, True, True, True, True), (True, False, False, False, True, True),
    }  # fmt: skip
    assert {c["segments"] > 256 for c in fake.calls} == {False, True}


def test_every_call_form_is_a_warmed_variant() -> None:
    """Whatever form a call takes (new keys given or in the cache, a prefix split or copied, a
    window, PCP's runs, with or without the LSE), its FA4 compile key is one the warm-up compiled."""
    for return_lse, runs, case in itertools.product((False, True), (False, True), CASES):
        if not case.sinks or sum(case.seq_lens) == 0:
            continue
        fake = FakeFA4(compute=False)
        variants = fa4_variants(
            dtype=torch.bfloat16, num_heads=case.hq, num_kv_heads=case.hkv, head_dim=case.d, sinks=True,
            page_size=case.page, return_lse=return_lse, runs=runs,
        )  # fmt: skip
        fa4_warmup.warm_up(variants, "cpu", fn=fake)
        warmed = set(fake.compiled)
        x = make_case(case, torch.bfloat16, seed=5)
        seg = _two_runs_per_request(list(case.seq_lens), case.prefix_lens) if runs else Segments.for_requests(x["cu"])
        prefix = None
        if case.prefix_lens is not None:
            prefix = PagedPrefix(x["k_cache"], x["v_cache"], x["block_table"], x["prefix_lens"], 10**6)
        kw = dict(kernel=FA4SegmentKernel(fake), prefix=prefix, window_left=case.window_left, sinks=x["sinks"],
                  scale=x["scale"], return_lse=return_lse)  # fmt: skip
        attend_segments(x["q"], x["k"], x["v"], seg, **kw)
        if prefix is not None:  # keys in the cache: the paged form (the values are not the new keys: no check)
            attend_segments(x["q"], None, None, seg, **kw)
        assert fake.compiled <= warmed, (case.name, return_lse, runs, fake.compiled - warmed)


def _two_runs_per_request(seq_lens: list[int], prefix_lens: tuple[int, ...] | None) -> Segments:
    """Segments of the new tokens, each request cut into two runs (token order kept)."""
    prefix = [0] * len(seq_lens) if prefix_lens is None else list(prefix_lens)
    runs = []
    for b, (n, p) in enumerate(zip(seq_lens, prefix)):
        half = n // 2
        runs += [(b, p, p + half), (b, p + half, p + n)]
    return plan_segments(seq_lens, prefix, "cpu", runs=runs)


# -- GPU: FA4 itself against the oracle ------------------------------------------------------------

GPU_CASES = [
    Case("gpu_ragged_sinks", (70, 0, 129, 5), hq=8, hkv=2, d=64, sinks=True),
    Case("gpu_window", (150, 33), hq=8, hkv=1, d=64, window_left=16, sinks=True),
    Case("gpu_prefix_split", (40, 17, 0), (70, 0, 33), hq=8, hkv=2, d=64, page=16, sinks=True),
    Case("gpu_prefix_split_tma_pages", (30, 20), (140, 128), hq=8, hkv=2, d=64, page=128, sinks=True),
    Case("gpu_prefix_window", (40, 9), (70, 5), hq=8, hkv=2, d=64, page=64, window_left=20, sinks=True),
    Case("gpu_head_dim_128", (65, 3), (17, 0), hq=4, hkv=4, d=128, page=32),
]


def _fa4_skip_reason() -> str | None:
    if not torch.cuda.is_available():
        return "needs CUDA"
    q = torch.zeros(1, 8, 64, device="cuda", dtype=torch.bfloat16)
    ok, why = fa4.fa4_supports(q, q[:, :1])
    return None if ok else why


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=[c.name for c in GPU_CASES])
def test_fa4_equals_oracle_on_gpu(case: Case) -> None:
    why = _fa4_skip_reason()
    if why is not None:
        pytest.skip(why)
    x = make_case(case, torch.bfloat16, seed=3)
    dev = {n: (t.cuda() if isinstance(t, torch.Tensor) else t) for n, t in x.items()}
    route = gqa_prefill_route(dev["q"], dev["k"])
    assert route.path == "fa4", route.reason
    got = gqa_prefill(dev["q"], dev["k"], dev["v"], dev["cu"], **op_kwargs(dev, case), backend="fa4")
    want = oracle(x, case)
    ref = gqa_prefill(x["q"], x["k"], x["v"], x["cu"], **op_kwargs(x, case), backend="reference")
    err = max(float((ref[0].double() - want[0]).abs().max()), 1e-3)
    assert_close((got[0].cpu(), got[1].cpu()), want, 4 * err, case.name)


@pytest.mark.gpu
def test_fa4_warmed_up_configuration_compiles_nothing() -> None:
    why = _fa4_skip_reason()
    if why is not None:
        pytest.skip(why)
    variants = [  # the cases below: contiguous keys, and paged ones in pages of 16 (cp.async) and 128 (TMA)
        v
        for page in (16, 128)
        for v in fa4_variants(
            dtype=torch.bfloat16, num_heads=8, num_kv_heads=2, head_dim=64, sinks=True, page_size=page
        )
    ]
    fa4_warmup.warm_up(variants, "cuda")
    before = fa4_warmup.compiled_count()
    for case in (GPU_CASES[0], GPU_CASES[2], GPU_CASES[3]):  # 8 query heads over 2 KV heads
        x = make_case(case, torch.bfloat16, seed=4)
        dev = {n: (t.cuda() if isinstance(t, torch.Tensor) else t) for n, t in x.items()}
        gqa_prefill(dev["q"], dev["k"], dev["v"], dev["cu"], **op_kwargs(dev, case), backend="fa4")
    torch.cuda.synchronize()
    assert before is not None and fa4_warmup.compiled_count() == before


def test_fa4_page_tables_follow_writes_no_version_counter_sees() -> None:
    """The FA4 adapter's page table is the block table's at each call: a table rewritten through a
    NumPy alias or ``.data`` (as an engine's kernels write it, no version bump) and a table made
    under ``torch.inference_mode`` (no counter: reading it raised) give their own pages. A cache
    keyed on the table's address and version gave the old pages (errors of 2.0 on the stand-in)."""
    kernel = FA4SegmentKernel(FakeFA4())
    seg = Segments.for_requests(torch.tensor([0, 2, 3], dtype=torch.int32))
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    assert torch.equal(kernel.table(table, seg, 6), FA4SegmentKernel(FakeFA4()).table(table, seg, 6))
    version = table._version
    table.numpy()[0] = [4, 5]
    table.data[1, 0] = 1
    assert table._version == version  # neither write is seen by the counter
    fresh = FA4SegmentKernel(FakeFA4()).table(table.clone(), seg, 6)
    assert torch.equal(kernel.table(table, seg, 6), fresh) and fresh[0, 0] == 4
    with torch.inference_mode():
        frozen = torch.tensor([[5, 4], [3, 2]], dtype=torch.int32)
        got = kernel.table(frozen, seg, 6)
    assert torch.equal(got, FA4SegmentKernel(FakeFA4()).table(frozen.clone(), seg, 6))
