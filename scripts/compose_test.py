"""`make compose-test`: the real docker-compose.yml under a real Docker engine, phase by phase.

    python -m scripts.compose_test [--build] [--build-network host] [--override FILE] [--keep]

  1. up 1 prefill + 2 decode; concurrent chat and completion requests, streamed and not
  2. scale to 2+2 while streams are in flight; then a round that must reach every node
  3. scale back to 1+2 while streams are in flight (the removed prefill node drains)
  4. scale decode 2 -> 1 while streams are in flight (the removed decode node drains)
  1a. the image alone passes the wheel's checks (scripts/compose_image.py): only pdserve installed,
     the C++ CPU kernel loads, `pdserve plan` and `pdserve bench serve` start, `pdserve up` serves
     and `pdserve up --autoscale` starts
  1b. a rogue container on the compose network, with the image but without the secrets volume,
     writes to Redis, sends a GenerateRequest to a decode node, offers it KV and pushes token
     chunks to the router while a round of requests runs: each is refused and logged, the round
     is unharmed
  5. back to 1+2, then `docker kill` a decode node under streamed and whole requests: every
     request ends in time, cleanly (answer, in-stream error event, or error status); the killed
     container stays down (restart: unless-stopped does not restart a killed container), and
     `up --scale` brings the pool back to size, which a last round checks

Prints a summary table and exits 1 when any check fails. The project runs under its own name
(`pdserve-compose-test`) on a free host port and is taken down at the end (`--keep` leaves it).
Every request loop is bounded in count and time and talks only to that port on this machine.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pdserve.launcher.ports import free_port
from scripts import compose_engine as ce
from scripts.compose_image import phase_image
from scripts.compose_rogue import phase_rogue
from scripts.compose_traffic import CLEAN, Load, Outcome, Result, all_clean_ok, mixed_specs

NODE_SERVICES = ("prefill", "decode")
# Set in compose's environment; the compose file must pass them through to every node.
HOST_ENV = {"PDSERVE_KV_CACHE_MEMORY_MB": "384", "PDSERVE_DTYPE": "float32"}
NATIVE_LINE = "attention: C++ CPU kernel"  # engine.llm_engine's start-up line, native path on


@dataclasses.dataclass(slots=True)
class Phase:
    name: str
    pools: str  # "P+D" at the end of the phase
    results: list[Result]
    seconds: float
    checks: dict[str, bool] = dataclasses.field(default_factory=dict)  # what must hold -> whether it did
    notes: list[str] = dataclasses.field(default_factory=list)

    def count(self, *outcomes: Outcome) -> int:
        return sum(r.outcome in outcomes for r in self.results)

    @property
    def ok(self) -> bool:
        return all(self.checks.values())


class Harness:
    def __init__(self, args: argparse.Namespace, project: ce.Project, base_url: str, tmp: Path) -> None:
        self.args, self.project, self.url, self.tmp = args, project, base_url, tmp
        self.phases: list[Phase] = []

    def load(self, num: int, stream_only: bool = False, max_tokens: int | None = None) -> Load:
        specs = mixed_specs(num, max_tokens or self.args.max_tokens, stream_only)
        return Load(self.url, specs, self.args.request_timeout)

    def scale(self, num_prefill: int, num_decode: int) -> float:
        """Seconds until the registry shows the new pool sizes (compose's own wait included)."""
        start = time.monotonic()
        self.project.up(num_prefill, num_decode)
        return (
            time.monotonic()
            - start
            + ce.wait_for(
                f"{num_prefill}P+{num_decode}D in the registry",
                ce.pool_size_is(self.url, num_prefill, num_decode),
                self.args.ready_timeout,
            )
        )

    def record(self, name: str, results: list[Result], start: float, **checks: bool) -> Phase:
        counts = self._pools()
        phase = Phase(name, f"{counts['prefill']}+{counts['decode']}", results, time.monotonic() - start)
        phase.checks.update(checks)
        if self.errors(results):
            phase.notes.append("errors: " + self.errors(results))
        self.phases.append(phase)
        return phase

    def errors(self, results: list[Result]) -> str:
        """The distinct error messages, each with its count (empty when none)."""
        messages = collections.Counter(r.detail[:80] for r in results if r.outcome is not Outcome.OK)
        return "; ".join(f"{n}x {m!r}" for m, n in messages.most_common(3))

    def served(self, service: str, event: str, since: float) -> dict[str, int]:
        """Per running container of ``service``: how many ``event`` log lines since ``since``."""
        return {
            c[:12]: self.project.logs_since(c, since).count(f'"event": "{event}"')
            for c in self.project.containers(service)
        }

    def _pools(self) -> dict[str, int]:
        now = ce.pools(self.url)
        return {role: len(now.get(role, [])) for role in ("prefill", "decode")}


def phase_mixed(h: Harness) -> None:
    start, wall = time.monotonic(), time.time()
    results = h.load(h.args.num_requests).results()
    decode_counts = h.served("decode", "request_finished", wall)
    passed = {
        name: value
        for name, value in HOST_ENV.items()
        if all(
            f"{name}={value}" in h.project.container_env(c)
            for s in NODE_SERVICES
            for c in h.project.containers(s)
        )
    }
    # The image carries a compiler, so every node runs the C++ CPU kernels (its start-up line says).
    native = [
        NATIVE_LINE in h.project.logs_since(c, 0) for s in NODE_SERVICES for c in h.project.containers(s)
    ]
    phase = h.record(
        "1P+2D mixed",
        results,
        start,
        all_ok=all_clean_ok(results),
        every_decode_served=len(decode_counts) == 2 and min(decode_counts.values()) > 0,
        host_env_reaches_nodes=passed == HOST_ENV,
        nodes_run_cpu_kernels=len(native) == 3 and all(native),
    )
    phase.notes.append(
        "decode "
        + "/".join(map(str, decode_counts.values()))
        + "; nodes got "
        + " ".join(f"{k}={v}" for k, v in passed.items())
    )


def phase_scale_up(h: Harness) -> None:
    start = time.monotonic()
    load = h.load(h.args.num_streams, stream_only=True, max_tokens=h.args.long_tokens)
    waited = h.scale(2, 2)
    results = load.results()
    wall = time.time()
    spread = h.load(h.args.num_requests).results()
    prefill = h.served("prefill", "request_added", wall)
    decode = h.served("decode", "request_finished", wall)
    phase = h.record(
        "scale 1+2 -> 2+2",
        results + spread,
        start,
        in_flight_ok=all_clean_ok(results),
        spread_ok=all_clean_ok(spread),
        every_node_served=min([*prefill.values(), *decode.values()], default=0) > 0,
    )
    phase.notes.append(
        f"2+2 in {waited:.0f} s; next round: prefill {'/'.join(map(str, prefill.values()))}, "
        f"decode {'/'.join(map(str, decode.values()))}"
    )


def phase_scale_down(h: Harness, name: str, service: str, num_prefill: int, num_decode: int) -> None:
    start = time.monotonic()
    before = h.project.containers(service)
    followers = {c: h.project.follow_logs(c, h.tmp / f"{c}.log") for c in before}
    load = h.load(h.args.num_streams, stream_only=True, max_tokens=h.args.long_tokens)
    time.sleep(h.args.settle)  # the streams are on the nodes (first tokens out) before one is removed
    arriving = h.load(h.args.num_requests)  # and new requests keep coming while it goes
    took = h.scale(num_prefill, num_decode)
    in_flight, arrivals = load.results(), arriving.results()
    results = in_flight + arrivals
    for follower in followers.values():
        follower.terminate()
        follower.wait(timeout=10)
    removed = [c for c in before if c not in h.project.containers(service)]
    logs = [(h.tmp / f"{c}.log").read_text() for c in removed]
    took_on = sum(log.count(f'"event": "{event}"') for log in logs for event in STARTED_EVENTS[service])
    drains = [drain_seconds(log) for log in logs]
    phase = h.record(
        name,
        results,
        start,
        in_flight_none_lost=all_clean_ok(in_flight),
        arrivals_none_lost=all_clean_ok(arrivals),
        removed_node_took_requests=took_on > 0,
    )
    phase.notes.append(
        f"compose took {took:.0f} s; removed {', '.join(c[:12] for c in removed)}, which took "
        f"{took_on} and drained in " + ", ".join("?" if d is None else f"{d:.1f} s" for d in drains)
    )


# The log events of a request a node takes on: a prefill node's intake; a decode node's adopted KV,
# or a request it prefills itself (a short prompt, or a cached prefix, goes to a decode node alone).
STARTED_EVENTS = {"prefill": ("request_added",), "decode": ("kv_adopted", "request_added")}


def drain_seconds(log: str) -> float | None:
    """From a node's JSON log lines: seconds from its "draining" event to "node_stopped"."""
    times = {}
    for line in log.splitlines():
        if line.startswith("{"):
            with contextlib.suppress(ValueError):
                record = json.loads(line)
                times.setdefault(record.get("event"), record.get("ts"))
    if times.get("draining") is None or times.get("node_stopped") is None:
        return None
    return times["node_stopped"] - times["draining"]


def phase_kill(h: Harness) -> None:
    h.scale(1, 2)
    start = time.monotonic()
    retries_before = ce.counter(h.url, "pdserve_retries_total")
    streams = h.load(h.args.num_streams, stream_only=True, max_tokens=h.args.long_tokens)
    whole = h.load(h.args.num_streams // 2, max_tokens=h.args.long_tokens)  # half streamed, half not
    time.sleep(h.args.settle)
    victim = h.project.containers("decode")[-1]
    ce.docker("kill", victim)
    results = streams.results() + whole.results()
    replays = ce.counter(h.url, "pdserve_retries_total") - retries_before
    time.sleep(h.args.settle)
    stays_down = h.project.container_state(victim) != "running"
    phase = h.record(
        "kill a decode node",
        results,
        start,
        every_request_ended_cleanly=all(r.outcome in CLEAN for r in results),
        killed_container_stays_down=stays_down,
    )
    outcomes = collections.Counter(r.outcome.value for r in results)
    phase.notes.append(
        f"killed {victim[:12]}; "
        + ", ".join(f"{k} {v}" for k, v in sorted(outcomes.items()))
        + f"; {replays:.0f} replayed"
    )

    start = time.monotonic()
    waited = h.scale(1, 2)  # docs/deployment.md: `up -d --scale decode=2` brings a killed node back
    results = h.load(h.args.num_requests).results()
    phase = h.record("back to size (up --scale)", results, start, all_ok=all_clean_ok(results))
    phase.notes.append(f"pool back to 1+2 in {waited:.0f} s")


def summary(phases: list[Phase]) -> str:
    header = ("phase", "P+D", "reqs", "ok", "stream err", "err status", "lost", "s", "checks", "notes")
    rows = [header]
    for p in phases:
        lost = p.count(Outcome.BROKEN, Outcome.TIMEOUT)
        failed = [name for name, held in p.checks.items() if not held]
        rows.append(
            (
                p.name,
                p.pools,
                str(len(p.results)),
                str(p.count(Outcome.OK)),
                str(p.count(Outcome.STREAM_ERROR)),
                str(p.count(Outcome.ERROR_STATUS)),
                str(lost),
                f"{p.seconds:.0f}",
                "pass" if not failed else "FAIL: " + ", ".join(failed),
                "; ".join(p.notes),
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(header) - 1)]
    lines = [" | ".join(c.ljust(w) for c, w in zip(r, widths, strict=False)) + " | " + r[-1] for r in rows]
    lines.insert(1, "-+-".join("-" * w for w in widths) + "-+-" + "-" * 5)
    return "\n".join(lines)


def failures(phases: list[Phase]) -> list[str]:
    out = []
    for p in phases:
        out += [
            f"{p.name}: {r.spec.label} {r.outcome.value}: {r.detail}"
            for r in p.results
            if r.outcome not in CLEAN
        ]
    return out


def build_override(network: str, directory: Path) -> Path:
    """An override file, outside the repository, that builds the pdserve image on ``network``."""
    path = directory / "build-network.yml"
    build = f"{{build: {{context: {ce.ROOT}, network: {network}}}}}"
    path.write_text("services:\n" + "".join(f"  {s}: {build}\n" for s in ("router", "prefill", "decode")))
    return path


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--build", action="store_true", help="build the image first (it is built anyway when missing)"
    )
    p.add_argument(
        "--build-network", default=None, help="network for the build, e.g. host (an override file)"
    )
    p.add_argument("--override", action="append", type=Path, default=[], help="more compose override files")
    p.add_argument("--project", default="pdserve-compose-test")
    p.add_argument("--threads", default="1", help="PDSERVE_THREADS for every node")
    p.add_argument("--num-requests", type=int, default=16, help="requests in a mixed round")
    p.add_argument("--num-streams", type=int, default=8, help="streams in flight while the pools change")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument(
        "--long-tokens",
        type=int,
        default=64,
        help="tokens per stream held in flight (a drain must finish them within 30 s on a busy CPU)",
    )
    p.add_argument("--settle", type=float, default=4.0, help="seconds between starting streams and acting")
    p.add_argument("--request-timeout", type=float, default=180.0)
    p.add_argument("--ready-timeout", type=float, default=240.0)
    p.add_argument("--keep", action="store_true", help="leave the project running")
    p.add_argument("--port", type=int, default=None, help="the router's host port (default: a free one)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    client = ce.compose_client()
    if client is None:
        raise SystemExit("compose-test: no `docker compose` or `docker-compose` on PATH")
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="pdserve-compose-test-") as tmp:
        overrides = [*(args.override or [])]
        if args.build_network:
            overrides.append(build_override(args.build_network, Path(tmp)))
        env = {"ROUTER_PORT": str(args.port or port), "PDSERVE_THREADS": args.threads, **HOST_ENV}
        project = ce.Project(client, args.project, overrides, env)
        harness = Harness(args, project, f"http://127.0.0.1:{args.port or port}", Path(tmp))
        try:
            return run(harness, build=args.build or not _have_image())
        finally:
            if not args.keep:
                project.down()


def run(h: Harness, build: bool) -> int:
    start = time.monotonic()
    print(f"compose-test: {'building and ' if build else ''}starting 1P+2D on {h.url}", flush=True)
    try:
        h.project.up(1, 2, build=build)
        ce.wait_for("the router's /health", lambda: ce.healthy(h.url), h.args.ready_timeout)
        ce.wait_for("1P+2D in the registry", ce.pool_size_is(h.url, 1, 2), h.args.ready_timeout)
        print(f"compose-test: up in {time.monotonic() - start:.0f} s", flush=True)
        phase_mixed(h)
        phase_image(h)
        phase_rogue(h)
        phase_scale_up(h)
        phase_scale_down(h, "scale 2+2 -> 1+2", "prefill", 1, 2)
        phase_scale_down(h, "scale decode 2 -> 1", "decode", 1, 1)
        phase_kill(h)
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
        print(f"compose-test: stopped: {exc}", file=sys.stderr)
        print(h.project.run("logs", "--tail", "30", check=False, timeout_s=60)[-6000:], file=sys.stderr)
        print(summary(h.phases))
        return 1
    print(summary(h.phases))
    for line in failures(h.phases):
        print("  " + line)
    passed = all(p.ok for p in h.phases)
    print(f"compose-test: {'passed' if passed else 'FAILED'} in {time.monotonic() - start:.0f} s")
    return 0 if passed else 1


def _have_image() -> bool:
    try:
        ce.docker("image", "inspect", "pdserve:local")
        return True
    except subprocess.CalledProcessError:
        return False


if __name__ == "__main__":
    sys.exit(main())
