"""Where compose and Kubernetes send the traces: deploy/compose/tracing.yml (an overlay with a
collector) and deploy/k8s/overlays/tracing, read as protocol/tracing.py reads their variables."""

from __future__ import annotations

import re
import subprocess

import kubernetes_validate
import pytest
import yaml

from pdserve.protocol.tracing import trace_settings
from tests.cluster import ROOT
from tests.test_compose import SERVICES, _compose_client
from tests.test_k8s import KUBERNETES_VERSION, env_of, overlay_deployments

OVERLAY = ROOT / "deploy" / "compose" / "tracing.yml"
COMPOSE = yaml.safe_load(OVERLAY.read_text())["services"]
COLLECTOR = yaml.safe_load((ROOT / "deploy" / "compose" / "otel-collector.yaml").read_text())
PDSERVE = ("router", "prefill", "decode")


def test_the_compose_overlay_adds_a_collector_and_touches_only_the_pdserve_services():
    assert set(COMPOSE) == {"otel-collector", *PDSERVE} and set(PDSERVE) <= set(SERVICES)
    assert re.fullmatch(
        r"otel/opentelemetry-collector(-contrib)?:[\w.-]+", COMPOSE["otel-collector"]["image"]
    )
    mount = COMPOSE["otel-collector"]["volumes"][0].split(":")[0]
    assert (ROOT / mount).resolve() == ROOT / "deploy" / "compose" / "otel-collector.yaml"


@pytest.mark.parametrize("service", PDSERVE)
def test_each_pdserve_service_exports_grpc_to_the_collectors_otlp_port_from_an_image_with_the_sdk(service):
    spec = COMPOSE[service]
    env = {k: re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", str(v)) for k, v in spec["environment"].items()}
    settings = trace_settings(None, env)
    assert settings is not None and settings.protocol == "grpc" and settings.exporters == ("otlp",)
    host, port = re.fullmatch(r"http://([\w-]+):(\d+)", env["OTEL_EXPORTER_OTLP_ENDPOINT"]).groups()
    assert host == "otel-collector" and COLLECTOR["receivers"]["otlp"]["protocols"]["grpc"][
        "endpoint"
    ].endswith(f":{port}")
    assert spec["build"]["args"]["PDSERVE_EXTRAS"].split()[0] == "otel"
    assert spec["depends_on"] == {"otel-collector": {"condition": "service_started"}}


def test_the_collector_takes_otlp_and_names_every_pipeline_part_it_defines():
    (pipeline,) = COLLECTOR["service"]["pipelines"].values()
    assert pipeline["receivers"] == ["otlp"]
    assert set(pipeline["exporters"]) <= set(COLLECTOR["exporters"])
    assert set(pipeline.get("processors", [])) <= set(COLLECTOR.get("processors", {}))


@pytest.mark.usefixtures("processes")
def test_the_compose_client_accepts_the_file_with_the_overlay():
    client = _compose_client()
    if client is None:
        pytest.skip("no `docker compose` or `docker-compose` installed (apt-get install docker-compose)")
    files = ["-f", str(ROOT / "docker-compose.yml"), "-f", str(OVERLAY)]
    result = subprocess.run([*client, *files, "config"], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert result.returncode == 0, result.stderr
    merged = yaml.safe_load(result.stdout)["services"]
    for service in PDSERVE:  # the base's variables and dependencies are kept, the overlay's added
        assert {"PDSERVE_MODEL", "OTEL_EXPORTER_OTLP_ENDPOINT"} <= set(merged[service]["environment"])
        assert {"redis", "otel-collector"} <= set(merged[service]["depends_on"])


@pytest.mark.parametrize("role", PDSERVE)
def test_the_k8s_overlay_sends_every_pods_traces_to_a_collector_over_grpc(role):
    rendered = overlay_deployments("tracing")[f"pdserve-{role}"]
    kubernetes_validate.validate(rendered, KUBERNETES_VERSION, strict=True)
    (spec,) = rendered["spec"]["template"]["spec"]["containers"]
    env = env_of(spec)
    settings = trace_settings(None, env)
    assert settings is not None and settings.protocol == "grpc"
    assert env["OTEL_EXPORTER_OTLP_ENDPOINT"].endswith(":4317")
    names = [e["name"] for e in spec["env"]]
    assert len(names) == len(set(names)) and "PDSERVE_MODEL" in names  # merged by name, the base's kept
    assert env["OTEL_RESOURCE_ATTRIBUTES"] == "k8s.pod.name=$(POD_NAME)" and "POD_NAME" in names
