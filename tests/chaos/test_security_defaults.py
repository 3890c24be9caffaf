"""Security defaults, checked on real processes: an API key on /v1 only (401 in OpenAI's shape,
health and metrics open), a Redis that needs a password, every socket bound to loopback outside
compose, and a compose file that publishes the router alone."""

from __future__ import annotations

import pathlib

import psutil
import pytest
import redis
import yaml

from tests import web
from tests.chaos.conftest import API_KEY
from tests.chaos.load import Spec, request_once
from tests.cluster import ROOT

pytestmark = pytest.mark.usefixtures("processes")


@pytest.fixture
def guarded(small):
    """The small cluster's router that wants API_KEY, its nodes, its Redis's port."""
    cluster, _, router = small
    return router, cluster.nodes, cluster.redis.port


def test_redis_refuses_clients_without_the_password(guarded):
    _, _, port = guarded
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(port=port, socket_timeout=1).ping()


def test_with_the_key_and_a_password_protected_redis_requests_complete(guarded, model, expected):
    router, _, _ = guarded
    spec = Spec(tuple(range(400, 440)), 6, stream=False, logprobs=True)
    body = {"model": model.name, "prompt": list(spec.prompt), "max_tokens": 6, "temperature": 0}
    body |= {"ignore_eos": True, "logprobs": 0, "return_tokens_as_token_ids": True}
    reply = web.post(
        router.url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"}
    )
    assert reply.status_code == 200, reply.text
    tokens = [int(t.removeprefix("token_id:")) for t in reply.json()["choices"][0]["logprobs"]["tokens"]]
    assert tokens == expected.tokens(spec)


@pytest.mark.parametrize("auth", [None, "Bearer wrong", f"Bearer {API_KEY}x", API_KEY, "Bearer é"])
def test_without_the_right_key_v1_is_401_in_openai_shape(guarded, model, auth):
    router, _, _ = guarded
    headers = {} if auth is None else {"Authorization": auth.encode()}
    outcome = web.post(router.url + "/v1/completions", json={"prompt": "x"}, headers=headers)
    assert outcome.status_code == 401 and outcome.headers["www-authenticate"] == "Bearer"
    assert outcome.json() == {
        "error": {
            "message": "missing or wrong API key",
            "type": "authentication_error",
            "param": None,
            "code": "invalid_api_key",
        }
    }
    assert web.get(router.url + "/v1/models", headers=headers).status_code == 401
    assert request_once(router.url, model.name, Spec((5,) * 8, 2, True, False)).status == 401


def test_health_and_metrics_need_no_key(guarded):
    router, _, _ = guarded
    assert web.get(router.url + "/health").status_code == 200
    assert "pdserve_node_kv_blocks_used" in web.get(router.url + "/metrics").text


def test_every_listening_socket_is_on_loopback_by_default(guarded):
    router, nodes, _ = guarded
    for proc in [router.proc, *(n.proc for n in nodes)]:
        listening = [
            c.laddr
            for c in psutil.Process(proc.pid).net_connections("inet")
            if c.status == psutil.CONN_LISTEN
        ]
        assert listening and all(addr.ip == "127.0.0.1" for addr in listening), listening


def test_compose_publishes_the_router_alone():
    services = yaml.safe_load(pathlib.Path(ROOT, "docker-compose.yml").read_text())["services"]
    published = {name for name, service in services.items() if service.get("ports")}
    assert published == {"router"}
