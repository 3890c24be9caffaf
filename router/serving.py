"""One HTTP request's samples: start them, merge their deltas, answer whole or as SSE.

n > 1 (and a list of prompts) is split here into independent samples with ids
``f"{request_id}-{index}"``, each sent to the nodes with n == 1 and, when a seed is given,
seed + i for the prompt's i-th sample (so a seeded request is reproducible, and its samples
differ). Choice ``index`` = prompt index * n + i, as in OpenAI's API. Usage counts each
prompt once and every sample's output tokens. A beam search is the exception: its n beams are one
sample on one node (``f"{request_id}-{prompt index * n}"``), whose one answer carries every beam.

A streamed answer only starts (status 200) once the first delta arrived: a request that fails
before any token gets a plain error status, never a 200 with an empty body. A sample whose decode
node dies or stalls after tokens resumes on another node (``run_sample``'s migration), streamed or
not, and its deltas simply go on; failures it cannot survive end the stream with an
``{"error": ...}`` event and ``[DONE]``. With migration off, a non-streamed sample is replayed from
scratch instead (the client saw nothing yet).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Protocol

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pdserve.protocol import messages as pm
from pdserve.protocol.reasons import FinishReason
from pdserve.router import responses as rs
from pdserve.router import spans
from pdserve.router.admission import Admission, Stage, Ticket
from pdserve.router.attempts import Replay
from pdserve.router.errors import APIError
from pdserve.router.generation import Backend, Sample, run_sample
from pdserve.router.jobs import Job, Prompt
from pdserve.router.route_trail import RouteTrail, headers, route_notice
from pdserve.router.sample_state import SampleDelta, SampleState
from pdserve.router.structured import tool_calls
from pdserve.router.tokenizer import Tokenizer

log = logging.getLogger(__name__)
_EVENT_QUEUE_SIZE = 64  # deltas buffered for the HTTP side, across a request's samples


@dataclasses.dataclass(slots=True)
class _Choice:
    index: int
    prompt_index: int
    sample: Sample
    state: SampleState
    prompt_ids: tuple[int, ...]
    prefix: str  # echo: prompt text still to send before the output
    logprobs: list = dataclasses.field(default_factory=list)  # non-streaming: all entries
    text_offset: int = 0  # completions logprobs: offset of the next token
    started: bool = False  # streaming: its first chunk went out


class JobRun:
    def __init__(
        self,
        backend: Backend,
        tokenizer: Tokenizer,
        admission: Admission,
        job: Job,
        model: str,
        max_model_len: int,
        trace: spans.RequestTrace | None = None,
    ) -> None:
        self.job = job
        self.model = model
        self._sample_prefix = (
            "chatcmpl-" if job.chat else "cmpl-"
        ) + uuid.uuid4().hex  # unique in the cluster
        self.id = (
            self._sample_prefix
            if job.response_id is None
            else ("chatcmpl-" if job.chat else "cmpl-") + job.response_id
        )
        self.created = int(time.time())
        self._backend = backend
        self._admission = admission
        self._tokenizer = tokenizer
        self._max_model_len = max_model_len
        self._events: asyncio.Queue[tuple[int, SampleDelta | APIError]] = asyncio.Queue(_EVENT_QUEUE_SIZE)
        self._tasks: list[asyncio.Task] = []
        self.choices = self._make_choices(time.time())
        self._num_open = len(self.choices)  # choices not finished yet (events() counts them down)
        chosen = job.params.logprob_token_ids is not None
        self.formatter = rs.LogprobFormatter(tokenizer, job.logprobs or 0, job.tokens_as_ids, chosen)
        # where each sample runs, by sample request id, in choice order (a beam search: one)
        self.trails = {c.sample.request_id: RouteTrail() for c in self.choices}
        self.sent_headers: dict[str, str] | None = None  # a stream's x-pdserve-* headers, once sent
        self.trace = trace  # its spans, or the client's trace context passed on (router/spans.py)
        if trace is not None:
            trace.describe(self)

    def path_headers(self) -> dict[str, str]:
        """The x-pdserve-* headers: where each sample ran (router.route_trail)."""
        return headers(list(self.trails.values()))

    def route_notice(self) -> list[dict[str, object]] | None:
        """A stream's routes, when they changed after its headers went out (else None)."""
        if self.sent_headers is None or self.path_headers() == self.sent_headers:
            return None
        return route_notice(list(self.trails.values()))

    def _make_choices(self, arrival: float) -> list[_Choice]:
        choices = []
        n = self.job.params.n
        for p, prompt in enumerate(self.job.prompts):
            base = self.job.params_for(prompt, self._max_model_len)
            beams = None  # a beam search: one sample, on one node, answers the prompt's n choices
            if base.beam_search is not None:
                beams = Sample(
                    f"{self._sample_prefix}-{p * n}", prompt.token_ids, base, arrival, self.job.adapter_rank
                )
            for i in range(n):
                seed = None if base.seed is None else (base.seed + i + (1 << 63)) % (1 << 64) - (1 << 63)
                params = dataclasses.replace(base, n=1, seed=seed)
                index = p * n + i
                sample = beams or Sample(
                    f"{self._sample_prefix}-{index}", prompt.token_ids, params, arrival, self.job.adapter_rank
                )
                choices.append(
                    _Choice(index, p, sample, self._state(sample), prompt.token_ids, self._echo_text(prompt))
                )
        return choices

    def _groups(self) -> list[list[_Choice]]:
        """The choices each sample answers: one, or a beam search's n."""
        groups: dict[str, list[_Choice]] = {}
        for choice in self.choices:
            groups.setdefault(choice.sample.request_id, []).append(choice)
        return list(groups.values())

    def _state(self, sample: Sample) -> SampleState:
        params = sample.params
        return SampleState(
            self._tokenizer, sample.prompt_ids, params.stop, self.job.no_output, params.min_tokens
        )

    def _echo_text(self, prompt: Prompt) -> str:
        if self.job.chat:
            return prompt.reply_prefix
        if not self.job.echo:
            return ""
        if prompt.text is not None:
            return prompt.text
        # Token ids echo as the tokenizer decodes them, special tokens kept (as vLLM does), so the
        # echo's length is the sum of the per-token texts that text_offset counts.
        return self._tokenizer.decode(list(prompt.token_ids), skip_special_tokens=False)

    def start(self) -> None:
        """Admit every sample (or raise 429 taking nothing) and start them."""
        groups = self._groups()
        with spans.admission(self.trace, len(groups)):
            self._admit(len(groups))
        for group in groups:
            ticket = Ticket(self._admission, (Stage.DECODE, Stage.PREFILL))
            self._tasks.append(asyncio.create_task(self._drive(group, ticket)))

    def _admit(self, num: int) -> None:
        """Take a prefill and a decode slot for each of ``num`` samples, or raise 429 taking none."""
        try:
            self._admission.admit(Stage.DECODE, num)
            try:
                self._admission.admit(Stage.PREFILL, num)
            except APIError:
                self._admission.release(Stage.DECODE, num)
                raise
        except APIError:
            self._backend.metrics.shed.labels(reason="inflight_limit").inc()
            raise

    def cancel(self) -> None:
        """Stop every sample (synchronous: safe in a cancelled scope); their nodes get aborts."""
        for task in self._tasks:
            task.cancel()

    def fail(self, error: APIError) -> None:
        """Cancel every sample and make ``events`` end with ``error``."""
        self.cancel()
        while not self._events.empty():
            self._events.get_nowait()
        self._events.put_nowait((0, error))

    async def _drive(self, group: list[_Choice], ticket: Ticket) -> None:
        index = group[0].index
        try:
            await self._relay(group, ticket)
        except APIError as exc:
            await self._events.put((index, exc))
        except Exception as exc:  # a bug: answer 500 rather than hang the client
            log.exception("sample %s failed", group[0].sample.request_id)
            await self._events.put((index, APIError(500, f"internal error: {exc}", None, "internal")))
        finally:
            ticket.release_all()

    async def _relay(self, group: list[_Choice], ticket: Ticket) -> None:
        """Run the sample for its choices (a beam search answers n at once); streaming: every
        delta to ``events``; else only the last one."""
        sample = group[0].sample
        running = list(group)
        trail = self.trails[sample.request_id]
        trace = spans.sample(self.trace, sample)
        runs = run_sample(self._backend, sample, ticket, not self.job.stream, trail, trace)
        async with contextlib.aclosing(runs) as chunks:
            async for chunk in chunks:
                if isinstance(chunk, Replay):  # nothing of it reached the client: start the sample over
                    for choice in group:
                        choice.state = self._state(sample)
                        choice.logprobs = []
                    continue
                for choice, part in zip(group, _beams_of(chunk, len(group)), strict=True):
                    if choice in running and await self._deliver(choice, part):
                        running.remove(choice)
                if not running:
                    return
        raise APIError(502, "the node ended the sample without a finish reason", None, "node_error")

    async def _deliver(self, choice: _Choice, chunk: pm.TokenChunk) -> bool:
        """One chunk of the choice's sample to ``events``; True once the choice has finished."""
        delta = choice.state.on_chunk(chunk)
        if self.job.stream or delta.finish_reason is not None:
            await self._events.put((choice.index, delta))
        if not self.job.stream:
            choice.logprobs.extend(delta.logprobs)
        if delta.finish_reason is None:
            return False
        self._count_tokens(choice)
        return True

    def _count_tokens(self, choice: _Choice) -> None:
        metrics = self._backend.metrics
        metrics.prompt_tokens.inc(choice.state.num_prompt_tokens)
        metrics.cached_tokens.inc(choice.state.num_cached_tokens)
        metrics.generation_tokens.inc(choice.state.num_output_tokens)

    async def events(self) -> AsyncIterator[tuple[_Choice, SampleDelta | APIError]]:
        """Deltas as they come, until every sample finished; stops after the first error."""
        while self._num_open:
            index, event = await self._events.get()
            yield self.choices[index], event
            if isinstance(event, APIError):
                return
            if event.finish_reason is not None:
                self._num_open -= 1

    def usage(self) -> rs.Usage:
        firsts = {c.prompt_index: c for c in reversed(self.choices)}  # each prompt's first sample
        return rs.Usage(
            prompt_tokens=sum(c.state.num_prompt_tokens for c in firsts.values()),
            completion_tokens=sum(c.state.num_output_tokens for c in self.choices),
            cached_tokens=sum(c.state.num_cached_tokens for c in firsts.values()),
        )

    # ------------------------------------------------------------------ formatting
    def _logprobs(self, choice: _Choice, entries, echoed: bool = False) -> dict | None:
        """The logprobs of ``entries``; ``echoed``: the echoed prompt's go first (completions)."""
        if self.job.logprobs is None:
            return None
        if self.job.chat:
            return self.formatter.chat(entries)
        if not echoed:
            body, choice.text_offset = self.formatter.completion(entries, choice.text_offset)
            return body
        body, _ = self.formatter.completion_prompt(choice.prompt_ids, choice.state.prompt_logprobs or ())
        output, choice.text_offset = self.formatter.completion(entries, choice.text_offset)
        return {key: body[key] + output[key] for key in body}

    def _prompt_logprobs(self, choice: _Choice) -> list | None:
        """The prompt_logprobs field: null when not asked for."""
        if self.job.prompt_logprobs is None:
            return None
        return self.formatter.prompt_logprobs(choice.state.prompt_logprobs or (), self.job.prompt_logprobs)

    def _prompt_fields(self, choice: _Choice) -> dict:
        """vLLM's prompt fields: prompt_logprobs (always, null when not asked), prompt_token_ids."""
        fields: dict = {"prompt_logprobs": self._prompt_logprobs(choice)}
        if self.job.return_token_ids:
            fields["prompt_token_ids"] = list(choice.prompt_ids)
        return fields

    def _continuous_usage(self) -> rs.Usage | None:
        return self.usage() if self.job.continuous_usage else None

    def chunk(self, choice: _Choice, delta: SampleDelta) -> str | None:
        """The SSE event for one delta (None when it carries nothing)."""
        first, choice.started = not choice.started, True
        text = choice.prefix + delta.text
        if choice.prefix:
            choice.text_offset = len(choice.prefix)
        choice.prefix = ""
        if self.job.tool_plan is not None:
            text = ""  # the calls go out whole, once the reply is complete
        echoed = first and self.job.echo and not self.job.chat
        if self._empty(first, text, delta, echoed):
            return None
        logprobs = self._logprobs(choice, delta.logprobs, echoed)
        ids = {"token_ids": list(delta.token_ids)} if self.job.return_token_ids else {}
        if self.job.chat:
            content: dict[str, object] = {"content": text} if text else {}
            finish, calls = delta.finish_reason, None
            if self.job.tool_plan is not None:
                calls = self._tool_calls(choice, finish)
                if calls:
                    content = {"tool_calls": rs.tool_call_deltas(calls)}
                elif finish is not None:
                    content = {"content": choice.state.text}  # cut short (length): the text as it is
            body = rs.chat_chunk_choice(choice.index, content, logprobs, finish, bool(calls), **ids)
            return self._chunk_event("chat.completion.chunk", body, delta)
        extra = self._prompt_fields(choice) if first else {"prompt_logprobs": None}
        body = rs.completion_choice(choice.index, text, logprobs, delta.finish_reason, **extra, **ids)
        return self._chunk_event("text_completion", body, delta)

    def _chunk_event(self, object_: str, body: dict, delta: SampleDelta) -> str:
        """One choice's chunk as an SSE event; the stream's last chunk with a choice (the last
        open choice's finish) carries ``pdserve_route`` when the route changed after the headers,
        unless a usage chunk, asked for, comes after it and carries it. Never a chunk without
        choices that the client did not ask for: clients read ``choices[0]`` of every chunk."""
        extra: dict[str, object] = {}
        if delta.finish_reason is not None and self._num_open == 1 and not self.job.include_usage:
            if (notice := self.route_notice()) is not None:
                extra["pdserve_route"] = notice
        envelope = rs.envelope(
            self.id, object_, self.created, self.model, [body], self._continuous_usage(), **extra
        )
        return rs.sse(envelope)

    def _empty(self, first: bool, text: str, delta: SampleDelta, echoed: bool) -> bool:
        """Nothing in the delta for the client: no text, logprobs, finish, first chunk's fields or
        token ids asked for. Tokens whose text is not out yet (a character split over tokens)
        still go when their ids were asked for."""
        job = self.job
        wants_first = first and (job.prompt_logprobs is not None or job.return_token_ids or echoed)
        ids = job.return_token_ids and bool(delta.token_ids)
        return not (text or delta.logprobs or delta.finish_reason is not None or wants_first or ids)

    def tool_calls_of(self, choice: _Choice) -> list | None:
        """A finished tools-constrained choice's calls (new call ids each time it is asked)."""
        return self._tool_calls(choice, choice.state.finish_reason)

    def _tool_calls(self, choice: _Choice, finish_reason: FinishReason | None) -> list | None:
        """A finished tools-constrained reply as tool calls (None while running or cut short)."""
        if self.job.tool_plan is None or finish_reason is not FinishReason.STOP:
            return None
        return tool_calls(self.job.tool_plan, choice.state.text)

    def role_chunks(self, first: _Choice) -> list[str]:
        """Chat streams open each choice with the assistant role (and the echoed content); the
        first of them carries the prompt's fields (the prompt is one: ``first`` has them)."""
        if not self.job.chat:
            return []
        chunks = []
        for i, c in enumerate(self.choices):
            delta = {"role": "assistant", "content": c.prefix}
            c.prefix = ""
            extra = self._prompt_fields(first) if i == 0 else {}
            body = rs.chat_chunk_choice(c.index, delta, None, None)
            envelope = rs.envelope(
                self.id,
                "chat.completion.chunk",
                self.created,
                self.model,
                [body],
                self._continuous_usage(),
                **extra,
            )
            chunks.append(rs.sse(envelope))
        return chunks

    def last_chunk(self, notice: list[dict[str, object]] | None) -> str:
        """A stream's usage chunk before [DONE] (include_usage), without choices; with
        ``pdserve_route`` (each sample's route as it ended) when the route changed after the
        headers went out."""
        object_ = "chat.completion.chunk" if self.job.chat else "text_completion"
        usage = self.usage() if self.job.include_usage else None
        extra = {} if notice is None else {"pdserve_route": notice}
        return rs.sse(rs.envelope(self.id, object_, self.created, self.model, [], usage, **extra))

    def whole(self) -> dict:
        choices = []
        for c in self.choices:
            text = c.prefix + c.state.text
            c.text_offset = len(c.prefix)
            logprobs = self._logprobs(c, c.logprobs, echoed=self.job.echo and not self.job.chat)
            ids = {"token_ids": list(c.state.output_token_ids)} if self.job.return_token_ids else {}
            if self.job.chat:
                calls = self._tool_calls(c, c.state.finish_reason)
                extra = self._prompt_fields(c) if self.job.batched else {}  # each choice its own prompt's
                choices.append(
                    rs.chat_choice(c.index, text, logprobs, c.state.finish_reason, calls, **extra, **ids)
                )
            else:
                extra = self._prompt_fields(c)
                choices.append(
                    rs.completion_choice(c.index, text, logprobs, c.state.finish_reason, **extra, **ids)
                )
        if not self.job.chat:
            body = rs.envelope(self.id, "text_completion", self.created, self.model, choices, self.usage())
            return rs.with_vllm_keys(body, rs.COMPLETION_KEYS)
        extra = {} if self.job.batched else self._prompt_fields(self.choices[0])
        body = rs.envelope(
            self.id, "chat.completion", self.created, self.model, choices, self.usage(), **extra
        )
        return rs.with_vllm_keys(body, rs.CHAT_KEYS)


