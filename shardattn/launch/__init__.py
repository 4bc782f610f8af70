"""shardattn.launch: the only part of the library that creates process groups or Ray actors.

* ``python -m shardattn.launch`` (under torchrun): synthetic steps on every rank, a per-rank
  table, ``--check`` against the single-process reference (:mod:`~shardattn.launch.__main__`,
  options in :mod:`~shardattn.launch.cli`, the per-rank run in :mod:`~shardattn.launch.runner`).
* :mod:`~shardattn.launch.process_group`  groups with a timeout, from torchrun's environment.
* :mod:`~shardattn.launch.workloads`      synthetic prefill / decode steps, identical on every rank.
* :mod:`~shardattn.launch.report`         the rich table and the JSON report.
* :mod:`~shardattn.serving`            :class:`~shardattn.serving.RayRankPool`, a servable Ray pool
  (optional Ray; also importable from :mod:`~shardattn.serving`).

Importing this package imports nothing heavy, so a bad command-line option fails fast.
"""
