"""Incremental detokenization and stop strings, one generated sequence at a time.

Decoding token by token is wrong for byte-level BPE (a multi-byte character spans tokens) and
for sentencepiece (a word's leading space only shows after a preceding token). So each step
decodes a short window twice, with and without the new tokens, and emits the difference:

    ids:   ... p p p p [r r r] n n        p: prefix_offset..read_offset, context already emitted
                  ^prefix  ^read          n: new tokens
    delta = decode(p..n)[len(decode(p..r)):]   held back while it ends in U+FFFD (partial char)

Stop strings are matched on the text; the last ``max(len(stop)) - 1`` characters are held back
so a stop string split across tokens is never streamed in part.

Torch-free and tokenizer-agnostic (anything with ``decode(ids) -> str``). ``StopStrings`` is the
one owner of the stop-string rule: the router streams a cluster's output through it, and the
offline engine ends its sequences with it, so both end a sample at the same token, O(new text) a
token.
"""

from __future__ import annotations

from typing import Protocol


class Tokenizer(Protocol):
    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str: ...


_CONTEXT_TOKENS = 5  # prompt tokens decoded as left context of the first output token
_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Turns generated token ids into text deltas whose concatenation is the decoded output."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int]) -> None:
        self._tokenizer = tokenizer
        self._ids = list(prompt_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)

    def add(self, token_id: int) -> str:
        """Text that ``token_id`` completes (may be empty while a character is partial)."""
        self._ids.append(token_id)
        return self._delta(final=False)

    def flush(self) -> str:
        """Whatever is still held back, at the end of the sequence."""
        return self._delta(final=True)

    def _delta(self, final: bool) -> str:
        decode = self._tokenizer.decode
        prefix_text = decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = decode(self._ids[self._prefix_offset :])
        if len(new_text) <= len(prefix_text) or (new_text.endswith(_REPLACEMENT) and not final):
            return ""
        delta = new_text[len(prefix_text) :]
        # Keep only the window the next step needs: the ids in it decode to prefix_text.
        del self._ids[: self._read_offset]
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        return delta


class StopStringMatcher:
    """Accumulates text, cuts it before the first stop string, and says what is safe to send."""

    def __init__(self, stop: tuple[str, ...]) -> None:
        self._stop = stop
        self._hold = max((len(s) for s in stop), default=1) - 1  # chars that may start a stop string
        self.text = ""  # the output so far, cut before a stop string once one matched
        self._num_sent = 0  # chars of text already handed out
        self.stopped = False  # a stop string matched
        self.matched: str | None = None  # which one (the earliest in the text)

    def add(self, delta: str) -> None:
        """Append generated text; sets ``stopped`` and cuts ``text`` when a stop string appears."""
        assert not self.stopped, "no text after a stop string"
        search_from = max(0, len(self.text) - self._hold)
        self.text += delta
        hits = [(i, s) for s in self._stop if (i := self.text.find(s, search_from)) >= 0]
        if hits:
            cut, self.matched = min(hits)
            self.text = self.text[:cut]
            self.stopped = True

    def take(self, final: bool) -> str:
        """Text not sent yet that no stop string can still claim (all of it when final or stopped)."""
        end = len(self.text) if final or self.stopped else max(self._num_sent, len(self.text) - self._hold)
        out = self.text[self._num_sent : end]
        self._num_sent = end
        return out


class StopStrings:
    """One sample's stop strings, token by token: the text, where it is cut, and whether it ended.

    With ``min_tokens``, text is matched only once that many tokens were generated; then all of it
    is, so a stop string completed earlier ends the sample at the min_tokens-th token, the text
    still cut before it (as an EOS banned until then is not). Before that the text is held back.
    """

    def __init__(
        self, tokenizer: Tokenizer, prompt_ids: list[int], stop: tuple[str, ...], min_tokens: int = 0
    ):
        self._detokenizer = IncrementalDetokenizer(tokenizer, list(prompt_ids))
        self.matcher = StopStringMatcher(stop)
        self._min_tokens = min_tokens
        self._pending = ""  # text of the tokens before min_tokens, not matched yet
        self.num_tokens = 0

    @property
    def stopped(self) -> bool:
        return self.matcher.stopped

    def add(self, token_id: int) -> bool:
        """Feed the next output token; True when a stop string has now matched."""
        self.num_tokens += 1
        self._pending += self._detokenizer.add(token_id)
        if self.num_tokens >= self._min_tokens:
            self._release()
        return self.matcher.stopped

    def finish(self) -> bool:
        """The sample ended for another reason: the text still held back is matched too."""
        self._pending += self._detokenizer.flush()
        self._release()
        return self.matcher.stopped

    def _release(self) -> None:
        if self._pending and not self.matcher.stopped:
            self.matcher.add(self._pending)
        self._pending = ""
