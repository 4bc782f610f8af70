"""Comm: the counted collectives, uneven sizes, byte packing, and the agreement check."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from shardattn.parallel.agreement import stable_fingerprint
from shardattn.parallel.comm import Comm, pack_rows, packed_nbytes, unpack_rows
from shardattn.parallel.packing import view_bytes
from tests.parallel_helpers import (
    WORLD_IDS,
    WORLD_SIZES,
    assert_rank_errors,
    catch,
    rank_1_rejected,
    short_timeout_group,
)


def _split(src: int, dst: int) -> int:
    return (src + 2 * dst) % 3  # rows rank src sends to rank dst; zeros included


def _collectives(group: dist.ProcessGroup) -> dict:
    comm = Comm(group)
    r, w = comm.rank, comm.world_size
    send = [_split(r, j) for j in range(w)]
    recv = [_split(j, r) for j in range(w)]
    x = torch.cat([torch.full((send[j], 2), 100.0 * r + j) for j in range(w)])
    a2a = comm.all_to_all(x, send, recv)
    sizes = [j + 1 for j in range(w)]
    uneven = comm.all_gather_uneven(torch.full((r + 1, 3), float(r), dtype=torch.bfloat16), sizes)
    rs_in = torch.arange(w * 2 * 3, dtype=torch.float32).view(w * 2, 3) * (r + 1)
    rs = comm.reduce_scatter(rs_in)
    ar = comm.all_reduce(torch.tensor([float(r)]))
    ints = comm.gather_ints([r, -5, 2**64 - 1])
    return {
        "a2a": a2a,
        "uneven": [u.float() for u in uneven],
        "rs": rs,
        "ar": float(ar),
        "ints": ints,
        "counts": dict(comm.counts),
    }


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", WORLD_SIZES, ids=WORLD_IDS)
def test_collectives_move_the_right_rows(dist_pool, world_size: int) -> None:
    results = dist_pool.run(_collectives, world_size=world_size)
    w = world_size
    for r, res in enumerate(results):
        expect = torch.cat([torch.full((_split(j, r), 2), 100.0 * j + r) for j in range(w)])
        torch.testing.assert_close(res["a2a"], expect, rtol=0, atol=0)
        assert [u.shape[0] for u in res["uneven"]] == [j + 1 for j in range(w)]
        for j, u in enumerate(res["uneven"]):
            assert bool((u == j).all())
        total = sum(torch.arange(w * 6, dtype=torch.float32).view(w * 2, 3) * (j + 1) for j in range(w))
        torch.testing.assert_close(res["rs"], total[2 * r : 2 * r + 2], rtol=0, atol=0)
        assert res["ar"] == sum(range(w))
        assert res["ints"] == [[j, -5, -1] for j in range(w)]  # 2**64 - 1 folds to int64 -1
        assert res["counts"] == {
            "all_to_all": 1,
            "all_gather": 2,
            "reduce_scatter": 1,
            "all_reduce": 1,
        }


def _agreement(group: dist.ProcessGroup, values: list[int], failing: int | None) -> tuple[str, str]:
    comm = Comm(group)
    error = ValueError("my input is bad") if comm.rank == failing else None
    return catch(comm.check_agreement, values[comm.rank], "test plan", error=error)


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("values", "bad"),
    [([7, 7, 7], []), ([7, 7, 9], [2]), ([9, 7, 7], [0]), ([1, 2, 2], [0]), ([2**63 + 5, 2**63 + 5, 3], [2])],
    ids=["agree", "last-differs", "first-differs", "majority-wins", "big-ints"],
)
def test_check_agreement_names_the_disagreeing_rank_on_every_rank(dist_pool, values: list[int], bad: list) -> None:
    results = dist_pool.run(_agreement, values, None, world_size=3)
    if not bad:
        assert results == [("ok", "")] * 3
        return
    for kind, msg in results:
        assert kind == "ValueError"
        assert f"test plan: rank(s) {bad} disagree" in msg


def _named_agreement(group: dist.ProcessGroup) -> str:
    """Rank 2 passes another v_dim, rank 1 another q shape too; rank 0 holds the majority's."""
    from shardattn.parallel.agreement import Fingerprint

    comm = Comm(group)
    shape, v_dim = ((4, 8), 512) if comm.rank == 0 else ((4, 8), 256) if comm.rank == 2 else ((5, 8), 512)
    names = {"q's shape": shape, "v_dim": v_dim, **{f"part {i}": i for i in range(20)}}  # past MAX_PARTS
    return catch(comm.check_agreement, Fingerprint("step", names), "test step")[1]


