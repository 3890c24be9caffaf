"""`pdserve plan`'s model: hand-checkable cases with a profile of round numbers.

The profile: prefill 1 ms per token, a decode step 10 ms whatever the batch, a transfer 5 ms.
"""

from __future__ import annotations

import pytest

from pdserve.bench_serve.metrics import Slo
from pdserve.planner.predict import predict, slo_fraction
from pdserve.planner.profile import DecodeStepGrid, PiecewiseLinear, Profile, TransferModel
from pdserve.planner.recommend import rank, shapes
from pdserve.planner.simulate import Cluster, SimRequest, simulate

PROFILE = Profile(
    model="toy",
    threads=1,
    kv_bytes_per_token=1000,
    max_num_batched_tokens=2048,
    max_num_seqs=64,
    prefill=PiecewiseLinear((0.0, 1000.0), (0.0, 1.0)),
    decode=DecodeStepGrid.constant(0.010),
    transfer=TransferModel(0.005, 0.0),
)
PD = Cluster(num_prefill=1, num_decode=1)


def test_one_request_first_token_after_its_prefill_then_transfer_then_one_step_per_token():
    [out] = simulate(PROFILE, PD, [SimRequest(0.0, 100, 3)])
    assert out.prefill_node == "prefill-0" and out.decode_node == "decode-0"
    assert out.token_times_s == pytest.approx((0.100, 0.115, 0.125))  # prefill; + transfer + step; + step
    assert out.ttft_s == pytest.approx(0.100) and out.tpot_s == pytest.approx(0.0125)


def test_short_prompt_prefills_on_the_decode_node_without_a_transfer():
    [out] = simulate(PROFILE, PD, [SimRequest(1.0, 40, 2)])  # below the threshold of 64
    assert out.prefill_node is None
    assert out.token_times_s == pytest.approx((1.040, 1.050))


def test_colocated_node_prefills_a_long_prompt_itself():
    [out] = simulate(PROFILE, Cluster(0, 0, num_colocated=1), [SimRequest(0.0, 500, 2)])
    assert out.prefill_node is None and out.decode_node == "colocated-0"
    assert out.token_times_s == pytest.approx((0.500, 0.510))


def test_prompts_queued_together_share_one_prefill_batch():
    outs = simulate(PROFILE, PD, [SimRequest(0.0, 100, 1), SimRequest(0.0, 100, 1), SimRequest(0.0, 100, 1)])
    # The first starts alone at 0; the other two arrive while it runs and go together: 0.1 + 0.2.
    assert [o.token_times_s for o in outs] == [
        pytest.approx((0.1,)),
        pytest.approx((0.3,)),
        pytest.approx((0.3,)),
    ]


def test_local_prefill_lengthens_the_running_batch_step():
    outs = simulate(PROFILE, PD, [SimRequest(0.0, 10, 3), SimRequest(0.015, 50, 1)])
    # step 1: prefill 10 (0.010); step 2: decode (0.010) -> 0.020; the second arrived during step 2:
    # step 3 decodes the first and prefills 50 tokens: 0.010 + 0.050 -> 0.080.
    assert outs[0].token_times_s == pytest.approx((0.010, 0.020, 0.080))
    assert outs[1].token_times_s == pytest.approx((0.080,))
    assert outs[1].decode_wait_s == pytest.approx(0.005)


def test_a_long_prompt_is_chunked_by_the_step_budget_and_a_running_decode_shares_its_steps():
    # The toy profile's step-time target: 1 s (the full 2048-token budget would take 2 s), so steps
    # of up to 1000 tokens. A decodes; B's 2500-token prompt arrives during A's second step.
    requests = [SimRequest(0.0, 10, 5), SimRequest(0.015, 2500, 1)]
    a, b = simulate(PROFILE, Cluster(0, 0, 1), requests)
    # each of A's next steps carries B's chunk of what A's decode row leaves: 999, 999, 502 tokens
    assert a.token_times_s == pytest.approx((0.010, 0.020, 1.029, 2.038, 2.550))
    assert b.token_times_s == pytest.approx((2.550,))  # the end of its last chunk
    # With a TPOT SLO of 0.1 s as the cluster's flag, steps that carry a decode keep to 0.08 s
    # (0.8 of it): B's chunks beside A shrink to the budget's floor (80 tokens less A's row).
    a, b = simulate(PROFILE, Cluster(0, 0, 1), requests, Slo(ttft_s=10.0, tpot_s=0.1))
    assert a.tpot_s == pytest.approx((0.010 + 0.079) * 3 / 4 + 0.010 / 4) and a.tpot_s < 0.1
    # then alone: 2500 - 3 * 79 tokens in steps of 1000
    assert b.token_times_s == pytest.approx((a.token_times_s[-1] + 1.0 + 1.0 + 0.263,))


def test_a_backed_up_prefill_pool_sends_long_prompts_to_the_decode_nodes_own_queue():
    requests = [SimRequest(0.0, 300, 2) for _ in range(4)]  # 0.3 s of prefill each, all at once
    # Each goes where it waits less, unless the prefill node is less than 0.2 s worse: 1st: 0.3
    # against 0.3 s; 2nd: 0.6 against 0.3; 3rd: 0.6 against 0.6 (the 2nd is prefilling locally);
    # 4th: 0.9 against 0.6, under a TPOT SLO whose decode-step target the node keeps (without one
    # a decode node with a request running prefills nothing more: the 4th waits for prefill-0).
    outs = simulate(PROFILE, Cluster(1, 1, local_prefill_margin_s=0.2), requests, slo_flags=Slo(60.0, 0.25))
    assert [o.prefill_node for o in outs] == ["prefill-0", None, "prefill-0", None]
    outs_without = simulate(PROFILE, Cluster(1, 1, local_prefill_margin_s=0.2), requests)
    assert [o.prefill_node for o in outs_without] == ["prefill-0", None, "prefill-0", "prefill-0"]
    assert outs[1].ttft_s == pytest.approx(0.3)  # beside nothing: a step of 300 prompt tokens
    outs = simulate(PROFILE, Cluster(1, 1, local_prefill_margin_s=-1.0), requests)
    assert [o.prefill_node for o in outs] == ["prefill-0"] * 4
    assert [o.ttft_s for o in outs] == pytest.approx([0.3, 1.2, 1.2, 1.2])  # 0.3 s, then one batch of 3


