"""Host time of one ``Runtime.prefill`` call of a GQA model, FA4 replaced by a stand-in that does nothing.

What it isolates: the library's own Python per layer on the plan-reused path (checks, the step,
the adapter, the FA4 launch path), on a CPU, without a GPU or FA4. The stand-in (:class:`NoopFA4`)
has FA4's public signature and its private pieces as the fast launch's guard reads them
(``_flash_attn_fwd.compile_cache``, the kernel classes' call signature), but no Python of its own:
a public call allocates the output (and LSE), looks its kernel up and calls it; the kernel returns
at once. So:

* ``fast launch``: the Runtime's FA4 calls after the plan's first (the compiled kernel called directly,
  :mod:`shardattn.kernels.fa4_launch`);
* ``public``: the guard fails (another FA4 version), every call goes through the public function:
  with the real FA4 that adds FA4's own wrapper (about 50 us per call on this kind of host, see
  :mod:`shardattn.kernels.fa4_launch`), which the stand-in does not have.

Rows: a one-rank ``headtp`` Runtime with a TP rank's shapes (``--tp``: 64 / 8 heads at TP 1, 8 / 1 at
TP 8; head_dim 64, bf16, sinks, no LSE), 16 requests of 2,048 new tokens (``16x2K``) and 4 of
8,192 (``4x8K``), the new keys given (``kv_new=(k, v)``) or already in the paged cache after a
2,048-token prefix (``kv_new=None``: one paged call). Each row: the median over ``--iters`` calls
of the wall time of one call, after ``--warmup`` calls (the plan's first call, the resolving one,
among them). CPU tensors: the block table's values are checked on the host (a GPU run skips that
check), which the paged rows include.

    python benchmarks/gqa_prefill_host.py --json gqa_prefill_host.json
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
import types
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from records import add_json_argument, environment, print_table, record, write_json

from shardattn.kernels import fa4
from shardattn.kernels.fa4_launch import FAST_LAUNCH_VERSION, check_fast_launch
from shardattn.plan.spec import ModelSpec
from shardattn.runtime.options import PrefillOptions
from shardattn.runtime.runtime import Runtime


class NoopKernel:
    """A compiled FA4 forward kernel's call signature (``FlashAttentionForwardSm90.__call__``); does nothing."""

    def __call__(
        self, mQ: object, mK: object, mV: object, mO: object, mLSE: object, softmax_scale: object,
        mCuSeqlensQ: object = None, mCuSeqlensK: object = None, mSeqUsedQ: object = None, mSeqUsedK: object = None,
        mPageTable: object = None, window_size_left: object = None, window_size_right: object = None,
        learnable_sink: object = None, *rest: object,
    ) -> None:  # fmt: skip
        return None


class NoopFA4:
    """``flash_attn_varlen_func`` with no Python of its own (module docstring); ``interface`` passes
    the fast launch's guard."""

    def __init__(self) -> None:
        def _flash_attn_fwd() -> None:
            raise AssertionError("never called")

        _flash_attn_fwd.compile_cache = {"kernel": NoopKernel()}
        self.fwd = _flash_attn_fwd
        self.interface = types.SimpleNamespace(
            flash_attn_varlen_func=self, _flash_attn_fwd=_flash_attn_fwd, FlashAttentionForwardSm90=NoopKernel,
            FlashAttentionForwardSm100=NoopKernel,
        )  # fmt: skip

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, cu_seqlens_q: torch.Tensor,
        cu_seqlens_k: torch.Tensor | None = None, seqused_k: torch.Tensor | None = None,
        page_table: torch.Tensor | None = None, softmax_scale: float | None = None, causal: bool = False,
        window_size: tuple = (None, None), learnable_sink: torch.Tensor | None = None, return_lse: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
        out = torch.empty(*q.shape[:2], v.shape[-1], dtype=q.dtype, device=q.device)
        lse = torch.empty(q.shape[1], q.shape[0], dtype=torch.float32, device=q.device) if return_lse else None
        self.fwd.compile_cache["kernel"](
            q, k, v, out, lse, softmax_scale, cu_seqlens_q, cu_seqlens_k, None, seqused_k, page_table,
            window_size[0], 0 if causal else window_size[1], learnable_sink, None, None, None, None,
        )  # fmt: skip
        return out, lse


