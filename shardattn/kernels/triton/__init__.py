"""Triton kernels and their launchers (private: the public operations live in :mod:`shardattn.ops`)."""
