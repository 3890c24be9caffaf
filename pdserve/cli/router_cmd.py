"""`pdserve router ...`: the OpenAI-compatible HTTP front end over prefill and decode nodes."""

from __future__ import annotations

import argparse

from pdserve.protocol.settings import flags, from_args
from pdserve.router.config import RouterConfig  # a plain dataclass module: cheap to import, no torch

NODE_SOURCES = ("--redis", "--decode")  # where the router finds decode nodes: exactly one of them


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "router",
        help="serve the OpenAI API over a cluster of nodes",
        description="Serve /v1/completions and /v1/chat/completions, routing each request to a "
        "prefill and a decode node found in Redis (--redis) or given as static lists.",
    )
    sources = parser.add_mutually_exclusive_group(required=True)
    for flag in flags(RouterConfig):  # the flags and their defaults come from RouterConfig: one source
        flag.add_to(sources if flag.name in NODE_SOURCES else parser)
    parser.set_defaults(run=run_router)


def run_router(args: argparse.Namespace) -> int:
    import logging

    import uvicorn

    try:
        config = from_args(RouterConfig, args)
    except ValueError as exc:
        raise SystemExit(f"pdserve router: {exc}") from None
    # The router's own warnings (retries, expired nodes, lost connections) with a wall-clock stamp.
    logging.basicConfig(
        level=config.log_level.upper(), format="%(created).3f %(levelname)s %(name)s: %(message)s"
    )

    from pdserve.router.app import create_app

    uvicorn.run(create_app(config), host=config.host, port=config.port, log_level=config.log_level)
    return 0
