"""Engine configuration: the model's shape (read from config.json) and the engine's knobs."""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import TYPE_CHECKING

from pdserve.engine.machine.device import check_device_name
from pdserve.protocol.settings import setting

# transformers loads where a config.json is read (ModelConfig.from_dict): what reads only
# EngineConfig's settings, such as the container entrypoint (launcher/env_flags.py), needs none of it.
if TYPE_CHECKING:
    import transformers

SUPPORTED_DTYPES = ("float32", "float16", "bfloat16")
# config.json's key for a checkpoint dequantized from a quantized file, e.g. "GGUF Q4_1": its
# weights are float32 on disk but carry no more precision than the quantized file did
DEQUANTIZED_FROM_KEY = "pdserve_dequantized_from"
KV_COMMIT_CHOICES = ("lazy", "idle", "startup")
DTYPE_CHOICES = ("auto", *SUPPORTED_DTYPES)  # auto: engine/machine/device.py explain_dtype
ATTENTION_BACKENDS = ("auto", "triton", "torch")
KV_CACHE_DTYPE_CHOICES = ("auto", "int8")
QUANTIZATION_CHOICES = ("int8",)  # kernels/cpu_int8.py; None: the weights in --dtype


@dataclasses.dataclass(frozen=True, slots=True)
class ModelConfig:
    """What the engine needs from a Hugging Face config.json, whatever the family.

    ``hf`` is the family's own transformers config built from the file, so a key that a
    checkpoint leaves out takes the same default here as in transformers; the model files read
    their family's knobs from it (and never write to it).
    """

    path: str  # model folder
    architecture: str  # config.json "architectures"[0]
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int  # query heads
    num_kv_heads: int  # key/value heads (GQA)
    head_dim: int  # channels per head (Gemma, Mistral: not hidden_size / num_heads)
    max_position_embeddings: int
    tie_word_embeddings: bool  # lm_head shares the embedding matrix
    eos_token_ids: tuple[int, ...]  # tokens that end generation
    bos_token_id: int | None
    hf: transformers.PreTrainedConfig  # the whole config, family defaults filled in
    # what the weights were published in: "float32", "bfloat16", "float16", or "GGUF Q4_1" and the
    # like for a checkpoint dequantized from a quantized file (engine/model_fetch.py); --dtype auto
    # follows it on the CPU (engine/machine/device.py)
    checkpoint_dtype: str = "float32"
    # a checkpoint stored quantized that the engine computes as such: "int8" for compressed-tensors
    # W8A8 (int8 weights per channel, dynamic int8 activations per token; engine/weights.py reads
    # them, kernels/cpu_int8.py runs them); None: the weights are floats
    checkpoint_quantization: str | None = None

    @classmethod
    def from_dict(cls, path: str, cfg: dict) -> ModelConfig:
        import transformers

        arch = (cfg.get("architectures") or [""])[0]
        if "model_type" not in cfg:
            raise ValueError(f"model: config.json in {path} has no model_type")
        try:
            hf = transformers.AutoConfig.for_model(**cfg)
        except (ValueError, KeyError) as e:
            raise ValueError(
                f"model: config.json in {path} has model_type {cfg['model_type']!r}, which "
                f"transformers {transformers.__version__} does not know ({e})"
            ) from None
        num_heads = hf.num_attention_heads
        eos = hf.eos_token_id
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return cls(
            path=path,
            architecture=arch,
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            num_layers=hf.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or num_heads,
            head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // num_heads,
            max_position_embeddings=hf.max_position_embeddings,
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            eos_token_ids=eos_ids,
            bos_token_id=hf.bos_token_id,
            hf=hf,
            checkpoint_dtype=checkpoint_dtype_of(cfg),
            checkpoint_quantization=checkpoint_quantization_of(path, cfg),
        )

    @classmethod
    def from_path(cls, path: str | pathlib.Path) -> ModelConfig:
        config_file = pathlib.Path(path) / "config.json"
        if not config_file.is_file():
            raise ValueError(f"model: no config.json in {path!s}; pass a Hugging Face model folder")
        return cls.from_dict(str(path), json.loads(config_file.read_text()))

    def rope_parameters(self) -> dict:
        """rope_theta, rope_type and the variant's keys (transformers' normalised form)."""
        return dict(self.hf.rope_parameters)

    def sliding_window(self, layer: int) -> int | None:
        """Layer ``layer``'s attention window: per ``layer_types`` where the config has them."""
        window = getattr(self.hf, "sliding_window", None) or None
        layer_types = getattr(self.hf, "layer_types", None)
        if layer_types is not None and layer_types[layer] != "sliding_attention":
            return None
        return window


