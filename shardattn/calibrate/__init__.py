"""Measure the cost model's calibration table on this machine: ``python -m shardattn.calibrate``.

Usage (one rank per GPU; the collectives and the step overheads are measured at this world
size, the kernels split over the ranks)::

    torchrun --nproc-per-node 2 -m shardattn.calibrate --out h200.json
    python -m shardattn.calibrate --out one_gpu.json      # one rank: kernels only
    torchrun --nnodes 2 --node-rank N --nproc-per-node 8 --master-addr HOST -m shardattn.calibrate --out 2x8.json

What it measures (a few minutes on an H200, with a progress bar on rank 0):

1. kernel points (:mod:`~shardattn.calibrate.kernels`): the prefill kernel call at each head
   count, each group size that fits the tile and each token count, on the launcher's synthetic
   step (DSA-like top-k), with the union ratio of its top-k; ``--passes`` passes over all
   points (default 3), each point keeping its median pass;
2. the device copy rate, and the all-to-all / all-gather rates of the group (latency and bus
   bandwidth); on two or more hosts (torchrun's agents) also the network between them and the
   first host's own rates (:mod:`~shardattn.calibrate.network`), so the cost model prices
   exchanges across hosts at measured rates;
3. whole head-TP and ShardQ steps (:mod:`~shardattn.calibrate.steps`) of two configurations,
   whose time beyond the kernel and the predicted collectives gives each step's overhead
   (``fixed_ms`` and ``factor`` of :class:`~shardattn.plan.cost.StepOverhead`).

The table is JSON (:class:`~shardattn.plan.cost.Calibration`); pass it to a Runtime
(``cost_model="file.json"``) or the launcher (``--calibration``). The model itself and the table
loading live in :mod:`shardattn.plan.cost` (pure host code).
"""

from shardattn.calibrate.fit import fit_step_overhead

__all__ = ["fit_step_overhead"]
