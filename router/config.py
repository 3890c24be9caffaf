"""The router's configuration: one frozen dataclass, validated on construction.

Every field declared with ``setting`` is a ``pdserve router`` flag (protocol/settings.py,
pdserve/cli/router_cmd.py) and a PDSERVE_* variable of the router's container (launcher/env_flags.py).
"""

from __future__ import annotations

import dataclasses

from pdserve.protocol.addresses import is_loopback, key_needed
from pdserve.protocol.sampling_params import MAX_LOGPROBS
from pdserve.protocol.settings import (
    cluster_key_file_setting,
    otlp_traces_endpoint_setting,
    redis_password_file_setting,
    setting,
)

# A decode node prefills a long prompt itself when it would wait this much longer behind the
# shortest prefill queue than behind the decode node's own (router/policy.py). Half a second of
# queueing: measured against off, 0.25 s and 1 s on two cores (bench/notes/serving.md, "Under load:
# 48 requests a rate, three rounds", the margin).
LOCAL_PREFILL_MARGIN_S = 0.5


# Integer flags -> the least value each takes (RouterConfig.__post_init__)
_LEAST = {
    "disagg_threshold": 0,
    "max_body_bytes": 0,
    "max_migrations": 0,
    "responses_store_size": 0,
    "max_logprobs": -1,  # vLLM's -1: the whole vocabulary
    "max_inflight_prefill": 1,
    "max_inflight_decode": 1,
    "max_n": 1,
    "max_attempts": 1,
    "max_logprob_entries": 1,
}
# Durations that must be > 0
_POSITIVE = (
    "chunk_timeout_s",
    "request_ttl_s",
    "reroute_wait_s",
    "poll_interval_s",
    "node_expiry_s",
    "max_record_skew_s",
    "responses_store_ttl_s",
)