@pytest.mark.distributed
def test_check_agreement_names_the_parts_that_differ(dist_pool) -> None:
    """A named fingerprint's parts are compared one by one: every rank names the dissenters and
    the parts on which they differ from the majority's (here none holds a majority: rank 0's wins)."""
    for msg in dist_pool.run(_named_agreement, world_size=3):
        assert msg.startswith("test step: rank(s) [1, 2] disagree with rank(s) [0] on q's shape, v_dim ("), msg


def _other_step_agreement(group: dist.ProcessGroup) -> str:
    """Rank 1 fingerprints another step (another tag, other parts) than rank 0."""
    from shardattn.parallel.agreement import Fingerprint

    comm = Comm(group)
    if comm.rank == 1:
        fingerprint = Fingerprint("decode", {"the lengths": (3, 4), "q's shape": (2, 8)})
    else:
        fingerprint = Fingerprint("prefill", {"q's shape": (9, 8), "the plan": 17, "v_dim": 512})
    return catch(comm.check_agreement, fingerprint, "test step")[1]


@pytest.mark.distributed
def test_check_agreement_says_when_a_rank_runs_another_step(dist_pool) -> None:
    """Ranks in different steps compare unrelated parts: the message said they differed on every one
    of them (here q's shape, the plan and v_dim); it says they run another step."""
    for rank, msg in enumerate(dist_pool.run(_other_step_agreement, world_size=2)):
        assert msg.startswith(f"test step: rank(s) [1] run another step than rank(s) [0] (rank {rank} runs"), msg
        assert "q's shape" not in msg and "v_dim" not in msg, msg


@pytest.mark.distributed
def test_check_agreement_spreads_one_ranks_input_error(dist_pool) -> None:
    results = dist_pool.run(_agreement, [1, 1, 1], 1, world_size=3)
    assert results[1] == ("ValueError", "my input is bad")
    for r in (0, 2):
        assert results[r][0] == "ValueError"
        assert "rank(s) [1] of 3 rejected their inputs" in results[r][1]


def _checks_with_a_bug_on_rank_1(group: dist.ProcessGroup) -> tuple[str, str]:
    comm = Comm(short_timeout_group(group))  # a peer left waiting in the agreement fails in seconds

    def validate() -> int:
        if comm.rank == 1:
            return len([0, 1].device)  # type: ignore[attr-defined]  # an argument of the wrong type
        return 7

    try:
        comm.agree_on("test inputs", validate)
    except Exception as e:
        return type(e).__name__, str(e)
    return "ok", ""


@pytest.mark.distributed
def test_agree_on_spreads_any_exception_of_one_ranks_checks(dist_pool, nproc: int) -> None:
    """Not only a TypeError or ValueError: the rank re-raises its own exception, the others raise at once."""
    if nproc < 2:
        pytest.skip("needs 2 ranks; run with --nproc 2 or more")
    expect = rank_1_rejected(nproc, "test inputs", "AttributeError: 'list' object has no attribute 'device'")
    assert_rank_errors(dist_pool.run(_checks_with_a_bug_on_rank_1), expect)


def _graces(group: dist.ProcessGroup) -> list[tuple[str, str]]:
    return [catch(Comm, group, report_grace_s=g) for g in (math.inf, math.nan, -0.5, True, "1", 0, 2.5)]


@pytest.mark.distributed
def test_report_grace_must_be_a_finite_number_of_seconds(dist_pool) -> None:
    """An infinite grace left a rank whose collective failed waiting for ever on a silent peer."""
    (results,) = dist_pool.run(_graces, world_size=1)
    assert results == [
        ("ValueError", "report_grace_s must be a finite number >= 0, got inf"),
        ("ValueError", "report_grace_s must be a finite number >= 0, got nan"),
        ("ValueError", "report_grace_s must be a finite number >= 0, got -0.5"),
        ("TypeError", "report_grace_s must be a number of seconds, got bool (True)"),
        ("TypeError", "report_grace_s must be a number of seconds, got str ('1')"),
        ("ok", ""),
        ("ok", ""),
    ]


