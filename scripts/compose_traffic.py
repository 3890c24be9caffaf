"""Client side of the compose test: OpenAI requests to the router, and how each one ended.

Every request is bounded in time (``timeout_s``, for the whole answer, stream included) and goes
only to the router's published port on this machine. An answer is read to its end and put in
one of the outcomes below; nothing is retried here, so what the router did is what is counted.
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
import json
import time
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor

import httpx


class Outcome(enum.Enum):
    OK = "ok"  # 200, a whole answer: text, a finish_reason, and [DONE] when streamed
    STREAM_ERROR = "stream_error"  # streamed 200, then a clean {"error": ...} event and [DONE]
    ERROR_STATUS = "error_status"  # a non-200 answer with an OpenAI error body
    BROKEN = "broken"  # anything else: cut off, malformed, no [DONE], no finish_reason
    TIMEOUT = "timeout"  # no end within timeout_s


CLEAN = frozenset({Outcome.OK, Outcome.STREAM_ERROR, Outcome.ERROR_STATUS})
# Numbers every prompt of this process anew: a prompt never hits another's prefix cache, which
# would let the decode node prefill it itself and leave the prefill pool idle.
_prompt_numbers = itertools.count()


@dataclasses.dataclass(frozen=True, slots=True)
class Spec:
    chat: bool  # /v1/chat/completions, else /v1/completions
    stream: bool
    max_tokens: int
    ignore_eos: bool = True  # fixed-length answers: a stream stays in flight for max_tokens tokens

    @property
    def label(self) -> str:
        return ("chat" if self.chat else "completion") + ("/stream" if self.stream else "")


@dataclasses.dataclass(frozen=True, slots=True)
class Result:
    spec: Spec
    outcome: Outcome
    num_tokens: int  # content deltas streamed, or usage.completion_tokens
    seconds: float  # request start to its end
    detail: str = ""  # the error message, or what was wrong


def all_clean_ok(results: list[Result]) -> bool:
    return all(r.outcome is Outcome.OK for r in results)


def mixed_specs(num: int, max_tokens: int, stream_only: bool = False) -> list[Spec]:
    """``num`` requests cycling chat/completion x streamed/not (streamed only when asked)."""
    kinds = (
        [(True, True), (False, True)]
        if stream_only
        else [(True, True), (False, True), (True, False), (False, False)]
    )
    return [Spec(chat, stream, max_tokens) for chat, stream in (kinds[i % len(kinds)] for i in range(num))]


# Long enough (over 64 tokens, the router's default disagg_threshold) that every request goes
# through a prefill node; the index leads, so no two requests share a cached prefix block.
_PASSAGE = (
    "The harbour town wakes before dawn. Fishing boats leave the quay one after another, their "
    "lamps swinging over black water, while the bakers on the hill light their ovens and the first "
    "gulls circle the market square. By seven the streets fill with carts, schoolchildren and the "
    "smell of bread. Describe what a visitor sees there at noon, in a few sentences."
)


def body(spec: Spec, index: int) -> dict:
    prompt = f"Request {index}. {_PASSAGE}"
    fields = {
        "max_tokens": spec.max_tokens,
        "temperature": 0.0,
        "ignore_eos": spec.ignore_eos,
        "stream": spec.stream,
    }
    if spec.chat:
        return {"messages": [{"role": "user", "content": prompt}], **fields}
    return {"prompt": prompt, **fields}


def send(client: httpx.Client, spec: Spec, index: int, timeout_s: float) -> Result:
    path = "/v1/chat/completions" if spec.chat else "/v1/completions"
    start = time.monotonic()
    try:
        with client.stream("POST", path, json=body(spec, index), timeout=timeout_s) as response:
            lines = _lines_until(response.iter_lines(), start + timeout_s)
            if lines is None:
                return Result(
                    spec, Outcome.TIMEOUT, 0, time.monotonic() - start, f"no end in {timeout_s:g} s"
                )
            outcome, num_tokens, detail = classify(spec, response.status_code, lines)
    except httpx.TimeoutException as exc:
        return Result(spec, Outcome.TIMEOUT, 0, time.monotonic() - start, repr(exc))
    except httpx.HTTPError as exc:
        return Result(spec, Outcome.BROKEN, 0, time.monotonic() - start, repr(exc))
    return Result(spec, outcome, num_tokens, time.monotonic() - start, detail)


def _lines_until(lines: Iterable[str], deadline: float) -> list[str] | None:
    out = []
    for line in lines:  # httpx's read timeout bounds each wait; the deadline bounds the whole
        out.append(line)
        if time.monotonic() > deadline:
            return None
    return out


def classify(spec: Spec, status: int, lines: list[str]) -> tuple[Outcome, int, str]:
    """How one answer ended, from its status and its body's lines."""
    if status != 200:
        try:
            return Outcome.ERROR_STATUS, 0, json.loads("".join(lines))["error"]["message"]
        except (ValueError, KeyError, TypeError):
            return Outcome.BROKEN, 0, f"status {status} without an error body"
    if not spec.stream:
        return _classify_whole(spec, "".join(lines))
    events = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
    if not events or events[-1] != "[DONE]":
        return Outcome.BROKEN, 0, "stream without [DONE]"
    num_tokens, finish_reason = 0, None
    for event in events[:-1]:
        chunk = json.loads(event)
        if "error" in chunk:
            return Outcome.STREAM_ERROR, num_tokens, chunk["error"]["message"]
        for choice in chunk.get("choices", []):
            text = choice["delta"].get("content") if spec.chat else choice.get("text")
            num_tokens += bool(text)
            finish_reason = choice.get("finish_reason") or finish_reason
    if finish_reason is None:
        return Outcome.BROKEN, num_tokens, "stream ended without a finish_reason"
    return Outcome.OK, num_tokens, ""


def _classify_whole(spec: Spec, text: str) -> tuple[Outcome, int, str]:
    try:
        answer = json.loads(text)
        choice = answer["choices"][0]
        content = choice["message"]["content"] if spec.chat else choice["text"]
        num_tokens = answer["usage"]["completion_tokens"]
    except (ValueError, KeyError, IndexError, TypeError):
        return Outcome.BROKEN, 0, f"malformed answer: {text[:120]!r}"
    if not content or choice.get("finish_reason") is None:
        return Outcome.BROKEN, num_tokens, "empty answer or no finish_reason"
    return Outcome.OK, num_tokens, ""


class Load:
    """Requests sent concurrently in the background; ``results()`` waits for every one of them."""

    def __init__(self, base_url: str, specs: list[Spec], timeout_s: float) -> None:
        self.started = time.monotonic()
        self._client = httpx.Client(base_url=base_url, limits=httpx.Limits(max_connections=len(specs) + 2))
        self._pool = ThreadPoolExecutor(max_workers=len(specs), thread_name_prefix="load")
        self._futures: list[Future[Result]] = [
            self._pool.submit(send, self._client, spec, next(_prompt_numbers), timeout_s) for spec in specs
        ]

    def results(self) -> list[Result]:
        try:
            return [future.result() for future in self._futures]  # each send() ends by its own timeout
        finally:
            self._pool.shutdown()
            self._client.close()