class Presenter(Protocol):
    """How a run's results are written: OpenAI's completions and chat shapes (``OPENAI``), or
    another API's over the same run (router.responses_api, router.messages_api)."""

    def whole(self, run: JobRun) -> dict: ...

    def stream(self, run: JobRun, first, events) -> AsyncIterator[str]:
        """The SSE body from the first event on; ``events`` yields the rest."""
        ...


class _OpenAIPresenter:
    def whole(self, run: JobRun) -> dict:
        return run.whole()

    def stream(self, run: JobRun, first, events) -> AsyncIterator[str]:
        return _stream(run, first, events)


OPENAI = _OpenAIPresenter()


async def serve(run: JobRun, request: Request, presenter: Presenter = OPENAI) -> Response:
    """Start the run and answer: whole once every sample finished, or as SSE from the first
    delta on. Either way the x-pdserve-* headers say where each sample ran."""
    run.start()
    try:
        if not run.job.stream:
            return await _answer_whole(run, request, presenter)
        events = run.events()
        watcher = asyncio.create_task(_cancel_on_disconnect(run, request))  # no token yet to fail on
        try:
            first = await anext(events)
        finally:
            watcher.cancel()
        if isinstance(first[1], APIError):
            raise first[1]
    except BaseException:
        run.cancel()
        raise
    run.sent_headers = run.path_headers()
    return _SampleStream(run, presenter.stream(run, first, events), run.sent_headers)


