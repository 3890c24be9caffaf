"""`pdserve up --autoscale`'s parts without a cluster: the policy's decisions on a hand-made
profile (planner/scaling.py), the moves from one shape to another, the window read from two real
router scrapes, and the router's /admin/autoscale endpoints and series (launcher/autoscale.py,
router/scaling_log.py). tests/test_autoscale_cluster.py runs the controller on real processes."""

from __future__ import annotations

import dataclasses

import httpx
import pytest

from pdserve.bench_serve.metrics import Slo
from pdserve.launcher.autoscale import DECODING, Move, moves, observe, parse_metrics
from pdserve.planner.correction import mean_ttft_s
from pdserve.planner.profile import DecodeStepGrid, PiecewiseLinear, Profile, TransferModel
from pdserve.planner.scaling import Kind, Observation, ScalingPolicy, ScalingSettings, demand
from pdserve.planner.simulate import Cluster
from pdserve.router.metrics import RouterMetrics
from tests.test_router_support import fake_cluster as router_with_fake_nodes
from tests.test_router_support import fake_pair, run_async

# 2 ms per prompt token; decode steps 10-24 ms by batch and context; a 5 ms transfer.
PROFILE = Profile(
    model="toy",
    threads=1,
    kv_bytes_per_token=1000,
    max_num_batched_tokens=2048,
    max_num_seqs=64,
    prefill=PiecewiseLinear((1.0, 1000.0), (0.002, 2.0)),
    decode=DecodeStepGrid((1.0, 16.0), (1.0, 1000.0), ((0.010, 0.016), (0.014, 0.024))),
    transfer=TransferModel(0.005, 0.0),
)
SLO = Slo(ttft_s=2.0, tpot_s=0.03)
PD, THREE = Cluster(1, 1), Cluster(0, 0, 3)
PREFILL_HEAVY = (3.0, 200, 2)  # req/s, prompt tokens, output tokens
DECODE_HEAVY = (1.0, 200, 60)


def window(load, met: float | None = 1.0, seconds: float = 10.0, shed: int = 0) -> Observation:
    rate, prompt, output = load
    return Observation(seconds, round(rate * seconds), shed, prompt, output, met, met, 0.0, 0.2)


def policy(**settings) -> ScalingPolicy:
    return ScalingPolicy(PROFILE, ScalingSettings(**{"slo": SLO, "max_nodes": 3, **settings}))


def test_a_prefill_heavy_load_grows_the_pools_to_the_shape_the_model_ranks_first():
    d = policy(confirm=1).decide(window(PREFILL_HEAVY), PD, now_s=0.0)
    assert d.kind is Kind.SCALE and d.target.label == "3 colocated"
    # every shape in the budget was simulated; the chosen one wins by more than the margin
    assert set(d.predicted) == {"1 colocated", "2 colocated", "3 colocated", "1P+1D", "1P+2D", "2P+1D"}
    assert d.predicted["3 colocated"] - d.predicted["1P+1D"] > 0.2
    assert "3 colocated predicted" in d.reason and "3.00 req/s" in d.reason
    body = d.to_json()
    assert body["target_nodes"] == {"prefill": 0, "decode": 0, "colocated": 3}
    assert body["kind"] == "scale" and body["current"] == "1P+1D"


def test_a_decode_heavy_load_shrinks_to_fewer_nodes_only_while_the_window_meets_the_slos():
    d = policy(shrink_confirm=1).decide(window(DECODE_HEAVY), THREE, now_s=0.0)
    assert d.kind is Kind.SCALE and d.target.label == "1P+1D"
    assert "fewer nodes" in d.reason
    # (a shape of as many nodes would do no better than the measured 98% by the margin)
    held = policy(shrink_confirm=1, min_fraction=0.99).decide(
        window(DECODE_HEAVY, met=0.98), THREE, now_s=0.0
    )
    assert held.kind is Kind.MISSING_SLO and held.target.label == "3 colocated"
    assert "98% only" in held.reason


