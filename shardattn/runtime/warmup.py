"""Warm-up of the sparse-prefill Triton kernels: every compile key the runtime can hit, up front.

:func:`compile_keys` lists, for a :class:`PrefillSpec`, each kernel variant a step can launch:
the top-k conversion, the union build and the attention kernel, on both sides of the routing
threshold (grouped ``G > 1`` for KV caches below ``2**24 - 1`` rows, per-query ``G = 1`` above,
which is also the explicit ``group_size=1`` path; on sm_90 either side runs the Gluon kernel
for the ``(heads, G)`` the routing sends there, key ``gluon_attention``, and a default step takes
the grouped Gluon kernel's ``G``). :func:`warmup` compiles them all by running
each launcher once on tiny inputs with the runtime's layouts; run-time sizes (token count, KV
rows, block-table width) are not specialised by the kernels (``do_not_specialize``), so later
calls of any size compile nothing. :func:`compiled_variants` counts what a kernel has compiled,
for tests.

Example:
    >>> keys = compile_keys(PrefillSpec(heads=8, topk=2048))
    >>> sorted({k.kernel for k in keys} - {"gluon_attention", "union_smem"})  # Gluon keys where Triton has Gluon
    ... # doctest: +NORMALIZE_WHITESPACE
    ['attention', 'convert_topk', 'pack_rows', 'union_bitmap', 'union_compact', 'union_fused', 'union_keys',
     'unique_rows']
    >>> sorted(k.params["G"] for k in keys if k.kernel == "attention")
    [1, 8]
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from shardattn.kernels import fa4_warmup
from shardattn.kernels.gluon.sparse_mla import gluon_config
from shardattn.kernels.gluon.union_smem import HAS_GLUON, WINDOWS, smem_unsupported_reason
from shardattn.kernels.gluon.union_smem import launch_config as smem_launch_config
from shardattn.kernels.triton.pack_rows import pack_rows, pack_rows_block
from shardattn.kernels.triton.sparse_mla import tile_config
from shardattn.kernels.triton.topk import convert_topk_config
from shardattn.kernels.triton.union import union_launch_config
from shardattn.kernels.triton.union_bitmap import bitmap_launch_config
from shardattn.kernels.triton.union_fused import fused_launch_config
from shardattn.kernels.triton.unique_rows import unique_rows_config
from shardattn.ops.dispatch import default_group_size
from shardattn.ops.gqa_prefill import fa4_variants
from shardattn.ops.topk import DcpShard
from shardattn.ops.union import UNION_METHOD
from shardattn.parallel.gqa_head_tp import head_tp_kv_heads
from shardattn.plan.kv_format import KV_FP8_DS_MLA
from shardattn.plan.routing import Route, gluon_grouped_group_size, prefill_group_size
from shardattn.runtime.decode_warmup import warm_up_decode
from shardattn.runtime.modes import GQA_BACKEND, PREFILL_STEP, prefill_step_of
from shardattn.runtime.state import RuntimeState


@dataclass(frozen=True)
class PrefillSpec:
    """What a runtime's sparse-prefill steps look like (one spec per layer shape).

    Attributes:
        heads: query heads per rank. topk: ``K``. dtype: q / KV dtype.
        v_dim, rope_dim: head dims (512 + 64 for DSA models).
        group_size: ``group_size`` the runtime passes (None = :func:`default_group_size`).
        sinks: runtime calls pass sinks. topk_length: runtime calls pass ``topk_length``.
        seq_lens, dcp: flags of the runtime's :func:`convert_topk` calls.
        kv_fp8: the KV rows are ``fp8_ds_mla`` (the kernels' FP8 variants).
    """

    heads: int
    topk: int
    dtype: torch.dtype = torch.bfloat16
    v_dim: int = 512
    rope_dim: int = 64
    group_size: int | None = None
    sinks: bool = False
    topk_length: bool = False
    seq_lens: bool = True
    dcp: bool = False
    kv_fp8: bool = False


@dataclass(frozen=True)
class CompileKey:
    """One kernel variant: the kernel's name and its compile-time parameters."""

    kernel: str
    params: dict = field(hash=False, compare=True)


def spec_group_sizes(spec: PrefillSpec) -> list[int]:
    """Group sizes a step with this spec can take: 1, the given or default ``G`` and, where the
    grouped Gluon kernel is routed (:func:`gluon_route`), its ``G`` for ``group_size=None``."""
    groups = {1, default_group_size(spec.heads) if spec.group_size is None else spec.group_size}
    g_gluon = gluon_grouped_group_size(spec.heads)
    if spec.group_size is None and g_gluon is not None and gluon_route(spec, g_gluon):
        groups.add(g_gluon)
    return sorted(groups)


def compile_keys(spec: PrefillSpec) -> list[CompileKey]:
    """Every kernel variant a step with this spec can launch (grouped and per-query sides)."""
    keys = [CompileKey("convert_topk", convert_topk_config(spec.topk, spec.seq_lens, spec.topk_length, spec.dcp))]
    for group in spec_group_sizes(spec):
        cfg = union_launch_config(group, spec.topk)
        # the union build: the bitmap builder (KV caches small enough for its count) or the sorting
        # builder of UNION_METHOD (larger ones): the cache size is a run-time value, so both
        bitmap = {"G": group, **bitmap_launch_config(group, spec.topk), "HAS_LEN": spec.topk_length}
        keys.append(CompileKey("union_bitmap", bitmap))
        if HAS_GLUON:  # on sm_90 the bitmap runs in shared memory: one key per window
            for window in WINDOWS:
                smem = {"G": group, **smem_launch_config(group, spec.topk, 32 * window), "HAS_LEN": spec.topk_length}
                smem.pop("per_sm")
                keys.append(CompileKey("union_smem", smem))
                if spec.kv_fp8:  # marking the blocks the FP8 staging dequantises (ops.kv_fp8_stage)
                    keys.append(CompileKey("union_smem", {**smem, "HAS_MARKS": True}))
        if group == 1 and not spec.kv_fp8:  # each query's valid rows packed (topk_unique; or after the hash
            # de-duplication, which a cache too large for the bitmap takes: a run-time value, so both)
            keys.append(CompileKey("pack_rows", {"BLOCK": pack_rows_block(spec.topk), "HAS_LEN": spec.topk_length}))
            unique = {"BLOCK": unique_rows_config(spec.topk)["BLOCK"], "HAS_LEN": spec.topk_length, "PDL": False}
            keys.append(CompileKey("unique_rows", unique))
        if group == 1 or UNION_METHOD[group] == "sort":
            keys.append(CompileKey("union_keys", {"G": group, "BLOCK_K": cfg["BLOCK_K"], "HAS_LEN": spec.topk_length}))
            keys.append(CompileKey("union_compact", {"G": group, "CHUNK": cfg["CHUNK"]}))
        else:  # "fused": the row sort's keys (the G = 1 keys kernel), then one launch
            row_cfg = union_launch_config(1, spec.topk)
            keys.append(CompileKey("union_keys", {"G": 1, "BLOCK_K": row_cfg["BLOCK_K"], "HAS_LEN": spec.topk_length}))
            keys.append(CompileKey("union_fused", {**fused_launch_config(group, spec.topk), "HAS_LEN": False}))
        # FP8 rows: the kernels' FP8 variants (rows dequantised in the kernel) and, on staged rows
        # (ops.kv_fp8_stage), the dense ones after the staging kernels
        kv_variants = (True, False) if spec.kv_fp8 else (False,)
        if spec.kv_fp8:
            keys.append(CompileKey("stage_mark", {"G1": group == 1}))
            keys.append(CompileKey("stage_remap", {"G1": group == 1}))
        if gluon_route(spec, group):
            gluon_tile = gluon_config(spec.heads, spec.v_dim, spec.rope_dim, group)
            params = {"config": gluon_tile.label, "G": group, "HAS_SINK": spec.sinks, "dtype": spec.dtype}
            keys.extend(CompileKey("gluon_attention", {**params, "KV_FP8": fp8}) for fp8 in kv_variants)
        tile = tile_config(spec.heads, group)
        params = {
            "G": group,
            "BLOCK_H": tile.block_h,
            "BLOCK_N": tile.block_n,
            "D_V": spec.v_dim,
            "D_R": spec.rope_dim,
            "HAS_SINK": spec.sinks,
            "num_warps": tile.num_warps,
            "num_stages": tile.num_stages,
            "dtype": spec.dtype,
        }
        keys.extend(CompileKey("attention", {**params, "KV_FP8": fp8}) for fp8 in kv_variants)
    if spec.kv_fp8:  # the buffer mirrors the cache, or packs the touched blocks (counted from the top-k
        # lists, which are moved to their places there before the union is built over them)
        keys.extend(CompileKey("stage_blocks", {"dtype": spec.dtype, "PACKED": packed}) for packed in (False, True))
        keys.append(CompileKey("stage_list", {}))
        keys.append(CompileKey("stage_mark_topk", {"HAS_LENS": spec.topk_length}))
        keys.append(CompileKey("stage_move_rows", {"HAS_LENS": spec.topk_length}))
    return keys


def gluon_route(spec: PrefillSpec, group_size: int = 1) -> bool:
    """``True`` when ``spec``'s steps of ``group_size`` queries per tile run the Gluon kernel on an sm_90 GPU.

    That is: this Triton ships Gluon, the head dims are DSA's and the routing's measured
    crossovers (:func:`shardattn.plan.routing.route_prefill_kernel`) send ``(heads, G)`` there.
    """
    from shardattn.kernels.gluon.sparse_mla import gluon_available
    from shardattn.plan.routing import route_prefill_kernel

    dims_ok = (spec.v_dim, spec.rope_dim) == (512, 64) and spec.dtype in (torch.bfloat16, torch.float16)
    dims_ok = dims_ok and (not spec.kv_fp8 or spec.dtype == torch.bfloat16)  # FP8 rows dequantise to bf16
    if not gluon_available() or not dims_ok:
        return False
    return route_prefill_kernel(spec.heads, sm=90, group_size=group_size).path == "gluon"


def compiled_variants(kernel) -> int:
    """Number of compiled variants a Triton ``JITFunction`` holds (all devices)."""
    caches = getattr(kernel, "device_caches", None)
    if caches is not None:
        return sum(len(entry[0]) for entry in caches.values())
    return sum(len(c) for c in getattr(kernel, "cache", {}).values())


def warmup(device: torch.device | str, *specs: PrefillSpec) -> int:
    """Compile every key of :func:`compile_keys` for each spec on ``device``.

    Returns:
        The number of kernel launches made (one per key).
    """
    from shardattn.ops.kv_fp8 import dequantize_kv, quantize_kv
    from shardattn.ops.kv_fp8_stage import LAYOUTS as STAGE_LAYOUTS
    from shardattn.ops.kv_fp8_stage import STAGE_BLOCK_ROWS, stage_fp8_union
    from shardattn.ops.sparse_mla_grouped import sparse_mla_grouped_prefill
    from shardattn.ops.topk import DcpShard, convert_topk
    from shardattn.ops.touched_blocks import moved_rows, touched_blocks
    from shardattn.ops.union import build_union
    from shardattn.ops.unique_rows import unique_rows

    device = torch.device(device)
    launches = 0
    for spec in specs:
        t, k = 16, spec.topk
        gen = torch.Generator(device="cpu").manual_seed(0)
        pos = torch.randint(-1, 64, (t, k), generator=gen, dtype=torch.int32).to(device)
        req = torch.zeros(t, dtype=torch.int32, device=device)
        table = torch.arange(4, dtype=torch.int32, device=device)[None, :].contiguous()
        convert_topk(
            pos, req, table, block_size=16,
            seq_lens=torch.full((1,), 64, dtype=torch.int32, device=device) if spec.seq_lens else None,
            topk_length=torch.full((t,), k, dtype=torch.int32, device=device) if spec.topk_length else None,
            dcp=DcpShard(1, 1, 0) if spec.dcp else None,
        )  # fmt: skip
        launches += 1
        d = spec.v_dim + spec.rope_dim
        q = torch.randn(t, spec.heads, d, generator=gen).to(device=device, dtype=spec.dtype)
        kv = torch.randn(64, d, generator=gen).to(device=device, dtype=spec.dtype)
        if spec.kv_fp8:
            kv = quantize_kv(kv)
        length = torch.full((t,), k, dtype=torch.int32, device=device) if spec.topk_length else None
        if spec.kv_fp8:  # the packed layout's blocks, marked and counted from the top-k lists, the rows moved
            moved_rows(pos, length, touched_blocks(pos, length, num_rows=kv.shape[0]), num_rows=kv.shape[0])
            launches += 3
        for group in spec_group_sizes(spec):
            for rows_kv in (kv, dequantize_kv(kv, spec.dtype)) if spec.kv_fp8 else (kv,):  # FP8: staged rows too
                sparse_mla_grouped_prefill(
                    q, rows_kv, pos, scale=d**-0.5, v_dim=spec.v_dim, group_size=group, topk_length=length,
                    sinks=torch.zeros(spec.heads, device=device) if spec.sinks else None,
                )  # fmt: skip
            if group == 1 and not spec.kv_fp8:  # a topk_unique step packs its rows (then the kernel above); on
                # a cache too large for the bitmap each query's repeats are dropped by hash first
                pack_rows(unique_rows(pos, num_kv_rows=kv.shape[0], topk_length=length), num_kv_rows=kv.shape[0],
                          width=k, topk_length=length)  # fmt: skip
                launches += 2
            if spec.kv_fp8:  # the staging kernels (ops.kv_fp8_stage) in both layouts, whatever the rule says here
                union, lens = build_union(pos, group_size=group, num_kv_rows=64, topk_length=length)
                for layout in STAGE_LAYOUTS:
                    stage_fp8_union(kv, union, lens, group_size=group, dtype=spec.dtype, layout=layout)
                launches += 6
            # the step above built its union with the bitmap builder (64 KV rows); a large cache
            # takes the sorting builder instead, and on sm_90 the shared-memory bitmap's wider window
            build_union(pos, group_size=group, num_kv_rows=64, topk_length=length, method=UNION_METHOD[group])
            launches += 4
            if smem_unsupported_reason(pos, group) is None:
                build_union(pos, group_size=group, num_kv_rows=32 * WINDOWS[-1], topk_length=length, method="bitmap")
                launches += 1
                if spec.kv_fp8:  # the shared-memory build that also marks the staged blocks, both windows
                    for rows in (64, 32 * WINDOWS[-1]):
                        marks = torch.zeros(-(-rows // STAGE_BLOCK_ROWS), dtype=torch.int32, device=device)
                        build_union(pos, group_size=group, num_kv_rows=rows, topk_length=length, method="bitmap",
                                    block_marks=marks)  # fmt: skip
                    launches += 2
    return launches


class RuntimeWarmup(RuntimeState):
    """The warm-up of a Runtime (mixed into it; it reads the Runtime's config and routes): every
    kernel variant its routes can launch, compiled at construction so that no step compiles."""

    def prefill_specs(self) -> list[PrefillSpec]:
        """Kernel shapes this Runtime's prefill routes can launch: every head count its steps run
        (ShardQ / PCP: all heads; head-TP and ShardQ below its gate: ``H / W``), each with the
        route's group size (grouped) and 1 (per-query: small steps, caches past ``2**24 - 1`` rows),
        with and without ``topk_length``."""
        step = PREFILL_STEP[self.mode]
        if self.spec.kind != "sparse_mla" or step is None:
            return []
        heads = {self.heads_per_rank}
        if step == "pcp" or (step == "shardq" and self.ws.shardq_possible):
            heads.add(self.spec.num_heads)
        return [
            PrefillSpec(
                heads=h,
                topk=self.topk,
                dtype=self.dtype,
                v_dim=self.spec.v_dim,
                rope_dim=self.spec.head_dim - self.spec.v_dim,
                group_size=prefill_group_size(h, gluon=self.gluon) or 1,
                sinks=self.spec.has_sinks,
                topk_length=with_len,
                kv_fp8=self.kv_format == KV_FP8_DS_MLA,
            )
            for h in sorted(heads)
            for with_len in (False, True)
        ]

    def route_keys(self, route: Route, heads: int, *, topk_length: bool = False) -> set[CompileKey]:
        """The kernel variants a prefill kernel call on ``route`` with ``heads`` heads launches."""
        spec = PrefillSpec(
            heads=heads,
            topk=self.topk,
            dtype=self.dtype,
            v_dim=self.spec.v_dim,
            rope_dim=self.spec.head_dim - self.spec.v_dim,
            group_size=route.group_size,
            sinks=self.spec.has_sinks,
            topk_length=topk_length,
            kv_fp8=self.kv_format == KV_FP8_DS_MLA,
        )
        return {k for k in compile_keys(spec) if k.kernel == "convert_topk" or k.params.get("G") == route.group_size}

    def gqa_prefill_variants(self) -> list[fa4_warmup.FA4Variant]:
        """The FA4 compile keys this Runtime's GQA prefill calls can meet (empty off the FA4 route):
        the rank's heads and KV heads of its step (head-TP ``H/W`` over its KV heads, PCP all),
        every call form (:func:`~shardattn.ops.gqa_prefill.fa4_variants`: new keys given or in the
        cache, a prefix split or copied, with and without a window), up to ``max_batched_tokens``
        segments (PCP: twice that, a rank's runs)."""
        step = prefill_step_of(self.spec.kind, self.mode)
        if self.spec.kind != "gqa" or step is None or self.gqa_prefill_route.path != "fa4":
            return []
        if step == "pcp":
            heads, kv_heads, segments = self.spec.num_heads, self.spec.num_kv_heads, 2 * self.max_batched_tokens
        else:
            lo, hi = head_tp_kv_heads(self.spec.num_heads, self.spec.num_kv_heads, self.world_size, self.rank)
            heads, kv_heads, segments = self.heads_per_rank, hi - lo, self.max_batched_tokens
        return fa4_variants(
            dtype=self.dtype, num_heads=heads, num_kv_heads=kv_heads, head_dim=self.spec.head_dim,
            sinks=self.spec.has_sinks, page_size=self.spec.page_size, max_segments=segments,
            return_lse=self.prefill_options.return_lse, runs=step == "pcp",
        )  # fmt: skip

    def warmup(self) -> int:
        """Launch every kernel variant the routes can produce, and one tiny decode; returns the launches."""
        specs = self.prefill_specs()
        launches = warmup(self.device, *specs) if specs else 0
        self.warmed_keys = frozenset(k for s in specs for k in compile_keys(s))
        variants = self.gqa_prefill_variants()
        if variants:  # FA4 compiles each key on its first call (seconds): all of them now
            launches += fa4_warmup.warm_up(variants, self.device)
            self.warmed_keys |= {CompileKey("fa4", dataclasses.asdict(v)) for v in variants}
        launches += self._warmup_decode()
        self.warmup_launches = launches
        return launches

    def _warmup_decode(self) -> int:
        """Run the decode kernels on tiny inputs (:func:`~shardattn.runtime.decode_warmup.warm_up_decode`)."""
        dcp = self.decode_is_dcp
        return warm_up_decode(
            self.spec,
            device=self.device,
            dtype=self.dtype,
            heads=self.spec.num_heads if dcp else self.heads_per_rank,
            kv_heads=self.spec.num_kv_heads if dcp else max(1, self.spec.num_kv_heads // self.world_size),
            topk=self.topk,
            max_decode_tokens=self.max_decode_tokens,
            scale=self.scale,
            dcp=DcpShard(self.world_size, self.layout.interleave, self.rank) if dcp else None,
            need_lse=self.decode_options.return_lse or dcp,
            gqa_backend=GQA_BACKEND[self.decode_route.path],
            kv_fp8=self.kv_format == KV_FP8_DS_MLA,
        )
