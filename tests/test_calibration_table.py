"""A calibration table as a file: every field of its JSON type, no unknown or misspelt name, every
rate finite, only tiles and group sizes the kernels run. A table that breaks any of it is refused
when it is read (a ``ValueError`` naming the field; :func:`load_calibration` warns and takes the
conservative table) instead of pricing steps at NaN, recursing, or silently using defaults. The
cost model's own arguments are checked before it prices anything."""

from __future__ import annotations

import json
import math
from collections.abc import Callable

import pytest

from shardattn.plan.calibration import CONSERVATIVE, Calibration, CalibrationWarning, load_calibration
from shardattn.plan.cost import CollectiveRate, CostModel
from shardattn.plan.step_shape import StepShape


def _table() -> dict:
    return json.loads(CONSERVATIVE.to_json())


def _parent(d: dict, path: str) -> tuple:
    """The container holding ``path``'s last part (dots; a list's index as a number) and its key."""
    *parents, last = path.split(".")
    node: object = d
    for p in parents:
        node = node[int(p)] if isinstance(node, list) else node[p]  # type: ignore[index]
    return node, int(last) if isinstance(node, list) else last


def _set(path: str, value: object) -> Callable[[dict], None]:
    """A mutation setting ``path`` to ``value``."""

    def mutate(d: dict) -> None:
        node, key = _parent(d, path)
        node[key] = value

    return mutate


def _drop(path: str) -> Callable[[dict], None]:
    def mutate(d: dict) -> None:
        node, key = _parent(d, path)
        del node[key]

    return mutate


def _rename_step(old: str, new: str) -> Callable[[dict], None]:
    return lambda d: d["steps"].__setitem__(new, d["steps"].pop(old))


def _point(**changes: object) -> Callable[[dict], None]:
    def mutate(d: dict) -> None:
        d["kernels"].append({**d["kernels"][0], **changes})

    return mutate


BAD = [
    ("a-number-as-string", _set("kernels.0.ms", "2.149"), r"kernels|ms must be a finite number"),
    ("tokens-as-string", _set("kernels.0.tokens", "4096"), r"tokens must be an integer"),
    ("tokens-as-bool", _set("kernels.0.tokens", True), r"tokens must be an integer"),
    ("latency-infinite", _set("collectives.0.latency_ms", math.inf), r"latency_ms must be a finite number"),
    ("busbw-infinite", _set("collectives.0.busbw_gbps", math.inf), r"busbw_gbps must be a finite number"),
    ("factor-infinite", _set("steps.shardq.factor", math.inf), r"factor must be a finite number"),
    ("union-ratio-infinite", _set("union_ratio.8", math.inf), r"union_ratio must map"),
    ("union-ratio-key", _set("union_ratio.eight", 1.4), r"union_ratio must map a group size"),
    ("unknown-top-level", _set("netwrok", {"name": "x"}), r"unknown field\(s\) \['netwrok'\]"),
    ("misspelt-step", _rename_step("shardq", "sharq"), r"bad step overhead 'sharq'"),
    ("misspelt-op", _set("collectives.0.op", "alltoall"), r"op must be one of"),
    ("missing-steps", _drop("steps"), r"missing field\(s\) \['steps'\]"),
    ("partial-step", _drop("steps.shardq.factor"), r"steps.shardq: missing field\(s\) \['factor'\]"),
    ("unknown-step-field", _set("steps.shardq.fixed", 0.8), r"steps.shardq: unknown field"),
    ("conservative-string", _set("conservative", "false"), r"conservative must be true or false"),
    ("format-bool", _set("format", True), r"format must be an integer"),
    ("format-3", _set("format", 3), r"format 3, expected one of"),
    ("tile-128", _set("kernels.0.tile", 128), r"tile must be 64"),
    ("group-size-3", _point(heads=8, group_size=3), r"group_size one whose queries fit"),
    ("64-heads-in-groups-of-8", _point(heads=64, group_size=8), r"\(1,\) at 64 heads"),
    ("network-not-object", _set("network", 5), r"network must be a JSON object"),
    ("network-misspelt", _set("network", {"name": "x", "latency_ms": 0.01, "busbw": 5.0}), r"network: unknown"),
    ("kernels-not-list", _set("kernels", {}), r"kernels must be a JSON array"),
    ("rank-per-node-float", _set("collectives.0.ranks_per_node", 1.0), r"ranks_per_node must be an integer or null"),
    (
        "collective-twice",
        lambda d: d["collectives"].append({**d["collectives"][0], "busbw_gbps": 1.0}),
        r"a second rate of all_to_all at this world_size",
    ),
]


