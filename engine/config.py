"""Engine configuration: the model's shape (read from config.json) and the engine's knobs."""

from __future__ import annotations

import dataclasses
import json
import pathlib

import transformers

from engine.device import check_device_name

SUPPORTED_DTYPES = ("float32", "float16", "bfloat16")
KV_COMMIT_CHOICES = ("lazy", "idle", "startup")
DTYPE_CHOICES = ("auto", *SUPPORTED_DTYPES)  # auto: bfloat16 on CUDA, float32 on the CPU
ATTENTION_BACKENDS = ("auto", "triton", "torch")


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

    @classmethod
    def from_dict(cls, path: str, cfg: dict) -> ModelConfig:
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


@dataclasses.dataclass(frozen=True, slots=True)
class EngineConfig:
    """Engine knobs; each maps one to one onto a CLI flag of the node commands."""

    model: str  # Hugging Face model folder
    dtype: str = "auto"  # weights, activations and KV cache; auto follows the device (DTYPE_CHOICES)
    block_size: int = 16  # tokens per KV block
    kv_cache_memory_mb: int | None = None  # KV pool budget; None: a share of available memory
    kv_cache_memory_fraction: float = 0.25  # that share, when neither the budget nor num_kv_blocks is given
    num_kv_blocks: int | None = None  # exact pool size (tests use tiny pools)
    # lazy: the pool's pages are committed just ahead of the blocks handed out (engine.kv_prefault);
    # idle: that, and the rest of the pool while the node has nothing to do (a node's loop says
    # when), at idle CPU priority and while memory allows; startup: all of it before the engine
    # serves, as vLLM does (steady latency from the first request, and a pool that cannot fit
    # fails at start, not mid-run)
    kv_commit: str = "idle"
    max_num_batched_tokens: int = 2048  # token budget of one forward pass
    # Step-time target: each step's token budget shrinks from max_num_batched_tokens so that a
    # step takes about this long at the measured speed (engine.step_budget); None: derived from
    # the first prefill steps (the full budget's time there, at most 1 s)
    max_step_s: float | None = None
    max_num_seqs: int = 64  # sequences in one forward pass
    max_model_len: int | None = None  # context limit; defaults to the model's
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True  # split long prompts over several iterations
    max_waiting: int = 1024  # bound on queued requests; add_request raises past it
    num_threads: int | None = None  # torch intra-op threads; None: the CPUs this process may use
    # With num_threads None: at most this many (a launcher's share of the cores); the count still
    # drops while other processes load this process's CPUs (engine.cpu_share).
    max_threads: int | None = None
    device: str = "auto"  # auto, cpu, cuda or cuda:N (engine.device)
    debug_checks: bool = False  # the full block-pool integrity check before every step (slow)
    # auto: Triton kernels on CUDA tensors, the CPU path on CPU; triton: the Triton kernels always
    # (on CPU tensors through Triton's interpreter: slow, how CPU CI runs the GPU code); torch: the
    # pure-torch kernels
    attention_backend: str = "auto"
    # Share of the GPU's memory this engine may hold, weights, activations and KV pool together
    # (the pool gets what the profile run leaves). CUDA only: a CPU pool is sized from host RAM.
    gpu_memory_utilization: float = 0.9
    enforce_eager: bool = False  # CUDA: no CUDA graphs for decode-only steps

    def __post_init__(self) -> None:
        check_device_name(self.device)
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}"
            )
        if self.kv_commit not in KV_COMMIT_CHOICES:
            raise ValueError(f"kv_commit must be one of {KV_COMMIT_CHOICES}, got {self.kv_commit!r}")
        if self.dtype not in DTYPE_CHOICES:
            raise ValueError(f"dtype must be one of {DTYPE_CHOICES}, got {self.dtype!r}")
        for name in (
            "block_size",
            "max_num_batched_tokens",
            "max_num_seqs",
            "max_waiting",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.max_step_s is not None and self.max_step_s <= 0:
            raise ValueError(f"max_step_s must be positive, got {self.max_step_s}")
        for name in ("num_kv_blocks", "kv_cache_memory_mb", "num_threads", "max_threads"):
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
