"""shardattn.kernels"""
