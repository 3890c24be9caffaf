"""deploy/k8s/base/network-policy.yaml: exactly the connections pdserve needs get in, no other.

The rendered policies are evaluated here the way Kubernetes does for ingress: a pod selected by
no policy takes anything; a selected pod takes a connection only when some rule of a policy that
selects it matches the source and the port (named ports resolved on the destination's container).
"""

from __future__ import annotations

import itertools

import pytest

from tests.test_k8s import BASE, container, deployment

POLICIES = [doc for (kind, _), doc in BASE.items() if kind == "NetworkPolicy"]
ROLES = ("router", "prefill", "decode", "redis")
LABELS = {role: deployment(role)["spec"]["template"]["metadata"]["labels"] for role in ROLES}
LABELS["stranger"] = {"app.kubernetes.io/name": "something-else"}  # another pod of the namespace
PORTS = {role: {p["name"]: p["containerPort"] for p in container(role)["ports"]} for role in ROLES}
ALLOWED = {
    *((src, "router", 8000) for src in (None, *LABELS)),  # the API, from anywhere
    ("prefill", "router", 7100),
    ("decode", "router", 7100),
    ("router", "prefill", 7000),
    ("router", "decode", 7000),
    ("prefill", "decode", 7001),
    ("router", "redis", 6379),
    ("prefill", "redis", 6379),
    ("decode", "redis", 6379),
}


def _selects(selector: dict, labels: dict) -> bool:
    assert set(selector) <= {"matchLabels"}, "only matchLabels selectors are evaluated here"
    return selector.get("matchLabels", {}).items() <= labels.items()


def _peer_matches(peer: dict, src: str | None) -> bool:
    assert set(peer) == {"podSelector"}, "only same-namespace pod peers are evaluated here"
    return src is not None and _selects(peer["podSelector"], LABELS[src])


def allowed(src: str | None, dst: str, port: int) -> bool:
    """``src`` None: a client outside the namespace."""
    selecting = [p for p in POLICIES if _selects(p["spec"]["podSelector"], LABELS[dst])]
    if not selecting:
        return True
    for policy in selecting:
        assert policy["spec"]["policyTypes"] == ["Ingress"]
        for rule in policy["spec"].get("ingress", []):
            if "from" in rule and not any(_peer_matches(peer, src) for peer in rule["from"]):
                continue
            numbers = [PORTS[dst].get(p["port"], p["port"]) for p in rule.get("ports", [])]
            if "ports" in rule and port not in numbers:
                continue
            return True
    return False


def test_every_pod_is_under_a_default_deny():
    assert any(p["spec"]["podSelector"] == {} and "ingress" not in p["spec"] for p in POLICIES)


def test_named_ports_of_every_policy_exist_on_the_pods_they_select():
    for policy in POLICIES:
        targets = [r for r in ROLES if _selects(policy["spec"]["podSelector"], LABELS[r])]
        for rule in policy["spec"].get("ingress", []):
            for port in rule.get("ports", []):
                assert all(port["port"] in PORTS[t] for t in targets), (policy["metadata"]["name"], port)


@pytest.mark.parametrize("dst", ROLES)
def test_exactly_the_paths_pdserve_uses_are_open(dst):
    every_port = sorted({n for ports in PORTS.values() for n in ports.values()})
    for src, port in itertools.product((None, *LABELS), every_port):
        assert allowed(src, dst, port) == ((src, dst, port) in ALLOWED), (src, dst, port)
