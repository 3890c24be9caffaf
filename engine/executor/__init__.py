"""The engine's executor: each step run on the node's tensor-parallel ranks.

``executor`` (rank 0's side, which owns the worker processes), ``worker`` (a rank's handlers, and
a worker process's entry point), ``rank_messages`` (the typed calls between them), ``model_runner``
(a rank's model, KV pool and forward pass), ``attention`` (a step's attention metadata),
``rank_pools`` (each rank's KV pool), ``parallel`` (the group and its collectives), ``platform``
(what differs between devices), ``cuda_graphs`` and ``kv_prefault`` (the pool's pages).
"""
