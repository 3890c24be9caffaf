"""One streamed request to an OpenAI-compatible server, timed event by event.

Output tokens are counted from the stream, not taken from ``usage``: each request asks for the
sampled token's logprob (``logprobs: 0`` for completions, ``logprobs: true, top_logprobs: 0``
for chat), so every streamed token arrives as one logprob entry even when its text is held back
(an incomplete UTF-8 sequence, a possible stop string) or several share one event. An event
with text but no entry counts as one token and is counted in the record
(``events_without_logprobs``), since it means the server dropped the logprobs it was asked for.
``stream_options.include_usage`` asks for the server's own count, which the record keeps
beside the counted one.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import json
import time
from typing import Any

import httpx

from pdserve.bench_serve.records import RequestRecord
from pdserve.bench_serve.workload import ChatMessage, WorkItem, prompt_len


class Api(enum.Enum):
    COMPLETIONS = "completions"
    CHAT = "chat"


@dataclasses.dataclass(frozen=True, slots=True)
class Endpoint:
    base_url: str  # the server, e.g. http://127.0.0.1:8000 (the /v1 paths are added)
    api: Api
    model: str  # the served model's id
    ignore_eos: bool = True  # generate exactly output_len tokens (a vLLM extension pdserve also has)
    count_with_logprobs: bool = True  # False: one token per non-empty text event (servers without logprobs)
    timeout_s: float = 300.0  # longest wait for any byte
    api_key: str | None = None

    @property
    def url(self) -> str:
        path = "/v1/chat/completions" if self.api is Api.CHAT else "/v1/completions"
        return self.base_url.rstrip("/") + path

    def body(self, item: WorkItem) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model,
            "max_tokens": item.output_len,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
            "ignore_eos": self.ignore_eos,
        }
        if self.api is Api.CHAT:
            body["messages"] = _messages(item)
            if self.count_with_logprobs:
                body |= {"logprobs": True, "top_logprobs": 0}
            return body
        if isinstance(item.prompt, tuple) and item.prompt and isinstance(item.prompt[0], ChatMessage):
            raise ValueError("a chat prompt (messages) needs --api chat")
        body["prompt"] = item.prompt if isinstance(item.prompt, str) else list(item.prompt)
        if self.count_with_logprobs:
            body["logprobs"] = 0
        return body


def _messages(item: WorkItem) -> list[dict[str, str]]:
    if isinstance(item.prompt, str):
        return [{"role": "user", "content": item.prompt}]
    if not all(isinstance(m, ChatMessage) for m in item.prompt):
        raise ValueError("token-id prompts need --api completions")
    return [{"role": m.role, "content": m.content} for m in item.prompt]


def served_model(base_url: str, api_key: str | None = None, timeout_s: float = 10.0) -> str:
    """The first model id the server lists under /v1/models."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    response = httpx.get(base_url.rstrip("/") + "/v1/models", headers=headers, timeout=timeout_s)
    response.raise_for_status()
    models = response.json().get("data") or []
    if not models:
        raise ValueError(f"{base_url}/v1/models lists no model; pass --model")
    return models[0]["id"]


class _StreamError(Exception):
    """The server sent an error event inside the stream."""


@dataclasses.dataclass(slots=True)
class _Tally:
    """The stream so far (mutable, private to one request)."""

    sent: float  # perf_counter at send
    logprobs_asked: bool  # the request asked for logprobs
    token_times: list[float] = dataclasses.field(default_factory=list)
    event_tokens: list[int] = dataclasses.field(default_factory=list)
    usage: dict[str, Any] | None = None
    finish_reason: str | None = None
    done: bool = False  # [DONE] seen
    ended: float | None = None  # perf_counter at the end of the stream
    events_without_logprobs: int = 0  # events with text but no logprob entry

    def feed(self, line: str, chat: bool, now: float) -> None:
        if not line.startswith("data:"):
            return  # blank separators, comments, other SSE fields
        payload = line[5:].strip()
        if payload == "[DONE]":
            self.done, self.ended = True, now
            return
        event = json.loads(payload)
        if "error" in event:
            raise _StreamError(json.dumps(event["error"])[:500])
        if event.get("usage"):
            self.usage = event["usage"]
        for choice in event.get("choices") or ():
            num_entries, has_text = _choice_tokens(choice, chat)
            num = num_entries or int(has_text)
            if num:
                self.token_times.append(now - self.sent)
                self.event_tokens.append(num)
            if self.logprobs_asked and has_text and not num_entries:
                self.events_without_logprobs += 1
            self.finish_reason = choice.get("finish_reason") or self.finish_reason


