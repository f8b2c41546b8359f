"""`otb-spec experiment` (issues 16, 26): the pipeline runs end to end in --quick and writes the report, is
deterministic, resumes after an interruption without redoing or changing finished work, rejects bad input by name;
its advantages are the reference's on the policy's own batches; the task, the pre-registered decision rule and the
stability definitions do what docs/experiment.md says. Nothing here asserts anything about accuracy: a quick run is
too short to."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("matplotlib")

import otb_spec as otb  # noqa: E402
from otb_experiment import task  # noqa: E402
from otb_experiment import run as experiment  # noqa: E402
from otb_experiment.policy import (Policy, greedy, sample, teacher_forced, token_log_probs,  # noqa: E402
                                   token_statistics)
from otb_spec.cli import main  # noqa: E402
from otb_spec.tolerances import otb_comparison_tolerance, port_tolerance, summation_tolerance  # noqa: E402

QUICK = experiment.QUICK_MAIN


@pytest.fixture(autouse=True)
def one_torch_thread():
    """The experiment runs on one thread (run_experiment sets it); the direct calls here do too, and the caller's
    setting is restored."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
SMALL = dataclasses.replace(QUICK, arms=("gm32", "otb4"), reference_steps=2, checkpoint_every=2, sft_steps_max=20)


def test_quick_command_writes_results_report_and_plot(tmp_path, capsys):
    out = tmp_path / "quick"
    assert main(["experiment", "--quick", "--out", str(out), "--no-progress"]) == 0
    assert (out / "accuracy_vs_tokens.png").stat().st_size > 0
    report = (out / "report.md").read_text()
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary) == {"main", "long"} and "training" not in summary["main"]["arms"]["pg/otb4"]
    for setup in ("main", "long"):
        results = json.loads((out / setup / "results.json").read_text())
        assert f"## Set-up `{setup}`" in report
        for key, entry in results["arms"].items():
            assert 0.0 <= entry["final_accuracy"]["mean"] <= 1.0 and entry["tokens"]["mean"] > 0, key
            assert len(entry["training"][0]["grad_norm"]) == experiment.steps_of(
                dataclasses.replace(experiment.QUICK_MAIN if setup == "main" else experiment.QUICK_LONG), key[3:])
    main_results = json.loads((out / "main" / "results.json").read_text())
    assert set(main_results["arms"]) == {f"pg/{arm}" for arm in ("gm32", "otb4", "loo4", "gm4", "rloo4")}
    assert set(main_results["decision"]["pg"]) >= {"arms", "claim", "gm32_gain", "margin", "confidence"}
    gm32 = main_results["arms"]["pg/gm32"]
    assert set(gm32["variance_start"][0]) == set(QUICK.arms) and gm32["proxy_start"]
    assert "pre-registered claim:" in capsys.readouterr().out


def test_publish_copies_the_report_into_the_docs(tmp_path):
    from otb_experiment import report

    out, docs = tmp_path / "run", tmp_path / "docs"
    experiment.run_all([SMALL], str(out), progress=False)
    docs.mkdir()
    (docs / "experiment.md").write_text("# E\n\n## Pre-registration\n\nrule\n\n## Outcome\n\nNone yet.\n\n"
                                        "## Running it\n\ncommands\n")
    report.publish(str(out), str(docs))
    text = (docs / "experiment.md").read_text()
    assert text.startswith("# E\n\n## Pre-registration\n\nrule\n\n## Outcome\n\n") and "None yet" not in text
    assert "### Set-up `main`" in text and text.endswith("## Running it\n\ncommands\n")
    assert "Draft README sentences (generated): In the pre-registered run (1 seeds)" in text
    summary = json.loads((out / "summary.json").read_text())
    assert json.loads((docs / "experiment-results.json").read_text()) == summary
    assert (docs / "experiment-accuracy-vs-tokens.png").read_bytes() == (out / "accuracy_vs_tokens.png").read_bytes()


