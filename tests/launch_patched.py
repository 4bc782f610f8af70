"""Run the launcher with test-only replacements, one rank per process (tests/test_launch_e2e.py).

    python -m tests.launch_patched PATCH [launcher options ...]

``PATCH``:

* ``oracle``: the launcher's ``--check`` compares with the independent fp64 oracles of
  tests/oracle.py instead of the library's references (and the workload derives its global rows
  with the oracle's top-k conversion), so a check that passes measures the steps against code
  they share nothing with.
* ``corrupt-prefill``: the sparse-MLA kernel the Runtime's prefill calls returns its output
  plus 0.5; ``--check`` must fail.

No environment variable selects anything: the patch is the first argument.
"""

from __future__ import annotations

import sys

import torch


def _replace(module: object, name: str, fn: object) -> None:
    """Replace ``module.name``; a name the module no longer has fails loudly (never a silent no-op)."""
    if not hasattr(module, name):
        raise AttributeError(f"{module.__name__} has no {name!r} to replace: update tests/launch_patched.py")
    setattr(module, name, fn)


def _oracle() -> None:
    from shardattn.launch import prepare, workloads
    from tests.oracle import gqa_oracle, gqa_prefill_oracle, sparse_mla_oracle, topk_rows_oracle

    def sparse_mla_reference(q, kv, rows, *, scale, v_dim, **kw):
        out, lse = sparse_mla_oracle(q, kv, rows, scale=scale, v_dim=v_dim, **kw)
        return out.to(q.device), lse.to(q.device)

    def gqa_paged_decode_reference(q, k_cache, v_cache, block_table, seq_lens, cu_q_lens, *, scale, **kw):
        out, lse = gqa_oracle(q, k_cache, v_cache, block_table, seq_lens, cu_q_lens.tolist(), scale=scale, **kw)
        return out.to(q.device), lse.to(q.device)

    def gqa_prefill(q, k, v, cu, *, k_cache, v_cache, block_table, prefix_lens, sinks, scale, window_left, **kw):
        lens = (cu[1:] - cu[:-1]).tolist()
        out, lse = gqa_prefill_oracle(
            q, k, v, lens, scale=scale, prefix_lens=prefix_lens.tolist(), k_cache=k_cache, v_cache=v_cache,
            block_table=block_table.cpu(), sinks=sinks, window_left=window_left,
        )  # fmt: skip
        return out.to(q.device), lse.to(q.device)

    def convert_topk(topk_pos, req_ids, block_table, *, block_size, **kw):
        rows = topk_rows_oracle(topk_pos, req_ids, block_table, block_size=block_size, **kw).to(topk_pos.device)
        return rows, (rows >= 0).sum(dim=1, dtype=torch.int32)

    _replace(prepare, "sparse_mla_reference", sparse_mla_reference)
    _replace(prepare, "gqa_paged_decode_reference", gqa_paged_decode_reference)
    _replace(prepare, "gqa_prefill", gqa_prefill)
    _replace(workloads, "convert_topk", convert_topk)


def _corrupt_prefill() -> None:
    from shardattn.runtime import prefill as prefill_attention

    kernel = prefill_attention.sparse_mla_grouped_prefill

    def corrupted(*args, **kw):
        out, lse = kernel(*args, **kw)
        return out.add_(0.5), lse  # in place: the step may have passed its own destination buffer

    _replace(prefill_attention, "sparse_mla_grouped_prefill", corrupted)


PATCHES = {"oracle": _oracle, "corrupt-prefill": _corrupt_prefill}


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in PATCHES:
        print(f"usage: python -m tests.launch_patched {{{','.join(PATCHES)}}} [launcher options]", file=sys.stderr)
        return 2
    PATCHES[argv[0]]()
    from shardattn.launch.__main__ import main as launch

    return launch(argv[1:])


if __name__ == "__main__":
    from shardattn.launch.__main__ import exit_now

    exit_now(main(sys.argv[1:]))
