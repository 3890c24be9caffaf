"""OpenAI response objects: completions and chat, whole or as stream chunks, with logprobs."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from typing import Any

from protocol.messages import TokenLogprobs
from router.tokenizer import Tokenizer


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
        }


def envelope(
    response_id: str, object_: str, created: int, model: str, choices: list[dict], usage: Usage | None = None
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "id": response_id,
        "object": object_,
        "created": created,
        "model": model,
        "choices": choices,
    }
    if usage is not None:
        body["usage"] = usage.to_dict()
    return body


def sse(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False, separators=(',', ':'))}\n\n"


SSE_DONE = "data: [DONE]\n\n"


class LogprobFormatter:
    """Token logprobs in the completions or chat shape."""

    def __init__(self, tokenizer: Tokenizer, num_top: int, tokens_as_ids: bool) -> None:
        self._tokenizer = tokenizer
        self._num_top = num_top  # alternatives per token
        self._tokens_as_ids = tokens_as_ids  # "token_id:N" instead of the token's text

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

    def chat(self, entries: Sequence[TokenLogprobs]) -> dict[str, Any]:
        def item(token_id: int, logprob: float) -> dict[str, Any]:
            text = self.token(token_id)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

        content = [
            {**item(e.token_id, e.logprob), "top_logprobs": [item(t, lp) for t, lp in self._top(e)]}
            for e in entries
        ]
        return {"content": content}


def completion_choice(index: int, text: str, logprobs: dict | None, finish_reason: str | None) -> dict:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def chat_choice(
    index: int, text: str, logprobs: dict | None, finish_reason: str | None, tool_calls: list | None = None
) -> dict:
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if tool_calls:  # the reply was constrained to calls (router.structured): no content beside them
        message = {"role": "assistant", "content": None, "tool_calls": tool_calls}
        finish_reason = "tool_calls" if finish_reason == "stop" else finish_reason
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}


def tool_call_deltas(tool_calls: list[dict]) -> list[dict]:
    """Streamed tool calls, each whole in one delta entry (OpenAI's shape, with its index)."""
    return [{"index": i, **call} for i, call in enumerate(tool_calls)]


def chat_chunk_choice(index: int, delta: dict, logprobs: dict | None, finish_reason: str | None) -> dict:
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
