"""FA4's fast launch (shardattn/kernels/fa4_launch.py) on the CPU stand-in of FA4 (tests/fake_fa4.py),
and on a GPU against FA4's public function.

The stand-in has FA4's private pieces as the guard reads them and launches its kernels as FA4 does,
and each kernel asserts that its arguments are of its own compile key, so a direct launch of a
wrong kernel (or with a stale argument) fails here. Checked: the guard and each of its refusals
(named in the route's reason), one public call per plan and call form then direct launches that
give the public path's bits, a call that does not fit the resolved form taking the public path,
refusals at resolve time (FA4 copying an input, no kernel launched), and FA4's compile cache put
back after each observed call."""

from __future__ import annotations

import inspect
import itertools
import re
import types

import pytest
import torch
import torch.distributed as dist

from shardattn.kernels import fa4
from shardattn.kernels.fa4_launch import FAST_LAUNCH_VERSION, FA4Launch, FA4Launches, check_fast_launch
from shardattn.ops.gqa_prefill_kernels import FA4SegmentKernel
from shardattn.runtime.options import PrefillOptions
from shardattn.runtime.runtime import Runtime
from tests.fake_fa4 import FakeFA4
from tests.test_gqa_prefill_parallel import make_step, oracle
from tests.test_runtime_gqa_prefill import _rank_inputs, fa4_stand_in, spec_of

# -- the guard --------------------------------------------------------------------------------------


def _interface(**changes: object) -> types.SimpleNamespace:
    fake = FakeFA4(compute=False)
    return types.SimpleNamespace(**{**vars(fake.interface), **changes})


class _OtherKernel:
    def __call__(self, mQ, mK, mV, mO, mLSE, softmax_scale, mCuSeqlensK=None, mCuSeqlensQ=None) -> None: ...


def _public_without_sinks(q, k, v, *, cu_seqlens_q, return_lse=False) -> None: ...


def _fwd_with(cache: object) -> object:
    def _flash_attn_fwd() -> None: ...

    _flash_attn_fwd.compile_cache = cache
    return _flash_attn_fwd


GUARD_REFUSALS = [
    ("another-version", "4.0.0b37", {}, r"flash-attn-4 4\.0\.0b37 is installed, .* against 4\.0\.0b36 only"),
    ("not-installed", None, {}, r"flash-attn-4 None is installed"),
    ("no-private-forward", FAST_LAUNCH_VERSION, {"_flash_attn_fwd": None}, r"lacks flash_attn_varlen_func or _flash"),
    ("public-lacks-keywords", FAST_LAUNCH_VERSION, {"flash_attn_varlen_func": _public_without_sinks},
     r"flash_attn_varlen_func takes no \['cu_seqlens_k'"),
    ("no-compile-cache", FAST_LAUNCH_VERSION, {"_flash_attn_fwd": _fwd_with(None)}, r"compile_cache is missing"),
    ("cache-without-protocol", FAST_LAUNCH_VERSION, {"_flash_attn_fwd": _fwd_with(frozenset())},
     r"compile_cache is missing"),
    ("sm90-kernel-reordered", FAST_LAUNCH_VERSION, {"FlashAttentionForwardSm90": _OtherKernel},
     r"FlashAttentionForwardSm90\.__call__ does not start with mQ, mK"),
    ("sm100-kernel-missing", FAST_LAUNCH_VERSION, {"FlashAttentionForwardSm100": None},
     r"FlashAttentionForwardSm100\.__call__ does not start with .* \(got None\)"),
]  # fmt: skip


def test_guard_accepts_the_pinned_version_with_its_private_pieces() -> None:
    fake = FakeFA4()
    private, why = check_fast_launch(FAST_LAUNCH_VERSION, fake.interface)
    assert private is not None and private.public is fake and private.fwd is fake.fwd
    assert why.startswith("FA4 fast launch: ") and FAST_LAUNCH_VERSION in why


@pytest.mark.parametrize(("version", "changes", "match"), [r[1:] for r in GUARD_REFUSALS],
                         ids=[r[0] for r in GUARD_REFUSALS])  # fmt: skip
def test_guard_refuses_and_says_why(version: str | None, changes: dict, match: str) -> None:
    private, why = check_fast_launch(version, _interface(**changes))
    assert private is None
    assert why.startswith("FA4 fast launch off: ")
    assert re.search(match, why), why


