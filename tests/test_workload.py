"""Workload generator: calibrated neighbour overlap, causality, dumps."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardattn.workload import Overlap, first_repeat, load_topk_dump, synthetic_topk, union_ratio


def test_positions_are_causal_unique_and_padded():
    pos = synthetic_topk(40, 16, start_position=5, seed=2)
    assert pos.shape == (40, 16) and pos.dtype == torch.int32
    for t, row in enumerate(pos.tolist()):
        valid = [p for p in row if p >= 0]
        assert len(valid) == min(16, 5 + t + 1) and len(set(valid)) == len(valid)
        assert max(valid) <= 5 + t


def test_dsa_preset_matches_published_neighbour_overlap():
    pos = synthetic_topk(64, 2048, start_position=60000, overlap="dsa", seed=0)
    r2, r8 = union_ratio(pos, 2), union_ratio(pos, 8)
    assert 1.08 <= r2 <= 1.25 and 1.2 <= r8 <= 1.7, (r2, r8)


def test_random_preset_is_the_worst_case_and_overlap_falls_with_position():
    rand = synthetic_topk(16, 256, start_position=60000, overlap="random", seed=0)
    assert union_ratio(rand, 8) > 7.0
    early = union_ratio(synthetic_topk(32, 256, start_position=1000, seed=1), 8)
    late = union_ratio(synthetic_topk(32, 256, start_position=30000, seed=1), 8)
    assert early < late


def test_union_ratio_definition():
    rows = torch.tensor([[1, 2, 3, -1], [2, 3, 4, -1], [9, 9, 9, 9]], dtype=torch.int32)
    assert union_ratio(rows, 2) == pytest.approx(4 / 3)  # the trailing partial group is left out
    assert union_ratio(rows[:1], 2) != union_ratio(rows[:1], 2)  # nan: no full group


def test_bad_overlap_raises():
    with pytest.raises(ValueError, match="rho \\+ jitter <= 1"):
        synthetic_topk(4, 4, start_position=10, overlap=Overlap(rho=0.9, drift=4, jitter=0.2))


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_load_topk_dump_round_trip(tmp_path, suffix):
    topk = torch.tensor([[3, 1, -1], [0, 2, 5]], dtype=torch.int64)
    valid = torch.tensor([2, 3], dtype=torch.int32)
    path = tmp_path / f"dump{suffix}"
    if suffix == ".pt":
        torch.save({"topk": topk, "valid": valid}, path)
    else:
        st = pytest.importorskip("safetensors.torch")
        st.save_file({"topk": topk, "valid": valid}, str(path))
    got_topk, got_valid = load_topk_dump(path)
    assert got_topk.dtype == torch.int32 and torch.equal(got_topk, topk.int()) and torch.equal(got_valid, valid)


def test_load_topk_dump_rejects_other_files(tmp_path):
    with pytest.raises(ValueError, match=r"must end in \.pt or \.safetensors"):
        load_topk_dump(tmp_path / "x.npy")
    torch.save({"rows": torch.zeros(1, 1)}, tmp_path / "bad.pt")
    with pytest.raises(ValueError, match="must hold a dict with a 'topk' tensor"):
        load_topk_dump(tmp_path / "bad.pt")


def test_load_topk_dump_default_uses_every_entry(tmp_path):
    """Without ``valid`` every entry is read: a -1 in the middle of a row does not cut off the
    entries after it (the library treats it as invalid where it stands)."""
    torch.save({"topk": torch.tensor([[5, -1, 7], [-1, -1, 2]], dtype=torch.int32)}, tmp_path / "d.pt")
    _, valid = load_topk_dump(tmp_path / "d.pt")
    assert valid.tolist() == [3, 3]


@pytest.mark.parametrize(
    ("data", "match"),
    [
        ({"topk": torch.tensor([[-(2**32) + 5, 1]])}, r"topk entries must fit int32"),
        ({"topk": torch.tensor([[2**31, 1]])}, r"topk entries must fit int32"),
        (
            {"topk": torch.zeros(2, 3, dtype=torch.int32), "valid": torch.tensor([1, -3])},
            r"valid counts must be in \[0, 3\]",
        ),
        (
            {"topk": torch.zeros(2, 3, dtype=torch.int32), "valid": torch.tensor([4, 0])},
            r"valid counts must be in \[0, 3\]",
        ),
        ({"topk": torch.zeros(1, 3, dtype=torch.int32), "valid": torch.tensor([2**40])}, r"valid counts must be in"),
    ],
    ids=["below-int32", "above-int32", "valid-negative", "valid-past-k", "valid-wraps"],
)
def test_load_topk_dump_rejects_values_that_would_wrap(tmp_path, data, match):
    torch.save(data, tmp_path / "d.pt")
    with pytest.raises(ValueError, match=match):
        load_topk_dump(tmp_path / "d.pt")


def test_load_topk_dump_names_an_unreadable_file(tmp_path):
    (tmp_path / "junk.pt").write_bytes(b"PK\x03\x04 not a torch file")
    (tmp_path / "junk.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}garbage")
    for name in ("junk.pt", "junk.safetensors"):
        with pytest.raises(ValueError, match=rf"^{name} is not a readable top-k dump"):
            load_topk_dump(tmp_path / name)


def _topk(**kw):
    return synthetic_topk(4, 4, start_position=3, **kw)


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda: _topk(overlap="dsa_hi"), ValueError, r"overlap must be one of .*'dsa_hi'"),
        (lambda: _topk(overlap={"rho": 1}), TypeError, r"overlap must be a preset name"),
        (lambda: _topk(overlap=Overlap(0.5, 2.5)), TypeError, r"overlap\.drift must be an int"),
        (lambda: _topk(overlap=Overlap("0.5", 2)), TypeError, r"overlap\.rho must be a float"),
        (lambda: _topk(chunk=0), ValueError, r"chunk must be >= 1, got 0"),
        (lambda: _topk(chunk=-1), ValueError, r"chunk must be >= 1, got -1"),
        (lambda: _topk(seed=1.5), TypeError, r"seed must be an int"),
        (lambda: union_ratio(torch.zeros(4, 2, dtype=torch.int32), 0), ValueError, r"group_size must be >= 1, got 0"),
        (lambda: union_ratio(torch.zeros(4, 2, dtype=torch.int32), 2.0), TypeError, r"group_size must be an int"),
        (lambda: load_topk_dump(3), TypeError, r"path must be a str or a path, got int"),
    ],
    ids=["unknown-preset", "overlap-dict", "drift-float", "rho-str", "chunk-zero", "chunk-negative",
         "seed-float", "group-size-zero", "group-size-float", "path-int"],
)  # fmt: skip
def test_bad_arguments_are_refused_naming_them(call, error, match):
    """A negative ``chunk`` returned every row ``-1`` (no query scored); the others raised a
    KeyError, an AttributeError, a ZeroDivisionError or torch's own message naming no argument."""
    with pytest.raises(error, match=match):
        call()


