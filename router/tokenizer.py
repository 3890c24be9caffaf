"""The served model's tokenizer and chat template, without transformers (which imports torch).

Reads a Hugging Face folder: ``tokenizer.json`` through the ``tokenizers`` library, the chat
template from ``chat_template.jinja`` or ``tokenizer_config.json``, rendered the way
``transformers`` renders it (sandboxed jinja2, trim_blocks, lstrip_blocks, loop controls).
"""

from __future__ import annotations

import datetime
import functools
import json
import pathlib
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox
import tokenizers

from pdserve.grammar import GrammarCompiler


class ChatTemplateError(ValueError):
    """The template refused the conversation (its raise_exception) or failed to render."""


def _read_json(path: pathlib.Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def _token_str(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


class Tokenizer:
    """Encode, decode and chat-render for one model folder."""

    def __init__(self, folder: str | pathlib.Path) -> None:
        folder = pathlib.Path(folder)
        self.folder = folder
        if not (folder / "tokenizer.json").is_file():
            raise FileNotFoundError(f"{folder} has no tokenizer.json")
        self._tok = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
        tok_config = _read_json(folder / "tokenizer_config.json")
        model_config = _read_json(folder / "config.json")
        self.bos_token = _token_str(tok_config.get("bos_token"))
        self.eos_token = _token_str(tok_config.get("eos_token"))
        self.vocab_size = max(
            self._tok.get_vocab_size(with_added_tokens=True), int(model_config.get("vocab_size", 0))
        )
        # longest prompt + output the model takes, before node records say otherwise
        self.max_model_len = int(
            model_config.get("max_position_embeddings")
            or model_config.get("n_positions")
            or tok_config.get("model_max_length")
            or 2048
        )  # n_positions: GPT-2
        self.special_ids = frozenset(
            i for i, tok in self._tok.get_added_tokens_decoder().items() if tok.special
        )
        template_file = folder / "chat_template.jinja"
        source = template_file.read_text() if template_file.is_file() else tok_config.get("chat_template")
        if isinstance(source, list):  # named templates: [{"name": "default", "template": ...}, ...]
            source = next((t["template"] for t in source if t.get("name") == "default"), None)
        self._chat_template = _compile_template(source) if source else None

    @functools.cached_property
    def grammar_compiler(self) -> GrammarCompiler:
        """Compiles guided-decoding specs for this vocabulary, as the nodes do (router.structured)."""
        eos = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        return GrammarCompiler.from_folder(self.folder, self.vocab_size, (eos or 0,))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """One token on its own (a partial UTF-8 character shows as U+FFFD), for logprobs."""
        return self._tok.decode([token_id], skip_special_tokens=False)

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        continue_final_message: bool = False,
        template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        """The conversation as prompt text; tokenize it with add_special_tokens=False.
        ``continue_final_message``: the text stops where the last message's content does (what
        the template puts after it, its end-of-turn, is cut), so the reply continues it."""
        if self._chat_template is None:
            raise ChatTemplateError("the model has no chat template; use /v1/completions")
        try:
            text = self._chat_template.render(
                **(template_kwargs or {}),
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                tools=tools,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
            )
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"chat template failed: {exc}") from None
        if continue_final_message:
            final = messages[-1]["content"].strip()
            end = text.rfind(final)
            if not final or end < 0:
                raise ChatTemplateError("the chat template does not show the last message's content as given")
            text = text[: end + len(final)]
        return text

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        continue_final_message: bool = False,
        template_kwargs: dict[str, Any] | None = None,
        add_special_tokens: bool = False,
    ) -> list[int]:
        text = self.render_chat(
            messages, add_generation_prompt, tools, continue_final_message, template_kwargs
        )
        return self.encode(text, add_special_tokens=add_special_tokens)


def _compile_template(source: str) -> jinja2.Template:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)
