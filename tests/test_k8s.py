"""deploy/k8s: every manifest against the Kubernetes schemas, and the manifests against compose.

kubernetes-validate ships the Kubernetes JSON schemas in its wheel, so this runs offline. KEDA's
ScaledObject is no Kubernetes kind: it is checked against the part of KEDA's CRD schema it uses.
The GPU overlay's patches are merged here (strategic-merge rules for the fields they touch) and the
result validated too; where kubectl is installed, its kustomize renders every kustomization as well. The compose half: the same images, commands and PDSERVE_* variables, save the
few a cluster needs on top (a pod's own IP as its address).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from pdserve.cli.main import build_parser
from pdserve.launcher.env_flags import flags_from_env
from pdserve.router.metrics import RouterMetrics
from tests.cluster import ROOT
from tests.test_router_support import node_info

K8S = ROOT / "deploy" / "k8s"
KUBERNETES_VERSION = "1.30.0"  # the oldest minor still in wide use that has every kind used here
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
ROLES = ("router", "prefill", "decode")
NODES = ("prefill", "decode")
# Variables only a cluster sets: the pod's IP, which compose's hostnames stand in for.
K8S_ONLY = {
    "router": {"PDSERVE_ADVERTISE_HOST", "PDSERVE_REPLY_PORT"},
    "prefill": {"PDSERVE_ADVERTISE_HOST"},
    "decode": {"PDSERVE_ADVERTISE_HOST"},
}
ADAPTER_VALUES = K8S / "autoscaling" / "hpa" / "prometheus-adapter-values.yaml"

# The fields of KEDA's ScaledObject CRD (keda.sh/v1alpha1) the manifests use, as its schema has them.
SCALED_OBJECT_SCHEMA = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "keda.sh/v1alpha1"},
        "kind": {"const": "ScaledObject"},
        "metadata": {"type": "object", "required": ["name"], "properties": {"name": {"type": "string"}}},
        "spec": {
            "type": "object",
            "required": ["scaleTargetRef", "triggers"],
            "additionalProperties": False,
            "properties": {
                "scaleTargetRef": {
                    "type": "object",
                    "required": ["name"],
                    "additionalProperties": False,
                    "properties": {k: {"type": "string"} for k in ("apiVersion", "kind", "name")},
                },
                **{
                    k: {"type": "integer", "minimum": 0}
                    for k in ("minReplicaCount", "maxReplicaCount", "pollingInterval", "cooldownPeriod")
                },
                "triggers": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "required": ["type", "metadata"],
                        "additionalProperties": False,
                        "properties": {
                            "type": {"type": "string"},
                            "name": {"type": "string"},
                            "metricType": {"enum": ["AverageValue", "Value", "Utilization"]},
                            "metadata": {"type": "object", "additionalProperties": {"type": "string"}},
                        },
                    },
                },
            },
        },
    },
}


def load_all(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def kustomizations() -> dict[Path, dict]:
    return {p: yaml.safe_load(p.read_text()) for p in sorted(K8S.rglob("kustomization.yaml"))}


def listed(key: str) -> list[Path]:
    """Files the kustomizations name under ``key`` ("resources" or "patches"), folders left out."""
    out = []
    for path, kustomization in kustomizations().items():
        for entry in kustomization.get(key, []):
            target = (path.parent / (entry["path"] if isinstance(entry, dict) else entry)).resolve()
            if target.is_file():
                out.append(target)
    return out


MANIFESTS = [(p, i, doc) for p in listed("resources") for i, doc in enumerate(load_all(p))]
BASE = {(doc["kind"], doc["metadata"]["name"]): doc for p, _, doc in MANIFESTS if p.parent == K8S / "base"}


def deployment(role: str) -> dict:
    return BASE[("Deployment", "redis" if role == "redis" else f"pdserve-{role}")]


def container(role: str) -> dict:
    (only,) = deployment(role)["spec"]["template"]["spec"]["containers"]
    return only


def env_of(spec: dict) -> dict[str, str]:
    return {e["name"]: e["value"] for e in spec.get("env", []) if "value" in e}


def strategic_merge(base, patch):
    """Kustomize's strategic merge for what the patches here touch: maps merge, named lists by name."""
    if isinstance(base, dict) and isinstance(patch, dict):
        return {**base, **{k: strategic_merge(base[k], v) if k in base else v for k, v in patch.items()}}
    if (
        isinstance(base, list)
        and isinstance(patch, list)
        and all(isinstance(x, dict) and "name" in x for x in base + patch)
    ):
        merged = {x["name"]: x for x in base}
        for item in patch:
            merged[item["name"]] = (
                strategic_merge(merged[item["name"]], item) if item["name"] in merged else item
            )
        return list(merged.values())
    return patch


