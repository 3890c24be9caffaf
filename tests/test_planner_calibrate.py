"""`pdserve plan calibrate` end to end on a tiny model: a profile the simulator can read."""

from __future__ import annotations

from pdserve_cli.main import main
from planner.profile import Profile
from tests.tiny_models import make_tiny_model


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
