"""shardattn: sharded sparse attention (sparse MLA and GQA) for LLM inference across GPUs.

Parts (see docs/ARCHITECTURE.md):

* :mod:`shardattn.plan`     pure CPU planning: zigzag splits, DCP/PCP layouts, workspace, routing,
  CUDA-graph policy.
* :mod:`shardattn.kernels`  one module per operation: Triton kernel, launcher and torch reference.
* :mod:`shardattn.parallel` torch.distributed steps (ShardQ, DCP, PCP), the collector and the Runtime.
* :mod:`shardattn.launch`   ``torchrun -m shardattn.launch``, workloads, reports, the Ray pool.
"""

__version__ = "0.1.0"