def gpu_deployments() -> dict[str, dict]:
    return overlay_deployments("gpu")


def overlay_deployments(name: str) -> dict[str, dict]:
    """The Deployments an overlay patches, merged onto what it builds on (the base, or another overlay)."""
    overlay = K8S / "overlays" / name
    below = deployments_of(overlay)
    return {
        p["metadata"]["name"]: strategic_merge(below[p["metadata"]["name"]], p) for p in _patches(overlay)
    }


def deployments_of(folder: Path) -> dict[str, dict]:
    """Every Deployment that ``folder``'s resources give, by name, before its own patches."""
    out = {}
    for entry in kustomizations()[folder / "kustomization.yaml"]["resources"]:
        target = (folder / entry).resolve()
        if target == K8S / "base":
            out.update({name: doc for (kind, name), doc in BASE.items() if kind == "Deployment"})
        else:
            out.update(deployments_of(target))
            out.update(overlay_deployments(target.name))
    return out


def _patches(overlay: Path) -> list[dict]:
    return [
        yaml.safe_load((overlay / p["path"]).read_text())
        for p in kustomizations()[overlay / "kustomization.yaml"].get("patches", [])
    ]


def test_kubernetes_validate_has_its_schemas_offline():
    assert KUBERNETES_VERSION.rsplit(".", 1)[0] in {
        v.rsplit(".", 1)[0] for v in kubernetes_validate.utils.all_versions()
    }


@pytest.mark.parametrize(
    ("path", "index", "doc"),
    MANIFESTS,
    ids=[f"{p.relative_to(K8S)}#{i}:{d['kind']}" for p, i, d in MANIFESTS],
)
def test_every_manifest_validates_against_its_schema(path, index, doc):
    if doc["kind"] == "ScaledObject":
        jsonschema.validate(doc, SCALED_OBJECT_SCHEMA)
    else:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


@pytest.mark.parametrize("name", ["pdserve-prefill", "pdserve-decode"])
def test_gpu_overlay_renders_valid_deployments_that_request_a_gpu(name):
    rendered = gpu_deployments()[name]
    kubernetes_validate.validate(rendered, KUBERNETES_VERSION, strict=True)
    (spec,) = rendered["spec"]["template"]["spec"]["containers"]
    assert (
        spec["resources"]["limits"]["nvidia.com/gpu"] == 1 == spec["resources"]["requests"]["nvidia.com/gpu"]
    )
    assert env_of(spec)["PDSERVE_DTYPE"] == "bfloat16"
    assert len(spec["env"]) == len({e["name"] for e in spec["env"]})  # merged by name, not appended
    # the nodes compute on the GPU, their pool sized from its memory rather than a fixed budget
    env = {k: v.replace("$(POD_IP)", "10.0.0.7") for k, v in env_of(spec).items()}
    args = build_parser().parse_args([spec["args"][0], *flags_from_env(spec["args"][0], env)])
    assert (args.device, args.gpu_memory_utilization, args.kv_cache_memory_mb) == ("cuda", 0.9, None)