def test_a_shape_measured_missing_the_slos_grows_and_is_not_shrunk_back_into_on_as_heavy_a_load():
    p = policy(confirm=1, max_nodes=2)
    one, two = Cluster(0, 0, 1), Cluster(0, 0, 2)
    load = (1.0, 100, 60)  # the model: 1 colocated meets the SLOs (98%), so do both 2-node shapes
    assert p.decide(window(load), one, now_s=0.0).kind is Kind.BEST
    # The window refutes the model: the pool grows, to the model's best shape of more nodes.
    d = p.decide(window(load, met=0.5), one, now_s=0.0)
    assert d.kind is Kind.SCALE and d.target.num_nodes == 2
    assert d.predicted["1 colocated"] >= 0.9  # the model's own figure, as reported
    assert "measured, not modelled, on as heavy a load: 1 colocated 50%" in d.reason
    # On two nodes, as heavy a load or heavier does not shrink it back (the model alone would);
    # a lighter one is the model's again, and so is any load once the miss is old.
    shrink = policy(confirm=1, max_nodes=2, shrink_confirm=1)
    assert shrink.decide(window(load), two, now_s=0.0).target == one  # the model alone
    shrink.misses = dict(p.misses)
    for now_s, heavy in ((100.0, load), (130.0, (1.5, 100, 60))):
        assert shrink.decide(window(heavy), two, now_s=now_s).kind is not Kind.SCALE
    assert shrink.decide(window((0.8, 100, 60)), two, now_s=200.0).target == one
    assert shrink.decide(window(load), two, now_s=800.0).target == one
    # A window that meets the SLOs on the shape, on as heavy a load, clears the miss; but not
    # within the cooldown of a change, whose first windows hold the requests of the shape before.
    p = policy(confirm=1, max_nodes=2)
    assert p.decide(window(load, met=0.5), one, now_s=0.0).kind is Kind.SCALE
    p.decide(window(load, met=0.2), two, now_s=10.0)
    assert set(p.misses) == {"1 colocated"}  # 10 s after the change: not judged
    p.decide(window(load), one, now_s=40.0)
    assert not p.misses


def test_shapes_of_as_many_nodes_are_compared_by_the_model_alone():
    # At the node budget, a measured miss moves nothing: against the current shape's measured
    # share any unmeasured shape would look better, and the pool would go round them all.
    p = policy(confirm=1, max_nodes=2)
    d = p.decide(window((1.0, 100, 60), met=0.5), Cluster(0, 0, 2), now_s=0.0)
    assert d.kind is not Kind.SCALE and d.target.label == "2 colocated" and "2 colocated" in p.misses


def test_the_best_shape_holds_and_a_small_gain_is_not_worth_a_change():
    assert policy().decide(window(PREFILL_HEAVY), THREE, now_s=0.0).kind is Kind.BEST
    # with two nodes, 2 colocated and 1P+1D are predicted within the margin of each other
    d = policy(max_nodes=2).decide(window(PREFILL_HEAVY), PD, now_s=0.0)
    assert (
        d.kind is Kind.NO_GAIN and d.target == PD and max(d.predicted, key=d.predicted.get) == "2 colocated"
    )
    assert abs(d.predicted["1P+1D"] - d.predicted["2 colocated"]) < 0.05


