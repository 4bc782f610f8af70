"""shardattn.testing"""
