"""Turns logits into next tokens: logits rules (logit_bias, allowed tokens, bad words, grammars),
penalties, temperature, top-k / top-p / min-p, seeds, logprobs."""

from __future__ import annotations

import dataclasses
import struct

import torch
import xxhash

from pdserve.engine.core.sequence import Sequence, TokenLogprob
from pdserve.engine.sampling.logits_rules import LogitsRules
from pdserve.kernels import cpu_ext
from pdserve.protocol.sampling_params import SamplingParams


def first_max(logits: torch.Tensor) -> torch.Tensor:
    """torch.argmax(logits, -1): on CPU one vectorised pass a row in the C++ kernels (4x torch's at
    64 rows of a 49k vocabulary); else max(), ~1.5x faster than argmax there."""
    if logits.device.type == "cpu" and logits.dim() == 2 and logits.stride(1) == 1 and cpu_ext.enabled():
        return cpu_ext.argmax_rows(logits)
    return logits.max(dim=-1).indices


@dataclasses.dataclass(frozen=True, slots=True)
class SamplerInput:
    seq: Sequence
    banned_token_ids: tuple[int, ...]  # EOS / stop tokens suppressed until min_tokens is reached


class Sampler:
    def __init__(self, rules: LogitsRules | None = None) -> None:
        self.rules = rules  # None: requests with logits rules are refused (LLMEngine.validate)

    def forget(self, seq: Sequence) -> None:
        """Drop a finished sequence's rules state. A seeded draw keeps nothing: it depends only on
        (seed, sample, position)."""
        if self.rules is not None:
            self.rules.forget(seq)

    def sample(
        self, logits: torch.Tensor, inputs: list[SamplerInput]
    ) -> list[tuple[int, TokenLogprob | None]]:
        # logits: [S, vocab] float32, one row per input
        assert logits.shape[0] == len(inputs) and logits.dtype == torch.float32
        want_logprobs = any(i.seq.params.logprobs is not None for i in inputs)
        raw_logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None  # the model's, unruled
        ruled = [r for r, i in enumerate(inputs) if i.seq.params.has_logits_rules]
        if ruled:  # edits those rows in place: the runner's logits serve this one step only
            assert self.rules is not None, "a request with logits rules reached an engine without them"
            with torch.inference_mode():  # the runner's logits are inference tensors
                self.rules.apply(logits, ruled, [inputs[r].seq for r in ruled])
        # Plain greedy rows take one argmax; unseeded rows without penalties are filtered and drawn
        # together on the logits' device; only seeded and penalised rows go one by one (a seeded
        # draw is the host generator's, the same on every node). One host sync for the rest.
        plain = [
            i.seq.params.greedy and not i.seq.params.has_penalties and not i.banned_token_ids for i in inputs
        ]
        single = [
            not plain[r] and (i.seq.params.seed is not None or i.seq.params.has_penalties)
            for r, i in enumerate(inputs)
        ]
        batched = [r for r in range(len(inputs)) if not plain[r] and not single[r]]
        picked = torch.empty(len(inputs), dtype=torch.int64, device=logits.device)
        if any(plain):
            rows = torch.tensor(
                [r for r, p in enumerate(plain) if p], dtype=torch.int64, device=logits.device
            )
            picked[rows] = first_max(logits[rows] if len(rows) < len(inputs) else logits)
        if batched:
            rows = torch.tensor(batched, dtype=torch.int64, device=logits.device)
            picked[rows] = _sample_rows(logits[rows], [inputs[r] for r in batched])
        token_ids = picked.tolist()  # the one sync for the plain and batched rows
        for r, inp in enumerate(inputs):
            if single[r]:
                token_ids[r] = self._sample_row(logits[r], inp)
        results = []
        for r, (inp, token_id) in enumerate(zip(inputs, token_ids, strict=True)):
            n = inp.seq.params.logprobs
            logprob: TokenLogprob | None = None
            if n is not None:
                assert raw_logprobs is not None  # computed when any row asks for logprobs
                logprob = _logprob(raw_logprobs[r], token_id, n, inp.seq.params.logprob_token_ids)
            results.append((token_id, logprob))
        return results

    def _sample_row(self, row: torch.Tensor, inp: SamplerInput) -> int:
        params = inp.seq.params
        row = row.clone()
        if params.has_penalties:
            _apply_penalties(row, inp.seq, params)
        if inp.banned_token_ids:
            row[list(inp.banned_token_ids)] = float("-inf")
        if params.greedy:
            return int(row.argmax())
        probs = _filtered_probs(row, params)
        generator = self._generator(inp.seq)
        if generator is not None:  # a seeded draw is the host generator's on every device
            probs = probs.to("cpu")
        return int(torch.multinomial(probs, 1, generator=generator))

    def _generator(self, seq: Sequence) -> torch.Generator | None:
        """A seeded sequence's RNG for its next token: a function of (seed, sample index, output
        position) alone, never of an RNG's history. So a request that moves between engines (prefill
        node to decode node), is preempted or resumed draws exactly what one engine would have."""
        if seq.params.seed is None:
            return None
        key = struct.pack("<QQQ", seq.params.seed % (1 << 64), seq.index, seq.num_output_tokens)
        return torch.Generator(device="cpu").manual_seed(
            xxhash.xxh3_64_intdigest(key) >> 1
        )  # manual_seed takes < 2**63


