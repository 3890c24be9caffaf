"""Request bodies of the OpenAI endpoints, as pydantic models (they also make /openapi.json).

Fail closed: every field of OpenAI's and vLLM's request schemas is either honoured or refused.
Types are checked strictly (no "5" for 5, no 1 for true). A field neither schema has is a 400
naming it (pydantic's ``extra="forbid"``), never dropped: a misspelt constraint must not pass as
free text. Fields of those schemas that pdserve does not implement are declared here so that
their no-op value (what a client library may send by default) passes, and ``UNSUPPORTED`` says
why any other value is refused (``router.jobs``). A body that fails here becomes a 400 naming the
field (see ``validation_error``); range checks live in ``protocol.sampling_params.SamplingParams``
and ``router.jobs``.
"""

from __future__ import annotations

from typing import Any, Literal

import pydantic

from pdserve.router.errors import APIError, bad_request

_CONFIG = pydantic.ConfigDict(strict=True, extra="forbid")


class StreamOptions(pydantic.BaseModel):
    model_config = _CONFIG
    include_usage: bool = False  # one last chunk with usage and no choices
    continuous_usage_stats: bool = False  # vLLM: usage so far on every chunk (with include_usage)


class StructuredOutputs(pydantic.BaseModel):
    """vLLM's ``structured_outputs`` (its ``guided_*`` fields' successor): exactly one of these."""

    model_config = _CONFIG
    json_: dict[str, Any] | str | None = pydantic.Field(default=None, alias="json")  # a JSON Schema
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # EBNF (GBNF) or Lark
    json_object: bool | None = None  # any JSON object
    disable_fallback: bool = False  # one grammar engine here: nothing to fall back to either way


