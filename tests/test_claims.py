"""The claims of proofs/, checked exactly by enumerating every sequence (and every group) of small random toy tasks.

Tolerances are summation bounds in float64: n terms whose absolute values add up to M (probability-weighted) are
exact to (n + 2)·ε·M.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from otb_spec import montecarlo as mc
from otb_spec import strategies as otb_st
from otb_spec.tolerances import summation_tolerance
from otb_spec.toy import EnumerablePolicy, group_gradients


def _weighted_scores(task):
    rollouts = task.all_rollouts()
    return rollouts, task.table.probabilities, rollouts.dense_scores()          # [S, T, P]


# ----------------------------------------------------------------------------------------------------------------------
# T2 — score orthogonality


@given(policy=otb_st.toy_policies(max_vocab_size=3, max_horizon=4))
def test_scores_at_different_positions_are_orthogonal_in_expectation(policy):
    """T2: E[mₜmᵤ sₜ·sᵤ] = 0 for t ≠ u, for any parametrization; hence E‖Sₜ‖² = Σ_{j≤t} E‖sⱼ‖²."""
    task = policy.task(np.zeros(policy.sequences.mask.shape))
    rollouts, p, scores = _weighted_scores(task)
    gram = np.einsum("stp,sup->stu", scores, scores)
    expected = np.einsum("s,stu->tu", p, gram)
    magnitude = float(np.einsum("s,stu->", p, np.abs(gram)))
    tolerance = summation_tolerance(rollouts.size * policy.n_params, magnitude)
    off_diagonal = expected - np.diag(np.diag(expected))
    tolerance.assert_close(off_diagonal, np.zeros_like(off_diagonal), "E[sₜ·sᵤ], t ≠ u")
    cumulative = p @ rollouts.cumulative_score_sq_norms
    tolerance.assert_close(cumulative, np.cumsum(np.diag(expected)), "E‖Sₜ‖² vs Σ E‖sⱼ‖²")


@given(policy=otb_st.toy_policies(parametrization="tabular", max_vocab_size=3, max_horizon=4))
def test_tabular_proxy_is_the_exact_cumulative_norm(policy):
    """T2 (tabular): per-token scores occupy disjoint parameter blocks, so Wₜ = Σ_{j≤t} wⱼ = ‖Sₜ‖² pointwise."""
    rollouts = policy.task(np.zeros(policy.sequences.mask.shape)).all_rollouts()
    realized = np.cumsum(rollouts.token_energy, axis=1)
    summation_tolerance(4 * policy.horizon * policy.vocab_size, float(realized.max()) + 1.0).assert_close(
        realized, rollouts.cumulative_score_sq_norms, "W vs ‖S‖²")


def test_shared_parameters_make_the_proxy_inexact_pointwise():
    """T2 (shared parameters): cross terms sₜ·sᵤ ≠ 0 per sequence, so Wₜ ≠ ‖Sₜ‖² pointwise (recorded example)."""
    rollouts = EnumerablePolicy.log_linear(3, 3, seed=0).task(np.zeros((15, 3))).all_rollouts()
    gap = np.abs(np.cumsum(rollouts.score_sq_norms, axis=1) - rollouts.cumulative_score_sq_norms)
    assert gap.max() > 0.1


# ----------------------------------------------------------------------------------------------------------------------
# T3 — unbiasedness


def _gradient_tolerance(task, group_size, max_advantage):
    rollouts, p, scores = _weighted_scores(task)
    per_sequence = np.abs(scores).sum(axis=(1, 2))                 # Σₜ‖sₜ‖₁
    magnitude = max_advantage * float(p @ per_sequence) * 2
    return summation_tolerance(rollouts.size**group_size * group_size * task.horizon * task.n_params, magnitude)


UNBIASED = ["reinforce", "rloo", "otb_loo", "otb_exact_loo", "sequence_optimal_loo"]


@settings(max_examples=20)
@given(task=otb_st.toy_tasks(max_vocab_size=3, max_horizon=3), group_size=st.integers(2, 3),
       estimator=st.sampled_from(UNBIASED))
def test_baselines_without_the_own_sample_are_unbiased(task, group_size, estimator):
    """T3: a baseline built from the other members only gives E[ĝ] = ∇J exactly (all Sᴺ groups enumerated)."""
    mean, _ = mc.exact_group_moments(task, estimator, group_size)
    returns = np.abs(task.returns()).max() + 1.0
    _gradient_tolerance(task, group_size, 2 * returns).assert_close(mean, task.gradient(), f"E[ĝ] ({estimator})")


@settings(max_examples=20)
@given(task=otb_st.toy_tasks(max_vocab_size=3, max_horizon=3), group_size=st.integers(2, 3))
def test_self_inclusive_group_mean_shrinks_the_gradient_by_one_minus_one_over_n(task, group_size):
    """T3: with the self-inclusive mean of the sequence returns, E[ĝ] = (1 − 1/N)·∇J exactly, for N ≥ 2."""
    mean, _ = mc.exact_group_moments(task, "group_mean", group_size)
    returns = np.abs(task.rewards.sum(axis=1)).max() + 1.0
    _gradient_tolerance(task, group_size, 2 * returns).assert_close(
        mean, (1 - 1 / group_size) * task.gradient(), "E[ĝ] (group mean)")


@given(task=otb_st.toy_tasks(max_vocab_size=3, max_horizon=3),
       estimator=st.sampled_from(["group_mean", "otb", "otb_exact", "opo", "sequence_optimal"]))
def test_singleton_groups_get_no_baseline_so_they_are_unbiased(task, estimator):
    """T3 (N = 1): every estimator gives a singleton group baseline 0 (verl's convention), i.e. REINFORCE — unbiased,
    where a literal self-inclusive mean would cancel the gradient entirely (1 − 1/1 = 0)."""
    mean, _ = mc.exact_group_moments(task, estimator, 1)
    returns = np.abs(task.returns()).max() + np.abs(task.rewards.sum(axis=1)).max() + 1.0
    _gradient_tolerance(task, 1, 2 * returns).assert_close(mean, task.gradient(), f"E[ĝ] ({estimator}, N = 1)")


@settings(max_examples=20)
@given(task=otb_st.toy_tasks(max_vocab_size=3, max_horizon=3), kind=st.sampled_from(["oracle", "proxy", "exact"]))
def test_constant_per_position_baselines_are_unbiased(task, kind):
    """T3: population constants (the oracle, population OTB) do not depend on the sample: E[ĝ] = ∇J."""
    baselines = mc.oracle_baselines(task) if kind == "oracle" else mc.population_token_baselines(task, kind)
    mean, _ = mc.exact_group_moments(task, mc.constant_baseline_estimator(baselines), 1)
    magnitude = np.abs(task.returns()).max() + np.abs(baselines).max() + 1.0
    _gradient_tolerance(task, 1, magnitude).assert_close(mean, task.gradient(), f"E[ĝ] ({kind} constants)")


RECORDED_TASK = dict(vocab_size=3, horizon=3, seed=3)


def _recorded_task():
    """The task of proofs/T3_unbiasedness.md: tabular V = 3, T = 3, seed 3, terminal rewards in {0, 1} (seed 0)."""
    policy = EnumerablePolicy.tabular(**RECORDED_TASK)
    values = np.random.default_rng(0).integers(0, 2, size=policy.sequences.size).astype(float)
    return policy.task(policy.terminal_rewards(values))


@pytest.mark.parametrize("group_size, scale, cosine", [(2, 0.040473, 0.876665), (3, 0.078688, 0.963144),
                                                       (4, 0.115266, 0.981554)])
def test_self_inclusive_otb_is_biased_in_scale_and_direction(group_size, scale, cosine):
    """T3: self-inclusive OTB on the recorded task (exact enumeration; the numbers of proofs/T3_unbiasedness.md)."""
    task = _recorded_task()
    gradient = task.gradient()
    mean, _ = mc.exact_group_moments(task, "otb", group_size)
    assert mean @ gradient / (gradient @ gradient) == pytest.approx(scale, abs=5e-7)
    assert mean @ gradient / np.linalg.norm(mean) / np.linalg.norm(gradient) == pytest.approx(cosine, abs=5e-7)


# ----------------------------------------------------------------------------------------------------------------------
# T4, T5 — optimal constant baselines


@given(task=otb_st.toy_tasks(reward_style="terminal", max_vocab_size=3, max_horizon=3),
       offsets=st.lists(st.floats(-3, 3), min_size=1, max_size=4))
def test_classic_optimal_baseline_and_its_variance_parabola(task, offsets):
    """T4: for ĝ(b) = S(τ)(R − b) (terminal rewards), V(b) = V(b*) + (b − b*)²·E‖S‖² with b* = E[‖S‖²R]/E‖S‖²."""
    rollouts = task.all_rollouts()
    p = task.table.probabilities
    norms = rollouts.sequence_score_sq_norms
    R = task.rewards.sum(axis=1)
    second = float(p @ norms)
    optimal = float(p @ (norms * R)) / second
    at_optimum = mc.constant_baseline_variance(task, np.full(task.horizon, optimal))
    for offset in offsets:
        b = optimal + offset
        variance = mc.constant_baseline_variance(task, np.full(task.horizon, b))
        magnitude = second * (np.abs(R).max() + abs(b) + 1.0) ** 2 * 4
        summation_tolerance(rollouts.size * task.n_params * 4, magnitude).assert_close(
            variance, at_optimum + offset**2 * second, "V(b)")
        assert variance >= at_optimum - summation_tolerance(rollouts.size * task.n_params, magnitude).atol


@given(task=otb_st.toy_tasks(max_vocab_size=3, max_horizon=3), data=st.data())
def test_per_position_baselines_have_a_diagonal_quadratic_variance(task, data):
    """T5: V(B) = V(B^opt) + Σₜ E[mₜ‖sₜ‖²](Bₜ − B^opt_t)², B^opt_t = E[mₜsₜ·ĝ₀]/E[mₜ‖sₜ‖²] — any rewards, any
    parametrization (the matrix is diagonal because of T2)."""
    rollouts = task.all_rollouts()
    p = task.table.probabilities
    oracle = mc.oracle_baselines(task)
    weights = p @ (rollouts.score_sq_norms * rollouts.response_mask)
    at_oracle = mc.constant_baseline_variance(task, oracle)
    shift = np.array(data.draw(st.lists(st.floats(-3, 3), min_size=task.horizon, max_size=task.horizon),
                               label="B − B^opt"))
    variance = mc.constant_baseline_variance(task, oracle + shift)
    magnitude = float(p @ rollouts.score_sq_norms.sum(axis=1)) * task.horizon * (
        np.abs(task.returns()).max() + np.abs(oracle + shift).max() + 1.0) ** 2 * 4
    summation_tolerance(rollouts.size * task.n_params * task.horizon * 4, magnitude).assert_close(
        variance, at_oracle + float(weights @ np.square(shift)), "V(B)")


# ----------------------------------------------------------------------------------------------------------------------
# T6 — OTB with exact norms and the prefix estimators


def _prefix_moments(task, t):
    """E[mₜSₜ], E[mₜSₜGₜ], E[mₜ‖Sₜ‖²], E[mₜ‖Sₜ‖²Gₜ] at position t."""
    rollouts, p, scores = _weighted_scores(task)
    cumulative = np.cumsum(scores, axis=1)[:, t] * rollouts.response_mask[:, t, None]
    G = task.returns()[:, t]
    norms = np.sum(np.square(cumulative), axis=1)
    return p @ cumulative, p @ (cumulative * G[:, None]), float(p @ norms), float(p @ (norms * G))


@given(task=otb_st.toy_tasks(max_vocab_size=3, max_horizon=3))
def test_exact_norm_otb_minimises_the_second_moment_of_every_prefix_term(task):
    """T6: Bₜ = E[mₜ‖Sₜ‖²Gₜ]/E[mₜ‖Sₜ‖²] (population OTB with exact norms) is argmin_b E‖mₜSₜ(Gₜ − b)‖²."""
    otb_exact = mc.population_token_baselines(task, "exact")
    for t in range(task.horizon):
        _, _, second, weighted = _prefix_moments(task, t)
        if second == 0:
            continue
        # the derivative of the second moment at Bₜ: −2·E[mₜ‖Sₜ‖²(Gₜ − Bₜ)] = −2·(weighted − Bₜ·second)
        magnitude = (abs(weighted) + abs(otb_exact[t]) * second) * 4
        summation_tolerance(task.table.size * task.n_params * 4, magnitude).assert_close(
            weighted - otb_exact[t] * second, 0.0, f"∂/∂b second moment at t = {t}")


@given(task=otb_st.toy_tasks(max_vocab_size=3, max_horizon=3))
def test_exact_norm_otb_minimises_the_prefix_variance_where_nobody_has_stopped(task):
    """T6, restated: at t = 0 every trajectory is alive, E[S₀] = 0, and the second-moment minimiser is also the
    variance minimiser of S₀(G₀ − b)."""
    mean_s, mean_sg, second, weighted = _prefix_moments(task, 0)
    if second == 0:
        return
    variance_argmin = (weighted - mean_s @ mean_sg) / (second - mean_s @ mean_s)
    magnitude = abs(weighted) / second * 4 + 1.0
    summation_tolerance(task.table.size * task.n_params * 4, magnitude).assert_close(
        variance_argmin, mc.population_token_baselines(task, "exact")[0], "variance argmin at t = 0")


def test_exact_norm_otb_is_not_the_prefix_variance_minimiser_after_stopping():
    """T6 counterexample (recorded): once some trajectories may have ended before t, E[mₜSₜ] ≠ 0 and the variance
    minimiser of mₜSₜ(Gₜ − b) differs from OTB — tabular V = 3, T = 3, seed 4, Gaussian terminal rewards (seed 1)."""
    policy = EnumerablePolicy.tabular(3, 3, seed=4)
    task = policy.task(policy.terminal_rewards(np.random.default_rng(1).normal(size=policy.sequences.size)))
    mean_s, mean_sg, second, weighted = _prefix_moments(task, 1)
    variance_argmin = (weighted - mean_s @ mean_sg) / (second - mean_s @ mean_s)
    otb_exact = mc.population_token_baselines(task, "exact")[1]
    assert np.linalg.norm(mean_s) == pytest.approx(0.232, abs=1e-3)
    assert otb_exact == pytest.approx(0.476561, abs=1e-6)
    assert variance_argmin == pytest.approx(0.444402, abs=1e-6)


# ----------------------------------------------------------------------------------------------------------------------
# F1 — OTB vs the group mean is an empirical finding, not a theorem


def _population_variances(policy, rewards):
    task = policy.task(rewards)
    T = policy.horizon
    return {
        "mean": mc.constant_baseline_variance(task, np.full(T, task.objective())),
        "otb": mc.constant_baseline_variance(task, mc.population_token_baselines(task, "proxy")),
        "otb_exact": mc.constant_baseline_variance(task, mc.population_token_baselines(task, "exact")),
        "oracle": mc.constant_baseline_variance(task, mc.oracle_baselines(task)),
    }


def test_population_otb_can_have_more_variance_than_the_group_mean():
    """F1 counterexample (proofs/F1_otb_vs_group_mean.md): tabular V = 4, T = 4, seed 20, scale 2, Bernoulli(½)
    terminal rewards drawn with seed 1020. Exact variances of the single-trajectory gradient with constant
    per-position baselines."""
    policy = EnumerablePolicy.tabular(4, 4, seed=20, scale=2.0)
    values = np.random.default_rng(1020).integers(0, 2, size=policy.sequences.size).astype(float)
    variances = _population_variances(policy, policy.terminal_rewards(values))
    assert variances["otb"] > variances["mean"]
    assert variances["otb"] == pytest.approx(0.27977, abs=5e-6)
    assert variances["mean"] == pytest.approx(0.27825, abs=5e-6)
    assert variances["oracle"] <= min(variances.values())


def test_population_otb_usually_beats_the_group_mean_on_the_survey_family():
    """F1 survey (recorded fractions): 40 seeds × {tabular, shared} × Bernoulli(½) terminal rewards, V = 4, T = 4."""
    wins = {}
    for kind in ("tabular", "log_linear"):
        constructor = getattr(EnumerablePolicy, kind)
        outcomes = []
        for seed in range(40):
            policy = constructor(4, 4, seed=seed, scale=2.0)
            values = np.random.default_rng(1000 + seed).integers(0, 2, size=policy.sequences.size).astype(float)
            variances = _population_variances(policy, policy.terminal_rewards(values))
            outcomes.append(variances["otb"] < variances["mean"])
            assert variances["oracle"] <= min(variances.values()) + 1e-12
        wins[kind] = float(np.mean(outcomes))
    assert wins == {"tabular": 0.975, "log_linear": 0.925}