@dataclasses.dataclass(frozen=True, slots=True)
class RouterConfig:
    # local Hugging Face folder: tokenizer, chat template, config.json
    model: str = setting(help="Hugging Face model folder (tokenizer, chat template)")
    # the name in /v1/models and the "model" field
    served_model_name: str | None = setting(None, "model name clients use (default: folder name)")
    host: str = setting("127.0.0.1", "HTTP bind address (default: loopback)")
    port: int = setting(8000, "HTTP port")
    # None: the static lists below. Parsed as args.redis_url, the field's name, as it always was.
    redis_url: str | None = setting(
        None, "node registry, e.g. redis://127.0.0.1:6379/0", flag="--redis", dest="redis_url", metavar="URL"
    )
    decode_addrs: tuple[str, ...] = setting(
        (), "static mode: decode nodes' control addresses", flag="--decode", metavar="ADDR"
    )
    prefill_addrs: tuple[str, ...] = setting(
        (), "static mode: prefill nodes' control addresses", flag="--prefill", metavar="ADDR"
    )
    # a ZeroMQ PULL socket
    reply_port: int = setting(0, "ZeroMQ port nodes push tokens to, bound on --host (default: a free port)")
    advertise_host: str | None = setting(
        None,
        "host the nodes reach the reply port at "
        "(default: --host, or this machine's hostname when --host is 0.0.0.0)",
    )
    api_key: str | None = setting(None, "require 'Authorization: Bearer KEY' on /v1, /tokenize and /admin")
    metrics_auth: bool = setting(
        False, "require --api-key on /metrics too (open by default, as Prometheus scrapers expect)"
    )
    redis_password_file: str | None = redis_password_file_setting()
    cluster_key_file: str | None = cluster_key_file_setting()
    disagg_threshold: int = setting(
        64, "prompts with fewer uncached tokens prefill on the decode node (default: %(default)s)"
    )
    local_prefill_margin_s: float = setting(
        LOCAL_PREFILL_MARGIN_S,
        "a decode node prefills a long prompt itself when it would wait this many seconds longer "
        "behind the prefill pool than behind its own queue; < 0: never (default: %(default)s)",
    )
    prefix_routing: bool = setting(True, "route by load alone, ignoring which node caches a prompt's prefix")
    lora_modules: tuple[str, ...] = setting(
        (),
        "LoRA adapters clients may name in 'model', as NAME=PEFT_FOLDER (a folder the nodes reach); "
        "more with POST /v1/load_lora_adapter",
        metavar="NAME=DIR",
    )
    ttft_slo_s: float | None = setting(
        None,
        "shed (429, Retry-After) a request whose predicted time to first token, its node's prompt "
        "queue at that node's measured prefill speed, passes this many seconds (default: none; "
        "then those predicted past --chunk-timeout-s are shed, which would time out anyway)",
    )
    tpot_slo_s: float | None = setting(
        None,
        "a decode node with requests running prefills a long prompt itself (--local-prefill-margin-s) "
        "only when its step-time target keeps their time per token within this many seconds "
        "(default: none, and then only an idle decode node prefills for a backed-up prefill pool)",
    )
    max_inflight_prefill: int = setting(
        256, "sub-requests in their prefill stage; beyond: 429 (default: %(default)s)"
    )
    max_inflight_decode: int = setting(
        1024, "sub-requests in flight in all; beyond: 429 (default: %(default)s)"
    )
    max_n: int = setting(16, "largest n (samples per prompt) one request may ask for (default: %(default)s)")
    max_logprobs: int = setting(
        MAX_LOGPROBS,
        "most log-probabilities a request may ask for per position (logprobs, top_logprobs, "
        "prompt_logprobs), as vLLM's flag: -1 asks for the whole vocabulary and counts as its size; "
        "-1 here allows it (default: %(default)s)",
    )
    max_logprob_entries: int = setting(
        1 << 20,
        "log-probabilities one response may carry when a count past 20 is asked for (count x "
        "positions x samples); each costs the router about 1 KB of memory and 10-20 us of its "
        "event loop while the response is built (default: %(default)s)",
    )
    chunk_timeout_s: float = setting(
        60.0,
        "seconds without a chunk after which a request is aborted, and retried when no token was "
        "sent yet (default: %(default)s)",
    )
    request_ttl_s: float = setting(
        600.0, "nodes drop a request this many seconds after receipt (default: %(default)s)"
    )
    max_attempts: int = setting(
        3,
        "tries of a sample in all: retries before any token, replays of non-streamed ones "
        "(default: %(default)s)",
    )
    migrate: bool = setting(
        True,
        "a stream whose decode node dies mid-output ends with an error event instead of "
        "resuming on another node",
        flag="--no-migration",
    )
    max_migrations: int = setting(
        2, "resumptions of a sample on another decode node, on top of --max-attempts (default: %(default)s)"
    )
    reroute_wait_s: float = setting(
        5.0,
        "seconds a sample whose node failed or left waits for a usable node before its 503 (a "
        "record that lapsed for a moment, a restart) (default: %(default)s)",
    )
    poll_interval_s: float = setting(
        0.5, "seconds between registry refreshes (Redis scan or StatusQuery round) (default: %(default)s)"
    )
    node_expiry_s: float = setting(
        3.0, "seconds after which a node not heard from is dropped (default: %(default)s)"
    )
    max_record_skew_s: float = setting(
        60.0,
        "under a cluster key: a node first seen with a heartbeat this many seconds older than the "
        "router's clock is refused as a replay (the clock skew allowed between machines) "
        "(default: %(default)s)",
    )
    responses_store_size: int = setting(
        1024,
        "Responses API: responses kept for GET /v1/responses/{id} and previous_response_id, least "
        "recently used out first; 0: none (default: %(default)s)",
    )
    responses_store_ttl_s: float = setting(
        3600.0,
        "Responses API: seconds a stored response is kept after it was last stored or used "
        "(default: %(default)s)",
    )
    otlp_traces_endpoint: str | None = otlp_traces_endpoint_setting()  # protocol/tracing.py
    max_body_bytes: int = 8 << 20  # larger request bodies get 413; no flag
    log_level: str = setting("info", "the router's log level", choices=("debug", "info", "warning", "error"))

    def __post_init__(self) -> None:
        if self.redis_url is None and not self.decode_addrs:
            raise ValueError("give --redis URL or at least one --decode ADDR")
        if self.redis_url is not None and (self.prefill_addrs or self.decode_addrs):
            raise ValueError("--redis and static --prefill/--decode lists are exclusive")
        if not self.cluster_key_file and not is_loopback(self.host):
            raise ValueError(key_needed("the router", self.host))
        if self.metrics_auth and self.api_key is None:
            raise ValueError("--metrics-auth needs --api-key (the key /metrics would require)")
        for name, least in _LEAST.items():
            if getattr(self, name) < least:
                raise ValueError(f"{name} must be >= {least}")
        for name in ("ttft_slo_s", "tpot_slo_s"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0")
        for name in _POSITIVE:
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0")
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be in 1..65535, got {self.port}")
        if not 0 <= self.reply_port < 65536:
            raise ValueError(f"reply_port must be in 0..65535, got {self.reply_port}")
