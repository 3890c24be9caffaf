"""The request body of OpenAI's Responses API (``POST /v1/responses``), as vLLM serves it.

Fail closed, as router/openai_schema.py: every field of OpenAI's and vLLM's Responses request is
declared, and each is honoured on every path or refused with a 400 naming it; an unknown field is
a 400 too. The sampling fields that chat completions share (``temperature``, ``top_p``, ``stop``,
vLLM's ``top_k``, ``seed``...) are declared loosely here and checked by ``ChatBody`` itself, into
which router/responses_api.py turns the request: one set of rules, one engine request.
"""

from __future__ import annotations

from typing import Any, Literal

import pydantic

from pdserve.router.openai_schema import LaxBool, LaxInt

_CONFIG = pydantic.ConfigDict(strict=True, extra="forbid")


class FunctionTool(pydantic.BaseModel):
    """A Responses function tool: flat, where chat nests it under ``function``."""

    model_config = _CONFIG
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # the arguments' JSON Schema; None: any object
    strict: LaxBool | None = None  # accepted: calls always follow the schema


class NamedFunction(pydantic.BaseModel):
    model_config = _CONFIG
    type: Literal["function"]
    name: str


class TextFormat(pydantic.BaseModel):
    """``text.format``: plain text, any JSON object, or JSON valid for a schema."""

    model_config = pydantic.ConfigDict(strict=True, extra="forbid", populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None  # json_schema: OpenAI requires it; unused
    description: str | None = None
    schema_: dict[str, Any] | None = pydantic.Field(default=None, alias="schema")
    strict: LaxBool | None = None  # accepted: the output always follows the schema


class TextConfig(pydantic.BaseModel):
    model_config = _CONFIG
    format: TextFormat | None = None
    verbosity: Any = None  # refused unless null: no verbosity control


class ResponsesStreamOptions(pydantic.BaseModel):
    model_config = _CONFIG
    include_obfuscation: LaxBool = False  # refused when true: events carry no obfuscation padding


class ResponsesBody(pydantic.BaseModel):
    model_config = _CONFIG
    model: str | None = None
    input: str | list[dict[str, Any]]  # a user message, or message / function_call(_output) items
    instructions: str | None = None  # a system message before everything else (not carried over)
    max_output_tokens: LaxInt | None = None  # None: what the context leaves
    tools: list[dict[str, Any]] | None = None  # function tools only (checked in responses_api)
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: LaxBool | None = None  # accepted: "required" may return several calls
    text: TextConfig | None = None
    store: LaxBool = True  # kept in the router's response store (GET, previous_response_id)
    previous_response_id: str | None = None
    stream: LaxBool = False
    stream_options: ResponsesStreamOptions | None = None
    include: list[str] | None = None  # only "message.output_text.logprobs"
    top_logprobs: LaxInt | None = None  # with include's logprobs: alternatives per output token
    request_id: str | None = None  # vLLM: the response's id
    # Passed to chat completions' body as they are: ChatBody checks them (router/openai_schema.py).
    temperature: Any = None
    top_p: Any = None
    top_k: Any = None
    min_p: Any = None
    seed: Any = None
    stop: Any = None
    repetition_penalty: Any = None
    ignore_eos: Any = None
    logit_bias: Any = None
    cache_salt: Any = None
    structured_outputs: Any = None
    user: Any = None
    metadata: Any = None
    safety_identifier: Any = None
    prompt_cache_key: Any = None
    prompt_cache_retention: Any = None
    service_tier: Any = None
    skip_special_tokens: Any = None
    include_stop_str_in_output: Any = None
    priority: Any = None
    vllm_xargs: Any = None
    mm_processor_kwargs: Any = None
    # Refused unless absent, null or the value that asks for nothing (REFUSED says why).
    background: Any = None
    conversation: Any = None
    context_management: Any = None
    prompt: Any = None
    prompt_cache_options: Any = None
    moderation: Any = None
    image: Any = None
    access_programs: Any = None
    background_options: Any = None
    max_tool_calls: Any = None
    reasoning: Any = None
    truncation: Any = None
    enable_response_messages: Any = None
    previous_input_messages: Any = None
    previous_response: Any = None


# Chat completions' body takes these as they are (names and values alike).
CHAT_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "repetition_penalty",
    "ignore_eos",
    "logit_bias",
    "cache_salt",
    "structured_outputs",
    "user",
    "metadata",
    "safety_identifier",
    "prompt_cache_key",
    "prompt_cache_retention",
    "service_tier",
    "skip_special_tokens",
    "include_stop_str_in_output",
    "priority",
    "vllm_xargs",
    "mm_processor_kwargs",
    "parallel_tool_calls",
)

# Field -> (values that ask for nothing, why any other is refused); absent or null always passes.
REFUSED: dict[str, tuple[tuple[Any, ...], str]] = {
    "background": ((False,), "background responses are not supported: the answer comes on this request"),
    "conversation": ((), "conversations are not stored; use previous_response_id"),
    "context_management": ((), "context management is not implemented"),
    "prompt": ((), "prompt templates are not supported"),
    "prompt_cache_options": ((), "prompt cache options are not implemented"),
    "moderation": ((), "moderation is not implemented"),
    "image": ((), "image generation is not implemented"),
    "access_programs": ((), "access programs are not implemented"),
    "background_options": ((), "background responses are not supported"),
    "max_tool_calls": ((), "a limit on tool calls is not implemented"),
    "reasoning": ((), "reasoning is not implemented: the model has no reasoning mode here"),
    "truncation": (("disabled",), "automatic truncation is not implemented: a prompt too long is a 400"),
    "enable_response_messages": ((False,), "raw response messages are not implemented"),
    "previous_input_messages": ((), "harmony messages are not supported; use previous_response_id"),
    "previous_response": ((), "stateless multi-turn is not supported; use previous_response_id"),
}
LOGPROBS_INCLUDE = "message.output_text.logprobs"
