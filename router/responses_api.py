"""OpenAI's Responses API over the chat completions path.

A Responses request becomes a chat completions body (``ChatBody``): ``instructions`` a system
message, the stored conversation of ``previous_response_id`` next, then ``input``'s items
(messages; ``function_call`` items as the assistant's tool calls; ``function_call_output`` items
as tool messages); flat function tools nested as chat's; ``text.format`` as ``response_format``;
``max_output_tokens`` as ``max_tokens``. ``jobs.chat_job`` then builds the engine request as for
chat completions, through the same chat template, so the text is chat completions' text for the
same messages and sampling. Errors from that path name the Responses field (``PARAM_NAMES``).

``ResponsesPresenter`` writes the run as a ``response`` object, whole or as the Responses event
stream, and keeps it in the router's store (router/response_store.py) when ``store`` is true.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pydantic

from pdserve.protocol.reasons import FinishReason
from pdserve.router.errors import APIError, bad_request
from pdserve.router.jobs import Job, chat_job
from pdserve.router.openai_schema import ChatBody, reads_as, validation_error
from pdserve.router.request_limits import Limits
from pdserve.router.response_store import ResponseStore, StoredResponse
from pdserve.router.responses_schema import CHAT_FIELDS, LOGPROBS_INCLUDE, REFUSED, ResponsesBody
from pdserve.router.serving import JobRun
from pdserve.router.structured import auto_tool_choice_message
from pdserve.router.tokenizer import Tokenizer

# A chat body's field, as the Responses request names it (errors name what the client sent).
PARAM_NAMES = {
    "max_tokens": "max_output_tokens",
    "max_completion_tokens": "max_output_tokens",
    "messages": "input",
    "response_format": "text.format",
    "logprobs": "include",
}
_ROLES = ("user", "system", "developer", "assistant")


def _renamed(param: str | None) -> str | None:
    if param is None:
        return None
    head = param.split(".")[0]
    return PARAM_NAMES.get(head, param) if head in PARAM_NAMES else param


def check_refused(body: ResponsesBody) -> None:
    """A field pdserve does not implement passes only at its no-op value (or null)."""
    for name in sorted(body.model_fields_set & REFUSED.keys()):
        value, (allowed, why) = getattr(body, name), REFUSED[name]
        if value is not None and not any(reads_as(value, a) for a in allowed):
            accepted = " or ".join(repr(a) for a in allowed) or "null"
            raise bad_request(f"{name} is not supported: {why} (accepted: {accepted})", name)
    if body.text is not None and body.text.verbosity is not None:
        raise bad_request("text.verbosity is not supported: no verbosity control", "text.verbosity")
    if body.stream_options is not None and body.stream_options.include_obfuscation:
        raise bad_request(
            "stream_options.include_obfuscation is not supported: events carry no obfuscation padding",
            "stream_options.include_obfuscation",
        )
    unknown = sorted(set(body.include or ()) - {LOGPROBS_INCLUDE})
    if unknown:
        raise bad_request(
            f"include: {', '.join(unknown)} is not supported (only {LOGPROBS_INCLUDE})", "include"
        )


def _text_parts(content: Any, param: str) -> str | list[dict[str, str]]:
    """A message's content as chat content: a string, or its text parts (input_text/output_text)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{param} must be a string or a list of text parts", param)
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text") or not isinstance(part.get("text"), str):
            raise bad_request(
                f"{param}.{j}: {kind!r} content is not supported: only input_text and output_text parts",
                f"{param}.{j}.type",
            )
        parts.append({"type": "text", "text": part["text"]})
    return parts