OVERLAYS = sorted(p.parent.name for p in (K8S / "overlays").glob("*/kustomization.yaml"))


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_pod_on_gpus_requests_one_gpu_per_tensor_parallel_rank(overlay):
    """A node's rank r computes on the r-th GPU from its first and two ranks cannot share one,
    so a pod that computes on CUDA requests (and is limited to) as many GPUs as its ranks."""
    for name, rendered in {
        **deployments_of(K8S / "overlays" / overlay),
        **overlay_deployments(overlay),
    }.items():
        (spec,) = rendered["spec"]["template"]["spec"]["containers"]
        env = env_of(spec)
        if env.get("PDSERVE_DEVICE") != "cuda":
            assert "nvidia.com/gpu" not in spec.get("resources", {}).get("requests", {}), name
            continue
        tp = int(env.get("PDSERVE_TENSOR_PARALLEL_SIZE", "1"))
        resources = spec["resources"]
        assert resources["requests"]["nvidia.com/gpu"] == tp == resources["limits"]["nvidia.com/gpu"], name


def test_the_gpu_tensor_parallel_overlay_gives_prefill_two_ranks_on_two_gpus():
    rendered = overlay_deployments("gpu-tensor-parallel")["pdserve-prefill"]
    kubernetes_validate.validate(rendered, KUBERNETES_VERSION, strict=True)
    (spec,) = rendered["spec"]["template"]["spec"]["containers"]
    env = {k: v.replace("$(POD_IP)", "10.0.0.7") for k, v in env_of(spec).items()}
    args = build_parser().parse_args([spec["args"][0], *flags_from_env(spec["args"][0], env)])
    assert (args.device, args.tensor_parallel_size, args.dtype) == ("cuda", 2, "bfloat16")
    assert spec["resources"]["limits"]["nvidia.com/gpu"] == 2
    decode = deployments_of(K8S / "overlays" / "gpu-tensor-parallel")["pdserve-decode"]
    (decode_spec,) = decode["spec"]["template"]["spec"]["containers"]
    assert decode_spec["resources"]["limits"]["nvidia.com/gpu"] == 1  # one rank, one GPU


def test_tensor_parallel_overlay_gives_prefill_two_ranks_with_their_threads_and_cores():
    rendered = overlay_deployments("tensor-parallel")["pdserve-prefill"]
    kubernetes_validate.validate(rendered, KUBERNETES_VERSION, strict=True)
    (spec,) = rendered["spec"]["template"]["spec"]["containers"]
    env = {k: v.replace("$(POD_IP)", "10.0.0.7") for k, v in env_of(spec).items()}
    args = build_parser().parse_args([spec["args"][0], *flags_from_env(spec["args"][0], env)])
    assert (args.tensor_parallel_size, args.threads) == (2, 4)
    assert spec["resources"]["requests"]["cpu"] == "4"  # a core a thread: two ranks of two
    assert env_of(container("decode"))["PDSERVE_TENSOR_PARALLEL_SIZE"] == "1"  # the base's layout


def test_every_yaml_file_is_a_kustomization_a_resource_a_patch_or_the_adapter_values():
    accounted = set(listed("resources")) | set(listed("patches")) | set(kustomizations()) | {ADAPTER_VALUES}
    assert set(K8S.rglob("*.yaml")) == accounted
    for path, kustomization in kustomizations().items():
        for entry in kustomization.get("resources", []):
            assert (path.parent / entry).exists(), (path, entry)


def test_overlay_images_retarget_an_image_the_base_uses():
    used = {c["image"].split(":")[0] for role in ("redis", *ROLES) for c in [container(role)]}
    for kustomization in kustomizations().values():
        assert {i["name"] for i in kustomization.get("images", [])} <= used


@pytest.mark.parametrize("role", ["redis", *ROLES])
def test_manifests_run_the_compose_image_and_command(role):
    assert container(role)["image"] == COMPOSE[role]["image"]
    assert container(role)["args"] == COMPOSE[role]["command"]  # args replace CMD, as compose's command does


@pytest.mark.parametrize("role", ROLES)
def test_manifests_set_the_compose_variables_plus_only_the_pod_address(role):
    k8s = {k: v for k, v in env_of(container(role)).items() if k.startswith("PDSERVE_")}
    compose = {k: str(v) for k, v in COMPOSE[role]["environment"].items()}
    assert set(k8s) == set(compose) | K8S_ONLY[role]
    for name, value in compose.items():
        default = re.fullmatch(r"\$\{\w+:-([^}]*)\}", value)
        if default is None or default.group(1):  # a literal, or a knob with a default: the same value
            assert k8s[name] == (default.group(1) if default else value), name


