"""shardattn.ops: the public single-GPU operations (validation, dispatch, torch references).

* :mod:`~shardattn.ops.gqa_prefill`  :func:`~shardattn.ops.gqa_prefill.gqa_prefill`: GQA prefill
  (varlen, causal, cached prefix in a paged cache, sinks, left window) on FA4 or the torch reference.
"""
