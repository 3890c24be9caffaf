"""How much one request may ask for: samples (``--max-n``) and log-probabilities.

Log-probabilities are bounded three ways, each a 400 naming the field:

- per position, as vLLM bounds them: ``--max-logprobs`` (vLLM's flag and default, 20) caps
  ``logprobs``, ``top_logprobs`` and ``prompt_logprobs``; vLLM's -1 asks for the whole vocabulary
  and counts as its size, so it passes only with ``--max-logprobs -1`` (vllm/sampling_params.py,
  ``SamplingParams._validate_logprobs``, whose words the 400 repeats);
- per response, past vLLM's default count: ``--max-logprob-entries`` entries (count x positions
  x samples). Each entry costs the router about 1 KB of memory while the response is built and
  about 80 bytes of JSON (docs/api.md, "The whole vocabulary");
- per message from a node: a sample's prompt log-probabilities arrive in one message, whose
  header protocol/codec.py caps at MAX_HEADER_BYTES; about 12 bytes an entry.
"""

from __future__ import annotations

import dataclasses

from pdserve.protocol.codec import MAX_HEADER_BYTES
from pdserve.protocol.sampling_params import MAX_LOGPROBS
from pdserve.router.errors import bad_request

# Entries of one sample's prompt log-probabilities one node message carries: 12 bytes each
# measured (a msgpack token id of up to 3 bytes and a float64 of 9), 16 leaving room for larger
# ids and the rest of the message.
WIRE_PROMPT_ENTRIES = MAX_HEADER_BYTES // 16


@dataclasses.dataclass(frozen=True, slots=True)
class Limits:
    """The router's flags a request is checked against (router/config.py)."""

    max_n: int  # --max-n: samples per prompt
    max_logprobs: int = MAX_LOGPROBS  # --max-logprobs: alternatives per position; -1: the vocabulary
    max_logprob_entries: int = 1 << 20  # --max-logprob-entries: a response's, past MAX_LOGPROBS a position

    def top_count(self, value: int | None, field: str, vocab_size: int) -> int | None:
        """``field``'s count of alternatives as the engine takes it, vLLM's -1 as the vocabulary's
        size; past ``max_logprobs``, vLLM's 400."""
        if value is None:
            return None
        if value < -1:
            raise bad_request(f"`{field}` must be a positive value or -1.", field)
        count = vocab_size if value == -1 else value
        allowed = vocab_size if self.max_logprobs == -1 else self.max_logprobs
        if count > allowed:
            kind = "prompt" if field == "prompt_logprobs" else "sample"
            raise bad_request(
                f"Requested {kind} logprobs of {count}, which is greater than max allowed: {allowed}", field
            )
        return count

    def check_entries(self, field: str, count: int | None, positions: int) -> None:
        """A 400 naming ``field`` when ``count`` alternatives at ``positions`` positions (across
        the response) pass ``max_logprob_entries``; counts vLLM allows by default always pass."""
        if count is None or count <= MAX_LOGPROBS or count * positions <= self.max_logprob_entries:
            return
        raise bad_request(
            f"{field}: {count} log-probabilities at {positions} positions are {count * positions} "
            f"entries, more than the {self.max_logprob_entries} a response may carry "
            "(--max-logprob-entries); ask for fewer positions or a count of at most "
            f"{MAX_LOGPROBS}",
            field,
        )


def check_prompt_wire(count: int | None, longest_prompt: int) -> None:
    """A 400 naming prompt_logprobs when one sample's prompt log-probabilities (``count`` and the
    token's own at each position after the first) would not fit one node message."""
    if count is None:
        return
    entries = (count + 1) * (longest_prompt - 1)
    if entries > WIRE_PROMPT_ENTRIES:
        raise bad_request(
            f"prompt_logprobs: {count} log-probabilities at {longest_prompt - 1} prompt positions are "
            f"{entries} entries for one sample, more than the {WIRE_PROMPT_ENTRIES} one node message "
            "carries (protocol/codec.py's MAX_HEADER_BYTES); ask for fewer or send a shorter prompt",
            "prompt_logprobs",
        )
