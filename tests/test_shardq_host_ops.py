"""What the host issues per chunk of a pipelined ShardQ step: torch ops, messages, scalar reads.

Each chunk of a pipelined step costs the host time to issue (about 1 ms on two H200s,
docs/DECISIONS.md, D40), which decides whether chunking pays. A ``TorchDispatchMode`` counts
every op the step dispatches (with a kernel call that only waits for its queries, so what is
counted is the step's own work); the per-chunk cost is the difference between a step of 8
chunks and one of 2, divided by 6. The bounds pin it so a regression fails here:

* device ops (allocations, copies, gathers: a launch each on a GPU): the three local pieces
  (queries, outputs, LSE a rank keeps) and nothing else;
* messages: exactly one per token run, peer and tensor (what :meth:`PipelinePlan.runs` lists);
* views (slices, selects, reshapes: host time only): a handful, not one per run and peer;
* scalar reads of tensors that would live on the device (``.item()``, ``int(t)``, ``.tolist()``:
  a device sync on a GPU): none. "Device" tensors are the caller's (q, kv, rows, workspace,
  destinations) and everything ops make from them or create; the plan's host tensors are not
  (reading them costs no sync). One blind spot: a plan tensor moved with ``.to(device)`` stays the
  same CPU tensor here, so a read of it would not be seen.
"""

from __future__ import annotations

import collections

import pytest
import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from shardattn.ops.prepared_union import SLICE_GROUPS
from shardattn.parallel.comm import Comm
from shardattn.parallel.shardq import shardq_prefill
from shardattn.plan import zigzag_split
from shardattn.plan.pipeline import pipeline_plan

D, DV, K, HEADS = 16, 8, 6, 2
#: Upper bounds per chunk (see the module docstring). Views were 28-30.5 per chunk (one slice or
#: select per run, peer and tensor, three per workspace carve) before the step cut each buffer
#: into its runs with one split; now 9 (a carve and a split per buffer).
MAX_DEVICE_OPS_PER_CHUNK = 3
MAX_VIEWS_PER_CHUNK = 9
#: Tensor methods that read values back to the host.
SCALAR_READS = frozenset({"item", "tolist", "__int__", "__float__", "__bool__", "__index__"})


def _storages(tree: object) -> set[int]:
    return {x.untyped_storage().data_ptr() for x in tree_leaves(tree) if isinstance(x, torch.Tensor)}


class _Ops(TorchDispatchMode):
    """Counts dispatched ops by name and tracks which storages hold device data (see the module docstring)."""

    def __init__(self, device_tensors: list[torch.Tensor]) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()
        self.device = _storages(device_tensors)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func)] += 1
        result = func(*args, **(kwargs or {}))
        inputs = _storages((args, kwargs))
        if not inputs or inputs & self.device:  # made on the device, or from device data
            self.device |= _storages(result)
        return result


class _Reads(TorchFunctionMode):
    """Counts the host reads (:data:`SCALAR_READS`) of tensors :class:`_Ops` marks as device data."""

    def __init__(self, ops: _Ops) -> None:
        super().__init__()
        self.ops, self.reads = ops, 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in SCALAR_READS and args and _storages(args[0]) & self.ops.device:
            self.reads += 1
        return func(*args, **(kwargs or {}))


class HostWork:
    """Ops dispatched (``ops``, by name) and device reads (``reads``) while active."""

    def __init__(self, device_tensors: list[torch.Tensor]) -> None:
        self._ops = _Ops(device_tensors)
        self._reads = _Reads(self._ops)

    def __enter__(self) -> HostWork:
        self._reads.__enter__()
        self._ops.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._ops.__exit__(*exc)
        self._reads.__exit__(*exc)

    @property
    def ops(self) -> collections.Counter[str]:
        return self._ops.ops

    @property
    def reads(self) -> int:
        return self._reads.reads


def _kind(name: str) -> str:
    if name.startswith("c10d."):
        return "messages" if name.split(".")[1] in ("send", "recv_") else "other collectives"
    op = name.split(".")[1]
    if op == "_local_scalar_dense":
        return "scalar reads (any tensor)"
    if op in ("slice", "select", "view", "as_strided", "split", "split_with_sizes", "detach", "alias", "unbind"):
        return "views"
    return "device ops"