def test_report_only_summarizes_without_training(tmp_path):
    out = tmp_path / "partial"
    experiment.run_all([SMALL], str(out), progress=False)
    (out / "report.md").unlink()
    partial = dataclasses.replace(SMALL, seeds=(0, 1))                # seed 1 never ran: the report says PARTIAL
    results = experiment.run_all([partial], str(out), progress=False, train=False)
    assert not (out / "main" / "runs" / "pg-gm32-seed1.json").exists()
    assert results["main"]["complete"] is False
    assert "PARTIAL" in (out / "report.md").read_text()


def test_report_only_on_a_missing_folder_is_a_usage_error(tmp_path, capsys):
    from otb_spec.cli import main

    assert main(["experiment", "--quick", "--report-only", "--out", str(tmp_path / "typo")]) == 2
    assert "--out: no folder" in capsys.readouterr().err and not (tmp_path / "typo").exists()


def test_every_arm_of_a_seed_sees_the_same_prompts(tmp_path, monkeypatch):
    seen: dict[str, list] = {}
    original = experiment.train_step

    def recording(update, arm, policy, optimizer, prompts, samples, generator):
        seen.setdefault(arm, []).append(prompts.digits.copy())
        return original(update, arm, policy, optimizer, prompts, samples, generator)

    monkeypatch.setattr(experiment, "train_step", recording)
    experiment.run_experiment(dataclasses.replace(SMALL, arms=("gm32", "otb4", "gm4")), str(tmp_path), progress=False)
    assert len(seen["otb4"]) == experiment.steps_of(SMALL, "otb4") > len(seen["gm32"])
    for arm in ("otb4", "gm4"):
        for step, digits in enumerate(seen["gm32"]):
            np.testing.assert_array_equal(seen[arm][step], digits, err_msg=f"{arm} step {step}")


def _without_wall_time(path) -> dict:
    record = json.loads(path.read_text())
    record.pop("seconds")
    return record


def test_interrupted_run_resumes_to_the_same_result(tmp_path, monkeypatch):
    reference_dir, interrupted_dir = tmp_path / "whole", tmp_path / "interrupted"
    experiment.run_experiment(SMALL, str(reference_dir), progress=False)
    calls = {"count": 0}
    original = experiment.train_step

    def failing(*args, **kwargs):
        calls["count"] += 1
        if calls["count"] == 2 + 5:                     # gm32's 2 steps, then otb4's 5th step (after a checkpoint)
            raise KeyboardInterrupt
        return original(*args, **kwargs)

    monkeypatch.setattr(experiment, "train_step", failing)
    with pytest.raises(KeyboardInterrupt):
        experiment.run_experiment(SMALL, str(interrupted_dir), progress=False)
    assert (interrupted_dir / "runs" / "pg-gm32-seed0.json").exists()          # the finished run is kept
    assert (interrupted_dir / "checkpoints" / "pg-otb4-seed0.pt").exists()
    monkeypatch.setattr(experiment, "train_step", original)
    finished_before = (interrupted_dir / "runs" / "pg-gm32-seed0.json").read_text()
    experiment.run_experiment(SMALL, str(interrupted_dir), progress=False)
    assert (interrupted_dir / "runs" / "pg-gm32-seed0.json").read_text() == finished_before
    for name in ("pg-gm32-seed0.json", "pg-otb4-seed0.json"):
        assert _without_wall_time(interrupted_dir / "runs" / name) == \
            _without_wall_time(reference_dir / "runs" / name), name
    assert (interrupted_dir / "checkpoints" / "warm-seed0.pt").exists()        # the warm start stays cached
    assert not (interrupted_dir / "checkpoints" / "pg-otb4-seed0.pt").exists()


@pytest.mark.parametrize("arguments, message", [
    (["--arm", "otb8"], "arms: unknown arm 'otb8'"),
    (["--arm", "otb4"], "arms: the reference arm 'gm32' is needed"),
    (["--samples", "1"], "samples: N must be at least 2"),
    (["--update", "sgd"], "updates: unknown update rule 'sgd'"),
])
def test_bad_input_is_named(tmp_path, capsys, arguments, message):
    assert main(["experiment", "--quick", "--out", str(tmp_path / "x"), "--no-progress", *arguments]) == 2
    assert message in capsys.readouterr().err


