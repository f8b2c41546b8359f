"""The claims of proofs/, checked exactly by enumerating every sequence (and every group) of small random toy tasks.

Tolerances are summation bounds in float64: n terms whose absolute values add up to M (probability-weighted) are
exact to (n + 2)·ε·M.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import otb_spec
from otb_spec import montecarlo as mc
from otb_spec import strategies as otb_st
from otb_spec.tolerances import (Tolerance, elementwise_tolerance, input_range_slack, otb_tolerance, output_rounding,
                                 summation_tolerance)
from otb_spec.toy import EnumerablePolicy, group_gradients, weighted_score_sums
from otb_spec.trajectory import realized_energy
from otb_spec.proxy import token_energy


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
    """T2 (shared parameters): cross terms sₜ·sᵤ ≠ 0 per sequence, so Σ_{j≤t}‖sⱼ‖² ≠ ‖Sₜ‖² pointwise — even exact
    per-token norms would not sum to the cumulative one (recorded example; that wₜ ≠ ‖sₜ‖² there as well is the next
    test's)."""
    rollouts = EnumerablePolicy.log_linear(3, 3, seed=0).task(np.zeros((15, 3))).all_rollouts()
    gap = np.abs(np.cumsum(rollouts.score_sq_norms, axis=1) - rollouts.cumulative_score_sq_norms)
    assert gap.max() > 0.1


@pytest.mark.parametrize("vocab, horizon, seed", [(3, 3, 0), (4, 5, 3), (2, 6, 1)])
def test_shared_parameter_feature_norms_lie_in_two_to_four(vocab, horizon, seed):
    """T2's parametrisation: φ = (1, one-hot previous token, t/T, fraction of token 1 so far), so ‖φₜ‖² ∈ [2, 4) at
    every valid token (1 + 1 + two terms in [0, 1), never both 1)."""
    policy = EnumerablePolicy.log_linear(vocab, horizon, seed=seed, scale=1.5)
    rollouts = policy.task(np.zeros(policy.sequences.mask.shape)).all_rollouts()
    norms = np.sum(np.square(rollouts.feature_values), axis=-1)[rollouts.response_mask > 0]
    assert norms.min() >= 2.0 and norms.max() < 4.0


def test_shared_parameter_proxy_misses_the_feature_norm():
    """T2 (shared parameters): ‖sₜ‖² = wₜ·‖φₜ‖² pointwise, so the proxy is not the squared score norm even in
    expectation — on the lab's policy (V = 4, T = 5, seed 3, scale 1.5) E[mₜ‖Sₜ‖²]/E[mₜWₜ] is 2.000, 2.038, 2.162,
    2.810, 3.491 along the positions (exact enumeration). A constant factor would not change OTB's baseline (it is
    invariant to W → cW); a factor that varies with the position and the prefix does."""
    policy = EnumerablePolicy.log_linear(4, 5, seed=3, scale=1.5)
    rollouts = policy.task(np.zeros(policy.sequences.mask.shape)).all_rollouts()
    p, mask = policy.sequences.probabilities, rollouts.response_mask
    feature_norms = np.sum(np.square(rollouts.feature_values), axis=-1)
    tolerance = summation_tolerance(policy.vocab_size, 4.0)
    tolerance.assert_close(rollouts.score_sq_norms, rollouts.token_energy * feature_norms, "‖sₜ‖² vs wₜ‖φₜ‖²")
    ratio = (p @ (mask * rollouts.cumulative_score_sq_norms)) / (p @ (mask * np.cumsum(rollouts.token_energy, 1)))
    np.testing.assert_array_equal(np.round(ratio, 3), [2.000, 2.038, 2.162, 2.810, 3.491])


def test_alive_only_cumulative_norm_is_not_a_sum_of_token_norms():
    """T2 with masks: E‖Σ_{j≤t} mⱼsⱼ‖² = Σ_{j≤t} E[mⱼ‖sⱼ‖²] (checked by the orthogonality test), but the alive-only
    moment OTB's denominator estimates, E[mₜ‖Sₜ‖²], is not Σ_{j≤t} E[mₜ‖sⱼ‖²]: mₜ depends on the tokens between j
    and t. Recorded: the lab's policy at the third position, 0.6628 vs 0.6473 (exact enumeration)."""
    policy = EnumerablePolicy.log_linear(4, 5, seed=3, scale=1.5)
    rollouts = policy.task(np.zeros(policy.sequences.mask.shape)).all_rollouts()
    p, mask = policy.sequences.probabilities, rollouts.response_mask
    alive = p @ (mask * rollouts.cumulative_score_sq_norms)
    summed = np.array([p @ (mask[:, t] * rollouts.score_sq_norms[:, :t + 1].sum(axis=1)) for t in range(5)])
    assert (round(alive[2], 4), round(summed[2], 4)) == (0.6628, 0.6473)
    summation_tolerance(policy.n_params * policy.horizon, float(alive.max()) + 1.0).assert_close(
        alive[:2], summed[:2], "E[mₜ‖Sₜ‖²] at t ≤ 1, where nothing lies between j and t")


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


_F1_TEXT = " ".join((Path(__file__).resolve().parents[1] / "proofs" / "F1_otb_vs_group_mean.md")
                    .read_text(encoding="utf-8").split())


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
    assert variances["oracle"] <= min(variances.values())
    stated = re.search(r"Var\(population OTB\) = (\d\.\d+) > Var\(group mean\) = (\d\.\d+)\s+\(oracle (\d\.\d+)\)",
                       _F1_TEXT)
    assert stated, "proofs/F1 item 1 no longer states the counterexample's variances"
    for name, text in zip(("otb", "mean", "oracle"), stated.groups()):     # as printed: to its last decimal
        assert round(variances[name], len(text) - 2) == float(text), (name, variances[name], text)


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
            assert variances["oracle"] == min(variances.values())       # exactly: T5's gap Σₜ cₜ(Bₜ − B*ₜ)² ≫ ε
        wins[kind] = float(np.mean(outcomes))
    stated = re.search(r"wins on (\d+\.\d) % \(tabular\) and (\d+\.\d) % \(shared parameters\)", _F1_TEXT)
    assert stated, "proofs/F1 item 1 no longer states the survey's fractions"
    assert wins == {"tabular": float(stated[1]) / 100, "log_linear": float(stated[2]) / 100}



# ----------------------------------------------------------------------------------------------------------------------
# T7 — self-inclusive OTB is leave-one-out OTB shrunk by (1 − λ)


def _clean_statistics(batch):
    """log π, Σπ², ρ with the masked positions neutralised (the reference ignores them; token_energy checks all)."""
    valid = np.asarray(batch.response_mask) > 0
    log_probs = np.where(valid, batch.log_probs, 0.0)
    spp = np.where(valid, batch.sum_pi_squared, 1.0)
    weights = None if batch.is_weights is None else np.where(valid, batch.is_weights, 1.0)
    return log_probs, spp, weights


def _aligned_index(mask, align):
    """[B, T] the aligned index of each valid token — t itself, or its rank among the row's valid tokens — and −1 at
    masked positions."""
    index = np.broadcast_to(np.arange(mask.shape[1]), mask.shape) if align == "position" else np.cumsum(mask, 1) - 1
    return np.where(mask > 0, index, -1).astype(np.int64)


def _group_structure(energy, mask, group_ids, align):
    """Loops, independent of the reference's grid. For each valid token: Σⱼ Wⱼ over the members of its group valid at
    the same aligned index, the number of *other* members valid there, whether its group is a singleton, and whether
    verl's zero tail covers it (the unique longest member, aligned index ≥ the second-longest length)."""
    aligned = _aligned_index(mask, align)
    lengths = mask.sum(axis=1).astype(np.int64)
    totals, others = np.zeros(mask.shape), np.zeros(mask.shape, dtype=np.int64)
    singleton, tail = np.zeros(mask.shape, dtype=bool), np.zeros(mask.shape, dtype=bool)
    ids = np.asarray(group_ids).tolist()
    for key in set(ids):
        rows = [row for row, value in enumerate(ids) if value == key]
        members = rows if align == "position" else [row for row in rows if lengths[row] > 0]
        energy_at, count_at = {}, {}
        for row in members:
            for t in np.flatnonzero(mask[row]):
                energy_at[aligned[row, t]] = energy_at.get(aligned[row, t], 0.0) + energy[row, t]
                count_at[aligned[row, t]] = count_at.get(aligned[row, t], 0) + 1
        ordered = sorted((int(lengths[row]) for row in members), reverse=True)
        for row in members:
            positions = np.flatnonzero(mask[row])
            totals[row, positions] = [energy_at[aligned[row, t]] for t in positions]
            others[row, positions] = [count_at[aligned[row, t]] - 1 for t in positions]
            if len(members) < 2:
                singleton[row, positions] = True
            elif lengths[row] == ordered[0] and ordered[1] < ordered[0]:
                tail[row, positions] = aligned[row, positions] >= ordered[1]
    return totals, others, singleton, tail


def _realized(batch):
    log_probs, spp, weights = _clean_statistics(batch)
    return realized_energy(token_energy(log_probs, spp), batch.response_mask, is_weights=weights)


def _both_otbs(batch, align, handle_zero_tail, epsilon):
    arguments = (batch.rewards, batch.response_mask, batch.group_ids, batch.log_probs, batch.sum_pi_squared)
    self_inclusive = (otb_spec.optimal_token_baseline if align == "position"
                      else otb_spec.multi_turn_optimal_token_baseline)(
        *arguments, is_weights=batch.is_weights, handle_zero_tail=handle_zero_tail, epsilon=epsilon)
    leave_one_out = otb_spec.leave_one_out_token_baseline(*arguments, is_weights=batch.is_weights, align=align,
                                                          epsilon=epsilon)
    return self_inclusive, leave_one_out


def _reference_bounds(batch, align, handle_zero_tail, epsilon):
    """The float64 reference's own forward error bounds (``otb_tolerance``) of A_self and A_loo."""
    arguments = (batch.rewards, batch.response_mask, batch.group_ids, batch.log_probs, batch.sum_pi_squared)
    options = dict(is_weights=batch.is_weights, align=align, epsilon=epsilon, dtype=np.float64)
    return (otb_tolerance(*arguments, handle_zero_tail=handle_zero_tail, **options)[0],
            otb_tolerance(*arguments, leave_one_out=True, handle_zero_tail=False, **options)[0])


def _identity_tolerance(bounds, shrink, loo_advantages, n_rows):
    """|A_self − (1 − λ)·A_loo| ≤ bound(A_self) + (1 − λ)·bound(A_loo) + |A_loo|·|Δλ|. λ = W/(Σ W + ε) is formed from
    the very W the reference uses (same function, same inputs), so only its sum of ≤ B terms and the division err."""
    self_bound, loo_bound = bounds
    lambda_error = summation_tolerance(n_rows, 1.0).atol + elementwise_tolerance().rtol
    scaled_loo_bound = np.where(shrink > 0, shrink * np.where(shrink > 0, loo_bound.atol, 0.0), 0.0)   # 0·∞ = 0 here
    atol = self_bound.atol + scaled_loo_bound + np.abs(loo_advantages) * lambda_error
    return Tolerance(rtol=self_bound.rtol + loo_bound.rtol + elementwise_tolerance().rtol, atol=atol,
                     reason="reference forward error bounds of A_self and A_loo, and of λ")


@given(batch=otb_st.rollout_batches(max_groups=3, max_group_size=5, max_length=8),
       align=st.sampled_from(["position", "valid_token"]), handle_zero_tail=st.booleans(),
       epsilon=st.sampled_from([0.0, 1e-8, 0.5]))
def test_self_inclusive_otb_is_leave_one_out_shrunk_by_one_minus_lambda(batch, align, handle_zero_tail, epsilon):
    """T7: at every valid token where the self-inclusive baseline is the ratio, A_self = (1 − λ)·A_loo with
    λ = Wᵢ/(Σⱼ Wⱼ + ε) — ε included, both alignments, IS weights, holes, left padding, empty rows; where verl forces
    the baseline to 0 (singleton group; zero tail when it is on) A_self = G."""
    mask = np.asarray(batch.response_mask, dtype=np.float64)
    energy = _realized(batch)
    totals, _, singleton, tail = _group_structure(energy, mask, batch.group_ids, align)
    forced = singleton | (tail & handle_zero_tail)
    self_inclusive, leave_one_out = _both_otbs(batch, align, handle_zero_tail, epsilon)
    denominator = totals + epsilon
    lam = np.divide(energy * mask, denominator, out=np.zeros(mask.shape), where=(mask > 0) & (denominator > 0))
    tolerance = _identity_tolerance(_reference_bounds(batch, align, handle_zero_tail, epsilon), 1.0 - lam,
                                    leave_one_out.advantages, mask.shape[0])
    assume(tolerance.checked_fraction() > 0.5)                      # reject ill-conditioned batches, not the bound
    expected = np.where(forced, self_inclusive.returns, (1.0 - lam) * leave_one_out.advantages) * mask
    tolerance.assert_close(self_inclusive.advantages, expected, "A_self vs (1 − λ)·A_loo")


@given(batch=otb_st.rollout_batches(max_groups=3, max_group_size=5, max_length=8, padding="right", holes=False),
       align=st.sampled_from(["position", "valid_token"]))
def test_zero_tail_is_the_leave_one_out_fallback_for_prefix_masks(batch, align):
    """T7: with prefix masks (right padding, no holes) — or any masks in the valid-token alignment — the zero tail
    covers exactly the tokens of multi-member groups where no other member is valid, and there
    A_self = A_loo = G exactly."""
    mask = np.asarray(batch.response_mask, dtype=np.float64)
    _, others, singleton, tail = _group_structure(_realized(batch), mask, batch.group_ids, align)
    alone = (mask > 0) & (others == 0) & ~singleton
    np.testing.assert_array_equal(tail, alone)
    self_inclusive, leave_one_out = _both_otbs(batch, align, True, 1e-8)
    np.testing.assert_array_equal(self_inclusive.advantages[alone], self_inclusive.returns[alone])
    np.testing.assert_array_equal(leave_one_out.advantages[alone], self_inclusive.returns[alone])


@given(batch=otb_st.rollout_batches(max_groups=3, max_group_size=5, max_length=8, padding="any", holes=True),
       align=st.sampled_from(["valid_token"]))
def test_zero_tail_is_the_leave_one_out_fallback_in_the_valid_token_alignment(batch, align):
    """T7: in the valid-token alignment the zero tail and "no other member is valid" coincide for any mask."""
    mask = np.asarray(batch.response_mask, dtype=np.float64)
    _, others, singleton, tail = _group_structure(_realized(batch), mask, batch.group_ids, align)
    np.testing.assert_array_equal(tail, (mask > 0) & (others == 0) & ~singleton)


def test_zero_tail_can_fall_where_another_member_is_valid():
    """T7 (recorded): aligned by position, a left-padded member can be valid inside the longest member's zero tail.
    Member 0 has tokens at t = 0, 1, 2; member 1 at t = 1, 2 (left padding): L₂ = 2, so verl zeroes member 0's
    baseline at t = 2 although member 1 is valid there — A_self = G there, A_loo = G − B⁽⁻⁰⁾ ≠ G."""
    rewards = np.array([[0.0, 0.0, 1.0], [0.0, 0.0, 3.0]])
    mask = np.array([[1.0, 1.0, 1.0], [0.0, 1.0, 1.0]])
    half = np.full((2, 3), 0.5)
    arguments = (rewards, mask, [0, 0], np.log(half), half)
    self_inclusive = otb_spec.optimal_token_baseline(*arguments, epsilon=0.0)
    leave_one_out = otb_spec.leave_one_out_token_baseline(*arguments, epsilon=0.0)
    assert self_inclusive.advantages[0, 2] == 1.0                   # G: the baseline was forced to 0
    assert leave_one_out.advantages[0, 2] == 1.0 - 3.0              # G − the other member's return


def test_two_member_advantage_keeps_the_epsilon_term():
    """T3.3 / T7 at N = 2 (both members valid, no zero tail): A₁ = ((G₁ − G₂)·W₂ + ε·G₁)/(W₁ + W₂ + ε); the formula
    without ε·G₁ (the old statement of T3) is off by ε·G₁/(W₁ + W₂ + ε), far outside the tolerance at ε = 0.5."""
    rewards = np.array([[0.0, 2.0], [0.0, -1.0]])
    mask = np.ones((2, 2))
    probabilities = np.array([[0.6, 0.9], [0.3, 0.5]])
    spp = np.array([[0.6, 0.82], [0.5, 0.5]])
    epsilon = 0.5
    arguments = (rewards, mask, ["g", "g"], np.log(probabilities), spp)
    result = otb_spec.optimal_token_baseline(*arguments, epsilon=epsilon)
    W = realized_energy(token_energy(np.log(probabilities), spp), mask)
    G = result.returns
    exact = ((G[0] - G[1]) * W[1] + epsilon * G[0]) / (W[0] + W[1] + epsilon)
    bound = otb_tolerance(*arguments, epsilon=epsilon, dtype=np.float64)[0] + elementwise_tolerance()
    tolerance = Tolerance(rtol=bound.rtol, atol=np.asarray(bound.atol)[0], reason=bound.reason)
    tolerance.assert_close(result.advantages[0], exact, "A₁ at N = 2")
    without_epsilon_term = (G[0] - G[1]) * W[1] / (W[0] + W[1] + epsilon)
    assert not tolerance.holds(result.advantages[0], without_epsilon_term)


@given(batch=otb_st.rollout_batches(max_groups=3, max_group_size=6, max_length=6, singleton_groups=False))
def test_group_mean_is_rloo_shrunk_by_one_minus_one_over_n(batch):
    """T7's template: the self-inclusive group mean is RLOO times (1 − 1/N), token by token, for N ≥ 2 (λ = 1/N: the
    identity with equal energies and ε = 0)."""
    arguments = (batch.rewards, batch.response_mask, batch.group_ids)
    mean = otb_spec.group_mean_advantage(*arguments).advantages
    rloo = otb_spec.rloo_advantage(*arguments).advantages
    ids = np.asarray(batch.group_ids).tolist()
    sizes = np.array([ids.count(key) for key in ids], dtype=np.float64)
    returns = np.abs(np.where(np.asarray(batch.response_mask) > 0, batch.rewards, 0.0)).sum(axis=1)
    magnitude = float(returns.max()) + 1.0
    summation_tolerance(2 * int(sizes.max()) + 4, 2 * magnitude).assert_close(
        mean, (1.0 - 1.0 / sizes)[:, None] * rloo, "group mean vs (1 − 1/N)·RLOO")


@given(batch=otb_st.rollout_batches(max_groups=3, max_group_size=5, max_length=8),
       align=st.sampled_from(["position", "valid_token"]), handle_zero_tail=st.booleans(),
       epsilon=st.sampled_from([0.0, 1e-8, 0.5]), output=st.sampled_from([np.float64, np.float32]))
def test_leave_one_out_advantages_are_recovered_from_verl_outputs(batch, align, handle_zero_tail, epsilon, output):
    """T7: leave_one_out_from_self_inclusive(verl's advantages, verl's returns, …) = leave_one_out_token_baseline(…),
    within the error of the advantages given times 1/(1 − λ) = D/D₋ᵢ (the conditioning its docstring states) — from the
    float64 reference's outputs and from the same outputs rounded to float32, as verl returns them."""
    mask = np.asarray(batch.response_mask, dtype=np.float64)
    energy = _realized(batch)
    totals, others, singleton, tail = _group_structure(energy, mask, batch.group_ids, align)
    self_inclusive, leave_one_out = _both_otbs(batch, align, handle_zero_tail, epsilon)
    given_advantages = self_inclusive.advantages.astype(output)
    given_returns = self_inclusive.returns.astype(output)
    recovered = otb_spec.leave_one_out_from_self_inclusive(
        given_advantages, given_returns, batch.response_mask, batch.group_ids, batch.log_probs, batch.sum_pi_squared,
        is_weights=batch.is_weights, align=align, handle_zero_tail=handle_zero_tail, epsilon=epsilon)
    self_bound, loo_bound = _reference_bounds(batch, align, handle_zero_tail, epsilon)
    rounding = output_rounding(output)
    rescaled = (mask > 0) & ~(singleton | (tail & handle_zero_tail)) & (others > 0)
    others_energy = np.maximum(totals - energy * mask, 0.0) + epsilon
    with np.errstate(divide="ignore"):
        factor = np.where(rescaled, (totals + epsilon) / np.where(others_energy > 0, others_energy, 1.0), 1.0)
    factor = np.where(rescaled & (others_energy <= 0), np.inf, factor)
    n_rows = mask.shape[0]
    factor_error = summation_tolerance(n_rows, 1.0).atol * (totals + epsilon) / np.where(
        others_energy > 0, others_energy, np.inf) + (n_rows + 4) * elementwise_tolerance().rtol
    advantage_error = self_bound.atol + self_bound.rtol * np.abs(self_inclusive.advantages) + \
        rounding.atol + rounding.rtol * np.abs(self_inclusive.advantages)
    returns_error = rounding.atol + rounding.rtol * np.abs(self_inclusive.returns)
    # where verl's zero tail forced the baseline to 0 although another member is valid (left padding or holes with
    # align="position"), A_loo is rebuilt from the returns: Gᵢ − Σ_{j≠i} GʲWʲ/D₋ᵢ, a weighted mean of the others' given
    # returns, so their rounding (≤ u·max|Gʲ| of the group) enters too, plus the float64 sums over the rows
    rebuilt = (mask > 0) & tail & handle_zero_tail & ~singleton & (others > 0)
    ids = np.asarray(batch.group_ids).tolist()
    group_return = np.array([max(np.abs(self_inclusive.returns[[r for r, k in enumerate(ids) if k == key]]).max(), 0.0)
                             for key in ids])[:, None]
    rebuilt_error = returns_error + rounding.atol + rounding.rtol * group_return + \
        summation_tolerance(2 * n_rows + 4, 2 * group_return.max(initial=0.0)).atol
    with np.errstate(invalid="ignore"):
        atol = np.where(rescaled, factor * (advantage_error + np.abs(given_advantages) * factor_error),
                        np.where(rebuilt, rebuilt_error, returns_error)) + loo_bound.atol
    tolerance = Tolerance(rtol=loo_bound.rtol, atol=np.where(mask > 0, atol, 0.0),
                          reason="error of the advantages given × D/D₋ᵢ, plus the reference's bound of A_loo")
    assume(tolerance.checked_fraction() > 0.5)
    tolerance.assert_close(recovered.advantages, leave_one_out.advantages, "recovered A_loo")
    np.testing.assert_array_equal(recovered.advantages[mask == 0], 0.0)


def _lambda_times_leave_one_out(batch):
    """λ·A_loo for toy rollouts (right-padded, no IS weights, ε = 1e-8): the part of the leave-one-out advantage
    that self-inclusive OTB removes; 0 where no other member is valid (there A_self = A_loo = G)."""
    mask = np.asarray(batch.response_mask, dtype=np.float64)
    energy = realized_energy(token_energy(np.where(mask > 0, batch.log_probs, 0.0),
                                          np.where(mask > 0, batch.sum_pi_squared, 1.0)), mask)
    groups = np.asarray(batch.group_ids)
    totals = np.zeros((groups.max() + 1, mask.shape[1]))
    counts = np.zeros_like(totals)
    np.add.at(totals, groups, energy * mask)
    np.add.at(counts, groups, mask)
    lam = np.where(counts[groups] - mask > 0, energy * mask / (totals[groups] + 1e-8), 0.0)
    leave_one_out = otb_spec.leave_one_out_token_baseline(batch.rewards, mask, groups, batch.log_probs,
                                                          batch.sum_pi_squared).advantages
    return lam * leave_one_out


@settings(max_examples=15)
@given(task=otb_st.toy_tasks(max_vocab_size=3, max_horizon=3), group_size=st.integers(2, 3))
def test_self_inclusive_bias_is_the_lambda_weighted_leave_one_out_gradient(task, group_size):
    """T7: E[ĝ_self] = ∇J − E[(1/N)·Σᵢ Σₜ λₜⁱ·sₜⁱ·Aₜ^loo,i] exactly (all Sᴺ groups) — the bias in closed form."""
    self_mean, _ = mc.exact_group_moments(task, "otb", group_size)
    removed, _ = mc.exact_group_moments(task, _lambda_times_leave_one_out, group_size)
    returns = np.abs(task.returns()).max() + 1.0
    _gradient_tolerance(task, group_size, 4 * returns).assert_close(self_mean + removed, task.gradient(),
                                                                    "E[ĝ_self] + E[λ·s·A_loo]")


def _control_variate(batch):
    """A_self − A_loo = −λ·A_loo: its group gradient has mean E[ĝ_self] − ∇J (leave-one-out OTB is unbiased, T3) and
    a variance that falls like 1/N³, so it measures the bias at large N far more precisely than ĝ_self itself."""
    return (otb_spec.estimate("otb", batch).advantages - otb_spec.estimate("otb_loo", batch).advantages)


def _well_conditioned_task():
    """The second task of proofs/T3 and T7: tabular V = 3, T = 3, seed 20, scale 0.5 (every π(y | prefix) ≥ 0.196),
    Bernoulli(½) terminal rewards drawn with numpy.random.default_rng(0)."""
    policy = EnumerablePolicy.tabular(3, 3, seed=20, scale=0.5)
    values = np.random.default_rng(0).integers(0, 2, size=policy.sequences.size).astype(float)
    return policy.task(policy.terminal_rewards(values))


def _scaled_bias_runs(task, sizes):
    """N·(E[ĝ_self] − ∇J) by the control variate, N in ``sizes``, 2²⁰ trajectories each (seed N)."""
    return {n: mc.run_monte_carlo(task, {"difference": _control_variate}, group_size=n, n_groups=2**20 // n,
                                  seed=n)["difference"] for n in sizes}


def test_self_inclusive_bias_has_the_predicted_one_over_n_coefficient():
    """T7: E[ĝ_self] = ∇J − c/N + O(1/N²) with c = Σₜ E[mₜWₜsₜ(Gₜ − B^pop_t)]/E[mₜWₜ] (exact, by enumeration). On the
    well-conditioned task every coordinate of N·(E[ĝ_self] − ∇J) is within 5 SE of −c at N = 128, 256, 512, and the
    scale coefficient N·(1 − scale) matches κ = c·∇J/‖∇J‖² = 1.3978, with ‖c_⊥‖/‖∇J‖ = 0.446 (the numbers of
    proofs/T7)."""
    task = _well_conditioned_task()
    gradient = task.gradient()
    coefficient = mc.self_inclusive_bias_coefficient(task)
    kappa = coefficient @ gradient / (gradient @ gradient)
    assert round(kappa, 4) == 1.3978
    perpendicular = coefficient - kappa * gradient                       # the tilt's coefficient, ‖c_⊥‖/‖∇J‖
    assert round(float(np.linalg.norm(perpendicular) / np.linalg.norm(gradient)), 3) == 0.446
    recorded = {128: (1.4012, 0.0030), 256: (1.3969, 0.0020), 512: (1.3973, 0.0026)}
    for n, run in _scaled_bias_runs(task, recorded).items():
        z = (n * run.mean_gradient + coefficient) / (n * run.mean_gradient_se)
        assert np.abs(z).max() < 5, (n, np.abs(z).max())
        scaled = -n * run.scale.value, n * run.scale.standard_error
        assert abs(scaled[0] - kappa) < 5 * scaled[1], (n, scaled, kappa)
        assert (round(scaled[0], 4), round(scaled[1], 4)) == recorded[n]


def test_the_recorded_task_is_as_nearly_degenerate_as_t3_says():
    """T3's recorded task: smallest π(y | prefix) 0.009, rarest sequence 4·10⁻⁶ (as printed)."""
    policy = _recorded_task().policy
    assert round(float(policy.prefix_probabilities().min()), 3) == 0.009
    assert float(f"{policy.sequences.probabilities.min():.0e}") == 4e-6


def test_one_over_n_expansion_converges_slowly_on_the_nearly_degenerate_task():
    """T7: on the recorded task of T3 (some π(y | prefix) = 0.009) the expansion is asymptotic only:
    N·(1 − scale) = 4.322 ± 0.042, 3.719 ± 0.016, 3.609 ± 0.022 at N = 128, 256, 512 against κ = 3.5732 —
    approaching it, but more than 5 SE away at N = 128 and 256 (the O(1/N²) remainder)."""
    task = _recorded_task()
    gradient = task.gradient()
    kappa = mc.self_inclusive_bias_coefficient(task) @ gradient / (gradient @ gradient)
    assert round(kappa, 4) == 3.5732
    recorded = {128: (4.322, 0.042), 256: (3.719, 0.016), 512: (3.609, 0.022)}
    for n, run in _scaled_bias_runs(task, recorded).items():
        scaled = -n * run.scale.value, n * run.scale.standard_error
        assert (round(scaled[0], 3), round(scaled[1], 3)) == recorded[n]
        assert (scaled[0] - kappa > 5 * scaled[1]) == (n < 512), n


@pytest.mark.parametrize("group_size, scale, cosine", [(2, 0.573297, 0.985218), (3, 0.640709, 0.998920),
                                                       (4, 0.695282, 0.996374)])
def test_self_inclusive_otb_is_biased_on_a_well_conditioned_task(group_size, scale, cosine):
    """T3: the bias is not an artefact of a nearly degenerate policy — the well-conditioned task (every π ≥ 0.196),
    exact enumeration."""
    task = _well_conditioned_task()
    assert task.policy.prefix_probabilities().min() > 0.196
    gradient = task.gradient()
    mean, _ = mc.exact_group_moments(task, "otb", group_size)
    assert mean @ gradient / (gradient @ gradient) == pytest.approx(scale, abs=5e-7)
    assert mean @ gradient / np.linalg.norm(mean) / np.linalg.norm(gradient) == pytest.approx(cosine, abs=5e-7)


def _shifted_gaussian_task(scale):
    """The recorded tasks of T7's "no ordering": shared parameters, V = 3, T = 3, seed 0, terminal rewards
    N(0, 1) + 5 drawn with numpy.random.default_rng(0)."""
    policy = EnumerablePolicy.log_linear(3, 3, seed=0, scale=scale)
    values = np.random.default_rng(0).normal(size=policy.sequences.size) + 5.0
    return policy.task(policy.terminal_rewards(values))


@pytest.mark.parametrize("task_name, group_size, ratio", [("well-conditioned", 2, 0.52216),
                                                          ("well-conditioned", 3, 0.50443),
                                                          ("shifted", 2, 1.11305), ("shifted", 3, 1.09603)])
def test_no_variance_ordering_between_self_inclusive_and_leave_one_out_otb(task_name, group_size, ratio):
    """T7: tr Cov(ĝ_self)/tr Cov(ĝ_loo) is below 1 on one task and above 1 on another (exact, all Sᴺ groups), although
    |A_self| ≤ |A_loo| at every token where the identity holds."""
    task = _well_conditioned_task() if task_name == "well-conditioned" else _shifted_gaussian_task(1.5)
    _, self_variance = mc.exact_group_moments(task, "otb", group_size)
    _, loo_variance = mc.exact_group_moments(task, "otb_loo", group_size)
    assert self_variance / loo_variance == pytest.approx(ratio, abs=5e-6)
    assert (self_variance < loo_variance) == (ratio < 1)


def test_self_inclusive_otb_can_lengthen_the_gradient():
    """T7 (recorded): the removed part λ·s·A_loo need not point along ∇J, so the scale can exceed 1 — shared
    parameters, scale 3, the shifted Gaussian rewards, N = 2: scale 1.330599."""
    task = _shifted_gaussian_task(3.0)
    gradient = task.gradient()
    mean, _ = mc.exact_group_moments(task, "otb", 2)
    assert mean @ gradient / (gradient @ gradient) == pytest.approx(1.330599, abs=5e-7)


# ----------------------------------------------------------------------------------------------------------------------
# T8 — rollout importance weights


def _behaviour_pair():
    """Target π and behaviour μ (the rollout engine): tabular V = 3, T = 3, seeds 3 and 7 (scale 1.5); the two tables
    list the same sequences in the same order."""
    target, behaviour = EnumerablePolicy.tabular(3, 3, seed=3), EnumerablePolicy.tabular(3, 3, seed=7)
    np.testing.assert_array_equal(target.sequences.tokens, behaviour.sequences.tokens)
    values = np.random.default_rng(0).integers(0, 2, size=target.sequences.size).astype(float)
    task = target.task(target.terminal_rewards(values))
    ratios = np.exp(target.sequences.log_probs - behaviour.sequences.log_probs) * target.sequences.mask
    return task, behaviour.sequences.probabilities, ratios


def _behaviour_expectation(task, probabilities, weights):
    """E_μ[Σₜ weights·sₜ] with sₜ the target policy's score: [P]."""
    rollouts = task.all_rollouts()
    per_token = probabilities[:, None] * weights * rollouts.response_mask
    return weighted_score_sums(rollouts, per_token, np.zeros(rollouts.size, dtype=np.int64), 1)[0]


def test_truncated_importance_weights_make_every_baseline_a_source_of_bias():
    """T8: E_μ[ρₜ·sₜ | y<ₜ] = 0 with the exact per-token ratio ρ = π/μ, so a baseline that does not depend on the token
    adds no bias; truncated at C = 1 (ρ̄ = min(ρ, 1)) it is not 0, so even a constant baseline shifts E[ĝ]."""
    task, behaviour, ratios = _behaviour_pair()
    tolerance = summation_tolerance(task.table.size * task.horizon * task.n_params, 4.0 * float(ratios.max()) + 1.0)
    untruncated = _behaviour_expectation(task, behaviour, ratios)
    tolerance.assert_close(untruncated, np.zeros_like(untruncated), "E_μ[Σ ρ s]")
    truncated = _behaviour_expectation(task, behaviour, np.minimum(ratios, 1.0))
    assert np.linalg.norm(truncated) > 0.05 and not tolerance.holds(truncated, np.zeros_like(truncated))


def test_per_token_importance_weights_do_not_correct_the_prefix_distribution():
    """T8: E_μ[Σₜ ρₜ·sₜ·Gₜ] ≠ ∇J(π) even untruncated — a per-token ratio reweights the token, not the prefix that led to
    it nor the tokens after it that Gₜ sums over; the trajectory's weight Πⱼ ρⱼ does give ∇J exactly."""
    task, behaviour, ratios = _behaviour_pair()
    returns = task.returns()
    gradient = task.gradient()
    magnitude = float(np.prod(np.maximum(ratios, 1.0), axis=1).max()) * (np.abs(returns).max() + 1.0) * 4.0
    tolerance = summation_tolerance(task.table.size * task.horizon * task.n_params, magnitude)
    trajectory_weights = np.prod(np.where(task.table.mask > 0, ratios, 1.0), axis=1, keepdims=True)
    tolerance.assert_close(_behaviour_expectation(task, behaviour, trajectory_weights * returns), gradient,
                           "E_μ[Π ρ · Σ s · G]")
    per_token = _behaviour_expectation(task, behaviour, ratios * returns)
    assert np.linalg.norm(per_token - gradient) > 0.1 * np.linalg.norm(gradient)


# ----------------------------------------------------------------------------------------------------------------------
# N1 — float32 statistics and the energy of near-deterministic tokens


def _verl_float32_statistics(logits, tokens):
    """What verl's actor hands to OTB: log π(y) = log_softmax in float32 and Σπ² = exp(lse(2z) − 2·lse(z)) in
    float32 (torch, as verl computes them)."""
    torch = pytest.importorskip("torch")
    z = torch.tensor(logits, dtype=torch.float32)
    log_probs = torch.log_softmax(z, -1).gather(-1, torch.tensor(tokens)[..., None])[..., 0]
    spp = torch.exp(torch.logsumexp(2 * z, -1) - 2 * torch.logsumexp(z, -1))
    return torch, log_probs, spp


def _near_deterministic_logits(shape, rng):
    """Logits [.., V = 8] with token 0 boosted by 6–14: π(0) from 0.98 to 1 − 10⁻⁶."""
    logits = rng.normal(size=shape + (8,)) * 2.0
    logits[..., 0] += rng.uniform(6.0, 14.0, size=shape)
    return logits


def _exact_proxy(logits, tokens):
    """w = (Σ_{v≠y} π_v)² + Σ_{v≠y} π_v² from float64 logits — a sum of non-negative terms, no cancellation."""
    shifted = np.exp(logits - logits.max(axis=-1, keepdims=True))
    probabilities = shifted / shifted.sum(axis=-1, keepdims=True)
    others = np.ones(probabilities.shape, dtype=bool)
    np.put_along_axis(others, tokens[..., None], False, axis=-1)
    rest = np.where(others, probabilities, 0.0)
    return np.square(rest.sum(axis=-1)) + np.square(rest).sum(axis=-1)


def test_float32_statistics_cannot_resolve_the_proxy_of_near_deterministic_tokens():
    """N1: for tokens with w < 10⁻⁶, the proxy from verl's float32 statistics — evaluated by verl in float32 or by the
    reference in float64 — is wrong by more than 100 % at the median and is sometimes negative; verl's own float32
    arithmetic adds at most 8ε₃₂, the statistics up to ~2·10⁻⁶. For inputs with Σπ² ≥ π² the reference's w is ≥ 0 to
    within float64's elementwise rounding (fl(exp(log π))² may pass the given Σπ² by an ulp)."""
    rng = np.random.default_rng(0)
    logits = _near_deterministic_logits((20_000,), rng)
    tokens = np.zeros(20_000, dtype=np.int64)
    torch, log_probs, spp = _verl_float32_statistics(logits, tokens)
    verl = (1 - 2 * torch.exp(log_probs) + spp).double().numpy()
    lp, s = log_probs.double().numpy(), spp.double().numpy()
    reference = np.square(np.expm1(lp)) + (s - np.exp(2 * lp))        # the reference's evaluation, unvalidated
    exact = _exact_proxy(logits, tokens)
    tiny = exact < 1e-6
    assert tiny.sum() > 1000
    relative = np.abs(verl[tiny] - exact[tiny]) / exact[tiny]
    assert np.median(relative) > 1.0 and (verl[tiny] < 0).any()
    arithmetic = elementwise_tolerance(np.float32)
    arithmetic.assert_close(verl, reference, "verl's float32 w vs the same inputs evaluated exactly")
    assert np.abs(reference - exact).max() > arithmetic.atol          # the inputs, not the arithmetic, dominate
    consistent = s >= np.exp(2 * lp)
    assert consistent.any() and (reference[consistent] >= -elementwise_tolerance().atol).all()


def test_float32_deterministic_opening_leaves_the_baseline_undetermined():
    """N1: a group of 4 whose responses open with 4 near-deterministic tokens. verl's float32 W is negative for a
    member there, its baseline leaves the range of the returns (B > max G = 1), and it differs from the baseline of the
    exact statistics by more than 0.4; the reference given the same float32 inputs cannot do better, and
    otb_tolerance marks exactly those positions ill-conditioned (+inf: the verifier does not judge them)."""
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(4, 6, 8)) * 2.0
    logits[:, :4, 0] += 12.0
    tokens = np.zeros((4, 6), dtype=np.int64)
    torch, log_probs, spp = _verl_float32_statistics(logits, tokens)
    rewards = np.zeros((4, 6))
    rewards[:, -1] = [1.0, 0.0, 1.0, 0.0]
    mask, ids = np.ones((4, 6)), np.zeros(4)
    W = (1 - 2 * torch.exp(log_probs) + spp).cumsum(-1)
    G = torch.tensor(rewards, dtype=torch.float32).flip(-1).cumsum(-1).flip(-1)
    verl_baseline = ((G * W).sum(0) / (W.sum(0) + 1e-8)).double().numpy()
    assert (W[:, :4] < 0).any() and verl_baseline.max() > 1.0
    shifted = np.exp(logits - logits.max(axis=-1, keepdims=True))
    probabilities = shifted / shifted.sum(axis=-1, keepdims=True)
    exact = otb_spec.optimal_token_baseline(rewards, mask, ids, np.log(probabilities[..., 0]),
                                            np.square(probabilities).sum(axis=-1)).baselines[0]
    assert 0.0 <= exact.min() and exact.max() <= 1.0                 # W ≥ 0: a convex combination of the returns
    assert np.abs(verl_baseline - exact)[:4].max() > 0.4
    inputs = (rewards, mask, ids, log_probs.numpy(), spp.numpy())
    bound = np.asarray(otb_tolerance(*inputs, dtype=np.float32)[0].atol)
    assert np.isinf(bound[:, :4]).all() and np.isfinite(bound[:, 4:]).all()


