"""Logits rules in the engine: grammars (guided decoding), logit_bias, allowed_token_ids and
bad_words. The oracle is Hugging Face ``generate`` on the same weights, with the same rule as a
logits processor (the grammar's through llguidance itself); unconstrained rows batched beside
constrained ones stay exactly HF's greedy output."""

from __future__ import annotations

import json
import pathlib
import re
import shutil

import jsonschema
import numpy as np
import pytest
import torch
import transformers

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.config import EngineConfig
from pdserve.engine.core.kv_connector import KVTransfer
from pdserve.engine.llm_engine import LLMEngine
from pdserve.protocol.sampling_params import GuidedDecoding
from tests.engine_helpers import hf_greedy, hf_model
from tests.test_engine_disagg import _move_kv

EOS = 2
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "pet": {"enum": ["cat", "dog"]},
    },
    "required": ["name", "age", "pet"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, default_model_dir) -> pathlib.Path:
    """A tiny seeded Llama with the default model's tokenizer (49,152 tokens): grammars need a
    real vocabulary, and a tiny model keeps HF's oracle fast."""
    path = tmp_path_factory.mktemp("tiny-vocab")
    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=49152,
        max_position_embeddings=512,
        eos_token_id=EOS,
        bos_token_id=1,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.08)
    model.save_pretrained(path, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_model_dir / name, path / name)
    return path


@pytest.fixture(scope="module")
def llm(model_dir) -> LLM:
    return LLM(str(model_dir), num_kv_blocks=128, block_size=8)