@contextlib.contextmanager
def noop_fa4(version: str) -> Iterator[NoopFA4]:
    """Route the Runtime's GQA prefill to FA4 on the CPU, FA4 being a :class:`NoopFA4` of ``version``."""
    stub = NoopFA4()
    with (
        mock.patch.object(fa4, "fa4_unsupported_reason", lambda *a: None),
        mock.patch.object(fa4, "get_fa4", lambda: stub),
        mock.patch.object(fa4, "fast_launch_support", lambda: check_fast_launch(version, stub.interface)),
    ):
        yield stub


def host_us(tp: int, requests: int, new: int, cached: int, fast: bool, args: argparse.Namespace) -> tuple[float, str]:
    """``(median us per call, the route's reason)`` of one row (module docstring)."""
    heads, kv_heads, dim, page = 64 // tp, max(1, 8 // tp), 64, 64
    with noop_fa4(FAST_LAUNCH_VERSION if fast else "another version"):
        spec = ModelSpec("gqa", heads, kv_heads, dim, dim, 0, page, has_sinks=True, dtype="bfloat16",
                         softmax_scale=dim**-0.5)  # fmt: skip
        rt = Runtime(spec, dist.group.WORLD, mode="headtp", max_batched_tokens=requests * new,
                     prefill_options=PrefillOptions(return_lse=False))  # fmt: skip
        plan = rt.plan_prefill([new] * requests, [cached] * requests)
        total = requests * new
        q = torch.empty(total, heads, dim, dtype=torch.bfloat16)
        sinks = torch.zeros(heads)
        if cached:
            pages = -(-(cached + new) // page)
            cache = torch.empty(requests * pages, page, kv_heads, dim, dtype=torch.bfloat16)
            table = torch.arange(requests * pages, dtype=torch.int32).view(requests, pages)
            call = dict(kv_cache=(cache, cache), kv_new=None, block_table=table)
        else:
            k = torch.empty(total, kv_heads, dim, dtype=torch.bfloat16)
            call = dict(kv_cache=None, kv_new=(k, k))
        for _ in range(args.warmup):
            rt.prefill(q, plan=plan, sinks=sinks, check=False, **call)
        times = []
        for _ in range(args.iters):
            t0 = time.perf_counter()
            rt.prefill(q, plan=plan, sinks=sinks, check=False, **call)
            times.append(time.perf_counter() - t0)
        return statistics.median(times) * 1e6, plan.route.reason


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 8], help="head-TP sizes whose rank shapes are timed")
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--warmup", type=int, default=50)
    add_json_argument(ap)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    env = environment()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    records, reasons = [], set()
    try:
        for tp in args.tp:
            for case, requests, new in (("16x2K", 16, 2048), ("4x8K", 4, 8192)):
                for keys, cached in (("new keys given", 0), ("keys in the cache, 2K prefix", 2048)):
                    config = {"case": case, "tp": tp, "keys": keys}
                    public, why_public = host_us(tp, requests, new, cached, False, args)
                    fast, why_fast = host_us(tp, requests, new, cached, True, args)
                    reasons |= {why_public, why_fast}
                    base = ("public FA4 path (stand-in), same run", public)
                    records.append(record("gqa-prefill-host", config, "Runtime.prefill host us, fast launch", fast,
                                          "us", "lower", base, env))  # fmt: skip
                    records.append(record("gqa-prefill-host", config, "Runtime.prefill host us, public path", public,
                                          "us", "lower", None, env))  # fmt: skip
    finally:
        dist.destroy_process_group()
    for why in sorted(reasons):
        print(f"route: {why}")
    print_table(records, "Runtime.prefill host time per call, FA4 a no-op stand-in (CPU)")
    write_json(args.json, records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
