"""Anthropic's Messages API over the chat completions path, as vLLM converts it.

A Messages request becomes a chat completions body: ``system`` (and any system-role messages)
one system message; each message's text blocks its content; ``tool_use`` blocks the assistant's
tool calls; ``tool_result`` blocks tool messages, ahead of the user text beside them; ``tools``
chat's function tools; ``tool_choice`` any / tool / none as required / named / none;
``stop_sequences`` as ``stop``; ``max_tokens`` as is. ``jobs.chat_job`` builds the engine request,
so the text is chat completions' for the same messages and sampling.

``MessagesPresenter`` writes the run as an Anthropic ``message``, whole or as its event stream.
Usage follows Anthropic: ``input_tokens`` are the prompt tokens not read from a prefix cache,
``cache_read_input_tokens`` those that were.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pydantic

from pdserve.protocol.reasons import FinishReason
from pdserve.router.errors import APIError, anthropic_body, bad_request
from pdserve.router.jobs import Job, chat_job
from pdserve.router.messages_schema import CHAT_FIELDS, REFUSED, CountTokensBody, MessagesBody
from pdserve.router.openai_schema import ChatBody, reads_as, validation_error
from pdserve.router.request_limits import Limits
from pdserve.router.serving import JobRun
from pdserve.router.structured import auto_tool_choice_message
from pdserve.router.tokenizer import Tokenizer

PARAM_NAMES = {
    "max_completion_tokens": "max_tokens",
    "stop": "stop_sequences",
    "response_format": "output_config",
}


def _renamed(param: str | None) -> str | None:
    return None if param is None else PARAM_NAMES.get(param.split(".")[0], param)


def _check_refused(body: CountTokensBody | MessagesBody) -> None:
    for name in sorted(body.model_fields_set & REFUSED.keys()):
        value, (allowed, why) = getattr(body, name), REFUSED[name]
        if value is not None and not any(reads_as(value, a) for a in allowed):
            raise bad_request(f"{name} is not supported: {why}", name)
    if body.output_config is not None and body.output_config.effort is not None:
        raise bad_request(
            "output_config.effort is not supported: no reasoning effort", "output_config.effort"
        )
    for i, tool in enumerate(body.tools or ()):
        if tool.type not in (None, "custom"):
            raise bad_request(f"tools.{i}: server tools ({tool.type}) are not supported", "tools")


def _block_text(blocks: Any, param: str) -> str:
    """A tool result's or system's content: a string, or its text blocks joined."""
    if isinstance(blocks, str) or blocks is None:
        return blocks or ""
    texts = []
    for j, block in enumerate(blocks):
        if (
            not isinstance(block, dict)
            or block.get("type") != "text"
            or not isinstance(block.get("text"), str)
        ):
            raise bad_request(f"{param}.{j}: only text blocks are supported here", param)
        texts.append(block["text"])
    return "\n".join(texts) if param.endswith("content") else "".join(texts)


def _system(body: CountTokensBody | MessagesBody) -> list[dict[str, Any]]:
    parts = [_block_text(body.system, "system")] if body.system else []
    for i, message in enumerate(body.messages):
        if message.role == "system":
            parts.append(_block_text(message.content, f"messages.{i}.content"))
    text = "".join(p for p in parts if p)
    return [{"role": "system", "content": text}] if text else []


def _tool_call(block: dict[str, Any], param: str) -> dict[str, Any]:
    if not isinstance(block.get("name"), str) or not isinstance(block.get("input", {}), dict):
        raise bad_request(f"{param}: a tool_use block needs a name and an input object", param)
    arguments = json.dumps(block.get("input") or {})
    return {
        "id": block.get("id") or _hex_id("toolu"),
        "type": "function",
        "function": {"name": block["name"], "arguments": arguments},
    }


def _message(role: str, content: Any, i: int) -> list[dict[str, Any]]:
    """One Anthropic message as chat messages: its tool results first, then its text and calls."""
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    texts, calls, results = [], [], []
    for j, block in enumerate(content):
        param = f"messages.{i}.content.{j}"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            if block["text"]:  # as vLLM: an empty text block adds nothing
                texts.append({"type": "text", "text": block["text"]})
        elif kind == "tool_use" and role == "assistant":
            calls.append(_tool_call(block, param))
        elif kind == "tool_result" and role == "user":
            content_text = _block_text(block.get("content"), f"{param}.content")
            results.append(
                {"role": "tool", "tool_call_id": block.get("tool_use_id") or "", "content": content_text}
            )
        else:
            raise bad_request(f"{param}: {kind!r} blocks are not supported in a {role} message", "messages")
    message: dict[str, Any] = {"role": role}
    if texts:
        message["content"] = texts[0]["text"] if len(texts) == 1 else texts
    if calls:
        message["tool_calls"] = calls
    keep = texts or calls or (role == "assistant" and not results)
    return [*results, *([message] if keep else [])]


def chat_messages(body: CountTokensBody | MessagesBody) -> list[dict[str, Any]]:
    messages = _system(body)
    for i, message in enumerate(body.messages):
        if message.role != "system":
            messages += _message(message.role, message.content, i)
    return messages


# Anthropic's "auto" (its default with tools), refused as chat's is (router.structured), in its terms
AUTO_TOOL_CHOICE_MESSAGE = auto_tool_choice_message(
    '{"type": "auto"}', '{"type": "any"} or {"type": "tool", "name": ...}', '{"type": "none"}'
)


def _tool_choice(body: CountTokensBody | MessagesBody, counting: bool) -> Any:
    choice = body.tool_choice
    if choice is None or choice.type == "auto":
        if body.tools and not counting:
            raise bad_request(AUTO_TOOL_CHOICE_MESSAGE, "tool_choice")
        # counting: the prompt is the same whatever the choice (the template sees the tools)
        return "none" if body.tools else None
    if choice.type == "tool":
        if not choice.name:
            raise bad_request("tool_choice.name is required when type is 'tool'", "tool_choice")
        return {"type": "function", "function": {"name": choice.name}}
    return {"any": "required", "none": "none"}[choice.type]


def _function(name: str, description: str | None, schema: dict[str, Any]) -> dict[str, Any]:
    function = {"name": name, "description": description, "parameters": schema}
    return {k: v for k, v in function.items() if v is not None}


def chat_body(body: CountTokensBody | MessagesBody) -> ChatBody:
    """The chat completions body the request stands for."""
    _check_refused(body)
    counting = isinstance(body, CountTokensBody)
    tools = [
        {"type": "function", "function": _function(t.name, t.description, t.input_schema)}
        for t in body.tools or ()
    ]
    fields: dict[str, Any] = {
        "model": body.model,
        "messages": chat_messages(body),
        "tools": tools or None,
        "tool_choice": _tool_choice(body, counting),
        "max_tokens": 1 if counting else body.max_tokens,  # type: ignore[union-attr]
    }
    fmt = body.output_config.format if body.output_config else None
    if fmt is not None:
        fields["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "output", "schema": fmt.schema_},
        }
    if isinstance(body, MessagesBody):
        fields |= {"stream": body.stream, "stop": body.stop_sequences, "metadata": body.metadata}
    fields |= {name: getattr(body, name) for name in CHAT_FIELDS if name in body.model_fields_set}
    try:
        return ChatBody.model_validate({k: v for k, v in fields.items() if v is not None})
    except pydantic.ValidationError as exc:
        error = validation_error([dict(e) for e in exc.errors()])
        error.param = _renamed(error.param)
        raise error from None


def messages_job(body: ChatBody, tokenizer: Tokenizer, max_model_len: int, limits: Limits) -> Job:
    """``jobs.chat_job``, its errors naming the Messages fields."""
    if body.max_tokens is not None and body.max_tokens < 1:
        raise bad_request("max_tokens: must be at least 1", "max_tokens")
    try:
        return chat_job(body, tokenizer, max_model_len, limits)
    except APIError as exc:
        exc.param = _renamed(exc.param)
        raise


def count_tokens(body: ChatBody, tokenizer: Tokenizer, max_model_len: int, limits: Limits) -> dict[str, int]:
    """count_tokens' answer: the prompt's tokens, as the chat template makes them."""
    return {"input_tokens": len(messages_job(body, tokenizer, max_model_len, limits).prompts[0].token_ids)}


def _hex_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def _sse(kind: str, data: dict[str, Any]) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, ensure_ascii=False, separators=(',', ':'))}\n\n"


class MessagesPresenter:
    """Writes a run as an Anthropic ``message``, whole or as its event stream."""

    def __init__(self) -> None:
        self.id = _hex_id("msg")
        self._num_blocks = 0  # content blocks opened so far (stream)
        self._text_open = False

    def _usage(self, run: JobRun, output: bool = True) -> dict[str, int]:
        usage = run.usage()
        return {
            "input_tokens": usage.prompt_tokens - usage.cached_tokens,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": usage.cached_tokens,
            "output_tokens": usage.completion_tokens if output else 0,
        }

    def _stop(self, run: JobRun, calls: list | None) -> tuple[str, str | None]:
        state = run.choices[0].state
        if calls:
            return "tool_use", None
        if state.finish_reason is FinishReason.LENGTH:
            return "max_tokens", None
        if state.stop_string is not None:
            return "stop_sequence", state.stop_string
        return "end_turn", None

    def _message(
        self, run: JobRun, content: list[dict], stop: tuple[str | None, str | None], usage: dict
    ) -> dict:
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": run.model,
            "content": content,
            "stop_reason": stop[0],
            "stop_sequence": stop[1],
            "usage": usage,
        }

    def whole(self, run: JobRun) -> dict:
        calls = run.tool_calls_of(run.choices[0])
        text = run.choices[0].state.text
        content = (
            [_tool_use(c) for c in calls] if calls else ([{"type": "text", "text": text}] if text else [])
        )
        return self._message(run, content, self._stop(run, calls), self._usage(run))

    def _text(self, text: str) -> list[str]:
        if not text:
            return []
        events = []
        if not self._text_open:
            self._text_open = True
            block = {"index": self._num_blocks, "content_block": {"type": "text", "text": ""}}
            events += [_sse("content_block_start", block), _sse("ping", {})]
        delta = {"index": self._num_blocks, "delta": {"type": "text_delta", "text": text}}
        return [*events, _sse("content_block_delta", delta)]

    def _close_text(self) -> list[str]:
        if not self._text_open:
            return []
        self._text_open = False
        self._num_blocks += 1
        return [_sse("content_block_stop", {"index": self._num_blocks - 1})]

    def _tool_blocks(self, calls: list) -> list[str]:
        events = []
        for call in calls:
            block = _tool_use(call)
            index = self._num_blocks
            self._num_blocks += 1
            events += [
                _sse("content_block_start", {"index": index, "content_block": {**block, "input": {}}}),
                _sse(
                    "content_block_delta",
                    {
                        "index": index,
                        "delta": {"type": "input_json_delta", "partial_json": call["function"]["arguments"]},
                    },
                ),
                _sse("content_block_stop", {"index": index}),
            ]
        return events

    def _closing(self, run: JobRun) -> list[str]:
        calls = run.tool_calls_of(run.choices[0])
        events = self._text(run.choices[0].state.text) if run.job.tool_plan is not None and not calls else []
        events += self._close_text() + self._tool_blocks(calls or [])
        stop_reason, stop_sequence = self._stop(run, calls)
        delta: dict[str, Any] = {"delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence}}
        delta["usage"] = self._usage(run)
        if (notice := run.route_notice()) is not None:
            delta["pdserve_route"] = notice
        return [*events, _sse("message_delta", delta), _sse("message_stop", {})]

    async def stream(self, run: JobRun, first, events) -> AsyncIterator[str]:
        try:
            opening = self._message(run, [], (None, None), self._usage(run, output=False))
            yield _sse("message_start", {"message": opening})
            _, event = first
            while True:
                if isinstance(event, APIError):
                    yield _sse("error", {"error": anthropic_body(event)["error"]})
                    return
                if run.job.tool_plan is None:
                    for line in self._text(event.text):
                        yield line
                try:
                    _, event = await anext(events)
                except StopAsyncIteration:
                    break
            for line in self._closing(run):
                yield line
        finally:
            run.cancel()


def _tool_use(call: dict[str, Any]) -> dict[str, Any]:
    function = call["function"]
    return {
        "type": "tool_use",
        "id": call["id"],
        "name": function["name"],
        "input": json.loads(function["arguments"]),
    }