def _misuse(group: dist.ProcessGroup) -> list[tuple[str, str]]:
    comm = Comm(group)
    w = comm.world_size
    x = torch.zeros(4, 2)
    out = [
        catch(comm.all_to_all, x, [4] + [0] * w, [0] * w),  # one split too many
        catch(comm.all_to_all, x, [3] + [0] * (w - 1), [0] * w),  # does not add up to 4 rows
        catch(comm.all_to_all, x, [-1, 5] + [0] * (w - 2), [0] * w),
        catch(comm.reduce_scatter, torch.zeros(w * 2 + 1)),
        catch(comm.all_gather_uneven, torch.zeros(3), [1] * w),
        catch(Comm, "not a group"),
        catch(Comm.wrap(comm).all_gather, "x"),
    ]
    assert not comm.counts, f"a refused collective must not be counted: {comm.counts}"
    return out


@pytest.mark.distributed
def test_misuse_raises_before_communicating(dist_pool) -> None:
    results = dist_pool.run(_misuse, world_size=2)
    for per_rank in results:
        kinds = [k for k, _ in per_rank]
        assert kinds == ["ValueError"] * 5 + ["TypeError"] * 2
        assert "send_splits must have world_size=2 entries" in per_rank[0][1]
        assert "send_splits must add up to 4" in per_rank[1][1]
        assert "non-negative" in per_rank[2][1]
        assert "divisible by world_size=2" in per_rank[3][1]
        assert "ProcessGroup" in per_rank[5][1]


@pytest.mark.parametrize("rows", [0, 1, 3], ids=lambda p: f"rows{p}")
def test_pack_rows_round_trips_mixed_dtypes(rows: int) -> None:
    g = torch.Generator().manual_seed(rows)
    a = torch.randn(rows, 3, 5, generator=g).to(torch.bfloat16)
    b = torch.randn(rows, 3, generator=g)
    c = torch.randint(-9, 9, (rows, 7), generator=g, dtype=torch.int32)
    specs = [((3, 5), torch.bfloat16), ((3,), torch.float32), ((7,), torch.int32)]
    buf = pack_rows([a, b, c])
    assert buf.shape == (rows, packed_nbytes(specs)) and buf.dtype == torch.uint8
    assert packed_nbytes(specs) % 16 == 0
    for got, want in zip(unpack_rows(buf, specs), (a, b, c)):
        assert got.dtype == want.dtype
        assert torch.equal(got, want)


def test_pack_rows_rejects_mismatched_leading_dims() -> None:
    with pytest.raises(ValueError, match="leading dim 2"):
        pack_rows([torch.zeros(2, 3), torch.zeros(3, 3)])
    with pytest.raises(ValueError, match=r"must be a \[P, 16\] uint8 tensor"):
        unpack_rows(torch.zeros(2, 8, dtype=torch.uint8), [((2,), torch.float32)])


def test_pack_rows_into_a_given_buffer_and_view_bytes() -> None:
    g = torch.Generator().manual_seed(5)
    a, b = torch.randn(2, 3, 5, generator=g).to(torch.bfloat16), torch.randn(2, 3, generator=g)
    nbytes = packed_nbytes([((3, 5), torch.bfloat16), ((3,), torch.float32)])
    arena = torch.randint(0, 256, (2 * nbytes + 8,), generator=g, dtype=torch.uint8)  # stale bytes
    out = view_bytes(arena, (2, nbytes), torch.uint8, "send")
    buf = pack_rows([a, b], out=out)
    assert buf.data_ptr() == arena.data_ptr()
    got = unpack_rows(buf, [((3, 5), torch.bfloat16), ((3,), torch.float32)])
    assert torch.equal(got[0], a) and torch.equal(got[1], b)
    with pytest.raises(ValueError, match=r"out must be a contiguous \[2, 48\] uint8"):
        pack_rows([a, b], out=arena[:nbytes].view(1, nbytes))
    with pytest.raises(ValueError, match=r"workspace\['send'\] must be a flat uint8 buffer of at least 200 B"):
        view_bytes(arena, (2, 100), torch.uint8, "send")
    assert view_bytes(None, (2, 3), torch.float32, "x") is None


