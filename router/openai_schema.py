"""Request bodies of the OpenAI endpoints, as pydantic models (they also make /openapi.json).

Fail closed: every field of OpenAI's and vLLM's request schemas is either honoured or refused.
Scalars coerce as vLLM's (pydantic's lax mode) do: ``"true"``, ``"1"`` or ``1`` for true, ``"5"``
or ``5.0`` for 5, ``"0.7"`` for 0.7; a boolean is never read as a number, and everything else
(strings, lists, token ids) is checked strictly (docs/api.md's "Lax values" says why, per field).
A field neither schema has is a 400 naming it (pydantic's ``extra="forbid"``), never dropped: a
misspelt constraint must not pass as free text. Fields of those schemas that pdserve does not implement are declared here so that
their no-op value (what a client library may send by default) passes, and ``UNSUPPORTED`` says
why any other value is refused (``router.jobs``). A body that fails here becomes a 400 naming the
field (see ``validation_error``); range checks live in ``protocol.sampling_params.SamplingParams``
and ``router.jobs``.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

import pydantic
import pydantic_core

from pdserve.router.errors import APIError, bad_request

_CONFIG = pydantic.ConfigDict(strict=True, extra="forbid")


def _number_input(value: Any) -> Any:
    """Numbers coerce as vLLM's do, but never from a boolean: ``true`` where a count goes is a
    field mix-up (chat's ``logprobs: true`` sent to completions), not a 1. A numeric string must
    name a finite number ("nan" would slip past every range check)."""
    if isinstance(value, bool):
        raise pydantic_core.PydanticCustomError("number_type", "Input should be a number, not a boolean")
    if isinstance(value, str):
        try:
            finite = math.isfinite(float(value))
        except ValueError:
            return value  # pydantic names the parse error
        if not finite:
            raise pydantic_core.PydanticCustomError("finite_number", "Input should be a finite number")
    return value


LaxBool = Annotated[bool, pydantic.Strict(False)]  # "true"/"false", "1"/"0", 1/0, "yes"/"no"...
LaxInt = Annotated[int, pydantic.Strict(False), pydantic.BeforeValidator(_number_input)]  # "5", 5.0
LaxFloat = Annotated[float, pydantic.Strict(False), pydantic.BeforeValidator(_number_input)]  # "0.7", 1
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
# vLLM bounds the seed by torch.long's range in its schema; clients match on pydantic's message.
Seed = Annotated[
    int,
    pydantic.Strict(False),
    pydantic.Field(ge=INT64_MIN, le=INT64_MAX),
    pydantic.BeforeValidator(_number_input),
]


_LAX_BOOL = pydantic.TypeAdapter(LaxBool)
_LAX_FLOAT = pydantic.TypeAdapter(LaxFloat)


def reads_as(value: Any, allowed: Any) -> bool:
    """``value`` reads as ``allowed`` under the rules above (``"false"`` as false, 1 as 1.0; a
    boolean never as a number): how a refused field's no-op value is recognised (router.jobs)."""
    if isinstance(allowed, bool):
        adapter: pydantic.TypeAdapter = _LAX_BOOL
    elif isinstance(allowed, (int, float)):
        adapter = _LAX_FLOAT
    else:
        return type(value) is type(allowed) and value == allowed
    try:
        return adapter.validate_python(value) == allowed
    except pydantic.ValidationError:
        return False


class StreamOptions(pydantic.BaseModel):
    model_config = _CONFIG
    include_usage: LaxBool = False  # one last chunk with usage and no choices
    # vLLM: usage so far on every chunk; as in vLLM, only together with include_usage (alone: no usage)
    continuous_usage_stats: LaxBool = False
    # In neither vLLM's StreamOptions (include_usage, continuous_usage_stats) nor OpenAI's (plus
    # include_obfuscation); vLLM lets unknown fields through and ignores them. Declared to be
    # refused by name (router.jobs): deltas go out as they come, never held to a minimum size.
    min_characters: Any = None


class StructuredOutputs(pydantic.BaseModel):
    """vLLM's ``structured_outputs`` (its ``guided_*`` fields' successor): exactly one of these."""

    model_config = _CONFIG
    json_: dict[str, Any] | str | None = pydantic.Field(default=None, alias="json")  # a JSON Schema
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # EBNF (GBNF) or Lark
    json_object: LaxBool | None = None  # any JSON object
    disable_fallback: LaxBool = False  # one grammar engine here: nothing to fall back to either way


class JsonSchemaFormat(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(strict=True, extra="forbid", populate_by_name=True)
    name: str | None = None  # OpenAI requires it; unused
    description: str | None = None
    schema_: dict[str, Any] | None = pydantic.Field(default=None, alias="schema")  # the JSON Schema
    strict: LaxBool | None = None  # accepted: the output always follows the schema


class ResponseFormat(pydantic.BaseModel):
    model_config = _CONFIG
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None  # for type json_schema


class _SamplingFields(pydantic.BaseModel):
    """Fields both endpoints share."""

    model_config = _CONFIG
    model: str | None = None  # served model name (or its folder); None: the one served model
    n: LaxInt = 1  # samples per prompt
    temperature: LaxFloat | None = None  # None: 1.0
    top_p: LaxFloat | None = None
    top_k: LaxInt | None = None  # vLLM extension
    min_p: LaxFloat | None = None  # vLLM extension
    seed: Seed | None = None  # a signed 64-bit value
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # vLLM extension
    presence_penalty: LaxFloat | None = None
    frequency_penalty: LaxFloat | None = None
    repetition_penalty: LaxFloat | None = None  # vLLM extension
    min_tokens: LaxInt = 0  # vLLM extension
    ignore_eos: LaxBool = False  # vLLM extension
    stream: LaxBool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted, unused
    return_tokens_as_token_ids: LaxBool = False  # vLLM extension: logprob tokens as "token_id:N"
    logit_bias: dict[str, LaxFloat] | None = None  # token id (as a string) -> bias in [-100, 100]
    allowed_token_ids: list[int] | None = None  # vLLM extension: sample only among these
    bad_words: list[str] | None = None  # vLLM extension: words the output may not contain
    response_format: ResponseFormat | None = None  # text, json_object or json_schema
    guided_json: dict[str, Any] | str | None = None  # vLLM extension: a JSON Schema
    guided_regex: str | None = None  # vLLM extension: the output matches this regex
    guided_choice: list[str] | None = None  # vLLM extension: the output is one of these
    guided_grammar: str | None = None  # vLLM extension: an EBNF (GBNF) or Lark grammar
    structured_outputs: StructuredOutputs | None = None  # vLLM: the guided_* fields' successor
    prompt_logprobs: LaxInt | None = None  # vLLM: top-N of every prompt position
    logprob_token_ids: list[int] | None = None  # vLLM: these tokens' logprobs in place of the top-N
    return_token_ids: LaxBool | None = None  # vLLM: the prompt's and the output's token ids
    truncate_prompt_tokens: LaxInt | None = None  # vLLM: keep this many prompt tokens (-1: the context)
    truncation_side: Literal["left", "right"] | None = None  # vLLM: which end to cut (left: the start)
    add_special_tokens: LaxBool | None = None  # vLLM: BOS etc. when tokenizing (completions: yes)
    request_id: str | None = None  # vLLM: the response's id
    # Identifiers and hints that never change the output: accepted, unused.
    metadata: dict[str, Any] | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    session_id: str | None = None
    use_beam_search: LaxBool = (
        False  # vLLM: the n choices are the n best beams (engine/sampling/beam_search.py)
    )
    length_penalty: LaxFloat | None = None  # vLLM: beam search's length penalty (1.0)
    early_stopping: LaxBool | None = None  # Hugging Face's: beam search stops once n beams finished
    # vLLM and OpenAI fields not implemented: only their no-op value passes (UNSUPPORTED says why).
    include_stop_str_in_output: Any = None
    skip_special_tokens: Any = None
    spaces_between_special_tokens: Any = None
    priority: Any = None
    cache_salt: str | None = None  # vLLM: requests with different salts never share cached blocks
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
    min_characters: Any = None


class CompletionBody(_SamplingFields):
    # Token ids stay strict: ["1", "2"] is two text prompts, never two ids. None, "" and []: a 400
    # in vLLM's words (router.jobs).
    prompt: str | list[str] | list[int] | list[list[int]] | None = None
    max_tokens: LaxInt | None = 16  # 0: no output (with echo: the prompt and its logprobs)
    logprobs: LaxInt | None = None  # top alternatives per token
    echo: LaxBool = False  # the prompt text before the completion (with logprobs: the prompt's too)
    suffix: str | None = None  # not supported (rejected when set)
    best_of: LaxInt | None = None  # only best_of == n is supported
    prompt_embeds: Any = None


# Field -> (the values that ask for nothing, why any other is refused). Absent or null always passes.
UNSUPPORTED: dict[str, tuple[tuple[Any, ...], str]] = {
    "include_stop_str_in_output": ((False,), "the output always ends before the stop string"),
    "skip_special_tokens": ((True,), "special tokens are always left out of the text"),
    "spaces_between_special_tokens": ((True,), "detokenization options are not implemented"),
    "priority": ((0,), "request priorities are not implemented: requests run first come, first served"),
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
    # In neither vLLM's request schemas nor OpenAI's (StreamOptions.min_characters neither; see
    # there); refused by name: a minimum size for streamed deltas would be a buffering option, and
    # deltas go out as they come.
    "min_characters": ((), "streamed deltas go out as they come; no minimum delta size is implemented"),
    "prompt_embeds": (([],), "prompt embeddings are not implemented; send text or token ids"),
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
    strict: LaxBool | None = None  # accepted: calls always follow the schema


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
    max_tokens: LaxInt | None = None  # deprecated OpenAI name of max_completion_tokens
    max_completion_tokens: LaxInt | None = None
    logprobs: LaxBool = False
    top_logprobs: LaxInt | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None  # router.structured
    parallel_tool_calls: LaxBool | None = None  # accepted: "required" may return several calls
    echo: LaxBool = False  # vLLM: the last message's content before the reply, when it is the assistant's
    add_generation_prompt: LaxBool = True  # vLLM: passed to the chat template
    continue_final_message: LaxBool = False  # vLLM: the reply continues the last (assistant) message
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


class BatchChatBody(ChatBody):
    """vLLM's POST /v1/chat/completions/batch: the chat fields, ``messages`` a list of
    conversations; one chat.completion whose choices answer them in order (router.jobs)."""

    messages: list[Annotated[list[ChatMessage], pydantic.Field(min_length=1)]] = pydantic.Field(  # type: ignore[assignment]
        min_length=1
    )


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
    if first.get("type") in _BOUND_ERRORS:
        return bad_request(vllm_validation_message(errors), param)
    return bad_request(f"{param}: {first.get('msg')}", param)


# pydantic's bound errors: the only ones the request schemas raise that vLLM's raise alike
# (``seed``'s signed 64-bit range), so the whole message can be vLLM's.
_BOUND_ERRORS = frozenset({"less_than_equal", "greater_than_equal"})


def vllm_validation_message(errors: list[dict[str, Any]]) -> str:
    """vLLM's words for a body its schema refuses, which clients match on: the count, then each
    error as pydantic gives it, its ``loc`` dotted and its ``input`` as text (at most 10), as
    vllm/entrypoints/serve/exception_handling/handlers/validation.py writes them:

        1 validation error:
          {'type': 'less_than_equal', 'loc': 'body.seed', 'msg': 'Input should be less than or
          equal to 9223372036854775807', 'input': '9223372036854775808', 'ctx': {'le': ...}}
    """
    label = "error" if len(errors) == 1 else "errors"
    lines = [f"{len(errors)} validation {label}:"]
    for error in errors[:10]:
        shown = {k: error[k] for k in ("type", "loc", "msg", "input", "ctx") if k in error}
        shown["loc"] = ".".join(str(part) for part in error.get("loc", ()))
        if "input" in shown:
            text = str(shown["input"])
            shown["input"] = text if len(text) <= 200 else text[:200] + "...[truncated]"
        lines.append(f"  {shown}")
    if len(errors) > 10:
        lines.append(f"  ...and {len(errors) - 10} more {label}")
    return "\n".join(lines)


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
    add_special_tokens: LaxBool | None = None  # prompt: True; messages: False (the template has them)
    add_generation_prompt: LaxBool = True
    continue_final_message: LaxBool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Tool] | None = None
    return_token_strs: LaxBool = False  # each token's text beside its id


class DetokenizeBody(pydantic.BaseModel):
    model_config = _CONFIG
    model: str | None = None
    tokens: list[int]