def _bfloat16(values):
    """float32 values rounded to the nearest bfloat16 (ties to even), returned as float32."""
    bits = np.asarray(values, np.float32).view(np.uint32)
    return ((bits + np.uint32(0x7FFF) + ((bits >> 16) & 1)) & np.uint32(0xFFFF0000)).view(np.float32)


def _forced_opening_groups(groups=100, members=8, positions=16, opening=6, vocab=4096, gap=15.0, seed=0):
    """Groups whose responses open with `opening` forced tokens (logit gap 15 over V = 4096): log π and Σπ² from
    float32 logits, Σπ² rounded to bf16 as a bf16 trainer stores it; then consistent free tokens; rewards in {0, 1}."""
    rng = np.random.default_rng(seed)
    for _ in range(groups):
        logits = rng.normal(size=(members, opening, vocab)).astype(np.float32)
        logits[..., 7] += gap
        shifted = logits - logits.max(-1, keepdims=True)
        lse = np.log(np.exp(shifted).sum(-1, dtype=np.float32))
        log_pi = np.empty((members, positions), np.float32)
        spp = np.empty((members, positions), np.float32)
        log_pi[:, :opening] = shifted[..., 7] - lse
        spp[:, :opening] = _bfloat16(np.square(np.exp(shifted - lse[..., None])).sum(-1, dtype=np.float32))
        pi = rng.uniform(0.2, 0.9, size=(members, positions - opening))
        log_pi[:, opening:] = np.log(pi)
        spp[:, opening:] = _bfloat16(pi**2 + (1 - pi) ** 2 * rng.uniform(0.1, 1.0, size=pi.shape))
        rewards = np.zeros((members, positions), np.float32)
        rewards[:, -1] = rng.integers(0, 2, members)
        yield rewards, np.ones((members, positions), np.float32), np.zeros(members, np.int64), log_pi, spp


