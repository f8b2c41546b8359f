"""The toy policies' ground truth is right: exact gradients against finite differences, exact objectives against
Monte Carlo, and sampling frequencies against the enumerated probabilities."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings

from otb_spec import strategies as otb_st
from otb_spec.tolerances import summation_tolerance
from otb_spec.toy import EnumerablePolicy, MarkovPolicy, group_gradients

FLOAT64_EPS = np.finfo(np.float64).eps


def _central_difference(objective, theta: np.ndarray, step: float) -> np.ndarray:
    gradient = np.zeros(theta.size)
    for k in range(theta.size):
        up, down = theta.ravel().copy(), theta.ravel().copy()
        up[k] += step
        down[k] -= step
        gradient[k] = (objective(up) - objective(down)) / (2 * step)
    return gradient


def _assert_matches_finite_differences(exact: np.ndarray, objective, theta: np.ndarray, value_scale: float) -> None:
    """Central differences have error c·h² + ε·|J|/h; the change between h and h/2 estimates the first term
    (Richardson), so |exact − FD(h/2)| ≤ |FD(h) − FD(h/2)| (the h² error of FD(h/2) is a third of it) plus rounding."""
    step = 1e-4
    coarse = _central_difference(objective, theta, step)
    fine = _central_difference(objective, theta, step / 2)
    tolerance = np.abs(coarse - fine) + 20 * FLOAT64_EPS * value_scale / (step / 2)
    assert np.all(np.abs(exact - fine) <= tolerance), np.max(np.abs(exact - fine) - tolerance)


@settings(max_examples=25)
@given(task=otb_st.toy_tasks(max_vocab_size=3, max_horizon=3))
def test_enumerable_gradient_matches_finite_differences(task):
    policy = task.policy
    exact = task.gradient()

    def objective(theta):
        return policy.with_theta(theta).task(task.rewards).objective()

    scale = float(np.abs(task.rewards).sum() + 1.0)
    _assert_matches_finite_differences(exact, objective, policy.theta, scale)


@given(policy=otb_st.toy_policies())
def test_enumerated_sequences_are_a_probability_distribution(policy):
    table = policy.sequences
    assert abs(table.probabilities.sum() - 1.0) <= table.size * 4 * FLOAT64_EPS
    assert np.all(table.probabilities > 0)
    # every sequence ends with EOS or reaches the horizon
    last = table.tokens[np.arange(table.size), table.lengths - 1]
    assert np.all((last == 0) | (table.lengths == policy.horizon))
    assert len({tuple(row) for row in table.tokens.tolist()}) == table.size


def test_sampling_frequencies_match_the_enumerated_probabilities():
    """Counts of each sequence in 200 000 draws: every cell within 5 binomial standard errors."""
    policy = EnumerablePolicy.log_linear(3, 3, seed=7)
    task = policy.task(np.zeros(policy.sequences.mask.shape))
    draws = 200_000
    ids = task.sample(draws, np.random.default_rng(11)).sequence_ids
    counts = np.bincount(ids, minlength=policy.sequences.size)
    p = policy.sequences.probabilities
    se = np.sqrt(draws * p * (1 - p))
    assert np.all(np.abs(counts - draws * p) < 5 * se)


@pytest.fixture(scope="module")
def markov_task():
    policy = MarkovPolicy.random(vocab_size=4, horizon=12, n_buckets=3, seed=2)
    token_rewards = np.random.default_rng(5).normal(size=(12, 4))
    return policy.task(token_rewards=token_rewards, length_rewards=np.linspace(0.0, 1.0, 13))


def test_markov_gradient_matches_finite_differences(markov_task):
    policy = markov_task.policy

    def objective(theta):
        return replace(policy, theta=theta.reshape(policy.theta.shape)).task(
            markov_task.token_rewards, markov_task.length_rewards).objective()

    # finite differences run over Θ[bucket, previous, next]; the gradient is in the scores' [next, feature] layout
    unflattened = markov_task.gradient().reshape(policy.vocab_size, policy.theta.shape[0], policy.vocab_size)
    _assert_matches_finite_differences(np.transpose(unflattened, (1, 2, 0)).ravel(), objective, policy.theta,
                                       float(np.abs(markov_task.token_rewards).sum() + 1.0))


def test_markov_objective_and_gradient_match_monte_carlo(markov_task):
    """J, E[L] and every coordinate of ∇J = E[Σₜ sₜGₜ] within 5 standard errors of 200 000 sampled trajectories."""
    n = 200_000
    rollouts = markov_task.sample(n, np.random.default_rng(3))
    returns_total = rollouts.rewards.sum(axis=1)
    assert abs(returns_total.mean() - markov_task.objective()) < 5 * returns_total.std(ddof=1) / np.sqrt(n)
    lengths = rollouts.response_mask.sum(axis=1)
    assert abs(lengths.mean() - markov_task.expected_length()) < 5 * lengths.std(ddof=1) / np.sqrt(n)
    returns = np.flip(np.cumsum(np.flip(rollouts.rewards, axis=1), axis=1), axis=1) * rollouts.response_mask
    # per-trajectory REINFORCE gradients in blocks of 1000 (groups of one)
    per_block = group_gradients(rollouts, returns, np.arange(n) // 1000, n // 1000, markov_task.n_params) * 1000
    mean = per_block.mean(axis=0) / 1000
    se = per_block.std(axis=0, ddof=1) / 1000 / np.sqrt(n // 1000)
    exact = markov_task.gradient()
    assert np.all(np.abs(mean - exact) <= 5 * se)      # a coordinate with SE 0 is 0 in every sample and in ∇J


def test_markov_lengths_are_heterogeneous_over_a_long_horizon():
    policy = MarkovPolicy.random(vocab_size=4, horizon=200, n_buckets=8, seed=0)
    lengths = policy.task().sample(5000, np.random.default_rng(0)).response_mask.sum(axis=1)
    assert lengths.min() < 50 and lengths.max() > 150 and 60 < np.median(lengths) < 160


def test_markov_cumulative_norms_match_dense_scores():
    """‖Sₜ‖² from the running per-block sums equals the norm of the explicitly accumulated score vectors."""
    policy = MarkovPolicy.random(vocab_size=3, horizon=30, n_buckets=4, seed=1)
    rollouts = policy.task().sample(50, np.random.default_rng(1))
    scores = rollouts.dense_scores()                                        # [n, T, P]
    expected = np.sum(np.square(np.cumsum(scores, axis=1)), axis=2)
    # both sides sum t ≤ T score vectors and square P coordinates: each within (2T + P + 4)·ε·Σₖ(Σⱼ|sⱼₖ|)² of the
    # exact value, so their difference within twice that
    magnitude = np.sum(np.square(np.cumsum(np.abs(scores), axis=1)), axis=2)
    bound = 2 * summation_tolerance(2 * scores.shape[1] + scores.shape[2] + 2, 1.0).atol * magnitude
    assert np.all(np.abs(rollouts.cumulative_score_sq_norms - expected) <= bound)


def test_toy_constructors_validate_their_sizes():
    with pytest.raises(ValueError, match="vocab_size: need EOS and at least one other token"):
        EnumerablePolicy.tabular(1, 3)
    with pytest.raises(ValueError, match="too many to enumerate"):
        EnumerablePolicy.tabular(30, 6)
    policy = EnumerablePolicy.tabular(3, 2)
    with pytest.raises(ValueError, match=r"rewards: expected shape"):
        policy.task(np.zeros((2, 2)))
    noncausal = np.zeros(policy.sequences.mask.shape)
    first = np.flatnonzero(policy.sequences.tokens[:, 0] == 1)[:2]        # two sequences starting with token 1
    noncausal[first[0], 0] = 1.0
    with pytest.raises(ValueError, match="rewards: not causal"):
        policy.task(noncausal)
    with pytest.raises(ValueError, match=r"token_rewards: expected shape"):
        MarkovPolicy.random(3, 10, n_buckets=2).task(token_rewards=np.zeros((3, 3)))