def test_without_fa4_the_fast_launch_is_off_and_says_fa4_is_missing() -> None:
    if fa4.get_fa4() is not None:
        pytest.skip("FA4 is installed here")
    private, why = fa4.fast_launch_support()
    assert private is None and why.startswith("FA4 fast launch off: FA4 (flash-attn-cute) is not importable")


# -- one form: resolve once, launch many ---------------------------------------------------------------


def _paged_inputs(seed: int, heads: int = 4, kv_heads: int = 2, d: int = 16, page: int = 4) -> dict:
    g = torch.Generator().manual_seed(seed)
    lens = [5, 0, 7]
    cu = torch.tensor([0, 5, 5, 12], dtype=torch.int32)
    return {
        "q": torch.randn(12, heads, d, generator=g).bfloat16(),
        "kc": torch.randn(8, page, kv_heads, d, generator=g).bfloat16(),
        "vc": torch.randn(8, page, kv_heads, d, generator=g).bfloat16(),
        "sinks": torch.randn(heads, generator=g),
        "cu": cu,
        "k_len": torch.tensor([9, 3, 7], dtype=torch.int32),  # prefix 4, 3, 0 and the new tokens
        "table": torch.tensor([[3, 5, 0], [1, 0, 0], [6, 2, 0]], dtype=torch.int32),
        "lens": lens,
    }


def _form(fake: FakeFA4, x: dict, **over: object) -> FA4Launch:
    private, _ = check_fast_launch(FAST_LAUNCH_VERSION, fake.interface)
    kw = dict(cu_q=x["cu"], cu_k=None, k_len=x["k_len"], page_table=x["table"], scale=0.25, causal=True,
              window_left=-1, return_lse=True, sinks=True) | over  # fmt: skip
    return FA4Launch(private, **kw)


def test_a_form_resolves_once_then_launches_its_kernel_directly_with_the_public_bits() -> None:
    fake = FakeFA4()
    form = _form(fake, _paged_inputs(0))
    for layer in range(4):  # each layer its own q, cache and sinks, the plan's metadata
        x = _paged_inputs(layer)
        calls, launches = len(fake.calls), fake.launches
        out, lse = form(x["q"], x["kc"], x["vc"], x["sinks"])
        assert fake.launches == launches + 1
        assert len(fake.calls) == calls + (layer == 0), layer  # only the first call is public
        want = fake(x["q"], x["kc"], x["vc"], cu_seqlens_q=x["cu"], seqused_k=x["k_len"], page_table=x["table"],
                    softmax_scale=0.25, causal=True, learnable_sink=x["sinks"], return_lse=True)  # fmt: skip
        assert torch.equal(out, want[0]) and torch.equal(lse, want[1]), layer
        assert out.abs().sum() > 0 and torch.isfinite(lse).all()
    assert form.resolved and form.off is None and (form.public_calls, form.fast_calls) == (1, 3)
    assert len(fake.compiled) == 1


def test_an_observed_call_puts_fa4s_compile_cache_back() -> None:
    fake = FakeFA4()
    cache = fake.fwd.compile_cache
    form = _form(fake, _paged_inputs(0))
    x = _paged_inputs(0)
    form(x["q"], x["kc"], x["vc"], x["sinks"])
    assert fake.fwd.compile_cache is cache
    bad = _form(fake, x, page_table=torch.full_like(x["table"], 99))  # FA4 refuses pages outside the cache
    with pytest.raises(AssertionError):
        bad(x["q"], x["kc"], x["vc"], x["sinks"])
    assert fake.fwd.compile_cache is cache


def _misfits(x: dict) -> list[tuple[str, tuple]]:
    q_wide = torch.cat([x["q"], x["q"]], dim=1)[:, : x["q"].shape[1]]  # other strides
    q_off = torch.cat([x["q"].flatten(), x["q"].flatten()[:1]])[1:].view_as(x["q"])  # 2-byte offset: misaligned
    return [
        ("q-strides", (q_wide, x["kc"], x["vc"], x["sinks"])),
        ("q-misaligned", (q_off, x["kc"], x["vc"], x["sinks"])),
        ("cache-other-pages", (x["q"], x["kc"][:7], x["vc"][:7], x["sinks"])),
        ("q-other-dtype", (x["q"].half(), x["kc"].half(), x["vc"].half(), x["sinks"])),
        ("no-sinks", (x["q"], x["kc"], x["vc"], None)),
        ("sinks-other-heads", (x["q"], x["kc"], x["vc"], x["sinks"][:2])),
        ("q-requires-grad", (x["q"].clone().requires_grad_(), x["kc"], x["vc"], x["sinks"])),
    ]


