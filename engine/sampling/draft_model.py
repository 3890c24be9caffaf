"""Draft tokens from a smaller model with the target's tokenizer (``--speculative-model DIR``).

The draft model runs in an engine of its own, in this process, with its own paged KV pool and
block manager: the target's pool, block tables and prefix cache never hold a draft token. Each
step, every sequence the speculator gives drafts to becomes one greedy request of the draft
engine (its tokens so far as the prompt, ``k`` tokens out), and the draft engine runs until all
of them are done: one batched prefill of what it has not cached, then k - 1 batched decodes.

    target tokens:  [t0 t1 ... t37 | t38 t39]      t38, t39: kept since the draft's last step
    draft engine:   [cached blocks ][recompute][d1 d2 ... dk]
                     prefix cache    <1 block + new tokens, then k greedy tokens

The draft engine keeps no sequence between steps. Its prefix cache holds each sequence's full
blocks, so a step recomputes at most a block's worth of tokens plus the ones the target kept
since: what the target rejected never needs rolling back here, because it was never kept. The
drafts only decide which tokens the target's one forward pass verifies; the target's own
sampler decides every output token (engine/sampling/speculation.py), so a draft model, good or bad,
never changes the output.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import pathlib
import time
from collections.abc import Callable

import torch

from pdserve.engine.config import EngineConfig, ModelConfig
from pdserve.engine.core.sequence import Sequence
from pdserve.engine.machine.sizing import DraftNeeds
from pdserve.engine.models import build_model
from pdserve.engine.sampling.speculation import Speculator
from pdserve.protocol.kv_layout import KVCacheSpec
from pdserve.protocol.sampling_params import SamplingParams

MAX_DRAFT_STEPS = 100_000  # a draft round that has not ended by then is a bug, not a slow step


def speculator_for(
    config: EngineConfig,
    model: ModelConfig,
    num_blocks: int,
    num_threads: int,
    max_model_len: int,
    build_engine: Callable[[EngineConfig], object],
) -> Speculator | None:
    """The engine's speculator for ``--speculative`` or ``--speculative-model`` (None without);
    the latter with a draft engine of its own, built by ``build_engine`` (LLMEngine) from
    ``draft_engine_config`` with the target engine's pool size, threads and context."""
    if config.speculative_method is None:
        return None
    draft = None
    if config.speculative_method == "draft":
        if config.speculative is not None:
            raise ValueError(
                "speculative_model: a draft model proposes instead of ngram; give --speculative "
                "ngram or --speculative-model, not both"
            )
        assert config.speculative_model is not None  # what speculative_method "draft" means
        draft_config = draft_model_config(config.speculative_model)
        check_same_tokenizer(model, draft_config)
        limits = (num_blocks, num_threads, min(max_model_len, draft_config.max_position_embeddings))
        draft = DraftModel(build_engine(draft_engine_config(config, *limits)))
    return Speculator(config.num_speculative_tokens, draft)


def draft_engine_config(
    target: EngineConfig, num_target_blocks: int, num_threads: int, max_model_len: int
) -> EngineConfig:
    """The draft engine's settings: the target's device, dtype, block size and batch limits; a
    pool of as many tokens as the target's (it never holds more sequences than the target runs,
    each for as many tokens, plus k drafts each) committed only as it is used; the target's
    thread count, fixed (the target's share of the CPUs decides it for both); ``max_model_len``:
    the shorter of the two models' contexts."""
    assert target.speculative_model is not None
    return EngineConfig(
        model=target.speculative_model,
        dtype=target.dtype,
        device=target.device,
        block_size=target.block_size,
        num_kv_blocks=num_target_blocks + draft_extra_blocks(target),
        max_num_batched_tokens=target.max_num_batched_tokens,
        max_num_seqs=target.max_num_seqs,
        max_model_len=max_model_len,
        num_threads=num_threads,
        kv_commit="lazy",
        attention_backend=target.attention_backend,
        debug_checks=target.debug_checks,
        enforce_eager=target.enforce_eager,
    )


def draft_extra_blocks(target: EngineConfig) -> int:
    """The draft pool's blocks beyond the target's count: k drafts and a token for each sequence."""
    return target.max_num_seqs * math.ceil((target.num_speculative_tokens + 1) / target.block_size)