class _GrammarMask(transformers.LogitsProcessor):
    """The oracle's grammar: an llguidance matcher of its own and its bitmask, on HF's scores."""

    def __init__(self, llm: LLM, spec: GuidedDecoding, num_prompt: int) -> None:
        self.matcher = llm.engine.sampler.rules.compiler.matcher(spec)  # a fresh copy: its own state
        self.num_prompt = num_prompt

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        new = input_ids[0, self.num_prompt :].tolist()
        if new:
            assert self.matcher.consume_token(new[-1])
        bits = np.unpackbits(np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
        allowed = torch.from_numpy(bits[: scores.shape[-1]].astype(bool))
        return scores.masked_fill(~allowed, float("-inf"))


def _hf_generate(
    model_dir, prompt: list[int], max_new_tokens: int, processors=(), eos: int | None = EOS, **kwargs
) -> list[int]:
    with torch.no_grad():
        out = hf_model(str(model_dir)).generate(
            torch.tensor([prompt]),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=0,
            logits_processor=transformers.LogitsProcessorList(list(processors)),
            **kwargs,
        )
    return out[0, len(prompt) :].tolist()


GUIDED = [
    GuidedDecoding.json_schema(PERSON),
    GuidedDecoding.regex(r"[a-z]{2,6}-\d{3}"),
    GuidedDecoding.choice(["alpha", "beta", "gamma delta"]),
    GuidedDecoding.grammar('root ::= "ok " ("yes" | "no") " " [0-9]+ "."'),
]


def test_mixed_batch_plain_rows_equal_hf_and_guided_rows_equal_hf_with_the_grammar(llm, model_dir):
    prompts = [[1, 5 + i, 300 + 7 * i, 1200 + i] for i in range(8)]
    plain = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    params = [
        plain
        if i % 2 == 0
        else SamplingParams(temperature=0.0, max_tokens=24, guided_decoding=GUIDED[i // 2])
        for i in range(8)
    ]
    outs = llm.generate(prompts, params)
    for i, (prompt, out) in enumerate(zip(prompts, outs, strict=True)):
        got = out.outputs[0].token_ids
        if i % 2 == 0:
            assert got == hf_greedy(str(model_dir), prompt, 12)
        else:
            spec = GUIDED[i // 2]
            assert got == _hf_generate(model_dir, prompt, 24, [_GrammarMask(llm, spec, len(prompt))])
    texts = {GUIDED[i // 2].kind.value: outs[i].outputs[0] for i in range(1, 8, 2)}
    assert texts["choice"].text in GUIDED[2].choices and texts["choice"].finish_reason == "stop"
    if texts["json"].finish_reason == "stop":
        jsonschema.validate(json.loads(texts["json"].text), PERSON)
    if texts["regex"].finish_reason == "stop":
        assert re.fullmatch(r"[a-z]{2,6}-[0-9]{3}", texts["regex"].text)
    assert not llm.engine.has_work()


def test_guided_output_survives_prefill_on_one_engine_and_decode_on_another(llm, model_dir):
    """The decode side rebuilds the matcher from the spec and replays the first token."""
    prompt = [1, 40, 41, 42, 43]
    spec = GuidedDecoding.json_schema(PERSON)
    params = SamplingParams(temperature=0.0, max_tokens=30, guided_decoding=spec)
    offline = llm.generate([prompt], params)[0].outputs[0].token_ids
    prefill = LLMEngine(EngineConfig(model=str(model_dir), num_kv_blocks=16, block_size=8))
    decode = LLMEngine(EngineConfig(model=str(model_dir), num_kv_blocks=16, block_size=8))
    prefill.add_request("g", prompt, params, kv_transfer=KVTransfer.SEND)
    while prefill.has_work():
        prefill.step()
    outs = _move_kv(prefill, decode, prefill.scheduler.held["g"], "g")
    assert prefill.abort_request("g")
    while decode.has_work():
        outs += decode.step().outputs
    assert outs[-1].finished and outs[-1].outputs[0].token_ids == offline
    assert decode.block_manager.num_free_blocks == 16 and not decode.sampler.rules._states


def test_a_grammar_that_cannot_finish_ends_with_length(llm):
    params = SamplingParams(temperature=0.0, max_tokens=3, guided_decoding=GuidedDecoding.json_schema(PERSON))
    out = llm.generate([[1, 9, 10]], params)[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 3


def test_sampled_guided_rows_stay_inside_the_grammar(llm):
    spec = GuidedDecoding.choice(["red", "green", "blue"])
    params = SamplingParams(temperature=1.5, seed=3, max_tokens=10, n=4, guided_decoding=spec)
    outs = llm.generate([[1, 77, 78]], params)[0].outputs
    assert len(outs) == 4 and all(o.text in spec.choices and o.finish_reason == "stop" for o in outs)


def test_each_spec_compiles_once(llm):
    compiler = llm.engine.sampler.rules.compiler
    spec = GuidedDecoding.regex(r"x{1,3}y")
    before = compiler.num_compiles
    llm.generate([[1, 5, 6], [1, 7, 8]], SamplingParams(temperature=0.0, max_tokens=8, guided_decoding=spec))
    llm.generate([[1, 9, 6]], SamplingParams(temperature=0.0, max_tokens=8, guided_decoding=spec))
    assert compiler.num_compiles == before + 1


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (GuidedDecoding.json_schema({"type": "objekt"}), "guided_decoding"),
        (GuidedDecoding(kind=GuidedDecoding.json_object().kind, text="{not json"), "guided_decoding"),
        (GuidedDecoding.regex("a(b"), "guided_decoding"),
        (GuidedDecoding.regex(r"[^\s\S]"), "guided_decoding"),  # compiles to a grammar matching nothing
        (GuidedDecoding.grammar("root ::= undefined_rule"), "guided_decoding"),
    ],
)
def test_a_spec_that_does_not_compile_is_refused_before_queueing(llm, spec, message):
    with pytest.raises(ValueError, match=message):
        llm.generate([[1, 5]], SamplingParams(guided_decoding=spec))
    assert not llm.engine.has_work()


def test_logit_bias_equals_hf_sequence_bias(llm, model_dir):
    prompt = [1, 500, 501, 502]
    first = hf_greedy(str(model_dir), prompt, 1)[0]
    bias = {first: -100.0, 4242: 5.0}
    out = llm.generate(
        [prompt], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logit_bias=bias)
    )
    ref = _hf_generate(model_dir, prompt, 10, sequence_bias={(t,): b for t, b in bias.items()}, eos=None)
    assert out[0].outputs[0].token_ids == ref and ref[0] != first


def test_allowed_token_ids_restrict_every_token(llm, model_dir):
    allowed = (10, 11, 12, 500, 4242)
    out = llm.generate(
        [[1, 60, 61]],
        SamplingParams(temperature=0.9, seed=5, max_tokens=12, ignore_eos=True, allowed_token_ids=allowed),
    )
    assert set(out[0].outputs[0].token_ids) <= set(allowed)


def test_bad_words_never_appear_and_the_rest_is_hf_with_them_banned(llm, model_dir):
    prompt = [1, 700, 701, 702]
    plain = hf_greedy(str(model_dir), prompt, 10)
    tokenizer = llm.get_tokenizer()
    word = tokenizer.decode([plain[0]]).strip()
    assert word, "the greedy first token should be a word"
    out = llm.generate(
        [prompt], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, bad_words=[word])
    )
    banned = {tuple(tokenizer.encode(w, add_special_tokens=False)) for w in (word, " " + word)}
    singles = {ids[0] for ids in banned if len(ids) == 1}
    got = out[0].outputs[0].token_ids
    assert singles and not singles & set(got)
    ref = _hf_generate(model_dir, prompt, 10, bad_words_ids=[list(ids) for ids in banned], eos=None)
    assert got == ref


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"logit_bias": {5: 101.0}}, "logit_bias"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"bad_words": [""]}, "bad_words"),
        ({"guided_decoding": GuidedDecoding.json_object(), "ignore_eos": True}, "ignore_eos"),
        ({"guided_decoding": GuidedDecoding.json_object(), "min_tokens": 2}, "min_tokens"),
    ],
)
def test_bad_rules_raise_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_rules_with_token_ids_outside_the_vocabulary_are_refused(llm):
    with pytest.raises(ValueError, match="logit_bias"):
        llm.generate([[1, 5]], SamplingParams(logit_bias={60000: 1.0}))
    with pytest.raises(ValueError, match="allowed_token_ids"):
        llm.generate([[1, 5]], SamplingParams(allowed_token_ids=[3, 60000]))