def checkpoint_dtype_of(cfg: dict) -> str:
    """The precision a config.json says its weights carry (``ModelConfig.checkpoint_dtype``)."""
    if cfg.get(DEQUANTIZED_FROM_KEY):
        return str(cfg[DEQUANTIZED_FROM_KEY])
    dtype = cfg.get("dtype") or cfg.get("torch_dtype")
    return dtype if dtype in ("bfloat16", "float16") else "float32"


def checkpoint_quantization_of(path: str, cfg: dict) -> str | None:
    """ "int8" for a compressed-tensors W8A8 checkpoint (llm-compressor's W8A8 preset: int8 weights,
    symmetric, a scale per output channel; int8 activations, symmetric, per token, dynamic), as
    vLLM loads it; None without a quantization_config; ValueError naming what else it holds."""
    qc = cfg.get("quantization_config")
    if not qc:
        return None
    method = qc.get("quant_method")
    if method != "compressed-tensors":
        raise ValueError(
            f"model: {path} is quantized with {method!r}; pdserve reads float checkpoints and "
            "compressed-tensors W8A8 ones (or quantizes at load with --quantization int8)"
        )
    groups = list((qc.get("config_groups") or {}).values())
    want_weights = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}
    want_inputs = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True}
    for group in groups:
        weights, inputs = group.get("weights") or {}, group.get("input_activations") or {}
        for what, got, want in (
            ("weights", weights, want_weights),
            ("input_activations", inputs, want_inputs),
        ):
            off = {k: got.get(k) for k, v in want.items() if got.get(k) != v}
            if off:
                raise ValueError(
                    f"model: {path}'s compressed-tensors {what} have {off}; pdserve reads the W8A8 "
                    f"scheme only ({what}: {want})"
                )
    if not groups or qc.get("format") not in ("int-quantized", "naive-quantized"):
        raise ValueError(
            f"model: {path}'s compressed-tensors format is {qc.get('format')!r} with {len(groups)} "
            "config groups; pdserve reads int-quantized W8A8 checkpoints"
        )
    return "int8"