def test_bfloat16_statistics_of_a_forced_opening_leave_one_out_stays_a_weighted_mean():
    """N1.5 as printed: over 100 groups of 8 with a 6-token forced opening and bf16 Σπ² (accepted by the value
    checks), max|A| per group — verl's self-inclusive formula above 10 in 20 groups (worst 253), leave-one-out with the
    bare weights W in 37 (worst 386), leave-one-out with W⁺ = max(W, 0) (the reference) in none: |A| ≤ max|G| = 1."""
    self_inclusive, clamped, bare = [], [], []
    for rewards, mask, ids, log_pi, spp in _forced_opening_groups():
        self_inclusive.append(np.abs(otb_spec.optimal_token_baseline(rewards, mask, ids, log_pi, spp).advantages).max())
        clamped.append(np.abs(otb_spec.leave_one_out_token_baseline(rewards, mask, ids, log_pi, spp).advantages).max())
        returns = otb_spec.returns_to_go(rewards, mask)
        energy = np.cumsum(otb_spec.token_energy(log_pi, spp) * mask, axis=-1)       # the bare W, some < 0
        numerator = (returns * energy).sum(0) - returns * energy
        others = energy.sum(0) - energy
        bare.append(np.abs(returns - np.where(others > 0, numerator / np.where(others > 0, others + 1e-8, 1.0),
                                              0.0)).max())
    self_inclusive, clamped, bare = map(np.asarray, (self_inclusive, clamped, bare))
    assert (self_inclusive > 10).sum() == 20 and round(float(self_inclusive.max())) == 253
    assert (bare > 10).sum() == 37 and round(float(bare.max())) == 386
    assert clamped.max() <= 1.0 + 1e-12


