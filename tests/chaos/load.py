"""The chaos suite's load and checks: requests of mixed lengths, streamed or not, with logprobs or
not, sent steadily from threads; every Outcome (tokens, finish, error, timings) checked against HF
greedy on the same tiny weights: each request ended in time and cleanly, or failed in a way the
fault allows. ``write_report_row`` adds a line to docs/reliability.md's table when asked."""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import random
import threading
import time

import httpx

from tests import web
from tests.chaos.harness import REQUEST_DEADLINE_S


@dataclasses.dataclass(frozen=True, slots=True)
class Spec:
    prompt: tuple[int, ...]  # token ids
    max_tokens: int
    stream: bool
    logprobs: bool


@dataclasses.dataclass(slots=True)
class Outcome:
    spec: Spec
    started: float  # time.monotonic()
    ended: float = 0.0
    status: int | None = None  # HTTP status; None: the connection failed
    tokens: list[int] = dataclasses.field(default_factory=list)  # when logprobs were asked for
    text: str = ""
    finish_reason: str | None = None
    num_completion_tokens: int | None = None  # usage
    num_prompt_tokens: int | None = None  # usage
    error: dict | None = None  # the JSON error body or the SSE error event
    connection_error: str | None = None
    first_token_at: float | None = None  # streamed: when the first token event came

    @property
    def kind(self) -> str:
        """How it ended: complete, sse_error, http_<status>, connection_error, incomplete."""
        if self.connection_error is not None:
            return "connection_error"
        if self.status != 200:
            return f"http_{self.status}"
        if self.error is not None:
            return "sse_error"
        return "complete" if self.finish_reason == "length" else "incomplete"


def prompts(seed: int, num: int) -> list[tuple[int, ...]]:
    """Mixed lengths: short ones prefill on the decode node, long ones go through a prefill node."""
    rng = random.Random(seed)
    lengths = [rng.choice([6, 20, 80, 200, 400]) for _ in range(num)]
    return [tuple(rng.randrange(100, 40000) for _ in range(n)) for n in lengths]


def completion_body(model_name: str, spec: Spec) -> dict:
    """The /v1/completions request for ``spec``: greedy, exactly max_tokens, token-id logprobs if asked."""
    body = {
        "model": model_name,
        "prompt": list(spec.prompt),
        "max_tokens": spec.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": spec.stream,
    }
    if spec.logprobs:
        body |= {"logprobs": 1, "return_tokens_as_token_ids": True}
    if spec.stream:
        body["stream_options"] = {"include_usage": True}
    return body


def request_once(url: str, model_name: str, spec: Spec, timeout_s: float = REQUEST_DEADLINE_S) -> Outcome:
    body = completion_body(model_name, spec)
    out = Outcome(spec, time.monotonic())
    try:
        if spec.stream:
            _stream(url, body, out, timeout_s)
        else:
            reply = web.post(url + "/v1/completions", json=body, timeout=timeout_s)
            out.status = reply.status_code
            data = reply.json()
            if reply.status_code == 200:
                choice = data["choices"][0]
                out.text, out.finish_reason = choice["text"], choice["finish_reason"]
                out.tokens = _token_ids(choice.get("logprobs"))
                out.num_completion_tokens = data["usage"]["completion_tokens"]
                out.num_prompt_tokens = data["usage"]["prompt_tokens"]
            else:
                out.error = data.get("error")
    except (httpx.TransportError, json.JSONDecodeError) as exc:
        out.connection_error = f"{type(exc).__name__}: {exc}"
    out.ended = time.monotonic()
    return out


def _token_ids(logprobs: dict | None) -> list[int]:
    return [int(t.removeprefix("token_id:")) for t in (logprobs or {}).get("tokens", [])]


def _stream(url: str, body: dict, out: Outcome, timeout_s: float) -> None:
    with web.stream("POST", url + "/v1/completions", json=body, timeout=timeout_s) as reply:
        out.status = reply.status_code
        if reply.status_code != 200:
            out.error = json.loads(reply.read()).get("error")
            return
        for line in reply.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                out.error = event["error"]
                continue
            if event.get("usage"):
                out.num_prompt_tokens = event["usage"]["prompt_tokens"]
                out.num_completion_tokens = event["usage"]["completion_tokens"]
            if not event["choices"]:
                continue
            choice = event["choices"][0]
            if choice["text"] or choice.get("logprobs"):
                out.first_token_at = out.first_token_at or time.monotonic()
            out.text += choice["text"]
            out.tokens += _token_ids(choice.get("logprobs"))
            out.finish_reason = choice["finish_reason"] or out.finish_reason


