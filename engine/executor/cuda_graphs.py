"""CUDA graphs for decode-only steps: one captured forward per padded batch size.

A decode step of n sequences runs in the graph of the smallest captured size >= n. Its inputs are
copied into static buffers the graph was captured on; the rows past n are padding that the
kernels skip: slot -1 (the KV write writes nothing) and context length 0 (decode attention reads
nothing and returns zeros). Block tables have the full width of max_model_len, so the decode
kernel's grid and partition count are the same on every replay; a partition past a sequence's
context reads and writes nothing (kernels/paged_decode.py), so short contexts pay one load per
empty program, not the full width's work.

Steps with prefill rows, batches above the largest size, MoE models (their routing syncs with the
host: engine/layers/moe.py) and ``--enforce-eager`` run eagerly. ``capture=False`` runs the same
padded forward eagerly: that is how the CPU tests check that padding changes no real row.
"""

from __future__ import annotations

import torch

from pdserve.engine.executor.attention import AttentionMetadata

SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


def why_eager(platform_kind: str, enforce_eager: bool, runner) -> str | None:
    """Why an engine's decode steps run eagerly; None where graphs capture them."""
    if platform_kind != "cuda":
        return "not CUDA"
    if enforce_eager:
        return "enforce_eager"
    if runner.has_host_routing:
        return "MoE routes on the host"
    return "torch attention" if runner.attention_backend == "torch" else None


def capture_sizes(max_num_seqs: int) -> list[int]:
    return [s for s in SIZES if s < max_num_seqs] + [max_num_seqs]


class DecodeGraphs:
    def __init__(self, runner, max_num_seqs: int, max_model_len: int, capture: bool) -> None:
        self.runner = runner
        self.sizes = capture_sizes(max_num_seqs)
        dev, n = runner.platform.device, self.sizes[-1]
        self.width = -(-max_model_len // runner.block_size)
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(n, dtype=torch.int64, device=dev)
        self.slots = torch.full((n,), -1, dtype=torch.int64, device=dev)
        self.tables = torch.zeros((n, self.width), dtype=torch.int32, device=dev)
        self.lens = torch.zeros(n, dtype=torch.int32, device=dev)
        self.q_start = torch.arange(n + 1, dtype=torch.int32, device=dev)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        if capture:
            self._capture()

    def padded_size(self, num_seqs: int) -> int | None:
        return next((s for s in self.sizes if s >= num_seqs), None)

    def _meta(self, size: int) -> AttentionMetadata:
        tables, lens = self.tables[:size], self.lens[:size]
        return AttentionMetadata(
            slot_mapping=self.slots[:size],
            num_decode_tokens=size,
            decode_block_tables=tables,
            decode_context_lens=lens,
            prefill_block_tables=tables[:0],
            prefill_query_start_loc=self.q_start[:1],
            prefill_context_lens=lens[:0],
            block_tables=tables,
            query_start_loc=self.q_start[: size + 1],
            context_lens=lens,
            backend=self.runner.attention_backend,
        )

    def _forward(self, size: int) -> torch.Tensor:
        r = self.runner
        return r.model(self.input_ids[:size], self.positions[:size], r.kv_caches, self._meta(size))

    def _capture(self) -> None:
        # Largest first, sharing one memory pool: the smaller graphs reuse its blocks.
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                self._forward(size)  # warm-up: Triton compiles and autotunes outside the capture
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self._forward(size)
            self.graphs[size] = (graph, out)
        torch.cuda.synchronize()

    def run(self, input_ids, positions, meta: AttentionMetadata) -> torch.Tensor:
        """The hidden states [n, hidden] of a decode-only step of n <= sizes[-1] rows."""
        n = input_ids.shape[0]
        size = self.padded_size(n)
        assert size is not None and meta.num_decode_tokens == n
        width = meta.decode_block_tables.shape[1]
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slots[:n].copy_(meta.slot_mapping)
        self.tables[:n, :width].copy_(meta.decode_block_tables)
        self.tables[:n, width:].zero_()
        self.lens[:n].copy_(meta.decode_context_lens)
        # padding: written nowhere, attends to nothing (and token 0 at position 0 to embed)
        self.input_ids[n:size].zero_()
        self.positions[n:size].zero_()
        self.slots[n:size].fill_(-1)
        self.lens[n:size].zero_()
        if size in self.graphs:
            graph, out = self.graphs[size]
            graph.replay()
            return out[:n]
        return self._forward(size)[:n]