@pytest.mark.parametrize("which", [m[0] for m in _misfits(_paged_inputs(0))])
def test_a_call_that_does_not_fit_the_resolved_form_takes_the_public_path(which: str) -> None:
    fake = FakeFA4()
    x = _paged_inputs(1)
    form = _form(fake, x)
    form(x["q"], x["kc"], x["vc"], x["sinks"])  # resolves
    args = dict(_misfits(x))[which]
    calls = len(fake.calls)
    if which == "sinks-other-heads":
        with pytest.raises(AssertionError):  # the public function refuses it, as FA4 does
            form(*args)
        return
    out, _ = form(*args)
    assert len(fake.calls) == calls + 1 and form.fast_calls == 0
    sinks = None if args[3] is None else args[3]
    want = fake(*args[:3], cu_seqlens_q=x["cu"], seqused_k=x["k_len"], page_table=x["table"], softmax_scale=0.25,
                causal=True, learnable_sink=sinks, return_lse=True)[0]  # fmt: skip
    assert torch.equal(out, want)
    form(x["q"], x["kc"], x["vc"], x["sinks"])  # the resolved form still launches directly
    assert form.fast_calls == 1


def test_a_form_resolved_by_a_call_with_grad_returns_no_lse_where_none_was_asked() -> None:
    """FA4 computes the LSE for an input that requires grad; a form resolved by such a call keeps
    that LSE, and ``fa4_paged(return_lse=False)`` still returns none."""
    fake = FakeFA4()
    private, _ = check_fast_launch(FAST_LAUNCH_VERSION, fake.interface)
    launches = FA4Launches()
    plan = _paged_inputs(0)  # the plan's tensors, the same object every layer
    for layer in range(3):  # the first call, with grad, takes the public path and resolves the form
        x = _paged_inputs(layer)
        q = x["q"].clone().requires_grad_(layer == 0)
        out, lse = fa4.fa4_paged(
            q, x["kc"], x["vc"], plan["table"], plan["cu"], plan["k_len"], causal=True, window_left=-1,
            sinks=x["sinks"], scale=0.25, return_lse=False, fn=fake, launches=launches, private=private,
        )  # fmt: skip
        assert lse is None and out.shape == q.shape, layer
    assert len(launches.forms) == 1 and launches.forms[0].fast_calls == 2


class _CopyingFA4(FakeFA4):
    """A FA4 whose public function hands its kernel a copy of q (as FA4 does for a misaligned q)."""

    def __call__(self, q: torch.Tensor, *args: object, **kwargs: object) -> tuple:
        return super().__call__(q.clone(), *args, **kwargs)


class _TwoKernelFA4(FakeFA4):
    """A FA4 that launches two kernels in one call (as a split-KV call with its combine would)."""

    def __call__(self, *args: object, **kwargs: object) -> tuple:
        super().__call__(*args, **kwargs)
        return super().__call__(*args, **kwargs)


for _fake in (_CopyingFA4, _TwoKernelFA4):  # FA4's public signature, which the guard reads
    _fake.__call__.__signature__ = inspect.signature(FakeFA4.__call__)


@pytest.mark.parametrize(
    ("fake_type", "match"),
    [(_CopyingFA4, "argument mQ is not the call's tensor"), (_TwoKernelFA4, "FA4 called 2 compiled kernels")],
    ids=["fa4-copies-q", "two-kernels"],
)
def test_resolve_refuses_a_call_whose_kernel_arguments_are_not_the_expected_ones(fake_type: type, match: str) -> None:
    fake = fake_type()
    x = _paged_inputs(2)
    form = _form(fake, x)
    first = form(x["q"], x["kc"], x["vc"], x["sinks"])
    again = form(x["q"], x["kc"], x["vc"], x["sinks"])
    assert not form.resolved and match in form.off
    assert form.public_calls == 2 and form.fast_calls == 0 and torch.equal(first[0], again[0])


