"""Router text handling: incremental detokenization, stop strings, chat template rendering."""

from __future__ import annotations

import pytest

from pdserve.detok import IncrementalDetokenizer, StopStringMatcher
from pdserve.protocol.messages import TokenChunk
from pdserve.router.sample_state import SampleState
from pdserve.router.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tokenizer(default_model_dir) -> Tokenizer:
    return Tokenizer(default_model_dir)


def _stream(tokenizer, ids, prompt=(1, 2, 3)):
    detok = IncrementalDetokenizer(tokenizer, list(prompt))
    deltas = [detok.add(t) for t in ids]
    return deltas + [detok.flush()]


@pytest.mark.parametrize(
    "text",
    [
        "héllo wörld",
        "你好世界，日本語のテキスト",
        "emoji 🎉🎉 and 🇫🇷 flags",
        "  leading  and trailing  ",
        "tabs\tand\nnewlines\n\n",
        "Ünïcödé ∑∫√",
    ],
)
def test_streamed_deltas_concatenate_to_the_full_decode(tokenizer, text):
    ids = tokenizer.encode(text)
    assert "".join(_stream(tokenizer, ids)) == tokenizer.decode(ids) == text


def test_multibyte_character_split_across_tokens_is_held_until_complete(tokenizer):
    ids = tokenizer.encode("🎉")
    assert len(ids) > 1, "the emoji must span tokens for this test to mean anything"
    deltas = _stream(tokenizer, ids)
    assert deltas[:-2] == [""] * (len(ids) - 1)
    assert deltas[len(ids) - 1] == "🎉"
    assert all("\ufffd" not in d for d in deltas)


def test_leading_space_of_the_first_output_token_is_kept(tokenizer):
    prompt = tokenizer.encode("Hello")
    ids = tokenizer.encode(" world")
    assert "".join(_stream(tokenizer, ids, prompt)) == " world"


def test_special_tokens_are_not_in_the_text(tokenizer):
    eos = tokenizer.encode("<|im_end|>", add_special_tokens=False)
    assert len(eos) == 1 and eos[0] in tokenizer.special_ids
    assert "".join(_stream(tokenizer, tokenizer.encode("ok") + eos)) == "ok"


def _match(stop, pieces, final=True):
    matcher = StopStringMatcher(tuple(stop))
    sent = []
    for piece in pieces:
        matcher.add(piece)
        sent.append(matcher.take(final=False))
        if matcher.stopped:
            break
    sent.append(matcher.take(final=final))
    return matcher, sent


def test_stop_string_split_across_pieces_is_cut_exactly():
    matcher, sent = _match(["STOP"], ["abc S", "T", "OP tail"])
    assert matcher.stopped and matcher.text == "abc "
    assert "".join(sent) == "abc "


def test_partial_stop_prefix_is_held_back_then_released():
    matcher, sent = _match(["STOP"], ["abc ST", "x"])
    assert sent[0] == "abc"  # " ST" might start STOP
    assert not matcher.stopped and "".join(sent) == "abc STx"


def test_earliest_of_several_stop_strings_wins():
    matcher, _ = _match(["world", "lo w"], ["hello world"])
    assert matcher.text == "hel"


def test_no_stop_strings_sends_everything_at_once():
    _, sent = _match([], ["a", "b"], final=False)
    assert sent == ["a", "b", ""]


def _chunk(ids, finish=None):
    return TokenChunk(
        request_id="r",
        node_id="n",
        token_ids=tuple(ids),
        logprobs=(),
        finish_reason=finish,
        num_prompt_tokens=5,
        num_cached_tokens=2,
        is_first=False,
    )


def test_stop_string_inside_a_chunk_ends_the_sample_and_counts_tokens_up_to_it(tokenizer):
    ids = tokenizer.encode("one two three four")
    state = SampleState(tokenizer, (1, 2), (" three",))
    delta = state.on_chunk(_chunk(ids))
    assert (delta.text, delta.finish_reason) == ("one two", "stop")
    assert state.num_output_tokens == tokenizer.encode("one two three").__len__()
    assert (state.num_prompt_tokens, state.num_cached_tokens) == (5, 2)


def test_length_finish_flushes_held_text(tokenizer):
    state = SampleState(tokenizer, (1,), ("xyz",))
    first = state.on_chunk(_chunk(tokenizer.encode("ab x")))
    last = state.on_chunk(_chunk(tokenizer.encode("y"), finish="length"))
    assert first.text + last.text == "ab xy" and last.finish_reason == "length"


def test_chat_template_renders_like_transformers(tokenizer, default_model_dir):
    import transformers

    hf = transformers.AutoTokenizer.from_pretrained(default_model_dir)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi ü"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Again"},
    ]
    for conversation in (messages, messages[1:2]):
        expected = hf.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
        assert tokenizer.render_chat(conversation) == expected
        assert tokenizer.encode_chat(conversation) == list(
            hf(expected, add_special_tokens=False)["input_ids"]
        )
