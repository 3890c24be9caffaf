"""Per-request sampling parameters, validated on construction. Torch-free: the router builds them,
they cross the wire as they are (protocol.codec builds and so re-validates them on decode), and
the engine samples by them (``from engine import SamplingParams`` names this class)."""

from __future__ import annotations

import dataclasses
import enum
import json
from collections.abc import Mapping
from typing import Annotated, Any

from pdserve.protocol.codec import SIGNED

MAX_LOGPROBS = 20  # the API's largest count of alternatives, -1 (the whole vocabulary) aside
MAX_LOGIT_BIAS = 100.0  # OpenAI: each bias in [-100, 100]


class GuidedKind(enum.Enum):
    JSON = "json"  # text: a JSON Schema, as JSON text
    REGEX = "regex"  # text: a regular expression the whole output matches
    CHOICE = "choice"  # choices: the output is exactly one of them
    GRAMMAR = "grammar"  # text: an EBNF (GBNF) or Lark grammar


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class GuidedDecoding:
    """A constraint on the whole output (grammar compiles it into a token mask per step)."""

    kind: GuidedKind
    text: str = ""  # the schema, regex or grammar; empty for CHOICE
    choices: tuple[str, ...] = ()  # CHOICE only: the allowed outputs

    def __post_init__(self) -> None:
        if isinstance(self.choices, list):
            object.__setattr__(self, "choices", tuple(self.choices))
        if self.kind is GuidedKind.CHOICE:
            if not self.choices or not all(isinstance(c, str) and c for c in self.choices):
                raise ValueError("guided_choice must be a non-empty list of non-empty strings")
            if self.text:
                raise ValueError("guided_decoding: a choice takes choices, not text")
        elif not isinstance(self.text, str) or not self.text:
            raise ValueError(f"guided_decoding: {self.kind.value} needs non-empty text")
        elif self.choices:
            raise ValueError(f"guided_decoding: {self.kind.value} takes text, not choices")

    @classmethod
    def json_schema(cls, schema: Mapping[str, Any] | str) -> GuidedDecoding:
        text = schema if isinstance(schema, str) else json.dumps(schema)  # key order: property order
        return cls(kind=GuidedKind.JSON, text=text)

    @classmethod
    def json_object(cls) -> GuidedDecoding:
        """Any JSON object (OpenAI's ``{"type": "json_object"}``)."""
        return cls.json_schema({"type": "object"})

    @classmethod
    def regex(cls, pattern: str) -> GuidedDecoding:
        return cls(kind=GuidedKind.REGEX, text=pattern)

    @classmethod
    def choice(cls, choices: list[str] | tuple[str, ...]) -> GuidedDecoding:
        return cls(kind=GuidedKind.CHOICE, choices=tuple(choices))

    @classmethod
    def grammar(cls, text: str) -> GuidedDecoding:
        return cls(kind=GuidedKind.GRAMMAR, text=text)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class LogitBias:
    token_id: int  # the token whose logit moves
    bias: float  # added to its logit before sampling, in [-100, 100]


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class BeamSearch:
    """Beam search over ``SamplingParams.n`` beams (engine/sampling/beam_search.py), scored as Hugging Face's
    ``generate(num_beams=n)`` scores: a finished beam's score is its summed log-probability over
    its length in generated tokens to the power ``length_penalty``."""

    length_penalty: float = 1.0  # > 0 favours longer outputs, < 0 shorter ones
    # True: stop once n beams have finished; False: also stop when no running beam can still beat
    # the worst finished one at its present length (Hugging Face's heuristic)
    early_stopping: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.length_penalty, (int, float)) or isinstance(self.length_penalty, bool):
            raise ValueError(f"length_penalty must be a number, got {self.length_penalty!r}")
        if not -10.0 <= self.length_penalty <= 10.0:
            raise ValueError(f"length_penalty must be in [-10, 10], got {self.length_penalty}")