def test_prefill_times_measured_slower_than_modelled_move_the_pool_off_the_family_that_ran_them():
    # At two nodes the model ties 1P+1D and 2 colocated on this load (66% each). Windows on 2
    # colocated measured the profile's own speed; then windows on 1P+1D measure the mean TTFT the
    # model gives it with prefills twice as long.
    p = policy(max_nodes=2, confirm=1)
    load, two = PREFILL_HEAVY, Cluster(0, 0, 2)
    at_profile = mean_ttft_s(PROFILE, two, demand(window(load)), SLO)
    d = p.decide(dataclasses.replace(window(load, met=0.66), mean_ttft_s=at_profile), two, now_s=0.0)
    assert d.kind is not Kind.SCALE and d.prefill_scale == pytest.approx(
        {"disaggregated": 1.0, "colocated": 1.0}, rel=0.02
    )
    slow = mean_ttft_s(PROFILE.with_prefill_scale(2.0), PD, demand(window(load)), SLO)
    assert p.decide(window(load), PD, now_s=100.0).kind is Kind.NO_GAIN  # no TTFT measured: the model
    d = p.decide(dataclasses.replace(window(load, met=0.66), mean_ttft_s=slow), PD, now_s=100.0)
    assert d.kind is Kind.SCALE and d.target.label == "2 colocated"
    scale = d.prefill_scale["disaggregated"]
    assert scale == pytest.approx(2.0**0.25, rel=0.02) and d.prefill_scale["colocated"] == pytest.approx(
        1.0, rel=0.02
    )
    assert d.predicted["1P+1D"] < d.predicted["2 colocated"] - 0.05
    assert f"disaggregated x{scale:.2f}" in d.reason and d.to_json()["prefill_scale"]["disaggregated"] > 1.1
    # told to trust the profile, the policy measures and reports the scale but ranks as calibrated
    trusting = policy(max_nodes=2, confirm=1, correct_prefill=False)
    held = trusting.decide(dataclasses.replace(window(load, met=0.66), mean_ttft_s=slow), PD, now_s=0.0)
    assert held.kind is Kind.NO_GAIN and held.prefill_scale["disaggregated"] == pytest.approx(scale)
    # windows within the cooldown of that change refit nothing (the requests of the shape before
    # it are still finishing); after it the running shape's family is refitted
    fast = mean_ttft_s(PROFILE.with_prefill_scale(0.6), two, demand(window(load)), SLO)
    colocated = d.prefill_scale["colocated"]
    for now_s, expected in ((110.0, colocated), (140.0, colocated * (0.6 / colocated) ** 0.25)):
        d = p.decide(dataclasses.replace(window(load), mean_ttft_s=fast), two, now_s=now_s)
        assert d.prefill_scale["colocated"] == pytest.approx(expected, rel=0.03)
        assert d.prefill_scale["disaggregated"] == scale


def test_a_family_measured_slow_alone_does_not_make_the_other_look_better_for_being_unmeasured():
    # Run 12 of the shifting-load study: the first windows on 2 colocated measured its prefills
    # 1.64x the profile's, 1P+1D (never run) was ranked at the profile's speed, and the pool moved
    # to it and stayed. What slows the shape that runs is as likely to slow the other: both are
    # ranked at the measured scale until each has been measured on this load.
    p, two = policy(max_nodes=2, confirm=1), Cluster(0, 0, 2)
    load = PREFILL_HEAVY
    slow = mean_ttft_s(PROFILE.with_prefill_scale(2.0), two, demand(window(load)), SLO)
    for now_s in (0.0, 5.0, 10.0):
        d = p.decide(dataclasses.replace(window(load, met=0.5), mean_ttft_s=slow), two, now_s=now_s)
        assert d.kind is not Kind.SCALE and d.target == two, d.reason
    assert d.prefill_scale["disaggregated"] == d.prefill_scale["colocated"] > 1.3
    assert "(0 fit(s) near this load; colocated's)" in d.reason


def test_a_window_with_too_few_requests_is_not_judged():
    d = policy(min_requests=8).decide(window((0.5, 200, 60)), PD, now_s=0.0)  # 5 requests
    assert d.kind is Kind.IDLE and d.target == PD and d.predicted == {}


