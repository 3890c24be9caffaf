"""OpenAI response objects: completions and chat, whole or as stream chunks, with logprobs."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from typing import Any

from pdserve.protocol.messages import TokenLogprobs
from pdserve.protocol.reasons import FinishReason
from pdserve.router.tokenizer import Tokenizer


@dataclasses.dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prompt tokens served from a prefix cache

    def to_dict(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
            "cache_read_input_tokens": self.cached_tokens,  # vLLM's name for the same count
        }


def envelope(
    response_id: str,
    object_: str,
    created: int,
    model: str,
    choices: list[dict],
    usage: Usage | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """``extra``: vLLM's response-level fields (chat: prompt_logprobs, prompt_token_ids)."""
    body: dict[str, Any] = {
        "id": response_id,
        "object": object_,
        "created": created,
        "model": model,
        "choices": choices,
        **extra,
    }
    if usage is not None:
        body["usage"] = usage.to_dict()
    return body


# The top-level keys of vLLM's whole (not streamed) responses, in its order: it dumps every field
# of its response models, null when unset (vllm/entrypoints/openai/chat_completion/protocol.py's
# ChatCompletionResponse, completion/protocol.py's CompletionResponse), so its clients meet the
# same keys on every response, /invocations' included. Streamed chunks carry only what is set.
CHAT_KEYS = (
    "id",
    "object",
    "created",
    "model",
    "choices",
    "service_tier",
    "system_fingerprint",
    "usage",
    "prompt_logprobs",
    "prompt_token_ids",
    "prompt_text",
    "kv_transfer_params",
    "ec_transfer_params",
    "metrics",
)
COMPLETION_KEYS = tuple(k for k in CHAT_KEYS if not k.startswith("prompt_"))


def with_vllm_keys(body: dict[str, Any], keys: tuple[str, ...]) -> dict[str, Any]:
    """A whole response with vLLM's top-level ``keys`` in its order, null where pdserve has no
    value, and any key of pdserve's own after them."""
    return {**{key: body.get(key) for key in keys}, **{k: v for k, v in body.items() if k not in keys}}


def sse(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False, separators=(',', ':'))}\n\n"


SSE_DONE = "data: [DONE]\n\n"


