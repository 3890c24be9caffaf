"""What one request did, as measured by the client: the unit every metric is computed from."""

from __future__ import annotations

import dataclasses
from typing import Any

# Error kinds (RequestRecord.error_kind):
#   http_<status>  the server answered with that status (http_429: shed load, http_400: rejected)
#   connect        no connection to the server
#   timeout        no byte from the server for the request timeout
#   read           the connection broke mid-stream
#   stream_error   the server sent an error event inside the stream
#   bad_event      an event's data was not JSON
#   incomplete     the stream ended without a finish reason or without [DONE]
#   cut_off        still running when the run's time limit passed


@dataclasses.dataclass(frozen=True, slots=True)
class RequestRecord:
    index: int  # position in the workload
    conversation: int | None  # multi-turn conversation id
    turn: int  # multi-turn turn number
    ok: bool  # completed with a finish reason and [DONE]
    error_kind: str | None  # one of the kinds above; None when ok
    error: str | None  # the error's text (truncated); None when ok
    sent_s: float  # when the request went out, seconds after the run started
    ttft_s: float | None  # send -> first output token
    e2e_s: float | None  # send -> end of the stream
    token_times_s: tuple[float, ...]  # send -> each event that carried output tokens
    event_tokens: tuple[int, ...]  # output tokens in each of those events
    requested_tokens: int  # max_tokens asked for
    prompt_tokens: int | None  # exact ids sent, else usage.prompt_tokens, else None
    usage_completion_tokens: int | None  # usage.completion_tokens; None when the server sent no usage
    usage_cached_tokens: int | None  # usage.prompt_tokens_details.cached_tokens (prefix-cache hits), if sent
    finish_reason: str | None  # the last finish reason seen
    events_without_logprobs: int = 0  # events with text but no logprob entry although logprobs were asked for

    @property
    def num_output_tokens(self) -> int:
        """Output tokens counted from the stream itself."""
        return sum(self.event_tokens)

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first: (e2e - ttft) / (n - 1); None below 2 tokens."""
        n = self.num_output_tokens
        if self.ttft_s is None or self.e2e_s is None or n < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (n - 1)

    @property
    def itl_s(self) -> list[float]:
        """Gaps between consecutive token-carrying events."""
        times = self.token_times_s
        return [b - a for a, b in zip(times, times[1:], strict=False)]

    @property
    def usage_mismatch(self) -> bool:
        """The server's usage disagrees with the tokens counted in the stream."""
        return (
            self.usage_completion_tokens is not None
            and self.usage_completion_tokens != self.num_output_tokens
        )

    def to_json(self) -> dict[str, Any]:
        body = dataclasses.asdict(self)
        body |= {
            "num_output_tokens": self.num_output_tokens,
            "tpot_s": self.tpot_s,
            "usage_mismatch": self.usage_mismatch,
        }
        return body

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> RequestRecord:
        fields = {f.name for f in dataclasses.fields(cls)}
        kept = {k: v for k, v in body.items() if k in fields}
        kept["token_times_s"] = tuple(kept["token_times_s"])
        kept["event_tokens"] = tuple(kept["event_tokens"])
        return cls(**kept)
