"""Validated request bodies → ``Job``: tokenized prompts, sampling parameters, output options.

Everything a client can get wrong is caught here as a 400 naming the field, before any node
is involved: ranges (through SamplingParams), token ids outside the vocabulary, empty prompts,
and prompts that do not fit the context with the requested output.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from pdserve.protocol.sampling_params import BeamSearch, SamplingParams
from pdserve.router.errors import APIError, bad_request
from pdserve.router.openai_schema import (
    UNSUPPORTED,
    BatchChatBody,
    ChatBody,
    CompletionBody,
    _SamplingFields,
    reads_as,
)
from pdserve.router.request_limits import Limits, check_prompt_wire
from pdserve.router.structured import Structured, ToolCallPlan, check_in_vocab, check_token_rules, structured
from pdserve.router.tokenizer import ChatTemplateError, Tokenizer


@dataclasses.dataclass(frozen=True, slots=True)
class Prompt:
    token_ids: tuple[int, ...]  # what the nodes see
    text: str | None  # the prompt as text (for echo); None until decoded
    reply_prefix: str = ""  # chat echo: the last (assistant) message's content before the reply


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
    echo: bool  # completions: the prompt text before the output (with logprobs: the prompt's too)
    tokens_as_ids: bool  # logprob tokens as "token_id:N"
    tool_plan: ToolCallPlan | None = None  # chat with tools: the reply becomes tool_calls
    prompt_logprobs: int | None = None  # the prompt_logprobs field (None: the key is null)
    return_token_ids: bool = False  # prompt_token_ids and token_ids in the response
    continuous_usage: bool = False  # streaming: usage so far on every chunk
    response_id: str | None = None  # the client's request_id; None: a fresh one
    no_output: bool = False  # max_tokens 0: the one token the nodes make is not returned
    batched: bool = False  # /v1/chat/completions/batch: a prompt per conversation, its fields per choice
    adapter_rank: int | None = None  # params.adapter's rank (router/lora.py): which nodes can serve it

    def params_for(self, prompt: Prompt, max_model_len: int) -> SamplingParams:
        room = max_model_len - len(prompt.token_ids)
        return dataclasses.replace(
            self.params, max_tokens=room if self.max_tokens is None else self.max_tokens
        )


_FIELD_RE = re.compile(r"^(?:stop strings|(\w+))")


def _given(value: float | None, default: float) -> float:
    return default if value is None else value


def _sampling_params(
    body: _SamplingFields,
    max_tokens: int | None,
    logprobs: int | None,
    rules: Structured,
    prompt_logprobs: int | None = None,
) -> SamplingParams:
    try:
        beams = _beam_search(body)
        return SamplingParams(
            n=body.n,
            temperature=_temperature(body.temperature, beams),
            top_p=_given(body.top_p, 1.0),
            top_k=body.top_k,
            min_p=_given(body.min_p, 0.0),
            seed=body.seed,
            presence_penalty=_given(body.presence_penalty, 0.0),
            frequency_penalty=_given(body.frequency_penalty, 0.0),
            repetition_penalty=_given(body.repetition_penalty, 1.0),
            max_tokens=max_tokens,
            min_tokens=body.min_tokens,
            stop=(body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ()),
            stop_token_ids=tuple(body.stop_token_ids or ()),
            ignore_eos=body.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            logprob_token_ids=None if body.logprob_token_ids is None else tuple(body.logprob_token_ids),
            logit_bias=rules.logit_bias,
            allowed_token_ids=None if body.allowed_token_ids is None else tuple(body.allowed_token_ids),
            bad_words=tuple(body.bad_words or ()),
            guided_decoding=rules.guided,
            beam_search=beams,
            cache_salt=body.cache_salt,
        )
    except ValueError as exc:
        match = _FIELD_RE.match(str(exc))
        param = "stop" if match and match.group(1) is None else (match.group(1) if match else None)
        raise bad_request(str(exc), param) from None


def _beam_search(body: _SamplingFields) -> BeamSearch | None:
    """use_beam_search and its options; ValueError naming an option sent without it."""
    if not body.use_beam_search:
        for name in ("length_penalty", "early_stopping"):
            if getattr(body, name) is not None:
                raise ValueError(f"{name} applies to beam search only: set use_beam_search")
        return None
    return BeamSearch(
        length_penalty=1.0 if body.length_penalty is None else body.length_penalty,
        early_stopping=bool(body.early_stopping),
    )


def _temperature(value: float | None, beams: BeamSearch | None) -> float:
    """The request's temperature (1 when not sent). Beam search ranks by the model's own
    log-probabilities, so it takes 0 or 1 (each leaves them as they are), sent or not."""
    if beams is not None and value in (None, 0, 1):
        return 0.0
    return 1.0 if value is None else value


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


def _check_unsupported(body: _SamplingFields) -> None:
    """A field pdserve does not implement passes only at its no-op value (or null)."""
    for name in sorted(body.model_fields_set & UNSUPPORTED.keys()):
        value = getattr(body, name)
        allowed, why = UNSUPPORTED[name]
        if value is not None and not any(reads_as(value, a) for a in allowed):
            accepted = " or ".join(repr(a) for a in allowed)
            raise bad_request(f"{name} is not supported: {why} (accepted: {accepted or 'null'})", name)


def _chat_prompt_ids(body: ChatBody, messages: list[dict], tokenizer: Tokenizer) -> tuple[int, ...]:
    """The chat template applied to the messages (and tools), after its options are checked."""
    if body.continue_final_message:
        if body.add_generation_prompt:
            raise bad_request(
                "continue_final_message and add_generation_prompt cannot both be true "
                "(set add_generation_prompt: false)",
                "continue_final_message",
            )
        if messages[-1]["role"] != "assistant" or not messages[-1]["content"]:
            raise bad_request(
                "continue_final_message needs a last message from the assistant with content", "messages"
            )
    reserved = {"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"}
    if clash := sorted(reserved & set(body.chat_template_kwargs or {})):
        raise bad_request(f"chat_template_kwargs may not set {', '.join(clash)}", "chat_template_kwargs")
    try:
        tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
        return tuple(
            tokenizer.encode_chat(
                messages,
                add_generation_prompt=body.add_generation_prompt,
                tools=tools,
                continue_final_message=body.continue_final_message,
                template_kwargs=body.chat_template_kwargs,
                add_special_tokens=bool(body.add_special_tokens),
            )
        )
    except ChatTemplateError as exc:
        raise bad_request(str(exc), "messages") from None


def _check_common(body: _SamplingFields, limits: Limits, tokenizer: Tokenizer) -> Structured:
    """Checks both endpoints share; the body's constraints (router.structured)."""
    _check_unsupported(body)
    for name, value in body.model_dump().items():
        _check_unicode(value, name)
    if body.n > limits.max_n:
        raise bad_request(f"n must be <= {limits.max_n}, got {body.n}", "n")
    if body.stream_options is not None and not body.stream:
        raise bad_request("stream_options is only allowed when stream is true", "stream_options")
    if body.stream_options is not None and body.stream_options.min_characters is not None:
        raise bad_request(
            "stream_options.min_characters is not supported: it is in neither vLLM's nor OpenAI's "
            "stream options (vLLM ignores it as an unknown field), and streamed deltas go out as they "
            "come, never held back to a minimum size",
            "stream_options.min_characters",
        )
    if body.truncation_side is not None and body.truncate_prompt_tokens is None:
        raise bad_request("truncation_side needs truncate_prompt_tokens", "truncation_side")
    check_token_rules(body, tokenizer.vocab_size)
    _check_logprob_token_ids(body.logprob_token_ids, tokenizer.vocab_size)
    return structured(body, tokenizer)


