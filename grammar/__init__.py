"""Grammar-constrained decoding through llguidance: a ``GuidedDecoding`` spec compiled once per
distinct spec (bounded LRU), and a fresh matcher per sequence copied from the compiled one.

Torch-free: the router compiles every spec it accepts with the same code (a spec that does not
compile is a 400 there), and the nodes' samplers match tokens against it. Both read the model
folder's ``tokenizer.json``, so both sides see the same token vocabulary.

JSON schemas compile to compact JSON (no whitespace between tokens): a small model given the
freedom to emit whitespace may spend its whole budget on it.
"""

from __future__ import annotations

import collections
import json
import pathlib
import threading
from typing import TYPE_CHECKING

import llguidance

from pdserve.protocol.sampling_params import GuidedDecoding, GuidedKind

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions  # only in the stub: a TypedDict, absent at runtime

DEFAULT_CACHE_SIZE = 64  # compiled specs kept per process
_JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False}


class GrammarError(ValueError):
    """A spec that does not compile, or whose grammar matches nothing."""


class GrammarCompiler:
    """Compiles specs for one tokenizer and hands out matchers positioned at the output's start."""

    def __init__(
        self,
        tokenizer_json: str,
        vocab_size: int,
        eos_token_ids: tuple[int, ...],
        cache_size: int = DEFAULT_CACHE_SIZE,
    ) -> None:
        if not eos_token_ids:
            raise ValueError("guided decoding needs the model's end-of-sequence token id")
        self.vocab_size = vocab_size  # bits per mask: the model's logits width
        self.tokenizer = llguidance.LLTokenizer(
            tokenizer_json, n_vocab=vocab_size, eos_token=list(eos_token_ids)
        )
        self._cache_size = cache_size
        self._compiled: collections.OrderedDict[GuidedDecoding, llguidance.LLMatcher] = (
            collections.OrderedDict()
        )
        self._lock = threading.Lock()  # the router compiles from worker threads
        self.num_compiles = 0  # specs compiled (cache misses), for tests and metrics

    @classmethod
    def from_folder(
        cls, folder: str | pathlib.Path, vocab_size: int, eos_token_ids: tuple[int, ...]
    ) -> GrammarCompiler:
        path = pathlib.Path(folder) / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"{folder} has no tokenizer.json (guided decoding needs one)")
        return cls(path.read_text(), vocab_size, eos_token_ids)

    def matcher(self, spec: GuidedDecoding) -> llguidance.LLMatcher:
        """A new matcher for ``spec`` at the start of the output. GrammarError if it cannot compile."""
        with self._lock:
            compiled = self._compiled.get(spec)
            if compiled is not None:
                self._compiled.move_to_end(spec)
                return compiled.deep_copy()
        compiled = self._compile(spec)  # outside the lock: a large schema takes a while
        with self._lock:
            self._compiled[spec] = compiled
            while len(self._compiled) > self._cache_size:
                self._compiled.popitem(last=False)
        return compiled.deep_copy()

    def check(self, spec: GuidedDecoding) -> None:
        """Raise GrammarError unless ``spec`` compiles (and caches it for the first request)."""
        self.matcher(spec)

    def _compile(self, spec: GuidedDecoding) -> llguidance.LLMatcher:
        self.num_compiles += 1
        grammar = _grammar_text(spec)
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if not matcher.is_error():
            matcher.compute_bitmask()  # a grammar that matches nothing fails on its first mask
        if matcher.is_error():
            raise GrammarError(_first_line(matcher.get_error()))
        return matcher


def _grammar_text(spec: GuidedDecoding) -> str:
    try:
        if spec.kind is GuidedKind.JSON:
            return llguidance.LLMatcher.grammar_from_json_schema(spec.text, defaults=_JSON_OPTIONS)
        if spec.kind is GuidedKind.REGEX:
            # \d and \w as ASCII classes, as in JSON Schema patterns (Rust's are Unicode)
            return llguidance.LLMatcher.grammar_from_lark(
                f"start: /{llguidance.regex_to_lark(spec.text, 'dw')}/"
            )
        if spec.kind is GuidedKind.CHOICE:
            return llguidance.LLMatcher.grammar_from_lark(
                "start: " + " | ".join(json.dumps(c) for c in spec.choices)
            )
        return llguidance.grammar_from("grammar", spec.text)  # GBNF / EBNF, or Lark as it is
    except ValueError as exc:
        raise GrammarError(_first_line(str(exc))) from None


def _first_line(message: str) -> str:
    """llguidance appends its parser state to some errors; the first lines say what is wrong."""
    return message.split("\n<state>", 1)[0].strip() or "the grammar does not compile"
