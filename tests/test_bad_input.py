"""Every public entry point against every kind of bad argument: one table, one test.

Each row of ``ROWS`` names an entry point and a bad argument, and states what it must get (the
rows live in ``tests/bad_input/``: the harness in ``table.py``, the rows by layer in
``kernel_rows.py`` (destinations laid over inputs in ``alias_rows.py``), ``plan_rows.py`` (the
planner's lengths in ``plan_length_rows.py``, its page ledger, cost model, decode routing and
arena in ``plan_state_rows.py``) and
``parallel_rows.py`` (the Runtime's arguments bound to a kind, mode or Runtime in
``runtime_bound_rows.py``, a step's destinations laid over its inputs in
``parallel_alias_rows.py``), GQA prefill's in ``gqa_prefill_rows.py``):

* ``Raises(TypeError | ValueError, match)``: the error names the argument (``match`` is a regex
  on the message), it is raised before any kernel runs (the kernels and references of
  :data:`tests.bad_input.table.KERNELS` are replaced by spies that record calls) and, for distributed steps, before
  any data collective (only the agreement all-gather may have run);
* ``Gives(check)``: a defined result (for instance ``out = 0, lse = -inf`` for rows whose
  indices are all out of range); ``check(result)`` returns ``None`` or what is wrong.

Either way the caller's inputs are left as they were (cloned before, compared after).

Distributed steps and the ``Runtime`` run on a one-rank gloo group of the test worker pool
(``dist_pool.run(..., world_size=1)``); rows travel there by id, so the table is rebuilt in the
worker. Mismatched devices use the ``meta`` device, so no GPU is needed.

The Ray pool's bad requests are not here: ``shardattn/serving.py`` tests its own calls in
``tests/test_ray_pool*.py``. Multi-rank failures (a rank that raises, exits, hangs, or passes a
different plan) are in ``tests/test_faults.py``.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch

from shardattn import plan as P
from shardattn.launch.cli import LaunchError, parse_options
from shardattn.ops import lse_merge as merge_mod
from shardattn.ops import sparse_mla as mla_mod
from tests.bad_input.alias_rows import alias_rows
from tests.bad_input.gqa_prefill_rows import gqa_prefill_rows
from tests.bad_input.kernel_rows import kernel_rows
from tests.bad_input.parallel_alias_rows import parallel_alias_rows
from tests.bad_input.parallel_rows import parallel_rows
from tests.bad_input.plan_length_rows import plan_length_rows
from tests.bad_input.plan_rows import plan_rows
from tests.bad_input.plan_state_rows import plan_state_rows
from tests.bad_input.runtime_bound_rows import runtime_bound_rows
from tests.bad_input.table import (
    INF,
    NAN,
    Gives,
    Raises,
    Row,
    _clone,
    _gen,
    _merge_inputs,
    _merge_without_inf,
    _same,
    spy_kernels,
)

#: The table: rows live in tests/bad_input/ by layer (kernels, planner, parallel steps and Runtime).
ROWS: list[Row] = [
    *kernel_rows(),
    *alias_rows(),
    *plan_rows(),
    *plan_length_rows(),
    *plan_state_rows(),
    *parallel_rows(),
    *parallel_alias_rows(),
    *runtime_bound_rows(),
    *gqa_prefill_rows(),
]
BY_ID = {r.id: r for r in ROWS}
assert len(BY_ID) == len(ROWS), "row ids must be unique"


# -- running one row ----------------------------------------------------------------------------


def run_row(group: Any, row_id: str) -> dict[str, Any]:
    """Build and run one row (here, or on a rank of the worker pool); report what happened."""
    row = BY_ID[row_id]
    call = row.build(group)
    before = _clone((call.args, call.kwargs))
    report: dict[str, Any] = {"error": None, "message": "", "check": None}
    with spy_kernels() as called:
        try:
            result = call.fn(*call.args, **call.kwargs)
        except Exception as e:  # every exception is reported; the test decides
            report["error"], report["message"] = type(e).__name__, str(e)
            report["is_expected_kind"] = isinstance(row.expect, Raises) and isinstance(e, row.expect.kind)
        else:
            report["check"] = row.expect.check(result) if isinstance(row.expect, Gives) else "no error raised"
    report["kernels"] = list(called)
    report["inputs_unchanged"] = _same(before, (call.args, call.kwargs))
    report["collectives"] = {k: v for k, v in call.comm.counts.items() if k != "agreement"} if call.comm else {}
    return report


@pytest.mark.parametrize("row_id", [r.id for r in ROWS])
def test_bad_input(row_id: str, dist_pool: Any) -> None:
    row = BY_ID[row_id]
    report = dist_pool.run(run_row, row_id, world_size=1)[0] if row.dist else run_row(None, row_id)
    assert report["inputs_unchanged"], "the call modified the caller's inputs"
    if isinstance(row.expect, Raises):
        assert report["error"] is not None, f"no error raised (check: {report['check']})"
        assert report["is_expected_kind"], f"{report['error']}: {report['message']}"
        assert re.search(row.expect.match, report["message"]), report["message"]
        assert report["kernels"] == [], f"kernels ran before the error: {report['kernels']}"
        assert report["collectives"] == {}, f"collectives ran before the error: {report['collectives']}"
    else:
        assert report["error"] is None, f"{report['error']}: {report['message']}"
        assert report["check"] is None, report["check"]


# -- the launcher's options: a bad option exits with status 2 and one line ------------------------

LAUNCH_ROWS = [
    (["--mode", "ring"], r"argument --mode: invalid choice: 'ring'"),
    (["--tokens", "-5"], r"--tokens must be >= 1, got -5"),
    (["--timeout", "nan"], r"--timeout must be"),
    (["--timeout", "inf"], r"--timeout must be"),
    (["--topk", "0"], r"--topk must be >= 1"),
    (["--dtype", "int8"], r"argument --dtype: invalid choice"),
    (["--device", "tpu"], r"argument --device: invalid choice"),
    (["--fail-rank", "-1"], r"--fail-rank must be >= 0"),
    (["--interleave", "0"], r"--interleave must be >= 1"),
    (["--q-len", "1,x"], r"expected comma-separated integers"),
    (["--warmup", "-1"], r"--warmup must be >= 0"),
]


@pytest.mark.parametrize(("argv", "match"), LAUNCH_ROWS, ids=[" ".join(a) for a, _ in LAUNCH_ROWS])
def test_bad_launch_option(argv: list[str], match: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(LaunchError, match=match) as info:
        parse_options(argv)
    assert info.value.status == 2 and "\n" not in str(info.value)
    from shardattn.launch.__main__ import main

    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("shardattn.launch: error: "), err


def test_table_covers_every_public_kernel_and_plan_function() -> None:
    """A new public planner function gets rows in the table, or the test names what is missing.

    (Planner classes built by these functions, such as ShardPlan and PCPPlan, are not listed;
    DCPLayout and ModelSpec, which users build, are.)
    """
    covered = {r.id.split("-")[0] for r in ROWS}
    plan_functions = {n for n in P.__all__ if callable(getattr(P, n)) and not isinstance(getattr(P, n), type)}
    missing = (plan_functions | {"DCPLayout", "ModelSpec"}) - covered
    assert not missing, f"plan functions without a row: {sorted(missing)}"
    kernels = {
        "sparse_mla_attention", "sparse_mla_grouped_prefill", "sparse_mla_decode", "gqa_paged_decode",
        "lse_merge", "convert_topk", "build_union", "split_partials", "gqa_prefill",
    }  # fmt: skip
    assert kernels <= covered, sorted(kernels - covered)
    steps = {
        "shardq_prefill", "dcp_sparse_mla_decode", "dcp_gqa_decode", "pcp_prefill", "collect_partials",
        "gqa_prefill_head_tp", "gqa_prefill_pcp",
    }  # fmt: skip
    assert steps | {"Runtime", "Runtime.prefill", "Runtime.decode"} <= covered


def interpreted_pos_inf_merge() -> None:
    """Runs under ``TRITON_INTERPRET=1`` (a subprocess): the Triton merge equals the reference."""
    from shardattn.ops.dispatch import use_triton

    outs, lses = _merge_inputs()
    assert use_triton(outs), "the interpreter is not on"
    with spy_kernels() as called:
        out, lse = merge_mod.lse_merge(outs, lses)
    assert called == ["shardattn.ops.lse_merge.launch_lse_merge"], called
    want_out, want_lse = _merge_without_inf()
    assert not bool(out.isnan().any()) and torch.equal(lse.isneginf(), want_lse.isneginf())
    torch.testing.assert_close(out, want_out, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(lse, want_lse, atol=1e-6, rtol=1e-6)
    print("ok")


@pytest.mark.interpret
def test_lse_merge_pos_inf_is_empty_on_the_triton_kernel() -> None:
    """The Triton merge kernel reads +inf as an empty partial, like the reference (it gave NaN)."""
    from shardattn.ops.dispatch import triton_available
    from shardattn.testing.interpret import run_interpreted

    if not triton_available():
        pytest.skip("triton is not installed")
    assert run_interpreted(__name__, "interpreted_pos_inf_merge", timeout=300).strip().endswith("ok")


# -- regression tests of bad inputs a user met (also rows of the table above) ---------------------


def _dsa_step(t: int = 2, d: int = 576) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = _gen(11)
    return (
        torch.randn(t, 4, d, generator=g),
        torch.randn(9, 576, generator=g),
        torch.tensor([[0, 5, -1], [8, 2, 2]], dtype=torch.int32),
    )


@pytest.mark.parametrize("scale", [NAN, INF, -INF, 0.0, -0.05], ids=["nan", "inf", "-inf", "zero", "negative"])
def test_scale_that_is_not_finite_and_positive_is_refused(scale: float) -> None:
    q, kv, rows = _dsa_step()
    with pytest.raises(ValueError, match=r"^scale must be a finite number > 0"):
        mla_mod.sparse_mla_attention(q, kv, rows, scale=scale)


def test_kv_cache_without_rows_gives_empty_rows_not_index_error() -> None:
    q, _, rows = _dsa_step()
    out, lse = mla_mod.sparse_mla_attention(q, torch.zeros(0, 576), rows, scale=576**-0.5)
    assert out.shape == (2, 4, 512) and bool((out == 0).all()) and bool(lse.isneginf().all())


def test_q_of_the_wrong_width_is_blamed_on_q() -> None:
    q, kv, rows = _dsa_step(d=500)
    with pytest.raises(ValueError, match=r"^q must have last dim 576 \(kv's row width\), got 500"):
        mla_mod.sparse_mla_attention(q, kv, rows, scale=576**-0.5)


def test_pos_inf_lse_merges_as_an_empty_partial() -> None:
    outs, lses = _merge_inputs()
    out, lse = merge_mod.lse_merge(outs, lses)
    want_out, want_lse = _merge_without_inf()
    assert not bool(out.isnan().any()) and not bool(lse.isnan().any())
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)