def test_verls_sum_pi_squared_of_bfloat16_logits_breaks_the_rule_pi_squared_at_most_sum():
    """N1.4 as printed there: verl's exp(lse(2z) − 2·lse(z)) evaluated in bfloat16 on logits ~N(0, 8²), V = 32768
    (512 rows, seed 0), against the exact Σπ² of the same bf16 values: its largest and median relative errors, how far
    π² of a token drawn from π passes it, and on what fraction of rows by more than float32's slack of the rule."""
    torch = pytest.importorskip("torch")
    generator = torch.Generator().manual_seed(0)
    rows, vocab = 512, 32768
    logits = (torch.randn(rows, vocab, generator=generator) * 8).to(torch.bfloat16)
    verl = torch.exp(torch.logsumexp(2 * logits, -1) - 2 * torch.logsumexp(logits, -1)).double()
    probabilities = torch.softmax(logits.double(), -1)
    exact = torch.square(probabilities).sum(-1)
    relative = (verl - exact).abs() / exact
    tokens = torch.multinomial(probabilities, 1, generator=generator)[:, 0]
    excess = torch.square(probabilities[torch.arange(rows), tokens]) - verl
    slack = input_range_slack(np.float32)
    text = " ".join((Path(__file__).resolve().parents[1] / "proofs" / "N1_float32_energy.md").read_text(
        encoding="utf-8").split())
    stated = re.search(r"up to (\d+) %, median (\d+) %; π² above it by up to (0\.\d+), on (\d+) % of the rows by "
                       r"more than the float32 slack 10⁻² of the rule", text)
    assert stated and slack == 1e-2
    # each within one unit of its printed last digit: torch's bfloat16 reductions may change their order between
    # releases, which moves these extremes of one sample by a little, not the claim
    measured = (100 * float(relative.max()), 100 * float(relative.median()), float(excess.max()),
                100 * float((excess > slack).double().mean()))
    for value, text, unit in zip(measured, stated.groups(), (1, 1, 0.01, 1)):
        assert abs(value - float(text)) <= unit, (value, text)


