"""The engine's core: one node's requests and their KV blocks, scheduled a step at a time.

``scheduler`` (iteration-level scheduling under a token budget, with the node's ``kv_connector``),
``block_manager`` (paged blocks, prefix cache, copy-on-write), ``sequence`` and ``requests``
(what the scheduler schedules), ``outputs`` (what the engine reports), ``step_budget`` and
``step_stats`` (each step's size and its counts), and ``pool_reservations`` (the core's side of a
KV transfer without a model, for benchmarks and tests). Nothing here runs a model.
"""