def test_bad_warm_start_measure_is_named(tmp_path):
    with pytest.raises(ValueError, match="sft_measure: 'greedy' or 'sampled', got 'best'"):
        experiment.check_config(dataclasses.replace(QUICK, sft_measure="best"), str(tmp_path))


def test_sampled_warm_start_stops_on_sampled_accuracy():
    config = dataclasses.replace(QUICK, sft_measure="sampled", sft_target_accuracy=0.1, sft_check_every=10,
                                 sft_steps_max=40)
    validation, _ = experiment.splits(config, 0)
    state, summary = experiment.warm_start(config, 0, validation)
    policy = Policy()
    policy.load_state_dict(state)
    assert summary["sft_measure"] == "sampled" and summary["sft_steps"] % 10 == 0
    assert summary["sft_validation_accuracy"] == experiment.sampled_accuracy(policy, validation, 20_000)
    assert summary["sft_validation_accuracy"] >= 0.1 or summary["sft_steps"] == 40


def test_unwritable_output_is_named(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    assert main(["experiment", "--quick", "--out", str(blocker / "out"), "--no-progress"]) == 2
    assert "out: cannot write the output directory" in capsys.readouterr().err


def test_task_targets_and_rewards_follow_the_definition():
    prompts = task.make_prompts(np.random.default_rng(0), 64, 1, 9)
    answers = task.targets(prompts)
    for row in range(64):
        running = 0
        for k in range(prompts.lengths[row]):
            running += int(prompts.digits[row, k])
            assert answers[row, k] == (running % 10) // 2
        assert not answers[row, prompts.lengths[row]:].any() and not prompts.digits[row, prompts.lengths[row]:].any()
    assert task.rewards_of(prompts, answers).tolist() == [1.0] * 64
    wrong = answers.copy()
    last = prompts.lengths - 1
    wrong[np.arange(64), last] = (wrong[np.arange(64), last] + 1) % task.OUTPUTS       # one slip at the end fails
    assert task.rewards_of(prompts, wrong).tolist() == [0.0] * 64
    beyond = answers.copy()
    beyond[prompts.lengths < 9, -1] = 3                                               # tokens beyond n do not count
    assert task.rewards_of(prompts, beyond).tolist() == [1.0] * 64


def test_the_parity_is_hidden_from_the_outputs():
    # Two prompts whose outputs agree up to k but whose sums differ in parity there must diverge later: the response
    # does not determine the state, so the policy has to carry it.
    a = task.Prompts(np.array([[1, 1, 0]]), np.array([3]))        # S = 1, 2, 2 → y = 0, 1, 1
    b = task.Prompts(np.array([[0, 2, 1]]), np.array([3]))        # S = 0, 2, 3 → y = 0, 1, 1
    assert task.targets(a).tolist() == task.targets(b).tolist()
    a2 = task.Prompts(np.array([[1, 1, 0, 1]]), np.array([4]))    # S₄ = 3 → y₄ = 1
    b2 = task.Prompts(np.array([[0, 2, 1, 1]]), np.array([4]))    # S₄ = 4 → y₄ = 2
    assert task.targets(a2)[0, 3] != task.targets(b2)[0, 3]


def test_bad_task_arguments_are_named():
    with pytest.raises(ValueError, match="min_digits, max_digits"):
        task.make_prompts(np.random.default_rng(0), 4, 5, 3)
    prompts = task.make_prompts(np.random.default_rng(0), 4, 5, 5)
    with pytest.raises(ValueError, match="responses: 3 tokens per row"):
        task.rewards_of(prompts, np.zeros((4, 3), np.int64))


def test_decoding_and_teacher_forcing_give_the_same_distribution():
    torch.manual_seed(0)
    policy = Policy()
    prompts = task.make_prompts(np.random.default_rng(1), 6, 2, 7)
    steps = []

    def record(logits):
        steps.append(torch.log_softmax(logits, -1))
        return torch.multinomial(torch.softmax(logits, -1), 1, generator=generator)[:, 0]

    generator = torch.Generator().manual_seed(2)
    rollouts = sample(policy, prompts, 1, torch.Generator().manual_seed(2))
    from otb_experiment.policy import _decode
    again = _decode(policy, prompts, np.arange(6), record)
    assert torch.equal(again.tokens, rollouts.tokens)                            # same generator, same draws
    decoded = torch.stack(steps, dim=1).gather(-1, rollouts.tokens[..., None])[..., 0]
    forced = token_log_probs(teacher_forced(policy, prompts, rollouts), rollouts.tokens).detach()
    mask = rollouts.mask.bool()
    port_tolerance(np.float32).assert_close(forced[mask].numpy(), decoded[mask].numpy(), "log π")
    assert greedy(policy, prompts).shape == (6, 7)


@pytest.mark.parametrize("arm", ["otb4", "loo4", "gm4", "rloo4", "gm32"])
def test_advantages_are_the_reference_on_the_policys_batches(arm):
    torch.manual_seed(0)
    policy = Policy()
    prompts = task.make_prompts(np.random.default_rng(0), 4, QUICK.min_digits, QUICK.max_digits)
    rollouts = sample(policy, prompts, experiment.ARMS[arm][1], torch.Generator().manual_seed(1))
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


def _arms(differences: dict[str, list[float]], gain: float = 0.3) -> dict:
    seeds = len(next(iter(differences.values())))
    arms = {"pg/gm32": {"seeds": list(range(seeds)), "gain": {"mean": gain}, "difference_from_gm32": [0.0] * seeds,
                        "mean_accuracy_over_run": [0.5] * seeds}}
    for arm, values in differences.items():
        arms[f"pg/{arm}"] = {"seeds": list(range(seeds)), "difference_from_gm32": values,
                             "mean_accuracy_over_run": [0.5] * seeds}
    return arms


_CONFIG = dataclasses.replace(experiment.MAIN, seeds=tuple(range(4)))
_MATCH, _SHORT, _WIDE = [0.0, 0.01, -0.01, 0.005], [-0.1, -0.11, -0.09, -0.1], [0.1, -0.2, 0.05, -0.15]
_WIDE_AT_ZERO = [0.1, -0.1, 0.08, -0.08]          # mean 0 ≥ −δ, but the interval reaches below −δ: undecided


@pytest.mark.parametrize("differences, gain, claim", [
    ({"otb4": _MATCH, "gm4": _SHORT, "rloo4": _SHORT}, 0.3, "supported"),
    ({"otb4": _SHORT, "gm4": _SHORT, "rloo4": _SHORT}, 0.3, "not supported (otb4 falls short of gm32)"),
    ({"otb4": _MATCH, "gm4": _MATCH, "rloo4": _SHORT}, 0.3, "not supported (gm4 also matches gm32"),
    ({"otb4": _WIDE, "gm4": _SHORT, "rloo4": _SHORT}, 0.3, "undecided"),
    ({"otb4": _WIDE_AT_ZERO, "gm4": _SHORT, "rloo4": _SHORT}, 0.3, "undecided"),
    ({"otb4": _MATCH, "gm4": _WIDE, "rloo4": _SHORT}, 0.3, "undecided"),
    ({"otb4": _MATCH, "gm4": _SHORT, "rloo4": _SHORT}, 0.1, "void (gm32 gained 0.100 < 0.2)"),
    ({"otb4": _MATCH, "gm4": _SHORT}, 0.3, "void (incomplete"),
])
def test_decision_rule_as_pre_registered(differences, gain, claim):
    result = experiment.decision(_arms(differences, gain), "pg", _CONFIG)
    assert result["claim"].startswith(claim), result["claim"]


def test_secondary_learning_speed_is_paired_by_seed():
    arms = _arms({"otb4": _MATCH, "gm4": _SHORT, "rloo4": _SHORT, "loo4": _MATCH})
    speeds = {"otb4": [0.5, 0.6, 0.7, 0.8], "gm4": [0.4, 0.5, 0.6, 0.7], "rloo4": [0.6, 0.7, 0.8, 0.9],
              "loo4": [0.45, 0.7, 0.65, 0.8]}
    for arm, values in speeds.items():
        arms[f"pg/{arm}"]["mean_accuracy_over_run"] = values
    arms["pg/gm4"]["seeds"] = [3, 2, 1, 0]                            # pairing goes by seed, not by position
    arms["pg/gm4"]["mean_accuracy_over_run"] = speeds["gm4"][::-1]
    secondary = experiment.decision(arms, "pg", _CONFIG)["secondary"]
    assert secondary["otb4 - gm4"]["verdict"] == "otb4 faster"
    assert secondary["otb4 - gm4"]["difference"]["mean"] == pytest.approx(0.1)
    assert secondary["otb4 - rloo4"]["verdict"] == "otb4 slower"
    assert secondary["otb4 - loo4"]["verdict"] == "not resolved"


def test_decision_intervals_are_student_t():
    result = experiment.decision(_arms({"otb4": _MATCH, "gm4": _SHORT, "rloo4": _SHORT}), "pg", _CONFIG)
    d = result["arms"]["otb4"]["difference"]
    values = np.array(_MATCH)
    se = values.std(ddof=1) / 2
    assert d["se"] == pytest.approx(se) and d["high"] - d["mean"] == pytest.approx(3.182446305284263 * se)
    assert result["arms"]["otb4"]["verdict"] == "matches" and result["arms"]["gm4"]["verdict"] == "falls short"


def _record(norms, entropy, accuracy, numerically=False):
    return {"history": {"grad_norm": norms, "entropy": entropy, "accuracy": accuracy},
            "diverged_numerically": numerically}


def test_stability_definitions():
    config = dataclasses.replace(experiment.MAIN, spike_window=4, spike_factor=10.0, collapse_accuracy=0.5)
    calm = experiment.stability(_record([1.0] * 10, [0.5] * 10, [0.2, 0.5]), config)
    assert calm == {"spike_steps": [], "spikes": 0, "max_norm_ratio": 1.0, "final_entropy": 0.5, "collapsed": False,
                    "diverged": False}
    # against the median of all earlier steps (a spike does not hide the next one), strictly above 10×
    spiky = experiment.stability(_record([1.0] * 5 + [10.5, 1.0, 10.4, 9.9, 10.0], [0.5] * 10, [0.2, 0.5]), config)
    assert spiky["spike_steps"] == [5, 7] and spiky["max_norm_ratio"] == pytest.approx(10.5)
    assert experiment.stability(_record([1.0] * 5 + [10.0] + [1.0] * 4, [0.5] * 10, [0.2, 0.5]), config)["spikes"] == 0
    # a quiet stretch near convergence does not lower the scale: the median of all earlier norms stays 1
    quiet = experiment.stability(_record([1.0] * 9 + [0.01] * 6 + [5.0], [0.5] * 16, [0.2, 0.99]), config)
    assert quiet["spikes"] == 0 and quiet["max_norm_ratio"] == pytest.approx(5.0)
    assert experiment.stability(_record([1.0] * 4, [0.5] * 4, [0.2, 0.5]), config)["max_norm_ratio"] is None
    collapsed = experiment.stability(_record([1.0] * 10, [0.5] * 6 + [0.001] * 4, [0.2, 0.3]), config)
    assert collapsed["collapsed"] and not collapsed["diverged"]
    converged = experiment.stability(_record([1.0] * 10, [0.001] * 10, [0.2, 0.6]), config)
    assert not converged["collapsed"]
    dropped = experiment.stability(_record([1.0] * 10, [0.5] * 10, [0.3, 0.19]), config)
    assert dropped["diverged"] and not experiment.stability(_record([1.0] * 10, [0.5] * 10, [0.3, 0.2]),
                                                            config)["diverged"]
    assert experiment.stability(_record([1.0, float("nan")], [0.5, 0.5], [0.3], numerically=True), config)["diverged"]
