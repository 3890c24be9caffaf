"""Validated request bodies → ``Job``: tokenized prompts, sampling parameters, output options.

Everything a client can get wrong is caught here as a 400 naming the field, before any node
is involved: ranges (through SamplingParams), token ids outside the vocabulary, empty prompts,
and prompts that do not fit the context with the requested output.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from protocol.sampling_params import MAX_LOGPROBS, SamplingParams
from router.errors import APIError, bad_request
from router.openai_schema import ChatBody, CompletionBody, _SamplingFields
from router.structured import Structured, ToolCallPlan, check_token_rules, structured
from router.tokenizer import ChatTemplateError, Tokenizer


@dataclasses.dataclass(frozen=True, slots=True)
class Prompt:
    token_ids: tuple[int, ...]  # what the nodes see
    text: str | None  # the prompt as text (for echo); None until decoded


@dataclasses.dataclass(frozen=True, slots=True)
class Job:
    """One HTTP request's work: ``len(prompts) * params.n`` samples."""

    chat: bool  # /v1/chat/completions (else /v1/completions)
    prompts: tuple[Prompt, ...]
    params: SamplingParams  # n as requested; max_tokens set per prompt by ``params_for``
    max_tokens: int | None  # as requested; None: fill the context
    stream: bool
    include_usage: bool  # streaming: a last chunk with usage
    logprobs: int | None  # top alternatives per token; None: no logprobs
    echo: bool  # completions: the prompt text before the output
    tokens_as_ids: bool  # logprob tokens as "token_id:N"
    tool_plan: ToolCallPlan | None = None  # chat with tools: the reply becomes tool_calls

    def params_for(self, prompt: Prompt, max_model_len: int) -> SamplingParams:
        room = max_model_len - len(prompt.token_ids)
        return dataclasses.replace(
            self.params, max_tokens=room if self.max_tokens is None else self.max_tokens
        )


_FIELD_RE = re.compile(r"^(?:stop strings|(\w+))")


def _sampling_params(
    body: _SamplingFields, max_tokens: int | None, logprobs: int | None, rules: Structured
) -> SamplingParams:
    def given(value: float | None, default: float) -> float:
        return default if value is None else value

    try:
        return SamplingParams(
            n=body.n,
            temperature=given(body.temperature, 1.0),
            top_p=given(body.top_p, 1.0),
            top_k=body.top_k,
            min_p=given(body.min_p, 0.0),
            seed=body.seed,
            presence_penalty=given(body.presence_penalty, 0.0),
            frequency_penalty=given(body.frequency_penalty, 0.0),
            repetition_penalty=given(body.repetition_penalty, 1.0),
            max_tokens=max_tokens,
            min_tokens=body.min_tokens,
            stop=body.stop,
            stop_token_ids=tuple(body.stop_token_ids or ()),
            ignore_eos=body.ignore_eos,
            logprobs=logprobs,
            logit_bias=rules.logit_bias,
            allowed_token_ids=None if body.allowed_token_ids is None else tuple(body.allowed_token_ids),
            bad_words=tuple(body.bad_words or ()),
            guided_decoding=rules.guided,
        )
    except ValueError as exc:
        match = _FIELD_RE.match(str(exc))
        param = "stop" if match and match.group(1) is None else (match.group(1) if match else None)
        raise bad_request(str(exc), param) from None


def _check_unicode(value: Any, param: str) -> None:
    """JSON may escape lone surrogates (\\ud800) that no UTF-8 text holds: the tokenizer cannot take them."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise bad_request("text holds a lone surrogate: not valid Unicode", param) from None
    elif isinstance(value, dict):
        for item in value.values():
            _check_unicode(item, param)
    elif isinstance(value, (list, tuple)):
        for item in value:
            _check_unicode(item, param)


def _check_common(body: _SamplingFields, max_n: int, tokenizer: Tokenizer) -> Structured:
    """Checks both endpoints share; the body's constraints (router.structured)."""
    for name, value in body.model_dump().items():
        _check_unicode(value, name)
    if body.n > max_n:
        raise bad_request(f"n must be <= {max_n}, got {body.n}", "n")
    if body.seed is not None and body.seed < 0:
        raise bad_request(f"seed must be >= 0, got {body.seed}", "seed")
    check_token_rules(body, tokenizer.vocab_size)
    return structured(body, tokenizer)