@pytest.mark.parametrize("role", ROLES)
def test_every_manifest_variable_is_a_flag_of_the_command(role):
    env = {k: v.replace("$(POD_IP)", "10.0.0.7") for k, v in env_of(container(role)).items()}
    command = container(role)["args"][0]
    args = build_parser().parse_args([command, *flags_from_env(command, env)])
    assert (args.redis_url if role == "router" else args.redis) == "redis://redis:6379/0"


@pytest.mark.parametrize("role", NODES)
def test_nodes_advertise_their_pod_ip_and_have_no_service(role):
    env = container(role)["env"]
    assert {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}} in env
    assert env_of(container(role))["PDSERVE_ADVERTISE_HOST"] == "$(POD_IP)"
    assert [n for kind, n in BASE if kind == "Service"] == ["redis", "pdserve-router"]


def test_router_replies_at_its_pod_ip_and_its_service_targets_port_8000():
    env = {k: v.replace("$(POD_IP)", "10.0.0.7") for k, v in env_of(container("router")).items()}
    args = build_parser().parse_args(["router", *flags_from_env("router", env)])
    assert (args.host, args.advertise_host, args.reply_port) == ("0.0.0.0", "10.0.0.7", 7100)
    assert {"name": "replies", "containerPort": 7100} in container("router")["ports"]
    service = BASE[("Service", "pdserve-router")]["spec"]
    assert service["selector"] == deployment("router")["spec"]["template"]["metadata"]["labels"]
    assert service["ports"] == [{"name": "http", "port": 8000, "targetPort": "http"}]
    assert container("router")["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}


@pytest.mark.parametrize("role", NODES)
def test_node_readiness_is_its_ready_file_on_an_in_memory_volume(role):
    ready_file = env_of(container(role))["PDSERVE_READY_FILE"]
    assert container(role)["readinessProbe"]["exec"]["command"] == ["test", "-f", ready_file]
    (mount,) = [m for m in container(role)["volumeMounts"] if ready_file.startswith(m["mountPath"] + "/")]
    (volume,) = [
        v for v in deployment(role)["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"]
    ]
    assert volume["emptyDir"]["medium"] == "Memory"


@pytest.mark.parametrize("role", NODES)
def test_nodes_drain_in_prestop_within_the_grace_period(role):
    drain_timeout = build_parser().parse_args([role, "--model", "m"]).drain_timeout
    assert deployment(role)["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > drain_timeout + 5
    command = container(role)["lifecycle"]["preStop"]["exec"]["command"]
    assert command[:2] == ["sh", "-c"] and "kill -TERM 1" in command[2]


@pytest.mark.parametrize("role", ["redis", *ROLES])
def test_every_container_requests_cpu_and_memory(role):
    assert {"cpu", "memory"} <= set(container(role)["resources"]["requests"])


@pytest.mark.parametrize("role", ROLES)
def test_each_role_has_a_disruption_budget_over_its_pods(role):
    budget = BASE[("PodDisruptionBudget", f"pdserve-{role}")]["spec"]
    labels = deployment(role)["spec"]["template"]["metadata"]["labels"]
    assert budget["selector"]["matchLabels"] == labels == deployment(role)["spec"]["selector"]["matchLabels"]
    assert budget["maxUnavailable"] == 1


def autoscalers(kind: str) -> dict[str, dict]:
    return {doc["spec"]["scaleTargetRef"]["name"]: doc for _, _, doc in MANIFESTS if doc["kind"] == kind}


@pytest.mark.parametrize("kind", ["HorizontalPodAutoscaler", "ScaledObject"])
def test_both_autoscalers_scale_the_prefill_and_decode_deployments(kind):
    assert set(autoscalers(kind)) == {"pdserve-prefill", "pdserve-decode"}
    assert all(("Deployment", name) in BASE for name in autoscalers(kind))


def test_hpa_metrics_are_the_adapters_external_rules():
    rules = {r["name"]["as"]: r for r in yaml.safe_load(ADAPTER_VALUES.read_text())["rules"]["external"]}
    named = {
        m["external"]["metric"]["name"]
        for hpa in autoscalers("HorizontalPodAutoscaler").values()
        for m in hpa["spec"]["metrics"]
    }
    assert (
        named
        == set(rules)
        == {
            "pdserve_prefill_backlog_seconds",
            "pdserve_decode_kv_usage_ratio",
            "pdserve_decode_running_requests",
        }
    )


def exported_metric_names() -> set[str]:
    nodes = [
        node_info("p0", "prefill", num_queued_prefill_tokens=10, prefill_tokens_per_s=5.0),
        node_info("d0", "decode"),
    ]
    text = RouterMetrics(lambda: nodes, lambda: {}).render().decode()
    return {s.name for family in text_string_to_metric_families(text) for s in family.samples}


def test_every_metric_the_autoscalers_query_is_one_the_router_exports_and_the_readme_names():
    rules = yaml.safe_load(ADAPTER_VALUES.read_text())["rules"]["external"]
    queries = [r["metricsQuery"] for r in rules] + [
        t["metadata"]["query"] for so in autoscalers("ScaledObject").values() for t in so["spec"]["triggers"]
    ]
    queried = {m for q in queries for m in re.findall(r"\bpdserve_\w+", q)}
    assert queried <= exported_metric_names()
    readme = (K8S / "README.md").read_text()
    assert all(f"`{name}`" in readme for name in queried | {r["name"]["as"] for r in rules})


def _kubectl_kustomize(folder: Path) -> list[dict]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("no kubectl installed (its built-in kustomize renders the kustomizations)")
    result = subprocess.run([kubectl, "kustomize", str(folder)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc is not None]


@pytest.mark.parametrize(
    "folder", sorted(p.parent.relative_to(K8S) for p in K8S.rglob("kustomization.yaml")), ids=str
)
@pytest.mark.usefixtures("processes")
def test_kustomize_renders_every_kustomization_into_valid_manifests_in_the_namespace(folder):
    for doc in _kubectl_kustomize(K8S / folder):
        if doc["kind"] == "ScaledObject":
            jsonschema.validate(doc, SCALED_OBJECT_SCHEMA)
        else:
            kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
        assert doc["kind"] == "Namespace" or doc["metadata"]["namespace"] == "pdserve"


@pytest.mark.usefixtures("processes")
def test_kustomize_renders_the_gpu_overlay_as_the_merge_above_does():
    rendered = {
        d["metadata"]["name"]: d
        for d in _kubectl_kustomize(K8S / "overlays" / "gpu")
        if d["kind"] == "Deployment"
    }
    for name, merged in gpu_deployments().items():
        (ours,) = merged["spec"]["template"]["spec"]["containers"]
        (theirs,) = rendered[name]["spec"]["template"]["spec"]["containers"]
        assert theirs["image"] == "pdserve:gpu"
        assert {e["name"]: e.get("value") for e in theirs["env"]} == {
            e["name"]: e.get("value") for e in ours["env"]
        }
        assert theirs["resources"] == ours["resources"]


@pytest.mark.parametrize("role", ["redis", *ROLES])
def test_every_pod_mounts_the_cluster_secret_read_only_and_no_manifest_holds_one(role):
    """The key and the Redis password come from the Secret pdserve-cluster, which the operator
    makes (deploy/k8s/README.md): mounted where compose mounts its secrets volume, never in a file here."""
    pod = deployment(role)["spec"]["template"]["spec"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == "secrets"]
    assert volume["secret"]["secretName"] == "pdserve-cluster" and volume["secret"]["defaultMode"] == 0o400
    assert {"name": "secrets", "mountPath": "/secrets", "readOnly": True} in container(role)["volumeMounts"]
    if role != "redis":
        env = env_of(container(role))
        assert env["PDSERVE_CLUSTER_KEY_FILE"] == "/secrets/cluster.key"
        assert env["PDSERVE_REDIS_PASSWORD_FILE"] == "/secrets/redis-password"
    assert not [doc for _, _, doc in MANIFESTS if doc["kind"] == "Secret"]