@pytest.mark.parametrize("aggregation, estimator, group_size, scale, cosine", [
    ("token_mean", "rloo", 2, 0.828310, 0.997593), ("token_mean", "rloo", 4, 0.919261, 0.999157),
    ("token_mean", "otb_loo", 2, 0.883080, 0.992573), ("token_mean", "otb_loo", 4, 0.932952, 0.998844),
    ("sequence_mean", "rloo", 2, 0.776715, 0.951158), ("sequence_mean", "rloo", 4, 0.776715, 0.951158),
    ("sequence_mean", "otb_loo", 2, 0.831485, 0.956711), ("sequence_mean", "otb_loo", 4, 0.807327, 0.950471)])
def test_token_mean_and_sequence_mean_aggregations_bias_even_unbiased_estimators(aggregation, estimator, group_size,
                                                                                 scale, cosine):
    """T3.4: RLOO and leave-one-out OTB are unbiased for the sequence-sum gradient only. Normalised by the group's
    token count (token-mean) or by each sequence's length (sequence-mean) they are biased in scale and direction —
    exact enumeration on the well-conditioned task; the sequence-mean bias of RLOO does not shrink with N."""
    task = _well_conditioned_task()
    gradient = task.gradient()
    mean, _ = mc.exact_group_moments(task, estimator, group_size, aggregation=aggregation)
    assert mean @ gradient / (gradient @ gradient) == pytest.approx(scale, abs=5e-7)
    assert mean @ gradient / np.linalg.norm(mean) / np.linalg.norm(gradient) == pytest.approx(cosine, abs=5e-7)


