"""The tests' HTTP calls: httpx's ``get``, ``post`` and ``stream`` with one SSL context for them all.

httpx builds a client for every module-level call, and every client reads the CA bundle into a new
SSL context (about 25 ms of CPU here) although the tests speak plain HTTP to loopback servers. Over
the suite's thousands of calls (health polls, metrics reads, concurrent requests) that was two
fifths of the pytest process's CPU, taken from the nodes under test on a two-core machine. Each call
still opens its own connection, as ``httpx.get`` does; tests/test_tiers.py keeps the tests on these.
"""

from __future__ import annotations

from typing import Any

import httpx

VERIFY = httpx.create_ssl_context()  # what httpx builds by default, built once


def get(url: str, **kwargs: Any) -> httpx.Response:
    return httpx.get(url, verify=VERIFY, **kwargs)


def post(url: str, **kwargs: Any) -> httpx.Response:
    return httpx.post(url, verify=VERIFY, **kwargs)


def stream(method: str, url: str, **kwargs: Any):
    return httpx.stream(method, url, verify=VERIFY, **kwargs)