def test_a_change_needs_the_same_target_on_confirm_windows_in_a_row():
    p = policy(confirm=2, cooldown_s=0)
    assert p.decide(window(PREFILL_HEAVY), PD, 0.0).kind is Kind.CONFIRMING
    assert p.decide(window(PREFILL_HEAVY), PD, 5.0).kind is Kind.SCALE
    # a window that names no change in between starts the count again
    assert p.decide(window(PREFILL_HEAVY), PD, 10.0).kind is Kind.CONFIRMING
    assert p.decide(window((0.1, 10, 2)), PD, 15.0).kind is Kind.IDLE
    assert p.decide(window(PREFILL_HEAVY), PD, 20.0).kind is Kind.CONFIRMING


def test_no_change_but_growth_within_the_cooldown_of_the_last_one():
    p = policy(confirm=1, shrink_confirm=1, cooldown_s=30, max_nodes=2)
    light = (1.0, 20, 4)  # one node meets the SLOs
    one = Cluster(0, 0, 1)
    grown = p.decide(window(PREFILL_HEAVY), one, 0.0)
    assert grown.kind is Kind.SCALE and grown.target.num_nodes == 2
    held = p.decide(window(light), grown.target, 10.0)  # back to one node: held
    assert held.kind is Kind.COOLDOWN and "20 s of cooldown left" in held.reason
    shrunk = p.decide(window(light), grown.target, 31.0)
    assert shrunk.kind is Kind.SCALE and shrunk.target.num_nodes == 1
    again = p.decide(window(PREFILL_HEAVY), shrunk.target, 35.0)  # a shortage waits for nothing
    assert again.kind is Kind.SCALE and again.target.num_nodes == 2
    p.changed(40.0)  # an operator's switch starts the cooldown too
    assert p.decide(window(light), again.target, 45.0).kind is Kind.COOLDOWN


def test_fewer_nodes_need_shrink_confirm_windows_in_a_row_and_growth_only_confirm():
    p = policy(confirm=2, shrink_confirm=4, cooldown_s=0)
    kinds = [p.decide(window(DECODE_HEAVY), THREE, 5.0 * k).kind for k in range(4)]
    assert kinds == [Kind.CONFIRMING] * 3 + [Kind.SCALE]
    kinds = [p.decide(window(PREFILL_HEAVY), PD, 100.0 + 5.0 * k).kind for k in range(2)]
    assert kinds == [Kind.CONFIRMING, Kind.SCALE]


def test_min_nodes_keeps_smaller_shapes_out_of_the_search():
    d = policy(confirm=1, min_nodes=3).decide(window(DECODE_HEAVY), THREE, now_s=0.0)
    assert d.kind is Kind.BEST and set(d.predicted) == {"3 colocated", "1P+2D", "2P+1D"}


def test_shed_requests_count_as_arrivals_and_as_missed():
    obs = window(PREFILL_HEAVY, met=1.0, shed=10)  # 30 finished within the SLOs, 10 refused
    assert obs.rate == pytest.approx(4.0) and obs.slo_met == pytest.approx(0.75)


@pytest.mark.parametrize(
    ("roles", "target", "expected"),
    [
        (  # three colocated to 1P+1D: two keep their weights under a new role (the instant switch
            # to decode first), the newest stops
            {"colocated-0": "colocated", "colocated-1": "colocated", "colocated-2": "colocated"},
            PD,
            [
                Move("switch", "decode", "colocated-0"),
                Move("switch", "prefill", "colocated-1"),
                Move("stop", "colocated", "colocated-2"),
            ],
        ),
        (  # 1P+1D to three colocated: both switch (the decode node at once), one more starts
            {"prefill-0": "prefill", "decode-0": "decode"},
            THREE,
            [
                Move("switch", "colocated", "decode-0"),
                Move("switch", "colocated", "prefill-0"),
                Move("start", "colocated"),
            ],
        ),
        (  # one colocated to 1P+1D: it decodes at once, a prefill node starts (draining it to
            # prefill first would leave no node that decodes)
            {"colocated-0": "colocated"},
            PD,
            [Move("switch", "decode", "colocated-0"), Move("start", "prefill")],
        ),
        (  # 2P+1D to 1P+1D: the newest prefill node stops
            {"prefill-0": "prefill", "prefill-1": "prefill", "decode-0": "decode"},
            PD,
            [Move("stop", "prefill", "prefill-1")],
        ),
        ({"prefill-0": "prefill", "decode-0": "decode"}, PD, []),
    ],
)
def test_moves_switch_roles_before_stopping_or_starting_nodes(roles, target, expected):
    assert moves(roles, target) == expected