# ----------------------------------------------------------------------------------------------------------------------
# F1, item 2 — the finite-group statements, against the recorded lab (docs/lab-results.json, regenerated by
# `otb-spec lab` and compared with a fresh run by the slow test_full_lab_reproduces_the_recorded_results)

LAB_RESULTS = Path(__file__).resolve().parents[1] / "docs" / "lab-results.json"
REGIMES = ("random", "confidence", "long")


def _printed(pair, digits):
    """A recorded [value, SE] as printed in proofs/F1 (``digits`` decimals)."""
    return round(pair[0], digits), round(pair[1], digits)


def _matches(pair, text):
    """A recorded [value, SE] against "v ± e" as printed in proofs/F1, to the decimals printed."""
    value, error = (part.strip() for part in text.split("±"))
    digits = len(error.split(".")[1]) if "." in error else 0
    return (round(pair[0], digits), round(pair[1], digits)) == (float(value), float(error))


def _verdict(pair, below="lower", above="higher"):
    value, error = pair
    return below if value + 5 * error <= 1 else above if value - 5 * error > 1 else "unclear"


def test_f1_finite_group_statements_hold_in_the_recorded_lab():
    """F1.2–3: the recorded lab supports every number and verdict the file states, and no more."""
    lab = json.loads(LAB_RESULTS.read_text())["regimes"]
    cells = {regime: lab[regime]["cells"] for regime in REGIMES}
    otb = {regime: {n: cells[regime][n]["otb"] for n in cells[regime]} for regime in REGIMES}
    # bias: scales and tilts
    assert [_printed(otb[r]["4"]["scale"], 4) for r in REGIMES] == [(0.3145, 0.0037), (0.0996, 0.0049),
                                                                    (0.6867, 0.0051)]
    assert [_printed(otb[r]["32"]["scale"], 4) for r in REGIMES] == [(0.8810, 0.0045), (0.6370, 0.0094),
                                                                     (0.9661, 0.0052)]
    assert [_printed(otb["random"][n]["tilt_degrees"], 2) for n in ("2", "4", "32")] == [(10.05, 0.09), (7.13, 0.06),
                                                                                         (3.05, 0.08)]
    assert all(otb["random"][n]["tilt_resolved"] for n in otb["random"])
    assert [otb["confidence"][n]["tilt_resolved"] for n in ("2", "4", "8", "16", "32")] == [False] * 3 + [True] * 2
    assert round(otb["confidence"]["4"]["tilt_upper_bound_degrees"], 1) == 18.7
    assert _printed(otb["confidence"]["32"]["tilt_degrees"], 2) == (5.56, 0.28)
    assert not any(otb["long"][n]["tilt_resolved"] for n in otb["long"])
    assert [round(otb["long"][n]["tilt_upper_bound_degrees"], 1) for n in ("4", "32")] == [7.3, 4.6]
    # raw variance below the group mean's in every cell but confidence, N = 2
    higher = []
    for regime in REGIMES:
        for n, cell in cells[regime].items():
            (a, da), (b, db) = cell["otb"]["variance_vs_reinforce"], cell["group_mean"]["variance_vs_reinforce"]
            assert abs(a - b) > 5 * np.hypot(da, db), (regime, n)
            if a > b:
                higher.append((regime, n))
    assert higher == [("confidence", "2")]
    assert (_printed(otb["confidence"]["2"]["variance_vs_reinforce"], 4),
            _printed(cells["confidence"]["2"]["group_mean"]["variance_vs_reinforce"], 4)) == ((0.1462, 0.0014),
                                                                                             (0.0211, 0.0004))
    # head to head, per unit of signal, same groups
    stated = {
        ("random", "otb/group_mean"): ["higher", "higher", "higher", "lower", "lower"],
        ("confidence", "otb/group_mean"): ["unclear", "higher", "higher", "higher", "unclear"],
        ("long", "otb/group_mean"): ["lower", "unclear", "unclear", "lower", "lower"],
        ("random", "otb_loo/rloo"): ["lower", "higher", "higher", "unclear", "lower"],
        ("confidence", "otb_loo/rloo"): ["higher", "higher", "higher", "unclear", "unclear"],
        ("long", "otb_loo/rloo"): ["lower"] * 5,
    }
    for (regime, pair), verdicts in stated.items():
        recorded = lab[regime]["head_to_head"][pair]
        assert [_verdict(recorded[n]) for n in ("2", "4", "8", "16", "32")] == verdicts, (regime, pair)
    assert _printed(otb["confidence"]["2"]["scale"], 3) == (0.026, 0.015)
    assert [_printed(lab["random"]["head_to_head"]["otb/group_mean"][n], 3) for n in ("2", "4", "8", "16", "32")] \
        == [(1.240, 0.024), (2.060, 0.047), (1.350, 0.023), (0.875, 0.015), (0.678, 0.013)]
    assert _printed(lab["long"]["head_to_head"]["otb/group_mean"]["2"], 4) == (0.6135, 0.0081)
    assert [_printed(lab["long"]["head_to_head"]["otb_loo/rloo"][n], 4) for n in ("2", "32")] == [(0.8299, 0.0013),
                                                                                                 (0.8890, 0.0023)]
    printed = {
        ("confidence", "otb/group_mean"): {"4": "22.2 ± 2.9", "8": "2.90 ± 0.12", "16": "1.493 ± 0.072",
                                           "32": "0.969 ± 0.037"},
        ("long", "otb/group_mean"): {"4": "1.010 ± 0.015", "8": "0.977 ± 0.011", "16": "0.922 ± 0.012",
                                     "32": "0.889 ± 0.010"},
        ("random", "otb_loo/rloo"): {"2": "0.9142 ± 0.0018", "4": "1.1894 ± 0.0063", "8": "1.1925 ± 0.0097",
                                     "32": "0.806 ± 0.012"},
        ("confidence", "otb_loo/rloo"): {"2": "2.470 ± 0.031", "4": "1.1488 ± 0.0094", "8": "1.129 ± 0.013"},
    }
    for (regime, pair), numbers in printed.items():
        for n, text in numbers.items():
            assert _matches(lab[regime]["head_to_head"][pair][n], text), (regime, pair, n, text)
    comparison = {regime: lab[regime]["otb_n4_vs_group_mean_n32"] for regime in REGIMES}
    stated_n4 = {
        ("otb", "raw"): ["2.182 ± 0.039", "2.036 ± 0.094", "5.416 ± 0.053"],
        ("otb_loo", "raw"): ["12.74 ± 0.18", "10.63 ± 0.29", "10.127 ± 0.099"],
        ("otb_exact", "raw"): ["2.737 ± 0.041", "2.040 ± 0.094", "5.260 ± 0.052"],
        ("otb", "equal_trajectories"): ["0.2728 ± 0.0049", "0.255 ± 0.012", "0.6771 ± 0.0066"],
        ("otb", "equal_trajectories_adjusted"): ["2.589 ± 0.066", "24.1 ± 3.1", "1.347 ± 0.021"],
        ("otb_loo", "equal_trajectories"): ["1.592 ± 0.023", "1.328 ± 0.036", "1.266 ± 0.012"],
    }
    for (estimator, view), texts in stated_n4.items():
        for regime, text in zip(REGIMES, texts):
            assert _matches(comparison[regime][estimator][view], text), (regime, estimator, view, text)
    # N = 4 against N = 32: equal tokens agrees with equal trajectories within the errors
    for regime in REGIMES:
        for estimator, views in lab[regime]["otb_n4_vs_group_mean_n32"].items():
            (a, da), (b, db) = views["equal_tokens"], views["equal_trajectories"]
            assert abs(a - b) < 5 * np.hypot(da, db), (regime, estimator)
    # item 3: the oracle's per-unit-of-signal variance at N = 32, against the group mean's
    oracle = [_printed(cells[r]["32"]["oracle"]["adjusted_variance_vs_reinforce"], 4) for r in REGIMES]
    mean = [_printed(cells[r]["32"]["group_mean"]["adjusted_variance_vs_reinforce"], 4) for r in REGIMES]
    assert oracle == [(0.3208, 0.0064), (0.0219, 0.0008), (0.6503, 0.0042)]
    assert mean == [(0.7677, 0.0074), (0.0643, 0.0020), (0.7560, 0.0049)]
    assert [round(b[0] / a[0], 1) for a, b in zip(oracle, mean)] == [2.4, 2.9, 1.2]
    paired = [lab[r]["head_to_head"]["oracle/group_mean"]["32"] for r in REGIMES]
    assert [_printed(ratio, 4) for ratio in paired] == [(0.4178, 0.0075), (0.3415, 0.0073), (0.8602, 0.0025)]
    assert [round(1 / ratio[0], 1) for ratio in paired] == [2.4, 2.9, 1.2]
    assert all(value - 5 * error > 1 / 8 for value, error in paired)    # no constant baseline is 8× below it