def test_a_saturated_decode_node_queue_grows_with_every_arrival():
    one_seq = Profile(**{**{f: getattr(PROFILE, f) for f in PROFILE.__slots__}, "max_num_seqs": 1})
    requests = [SimRequest(0.05 * k, 20, 11) for k in range(8)]  # 0.1 s of decode each, one every 0.05 s
    outs = simulate(one_seq, Cluster(num_prefill=1, num_decode=1, disagg_threshold=0), requests)
    waits = [o.decode_wait_s for o in outs]
    assert waits == pytest.approx([0.05 * k for k in range(8)])  # falls 0.05 s further behind per request
    assert all(o.ttft_s == pytest.approx(0.02) for o in outs)  # the prefill node keeps up: TPOT pays


def test_load_spreads_over_decode_nodes_by_outstanding_blocks():
    outs = simulate(PROFILE, Cluster(1, 2), [SimRequest(0.0, 100, 8), SimRequest(0.0, 100, 8)])
    assert {o.decode_node for o in outs} == {"decode-0", "decode-1"}


def test_prediction_counts_goodput_against_the_slos():
    requests = [SimRequest(0.0, 100, 3), SimRequest(10.0, 900, 3)]
    summary = predict(PROFILE, PD, requests, Slo(ttft_s=0.5, tpot_s=0.1), slo_flags=False)
    assert summary.num_ok == 2 and summary.ttft.p50 == pytest.approx(0.5)  # (0.1 + 0.9) / 2
    assert summary.duration_s == pytest.approx(10.0 + 0.9 + 0.025)
    assert slo_fraction(summary) == pytest.approx(0.5)  # the 900-token prompt misses the TTFT target
    # With the SLO as the cluster's flags, the router sheds it: 0.9 s of queue at 1000 tokens/s.
    summary = predict(PROFILE, PD, requests, Slo(ttft_s=0.5, tpot_s=0.1))
    assert summary.num_ok == 1 and summary.errors == {"http_429": 1}
    assert slo_fraction(summary) == pytest.approx(0.5)


def test_recommend_picks_the_smallest_cluster_that_meets_the_slos():
    requests = [SimRequest(0.0, 400, 4) for _ in range(4)]  # 0.4 s of prefill each, all at once
    slo = Slo(ttft_s=0.5, tpot_s=0.1)  # only a prompt prefilled alone meets it
    ranked = rank(PROFILE, requests, slo, shapes(5, colocated=False), min_fraction=0.9)
    assert ranked[0].cluster.label == "4P+1D" and ranked[0].slo_fraction == 1.0
    assert [c.cluster.label for c in ranked if c.meets(0.9)] == ["4P+1D"]
    with_colocated = rank(PROFILE, requests, slo, shapes(5), min_fraction=0.9)
    assert [c.cluster.label for c in with_colocated if c.meets(0.9)] == [
        "4 colocated",
        "4P+1D",
        "5 colocated",
    ]


def test_piecewise_linear_interpolates_and_extends_the_end_slopes():
    curve = PiecewiseLinear((10.0, 20.0, 40.0), (1.0, 2.0, 6.0))
    assert [curve(x) for x in (15, 20, 30, 50, 5, 0)] == pytest.approx([1.5, 2.0, 4.0, 8.0, 0.5, 0.0])


def test_decode_grid_interpolates_in_batch_then_in_context_per_sequence():
    grid = DecodeStepGrid((1.0, 5.0), (100.0, 300.0), ((0.010, 0.030), (0.020, 0.060)))
    assert grid(1, 100) == pytest.approx(0.010) and grid(5, 1500) == pytest.approx(0.060)
    assert grid(3, 3 * 200) == pytest.approx((0.020 + 0.040) / 2)  # midway on both axes
    assert grid(9, 9 * 100) == pytest.approx(0.050)  # past the last batch: the same slope on
    assert grid(0, 0) == 0.0


def test_profile_round_trips_through_json(tmp_path):
    PROFILE.save(tmp_path / "p.json")
    assert Profile.load(tmp_path / "p.json") == PROFILE


def test_simulate_command_replays_a_bench_workload_through_the_model(tmp_path, capsys):
    from pdserve.cli.main import main

    PROFILE.save(tmp_path / "p.json")
    args = [
        "--profile",
        str(tmp_path / "p.json"),
        "--workload",
        "fixed",
        "--num-requests",
        "1",
        "--input-len",
        "100",
        "--output-len",
        "3",
        "--request-rate",
        "1",
    ]
    assert main(["plan", "simulate", *args, "--json", str(tmp_path / "out.json")]) == 0
    out = capsys.readouterr().out
    assert "1P+1D, 1 req/s (predicted)" in out
    assert "TTFT              100.0    100.0    100.0    100.0" in out  # the one request: its prefill
    assert main(["plan", "recommend", *args, "--max-nodes", "2", "--ttft-slo-ms", "200"]) == 0
    assert "recommended: 1 colocated (1 node(s) of 1 thread(s) each)" in capsys.readouterr().out