def _choice_tokens(choice: dict[str, Any], chat: bool) -> tuple[int, bool]:
    """(logprob entries, whether it carries text) of one streamed choice.

    An event with entries counts one token per entry; one with text but no entry (a server
    without logprobs, or one that dropped them) counts as one token.
    """
    logprobs = choice.get("logprobs") or {}
    entries = logprobs.get("content") if chat else logprobs.get("tokens")
    text = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
    return len(entries or ()), bool(text)


def _record(
    tally: _Tally,
    item: WorkItem,
    index: int,
    sent_s: float,
    error_kind: str | None = None,
    error: str | None = None,
) -> RequestRecord:
    if error_kind is None and not (tally.done and tally.finish_reason):
        error_kind, error = (
            "incomplete",
            f"stream ended (done={tally.done}, finish_reason={tally.finish_reason})",
        )
    usage = tally.usage or {}
    exact = prompt_len(item.prompt)
    ok = error_kind is None
    return RequestRecord(
        index=index,
        conversation=item.conversation,
        turn=item.turn,
        ok=ok,
        error_kind=error_kind,
        error=error[:500] if error else None,
        sent_s=sent_s,
        ttft_s=tally.token_times[0] if tally.token_times else None,
        e2e_s=tally.ended - tally.sent if ok and tally.ended is not None else None,
        token_times_s=tuple(tally.token_times),
        event_tokens=tuple(tally.event_tokens),
        requested_tokens=item.output_len,
        prompt_tokens=exact if exact is not None else usage.get("prompt_tokens"),
        usage_completion_tokens=usage.get("completion_tokens"),
        usage_cached_tokens=(usage.get("prompt_tokens_details") or {}).get("cached_tokens"),
        finish_reason=tally.finish_reason,
        events_without_logprobs=tally.events_without_logprobs,
    )


async def send(
    http: httpx.AsyncClient,
    endpoint: Endpoint,
    item: WorkItem,
    index: int,
    run_start: float,
    deadline: float | None = None,
) -> RequestRecord:
    """Send ``item``, read its stream to the end; never raises for a failed request.

    ``deadline`` (a ``time.perf_counter()`` value) cuts the request off as ``cut_off``.
    """
    body = endpoint.body(item)
    headers = {"Authorization": f"Bearer {endpoint.api_key}"} if endpoint.api_key else {}
    tally = _Tally(sent=time.perf_counter(), logprobs_asked=endpoint.count_with_logprobs)
    sent_s = tally.sent - run_start
    budget = None if deadline is None else max(0.0, deadline - tally.sent)
    try:
        async with asyncio.timeout(budget):
            await _stream(http, endpoint, body, headers, tally)
    except _HttpStatus as exc:
        return _record(tally, item, index, sent_s, f"http_{exc.status}", exc.text)
    except _StreamError as exc:
        return _record(tally, item, index, sent_s, "stream_error", str(exc))
    except TimeoutError:
        return _record(tally, item, index, sent_s, "cut_off", "the run's time limit passed")
    except httpx.ConnectError as exc:
        return _record(tally, item, index, sent_s, "connect", repr(exc))
    except httpx.TimeoutException as exc:
        return _record(tally, item, index, sent_s, "timeout", repr(exc))
    except httpx.TransportError as exc:
        return _record(tally, item, index, sent_s, "read", repr(exc))
    except ValueError as exc:  # an event that is not JSON
        return _record(tally, item, index, sent_s, "bad_event", repr(exc))
    return _record(tally, item, index, sent_s)


class _HttpStatus(Exception):
    def __init__(self, status: int, text: str) -> None:
        super().__init__(status, text)
        self.status, self.text = status, text


async def _stream(
    http: httpx.AsyncClient, endpoint: Endpoint, body: dict[str, Any], headers: dict[str, str], tally: _Tally
) -> None:
    chat = endpoint.api is Api.CHAT
    async with http.stream(
        "POST", endpoint.url, json=body, headers=headers, timeout=endpoint.timeout_s
    ) as response:
        if response.status_code != 200:
            raise _HttpStatus(response.status_code, (await response.aread()).decode(errors="replace"))
        async for line in response.aiter_lines():
            tally.feed(line, chat, time.perf_counter())
    if tally.ended is None:
        tally.ended = time.perf_counter()
