"""Move a prompt's paged KV blocks from a prefill node to a decode node over ZeroMQ.

Modules, one job each:

- ``messages``  torch-free wire messages (msgpack header + raw frames), strict decoding
- ``channel``   the ZeroMQ sockets (DEALER on the prefill side, ROUTER on the decode side)
- ``sender``    ``KVSender``: reserve → chunks under a credit window → done → ack
- ``receiver``  ``KVReceiver``: grants from the node's BlockManager, lands chunks, deadlines
- ``staging``   the sender's staging ring (shared memory for same-host peers)
- ``tensors``   pack/unpack a layer's blocks (host or device memory), checksums, int8 wire format
- ``errors``    typed failures (rejected, timed out, aborted)

Chunking: one chunk is one layer's K and V for a run of the request's blocks (a whole layer
unless it exceeds ``max_chunk_bytes``), so a prefill node can stream layer by layer as it
computes. Frames are checked with xxh3_64. See the sender and receiver docstrings for the
message sequence and deadlines.

This package's ``__init__`` stays torch-free (the router imports ``kv_transfer.messages``):
import ``KVSender`` from ``kv_transfer.sender`` and ``KVReceiver`` from ``kv_transfer.receiver``.
"""
