"""`pdserve bench serve` workloads, trace files and arrival processes: seeded, bounded, shaped as said."""

from __future__ import annotations

import json
import math
import statistics

import pytest

from pdserve.bench_serve import trace, workload
from pdserve.bench_serve.arrivals import Arrivals, replayed_times
from pdserve.bench_serve.spec import WorkloadKind, WorkloadSpec, parse_rates
from pdserve.bench_serve.workload import ChatMessage, LengthMix, PromptStyle, WorkItem

IDS, TEXT, CHAT = PromptStyle.TOKEN_IDS, PromptStyle.TEXT, PromptStyle.CHAT


@pytest.mark.parametrize("kind", [k for k in WorkloadKind if k is not WorkloadKind.FILE])
@pytest.mark.parametrize("style", list(PromptStyle))
def test_every_generator_gives_the_same_workload_for_the_same_seed_and_another_for_another(kind, style):
    spec = WorkloadSpec(
        kind,
        style,
        num_requests=16,
        input_len=12,
        output_len=5,
        min_input_len=4,
        min_output_len=2,
        prefix_len=20,
        num_groups=2,
        questions_per_group=4,
        num_conversations=2,
        num_turns=3,
    )
    assert spec.build(seed=7) == spec.build(seed=7)
    assert spec.build(seed=7) != spec.build(seed=8)


def test_fixed_token_id_prompts_have_exactly_the_asked_lengths_within_the_id_range():
    items = workload.fixed(10, 33, 7, IDS, seed=0, space=workload.TokenSpace(500, 600))
    assert len(items) == 10
    assert all(len(i.prompt) == 33 and i.output_len == 7 for i in items)
    assert all(500 <= t < 600 for i in items for t in i.prompt)


def test_text_prompts_have_one_word_per_token_and_chat_prompts_one_user_message():
    text = workload.fixed(1, 9, 4, TEXT, seed=0)[0].prompt
    assert isinstance(text, str) and len(text.split(" ")) == 9
    (message,) = workload.fixed(1, 9, 4, CHAT, seed=0)[0].prompt
    assert message.role == "user" and message.content == text  # same draws, another rendering


def test_mix_lengths_stay_in_bounds_and_have_a_long_tail():
    inputs, outputs = LengthMix(64, 1.0, 16, 1024), LengthMix(32, 0.8, 8, 256)
    items = workload.mix(400, inputs, outputs, IDS, seed=1)
    input_lens = [len(i.prompt) for i in items]
    output_lens = [i.output_len for i in items]
    assert min(input_lens) >= 16 and max(input_lens) <= 1024
    assert min(output_lens) >= 8 and max(output_lens) <= 256
    assert 48 <= statistics.median(input_lens) <= 85  # around the median asked for
    assert statistics.mean(input_lens) > statistics.median(input_lens)  # skewed right
    assert sorted(input_lens)[int(0.95 * len(input_lens))] > 3 * statistics.median(input_lens)


def test_length_mix_refuses_a_median_outside_its_bounds():
    with pytest.raises(ValueError):
        LengthMix(median=8, sigma=1.0, low=16, high=64)


def test_shared_prefix_groups_share_exactly_their_system_prompt():
    items = workload.shared_prefix(3, 4, prefix_len=20, question_len=6, output_len=5, style=CHAT, seed=0)
    assert len(items) == 12
    by_prefix: dict[str, list[str]] = {}
    for item in items:
        system, user = item.prompt
        assert (system.role, user.role) == ("system", "user")
        by_prefix.setdefault(system.content, []).append(user.content)
    assert sorted(len(questions) for questions in by_prefix.values()) == [4, 4, 4]
    assert len({q for questions in by_prefix.values() for q in questions}) == 12


def test_shared_prefix_token_ids_start_with_the_group_prefix():
    items = workload.shared_prefix(2, 3, prefix_len=16, question_len=4, output_len=5, style=IDS, seed=0)
    assert all(len(i.prompt) == 20 for i in items)
    assert len({i.prompt[:16] for i in items}) == 2
    assert len({i.prompt[16:] for i in items}) == 6


def test_multi_turn_history_grows_by_the_last_reply_and_the_next_question():
    items = workload.multi_turn(2, 3, turn_len=5, output_len=4, style=CHAT, seed=0)
    assert [(i.conversation, i.turn) for i in items] == [(0, 0), (1, 0), (0, 1), (1, 1), (0, 2), (1, 2)]
    conv0 = [i.prompt for i in items if i.conversation == 0]
    assert [len(p) for p in conv0] == [1, 3, 5]
    assert [m.role for m in conv0[2]] == ["user", "assistant", "user", "assistant", "user"]
    for earlier, later in zip(conv0, conv0[1:], strict=False):
        assert later[: len(earlier)] == earlier  # each turn resends the whole history
    ids = workload.multi_turn(2, 3, turn_len=5, output_len=4, style=IDS, seed=0)
    assert [len(i.prompt) for i in ids if i.conversation == 1] == [5, 14, 23]