@pytest.mark.parametrize("overlap", ["dsa", "dsa_low", "random"])
def test_chunk_is_a_memory_knob_only(overlap):
    """The same seed gives the same indices whatever ``chunk`` scores at once (the per-query jitter
    was drawn a chunk at a time, so the indices changed with ``chunk``)."""
    want = synthetic_topk(40, 8, start_position=100, overlap=overlap, seed=3)
    for chunk in (1, 7, 40):
        got = synthetic_topk(40, 8, start_position=100, overlap=overlap, seed=3, chunk=chunk)
        assert torch.equal(got, want), (overlap, chunk)


@pytest.mark.parametrize(
    ("data", "match"),
    [
        ({"topk": torch.zeros(3, dtype=torch.int32)}, r"d\.pt: topk"),
        ({"topk": torch.zeros(2, 3)}, r"d\.pt: topk"),
        ({"topk": torch.zeros(2, 3, dtype=torch.int32), "valid": torch.zeros(3, dtype=torch.int32)}, r"d\.pt: valid"),
    ],
    ids=["topk-1d", "topk-float", "valid-wrong-length"],
)
def test_load_topk_dump_names_the_file_in_shape_and_dtype_errors(tmp_path, data, match):
    torch.save(data, tmp_path / "d.pt")
    with pytest.raises((ValueError, TypeError), match=match):
        load_topk_dump(tmp_path / "d.pt")


@settings(max_examples=60, deadline=None)
@given(
    t=st.integers(1, 6),
    k=st.integers(1, 12),
    span=st.integers(1, 20),
    seed=st.integers(0, 2**31 - 1),
    with_valid=st.booleans(),
)
def test_first_repeat_finds_the_first_row_listing_a_position_twice(t, k, span, seed, with_valid):
    """Against a per-row set: invalid (negative) entries anywhere and entries past ``valid`` never
    repeat; the first repeating row is named with a position it lists twice."""
    g = torch.Generator().manual_seed(seed)
    topk = torch.randint(-2, span, (t, k), generator=g, dtype=torch.int32)
    valid = torch.randint(0, k + 1, (t,), generator=g, dtype=torch.int32) if with_valid else None
    want = None
    for i in range(t):
        read = [p for p in topk[i, : k if valid is None else int(valid[i])].tolist() if p >= 0]
        twice = sorted({p for p in read if read.count(p) > 1})
        if twice:
            want = (i, twice)
            break
    got = first_repeat(topk, valid)
    if want is None:
        assert got is None
    else:
        assert got is not None and got[0] == want[0] and got[1] in want[1]
