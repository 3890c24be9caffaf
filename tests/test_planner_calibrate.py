"""`pdserve plan calibrate` end to end on a tiny model: a profile the simulator can read."""

from __future__ import annotations

import pytest

from pdserve.cli.main import main
from pdserve.planner.calibrate import DECODE_HEADROOM, Grid
from pdserve.planner.profile import Profile
from tests.tiny_models import make_tiny_model


@pytest.mark.usefixtures("processes")
def test_calibrate_writes_a_profile_of_the_measured_grid_and_a_transfer_that_grows_with_bytes(
    tmp_path, capsys
):
    model = make_tiny_model("llama", tmp_path)
    out = tmp_path / "profile.json"
    assert (
        main(
            [
                "plan",
                "calibrate",
                "--model",
                str(model),
                "--out",
                str(out),
                "--prefill-lens",
                "8,64",
                "--decode-batches",
                "1,4",
                "--decode-contexts",
                "16,64",
                "--repeats",
                "1",
            ]
        )
        == 0
    )
    profile = Profile.load(out)
    assert profile.prefill.xs == (8.0, 64.0) and all(t > 0 for t in profile.prefill.ys)
    assert profile.decode.batches == (1.0, 4.0) and profile.decode.contexts == (16.0, 64.0)
    assert all(t > 0 for row in profile.decode.seconds for t in row)
    assert [b for b, _ in profile.measured["transfer"]] == [
        64 * profile.kv_bytes_per_token,
        512 * profile.kv_bytes_per_token,
    ]
    assert profile.transfer_s(512) >= profile.transfer_s(64) > 0
    assert f"profile: {out}" in capsys.readouterr().out


def test_decode_points_hold_every_request_while_a_small_budget_prefills_the_later_ones():
    # 16 prompts of 60 tokens at 24 tokens a step: the first prompts decode for 40-odd steps
    # while the last ones prefill (a slow machine's step budget cuts prompts as small); each
    # batch is still timed with its requests running, not after they ran out of tokens
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.planner.calibrate import _decode_points

    engine = LLMEngine(
        EngineConfig(
            model=str(make_tiny_model("llama")),
            num_kv_blocks=400,  # no preemption: 16 x (60 + 200) tokens
            max_num_batched_tokens=24,
            enable_prefix_caching=False,
            max_step_s=10.0,
        )
    )
    prompts = [[3 + (i * 7 + j) % 200 for j in range(60)] for i in range(16)]
    points = _decode_points(engine, prompts, [16, 4, 1])
    assert [batch for batch, _, _ in points] == [16, 4, 1]
    assert all(context >= 60 * batch and seconds > 0 for batch, context, seconds in points)
    assert not engine.has_work()


def test_the_grid_is_cut_to_the_models_context():
    """`pdserve up --autoscale` calibrates the served model with the default grid: on a model of
    512 tokens its 512-token prompt was refused and the launch failed."""
    grid = Grid().within(512)
    assert grid.prefill_lens == (16, 64, 128, 256, 511)
    assert grid.decode_contexts == (64, 512 - DECODE_HEADROOM)
    assert Grid().within(8192) == Grid()
    with pytest.raises(ValueError, match="too short to calibrate"):
        Grid().within(100)  # decode contexts 36 and 36: one length left


def test_calibrate_measures_what_a_short_context_model_takes(tmp_path, capsys):
    model = make_tiny_model("llama", tmp_path)  # 512 positions
    out = tmp_path / "profile.json"
    argv = ["plan", "calibrate", "--model", str(model), "--out", str(out), "--prefill-lens", "8,4096"]
    argv += ["--decode-batches", "1,2", "--decode-contexts", "16,4096", "--repeats", "1", "--no-transfer"]
    assert main(argv) == 0
    profile = Profile.load(out)
    assert profile.prefill.xs == (8.0, 511.0)
    assert profile.decode.contexts == (16.0, 512.0 - DECODE_HEADROOM)
    assert "the model's context is 512 tokens" in capsys.readouterr().out