def test_workload_file_round_trips_every_prompt_kind(tmp_path):
    items = [
        WorkItem("plain text", 3, 0.0),
        WorkItem((5, 6, 7), 8, 0.25),
        WorkItem(
            (ChatMessage("system", "be brief"), ChatMessage("user", "hi")), 2, 1.5, conversation=4, turn=1
        ),
    ]
    path = tmp_path / "trace.jsonl"
    trace.write(path, items)
    assert len(path.read_text().splitlines()) == 3
    assert trace.read(path) == items
    spec = WorkloadSpec(WorkloadKind.FILE, IDS, num_requests=2, path=path)
    assert spec.build(seed=0) == items[:2]


def test_generated_workloads_round_trip_through_the_file_too(tmp_path):
    items = workload.multi_turn(2, 2, 3, 4, CHAT, seed=3) + workload.fixed(2, 3, 4, IDS, seed=3)
    trace.write(tmp_path / "w.jsonl", items)
    assert trace.read(tmp_path / "w.jsonl") == items


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ({"prompt": "x"}, "needs 'prompt' and 'output_len'"),
        ({"prompt": "x", "output_len": 0}, "positive integer"),
        ({"prompt": [], "output_len": 1}, "prompt must be"),
        ({"prompt": "x", "output_len": 1, "arrival_s": -1}, "arrival_s"),
        ({"prompt": "x", "output_len": 1, "extra": 1}, "unknown fields"),
    ],
)
def test_workload_file_names_the_line_that_is_wrong(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"prompt": "ok", "output_len": 1}) + "\n" + json.dumps(line) + "\n")
    with pytest.raises(ValueError, match=message) as info:
        trace.read(path)
    assert f"{path}:2" in str(info.value)


def test_workload_file_arrivals_must_not_go_back_in_time(tmp_path):
    path = tmp_path / "t.jsonl"
    trace.write(path, [WorkItem("a", 1, 1.0), WorkItem("b", 1, 0.5)])
    with pytest.raises(ValueError, match="must not decrease"):
        trace.read(path)


def test_poisson_arrivals_are_seeded_start_at_zero_and_average_the_rate():
    times = Arrivals(rate=4.0, seed=1).send_times(2000)
    assert times == Arrivals(rate=4.0, seed=1).send_times(2000)
    assert times != Arrivals(rate=4.0, seed=2).send_times(2000)
    assert len(times) == 2000 and times[0] == 0.0 and times == sorted(times)
    assert 1999 / times[-1] == pytest.approx(4.0, rel=0.08)


def test_burstiness_below_one_makes_gaps_more_variable_at_the_same_rate():
    def gap_cv(burstiness: float) -> float:
        t = Arrivals(rate=2.0, burstiness=burstiness, seed=0).send_times(3000)
        gaps = [b - a for a, b in zip(t, t[1:], strict=False)]
        return statistics.stdev(gaps) / statistics.mean(gaps)

    assert gap_cv(1.0) == pytest.approx(1.0, abs=0.1)  # exponential gaps
    assert gap_cv(0.25) > 1.6 and gap_cv(4.0) < 0.6  # gamma: cv = 1 / sqrt(shape)


def test_arrivals_stop_at_the_request_count_and_the_time_bound():
    assert len(Arrivals(rate=10.0, seed=0).send_times(5)) == 5
    bounded = Arrivals(rate=10.0, seed=0).send_times(10_000, max_s=3.0)
    assert 20 < len(bounded) < 45 and all(t < 3.0 for t in bounded)
    assert Arrivals(rate=math.inf).send_times(4) == [0.0] * 4
    assert replayed_times([0.0, 1.0, 2.0, 3.0], num=3, max_s=1.5) == [0.0, 1.0]


def test_arrivals_and_rates_refuse_nonsense():
    with pytest.raises(ValueError):
        Arrivals(rate=0.0)
    with pytest.raises(ValueError):
        Arrivals(rate=1.0, burstiness=0.0)
    assert parse_rates("0.5, 2,inf") == (0.5, 2.0, math.inf)
    with pytest.raises(ValueError):
        parse_rates("1,-2")
