"""The Monte Carlo engine agrees with exact enumeration (which validates the engine), and the claims that need N too
large to enumerate hold within 5 standard errors. All runs use fixed seeds."""

from __future__ import annotations

import numpy as np
import pytest

from otb_spec import montecarlo as mc
from otb_spec.toy import EnumerablePolicy, MarkovPolicy

ESTIMATORS = ["reinforce", "group_mean", "rloo", "otb", "otb_loo", "opo", "sequence_optimal"]


@pytest.fixture(scope="module")
def small_task():
    policy = EnumerablePolicy.log_linear(3, 3, seed=5, scale=1.5)
    values = np.random.default_rng(2).integers(0, 2, size=policy.sequences.size).astype(float)
    return policy.task(policy.terminal_rewards(values))


@pytest.fixture(scope="module")
def small_runs(small_task):
    return mc.run_monte_carlo(small_task, ESTIMATORS, group_size=3, n_groups=60_000, seed=17)


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_monte_carlo_matches_exact_moments(small_task, small_runs, estimator):
    """Mean (every coordinate, scale) and total variance of ĝ within 5 SE of the exact values (S³ groups)."""
    exact_mean, exact_variance = mc.exact_group_moments(small_task, estimator, 3)
    run = small_runs[estimator]
    gradient = small_task.gradient()
    difference = np.abs(run.mean_gradient - exact_mean)
    assert np.all(difference < 5 * run.mean_gradient_se + 1e-12)
    assert abs(run.scale.z_score(exact_mean @ gradient / (gradient @ gradient))) < 5
    assert abs(run.total_variance.z_score(exact_variance)) < 5


@pytest.mark.bitexact
def test_common_random_numbers_and_determinism(small_task):
    first = mc.run_monte_carlo(small_task, ["rloo", "otb_loo"], group_size=2, n_groups=4000, seed=3)
    second = mc.run_monte_carlo(small_task, ["otb_loo", "rloo"], group_size=2, n_groups=4000, seed=3)
    np.testing.assert_array_equal(first["rloo"].mean_gradient, second["rloo"].mean_gradient)
    np.testing.assert_array_equal(first["otb_loo"].mean_gradient, second["otb_loo"].mean_gradient)


def test_custom_advantage_functions_and_options(small_task):
    oracle = mc.constant_baseline_estimator(mc.oracle_baselines(small_task))
    runs = mc.run_monte_carlo(small_task, {"oracle": oracle, "otb_no_tail": "otb"}, group_size=2, n_groups=20_000,
                              seed=5, options={"otb_no_tail": {"handle_zero_tail": False}})
    assert abs(runs["oracle"].scale.z_score(1.0)) < 5
    exact_mean, _ = mc.exact_group_moments(small_task, "otb", 2, handle_zero_tail=False)
    gradient = small_task.gradient()
    assert abs(runs["otb_no_tail"].scale.z_score(exact_mean @ gradient / (gradient @ gradient))) < 5


def test_leave_one_out_otb_is_unbiased_for_larger_groups(small_task):
    """T3 beyond enumeration: N = 8 and 16, every coordinate of E[ĝ] within 5 SE of ∇J."""
    for group_size in (8, 16):
        run = mc.run_monte_carlo(small_task, ["otb_loo"], group_size=group_size, n_groups=20_000,
                                 seed=group_size)["otb_loo"]
        assert run.max_abs_z() < 5
        assert abs(run.scale.z_score(1.0)) < 5


def test_self_inclusive_otb_bias_vanishes_as_groups_grow():
    """T3: on the recorded task, the scale of E[ĝ] rises towards 1 and the angle to ∇J closes as N grows."""
    policy = EnumerablePolicy.tabular(3, 3, seed=3)
    values = np.random.default_rng(0).integers(0, 2, size=policy.sequences.size).astype(float)
    task = policy.task(policy.terminal_rewards(values))
    runs = {n: mc.run_monte_carlo(task, ["otb"], group_size=n, n_groups=max(4000, 2**17 // n), seed=n)["otb"]
            for n in (8, 32, 128)}
    scales = [runs[n].scale for n in (8, 32, 128)]
    for smaller, larger in zip(scales, scales[1:]):
        assert larger.value - smaller.value > 5 * np.hypot(smaller.standard_error, larger.standard_error)
    assert 1 - runs[128].scale.value < 0.2
    assert runs[128].cosine.value > runs[8].cosine.value


def test_leave_one_out_otb_is_unbiased_on_the_long_horizon_task():
    """T3 on the Markov task (T = 60, heterogeneous lengths, reward tied to length): N = 4, 5 SE."""
    policy = MarkovPolicy.random(vocab_size=3, horizon=60, n_buckets=4, seed=1)
    task = policy.task(length_rewards=(np.arange(61) <= 30).astype(float))
    run = mc.run_monte_carlo(task, ["otb_loo", "reinforce"], group_size=4, n_groups=6000, seed=2)
    for name in ("otb_loo", "reinforce"):
        assert run[name].max_abs_z() < 5, name
        assert abs(run[name].scale.z_score(1.0)) < 5, name


@pytest.mark.slow
def test_large_group_unbiasedness_and_engine_agreement_thorough(small_task):
    """The slow profile: 10⁶ trajectories per estimator, N up to 64."""
    for group_size in (32, 64):
        runs = mc.run_monte_carlo(small_task, ["rloo", "otb_loo", "otb_exact_loo"], group_size=group_size,
                                  n_groups=2**20 // group_size, seed=group_size)
        for run in runs.values():
            assert run.max_abs_z() < 5