def _prompt_positions(prompts: tuple[Prompt, ...], n: int) -> int:
    """Prompt positions scored across the response (each sample's choice may carry them)."""
    return n * sum(len(p.token_ids) - 1 for p in prompts)


def _output_positions(prompts: tuple[Prompt, ...], n: int, max_tokens: int | None, max_model_len: int) -> int:
    """Output positions across the response at most (None: up to the context)."""
    return n * sum(max_model_len - len(p.token_ids) if max_tokens is None else max_tokens for p in prompts)


def _check_logprob_token_ids(ids: list[int] | None, vocab_size: int) -> None:
    """vLLM's words (vllm/sampling_params.py, SamplingParams._validate_logprobs)."""
    if ids is not None and not ids:
        raise bad_request("`logprob_token_ids` must not be an empty list.", "logprob_token_ids")
    check_in_vocab(ids, "logprob_token_ids", vocab_size)


def _num_top(logprobs: int | None, chosen: list[int] | None) -> int | None:
    """Alternatives listed per output token: the chosen ids' (logprob_token_ids) when given."""
    return logprobs if logprobs is None or chosen is None else len(chosen)


def _truncate(body: _SamplingFields, ids: tuple[int, ...], max_model_len: int) -> tuple[int, ...]:
    """vLLM's truncate_prompt_tokens: keep k tokens (-1: the context), cut from the left by default."""
    k = body.truncate_prompt_tokens
    if k is None:
        return ids
    if k == -1:
        k = max_model_len
    if not 1 <= k <= max_model_len:
        raise bad_request(
            f"truncate_prompt_tokens must be -1 or in [1, {max_model_len}], got {body.truncate_prompt_tokens}",
            "truncate_prompt_tokens",
        )
    if len(ids) <= k:
        return ids
    return ids[:k] if body.truncation_side == "right" else ids[len(ids) - k :]