@dataclasses.dataclass(frozen=True, slots=True)
class EngineConfig:
    """Engine knobs; each one with a ``setting`` is a flag of the node commands (node/options.py)."""

    model: str = setting(help="Hugging Face model folder")
    dtype: str = setting(
        "auto",
        "weights, activations and KV cache; auto: bfloat16 on CUDA; on the CPU the checkpoint's "
        "dtype where the CPU computes it (a bfloat16, float16 or quantized checkpoint runs in "
        "bfloat16 on CPUs with AVX512-BF16 or AMX), float32 elsewhere",
        choices=DTYPE_CHOICES,
    )
    device: str = setting("auto", "auto, cpu, cuda or cuda:N (default: auto)")  # engine.device
    tensor_parallel_size: int = setting(  # engine.executor
        1,
        "ranks the model is split over (its heads, MLP and vocabulary): this process and N-1 worker "
        "processes, on the CPU one thread each by default, on CUDA one device each from --device's",
    )
    collective_timeout_s: float = setting(  # engine.executor
        120.0,
        "with --tensor-parallel-size above 1: the longest a collective between the ranks may wait "
        "(a hung or stopped rank); past it the node stops, as for a lost rank",
        flag="--collective-timeout-seconds",
    )
    block_size: int = setting(16, "tokens per KV block")
    kv_cache_dtype: str = setting(  # kernels/kv_int8.py
        "auto",
        "auto: the KV cache in --dtype; int8: each (token, head) row as int8 with its own fp32 "
        "scale, about a quarter of fp32's memory and DRAM traffic (CPU only; small accuracy cost, "
        "bench/notes/kv-int8.md)",
        choices=KV_CACHE_DTYPE_CHOICES,
    )
    quantization: str | None = setting(  # kernels/cpu_int8.py
        None,
        "int8: W8A8 linear layers, each output channel's weights int8 as they load (no "
        "calibration) and each token's activations int8 as they arrive, int32 sums in oneDNN's "
        "int8 matmul; embeddings, LM head, norms and attention stay in --dtype (CPU only; "
        "accuracy in bench/README.md)",
        choices=QUANTIZATION_CHOICES,
    )
    kv_cache_memory_mb: int | None = setting(
        None, "KV pool budget in MiB (default: a share of available memory, --kv-cache-memory-fraction)"
    )
    kv_cache_memory_fraction: float = setting(
        0.25,
        "share of available memory the KV pool takes when neither --kv-cache-memory-mb nor "
        "--num-kv-blocks is given",
    )
    num_kv_blocks: int | None = setting(None, "exact KV pool size in blocks (tests use tiny pools)")
    max_num_batched_tokens: int = setting(2048, "token budget of one forward pass")
    max_step_s: float | None = setting(  # engine.step_budget
        None,
        "step-time target: each step's token budget shrinks so that a step takes about this long "
        "at the measured speed (prefill chunks get smaller on a slow or loaded machine); default: "
        "the full budget's time at the speed of the first prefill steps, at most 1 s",
        flag="--max-step-seconds",
    )
    max_decode_step_s: float | None = setting(  # engine.step_budget
        None,
        "step-time target of the steps that carry running decodes beside prompt chunks: those "
        "chunks shrink so that such a step takes about this long, which bounds a running request's "
        "time per token while prompts are prefilled beside it (set it within the TPOT SLO; "
        "`pdserve up --tpot-slo-s` does); default: the step-time target",
        flag="--max-decode-step-seconds",
    )
    max_num_seqs: int = setting(64, "sequences in one forward pass")
    max_model_len: int | None = setting(None, "context limit in tokens (default: the model's)")
    enable_prefix_caching: bool = setting(
        True, "recompute every prompt instead of reusing cached prefix blocks", flag="--no-prefix-caching"
    )
    # No flag: a node always chunks long prompts; the offline LLM API may turn it off.
    enable_chunked_prefill: bool = True  # split long prompts over several iterations
    max_waiting: int = setting(1024, "bound on queued requests; add_request raises past it")
    num_threads: int | None = setting(
        None, "torch threads for this process (default: the CPUs it may use)", flag="--threads"
    )
    max_threads: int | None = setting(  # engine.cpu_share
        None,
        "without --threads: at most this many torch threads (a launcher's share of the cores), "
        "fewer while other processes load the CPUs",
    )
    # lazy: the pool's pages are committed just ahead of the blocks handed out (engine.kv_prefault);
    # idle: that, and the rest of the pool while the node has nothing to do (a node's loop says
    # when), at idle CPU priority and while memory allows; startup: all of it before the engine
    # serves, as vLLM does (steady latency from the first request, and a pool that cannot fit
    # fails at start, not mid-run)
    kv_commit: str = setting(
        "idle",
        "lazy: commit the KV pool's memory as blocks are first used; idle: that, and the rest "
        "while the node is idle; startup: all of it before serving",
        choices=KV_COMMIT_CHOICES,
    )
    # engine/offload/: KV blocks kept beyond the pool, by content hash, across restarts
    kv_offload_dir: str | None = setting(
        None,
        "keep full KV blocks in this folder too (a subfolder per model and KV format; one node "
        "each): a prefix evicted from the pool, preempted, or from before a restart is loaded "
        "from it rather than recomputed",
    )
    kv_offload_disk_mb: int = setting(
        8192, "with --kv-offload-dir: the folder's budget in MiB (least recently used blocks go past it)"
    )
    kv_offload_host_mb: int | None = setting(
        None,
        "a host-memory tier of this many MiB in front of a device KV pool (pinned memory; its "
        "evictions go on to --kv-offload-dir where given); refused on a CPU node, whose pool is "
        "host memory already",
    )
    debug_checks: bool = setting(False, "check the block pool's integrity before every step (slow)")
    # triton on CPU tensors runs Triton's interpreter: slow, but how CPU CI runs the GPU code
    attention_backend: str = setting(
        "auto",
        "auto: Triton on CUDA, the CPU kernels on CPU; triton on CPU runs Triton's interpreter; "
        "torch: the pure-torch kernels",
        choices=ATTENTION_BACKENDS,
    )
    # Weights, activations and KV pool together; a CPU pool is sized from host RAM instead.
    gpu_memory_utilization: float = setting(
        0.9,
        "CUDA: share of the GPU's memory this node holds; the KV pool gets what weights and the "
        "profile run leave of it",
    )
    enforce_eager: bool = setting(False, "CUDA: no CUDA graphs for decode-only steps")
    # engine.speculation: the decodes' draft tokens, verified in the step's one forward pass
    speculative: str | None = setting(
        None,
        "speculative decoding: ngram proposes the tokens that followed the last occurrence of the "
        "sequence's last tokens in its prompt or output (exact: output is what it would be without)",
        choices=("ngram",),
    )
    # engine.draft_model: a smaller model of the same tokenizer proposes, in a KV pool of its own
    speculative_model: str | None = setting(
        None,
        "speculative decoding with a draft model: a Hugging Face folder of a smaller model with "
        "this model's tokenizer, whose greedy tokens are verified (exact, as with ngram)",
        metavar="DIR",
    )
    num_speculative_tokens: int = setting(
        4,
        "with --speculative or --speculative-model: most draft tokens per sequence and step "
        "(fewer as acceptance falls)",
    )
    # Multi-LoRA (engine/lora), with vLLM's flags and meanings.
    enable_lora: bool = setting(  # serve LoRA adapters (SamplingParams.adapter) beside the base model
        False, "serve LoRA adapters (PEFT folders) beside the base model", flag="--enable-lora"
    )
    max_loras: int = setting(1, "adapter slots in memory: the most distinct adapters one step runs")
    max_lora_rank: int = setting(16, "the largest adapter rank r served (every slot is padded to it)")
    # the adapters read at start, each NAME=PEFT_FOLDER (the offline API takes (name, folder)
    # pairs too); more come with load_adapter. ``lora_module_paths`` has them as pairs.
    lora_modules: tuple[str, ...] = setting(
        (), "adapters read at start, as NAME=PEFT_FOLDER", flag="--lora-modules", metavar="NAME=DIR"
    )

    @property
    def lora_module_paths(self) -> tuple[tuple[str, str], ...]:
        """``lora_modules`` as (name, PEFT folder) pairs."""
        return tuple(_lora_module(m) for m in self.lora_modules)

    @property
    def speculative_method(self) -> str | None:
        """How drafts are proposed: ngram, draft (a draft model), or None (no speculation). A
        config may name both (every flag set at once is a valid config); the engine refuses it."""
        return "draft" if self.speculative_model is not None else self.speculative

    @property
    def kv_dtype(self) -> str:
        """The KV cache's dtype (protocol/kv_layout.py): --dtype, or int8."""
        return "int8" if self.kv_cache_dtype == "int8" else self.dtype

    def __post_init__(self) -> None:
        check_device_name(self.device)
        self._check_lora()
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}"
            )
        if self.kv_commit not in KV_COMMIT_CHOICES:
            raise ValueError(f"kv_commit must be one of {KV_COMMIT_CHOICES}, got {self.kv_commit!r}")
        if self.dtype not in DTYPE_CHOICES:
            raise ValueError(f"dtype must be one of {DTYPE_CHOICES}, got {self.dtype!r}")
        if self.quantization not in (None, *QUANTIZATION_CHOICES):
            raise ValueError(
                f"quantization must be one of {QUANTIZATION_CHOICES} or None, got {self.quantization!r}"
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPE_CHOICES:
            raise ValueError(
                f"kv_cache_dtype must be one of {KV_CACHE_DTYPE_CHOICES}, got {self.kv_cache_dtype!r}"
            )
        for name in (
            "block_size",
            "max_num_batched_tokens",
            "max_num_seqs",
            "max_waiting",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.collective_timeout_s <= 0:
            raise ValueError(f"collective_timeout_s must be positive, got {self.collective_timeout_s}")
        if self.tensor_parallel_size <= 0:
            raise ValueError(f"tensor_parallel_size must be positive, got {self.tensor_parallel_size}")
        if self.speculative not in (None, "ngram"):
            raise ValueError(f"speculative must be ngram or None, got {self.speculative!r}")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError(f"num_speculative_tokens must be in [1, 16], got {self.num_speculative_tokens}")
        for name in ("max_step_s", "max_decode_step_s"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        for name in (
            "num_kv_blocks",
            "kv_cache_memory_mb",
            "num_threads",
            "max_threads",
            "kv_offload_disk_mb",
        ):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if not 0 < self.kv_cache_memory_fraction <= 0.9:
            raise ValueError(
                f"kv_cache_memory_fraction must be in (0, 0.9], got {self.kv_cache_memory_fraction}"
            )
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ValueError(f"max_model_len must be positive, got {self.max_model_len}")
        if (
            not self.enable_chunked_prefill
            and self.max_model_len is not None
            and self.max_model_len > self.max_num_batched_tokens
        ):
            raise ValueError("max_num_batched_tokens must cover max_model_len without chunked prefill")

    def _check_lora(self) -> None:
        modules = tuple(_lora_module(m) for m in self.lora_modules)
        object.__setattr__(self, "lora_modules", tuple(f"{name}={path}" for name, path in modules))
        if not self.enable_lora:
            for name, default in (("lora_modules", ()), ("max_loras", 1), ("max_lora_rank", 16)):
                if getattr(self, name) != default:
                    raise ValueError(f"{name} needs enable_lora (LoRA adapters are off)")
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be at least 1, got {self.max_loras}")
        if self.max_lora_rank < 1:
            raise ValueError(f"max_lora_rank must be at least 1, got {self.max_lora_rank}")
        names = [name for name, _ in modules]
        if any(not name for name in names) or len(set(names)) != len(names):
            raise ValueError(f"lora_modules: adapter names must be non-empty and distinct, got {names}")


def _lora_module(module: str | tuple[str, str] | list[str]) -> tuple[str, str]:
    """One lora_modules entry as (name, folder): the flag's NAME=DIR, or a pair."""
    if isinstance(module, str):
        name, sep, path = module.partition("=")
        if not sep:
            raise ValueError(f"lora_modules takes NAME=PEFT_FOLDER, got {module!r}")
        return name, path
    name, path = module
    return str(name), str(path)