def _filtered_probs(row: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """One row's sampling distribution [V]: temperature, then top-k, min-p and top-p."""
    row = row / params.temperature
    if params.top_k is not None and params.top_k < row.shape[0]:
        kth = torch.topk(row, params.top_k).values[-1]
        row[row < kth] = float("-inf")
    probs = torch.softmax(row, dim=-1)
    if params.min_p > 0:
        probs[probs < params.min_p * probs.max()] = 0.0
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        drop = sorted_probs.cumsum(0) - sorted_probs > params.top_p * sorted_probs.sum()
        probs[order[drop]] = 0.0
    return probs


def _filtered_probs_rows(x: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """``_filtered_probs`` of many rows at once [R, V], with per-row parameters as tensors."""
    dev, vocab = x.device, x.shape[1]
    x = x / torch.tensor([p.temperature for p in params], dtype=x.dtype, device=dev)[:, None]
    ks = [p.top_k if p.top_k is not None and p.top_k < vocab else vocab for p in params]
    if min(ks) < vocab:
        kth = torch.topk(x, max(ks), dim=-1).values  # [R, kmax], descending
        k = torch.tensor(ks, dtype=torch.int64, device=dev)[:, None]
        cut = kth.gather(1, (k - 1).clamp(max=kth.shape[1] - 1))  # [R, 1]
        cut = torch.where(k < vocab, cut, torch.full_like(cut, float("-inf")))
        x = x.masked_fill(x < cut, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    min_p = torch.tensor([p.min_p for p in params], dtype=probs.dtype, device=dev)[:, None]
    probs = probs.masked_fill(probs < min_p * probs.amax(dim=-1, keepdim=True), 0.0)
    if any(p.top_p < 1.0 for p in params):  # decided on the host: no sync
        top_p = torch.tensor([p.top_p for p in params], dtype=probs.dtype, device=dev)[:, None]
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        drop = sorted_probs.cumsum(-1) - sorted_probs > top_p * sorted_probs.sum(-1, keepdim=True)
        drop &= top_p < 1.0
        probs = probs.scatter(1, order, sorted_probs.masked_fill(drop, 0.0))
    return probs


def _sample_rows(x: torch.Tensor, inputs: list[SamplerInput]) -> torch.Tensor:
    """Unseeded rows without penalties, drawn together: [R] token ids on the logits' device."""
    x = x.clone()
    banned = [(r, t) for r, i in enumerate(inputs) for t in i.banned_token_ids]
    if banned:
        rows, ids = zip(*banned, strict=True)
        x[list(rows), list(ids)] = float("-inf")
    greedy = torch.tensor([i.seq.params.greedy for i in inputs], device=x.device)
    params = [i.seq.params for i in inputs]
    # greedy rows (here only for their banned tokens) take any temperature: their draw is discarded
    safe = [p if not p.greedy else SamplingParams(temperature=1.0) for p in params]
    drawn = torch.multinomial(_filtered_probs_rows(x, safe), 1).squeeze(1)
    return torch.where(greedy, x.argmax(dim=-1), drawn)


def _apply_penalties(row: torch.Tensor, seq: Sequence, params: SamplingParams) -> None:
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(seq.token_ids)), dtype=torch.int64, device=row.device)
        vals = row[seen]
        row[seen] = torch.where(vals > 0, vals / params.repetition_penalty, vals * params.repetition_penalty)
    output = seq.output_token_ids
    if output and (params.presence_penalty or params.frequency_penalty):
        ids, counts = torch.tensor(output, dtype=torch.int64, device=row.device).unique(return_counts=True)
        row[ids] -= params.frequency_penalty * counts.to(row.dtype) + params.presence_penalty


def _logprob(
    logprobs: torch.Tensor, token_id: int, num_top: int, chosen: tuple[int, ...] | None = None
) -> TokenLogprob:
    """The sampled token's entry; its alternatives are the ``chosen`` ids' (vLLM's
    logprob_token_ids, in the order asked) or else the ``num_top`` most likely."""
    # logprobs: [vocab]
    top: tuple[tuple[int, float], ...] = ()
    if chosen is not None:
        values = logprobs[torch.tensor(chosen, dtype=torch.int64, device=logprobs.device)]
        top = tuple(zip(chosen, values.tolist(), strict=True))
    elif num_top > 0:  # the whole vocabulary at most (vLLM's -1 arrives as its size)
        values, ids = torch.topk(logprobs, min(num_top, logprobs.shape[-1]))
        top = tuple(zip(ids.tolist(), values.tolist(), strict=True))
    return TokenLogprob(token_id, float(logprobs[token_id]), top)


def prompt_logprobs(logits: torch.Tensor, next_ids: list[int], num_top: int) -> list[TokenLogprob]:
    """Each row's log-probability of the prompt token that follows it, that token's rank, and
    the ``num_top`` most likely tokens: the model's distribution, before any sampling rule."""
    logprobs = torch.log_softmax(logits, dim=-1)  # [rows, vocab]
    ids = torch.tensor(next_ids, dtype=torch.int64, device=logits.device)
    chosen = logprobs.gather(1, ids[:, None]).squeeze(1)
    ranks = (logprobs > chosen[:, None]).sum(dim=1) + 1
    tops: list[tuple] = [()] * len(next_ids)
    if num_top > 0:
        values, top_ids = torch.topk(logprobs, min(num_top, logprobs.shape[-1]), dim=-1)
        tops = [tuple(zip(i, v, strict=True)) for i, v in zip(top_ids.tolist(), values.tolist(), strict=True)]
    return [
        TokenLogprob(t, lp, top, rank)
        for t, lp, top, rank in zip(next_ids, chosen.tolist(), tops, ranks.tolist(), strict=True)
    ]