def test_a_call_fa4_answers_without_a_kernel_never_resolves() -> None:
    fake = FakeFA4()
    x = _paged_inputs(3)
    empty = x["kc"][:0]  # no key anywhere: FA4 returns zeros without a kernel
    form = _form(fake, x, page_table=None, cu_k=x["cu"], k_len=None)
    out, _ = form(x["q"], empty.flatten(0, 1), empty.flatten(0, 1), x["sinks"])
    assert not form.resolved and "0 compiled kernels" in form.off and not out.any()


def test_a_plan_keeps_one_launch_per_call_form_and_at_most_max_forms() -> None:
    fake = FakeFA4()
    private, _ = check_fast_launch(FAST_LAUNCH_VERSION, fake.interface)
    x = _paged_inputs(0)
    launches = FA4Launches()
    base = dict(cu_q=x["cu"], cu_k=None, k_len=x["k_len"], page_table=x["table"], scale=0.25, causal=True,
                window_left=-1, return_lse=False, sinks=True)  # fmt: skip
    first = launches.get(private, **base)
    assert launches.get(private, **base) is first
    assert launches.get(private, **base | {"k_len": x["k_len"].clone()}) is not first  # identity, not values
    for w in range(FA4Launches.MAX_FORMS):
        launches.get(private, **base | {"window_left": w})
    assert len(launches.forms) == FA4Launches.MAX_FORMS and launches.get(private, **base | {"scale": 0.5}) is None


# -- through the Runtime ------------------------------------------------------------------------------------


def _layers(rt: Runtime, plan: object, case: dict, in_cache: bool, window: int, layers: int,
            device: str = "cpu") -> list:  # fmt: skip
    """``layers`` calls of one plan, each layer with its own q, k, v, cache and sinks (the plan's
    lengths and one block table object, as an engine passes them); tensors built on the CPU."""
    outs, table0 = [], None
    for layer in range(layers):
        g = torch.Generator().manual_seed(100 + layer)
        fresh = {n: torch.randn(case[n].shape, generator=g).to(case[n].dtype)
                 for n in ("q", "k", "v", "k_cache", "v_cache", "sinks")}  # fmt: skip
        step = case | fresh
        q, kv_new, cache, table, where = _rank_inputs(rt, plan, step, in_cache)
        table0 = table.to(device) if table0 is None else table0
        assert torch.equal(table, table0.cpu())

        def to(t: torch.Tensor) -> torch.Tensor:
            return t.to(device)

        out = rt.prefill(
            to(q), tuple(map(to, cache)), plan=plan, kv_new=None if kv_new is None else tuple(map(to, kv_new)),
            block_table=table0, sinks=to(step["sinks"]), window_left=window, check=False,
        )  # fmt: skip
        outs.append((out, where, step))
    return outs


@pytest.mark.parametrize("return_lse", [False, True])
def test_runtime_steady_state_launches_directly_and_matches_the_public_path_bit_for_bit(
    return_lse: bool, one_rank_group: dist.ProcessGroup
) -> None:
    """A one-rank head-TP Runtime, every call form (new keys given or in the cache, with and without
    a window): the plan's first call of a form is public, the next layers launch the kernel
    directly, and every output equals the public path's (a Runtime whose guard fails) bit for bit
    and the fp64 oracle within bf16's error."""
    case = make_step(3, [5, 0, 7], [4, 2, 0], window_left=3, dtype=torch.bfloat16)
    results = {}
    for version in (FAST_LAUNCH_VERSION, "4.0.0b37"):
        fake = FakeFA4()
        with fa4_stand_in(fake, version):
            rt = Runtime(spec_of(case, "bfloat16"), dist.group.WORLD, mode="headtp", max_batched_tokens=64,
                         prefill_options=PrefillOptions(return_lse=return_lse), warmup=False)  # fmt: skip
            assert ("fast launch off: flash-attn-4 4.0.0b37" in rt.gqa_prefill_route.reason) == (version != "4.0.0b36")
            plan = rt.plan_prefill(case["seq_lens"], case["prefix_lens"])
            public, launches = len(fake.calls), fake.launches
            for in_cache, window in itertools.product((False, True), (-1, 3)):
                results[version, in_cache, window] = _layers(rt, plan, case, in_cache, window, layers=3)
            forms = plan.gqa.launches.forms
            if version == FAST_LAUNCH_VERSION:
                # kv_new given over a prefix without a window: two calls (prefix, new keys); with a window the
                # prefix tail is copied per call (public); in the cache: one paged call
                assert len(fake.calls) - public == 2 + 3 + 1 + 1, len(fake.calls) - public
                assert all(f.resolved for f in forms) and sum(f.fast_calls for f in forms) == 2 * (2 + 1 + 1)
                assert fake.launches - launches == 3 * (2 + 1 + 1 + 1)
            else:
                assert not forms and len(fake.calls) - public == fake.launches - launches == 15
    for (version, in_cache, window), outs in results.items():
        if version != FAST_LAUNCH_VERSION:
            continue
        for (fast, where, step), (public, _, _) in zip(outs, results["4.0.0b37", in_cache, window]):
            assert torch.equal(fast[0], public[0]) and (fast[1] is None) != return_lse
            if return_lse:
                assert torch.equal(fast[1], public[1])
            out64 = oracle(step | {"window_left": window})[0]
            torch.testing.assert_close(fast[0].double(), out64[where], atol=3e-2, rtol=0)


