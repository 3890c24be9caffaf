"""Structured outputs: request fields → a ``GuidedDecoding`` spec (response_format, vLLM's guided_*,
tools) and the logits rules (logit_bias, allowed_token_ids, bad_words); and a constrained chat
reply back into OpenAI ``tool_calls``.

Every spec is compiled here, with the nodes' own compiler (grammar, torch-free), before a
node sees it: a schema, regex or grammar that does not compile, or compiles to one that matches
nothing, is a 400 naming the field that carried it.

Tools: ``tool_choice`` "required" constrains the reply to a JSON array of calls
``[{"name": ..., "parameters": {...}}]`` of the listed functions, a named function to that
function's arguments. "auto" needs a parser for the model's own tool-call syntax, which pdserve
does not have: it is refused. "none" (or no tools) generates text as usual.
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from typing import Any

from pdserve.grammar import GrammarError
from pdserve.protocol.sampling_params import MAX_LOGIT_BIAS, GuidedDecoding, LogitBias
from pdserve.router.errors import bad_request
from pdserve.router.openai_schema import ChatBody, NamedToolChoice, _SamplingFields
from pdserve.router.tokenizer import Tokenizer

# vLLM's refusal of "auto" on a server without a tool-call parser, word for word: agent clients
# match on it to fall back to tools described in text (OpenAIServingChat.create_chat_completion,
# vllm/entrypoints/openai/serving_chat.py, later chat_completion/serving.py).
VLLM_AUTO_TOOL_CHOICE = (
    '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
)


def auto_tool_choice_message(auto: str, constrained: str, none: str) -> str:
    """Why ``auto`` (each API's spelling) is refused, and what to send instead."""
    return (
        f"tool_choice {auto}, the default when tools are given, needs a parser for the model's own "
        "tool-call syntax to tell a call from text, and pdserve has none; vLLM without one refuses it "
        f"too: {VLLM_AUTO_TOOL_CHOICE}. Send tool_choice {constrained}, which constrain the reply "
        f"to valid calls, or {none} for text."
    )


AUTO_TOOL_CHOICE_MESSAGE = auto_tool_choice_message(
    '"auto"', '"required" or {"type": "function", "function": {"name": ...}}', '"none"'
)


@dataclasses.dataclass(frozen=True, slots=True)
class ToolCallPlan:
    """How to read a tools-constrained reply back into ``tool_calls``."""

    function: str | None  # a named tool_choice: the reply is this function's arguments
    # else (tool_choice "required") the reply is a JSON array of {"name", "parameters"}


@dataclasses.dataclass(frozen=True, slots=True)
class Structured:
    guided: GuidedDecoding | None
    tool_plan: ToolCallPlan | None
    logit_bias: tuple[LogitBias, ...]


def structured(body: _SamplingFields, tokenizer: Tokenizer) -> Structured:
    """The body's constraints, checked: a 400 naming the field for anything that cannot run."""
    given = _guided_fields(body)
    if len(given) > 1:
        raise bad_request(
            f"{' and '.join(f for f, _ in given)} cannot be combined: give one constraint", given[1][0]
        )
    field, guided = given[0] if given else (None, None)
    plan = None
    if isinstance(body, ChatBody) and body.tools and body.tool_choice != "none":
        if guided is not None:
            raise bad_request(f"{field} cannot be combined with tools (they constrain the reply)", field)
        field, (guided, plan) = "tools", _tools_spec(body)
    elif isinstance(body, ChatBody) and body.tool_choice not in (None, "none") and not body.tools:
        raise bad_request("tool_choice needs tools", "tool_choice")
    if guided is not None:
        if body.ignore_eos:
            raise bad_request(f"ignore_eos cannot be combined with {field}", "ignore_eos")
        if body.min_tokens:
            raise bad_request(f"min_tokens cannot be combined with {field}", "min_tokens")
        try:
            tokenizer.grammar_compiler.check(guided)
        except (GrammarError, FileNotFoundError) as exc:
            raise bad_request(f"{field}: {exc}", field) from None
    return Structured(guided, plan, _logit_bias(body, tokenizer.vocab_size))


def _guided_fields(body: _SamplingFields) -> list[tuple[str, GuidedDecoding]]:
    given = []
    rf = body.response_format
    if rf is not None and rf.type == "json_object":
        given.append(("response_format", GuidedDecoding.json_object()))
    elif rf is not None and rf.type == "json_schema":
        if rf.json_schema is None or rf.json_schema.schema_ is None:
            raise bad_request("response_format.json_schema.schema is required", "response_format")
        given.append(("response_format", GuidedDecoding.json_schema(rf.json_schema.schema_)))
    if body.guided_json is not None:
        given.append(("guided_json", _checked("guided_json", GuidedDecoding.json_schema, body.guided_json)))
    if body.guided_regex is not None:
        given.append(("guided_regex", _checked("guided_regex", GuidedDecoding.regex, body.guided_regex)))
    if body.guided_choice is not None:
        given.append(("guided_choice", _checked("guided_choice", GuidedDecoding.choice, body.guided_choice)))
    if body.guided_grammar is not None:
        given.append(
            ("guided_grammar", _checked("guided_grammar", GuidedDecoding.grammar, body.guided_grammar))
        )
    if body.structured_outputs is not None:
        given.append(_structured_outputs(body.structured_outputs))
    return given


def _structured_outputs(so) -> tuple[str, GuidedDecoding]:
    """vLLM's structured_outputs: exactly one of json, regex, choice, grammar, json_object."""
    kinds = [
        (f"structured_outputs.{name}", make, value)
        for name, make, value in (
            ("json", GuidedDecoding.json_schema, so.json_),
            ("regex", GuidedDecoding.regex, so.regex),
            ("choice", GuidedDecoding.choice, so.choice),
            ("grammar", GuidedDecoding.grammar, so.grammar),
            ("json_object", lambda _: GuidedDecoding.json_object(), so.json_object or None),
        )
        if value is not None
    ]
    if len(kinds) != 1:
        named = " and ".join(k for k, _, _ in kinds) or "none"
        raise bad_request(
            f"structured_outputs takes exactly one of json, regex, choice, grammar, json_object; got {named}",
            kinds[1][0] if len(kinds) > 1 else "structured_outputs",
        )
    field, make, value = kinds[0]
    return field, _checked(field, make, value)


def _checked(field: str, make, value) -> GuidedDecoding:
    try:
        return make(value)
    except ValueError as exc:
        raise bad_request(f"{field}: {str(exc).removeprefix('guided_decoding: ')}", field) from None


def _tools_spec(body: ChatBody) -> tuple[GuidedDecoding, ToolCallPlan]:
    assert body.tools is not None  # only a request with tools gets here
    choice = body.tool_choice
    if choice is None or choice == "auto":
        raise bad_request(AUTO_TOOL_CHOICE_MESSAGE, "tool_choice")
    functions = {tool.function.name: tool.function.parameters or {"type": "object"} for tool in body.tools}
    if len(functions) != len(body.tools):
        raise bad_request("tools: function names must be unique", "tools")
    if isinstance(choice, NamedToolChoice):
        name = choice.function.name
        if name not in functions:
            raise bad_request(f"tool_choice names {name!r}, which is not among the tools", "tool_choice")
        return GuidedDecoding.json_schema(functions[name]), ToolCallPlan(name)
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": name}, "parameters": schema},
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for name, schema in functions.items()
    ]
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    return GuidedDecoding.json_schema(schema), ToolCallPlan(None)


