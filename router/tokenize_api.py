"""vLLM's utility endpoints: POST /tokenize (a prompt, or messages through the chat template, as
the completion endpoints would see them) and POST /detokenize."""

from __future__ import annotations

from typing import Any

from pdserve.router.errors import bad_request
from pdserve.router.openai_schema import DetokenizeBody, TokenizeBody
from pdserve.router.tokenizer import ChatTemplateError, Tokenizer


def tokenize(body: TokenizeBody, tokenizer: Tokenizer, max_model_len: int) -> dict[str, Any]:
    if (body.prompt is None) == (body.messages is None):
        raise bad_request("give exactly one of prompt and messages", "prompt" if body.prompt else "messages")
    if body.prompt is not None:
        ids = tokenizer.encode(body.prompt, body.add_special_tokens is not False)
    else:
        assert body.messages is not None  # exactly one of the two, checked above
        if body.continue_final_message and body.add_generation_prompt:
            raise bad_request(
                "continue_final_message and add_generation_prompt cannot both be true",
                "continue_final_message",
            )
        try:
            ids = tokenizer.encode_chat(
                [m.for_template() for m in body.messages],
                add_generation_prompt=body.add_generation_prompt,
                tools=[t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None,
                continue_final_message=body.continue_final_message,
                template_kwargs=body.chat_template_kwargs,
                add_special_tokens=bool(body.add_special_tokens),
            )
        except ChatTemplateError as exc:
            raise bad_request(str(exc), "messages") from None
    strs = [tokenizer.token_text(t) for t in ids] if body.return_token_strs else None
    return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids, "token_strs": strs}


def detokenize(body: DetokenizeBody, tokenizer: Tokenizer) -> dict[str, Any]:
    bad = [t for t in body.tokens if not 0 <= t < tokenizer.vocab_size]
    if bad:
        raise bad_request(
            f"token ids outside the vocabulary [0, {tokenizer.vocab_size}): {bad[:8]}", "tokens"
        )
    return {"prompt": tokenizer.decode(body.tokens)}
