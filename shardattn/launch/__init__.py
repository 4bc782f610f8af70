"""shardattn.launch: the command-line launcher and the process groups it creates (with
:mod:`shardattn.serving` and :mod:`shardattn.testing`, the only parts of the library that create
process groups or Ray actors).

* ``python -m shardattn.launch`` (under torchrun): synthetic steps on every rank, a per-rank
  table, ``--check`` against the single-process reference (:mod:`~shardattn.launch.__main__`,
  options in :mod:`~shardattn.launch.cli`, the per-rank run in :mod:`~shardattn.launch.runner`).
* :mod:`~shardattn.launch.process_group`  groups with a timeout, from torchrun's environment.
* :mod:`~shardattn.launch.workloads`      synthetic prefill / decode steps, identical on every rank.
* :mod:`~shardattn.launch.report`         the rich table and the JSON report.
* :mod:`~shardattn.launch.local`          ``run_ranks``: a function on every rank of a small local
  world (the examples); the servable Ray pool is :mod:`shardattn.serving`'s (optional Ray).

Importing this package imports nothing heavy, so a bad command-line option fails fast.
"""