def _response_fields(body: _SamplingFields, prompt_logprobs: int | None) -> dict[str, Any]:
    """The Job fields both endpoints set from the body alike (prompt_logprobs: -1 resolved)."""
    options = body.stream_options
    return {
        "prompt_logprobs": prompt_logprobs,
        "return_token_ids": bool(body.return_token_ids),
        # as vLLM: continuous_usage_stats without include_usage asks for no usage at all
        "continuous_usage": _include_usage(body) and bool(options and options.continuous_usage_stats),
        "response_id": body.request_id,
    }


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
    """Token-id prompts inside the vocabulary. Past its end: vLLM's words, which name the largest
    id (vllm/v1/engine/input_processor.py, _validate_model_input); vLLM's schema refuses a
    negative id before that, with pydantic's words for a field, so pdserve says it in its own."""
    for ids in prompts:
        if ids and max(ids) >= vocab_size:
            raise bad_request(f"Token id {max(ids)} is out of vocabulary", "prompt")
        if ids and min(ids) < 0:
            raise bad_request(f"token ids must be >= 0, got {min(ids)}", "prompt")


def completion_job(body: CompletionBody, tokenizer: Tokenizer, max_model_len: int, limits: Limits) -> Job:
    # vLLM's words, which clients match on (a non-empty prompt_embeds is refused by name below)
    if (body.prompt is None or body.prompt in ("", [])) and not body.prompt_embeds:
        raise bad_request("Either prompt or prompt_embeds must be provided and non-empty.", "prompt")
    rules = _check_common(body, limits, tokenizer)
    no_output = body.max_tokens == 0
    _check_completion_fields(body, no_output)
    max_tokens = 1 if no_output else body.max_tokens  # the nodes make one token; it is not returned
    vocab = tokenizer.vocab_size
    logprobs = limits.top_count(body.logprobs, "logprobs", vocab)
    asked_prompt_logprobs = limits.top_count(body.prompt_logprobs, "prompt_logprobs", vocab)
    # echo with logprobs scores the echoed prompt too, as vLLM does (lm-eval's loglikelihood)
    prompt_logprobs = asked_prompt_logprobs
    if body.echo and logprobs is not None:
        prompt_logprobs = max(prompt_logprobs or 0, logprobs)
    params = _sampling_params(body, max_tokens, logprobs, rules, prompt_logprobs)
    prompts = _completion_prompts(body, tokenizer, max_model_len)
    _check_fits(prompts, max_tokens, max_model_len, "prompt")
    _check_logprob_sizes(limits, prompts, body.n, (asked_prompt_logprobs, prompt_logprobs))
    echoed = _prompt_positions(prompts, body.n) if body.echo else 0
    output = 0 if no_output else _output_positions(prompts, body.n, max_tokens, max_model_len)
    limits.check_entries("logprobs", logprobs, echoed + output)
    return Job(
        False,
        tuple(prompts),
        params,
        max_tokens,
        body.stream,
        _include_usage(body),
        _num_top(logprobs, body.logprob_token_ids),
        body.echo,
        body.return_tokens_as_token_ids,
        no_output=no_output,
        **_response_fields(body, asked_prompt_logprobs),
    )