class _SampleStream(StreamingResponse):
    """SSE that stops the samples however the response ends. When the client goes away,
    Starlette abandons the body generator without closing it, so its ``finally`` would only run
    whenever it is garbage-collected: too late to free node blocks promptly."""

    def __init__(self, run: JobRun, body: AsyncIterator[str], path_headers: dict[str, str]) -> None:
        super().__init__(
            body,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **path_headers},
        )
        self._run = run

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._run.cancel()


async def _answer_whole(run: JobRun, request: Request, presenter: Presenter) -> Response:
    watcher = asyncio.create_task(_cancel_on_disconnect(run, request))
    try:
        async for _, event in run.events():
            if isinstance(event, APIError):
                raise event
        return JSONResponse(presenter.whole(run), headers=run.path_headers())
    finally:
        watcher.cancel()


async def _cancel_on_disconnect(run: JobRun, request: Request) -> None:
    while not await request.is_disconnected():
        await asyncio.sleep(0.5)
    run.fail(APIError(499, "the client disconnected", None, "client_disconnected"))


async def _stream(run: JobRun, first, events) -> AsyncIterator[str]:
    try:
        choice, event = first
        for line in run.role_chunks(choice):
            yield line
        while True:
            if isinstance(event, APIError):
                yield rs.sse(event.body())
                break
            chunk = run.chunk(choice, event)
            if chunk is not None:
                yield chunk
            try:
                choice, event = await anext(events)
            except StopAsyncIteration:
                if run.job.include_usage:  # the usage chunk carries the route notice, if any
                    yield run.last_chunk(run.route_notice())
                break
        yield rs.SSE_DONE
    finally:
        run.cancel()


def _beams_of(chunk: pm.TokenChunk, num_choices: int) -> tuple[pm.TokenChunk, ...]:
    """A chunk as its choices see it: itself, or a beam search's answer as one chunk a beam."""
    if num_choices == 1:
        return (chunk,)
    if len(chunk.beams) != num_choices - 1:
        raise APIError(
            502, f"the node answered {len(chunk.beams) + 1} of {num_choices} beams", None, "node_error"
        )
    others = (
        dataclasses.replace(chunk, token_ids=b.token_ids, logprobs=b.logprobs, finish_reason=b.finish_reason)
        for b in chunk.beams
    )
    return (dataclasses.replace(chunk, beams=()), *others)
