"""Request bodies of the OpenAI endpoints, as pydantic models (they also make /openapi.json).

Types are checked strictly (no "5" for 5, no 1 for true) and unknown fields are ignored, as
vLLM does. A body that fails here becomes a 400 naming the field (see ``validation_error``);
range checks live in ``protocol.sampling_params.SamplingParams`` and ``router.jobs``.
"""

from __future__ import annotations

from typing import Any, Literal

import pydantic

from router.errors import APIError, bad_request

_CONFIG = pydantic.ConfigDict(strict=True, extra="ignore")


class StreamOptions(pydantic.BaseModel):
    model_config = _CONFIG
    include_usage: bool = False  # one last chunk with usage and no choices


class _SamplingFields(pydantic.BaseModel):
    """Fields both endpoints share."""

    model_config = _CONFIG
    model: str | None = None  # served model name (or its folder); None: the one served model
    n: int = 1  # samples per prompt
    temperature: float | None = None  # None: 1.0
    top_p: float | None = None
    top_k: int | None = None  # vLLM extension
    min_p: float | None = None  # vLLM extension
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # vLLM extension
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None  # vLLM extension
    min_tokens: int = 0  # vLLM extension
    ignore_eos: bool = False  # vLLM extension
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted, unused
    return_tokens_as_token_ids: bool = False  # vLLM extension: logprob tokens as "token_id:N"
    logit_bias: dict[str, float] | None = None  # accepted only when empty


class CompletionBody(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None  # top alternatives per token
    echo: bool = False  # the prompt text before the completion
    suffix: str | None = None  # not supported (rejected when set)
    best_of: int | None = None  # only best_of == n is supported


class TextPart(pydantic.BaseModel):
    model_config = _CONFIG
    type: Literal["text"]
    text: str


class ChatMessage(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(strict=True, extra="allow")  # tool_calls etc. reach the template
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def for_template(self) -> dict[str, Any]:
        message = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            message["content"] = "".join(part.text for part in self.content)
        message.setdefault("content", "")
        return message


class ChatBody(_SamplingFields):
    messages: list[ChatMessage] = pydantic.Field(min_length=1)
    max_tokens: int | None = None  # deprecated OpenAI name of max_completion_tokens
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None


def validation_error(errors: list[dict[str, Any]]) -> APIError:
    """The first pydantic error as a 400 naming the field (``messages.0.role``)."""
    if not errors:
        return bad_request("invalid request body", None)
    first = errors[0]
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    # Union members add their type name to loc ("prompt.str"); keep field names and indices.
    fields = [part for part in loc if part.isdigit() or part in _FIELD_NAMES]
    param = ".".join(fields) or None
    if first.get("type") == "json_invalid":
        return bad_request(f"request body is not valid JSON: {first.get('msg')}", None)
    if first.get("type") == "missing":
        return bad_request(f"{param} is required", param)
    return bad_request(f"{param}: {first.get('msg')}", param)


_FIELD_NAMES = frozenset(
    set(CompletionBody.model_fields)
    | set(ChatBody.model_fields)
    | set(ChatMessage.model_fields)
    | set(TextPart.model_fields)
    | set(StreamOptions.model_fields)
)
