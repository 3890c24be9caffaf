"""The `pdserve` command line: real subprocesses for parsing and `model fetch`; generate in-process."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.engine.model_fetch import COMPLETE_MARKER, CONVERTER_VERSION, DEFAULT_MODEL_NAME

REPO_ROOT = Path(__file__).resolve().parent.parent
_SCRIPT = Path(sys.executable).parent / "pdserve"
# The installed console script when this venv has one (make test installs it), else the module.
PDSERVE = [str(_SCRIPT)] if _SCRIPT.exists() else [sys.executable, "-m", "pdserve"]


def pdserve(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*PDSERVE, *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)


@pytest.mark.usefixtures("processes")
def test_help_lists_the_subcommands():
    result = pdserve("--help")
    assert result.returncode == 0
    assert "model" in result.stdout and "generate" in result.stdout


@pytest.mark.usefixtures("processes")
def test_unknown_subcommand_exits_2_with_a_message():
    result = pdserve("frobnicate")
    assert result.returncode == 2
    assert "invalid choice: 'frobnicate'" in result.stderr


@pytest.mark.usefixtures("processes")
def test_model_fetch_prints_the_folder_as_last_line(shipped_default_model: Path):
    result = pdserve("model", "fetch")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == str(shipped_default_model)


@pytest.mark.usefixtures("processes")
def test_model_fetch_honours_cache_dir(tmp_path: Path):
    # A folder already marked complete is returned as is: this checks the flag, not the conversion.
    model_dir = tmp_path / "models" / DEFAULT_MODEL_NAME
    model_dir.mkdir(parents=True)
    (model_dir / COMPLETE_MARKER).write_text(json.dumps({"converter_version": CONVERTER_VERSION}))
    result = pdserve("model", "fetch", "--cache-dir", str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == str(model_dir)


def _require_engine_llm() -> None:
    engine = pytest.importorskip("pdserve.engine")
    if not hasattr(engine, "LLM"):
        pytest.skip("engine.LLM is not available yet")


def test_chat_prompt_ids_apply_the_models_template(default_model_dir: Path):
    from transformers import AutoTokenizer

    from pdserve.cli.generate import chat_prompt_ids

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    ids = chat_prompt_ids(tokenizer, "Hi")
    assert ids[:1] == [1]  # the template's own <|im_start|>, with no BOS added in front
    assert tokenizer.decode(ids).endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_generate_prints_the_greedy_completion_of_hf(default_model_dir: Path, capsys):
    _require_engine_llm()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pdserve.cli.main import main

    prompt, max_tokens = "The capital of France is", 8
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    hf = AutoModelForCausalLM.from_pretrained(default_model_dir).eval()
    input_ids = torch.tensor([tokenizer.encode(prompt)])  # [1, S]
    with torch.no_grad():
        out = hf.generate(input_ids, max_new_tokens=max_tokens, do_sample=False)  # [1, S + max_tokens]
    expected = tokenizer.decode(out[0, input_ids.shape[1] :], skip_special_tokens=True)

    args = [
        "generate",
        "--model",
        str(default_model_dir),
        "--prompt",
        prompt,
        "--max-tokens",
        str(max_tokens),
    ]
    assert main(args) == 0
    assert capsys.readouterr().out == expected + "\n"
