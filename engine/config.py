"""Engine configuration: the model's shape (read from config.json) and the engine's knobs."""

from __future__ import annotations

import dataclasses
import json
import pathlib

SUPPORTED_DTYPES = ("float32", "float16", "bfloat16")


@dataclasses.dataclass(frozen=True, slots=True)
class ModelConfig:
    """What the engine needs from a Hugging Face config.json of a Llama-family model."""

    path: str  # model folder
    architecture: str  # config.json "architectures"[0]
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int  # query heads
    num_kv_heads: int  # key/value heads (GQA)
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None  # {"rope_type": "llama3" | "linear", ...} or None for plain RoPE
    max_position_embeddings: int
    tie_word_embeddings: bool  # lm_head shares the embedding matrix
    qkv_bias: bool  # Qwen2 (and Llama with attention_bias) add a bias to q, k, v
    sliding_window: int | None  # Mistral: attend to at most this many most recent tokens
    eos_token_ids: tuple[int, ...]  # tokens that end generation
    bos_token_id: int | None

    @classmethod
    def from_dict(cls, path: str, cfg: dict) -> ModelConfig:
        arch = (cfg.get("architectures") or [""])[0]
        num_heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // num_heads
        rope = dict(cfg.get("rope_parameters") or {})  # transformers >= 5 layout
        legacy = cfg.get("rope_scaling") or {}
        rope = {**legacy, **rope}
        rope_theta = float(rope.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        window = cfg.get("sliding_window")
        if arch == "Qwen2ForCausalLM" and not cfg.get("use_sliding_window", False):
            window = None
        return cls(
            path=path, architecture=arch, vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"], num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads, num_kv_heads=cfg.get("num_key_value_heads") or num_heads, head_dim=head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6), rope_theta=rope_theta,
            rope_scaling=None if rope_type == "default" else {**rope, "rope_type": rope_type},
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            qkv_bias=arch == "Qwen2ForCausalLM" or cfg.get("attention_bias", False),
            sliding_window=window, eos_token_ids=eos_ids, bos_token_id=cfg.get("bos_token_id"),
        )

    @classmethod
    def from_path(cls, path: str | pathlib.Path) -> ModelConfig:
        config_file = pathlib.Path(path) / "config.json"
        if not config_file.is_file():
            raise ValueError(f"model: no config.json in {path!s}; pass a Hugging Face model folder")
        return cls.from_dict(str(path), json.loads(config_file.read_text()))


@dataclasses.dataclass(frozen=True, slots=True)
class EngineConfig:
    """Engine knobs; each maps one to one onto a CLI flag of the node commands."""

    model: str  # Hugging Face model folder
    dtype: str = "float32"  # weights, activations and KV cache
    block_size: int = 16  # tokens per KV block
    kv_cache_memory_mb: int = 512  # KV pool budget; ignored when num_kv_blocks is given
    num_kv_blocks: int | None = None  # exact pool size (tests use tiny pools)
    max_num_batched_tokens: int = 2048  # token budget of one forward pass
    max_num_seqs: int = 64  # sequences in one forward pass
    max_model_len: int | None = None  # context limit; defaults to the model's
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True  # split long prompts over several iterations
    max_waiting: int = 4096  # bound on queued requests; add_request raises past it
    num_threads: int | None = None  # torch intra-op threads; None leaves torch's default

    def __post_init__(self) -> None:
        if self.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"dtype must be one of {SUPPORTED_DTYPES}, got {self.dtype!r}")
        for name in ("block_size", "kv_cache_memory_mb", "max_num_batched_tokens", "max_num_seqs", "max_waiting"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_kv_blocks is not None and self.num_kv_blocks <= 0:
            raise ValueError(f"num_kv_blocks must be positive, got {self.num_kv_blocks}")
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ValueError(f"max_model_len must be positive, got {self.max_model_len}")
        if not self.enable_chunked_prefill and self.max_model_len is not None \
                and self.max_model_len > self.max_num_batched_tokens:
            raise ValueError("max_num_batched_tokens must cover max_model_len without chunked prefill")