def _count(group: dist.ProcessGroup, lens: list[int], chunk_counts: list[int], one_union: bool) -> list[dict]:
    comm = Comm(group)
    w, rank = comm.world_size, comm.rank
    g = torch.Generator().manual_seed(rank)
    t = sum(lens)
    q = torch.randn(t, HEADS, D, generator=g)
    kv = torch.randn(50, D, generator=g)
    rows = torch.randint(-1, 50, (t, K), generator=g, dtype=torch.int32)
    length = torch.randint(0, K + 1, (t,), generator=g, dtype=torch.int32)
    plan = zigzag_split(lens, w, min_tokens=0)
    n = int(plan.counts.max())
    pad = 8 * 256
    ws = {  # as the Runtime passes them: nothing is allocated per step
        "q": torch.empty(n * w * HEADS * D * 4 + pad, dtype=torch.uint8),
        "out": torch.empty(n * w * HEADS * DV * 4 + pad, dtype=torch.uint8),
        "lse": torch.empty(n * w * HEADS * 4 + pad, dtype=torch.uint8),
        "rows": torch.empty(n * K * 4, dtype=torch.uint8),
        "union": torch.empty(n * K * 4, dtype=torch.uint8),
        "lens": torch.empty(n * 8, dtype=torch.uint8),
    }
    out = torch.empty(t, HEADS, DV)
    lse = torch.empty(t, HEADS)

    def waits_only(*args, **kwargs):  # the kernel call, minus the kernel: waits for its queries
        kwargs["q_ready"]()
        return kwargs["out"], kwargs["lse_out"]

    kinds = []
    for c in chunk_counts:
        kw = dict(scale=0.3, v_dim=DV, topk_length=length, attention=waits_only, chunks=c, check=False)
        shardq_prefill(q, kv, rows, plan, comm, workspace=ws, out=out, lse_out=lse, one_union=one_union, **kw)
        with HostWork([q, kv, rows, length, out, lse, *ws.values()]) as counter:
            shardq_prefill(q, kv, rows, plan, comm, workspace=ws, out=out, lse_out=lse, one_union=one_union, **kw)
        by_kind: collections.Counter[str] = collections.Counter()
        for name, k in counter.ops.items():
            by_kind[_kind(name)] += k
        pipe = pipeline_plan(plan, c, align=SLICE_GROUPS if one_union else 1)  # the step's cut
        runs_out = sum(len(pipe.runs(rank, i)) for i in range(c)) * (w - 1)  # my runs, to every peer
        runs_in = sum(len(pipe.runs(j, i)) for j in range(w) if j != rank for i in range(c))
        kinds.append(
            {"kinds": dict(by_kind), "ops": dict(counter.ops), "reads": counter.reads, "runs": runs_out + runs_in}
        )
    return kinds


@pytest.mark.distributed
@pytest.mark.parametrize("one_union", [False, True], ids=["per-chunk-union", "one-union"])
@pytest.mark.parametrize("world_size", [2, 3], ids=["world2", "world3"])
def test_host_work_per_chunk_is_bounded(dist_pool, world_size: int, one_union: bool) -> None:
    lens = [70, 33, 0, 58, 21]  # several requests: several token runs per rank and chunk
    for rank, (two, eight) in enumerate(dist_pool.run(_count, lens, [2, 8], one_union, world_size=world_size)):
        per_chunk = {
            k: (eight["kinds"].get(k, 0) - two["kinds"].get(k, 0)) / 6 for k in set(two["kinds"]) | set(eight["kinds"])
        }
        detail = {k: eight["ops"][k] - two["ops"].get(k, 0) for k in eight["ops"]}
        assert per_chunk.get("device ops", 0) <= MAX_DEVICE_OPS_PER_CHUNK, (rank, per_chunk, detail)
        assert per_chunk.get("views", 0) <= MAX_VIEWS_PER_CHUNK, (rank, per_chunk, detail)
        assert eight["reads"] == two["reads"] == 0, (rank, detail)  # no device sync in the step
        assert "other collectives" not in eight["kinds"], (rank, eight["ops"])
        # one message per token run, peer and tensor (queries, outputs, LSE): none more
        assert two["kinds"]["messages"] == 3 * two["runs"] and eight["kinds"]["messages"] == 3 * eight["runs"], rank


def test_host_work_sees_device_reads_and_not_host_plan_reads() -> None:
    """The counter itself: reads of device data (and of what ops make from it) count; plan reads do not."""
    x = torch.arange(6.0)
    plan_offsets = torch.tensor([0, 3, 6])
    with HostWork([x]) as work:
        y = x[2:] * 2
        int(plan_offsets[1])
        plan_offsets.tolist()
        assert work.reads == 0
        float(y.sum())
        y.tolist()
        bool(torch.zeros(1))  # made by the step: device data
    assert work.reads == 3 and work.ops["aten.mul.Tensor"] == 1