_F1_CELLS = ("2", "4", "8", "16", "32")


def _stated_verdicts(text: str) -> dict[str, dict[str, str]]:
    """{regime: {N: verdict}} from "regime — higher at N = 2, 4 (…), unclear at N = 8, lower at every N (…); …"."""
    stated: dict[str, dict[str, str]] = {}
    for regime, clauses in re.findall(r"(random|confidence|long) — (.*?)(?=; (?:random|confidence|long) —|$)", text,
                                      flags=re.S):
        cells = stated.setdefault(regime, {})
        for verdict, where in re.findall(r"(higher|lower|unclear) at (every N|N = \d+(?:, \d+)*)", clauses):
            for n in (_F1_CELLS if where == "every N" else re.findall(r"\d+", where)):
                assert n not in cells, (regime, n, "stated twice")
                cells[n] = verdict
    return stated


def test_f1_prints_the_recorded_numbers_and_verdicts_in_the_places_it_states_them():
    """F1 items 2–3 as written: every "v ± e" of the file, in the file's order, is the recorded lab statistic the
    sentence around it names (to the decimals printed), and every higher/lower/unclear of the two head-to-head
    bullets is the recorded verdict at 5 SE — a number changed or moved between regimes, or a verdict flipped, in
    proofs/F1 fails here (test_f1_finite_group_statements_hold_in_the_recorded_lab checks the lab itself)."""
    lab = json.loads(LAB_RESULTS.read_text())["regimes"]
    items = _F1_TEXT.split("2. **Finite groups**", 1)[1].split("## Derivation", 1)[0]
    cell = {r: {n: lab[r]["cells"][n] for n in _F1_CELLS} for r in REGIMES}
    head = {r: lab[r]["head_to_head"] for r in REGIMES}
    n4 = {r: lab[r]["otb_n4_vs_group_mean_n32"] for r in REGIMES}
    expected = (
        [cell[r]["4"]["otb"]["scale"] for r in REGIMES] + [cell[r]["32"]["otb"]["scale"] for r in REGIMES]
        + [cell["random"][n]["otb"]["tilt_degrees"] for n in ("2", "4", "32")]
        + [cell["confidence"]["32"]["otb"]["tilt_degrees"]]
        + [cell["confidence"]["2"][e]["variance_vs_reinforce"] for e in ("otb", "group_mean")]
        + [head["random"]["otb/group_mean"][n] for n in _F1_CELLS]
        + [cell["confidence"]["2"]["otb"]["scale"]]
        + [head["confidence"]["otb/group_mean"][n] for n in ("4", "8", "16", "32")]
        + [head["long"]["otb/group_mean"][n] for n in ("2", "4", "8", "16", "32")]
        + [head["random"]["otb_loo/rloo"][n] for n in ("2", "4", "8", "32")]
        + [head["confidence"]["otb_loo/rloo"][n] for n in ("2", "4", "8")]
        + [head["long"]["otb_loo/rloo"][n] for n in ("2", "32")]
        + [n4[r][estimator][view] for estimator, view in (("otb", "raw"), ("otb_loo", "raw"), ("otb_exact", "raw"),
                                                          ("otb", "equal_trajectories"),
                                                          ("otb", "equal_trajectories_adjusted"),
                                                          ("otb_loo", "equal_trajectories")) for r in REGIMES]
        + [cell[r]["32"][e]["adjusted_variance_vs_reinforce"] for r in REGIMES for e in ("oracle", "group_mean")]
        + [head[r]["oracle/group_mean"]["32"] for r in REGIMES])
    printed = re.findall(r"\d+\.\d+ ± \d+\.\d+", items)
    assert len(printed) == len(expected)
    mismatched = [(k, text_, value) for k, (text_, value) in enumerate(zip(printed, expected))
                  if not _matches(value, text_)]
    assert mismatched == []
    bullets = {"otb/group_mean": items.split("**Per unit of signal, self-inclusive OTB ÷ group mean:**", 1)[1]
                                      .split("*Corrected:*", 1)[0],
               "otb_loo/rloo": items.split("**Leave-one-out OTB ÷ RLOO**", 1)[1].split("* **N = 4", 1)[0]}
    for pair, bullet in bullets.items():
        stated = _stated_verdicts(bullet)
        recorded = {r: {n: _verdict(head[r][pair][n]) for n in _F1_CELLS} for r in REGIMES}
        assert stated == recorded, pair