def _logit_bias(body: _SamplingFields, vocab_size: int) -> tuple[LogitBias, ...]:
    """Every bad key and every bad value is named in the one 400; keys that are all integers, some
    outside the vocabulary, in vLLM's words."""
    items = (body.logit_bias or {}).items()
    if all(k.isascii() and k.removeprefix("-").isdigit() for k, _ in items):
        check_in_vocab([int(k) for k, _ in items], "logit_bias", vocab_size)
    bad_keys = [k for k, _ in items if not (k.isascii() and k.isdigit()) or int(k) >= vocab_size]
    if bad_keys:
        raise bad_request(
            f"logit_bias keys must be token ids in [0, {vocab_size}), got {', '.join(map(repr, bad_keys))}",
            "logit_bias",
        )
    bad_values = [f"{b} (for {k!r})" for k, b in items if not -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS]
    if bad_values:
        raise bad_request(
            f"logit_bias values must be in [-100, 100], got {', '.join(bad_values)}", "logit_bias"
        )
    return tuple(
        sorted((LogitBias(token_id=int(k), bias=float(b)) for k, b in items), key=lambda b: b.token_id)
    )


def check_token_rules(body: _SamplingFields, vocab_size: int) -> None:
    """Token ids outside the vocabulary, refused in vLLM's words, which clients match on
    (vllm/sampling_params.py, SamplingParams._validate_*)."""
    ids = body.allowed_token_ids
    if ids is not None and not ids:
        raise bad_request("allowed_token_ids is not None and empty!", "allowed_token_ids")
    if ids is not None and any(not 0 <= t < vocab_size for t in ids):
        raise bad_request("allowed_token_ids contains out-of-vocab token id!", "allowed_token_ids")
    check_in_vocab(body.stop_token_ids, "stop_token_ids", vocab_size)
    if body.bad_words is not None and not all(w.strip() for w in body.bad_words):
        raise bad_request("bad_words must be non-empty strings", "bad_words")


def check_in_vocab(ids: list[int] | None, field: str, vocab_size: int) -> None:
    """A 400 naming ``field`` and every id of it outside [0, vocab_size), in vLLM's words."""
    bad = [t for t in ids or () if not 0 <= t < vocab_size]
    if bad:
        raise bad_request(
            f"token_id(s) {bad} in {field} contain out-of-vocab token ids. Vocabulary size: {vocab_size}",
            field,
        )


def tool_calls(plan: ToolCallPlan, text: str) -> list[dict[str, Any]] | None:
    """The reply as OpenAI tool calls; None when it is not complete JSON (finish_reason length)."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if plan.function is not None:  # the reply is the arguments, as the model wrote them
        calls = [(plan.function, text)]
    else:
        calls = [(call["name"], json.dumps(call["parameters"], ensure_ascii=False)) for call in value]
    return [
        {
            "id": f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {"name": name, "arguments": args},
        }
        for name, args in calls
    ]