def _serving_decoders(roles: dict[str, str]) -> int:
    return sum(role in DECODING for role in roles.values())


def _roles_of(target: Cluster) -> list[str]:
    counts = {"colocated": target.num_colocated, "decode": target.num_decode, "prefill": target.num_prefill}
    return [role for role, n in counts.items() for _ in range(n)]


@pytest.mark.parametrize("budget", [1, 2, 3])
def test_every_move_keeps_a_node_that_decodes_taking_requests(budget):
    # Every shape of up to ``budget`` nodes to every other: while a node drains to or from
    # prefill, or stops, another that decodes takes requests.
    shapes_ = [
        Cluster(p, d, c) for p in range(budget + 1) for d in range(budget + 1) for c in range(budget + 1)
        if 0 < p + d + c <= budget and d + c > 0
    ]  # fmt: skip
    for start in shapes_:
        names = {f"p{i}": "prefill" for i in range(start.num_prefill)}
        names |= {f"d{i}": "decode" for i in range(start.num_decode)}
        names |= {f"c{i}": "colocated" for i in range(start.num_colocated)}
        for target in shapes_:
            roles = dict(names)
            for move in moves(roles, target):
                if move.action == "start":
                    roles[f"new{len(roles)}"] = move.role
                    continue
                if move.action == "stop" or "prefill" in (roles[move.node], move.role):  # it drains
                    others = {n: r for n, r in roles.items() if n != move.node}
                    assert _serving_decoders(others) > 0, (start.label, target.label, move)
                if move.action == "stop":
                    del roles[move.node]
                else:
                    roles[move.node] = move.role
            assert sorted(roles.values()) == _roles_of(target), (start.label, target.label)


def test_a_window_is_read_from_two_scrapes_of_the_router():
    metrics = RouterMetrics(lambda: [], lambda: {})
    metrics.ttft.observe(0.5)  # before the window: not counted
    before = parse_metrics(metrics.render().decode())
    for ttft, tpot in ((0.5, 0.02), (1.0, 0.02), (1.5, 0.05), (9.0, 0.02)):  # 3 of 4 TTFTs, 3 TPOTs
        metrics.ttft.observe(ttft)
        metrics.tpot.observe(tpot)
        metrics.e2e.observe(ttft + 1)
    metrics.prompt_tokens.inc(4 * 300)
    metrics.generation_tokens.inc(4 * 20)
    metrics.shed.labels(reason="ttft_slo").inc(1)
    after = parse_metrics(metrics.render().decode())
    obs = observe(before, after, window_s=5.0, slo=Slo(ttft_s=2.5, tpot_s=0.025))  # on bucket bounds
    assert (obs.num_finished, obs.num_shed, obs.num_arrived) == (4, 1, 5)
    assert obs.rate == pytest.approx(1.0)
    assert (obs.mean_prompt_tokens, obs.mean_output_tokens) == (300, 20)
    assert obs.ttft_met == pytest.approx(0.75) and obs.tpot_met == pytest.approx(0.75)
    assert obs.slo_met == pytest.approx(0.75 * 4 / 5)
    assert obs.mean_ttft_s == pytest.approx((0.5 + 1.0 + 1.5 + 9.0) / 4)
    # a target between bounds: the 1.0-2.5 s bucket's one observation counts by (2.0 - 1.0) / 1.5
    between = observe(before, after, window_s=5.0, slo=SLO)
    assert between.ttft_met == pytest.approx((2 + 1 / 1.5) / 4)
    assert observe(after, after, 5.0, SLO).ttft_met is None  # nothing observed in the window