def _item_message(item: Any, i: int) -> dict[str, Any]:
    """One input item as a chat message (function calls: an assistant message with tool_calls)."""
    param = f"input.{i}"
    if not isinstance(item, dict):
        raise bad_request(f"{param} must be an object", param)
    kind = item.get("type", "message")
    if kind == "message":
        if item.get("role") not in _ROLES:
            raise bad_request(f"{param}.role must be one of {', '.join(_ROLES)}", f"{param}.role")
        return {"role": item["role"], "content": _text_parts(item.get("content"), f"{param}.content")}
    if kind == "function_call":
        call = {"name": item.get("name"), "arguments": item.get("arguments")}
        if not all(isinstance(v, str) for v in (*call.values(), item.get("call_id"))):
            raise bad_request(f"{param}: a function_call needs call_id, name and arguments strings", param)
        tool_call = {"id": item["call_id"], "type": "function", "function": call}
        return {"role": "assistant", "content": "", "tool_calls": [tool_call]}
    if kind == "function_call_output":
        if not isinstance(item.get("call_id"), str):
            raise bad_request(f"{param}: a function_call_output needs its call_id", f"{param}.call_id")
        output = _text_parts(item.get("output"), f"{param}.output")
        return {"role": "tool", "tool_call_id": item["call_id"], "content": output}
    raise bad_request(
        f"{param}: {kind!r} items are not supported: only message, function_call and function_call_output",
        f"{param}.type",
    )


def input_messages(body: ResponsesBody) -> list[dict[str, Any]]:
    """``input`` as chat messages."""
    if isinstance(body.input, str):
        return [{"role": "user", "content": body.input}]
    return merged([_item_message(item, i) for i, item in enumerate(body.input)])