def draft_needs(target: EngineConfig, dtype: torch.dtype) -> DraftNeeds | None:
    """What the target's ``--speculative-model`` takes of its device share (None without one): its
    weights counted on the meta device (nothing allocated), its pool's blocks from its config."""
    if target.speculative_method != "draft":
        return None
    assert target.speculative_model is not None
    draft = draft_model_config(target.speculative_model)
    model = build_model(draft, draft.max_position_embeddings, dtype, torch.device("meta"))
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    spec = KVCacheSpec(
        draft.num_layers, 1, target.block_size, draft.num_kv_heads, draft.head_dim, target.kv_dtype
    )
    return DraftNeeds(weight_bytes, spec.bytes_per_block, draft_extra_blocks(target))


def draft_model_config(path: str) -> ModelConfig:
    """The draft model's config; a ValueError names the flag that gave the folder."""
    try:
        return ModelConfig.from_path(path)
    except ValueError as exc:
        raise ValueError(f"speculative_model: {exc}") from None


def check_same_tokenizer(target: ModelConfig, draft: ModelConfig) -> None:
    """A draft's token ids must mean the target's tokens: the vocabularies must be the same size,
    and where both folders ship a tokenizer.json, the same. ValueError naming the flag else."""
    if draft.vocab_size != target.vocab_size:
        raise ValueError(
            f"speculative_model: {draft.path} has a vocabulary of {draft.vocab_size} tokens, the "
            f"model {target.vocab_size}; a draft model needs the model's tokenizer"
        )
    files = [pathlib.Path(m.path) / "tokenizer.json" for m in (target, draft)]
    if all(f.is_file() for f in files):
        vocabs = [_vocabulary(f) for f in files]
        if vocabs[0] != vocabs[1]:
            raise ValueError(
                f"speculative_model: {draft.path}'s tokenizer.json differs from the model's; a "
                "draft model needs the model's tokenizer"
            )


def _vocabulary(path: pathlib.Path) -> tuple[object, object]:
    spec = json.loads(path.read_text())
    return spec.get("model", {}).get("vocab"), [t.get("content") for t in spec.get("added_tokens", [])]


@dataclasses.dataclass(slots=True)
class DraftStats:
    """The draft engine's work since start (benchmarks read it; /metrics has the acceptance)."""

    rounds: int = 0  # propose calls that ran the draft engine
    steps: int = 0  # draft engine steps
    seconds: float = 0.0  # time in the draft engine


class DraftModel:
    """Greedy drafts from a draft engine (an ``LLMEngine`` over the draft model, built by the
    target engine with ``draft_engine_config``)."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.max_model_len: int = engine.max_model_len
        self.stats = DraftStats()
        self._ids = itertools.count()

    def propose(self, wanted: list[tuple[Sequence, int]]) -> dict[int, list[int]]:
        """Up to ``k`` greedy draft tokens after each sequence's tokens, for each (sequence, k) of
        ``wanted``; keyed by seq_id. A sequence whose drafts would pass the draft model's context
        gets fewer, or none."""
        start = time.perf_counter()
        pending: dict[str, int] = {}  # draft request id -> the target sequence's seq_id
        for seq, k in wanted:
            k = min(k, self.max_model_len - seq.num_tokens)
            if k <= 0:
                continue
            request_id = f"draft-{next(self._ids)}"
            params = SamplingParams(temperature=0.0, max_tokens=k, ignore_eos=True)
            try:
                self.engine.add_request(request_id, list(seq.token_ids), params)
            except ValueError:  # the draft engine cannot take it: no drafts, the step goes on
                continue
            pending[request_id] = seq.seq_id
        drafts: dict[int, list[int]] = {}
        for _ in range(MAX_DRAFT_STEPS):
            if not pending:
                break
            self.stats.steps += 1
            for out in self.engine.step().outputs:
                if out.finished:
                    drafts[pending.pop(out.request_id)] = list(out.outputs[0].token_ids)
        else:
            for request_id in pending:
                self.engine.abort_request(request_id)
            raise AssertionError(f"draft round did not end in {MAX_DRAFT_STEPS} steps")
        if wanted:
            self.stats.rounds += 1
        self.stats.seconds += time.perf_counter() - start
        return drafts
