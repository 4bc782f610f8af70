"""The shared-memory step protocol between processes: every payload a rank reads is the one published.

Two rank processes serve a region (``shardattn.serving.shm``) while the driver publishes
thousands of steps of random sizes whose queries carry the step's number and a checksum. A rank
checks, before it answers, that what it read is the step the doorbell announced, whole (sizes,
marker, checksum); the driver checks every output row. A transport that let a rank (or the
driver) read before the writer's stores were visible, as an aligned store of a sequence number
does on Arm CPUs, fails here with the rank's message; a driver that rings before writing its
payload is caught the same way (the last test shows the check is live on any CPU).
"""

from __future__ import annotations

import multiprocessing as mp
import time
from typing import Any

import numpy as np
import pytest
import torch

from shardattn.serving.doorbell import Doorbell, wait_any
from shardattn.serving.errors import RankStepError
from shardattn.serving.shm import SEQ, ShmRegion, decode_layout, serve
from shardattn.serving.shm_steps import ShmSteps

RANKS, HEADS_PER_RANK, D, DV, TOPK, MAX_T = 2, 2, 24, 16, 4, 32


def _layout() -> Any:
    return decode_layout(
        RANKS, max_tokens=MAX_T, max_requests=MAX_T, table_width=1, heads_per_rank=HEADS_PER_RANK, head_dim=D,
        v_dim=DV, dtype=torch.float32, topk=TOPK, kv_rows=[((D,), torch.float32)],
    )  # fmt: skip


def _checksum(q: torch.Tensor) -> int:
    return int(q.contiguous().view(torch.int32).to(torch.int64).sum()) & 0x7FFFFFFF


def _checked_step(region: ShmRegion) -> Any:
    def step(views: dict[str, Any]) -> None:
        """Check the step is whole and the announced one, then answer: out = 2 q, lse = its number."""
        _, n_q, _ = views["sizes"]
        seq = int(region.ctrl[SEQ])
        q, topk = views["q"], views["topk"]
        marks = q[:, :, 0].unique().tolist()
        if marks != [float(seq)]:
            raise ValueError(f"payload of step {seq}: query markers {marks[:4]}")
        if topk[:, 1].unique().tolist() != [n_q]:
            raise ValueError(f"payload of step {seq}: sizes {n_q} but rows say {topk[:, 1].unique().tolist()[:4]}")
        if int(topk[0, 0]) != _checksum(q[:, :, 1:]):
            raise ValueError(f"payload of step {seq}: checksum {_checksum(q[:, :, 1:])} != {int(topk[0, 0])}")
        views["out"].copy_(2 * q[:, views["heads"], :DV])
        views["lse"].fill_(float(seq))

    return step


def _rank_main(path: str, layout: Any, rank: int, spin_s: float, ready: Any) -> None:
    torch.set_num_threads(1)
    region = ShmRegion(path, layout, create=False)
    ready.release()
    serve(region, rank, _checked_step(region), spin_s)


class _Ranks:
    """A region and its rank processes (spawned; they serve until stopped). Rank ``r`` spins
    ``spins[r]`` seconds on its doorbell after a step before it sleeps (both ways of waking)."""

    def __init__(self, spins: tuple[float, ...] = (2e-4, 0.0)) -> None:
        self.steps = ShmSteps(_layout(), spin_s=0.0)
        ctx = mp.get_context("spawn")
        ready = ctx.Semaphore(0)
        args = (self.steps.path, _layout())
        self.procs = [
            ctx.Process(target=_rank_main, args=(*args, r, spins[r], ready), daemon=True) for r in range(RANKS)
        ]
        for p in self.procs:
            p.start()
        for _ in self.procs:
            assert ready.acquire(timeout=60), "a rank process did not start"

    def close(self) -> list[int | None]:
        self.steps.stop()
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        self.steps.close()
        return [p.exitcode for p in self.procs]


