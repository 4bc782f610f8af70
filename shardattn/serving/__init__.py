"""shardattn.serving: serving across processes of one host (the Ray pool's transport pieces).

* :mod:`~shardattn.serving.doorbell`  :class:`~shardattn.serving.doorbell.Doorbell`: a named pipe
  that wakes a process and orders the memory it reads after the writer's stores, on any CPU.
"""
