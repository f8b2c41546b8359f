"""`otb-spec experiment` (issue 16): the pipeline runs end to end in --quick, is deterministic, resumes after an
interruption without redoing or changing finished work, rejects bad input by name, and its advantages are the
reference's on the policy's own batches. It asserts nothing about accuracy: a quick run is too short to."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("matplotlib")

import otb_spec as otb  # noqa: E402
from otb_experiment import QUICK, run_experiment  # noqa: E402
from otb_experiment import run as experiment  # noqa: E402
from otb_experiment.policy import Policy, sample, teacher_forced, token_statistics  # noqa: E402
from otb_spec.cli import main  # noqa: E402
from otb_spec.tolerances import otb_comparison_tolerance, summation_tolerance  # noqa: E402

SMALL = dataclasses.replace(QUICK, arms=("gm32", "otb4"), steps={"gm32": 2, "otb4": 6}, checkpoint_every=2,
                            sft_steps_max=20)


def test_quick_command_writes_results_and_plot(tmp_path, capsys):
    out = tmp_path / "quick"
    assert main(["experiment", "--quick", "--out", str(out), "--no-progress"]) == 0
    results = json.loads((out / "results.json").read_text())
    assert (out / "accuracy_vs_tokens.png").stat().st_size > 0
    assert set(results["arms"]) == {f"pg/{arm}" for arm in ("gm32", "otb4", "loo4", "gm4", "rloo4")}
    for key, entry in results["arms"].items():
        assert 0.0 <= entry["final_accuracy"]["mean"] <= 1.0 and entry["tokens"]["mean"] > 0, key
        assert entry["diverged"] == 0
    assert set(results["decision"]["pg"]) == {"successes_within_35_percent", "needed", "gm32_gain", "valid",
                                                "claim_supported"}
    gm32 = results["arms"]["pg/gm32"]
    assert set(gm32["variance_start"][0]) == set(QUICK.arms) and gm32["proxy_start"]
    assert "pre-registered claim supported" in capsys.readouterr().out


def test_interrupted_run_resumes_to_the_same_result(tmp_path, monkeypatch):
    reference_dir, interrupted_dir = tmp_path / "whole", tmp_path / "interrupted"
    run_experiment(SMALL, str(reference_dir), progress=False)
    calls = {"count": 0}
    original = experiment.train_step

    def failing(*args, **kwargs):
        calls["count"] += 1
        if calls["count"] == 2 + 5:                     # gm32's 2 steps, then otb4's 5th step (after a checkpoint)
            raise KeyboardInterrupt
        return original(*args, **kwargs)

    monkeypatch.setattr(experiment, "train_step", failing)
    with pytest.raises(KeyboardInterrupt):
        run_experiment(SMALL, str(interrupted_dir), progress=False)
    assert (interrupted_dir / "runs" / "pg-gm32-seed0.json").exists()          # the finished run is kept
    assert (interrupted_dir / "checkpoints" / "pg-otb4-seed0.pt").exists()
    monkeypatch.setattr(experiment, "train_step", original)
    finished_before = (interrupted_dir / "runs" / "pg-gm32-seed0.json").read_text()
    run_experiment(SMALL, str(interrupted_dir), progress=False)
    assert (interrupted_dir / "runs" / "pg-gm32-seed0.json").read_text() == finished_before
    for name in ("pg-gm32-seed0.json", "pg-otb4-seed0.json"):
        assert json.loads((interrupted_dir / "runs" / name).read_text()) == \
            json.loads((reference_dir / "runs" / name).read_text()), name
    assert (interrupted_dir / "checkpoints" / "warm-seed0.pt").exists()        # the warm start stays cached
    assert not (interrupted_dir / "checkpoints" / "pg-otb4-seed0.pt").exists()


@pytest.mark.parametrize("arguments, message", [
    (["--arm", "otb8"], "arms: unknown arm 'otb8'"),
    (["--samples", "1"], "samples: N must be at least 2"),
    (["--update", "sgd"], "updates: unknown update rule 'sgd'"),
])
def test_bad_input_is_named(tmp_path, capsys, arguments, message):
    assert main(["experiment", "--quick", "--out", str(tmp_path / "x"), "--no-progress", *arguments]) == 2
    assert message in capsys.readouterr().err


def test_unwritable_output_is_named(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    assert main(["experiment", "--quick", "--out", str(blocker / "out"), "--no-progress"]) == 2
    assert "out: cannot write the output directory" in capsys.readouterr().err


@pytest.mark.parametrize("arm", ["otb4", "loo4", "gm4", "rloo4", "gm32"])
def test_advantages_are_the_reference_on_the_policys_batches(arm):
    torch.manual_seed(0)
    policy = Policy()
    train, _ = experiment._splits(QUICK, 0)
    prompts = experiment._prompts_at(train, np.arange(4))
    rollouts = sample(policy, prompts, experiment.ARMS[arm][1], torch.Generator().manual_seed(1), QUICK.max_response)
    rewards = experiment._terminal_rewards(np.arange(len(rollouts.lengths)) % 3 * 0.5, rollouts.mask)
    with torch.no_grad():
        stats = token_statistics(teacher_forced(policy, prompts, rollouts), rollouts.tokens)
    mask = rollouts.mask
    log_probs, spp = stats.log_probs * mask, stats.sum_pi_squared * mask + (1 - mask)
    got = experiment.arm_advantages(arm, rewards, mask, rollouts.prompt_rows, log_probs, spp).numpy()
    arrays = [a.numpy().astype(np.float64) for a in (rewards, mask, log_probs, spp)]
    kind = experiment.ARMS[arm][0]
    if kind in ("otb", "leave_one_out"):
        function = otb.optimal_token_baseline if kind == "otb" else otb.leave_one_out_token_baseline
        expected = function(arrays[0], arrays[1], rollouts.prompt_rows, arrays[2], arrays[3]).advantages
        tolerance, _ = otb_comparison_tolerance(arrays[0], arrays[1], rollouts.prompt_rows, arrays[2], arrays[3],
                                                leave_one_out=kind == "leave_one_out",
                                                handle_zero_tail=kind == "otb", compute_dtype=np.float32)
        tolerance.assert_close(got, expected, f"{arm} advantages")
    else:
        function = otb.rloo_advantage if kind == "rloo" else otb.group_mean_advantage
        expected = function(arrays[0], arrays[1], rollouts.prompt_rows).advantages
        tolerance = summation_tolerance(experiment.ARMS[arm][1], float(np.abs(arrays[0]).max()), np.float32)
        tolerance.assert_close(got, expected, f"{arm} advantages")