def _check_completion_fields(body: CompletionBody, no_output: bool) -> None:
    """The completions fields refused, or refused in combination (``no_output``: max_tokens 0)."""
    if body.suffix:
        raise bad_request("suffix is not supported", "suffix")
    if body.best_of is not None and body.best_of != body.n:
        raise bad_request("best_of must equal n (best-of sampling is not supported)", "best_of")
    if no_output and body.min_tokens:
        raise bad_request("min_tokens must be 0 when max_tokens is 0", "min_tokens")
    if body.logprob_token_ids is not None and body.logprobs is None:
        raise bad_request("logprob_token_ids needs logprobs to be set", "logprob_token_ids")
    if body.logprob_token_ids is not None and no_output:
        raise bad_request(
            "logprob_token_ids needs output tokens: max_tokens 0 generates none", "logprob_token_ids"
        )


def _check_logprob_sizes(
    limits: Limits, prompts: tuple[Prompt, ...], n: int, prompt_logprobs: tuple[int | None, int | None]
) -> None:
    """Prompt log-probabilities within the response's bound (as asked) and one node message's (as
    the engine computes them: with echo, completions' logprobs count too) (router.request_limits)."""
    asked, computed = prompt_logprobs
    limits.check_entries("prompt_logprobs", asked, _prompt_positions(prompts, n))
    check_prompt_wire(computed, max(len(p.token_ids) for p in prompts))


def _completion_prompts(body: CompletionBody, tokenizer: Tokenizer, max_model_len: int) -> tuple[Prompt, ...]:
    """The prompts of a completions body: texts encoded, token ids checked, each truncated as asked."""
    raw = body.prompt
    assert raw, "completion_job refuses an empty prompt"
    if isinstance(raw, str):
        raw = [raw]
    add_special = body.add_special_tokens is not False
    if isinstance(raw[0], str):
        prompts = [Prompt(tuple(tokenizer.encode(text, add_special)), text) for text in raw]
    else:
        id_lists = [raw] if isinstance(raw[0], int) else raw
        _check_token_ids(id_lists, tokenizer.vocab_size)
        prompts = [Prompt(tuple(ids), None) for ids in id_lists]
    for i, prompt in enumerate(prompts):
        ids = _truncate(body, prompt.token_ids, max_model_len)
        prompts[i] = prompt if ids == prompt.token_ids else Prompt(ids, None)
    return tuple(prompts)


def chat_job(body: ChatBody, tokenizer: Tokenizer, max_model_len: int, limits: Limits) -> Job:
    return _chat_job(body, [body.messages], tokenizer, max_model_len, limits)


