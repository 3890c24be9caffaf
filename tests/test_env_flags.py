"""Variables the code reads from the environment itself pass the container entrypoint untouched."""

from __future__ import annotations

import pytest

from pdserve.launcher.env_flags import flags_from_env


@pytest.mark.parametrize("command", ["prefill", "decode", "router"])
def test_native_cpu_switch_and_cache_dir_are_not_taken_for_flags(command):
    env = {"PDSERVE_NATIVE_CPU": "1", "PDSERVE_CACHE": "/models"}
    assert flags_from_env(command, env) == []