class JsonSchemaFormat(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(strict=True, extra="forbid", populate_by_name=True)
    name: str | None = None  # OpenAI requires it; unused
    description: str | None = None
    schema_: dict[str, Any] | None = pydantic.Field(default=None, alias="schema")  # the JSON Schema
    strict: bool | None = None  # accepted: the output always follows the schema


class ResponseFormat(pydantic.BaseModel):
    model_config = _CONFIG
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None  # for type json_schema


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
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias in [-100, 100]
    allowed_token_ids: list[int] | None = None  # vLLM extension: sample only among these
    bad_words: list[str] | None = None  # vLLM extension: words the output may not contain
    response_format: ResponseFormat | None = None  # text, json_object or json_schema
    guided_json: dict[str, Any] | str | None = None  # vLLM extension: a JSON Schema
    guided_regex: str | None = None  # vLLM extension: the output matches this regex
    guided_choice: list[str] | None = None  # vLLM extension: the output is one of these
    guided_grammar: str | None = None  # vLLM extension: an EBNF (GBNF) or Lark grammar
    structured_outputs: StructuredOutputs | None = None  # vLLM: the guided_* fields' successor
    prompt_logprobs: int | None = None  # vLLM: top-N of every prompt position
    return_token_ids: bool | None = None  # vLLM: the prompt's and the output's token ids
    truncate_prompt_tokens: int | None = None  # vLLM: keep this many prompt tokens (-1: the context)
    truncation_side: Literal["left", "right"] | None = None  # vLLM: which end to cut (left: the start)
    add_special_tokens: bool | None = None  # vLLM: BOS etc. when tokenizing (completions: yes)
    request_id: str | None = None  # vLLM: the response's id
    # Identifiers and hints that never change the output: accepted, unused.
    metadata: dict[str, Any] | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    session_id: str | None = None
    # vLLM and OpenAI fields not implemented: only their no-op value passes (UNSUPPORTED says why).
    use_beam_search: Any = None
    length_penalty: Any = None
    include_stop_str_in_output: Any = None
    skip_special_tokens: Any = None
    spaces_between_special_tokens: Any = None
    logprob_token_ids: Any = None
    priority: Any = None
    cache_salt: Any = None
    kv_transfer_params: Any = None
    ec_transfer_params: Any = None
    vllm_xargs: Any = None
    repetition_detection: Any = None
    thinking_token_budget: Any = None
    watermarking: Any = None
    routed_experts_prompt_start: Any = None
    return_token_offsets: Any = None
    return_mm_kwargs: Any = None
    stream_interval: Any = None
    logits_processors: Any = None
    guided_decoding_backend: Any = None
    guided_whitespace_pattern: Any = None
    store: Any = None
    service_tier: Any = None


class CompletionBody(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # 0: no output (with echo: the prompt and its logprobs)
    logprobs: int | None = None  # top alternatives per token
    echo: bool = False  # the prompt text before the completion (with logprobs: the prompt's too)
    suffix: str | None = None  # not supported (rejected when set)
    best_of: int | None = None  # only best_of == n is supported
    prompt_embeds: Any = None


# Field -> (the values that ask for nothing, why any other is refused). Absent or null always passes.
UNSUPPORTED: dict[str, tuple[tuple[Any, ...], str]] = {
    "use_beam_search": ((False,), "beam search is not implemented; sample n completions instead"),
    "length_penalty": ((1.0,), "length_penalty applies to beam search, which is not implemented"),
    "include_stop_str_in_output": ((False,), "the output always ends before the stop string"),
    "skip_special_tokens": ((True,), "special tokens are always left out of the text"),
    "spaces_between_special_tokens": ((True,), "detokenization options are not implemented"),
    "logprob_token_ids": ((), "logprobs of chosen token ids are not implemented; use logprobs"),
    "priority": ((0,), "request priorities are not implemented: requests run first come, first served"),
    "cache_salt": ((), "prefix-cache salting is not implemented"),
    "kv_transfer_params": ((), "KV transfer is the router's to arrange, not a request's"),
    "ec_transfer_params": ((), "encoder-cache transfer is not implemented"),
    "vllm_xargs": ((), "vLLM's extra arguments are not implemented"),
    "repetition_detection": ((), "repetition detection is not implemented"),
    "thinking_token_budget": ((), "thinking budgets are not implemented"),
    "watermarking": ((False,), "watermarking is not implemented"),
    "routed_experts_prompt_start": ((0,), "expert routing replay is not implemented"),
    "return_token_offsets": ((False,), "token offsets are not implemented (logprobs carry text_offset)"),
    "return_mm_kwargs": ((True, False), ""),  # render endpoints only: no effect on generation
    "stream_interval": ((1,), "tokens stream as they come; stream_interval is not implemented"),
    "logits_processors": ((), "custom logits processors are not implemented"),
    "guided_decoding_backend": ((), "one grammar engine (llguidance) serves every constraint"),
    "guided_whitespace_pattern": ((), "JSON whitespace patterns are not implemented"),
    "store": ((False,), "requests are not stored"),
    "service_tier": (("auto", "default"), "service tiers are not implemented"),
    "prompt_embeds": ((), "prompt embeddings are not implemented; send text or token ids"),
    "chat_template": ((), "request chat templates are refused: the model's own template applies"),
    "documents": ((), "documents for the chat template are not implemented"),
    "mm_processor_kwargs": ((), "multimodal inputs are not implemented"),
    "media_io_kwargs": ((), "multimodal inputs are not implemented"),
    "include_reasoning": ((True,), "reasoning parsers are not implemented: the reply is returned whole"),
    "return_prompt_text": ((False,), "return_prompt_text is not implemented; use echo"),
    "reasoning_effort": ((), "reasoning effort is not implemented"),
    "audio": ((), "audio output is not implemented"),
    "modalities": ((["text"],), "only text output is implemented"),
    "prediction": ((), "predicted outputs are not implemented"),
    "verbosity": ((), "verbosity is not implemented"),
    "web_search_options": ((), "web search is not implemented"),
    "functions": ((), "functions is deprecated and not implemented; use tools"),
    "function_call": ((), "function_call is deprecated and not implemented; use tool_choice"),
    "moderation": ((), "moderation is not implemented"),
    "prompt_cache_options": ((), "prompt cache options are not implemented"),
    "structural_tag": ((), "structural tags are not implemented; use structured_outputs"),
}


class TextPart(pydantic.BaseModel):
    model_config = _CONFIG
    type: Literal["text"]
    text: str


class ChatMessage(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(strict=True, extra="allow")  # tool_calls etc. reach the template
    role: str  # the chat template decides which roles it takes
    content: str | list[TextPart] | None = None
    name: str | None = None

    def for_template(self) -> dict[str, Any]:
        message = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            message["content"] = "".join(part.text for part in self.content)
        message.setdefault("content", "")
        return message


class FunctionDef(pydantic.BaseModel):
    model_config = _CONFIG
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # the arguments' JSON Schema; None: any object
    strict: bool | None = None  # accepted: calls always follow the schema


class Tool(pydantic.BaseModel):
    model_config = _CONFIG
    type: Literal["function"]
    function: FunctionDef


class FunctionName(pydantic.BaseModel):
    model_config = _CONFIG
    name: str


class NamedToolChoice(pydantic.BaseModel):
    model_config = _CONFIG
    type: Literal["function"]
    function: FunctionName


class ChatBody(_SamplingFields):
    messages: list[ChatMessage] = pydantic.Field(min_length=1)
    max_tokens: int | None = None  # deprecated OpenAI name of max_completion_tokens
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None  # router.structured
    parallel_tool_calls: bool | None = None  # accepted: "required" may return several calls
    echo: bool = False  # vLLM: the last message's content before the reply, when it is the assistant's
    add_generation_prompt: bool = True  # vLLM: passed to the chat template
    continue_final_message: bool = False  # vLLM: the reply continues the last (assistant) message
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM: extra variables for the template
    chat_template: Any = None
    documents: Any = None
    mm_processor_kwargs: Any = None
    media_io_kwargs: Any = None
    include_reasoning: Any = None
    return_prompt_text: Any = None
    reasoning_effort: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    verbosity: Any = None
    web_search_options: Any = None
    functions: Any = None
    function_call: Any = None
    moderation: Any = None
    prompt_cache_options: Any = None
    structural_tag: Any = None


def validation_error(errors: list[dict[str, Any]]) -> APIError:
    """The first pydantic error as a 400 naming the field (``messages.0.role``); unknown fields
    first, all of them named."""
    if not errors:
        return bad_request("invalid request body", None)
    unknown = [
        ".".join(str(p) for p in e.get("loc", ()) if p != "body")
        for e in errors
        if e.get("type") == "extra_forbidden"
    ]
    if unknown:
        names = ", ".join(unknown)
        return bad_request(
            f"unknown field{'s' if len(unknown) > 1 else ''} {names}: neither OpenAI's nor vLLM's request "
            "schema has it, and pdserve refuses fields it does not know rather than ignore them",
            unknown[0],
        )
    first = errors[0]
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    # Union members add their type name to loc ("prompt.str"); keep field names and indices. The
    # first part is always one of the body's own fields (the admin bodies' too).
    fields = loc[:1] + [part for part in loc[1:] if part.isdigit() or part in _FIELD_NAMES]
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
    | set(StructuredOutputs.model_fields)
    | {"json"}
    | set(ResponseFormat.model_fields)
    | {"schema"}
    | set(JsonSchemaFormat.model_fields)
    | set(Tool.model_fields)
    | set(FunctionDef.model_fields)
)


class TokenizeBody(pydantic.BaseModel):
    """vLLM's POST /tokenize: a prompt, or chat messages through the chat template."""

    model_config = _CONFIG
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # prompt: True; messages: False (the template has them)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Tool] | None = None
    return_token_strs: bool = False  # each token's text beside its id


class DetokenizeBody(pydantic.BaseModel):
    model_config = _CONFIG
    model: str | None = None
    tokens: list[int]