class LogprobFormatter:
    """Token logprobs in the completions or chat shape."""

    def __init__(self, tokenizer: Tokenizer, num_top: int, tokens_as_ids: bool, chosen: bool = False) -> None:
        self._tokenizer = tokenizer
        self._num_top = num_top  # alternatives per token
        self._tokens_as_ids = tokens_as_ids  # "token_id:N" instead of the token's text
        # logprob_token_ids: the alternatives are those ids, and the sampled token leads them
        self._chosen = chosen

    def token(self, token_id: int) -> str:
        return f"token_id:{token_id}" if self._tokens_as_ids else self._tokenizer.token_text(token_id)

    def _top(self, entry: TokenLogprobs) -> list[tuple[int, float]]:
        return list(zip(entry.top_token_ids, entry.top_logprobs, strict=True))[: self._num_top]

    def completion(self, entries: Sequence[TokenLogprobs], text_offset: int) -> tuple[dict[str, Any], int]:
        """The completions ``logprobs`` object and the text offset after these tokens."""
        tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
        for entry in entries:
            text = self.token(entry.token_id)
            tokens.append(text)
            token_logprobs.append(entry.logprob)
            top = {self.token(t): lp for t, lp in self._top(entry)}
            top.setdefault(text, entry.logprob)  # the sampled token is always listed, as in vLLM
            top_logprobs.append(top)
            offsets.append(text_offset)
            text_offset += len(text)
        body = {
            "tokens": tokens,
            "token_logprobs": token_logprobs,
            "top_logprobs": top_logprobs,
            "text_offset": offsets,
        }
        return body, text_offset

    def completion_prompt(
        self, prompt_ids: Sequence[int], entries: Sequence[TokenLogprobs]
    ) -> tuple[dict[str, Any], int]:
        """Echo with logprobs: the prompt's tokens in the completions shape (the first has no
        logprob, as in vLLM), and the text offset after them."""
        first = self.token(prompt_ids[0])
        body, offset = self.completion(entries, len(first))
        body["tokens"].insert(0, first)
        body["token_logprobs"].insert(0, None)
        body["top_logprobs"].insert(0, None)
        body["text_offset"].insert(0, 0)
        return body, offset

    def prompt_logprobs(self, entries: Sequence[TokenLogprobs], num_top: int) -> list[dict | None]:
        """vLLM's ``prompt_logprobs``: None for the first prompt token, then for each the token's
        own entry and its ``num_top`` alternatives, keyed by token id."""

        def item(logprob: float, rank: int | None, token_id: int) -> dict[str, Any]:
            return {"logprob": logprob, "rank": rank, "decoded_token": self.token(token_id)}

        out: list[dict | None] = [None]
        for entry in entries:
            position = {str(entry.token_id): item(entry.logprob, entry.rank, entry.token_id)}
            top = zip(entry.top_token_ids[:num_top], entry.top_logprobs[:num_top], strict=True)
            for rank, (token_id, logprob) in enumerate(top, 1):
                position.setdefault(str(token_id), item(logprob, rank, token_id))
            out.append(position)
        return out

    def chat(self, entries: Sequence[TokenLogprobs]) -> dict[str, Any]:
        def item(token_id: int, logprob: float) -> dict[str, Any]:
            text = self.token(token_id)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

        content = [
            {**item(e.token_id, e.logprob), "top_logprobs": [item(t, lp) for t, lp in self._chat_top(e)]}
            for e in entries
        ]
        return {"content": content}

    def _chat_top(self, entry: TokenLogprobs) -> list[tuple[int, float]]:
        """Chat's alternatives. With logprob_token_ids, vLLM lists every entry the engine gave for
        the position, the sampled token first and the chosen ids after it in the order asked, each
        once (vllm/entrypoints/openai/chat_completion/serving.py, _create_chat_logprobs, on both
        chat endpoints; the sampler puts the sampled token in column 0)."""
        top = self._top(entry)
        if not self._chosen:
            return top
        return [(entry.token_id, entry.logprob), *((t, lp) for t, lp in top if t != entry.token_id)]


OPENAI_FINISH = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length", FinishReason.ABORT: "abort"}


def openai_finish(reason: FinishReason | None, tool_calls: bool = False) -> str | None:
    """OpenAI's finish_reason for the wire's: the one place the router turns it into a string."""
    if reason is None:
        return None
    return "tool_calls" if tool_calls and reason is FinishReason.STOP else OPENAI_FINISH[reason]


def completion_choice(
    index: int, text: str, logprobs: dict | None, finish_reason: FinishReason | None, **extra: Any
) -> dict:
    """``extra``: vLLM's fields (prompt_logprobs, prompt_token_ids, token_ids)."""
    return {
        "index": index,
        "text": text,
        "logprobs": logprobs,
        "finish_reason": openai_finish(finish_reason),
        **extra,
    }


def chat_choice(
    index: int,
    text: str,
    logprobs: dict | None,
    finish_reason: FinishReason | None,
    tool_calls: list | None = None,
    **extra: Any,
) -> dict:
    """``extra``: vLLM's fields (token_ids)."""
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if tool_calls:  # the reply was constrained to calls (router.structured): no content beside them
        message = {"role": "assistant", "content": None, "tool_calls": tool_calls}
    finish = openai_finish(finish_reason, bool(tool_calls))
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish, **extra}


def tool_call_deltas(tool_calls: list[dict]) -> list[dict]:
    """Streamed tool calls, each whole in one delta entry (OpenAI's shape, with its index)."""
    return [{"index": i, **call} for i, call in enumerate(tool_calls)]


def chat_chunk_choice(
    index: int,
    delta: dict,
    logprobs: dict | None,
    finish_reason: FinishReason | None,
    tool_calls: bool = False,
    **extra: Any,
) -> dict:
    finish = openai_finish(finish_reason, tool_calls)
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish, **extra}
