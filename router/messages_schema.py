"""The request bodies of Anthropic's Messages API (``POST /v1/messages`` and
``/v1/messages/count_tokens``), as vLLM serves them.

Fail closed, as router/openai_schema.py: every field of Anthropic's request (as its Python SDK
sends it) and of vLLM's is honoured or refused with a 400 naming it; an unknown field is a 400.
Sampling fields ride as extra body fields (the anthropic 2.x SDK has no ``temperature``
argument); they are declared loosely here and checked by chat completions' ``ChatBody``, into
which router/messages_api.py turns the request.
"""

from __future__ import annotations

from typing import Any, Literal

import pydantic

from pdserve.router.openai_schema import LaxBool, LaxInt

_CONFIG = pydantic.ConfigDict(strict=True, extra="forbid")


class AnthropicMessage(pydantic.BaseModel):
    model_config = _CONFIG
    # "system": vLLM's allowance for clients (Claude Code) that put system text among the messages
    role: Literal["user", "assistant", "system"]
    content: str | list[dict[str, Any]]  # text, tool_use and tool_result blocks (messages_api checks them)


class AnthropicTool(pydantic.BaseModel):
    model_config = _CONFIG
    type: Literal["custom"] | None = None  # a client tool; server tools (web search...) are refused
    name: str
    description: str | None = None
    input_schema: dict[str, Any]
    strict: LaxBool | None = None  # accepted: calls always follow the schema
    cache_control: Any = None  # a caching hint: prefixes are cached whatever it says


class AnthropicToolChoice(pydantic.BaseModel):
    model_config = _CONFIG
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None  # type "tool": the tool to call
    disable_parallel_tool_use: LaxBool | None = None  # accepted: "any" may return several calls


class JsonOutputFormat(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(strict=True, extra="forbid", populate_by_name=True)
    type: Literal["json_schema"]
    schema_: dict[str, Any] = pydantic.Field(alias="schema")


class OutputConfig(pydantic.BaseModel):
    model_config = _CONFIG
    format: JsonOutputFormat | None = None  # the reply is JSON valid for the schema
    effort: Any = None  # refused unless null: no reasoning effort


class _MessagesFields(pydantic.BaseModel):
    """What a Messages request and a count_tokens request share."""

    model_config = _CONFIG
    model: str
    messages: list[AnthropicMessage] = pydantic.Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None
    output_config: OutputConfig | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM: extra variables for the template
    cache_control: Any = None  # accepted: automatic prompt caching, which pdserve always does
    # refused unless null (REFUSED says why)
    thinking: Any = None
    context_management: Any = None
    mcp_servers: Any = None
    container: Any = None
    diagnostics: Any = None
    inference_geo: Any = None
    speed: Any = None
    user_profile_id: Any = None
    workspace_id: Any = None
    output_format: Any = None


class MessagesBody(_MessagesFields):
    max_tokens: LaxInt
    stop_sequences: list[str] | None = None
    stream: LaxBool = False
    metadata: dict[str, Any] | None = None  # {"user_id": ...}: accepted, unused
    service_tier: Literal["auto", "standard_only"] | None = None  # accepted: one tier here
    # Sampling as extra body fields; ChatBody checks them. Absent: temperature 1.0, top_p 1.0,
    # top_k off, as chat completions (docs/api.md).
    temperature: Any = None
    top_p: Any = None
    top_k: Any = None
    min_p: Any = None
    seed: Any = None
    repetition_penalty: Any = None
    kv_transfer_params: Any = None  # vLLM's; refused as chat completions refuses it


class CountTokensBody(_MessagesFields):
    pass


# Passed to chat completions' body as they are.
CHAT_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "repetition_penalty",
    "kv_transfer_params",
    "chat_template_kwargs",
)

REFUSED: dict[str, tuple[tuple[Any, ...], str]] = {
    "thinking": (({"type": "disabled"},), "extended thinking is not implemented"),
    "context_management": ((), "context management is not implemented"),
    "mcp_servers": ((), "MCP servers are not implemented"),
    "container": ((), "containers (code execution) are not implemented"),
    "diagnostics": ((), "diagnostics are not implemented"),
    "inference_geo": ((), "inference geography is not implemented: one cluster serves"),
    "speed": ((), "speed modes are not implemented"),
    "user_profile_id": ((), "user profiles are not implemented"),
    "workspace_id": ((), "workspaces are not implemented"),
    "output_format": ((), "use output_config.format"),
}