def test_op_calls_without_a_plan_stay_public() -> None:
    """The single-GPU op and a kernel given no launches never observe or launch directly."""
    fake = FakeFA4()
    private, _ = check_fast_launch(FAST_LAUNCH_VERSION, fake.interface)
    kernel = FA4SegmentKernel(fake, private=private)
    x = _paged_inputs(4)
    for _ in range(2):
        kernel.paged(x["q"], x["kc"], x["vc"], x["table"], x["cu"], x["k_len"], causal=True, window_left=-1,
                     sinks=x["sinks"], scale=0.25, return_lse=False)  # fmt: skip
    assert len(fake.calls) == fake.launches == 2


# -- GPU: the fast launch against FA4's public function ----------------------------------------------------


@pytest.mark.gpu
def test_fast_launch_on_gpu_gives_the_public_paths_bits(one_rank_group: dist.ProcessGroup) -> None:
    """On FA4 itself: every call form of a Runtime step over three layers, the fast launch (after
    the plan's first call) against a Runtime whose kernel has the fast launch off, bit for bit."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    why = fa4.fa4_unsupported_reason("cuda", torch.bfloat16, 64)
    if why is not None:
        pytest.skip(why)
    private, why = fa4.fast_launch_support()
    if private is None:
        pytest.skip(why)
    case = make_step(7, [130, 0, 257, 64], [70, 128, 0, 5], hq=8, hkv=1, d=64, page=64, dtype=torch.bfloat16)
    for return_lse in (False, True):
        runtimes = [
            Runtime(spec_of(case, "bfloat16"), dist.group.WORLD, mode="headtp", max_batched_tokens=1024,
                    device="cuda", prefill_options=PrefillOptions(return_lse=return_lse))
            for _ in range(2)
        ]  # fmt: skip
        fast_rt, public_rt = runtimes
        assert "FA4 fast launch: " in fast_rt.gqa_prefill_route.reason, fast_rt.gqa_prefill_route.reason
        public_rt.__dict__["gqa_kernel"] = FA4SegmentKernel()  # the same adapter, the fast launch off
        plans = [rt.plan_prefill(case["seq_lens"], case["prefix_lens"]) for rt in runtimes]
        for in_cache, window in itertools.product((False, True), (-1, 20)):
            fast, public = (_layers(rt, p, case, in_cache, window, 3, "cuda") for rt, p in zip(runtimes, plans))
            for layer, ((a, _, _), (b, _, _)) in enumerate(zip(fast, public)):
                assert torch.equal(a[0], b[0]), (return_lse, in_cache, window, layer)
                assert (a[1] is None) != return_lse and (not return_lse or torch.equal(a[1], b[1]))
        assert sum(f.fast_calls for f in plans[0].gqa.launches.forms) == 2 * (2 + 1 + 1)
        assert not plans[1].gqa.launches.forms


def test_head_dim_256_on_sm100_is_not_routed_to_fa4() -> None:
    """FA4's SM100 kernel for head_dim 256 asserts no sinks, no ``seqused_k``, no window and 128-token
    pages, which every paged, prefix and PCP call here breaks: the reason says so (it routed there
    and failed inside FA4 with an AssertionError). SM90 runs 256."""
    from shardattn.kernels.fa4 import _head_dim_reason

    assert _head_dim_reason(256, 10) == "FA4 on SM100 runs this library's calls at head_dim 8..128, got 256"
    assert _head_dim_reason(128, 10) is None and _head_dim_reason(256, 9) is None