def test_stable_fingerprint_separates_parts() -> None:
    assert stable_fingerprint("a", 1) == stable_fingerprint("a", 1)
    assert stable_fingerprint("a", 1) != stable_fingerprint("a", 2)
    assert stable_fingerprint("ab", "c") != stable_fingerprint("a", "bc")
    assert 0 <= stable_fingerprint(torch.float16) < 2**63


def _reduce_scatter_without_backend_support(group: dist.ProcessGroup) -> tuple:
    import shardattn.parallel.comm as comm_module

    def unsupported(*args, **kwargs):
        raise RuntimeError("ProcessGroupGloo does not support reduce_scatter")

    real = comm_module._REDUCE_SCATTER_TENSOR
    comm_module._REDUCE_SCATTER_TENSOR = unsupported
    try:
        comm = Comm(group)
        x = torch.arange(comm.world_size * 4, dtype=torch.float32).view(-1, 2) + comm.rank
        first = comm.reduce_scatter(x)
        second = comm.reduce_scatter(x)  # remembered: no second attempt
        return first, second, comm.has_reduce_scatter, dict(comm.counts)
    finally:
        comm_module._REDUCE_SCATTER_TENSOR = real


@pytest.mark.distributed
def test_reduce_scatter_falls_back_to_all_gather_when_the_backend_lacks_it(dist_pool) -> None:
    results = dist_pool.run(_reduce_scatter_without_backend_support, world_size=2)
    total = sum(torch.arange(8, dtype=torch.float32).view(-1, 2) + r for r in range(2))
    for r, (first, second, supported, counts) in enumerate(results):
        assert torch.equal(first, total[2 * r : 2 * r + 2]) and torch.equal(second, first)
        assert supported is False
        assert counts == {"all_gather": 2}


def _exchange_on_sub_group(group: dist.ProcessGroup) -> list[list[float]] | None:
    """Ranks 3 and 1 (group ranks 0 and 1 of ``new_group([3, 1])``) swap pieces through Comm.exchange."""
    sub = dist.new_group([3, 1])  # every rank of the world takes part in creating it
    if dist.get_rank() not in (1, 3):
        return None
    comm = Comm(sub)
    me = comm.rank
    mine = torch.full((2, 3), float(10 * dist.get_rank()))
    keep = torch.empty(2, 3)
    other = torch.empty(2, 3)
    comm.exchange([(1 - me, mine), (me, mine)], [(1 - me, other), (me, keep)]).wait()
    return [float(other[0, 0]), float(keep[0, 0])]


@pytest.mark.distributed(world_size=4)
def test_exchange_on_a_sub_group_names_peers_by_their_global_rank(dist_pool) -> None:
    """A sub-group's rank j is not global rank j: the point-to-point messages must name global ranks
    (ShardQ's exchanges on the "tp" dimension of a 2-D DeviceMesh failed with "Global rank 1 is not
    part of group")."""
    results = dist_pool.run(_exchange_on_sub_group, world_size=4)
    assert results == [None, [30.0, 10.0], None, [10.0, 30.0]]


def test_settle_raises_the_ranks_own_error_where_its_gather_fails_too(caplog) -> None:
    """A rank that failed and then cannot reach its peers (their process died) raises its own
    error, not the gather's; the gather's failure is logged."""
    from shardattn.parallel.agreement import settle

    reported: list[BaseException] = []

    class DeadPeers:
        rank, world_size = 0, 2

        def report_failure(self, error: BaseException) -> None:
            reported.append(error)

        def gather_ints(self, values: list[int]) -> list[list[int]]:
            raise RuntimeError("Connection reset by peer")

    own = ValueError("kv: bad rows")
    with caplog.at_level("WARNING", logger="shardattn.parallel.agreement"), pytest.raises(ValueError) as info:
        settle(DeadPeers(), "Runtime construction", [1, 2], error=own)  # type: ignore[arg-type]
    assert info.value is own and reported == [own]
    assert "Connection reset by peer" in caplog.text
    with pytest.raises(RuntimeError, match="Connection reset"):  # no error of its own: the gather's
        settle(DeadPeers(), "Runtime construction", [1, 2])  # type: ignore[arg-type]