def batch_chat_job(body: BatchChatBody, tokenizer: Tokenizer, max_model_len: int, limits: Limits) -> Job:
    """vLLM's batched chat: one prompt per conversation, answered whole (vLLM streams none of it
    and takes no tools either)."""
    if body.stream:
        raise bad_request("the batched chat endpoint does not stream; send stream: false", "stream")
    if body.tools:
        raise bad_request("the batched chat endpoint takes no tools; use /v1/chat/completions", "tools")
    return _chat_job(body, body.messages, tokenizer, max_model_len, limits, batched=True)


def _chat_job(
    body: ChatBody,
    conversations: list,
    tokenizer: Tokenizer,
    max_model_len: int,
    limits: Limits,
    batched: bool = False,
) -> Job:
    rules = _check_common(body, limits, tokenizer)
    logprobs, prompt_logprobs = _chat_logprobs(body, tokenizer.vocab_size, limits)
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    try:
        params = _sampling_params(body, max_tokens, logprobs, rules, prompt_logprobs)
    except APIError as exc:
        if exc.param == "max_tokens" and body.max_completion_tokens is not None:
            exc.param = "max_completion_tokens"
        raise
    prompts = _chat_prompts(body, conversations, tokenizer, max_tokens, max_model_len, batched)
    _check_logprob_sizes(limits, prompts, body.n, (prompt_logprobs, prompt_logprobs))
    output = _output_positions(prompts, body.n, max_tokens, max_model_len)
    limits.check_entries("top_logprobs", logprobs, output)
    return Job(
        True,
        prompts,
        params,
        max_tokens,
        body.stream,
        _include_usage(body),
        _num_top(logprobs, body.logprob_token_ids),
        False,
        body.return_tokens_as_token_ids,
        rules.tool_plan,
        batched=batched,
        **_response_fields(body, prompt_logprobs),
    )


def _chat_logprobs(body: ChatBody, vocab: int, limits: Limits) -> tuple[int | None, int | None]:
    """(alternatives per output token, or None without logprobs; per prompt token, or None)."""
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_request("top_logprobs needs logprobs to be true", "top_logprobs")
    if body.logprob_token_ids is not None and not body.logprobs:
        raise bad_request("logprob_token_ids needs logprobs to be true", "logprob_token_ids")
    top_logprobs = limits.top_count(body.top_logprobs, "top_logprobs", vocab)
    prompt_logprobs = limits.top_count(body.prompt_logprobs, "prompt_logprobs", vocab)
    return ((top_logprobs or 0) if body.logprobs else None), prompt_logprobs


def _chat_prompts(
    body: ChatBody,
    conversations: list,
    tokenizer: Tokenizer,
    max_tokens: int | None,
    max_model_len: int,
    batched: bool,
) -> tuple[Prompt, ...]:
    """A prompt per conversation; a batch's errors name the conversation (``messages.1``)."""
    prompts = []
    for i, conversation in enumerate(conversations):
        try:
            prompts.append(_chat_prompt(body, conversation, tokenizer, max_tokens, max_model_len))
        except APIError as exc:
            if batched and exc.param == "messages":
                exc.param = f"messages.{i}"
            raise
    return tuple(prompts)


def _chat_prompt(
    body: ChatBody, conversation: list, tokenizer: Tokenizer, max_tokens: int | None, max_model_len: int
) -> Prompt:
    """One conversation through the chat template; with echo, the last (assistant) message's content."""
    messages = [m.for_template() for m in conversation]
    ids = _truncate(body, _chat_prompt_ids(body, messages, tokenizer), max_model_len)
    last = messages[-1]
    echo = last["content"] if body.echo and last["role"] == "assistant" else ""
    prompt = Prompt(ids, None, reply_prefix=echo)
    _check_fits((prompt,), max_tokens, max_model_len, "messages")
    return prompt


def _include_usage(body: _SamplingFields) -> bool:
    return bool(body.stream and body.stream_options and body.stream_options.include_usage)
