"""`pdserve router ...`: the OpenAI-compatible HTTP front end over prefill and decode nodes."""

from __future__ import annotations

import argparse
import dataclasses

from router.config import RouterConfig  # a plain dataclass module: cheap to import, no torch

# The tuning knobs' flags and defaults come from RouterConfig itself: one source.
TUNABLES = (
    "disagg_threshold",
    "local_prefill_margin_s",
    "max_inflight_prefill",
    "max_inflight_decode",
    "max_n",
    "chunk_timeout_s",
    "request_ttl_s",
    "max_attempts",
    "max_migrations",
    "poll_interval_s",
    "node_expiry_s",
)
DEFAULTS = {f.name: f.default for f in dataclasses.fields(RouterConfig) if f.name in TUNABLES}


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "router",
        help="serve the OpenAI API over a cluster of nodes",
        description="Serve /v1/completions and /v1/chat/completions, routing each request to a "
        "prefill and a decode node found in Redis (--redis) or given as static lists.",
    )
    parser.add_argument("--model", required=True, help="Hugging Face model folder (tokenizer, chat template)")
    parser.add_argument(
        "--served-model-name", default=None, help="model name clients use (default: folder name)"
    )
    parser.add_argument("--host", default="127.0.0.1", help="HTTP bind address (default: loopback)")
    parser.add_argument("--port", type=int, default=8000, help="HTTP port")
    nodes = parser.add_mutually_exclusive_group(required=True)
    nodes.add_argument(
        "--redis", dest="redis_url", metavar="URL", help="node registry, e.g. redis://127.0.0.1:6379/0"
    )
    nodes.add_argument(
        "--decode",
        dest="decode_addrs",
        nargs="+",
        metavar="ADDR",
        help="static mode: decode nodes' control addresses",
    )
    parser.add_argument(
        "--prefill",
        dest="prefill_addrs",
        nargs="+",
        default=[],
        metavar="ADDR",
        help="static mode: prefill nodes' control addresses",
    )
    parser.add_argument(
        "--reply-port",
        type=int,
        default=0,
        help="ZeroMQ port nodes push tokens to, bound on --host (default: a free port)",
    )
    parser.add_argument(
        "--advertise-host",
        default=None,
        help="host the nodes reach the reply port at "
        "(default: --host, or this machine's hostname when --host is 0.0.0.0)",
    )
    parser.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1")
    for name, default in DEFAULTS.items():
        parser.add_argument(
            "--" + name.replace("_", "-"),
            type=type(default),
            default=default,
            help=f"see router.config.RouterConfig.{name} (default: {default})",
        )
    parser.add_argument(
        "--no-prefix-routing",
        dest="prefix_routing",
        action="store_false",
        help="route by load alone, ignoring which node caches a prompt's prefix",
    )
    parser.add_argument(
        "--no-migration",
        dest="migrate",
        action="store_false",
        help="a stream whose decode node dies mid-output ends with an error event instead of "
        "resuming on another node",
    )
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    parser.set_defaults(run=run_router)


def run_router(args: argparse.Namespace) -> int:
    import logging

    import uvicorn

    # The router's own warnings (retries, expired nodes, lost connections) with a wall-clock stamp.
    logging.basicConfig(
        level=args.log_level.upper(), format="%(created).3f %(levelname)s %(name)s: %(message)s"
    )

    from router.app import create_app

    try:
        config = RouterConfig(
            model=args.model,
            served_model_name=args.served_model_name,
            host=args.host,
            port=args.port,
            redis_url=args.redis_url,
            prefill_addrs=tuple(args.prefill_addrs),
            decode_addrs=tuple(args.decode_addrs or ()),
            reply_port=args.reply_port,
            advertise_host=args.advertise_host,
            api_key=args.api_key,
            prefix_routing=args.prefix_routing,
            migrate=args.migrate,
            **{name: getattr(args, name) for name in DEFAULTS},
        )
    except ValueError as exc:
        raise SystemExit(f"pdserve router: {exc}") from None
    uvicorn.run(create_app(config), host=config.host, port=config.port, log_level=args.log_level)
    return 0