def test_guided_decoding_needs_a_tokenizer_json(tmp_path):
    from tests.tiny_models import make_tiny_model

    bare = LLM(str(make_tiny_model("llama")), num_kv_blocks=16, block_size=8)
    with pytest.raises(ValueError, match="tokenizer.json"):
        bare.generate([[1, 5]], SamplingParams(guided_decoding=GuidedDecoding.regex("a+")))


def test_a_migrated_guided_request_resumes_inside_its_grammar(llm, model_dir):
    """Resumed with the tokens another decode node already produced, the matcher replays them."""
    prompt = [1, 90, 91, 92]
    params = SamplingParams(
        temperature=0.0, max_tokens=30, guided_decoding=GuidedDecoding.json_schema(PERSON)
    )
    whole = llm.generate([prompt], params)[0].outputs[0].token_ids
    assert len(whole) > 6
    engine = LLMEngine(EngineConfig(model=str(model_dir), num_kv_blocks=16, block_size=8))
    engine.add_request("m", prompt, params, resume_output_ids=tuple(whole[:5]))
    outs = []
    while engine.has_work():
        outs += engine.step().outputs
    assert outs[-1].outputs[0].token_ids == whole  # the resumed tokens, then what this engine added


def test_warm_up_builds_the_grammar_tokenizer_once_ahead_of_the_first_guided_request(model_dir, tmp_path):
    from pdserve.engine.sampling.logits_rules import LogitsRules

    rules = LogitsRules(str(model_dir), 49152, (EOS,))
    assert rules._compiler is None  # built lazily: an engine that never sees a grammar skips it
    rules.warm_up_in_background().join(60)
    built = rules._compiler
    assert built is not None and rules.compiler is built
    matcher = built.matcher(GuidedDecoding.choice(("yes", "no")))
    assert not matcher.is_error()
    # A folder without tokenizer.json: nothing to warm up, and no error until a request needs it.
    bare = LogitsRules(str(tmp_path), 49152, (EOS,))
    bare.warm_up()
    with pytest.raises(ValueError, match="tokenizer.json"):
        bare.compiler  # noqa: B018