def test_the_router_keeps_reported_decisions_on_metrics_and_refuses_malformed_ones(default_model_dir):
    decision = policy(confirm=1).decide(window(PREFILL_HEAVY), PD, now_s=0.0).to_json()

    async def go():
        nodes = fake_pair([1, 2, 3])
        async with router_with_fake_nodes(default_model_dir, nodes, api_key="k") as cluster:
            url, auth = cluster.base_url, {"Authorization": "Bearer k"}
            async with httpx.AsyncClient(base_url=url, timeout=30) as http:
                unauth = await http.post("/admin/autoscale", json=decision)
                ok = await http.post("/admin/autoscale", json=decision, headers=auth)
                extra = await http.post("/admin/autoscale", json={**decision, "surprise": 1}, headers=auth)
                bad_kind = await http.post(
                    "/admin/autoscale", json={**decision, "kind": "grow"}, headers=auth
                )
                listed = await http.get("/admin/autoscale", headers=auth)
                scrape = await http.get("/metrics")
        return unauth, ok, extra, bad_kind, listed, scrape

    unauth, ok, extra, bad_kind, listed, scrape = run_async(go())
    assert unauth.status_code == 401
    assert ok.status_code == 200, ok.text
    for refused, field in ((extra, "surprise"), (bad_kind, "kind")):
        assert refused.status_code == 400 and field in refused.json()["error"]["message"], refused.text
    [kept] = listed.json()["decisions"]
    assert kept["target"] == "3 colocated" and kept["reason"] == decision["reason"]
    samples = parse_metrics(scrape.text)
    by_kind = {lab["kind"]: v for lab, v in samples["pdserve_autoscale_decisions_total"]}
    assert by_kind["scale"] == 1 and by_kind["idle"] == 0 and len(by_kind) == len(Kind)
    target = {lab["role"]: v for lab, v in samples["pdserve_autoscale_target_nodes"]}
    assert target == {"prefill": 0, "decode": 0, "colocated": 3}
    scales = {lab["family"]: v for lab, v in samples["pdserve_autoscale_prefill_scale"]}
    assert scales == {"disaggregated": 1.0, "colocated": 1.0}


def test_a_prefill_scale_fitted_on_long_outputs_does_not_hold_a_shape_back_once_they_are_short():
    # Run 8 of the shifting-load study: windows on 2 colocated measured its prefills slow while
    # outputs were long; when the load turned prefill-heavy again, that scale kept the pool on
    # 1P+1D. Fits hold near the mix they were measured on (planner.correction.NEAR).
    p, two = policy(max_nodes=2, confirm=1, cooldown_s=0.0), Cluster(0, 0, 2)
    slow = mean_ttft_s(PROFILE.with_prefill_scale(2.0), two, demand(window(DECODE_HEAVY)), SLO)
    for now_s in (0.0, 10.0, 20.0, 30.0):
        d = p.decide(dataclasses.replace(window(DECODE_HEAVY), mean_ttft_s=slow), two, now_s=now_s)
    long_scale = d.prefill_scale["colocated"]
    assert long_scale > 1.4 and "4 fit(s) near this load" in d.reason
    tilted = p.corrections.profile_for(PROFILE, two)  # the long-output scale, were it to apply
    assert mean_ttft_s(tilted, two, demand(window(PREFILL_HEAVY)), SLO) > 1.4 * mean_ttft_s(
        PROFILE, two, demand(window(PREFILL_HEAVY)), SLO
    )
    d = p.decide(window(PREFILL_HEAVY), two, now_s=40.0)
    assert d.prefill_scale == {"disaggregated": 1.0, "colocated": 1.0}
    assert d.kind is not Kind.SCALE and d.target == two
    d = p.decide(window(DECODE_HEAVY), two, now_s=50.0)  # outputs long again: the fits apply again
    assert d.prefill_scale["colocated"] == pytest.approx(long_scale)
