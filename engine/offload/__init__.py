"""KV blocks beyond the device pool: a folder that outlives the node (``disk``), and what the
node's KV connector asks of it (``tiers``). The scheduler's loop never learns of them: the
connector answers its three questions (engine/core/kv_connector.py) with the tier's blocks too.
"""
