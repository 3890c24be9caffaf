"""`make lint`'s type check: mypy over the packages that carry the contracts and the engine.

mypy resolves imports from files alone. ``pdserve/X`` is a symbolic link to the top-level folder
``X/`` (pdserve/__init__.py), so from the repository root ``pdserve.engine.llm_engine`` is the
file pdserve/engine/llm_engine.py, as it is for Python itself: no tree of its own to build.

    python -m scripts.typecheck [mypy arguments]
"""

from __future__ import annotations

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
CHECKED = ("protocol", "engine", "router", "kv_transfer", "node", "prefill_node", "decode_node")


def main(argv: list[str]) -> int:
    packages = [arg for name in CHECKED for arg in ("-p", f"pdserve.{name}")]
    # the cache under build/ (ignored by git and the image), not a new folder in the checkout
    command = [sys.executable, "-m", "mypy", "--cache-dir", "build/mypy-cache", *packages, *argv]
    return subprocess.run(command, cwd=ROOT).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