# What beam search ranks by is the model's own log-probabilities: a field that reshapes or draws
# from the distribution (or reads the text as it grows) has no meaning there. Each is refused by name.
_NOT_WITH_BEAMS = {
    "top_p": lambda p: p.top_p != 1.0,
    "top_k": lambda p: p.top_k is not None,
    "min_p": lambda p: p.min_p != 0.0,
    "presence_penalty": lambda p: p.presence_penalty != 0.0,
    "frequency_penalty": lambda p: p.frequency_penalty != 0.0,
    "repetition_penalty": lambda p: p.repetition_penalty != 1.0,
    "min_tokens": lambda p: p.min_tokens != 0,
    "stop": lambda p: bool(p.stop),
    "prompt_logprobs": lambda p: p.prompt_logprobs is not None,
    "logprob_token_ids": lambda p: p.logprob_token_ids is not None,
    "logit_bias": lambda p: bool(p.logit_bias),
    "allowed_token_ids": lambda p: p.allowed_token_ids is not None,
    "bad_words": lambda p: bool(p.bad_words),
    "guided_decoding": lambda p: p.guided_decoding is not None,
}


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class SamplingParams:
    n: int = 1  # independent samples of the same prompt (they share its KV blocks)
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0  # nucleus mass in (0, 1]
    top_k: int | None = None  # keep the k most likely tokens; None (or 0 / -1) keeps all
    min_p: float = 0.0  # drop tokens below min_p * p(most likely token)
    seed: Annotated[int, SIGNED] | None = None  # per-request RNG seed: same seed, same output
    presence_penalty: float = 0.0  # OpenAI: subtract once per token seen in the output
    frequency_penalty: float = 0.0  # OpenAI: subtract per occurrence in the output
    repetition_penalty: float = 1.0  # CTRL-style, over prompt and output tokens
    max_tokens: int | None = 16  # output tokens; None means up to the model's context
    min_tokens: int = 0  # suppress EOS and stop tokens until this many were produced
    stop: tuple[str, ...] = ()  # stop strings; the output is cut before the first match
    stop_token_ids: tuple[int, ...] = ()  # extra token ids that end generation
    ignore_eos: bool = False  # keep going past the model's end-of-sequence token
    logprobs: int | None = None  # number of top alternatives to return per token (0 = chosen only)
    # vLLM: the log-probability of every prompt token after the first, with this many alternatives
    # (0: the token's own only). The node that computes the prompt sends them with the first token.
    prompt_logprobs: int | None = None
    # vLLM: with logprobs, these tokens' log-probabilities at each output position stand in for
    # the top alternatives (in this order); None: the top ``logprobs`` tokens
    logprob_token_ids: tuple[int, ...] | None = None
    logit_bias: tuple[LogitBias, ...] = ()  # OpenAI; a {token_id: bias} mapping is accepted too
    allowed_token_ids: tuple[int, ...] | None = None  # vLLM: sample only among these; None: all
    bad_words: tuple[str, ...] = ()  # vLLM: words the output may not contain (as tokens)
    guided_decoding: GuidedDecoding | None = None  # the output follows a schema, regex, choice or grammar
    # vLLM's use_beam_search: the n outputs are the n best beams (temperature 0), not n samples
    beam_search: BeamSearch | None = None
    # Not sampling options, but what the request's KV is computed with and keyed on besides its
    # tokens: they ride here because they must reach every engine the request touches (prefill,
    # decode, a migration), and every prefix-cache key on the way includes them (cache_root_of).
    adapter: str | None = None  # the LoRA adapter it runs with (its served name); None: the base model
    # where a node that has not read the adapter yet finds its PEFT folder (set by the router from
    # its own adapter table, never by a client)
    adapter_path: str | None = None
    cache_salt: str | None = None  # vLLM's: requests with different salts never share cached blocks

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        if isinstance(self.stop, str):
            set_(self, "stop", (self.stop,))
        elif self.stop is None:
            set_(self, "stop", ())
        elif isinstance(self.stop, (list, tuple)) and all(isinstance(s, str) for s in self.stop):
            set_(self, "stop", tuple(self.stop))
        else:
            raise ValueError(f"stop must be a string or a list of strings, got {type(self.stop).__name__}")
        if not all(self.stop):
            raise ValueError("stop strings must not be empty")
        set_(self, "stop_token_ids", tuple(int(t) for t in (self.stop_token_ids or ())))
        if self.top_k is not None and self.top_k in (0, -1):
            set_(self, "top_k", None)
        if isinstance(self.logit_bias, Mapping):
            set_(
                self,
                "logit_bias",
                tuple(LogitBias(token_id=int(t), bias=float(b)) for t, b in sorted(self.logit_bias.items())),
            )
        else:
            set_(self, "logit_bias", tuple(self.logit_bias or ()))
        if self.allowed_token_ids is not None:
            set_(self, "allowed_token_ids", tuple(self.allowed_token_ids))
        if self.logprob_token_ids is not None:
            set_(self, "logprob_token_ids", tuple(self.logprob_token_ids))
        set_(self, "bad_words", tuple(self.bad_words or ()))
        self._validate()
        self._validate_rules()
        self._validate_beams()
        self._validate_cache_identity()

    def _validate(self) -> None:
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k must be >= 1 (or 0 / -1 / None to disable), got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens <= 0):
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if self.min_tokens < 0 or (self.max_tokens is not None and self.min_tokens > self.max_tokens):
            raise ValueError(f"min_tokens must be in [0, max_tokens], got {self.min_tokens}")
        # No upper bound here: the router maps vLLM's -1 (the whole vocabulary) to the vocabulary's
        # size and bounds the API's counts; the engine lists at most its logits' width.
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError(f"logprobs must be >= 0, got {self.logprobs}")
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            raise ValueError(f"prompt_logprobs must be >= 0, got {self.prompt_logprobs}")
        if self.seed is not None and (
            not isinstance(self.seed, int)
            or isinstance(self.seed, bool)
            or not -(1 << 63) <= self.seed < 1 << 63
        ):
            raise ValueError(f"seed must be a 64-bit signed integer, got {self.seed!r}")

    def _validate_rules(self) -> None:
        ids = [b.token_id for b in self.logit_bias]
        if any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in ids):
            raise ValueError("logit_bias: keys must be token ids (integers >= 0)")
        if len(set(ids)) != len(ids):
            raise ValueError("logit_bias: a token id appears twice")
        if not all(-MAX_LOGIT_BIAS <= b.bias <= MAX_LOGIT_BIAS for b in self.logit_bias):
            raise ValueError(f"logit_bias: biases must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]")
        allowed = self.allowed_token_ids
        if allowed is not None and (
            not allowed or any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in allowed)
        ):
            raise ValueError("allowed_token_ids must be a non-empty list of token ids (integers >= 0)")
        chosen = self.logprob_token_ids
        if chosen is not None and (
            not chosen or any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in chosen)
        ):
            raise ValueError("logprob_token_ids must be a non-empty list of token ids (integers >= 0)")
        if chosen is not None and self.logprobs is None:
            raise ValueError("logprob_token_ids needs logprobs")
        if not all(isinstance(w, str) and w.strip() for w in self.bad_words):
            raise ValueError("bad_words must be non-empty strings")
        if self.guided_decoding is not None:
            if self.ignore_eos:
                raise ValueError(
                    "ignore_eos cannot be combined with guided decoding (the grammar ends the output)"
                )
            if self.min_tokens:
                raise ValueError(
                    "min_tokens cannot be combined with guided decoding (the grammar ends the output)"
                )

    def _validate_cache_identity(self) -> None:
        for name in ("adapter", "adapter_path", "cache_salt"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"{name} must be a non-empty string if provided")
        if self.adapter_path is not None and self.adapter is None:
            raise ValueError("adapter_path needs adapter")

    def _validate_beams(self) -> None:
        if self.beam_search is None:
            return
        if self.temperature != 0.0:
            raise ValueError("temperature: beam search ranks by the model's log-probabilities; send 0")
        for name, is_set in _NOT_WITH_BEAMS.items():
            if is_set(self):
                raise ValueError(f"{name} cannot be combined with beam search")

    @property
    def has_logits_rules(self) -> bool:
        """Anything that edits the logits row before sampling (engine.logits_rules)."""
        return bool(
            self.logit_bias or self.allowed_token_ids is not None or self.bad_words or self.guided_decoding
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0