def _stated_cells(phrase: str) -> set[tuple[str, str]]:
    """{(regime, N)} from "N = 2–8 (random) and N = 2, 16, 32 (long)", "every N in the long regime", "N ≤ 8 (…)"."""
    cells: set[tuple[str, str]] = set()
    for regime in re.findall(r"every N in the (random|confidence|long) regime", phrase):
        cells |= {(regime, n) for n in _F1_CELLS}
    for where, regime in re.findall(r"N (= \d+(?:(?:, |–)\d+)*|≤ \d+) \((random|confidence|long)\)", phrase):
        if where.startswith("≤"):
            ns = [n for n in _F1_CELLS if int(n) <= int(where[1:])]
        elif "–" in where:
            low, high = (int(part) for part in where[1:].split("–"))
            ns = [n for n in _F1_CELLS if low <= int(n) <= high]
        else:
            ns = re.findall(r"\d+", where)
        cells |= {(regime, n) for n in ns}
    return cells


def test_readme_lab_section_states_the_recorded_numbers_and_verdicts():
    """The README's "What the lab found", as written: its numbers, in order, are the recorded statistics its sentences
    name, and the cells it says are higher or lower per unit of signal are exactly the recorded verdicts at 5 SE."""
    lab = json.loads(LAB_RESULTS.read_text())["regimes"]
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    section = readme.split("## What the lab found", 1)[1].split("\n## ", 1)[0]
    raw = [(lab[r]["otb_n4_vs_group_mean_n32"][e]["raw"]) for r in REGIMES for e in ("otb", "otb_loo", "otb_exact")]
    expected = ([lab[r]["cells"]["4"]["otb"]["scale"] for r in REGIMES]
                + [lab["random"]["cells"]["4"]["otb"]["tilt_degrees"], min(raw), max(raw)]
                + [lab["random"]["otb_n4_vs_group_mean_n32"]["otb"][view]
                   for view in ("equal_trajectories", "equal_trajectories_adjusted")])
    printed = re.findall(r"\d+\.\d+ ± \d+\.\d+", section)
    assert len(printed) == len(expected) and all(_matches(v, t) for t, v in zip(printed, expected)), printed
    assert f"(< {lab['confidence']['cells']['4']['otb']['tilt_upper_bound_degrees']:.1f}°)" in section
    assert not any(lab["long"]["cells"][n]["otb"]["tilt_resolved"] for n in _F1_CELLS)     # "nor at any N"

    def recorded(pair, verdict):
        return {(r, n) for r in REGIMES for n in _F1_CELLS if _verdict(lab[r]["head_to_head"][pair][n]) == verdict}

    sentence = " ".join(section.split("Per unit of signal neither wins everywhere.", 1)[1].split("Population", 1)[0]
                        .split())
    otb_part, loo_part = sentence.split("leave-one-out OTB has", 1)
    more, less = otb_part.split("more variance than the group mean", 1)[1].split(" and less at ", 1)
    assert _stated_cells(more) == recorded("otb/group_mean", "higher")
    assert _stated_cells(less) == recorded("otb/group_mean", "lower")
    less, more = loo_part.split("less than RLOO", 1)[1].split(" and more at ", 1)
    assert _stated_cells(less) == recorded("otb_loo/rloo", "lower")
    assert _stated_cells(more) == recorded("otb_loo/rloo", "higher")

