"""planner/correction.py: the prefill scale under which the model's mean TTFT is the measured one,
and the running mean each shape family keeps of its fits."""

from __future__ import annotations

import math

import pytest

from pdserve.planner.correction import (
    SCALE_MAX,
    SCALE_MIN,
    WEIGHT,
    Corrections,
    Load,
    family,
    fit_prefill_scale,
    mean_ttft_s,
)
from pdserve.planner.scaling import demand
from pdserve.planner.simulate import Cluster
from tests.test_autoscale_policy import PD, PROFILE, SLO, window

LIGHT = (1.0, 200, 2)  # req/s, prompt tokens, output tokens: the prefill node is 40% busy


@pytest.mark.parametrize("true_scale", [0.7, 1.6, 2.5])
@pytest.mark.parametrize("cluster", [PD, Cluster(0, 0, 2)])
def test_the_fit_recovers_the_scale_a_measured_ttft_came_from(true_scale, cluster):
    requests = demand(window(LIGHT))
    measured = mean_ttft_s(PROFILE.with_prefill_scale(true_scale), cluster, requests, SLO)
    assert fit_prefill_scale(PROFILE, cluster, requests, SLO, measured) == pytest.approx(true_scale, rel=0.03)


def test_a_fit_stays_within_its_bounds():
    requests = demand(window(LIGHT))
    assert fit_prefill_scale(PROFILE, PD, requests, SLO, 100.0) == pytest.approx(SCALE_MAX, rel=0.02)
    assert fit_prefill_scale(PROFILE, PD, requests, SLO, 1e-3) == pytest.approx(SCALE_MIN, rel=0.02)


def test_each_family_keeps_a_running_geometric_mean_of_its_fits():
    corrections = Corrections()
    requests = demand(window(LIGHT))
    measured = mean_ttft_s(PROFILE.with_prefill_scale(2.0), PD, requests, SLO)
    fits = [corrections.update(PROFILE, PD, requests, SLO, measured, Load(200, 2)) for _ in range(3)]
    assert fits == pytest.approx([2.0] * 3, rel=0.03)
    expected = math.exp(math.log(fits[0]) * (1 - (1 - WEIGHT) ** 3))  # from 1 towards the fit
    assert corrections.prefill_scale["disaggregated"] == pytest.approx(expected, rel=1e-6)
    # a family the cluster has not run on this load takes the measured one's scale: it is not
    # ranked faster for being unmeasured
    assert corrections.prefill_scale["colocated"] == corrections.prefill_scale["disaggregated"]
    assert corrections.lender("colocated") == "disaggregated" and corrections.lender("disaggregated") is None
    assert "colocated x1.50 (0 fit(s) near this load; disaggregated's)" in corrections.describe()
    assert family(Cluster(1, 2)) == family(Cluster(2, 1, 1)) == "disaggregated"
    assert family(Cluster(0, 0, 3)) == "colocated"
    # the corrected profile: every prefill that many times as long, nothing else changed
    corrected = corrections.profile_for(PROFILE, Cluster(2, 1))
    scale = corrections.prefill_scale["disaggregated"]
    assert corrected.prefill_s(500) == pytest.approx(PROFILE.prefill_s(500) * scale)
    assert corrected.decode == PROFILE.decode and corrected.transfer == PROFILE.transfer
    assert corrections.profile_for(PROFILE, Cluster(0, 0, 1)).prefill_s(500) == pytest.approx(
        PROFILE.prefill_s(500) * scale
    )
    assert Corrections().profile_for(PROFILE, Cluster(0, 0, 1)) is PROFILE  # nothing measured


def test_a_fit_holds_for_loads_near_the_one_it_was_measured_on():
    """Run 8 of the shifting-load study: the colocated windows' TTFT was 1.57x the model's while
    outputs were long; that scale must not hold 2 colocated back once outputs are short again."""
    corrections = Corrections()
    requests = demand(window(LIGHT))
    long_out, short_out = Load(576, 96), Load(576, 4)
    slow = mean_ttft_s(PROFILE.with_prefill_scale(1.6), Cluster(0, 0, 2), requests, SLO)
    fits = [corrections.update(PROFILE, Cluster(0, 0, 2), requests, SLO, slow, long_out) for _ in range(4)]
    scale = corrections.prefill_scale["colocated"]
    assert (
        scale == pytest.approx(math.exp(math.log(fits[0]) * (1 - (1 - WEIGHT) ** 4)), rel=0.02)
        and scale > 1.3
    )
    assert "colocated x" in corrections.describe() and "(4 fit(s) near this load)" in corrections.describe()
    corrections.focus(short_out)  # prompts as long, outputs 24x shorter: no fit applies
    assert corrections.prefill_scale == {"disaggregated": 1.0, "colocated": 1.0}
    assert corrections.profile_for(PROFILE, Cluster(0, 0, 2)).prefill_s(500) == PROFILE.prefill_s(500)
    corrections.focus(Load(700, 80))  # within 1.5x of the long-output load in both: its fits apply
    assert corrections.prefill_scale["colocated"] == pytest.approx(scale)
    fast = mean_ttft_s(PROFILE.with_prefill_scale(0.8), Cluster(0, 0, 2), requests, SLO)
    corrections.update(PROFILE, Cluster(0, 0, 2), requests, SLO, fast, short_out)
    assert corrections.prefill_scale["colocated"] == pytest.approx(0.8**WEIGHT, rel=0.02)  # its own fit only
    corrections.focus(long_out)
    assert corrections.prefill_scale["colocated"] == pytest.approx(scale)  # kept for when it returns
    assert Load(0, 0).near(Load(1, 1))  # empty windows count as one token


def test_pdserve_up_takes_the_profile_as_calibrated_only_when_told_and_only_with_autoscale():
    from pdserve.cli.main import build_parser
    from pdserve.cli.up_slo import node_budget

    parser = build_parser()
    assert parser.parse_args(["up"]).autoscale_trust_profile is None  # corrected by default
    args = parser.parse_args(["up", "--autoscale-trust-profile"])
    assert args.autoscale_trust_profile is True
    with pytest.raises(ValueError, match="--autoscale-trust-profile: only with --autoscale"):
        node_budget(args, num_started=2, cores=2)