def _payload(gen: torch.Generator, seq: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    q = torch.randn(n, RANKS * HEADS_PER_RANK, D, generator=gen)
    q[:, :, 0] = float(seq)
    topk = torch.full((n, TOPK), n, dtype=torch.int32)
    topk[0, 0] = _checksum(q[:, :, 1:])
    return q, topk


def _step(q: torch.Tensor, topk: torch.Tensor) -> dict[str, Any]:
    n = int(q.shape[0])
    ones = np.ones(n, dtype=np.int64)
    return {"table": np.zeros((n, 1), dtype=np.int32), "starts": 0 * ones, "counts": 0 * ones, "q_lens": ones,
            "q": q, "topk": topk, "kv": [], "return_lse": True}  # fmt: skip


@pytest.fixture(scope="module")
def ranks():
    r = _Ranks()
    yield r
    r.close()  # idempotent: the last test closes them itself


def test_every_step_reads_the_payload_published_before_it(ranks: _Ranks) -> None:
    gen = torch.Generator().manual_seed(11)
    sizes = torch.randint(1, MAX_T + 1, (2000,), generator=gen).tolist()
    for n in sizes:
        seq = ranks.steps._seq + 1
        q, topk = _payload(gen, seq, n)
        out, lse = ranks.steps.run(_step(q, topk), timeout_s=60.0)
        assert torch.equal(out, 2 * q[..., :DV]), f"step {seq}: outputs are not the step's"
        assert torch.equal(lse, torch.full_like(lse, float(seq))), f"step {seq}: lse"


def test_a_driver_failure_after_the_ring_fails_the_step(ranks: _Ranks, monkeypatch: pytest.MonkeyPatch) -> None:
    """The ranks run a step once their doorbells rang: the driver's own failure after that (as
    ``select``'s for a descriptor past 1024 was) raised as it came, and the pool took the step
    back out of its ledger though the ranks had written it. It is the step's failure (RankStepError:
    the pool breaks), naming the ranks not seen done."""
    steps = ranks.steps
    gen = torch.Generator().manual_seed(13)

    def wait_fails(timeout_s: float, pending: list[int] | None = None) -> None:
        raise ValueError("filedescriptor out of range in select()")

    monkeypatch.setattr(steps, "_wait", wait_fails)
    q, topk = _payload(gen, steps._seq + 1, 4)
    failed = r"after ringing the step \(ValueError: filedescriptor out of range in select\(\)\); ranks \[0, 1\]"
    with pytest.raises(RankStepError, match=failed):
        steps.run(_step(q, topk), timeout_s=60.0)
    monkeypatch.undo()
    steps._wait(60.0)  # the ranks ran it: their answers, before the next step's payload is written
    seq = steps._seq + 1
    q, topk = _payload(gen, seq, 4)
    out, lse = steps.run(_step(q, topk), timeout_s=60.0)
    assert torch.equal(out, 2 * q[..., :DV]) and torch.equal(lse, torch.full_like(lse, float(seq)))


def test_doorbells_wait_on_descriptors_past_1024(tmp_path: Any) -> None:
    """A driver holding over 1024 descriptors (a server's sockets): ``select`` refused the doorbells'
    (ValueError), so every step failed; ``poll`` takes any descriptor."""
    import os
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = 1100
    if hard != resource.RLIM_INFINITY and hard < need:
        pytest.skip(f"the descriptor limit ({hard}) is below {need}")
    if soft != resource.RLIM_INFINITY and soft < need:
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))
    held: list[int] = []
    try:
        while not held or held[-1] < 1024:
            held.append(os.open(os.devnull, os.O_RDONLY))
        bells = [Doorbell(str(tmp_path / f"bell{i}"), create=True) for i in range(2)]
        assert min(b.fileno() for b in bells) >= 1024
        assert bells[0].wait(0.01) is None and wait_any(bells, 0.01) == []
        bells[1].ring(7)
        assert wait_any(bells, 1.0) == [1] and bells[1].wait(1.0) == 7
        for b in bells:
            b.close(unlink=True)
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_driver_that_rings_before_writing_its_payload_is_caught(ranks: _Ranks) -> None:
    """Runs last on the module's ranks (they stop): the protocol broken on purpose (the doorbell rung,
    then the payload written): the ranks read the previous step's payload and say so; the same check
    catches a CPU that makes the stores visible out of order."""
    steps = ranks.steps
    gen = torch.Generator().manual_seed(12)
    seq = steps._seq + 1
    q, topk = _payload(gen, seq, 8)
    steps.run(_step(q, topk), timeout_s=60.0)  # published properly
    q, topk = _payload(gen, seq + 1, 8)
    c, t = steps.region.ctrl, steps.region.tensors
    steps._seq += 1
    c[SEQ] = steps._seq
    for bell in steps._go:
        bell.ring(steps._seq)
    time.sleep(0.05)  # the ranks read now
    t["q"][:8].copy_(q)
    t["topk"][:8].copy_(topk)
    stale = rf"raised ValueError: payload of step {seq + 1}: query markers \[{seq}\.0\]"
    with pytest.raises(RankStepError, match=stale):
        steps._wait(60.0)
    assert ranks.close() == [0, 0]  # both serve loops returned after raising


def test_a_doorbell_that_fails_to_open_closes_those_opened_before(monkeypatch: Any) -> None:
    """The second doorbell fails: the one opened before it is closed (its descriptor was left
    open)."""
    import shardattn.serving.shm_steps as shm_steps

    opened: list[Doorbell] = []
    real = shm_steps.Doorbell

    def third_fails(path: str, *, create: bool) -> Doorbell:
        if len(opened) == 1:
            raise OSError(24, "Too many open files")
        opened.append(real(path, create=create))
        return opened[-1]

    monkeypatch.setattr(shm_steps, "Doorbell", third_fails)
    with pytest.raises(OSError, match="Too many open files"):
        ShmSteps(_layout(), spin_s=0.0)
    assert len(opened) == 1
    for bell in opened:
        with pytest.raises(ValueError, match="closed"):
            bell.fileno()