@pytest.mark.parametrize(("mutate", "match"), [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_a_malformed_table_is_refused_naming_the_field(tmp_path, mutate, match) -> None:
    d = _table()
    mutate(d)
    text = json.dumps(d)  # json writes inf as Infinity, as a table written by Python would hold it
    with pytest.raises(ValueError, match=match):
        Calibration.from_json(text)
    path = tmp_path / "table.json"
    path.write_text(text)
    with pytest.warns(CalibrationWarning, match="is unusable"):
        assert load_calibration(None, path) is CONSERVATIVE


def test_optional_fields_may_be_absent() -> None:
    d = _table()
    for k in ("source", "conservative", "network"):
        d.pop(k, None)
    del d["kernels"][0]["kv_format"], d["steps"]["shardq"]["hidden"]
    d["collectives"][0].pop("ranks_per_node", None)
    cal = Calibration.from_json(json.dumps(d))
    assert cal.kernels[0].kv_format == "bfloat16" and cal.steps["shardq"].hidden == 0.0 and not cal.conservative


@pytest.mark.parametrize(
    ("call", "exc", "match"),
    [
        (lambda m: m.kernel_ms(-64, 4096, 2048), ValueError, r"^heads must be >= 1"),
        (lambda m: m.kernel_ms(64, -4096, 2048), ValueError, r"^tokens must be >= 0"),
        (lambda m: m.kernel_ms(64, 4096, 2048.0), TypeError, r"^topk must be an int"),
        (lambda m: m.collective_ms("all_reduce", 1e6, 2), ValueError, r"^op must be one of"),
        (lambda m: m.collective_ms("all_to_all", 1e6, -3), ValueError, r"^world_size must be >= 1"),
        (lambda m: m.collective("all_gather", 8, 0), ValueError, r"^ranks_per_node must be >= 1"),
    ],
    ids=["heads", "tokens", "topk-float", "op", "world-size", "ranks-per-node"],
)
def test_cost_model_parts_check_their_arguments(call, exc, match) -> None:
    with pytest.raises(exc, match=match):
        call(CostModel(CONSERVATIVE))


@pytest.mark.parametrize(
    ("overrides", "exc", "match"),
    [
        ({"all_to_all": CollectiveRate("all_to_all", 2, 0.01, -5.0)}, ValueError, r"bus bandwidth > 0"),
        ({"all_to_all": CollectiveRate("all_to_all", 2, 0.01, 0.0)}, ValueError, r"bus bandwidth > 0"),
        ({"all_to_all": (0.01, 5.0)}, TypeError, r"must be a CollectiveRate of op 'all_to_all'"),
        ({"alltoall": CollectiveRate("all_to_all", 2, 0.01, 5.0)}, ValueError, r"op must be one of"),
        ({"all_gather": CollectiveRate("all_to_all", 2, 0.01, 5.0)}, TypeError, r"of op 'all_gather'"),
        ([CollectiveRate("all_to_all", 2, 0.01, 5.0)], TypeError, r"must be a dict"),
    ],
    ids=["negative", "zero", "tuple", "misspelt-op", "other-op", "list"],
)
def test_collective_overrides_are_checked_when_the_model_is_made(overrides, exc, match) -> None:
    with pytest.raises(exc, match=match):
        CostModel(CONSERVATIVE, collective_overrides=overrides)


@pytest.mark.parametrize(("rank_tokens", "match"), [(0, r">= 16384"), (16383, r">= 16384"), (32769, r"<= 32,768")])
def test_a_step_shapes_rank_tokens_lie_between_the_even_share_and_all(rank_tokens, match) -> None:
    with pytest.raises(ValueError, match=rf"^StepShape.rank_tokens must be {match}"):
        StepShape(heads=64, world_size=2, tokens=32768, topk=2048, rank_tokens=rank_tokens)
    StepShape(heads=64, world_size=2, tokens=32768, topk=2048, rank_tokens=16384)
    StepShape(heads=64, world_size=2, tokens=0, topk=2048, rank_tokens=0)