def _check_fits(prompts: tuple[Prompt, ...], max_tokens: int | None, max_model_len: int, param: str) -> None:
    for prompt in prompts:
        num = len(prompt.token_ids)
        if num == 0:
            raise bad_request("the prompt is empty", param)
        if num + (max_tokens or 1) > max_model_len:
            raise APIError(
                400,
                f"This model's maximum context length is {max_model_len} tokens. However, you "
                f"requested {num + (max_tokens or 1)} tokens ({num} in the prompt, "
                f"{max_tokens or 1} for the completion).",
                param,
                "context_length_exceeded",
            )


def _check_token_ids(prompts: list[list[int]], vocab_size: int) -> None:
    for ids in prompts:
        bad = next((t for t in ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise bad_request(f"token id {bad} is outside the vocabulary [0, {vocab_size})", "prompt")


def completion_job(body: CompletionBody, tokenizer: Tokenizer, max_model_len: int, max_n: int) -> Job:
    rules = _check_common(body, max_n, tokenizer)
    if body.suffix:
        raise bad_request("suffix is not supported", "suffix")
    if body.best_of is not None and body.best_of != body.n:
        raise bad_request("best_of must equal n (best-of sampling is not supported)", "best_of")
    if body.echo and body.logprobs is not None:
        raise bad_request("echo with logprobs (prompt logprobs) is not supported", "echo")
    params = _sampling_params(body, body.max_tokens, body.logprobs, rules)
    raw = body.prompt
    if isinstance(raw, str):
        raw = [raw]
    if not raw:
        raise bad_request("the prompt is empty", "prompt")
    if isinstance(raw[0], str):
        prompts = tuple(Prompt(tuple(tokenizer.encode(text)), text) for text in raw)
    else:
        id_lists = [raw] if isinstance(raw[0], int) else raw
        _check_token_ids(id_lists, tokenizer.vocab_size)
        prompts = tuple(Prompt(tuple(ids), None) for ids in id_lists)
    _check_fits(prompts, body.max_tokens, max_model_len, "prompt")
    return Job(
        False,
        prompts,
        params,
        body.max_tokens,
        body.stream,
        _include_usage(body),
        body.logprobs,
        body.echo,
        body.return_tokens_as_token_ids,
    )


def chat_job(body: ChatBody, tokenizer: Tokenizer, max_model_len: int, max_n: int) -> Job:
    rules = _check_common(body, max_n, tokenizer)
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_request("top_logprobs needs logprobs to be true", "top_logprobs")
    if body.top_logprobs is not None and not 0 <= body.top_logprobs <= MAX_LOGPROBS:
        raise bad_request(
            f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {body.top_logprobs}", "top_logprobs"
        )
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    try:
        params = _sampling_params(body, max_tokens, logprobs, rules)
    except APIError as exc:
        if exc.param == "max_tokens" and body.max_completion_tokens is not None:
            exc.param = "max_completion_tokens"
        raise
    try:
        tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
        ids = tokenizer.encode_chat([m.for_template() for m in body.messages], tools=tools)
    except ChatTemplateError as exc:
        raise bad_request(str(exc), "messages") from None
    prompts = (Prompt(tuple(ids), None),)
    _check_fits(prompts, max_tokens, max_model_len, "messages")
    return Job(
        True,
        prompts,
        params,
        max_tokens,
        body.stream,
        _include_usage(body),
        logprobs,
        False,
        body.return_tokens_as_token_ids,
        rules.tool_plan,
    )


def _include_usage(body: _SamplingFields) -> bool:
    return bool(body.stream and body.stream_options and body.stream_options.include_usage)