def merged(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Consecutive function calls join one assistant message, as one reply's calls are."""
    out: list[dict[str, Any]] = []
    for message in messages:
        last = out[-1] if out else None
        if "tool_calls" in message and last is not None and "tool_calls" in last:
            last["tool_calls"] = [*last["tool_calls"], *message["tool_calls"]]
        else:
            out.append(dict(message))
    return out


def _tools(body: ResponsesBody) -> list[dict[str, Any]] | None:
    """Function tools in chat's shape; any other tool type is refused by name."""
    if body.tools is None:
        return None
    tools = []
    for i, tool in enumerate(body.tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise bad_request(
                f"tools.{i}: {kind!r} tools are not supported: only function tools (built-in tools "
                "such as web search, file search or code interpreter are not served here)",
                "tools",
            )
        function = {k: v for k, v in tool.items() if k != "type"}
        tools.append({"type": "function", "function": function})
    return tools


# The Responses API's "auto" (OpenAI's default with tools), refused as chat's is, in its terms
AUTO_TOOL_CHOICE_MESSAGE = auto_tool_choice_message(
    '"auto"', '"required" or {"type": "function", "name": ...}', '"none"'
)


def _tool_choice(body: ResponsesBody) -> Any:
    choice = body.tool_choice
    if choice in (None, "auto") and body.tools:
        raise bad_request(AUTO_TOOL_CHOICE_MESSAGE, "tool_choice")
    if not isinstance(choice, dict):
        return choice
    if choice.get("type") != "function" or not isinstance(choice.get("name"), str) or len(choice) != 2:
        raise bad_request(
            "tool_choice: only none, auto, required or {type: function, name} are supported", "tool_choice"
        )
    return {"type": "function", "function": {"name": choice["name"]}}


def _response_format(body: ResponsesBody) -> dict[str, Any] | None:
    fmt = body.text.format if body.text is not None else None
    if fmt is None:
        return None
    if fmt.type != "json_schema":
        return {"type": fmt.type}
    schema = {"name": fmt.name, "schema": fmt.schema_, "strict": fmt.strict, "description": fmt.description}
    return {"type": "json_schema", "json_schema": {k: v for k, v in schema.items() if v is not None}}


def chat_body(body: ResponsesBody, history: list[dict[str, Any]]) -> ChatBody:
    """The chat completions body the request stands for (``history``: the stored conversation)."""
    check_refused(body)
    system = [{"role": "system", "content": body.instructions}] if body.instructions else []
    fields: dict[str, Any] = {
        "model": body.model,
        "messages": [*system, *history, *input_messages(body)],
        "max_tokens": body.max_output_tokens,
        "stream": body.stream,
        "tools": _tools(body),
        "tool_choice": _tool_choice(body),
        "response_format": _response_format(body),
    }
    if LOGPROBS_INCLUDE in (body.include or ()):
        fields |= {"logprobs": True, "top_logprobs": body.top_logprobs or 0}
    elif body.top_logprobs:
        raise bad_request(f"top_logprobs needs include: [{LOGPROBS_INCLUDE!r}]", "top_logprobs")
    fields |= {name: getattr(body, name) for name in CHAT_FIELDS if name in body.model_fields_set}
    try:
        return ChatBody.model_validate({k: v for k, v in fields.items() if v is not None})
    except pydantic.ValidationError as exc:
        error = validation_error([dict(e) for e in exc.errors()])
        error.param = _renamed(error.param)
        raise error from None


def responses_job(body: ChatBody, tokenizer: Tokenizer, max_model_len: int, limits: Limits) -> Job:
    """``jobs.chat_job``, its errors naming the Responses fields."""
    try:
        return chat_job(body, tokenizer, max_model_len, limits)
    except APIError as exc:
        exc.param = _renamed(exc.param)
        raise


def _hex_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponsesPresenter:
    """Writes a run as a Responses ``response``, whole or streamed, and stores it."""

    def __init__(self, body: ResponsesBody, store: ResponseStore) -> None:
        self.body = body
        self.id = f"resp_{body.request_id}" if body.request_id else _hex_id("resp")
        self.created_at = int(time.time())
        self._store = store
        self._input = tuple(input_messages(body))  # this turn's, stored (instructions are not carried)
        self._message_id = _hex_id("msg")
        self._sequence = 0

    # ------------------------------------------------------------------ the response object
    def response(self, run: JobRun, status: str, output: list[dict], error: dict | None = None) -> dict:
        body = self.body
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        fmt = (
            body.text.format.model_dump(by_alias=True, exclude_none=True)
            if body.text and body.text.format
            else None
        )
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "background": False,
            "error": error,
            "incomplete_details": incomplete,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "max_tool_calls": None,
            "model": run.model,
            "output": output,
            "parallel_tool_calls": True if body.parallel_tool_calls is None else body.parallel_tool_calls,
            "previous_response_id": body.previous_response_id,
            "reasoning": {"effort": None, "summary": None},
            "service_tier": "default",
            "store": self._stores,
            "temperature": 1.0 if body.temperature is None else body.temperature,
            "text": {"format": fmt or {"type": "text"}},
            "tool_choice": body.tool_choice or "auto",
            "tools": body.tools or [],
            "top_logprobs": body.top_logprobs or 0,
            "top_p": 1.0 if body.top_p is None else body.top_p,
            "truncation": "disabled",
            "usage": None if status == "in_progress" else self._usage(run),
            "user": body.user,
            "metadata": body.metadata or {},
        }

    @property
    def _stores(self) -> bool:
        return bool(self.body.store) and self._store.max_entries > 0

    def _usage(self, run: JobRun) -> dict[str, Any]:
        usage = run.usage()
        return {
            "input_tokens": usage.prompt_tokens,
            "input_tokens_details": {"cached_tokens": usage.cached_tokens},
            "output_tokens": usage.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        }

    def _logprobs(self, run: JobRun, entries) -> list[dict]:
        return run.formatter.chat(entries)["content"] if run.job.logprobs is not None else []

    def _text_item(self, text: str, logprobs: list[dict], status: str) -> dict[str, Any]:
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}
        content = [part] if status != "in_progress" else []
        return {
            "id": self._message_id,
            "type": "message",
            "status": status,
            "role": "assistant",
            "content": content,
        }

    def _output(self, run: JobRun) -> tuple[str, list[dict[str, Any]]]:
        """(status, output items) of the finished run: the reply's text, or its function calls."""
        choice = run.choices[0]
        state = choice.state
        status = "incomplete" if state.finish_reason is FinishReason.LENGTH else "completed"
        calls = run.tool_calls_of(choice)
        if calls:
            return status, [_call_item(call) for call in calls]
        return status, [self._text_item(state.text, self._logprobs(run, choice.logprobs), status)]

    def whole(self, run: JobRun) -> dict:
        status, output = self._output(run)
        response = self.response(run, status, output)
        self._keep(response)
        return response

    def _keep(self, response: dict) -> None:
        if not self._stores:
            return
        output = tuple(merged([_output_message(item) for item in response["output"]]))
        entry = StoredResponse(response, self._input, output, self.body.previous_response_id)
        self._store.put(self.id, entry)

    # ------------------------------------------------------------------ the event stream
    def _event(self, kind: str, **fields: Any) -> str:
        data = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"

    def _opening(self, run: JobRun) -> list[str]:
        in_progress = self.response(run, "in_progress", [])
        events = [self._event("response.created", response=in_progress)]
        events.append(self._event("response.in_progress", response=in_progress))
        if run.job.tool_plan is None:  # a reply constrained to calls opens its items at the end
            events += self._open_text(run)
        return events

    def _open_text(self, run: JobRun) -> list[str]:
        empty = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        return [
            self._event(
                "response.output_item.added", output_index=0, item=self._text_item("", [], "in_progress")
            ),
            self._event(
                "response.content_part.added",
                item_id=self._message_id,
                output_index=0,
                content_index=0,
                part=empty,
            ),
        ]

    def _delta(self, run: JobRun, delta) -> list[str]:
        if run.job.tool_plan is not None or not (delta.text or delta.logprobs):
            return []
        logprobs = self._logprobs(run, delta.logprobs)
        return [
            self._event(
                "response.output_text.delta",
                item_id=self._message_id,
                output_index=0,
                content_index=0,
                delta=delta.text,
                logprobs=logprobs,
            )
        ]

    def _closing(self, run: JobRun) -> list[str]:
        status, output = self._output(run)
        events = []
        for index, item in enumerate(output):
            events += self._close_item(run, index, item)
        response = self.response(run, status, output)
        if (notice := run.route_notice()) is not None:
            response["pdserve_route"] = notice
        self._keep(response)
        kind = "response.completed" if status == "completed" else "response.incomplete"
        return [*events, self._event(kind, response=response)]

    def _close_item(self, run: JobRun, index: int, item: dict[str, Any]) -> list[str]:
        if item["type"] == "function_call":
            added = {**item, "status": "in_progress", "arguments": ""}
            ids = {"item_id": item["id"], "output_index": index}
            return [
                self._event("response.output_item.added", output_index=index, item=added),
                self._event("response.function_call_arguments.delta", **ids, delta=item["arguments"]),
                self._event("response.function_call_arguments.done", **ids, arguments=item["arguments"]),
                self._event("response.output_item.done", output_index=index, item=item),
            ]
        # a reply constrained to calls that was cut short: its text item opens only now
        opened = self._open_text(run) if run.job.tool_plan is not None else []
        part = item["content"][0]
        ids = {"item_id": item["id"], "output_index": index, "content_index": 0}
        return [
            *opened,
            self._event("response.output_text.done", **ids, text=part["text"], logprobs=part["logprobs"]),
            self._event("response.content_part.done", **ids, part=part),
            self._event("response.output_item.done", output_index=index, item=item),
        ]

    def _failed(self, run: JobRun, error: APIError) -> str:
        failure = {"code": error.code or error.type, "message": error.message}
        return self._event("response.failed", response=self.response(run, "failed", [], failure))

    async def stream(self, run: JobRun, first, events) -> AsyncIterator[str]:
        try:
            for line in self._opening(run):
                yield line
            _, event = first
            while True:
                if isinstance(event, APIError):
                    yield self._failed(run, event)
                    return
                for line in self._delta(run, event):
                    yield line
                try:
                    _, event = await anext(events)
                except StopAsyncIteration:
                    break
            for line in self._closing(run):
                yield line
        finally:
            run.cancel()


def _call_item(call: dict[str, Any]) -> dict[str, Any]:
    """A chat tool call as a Responses function_call output item."""
    function = call["function"]
    return {
        "id": _hex_id("fc"),
        "type": "function_call",
        "status": "completed",
        "call_id": call["id"],
        "name": function["name"],
        "arguments": function["arguments"],
    }


def _output_message(item: dict[str, Any]) -> dict[str, Any]:
    """An output item as the chat message a later turn's template sees."""
    if item["type"] == "function_call":
        call = {
            "id": item["call_id"],
            "type": "function",
            "function": {"name": item["name"], "arguments": item["arguments"]},
        }
        return {"role": "assistant", "content": "", "tool_calls": [call]}
    return {"role": "assistant", "content": "".join(p["text"] for p in item["content"])}