class LoadGenerator:
    """``concurrency`` client threads sending mixed requests back to back until ``stop()``."""

    def __init__(
        self, url: str, model_name: str, specs: list[Spec], concurrency: int = 8, seed: int = 0
    ) -> None:
        self.url, self.model_name, self.specs = url, model_name, specs
        self.outcomes: list[Outcome] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._rng = random.Random(seed)
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(concurrency)]

    def __enter__(self) -> LoadGenerator:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _run(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                spec = self._rng.choice(self.specs)
            outcome = request_once(self.url, self.model_name, spec)
            with self._lock:
                self.outcomes.append(outcome)
            if outcome.connection_error is not None:
                time.sleep(0.2)  # the router is down: don't spin

    def in_flight_at(self, moment: float) -> int:
        """Requests started before ``moment`` and ended after it (call after ``stop``)."""
        with self._lock:
            return sum(1 for o in self.outcomes if o.started <= moment <= o.ended)

    def stop(self, timeout_s: float = REQUEST_DEADLINE_S + 10) -> list[Outcome]:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout_s)
        assert not any(t.is_alive() for t in self._threads), "a client request did not end"
        return self.outcomes


def make_specs(seed: int, num: int = 16, long_output: bool = False) -> list[Spec]:
    rng = random.Random(seed)
    out = []
    for i, prompt in enumerate(prompts(seed, num)):
        max_tokens = rng.choice([64, 128]) if long_output and i % 2 == 0 else rng.choice([4, 16, 40])
        out.append(Spec(prompt, max_tokens, stream=i % 2 == 0, logprobs=(i // 2) % 2 == 0))
    return out


# --------------------------------------------------------------------------- checks
class Expected:
    """Hugging Face greedy outputs, each computed once."""

    def __init__(self, model: pathlib.Path) -> None:
        from pdserve.router.tokenizer import Tokenizer

        self.model = model
        self.tokenizer = Tokenizer(model)
        self._cache: dict[tuple, list[int]] = {}

    def tokens(self, spec: Spec) -> list[int]:
        key = (spec.prompt, spec.max_tokens)
        if key not in self._cache:
            from tests.engine_helpers import hf_greedy

            self._cache[key] = hf_greedy(str(self.model), list(spec.prompt), spec.max_tokens)
        return self._cache[key]

    def check(self, outcome: Outcome) -> None:
        """A complete outcome's output is Hugging Face's, token for token (or as text)."""
        want = self.tokens(outcome.spec)
        if outcome.spec.logprobs:
            assert outcome.tokens == want, outcome
        else:
            assert outcome.text == self.tokenizer.decode(want), outcome
        # Usage counts the prompt once and each output token once (a migrated stream too).
        assert outcome.num_completion_tokens == outcome.spec.max_tokens, outcome
        assert outcome.num_prompt_tokens == len(outcome.spec.prompt), outcome


def check_outcomes(outcomes: list[Outcome], expected: Expected, allowed: set[str]) -> dict[str, int]:
    """Every request ended in time, a complete one equal to HF, every other in an allowed way with
    a clear error; a streamed one that failed had sent a token first (else it had to be retried)."""
    counts: dict[str, int] = {}
    for o in outcomes:
        counts[o.kind] = counts.get(o.kind, 0) + 1
        assert o.ended - o.started < REQUEST_DEADLINE_S, o
        if o.kind == "complete":
            expected.check(o)
            continue
        assert o.kind in allowed, o
        if o.kind == "sse_error":
            assert o.first_token_at is not None, f"failed before its first token, not retried: {o}"
            assert o.error.get("code") and o.error.get("message"), o
        if o.kind.startswith("http_"):
            assert o.error and o.error.get("message"), o
    return counts


def write_report_row(row: dict) -> None:
    """One line of docs/reliability.md's table, when scripts/chaos_report.py asked for it."""
    path = os.environ.get("PDSERVE_CHAOS_REPORT")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(row) + "\n")
