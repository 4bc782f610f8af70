"""Gluon (``triton.experimental.gluon``) kernels for Hopper (sm_90) and their launchers (private: the
public operations live in :mod:`shardattn.ops`). :mod:`~shardattn.kernels.gluon.compat` imports
Gluon once; without it every launcher here says why it cannot run and the callers route elsewhere."""
