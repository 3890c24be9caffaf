"""The router's configuration: one frozen dataclass, validated on construction.

Every field maps one to one onto a ``pdserve router`` flag (see pdserve_cli/router_cmd.py).
"""

from __future__ import annotations

import dataclasses

# A decode node prefills a long prompt itself when it would wait this much longer behind the
# shortest prefill queue than behind the decode node's own (router/policy.py). Half a second of
# queueing: measured against off, 0.25 s and 1 s on two cores (bench/README.md, "Prefill on the
# decode node when the prefill pool is backed up").
LOCAL_PREFILL_MARGIN_S = 0.5


@dataclasses.dataclass(frozen=True, slots=True)
class RouterConfig:
    model: str  # local Hugging Face folder: tokenizer, chat template, config.json
    served_model_name: str | None = None  # name in /v1/models and the "model" field; default: folder name
    host: str = "127.0.0.1"  # HTTP bind address (loopback unless asked otherwise)
    port: int = 8000  # HTTP port
    redis_url: str | None = None  # node registry in Redis; None: the static lists below
    prefill_addrs: tuple[str, ...] = ()  # static mode: prefill nodes' control addresses
    decode_addrs: tuple[str, ...] = ()  # static mode: decode nodes' control addresses
    reply_port: int = 0  # ZeroMQ PULL port nodes push tokens to, bound on ``host``; 0: a free port
    advertise_host: str | None = None  # the host nodes reach the reply port at; None: ``host``, or this
    #                                    machine's hostname when ``host`` is every interface
    api_key: str | None = None  # when set, every /v1 request needs "Authorization: Bearer <key>"
    disagg_threshold: int = 64  # prompts with fewer uncached tokens prefill on the decode node
    local_prefill_margin_s: float = LOCAL_PREFILL_MARGIN_S  # < 0: long prompts always go to a prefill node
    prefix_routing: bool = True  # route by the prefixes nodes cache; False: by load alone
    max_inflight_prefill: int = 256  # sub-requests in their prefill stage; beyond: 429
    max_inflight_decode: int = 1024  # sub-requests in flight in all; beyond: 429
    max_n: int = 16  # largest n (samples per prompt) one request may ask for
    chunk_timeout_s: float = 60.0  # no chunk for this long: abort the request (retry before any token)
    request_ttl_s: float = 600.0  # nodes drop a request this long after receipt
    max_attempts: int = 3  # tries of a sample in all (retries before tokens, replays of non-streamed ones)
    migrate: bool = True  # a sample whose decode node dies mid-output resumes on another node
    max_migrations: int = 2  # migrations per sample, on top of max_attempts
    poll_interval_s: float = 0.5  # registry refresh period (Redis scan or StatusQuery round)
    node_expiry_s: float = 3.0  # a node not heard from for this long is dropped
    max_body_bytes: int = 8 << 20  # larger request bodies get 413

    def __post_init__(self) -> None:
        if self.redis_url is None and not self.decode_addrs:
            raise ValueError("give --redis URL or at least one --decode ADDR")
        if self.redis_url is not None and (self.prefill_addrs or self.decode_addrs):
            raise ValueError("--redis and static --prefill/--decode lists are exclusive")
        for name in ("disagg_threshold", "max_body_bytes", "max_migrations"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        for name in ("max_inflight_prefill", "max_inflight_decode", "max_n", "max_attempts"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        for name in ("chunk_timeout_s", "request_ttl_s", "poll_interval_s", "node_expiry_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0")
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be in 1..65535, got {self.port}")
        if not 0 <= self.reply_port < 65536:
            raise ValueError(f"reply_port must be in 0..65535, got {self.reply_port}")
