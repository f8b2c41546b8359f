"""OTB follows verl's semantics exactly: the vectorized reference agrees with a naive per-group transcription, and the
hand-worked examples of the docstrings and docs hold."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, note
from hypothesis import strategies as st

import otb_spec as otb
from otb_spec import strategies as otb_st
from otb_spec.tolerances import otb_tolerance

from naive_otb import leave_one_out as naive_leave_one_out
from naive_otb import multi_turn as naive_multi_turn
from naive_otb import single_turn as naive_single_turn

pytestmark = pytest.mark.bitexact  # bit-for-bit assertions: .ci/run repeats them at baseline SIMD, one thread


def _tolerances(batch, **variant):
    """Reference and oracle both compute in float64, each within the forward error bound: compare with twice it."""
    advantages, returns = otb_tolerance(batch.rewards, batch.response_mask, batch.group_ids, batch.log_probs,
                                        batch.sum_pi_squared, is_weights=batch.is_weights, dtype=np.float64,
                                        **variant)
    note(f"checked fraction of advantages: {advantages.checked_fraction():.3f}")
    return advantages + advantages, returns + returns


@given(batch=otb_st.rollout_batches(), handle_zero_tail=st.booleans(),
       epsilon=st.sampled_from([0.0, 1e-8, 1e-3, 1.0]))
def test_single_turn_matches_naive_transcription(batch, handle_zero_tail, epsilon):
    result = otb.optimal_token_baseline(batch.rewards, batch.response_mask, batch.group_ids, batch.log_probs,
                                        batch.sum_pi_squared, is_weights=batch.is_weights,
                                        handle_zero_tail=handle_zero_tail, epsilon=epsilon)
    expected_advantages, expected_returns = naive_single_turn(
        batch.rewards, batch.response_mask, batch.group_ids, batch.log_probs, batch.sum_pi_squared,
        batch.is_weights, handle_zero_tail, epsilon)
    advantages_tolerance, returns_tolerance = _tolerances(batch, handle_zero_tail=handle_zero_tail, epsilon=epsilon)
    returns_tolerance.assert_close(result.returns, expected_returns, "returns")
    advantages_tolerance.assert_close(result.advantages, expected_advantages, "advantages")


@given(batch=otb_st.rollout_batches(), handle_zero_tail=st.booleans(),
       epsilon=st.sampled_from([0.0, 1e-8, 1e-3, 1.0]))
def test_multi_turn_matches_naive_transcription(batch, handle_zero_tail, epsilon):
    result = otb.multi_turn_optimal_token_baseline(batch.rewards, batch.response_mask, batch.group_ids,
                                                   batch.log_probs, batch.sum_pi_squared,
                                                   is_weights=batch.is_weights, handle_zero_tail=handle_zero_tail,
                                                   epsilon=epsilon)
    expected_advantages, expected_returns = naive_multi_turn(
        batch.rewards, batch.response_mask, batch.group_ids, batch.log_probs, batch.sum_pi_squared,
        batch.is_weights, handle_zero_tail, epsilon)
    advantages_tolerance, returns_tolerance = _tolerances(batch, align="valid_token",
                                                          handle_zero_tail=handle_zero_tail, epsilon=epsilon)
    returns_tolerance.assert_close(result.returns, expected_returns, "returns")
    advantages_tolerance.assert_close(result.advantages, expected_advantages, "advantages")


@given(batch=otb_st.rollout_batches(), epsilon=st.sampled_from([0.0, 1e-8, 1.0]))
def test_leave_one_out_matches_naive_transcription(batch, epsilon):
    result = otb.leave_one_out_token_baseline(batch.rewards, batch.response_mask, batch.group_ids, batch.log_probs,
                                              batch.sum_pi_squared, is_weights=batch.is_weights, epsilon=epsilon)
    expected_advantages, expected_returns = naive_leave_one_out(
        batch.rewards, batch.response_mask, batch.group_ids, batch.log_probs, batch.sum_pi_squared,
        batch.is_weights, epsilon)
    advantages_tolerance, _ = _tolerances(batch, leave_one_out=True, epsilon=epsilon)
    advantages_tolerance.assert_close(result.advantages, expected_advantages, "advantages")


def test_worked_example_single_turn_by_hand():
    """Two members, w = ½ everywhere, ε = 0 (docs/worked-examples.md, example 1)."""
    half = np.full((2, 3), 0.5)
    result = otb.optimal_token_baseline([[0, 0, 1], [0, 0, 0]], [[1, 1, 1], [1, 1, 0]], ["q", "q"],
                                        np.log(half), half, epsilon=0.0)
    # W = (.5, 1, 1.5) and (.5, 1, 1); G = (1, 1, 1) and (0, 0, 0)
    # B_0 = (1·.5 + 0·.5)/(.5 + .5) = .5; B_1 = (1·1)/(1 + 1) = .5; B_2: member 0 is the unique longest → 0
    np.testing.assert_array_equal(result.baselines, [[0.5, 0.5, 0.0], [0.5, 0.5, 0.0]])
    np.testing.assert_array_equal(result.advantages, [[0.5, 0.5, 1.0], [-0.5, -0.5, 0.0]])
    np.testing.assert_array_equal(result.returns, [[1, 1, 1], [0, 0, 0]])
    without_tail = otb.optimal_token_baseline([[0, 0, 1], [0, 0, 0]], [[1, 1, 1], [1, 1, 0]], ["q", "q"],
                                              np.log(half), half, epsilon=0.0, handle_zero_tail=False)
    # at t = 2 only member 0 is valid: B_2 = 1·1.5/1.5 = 1 → A = 0, the signal the zero tail restores
    np.testing.assert_array_equal(without_tail.advantages, [[0.5, 0.5, 0.0], [-0.5, -0.5, 0.0]])


def test_worked_example_importance_weights_enter_squared():
    """ρ = 2 on member 0's first token multiplies its w by 4: W₀ = (2, 2.5), W₁ = (.5, 1)."""
    half = np.full((2, 2), 0.5)
    rho = np.array([[2.0, 1.0], [1.0, 1.0]])
    result = otb.optimal_token_baseline([[0, 1], [0, 0]], np.ones((2, 2)), [0, 0], np.log(half), half,
                                        is_weights=rho, epsilon=0.0)
    # B_0 = (1·2 + 0·.5)/(2.5) = .8 ; B_1 = (1·2.5)/(2.5 + 1) = 5/7
    np.testing.assert_allclose(result.baselines, [[0.8, 5 / 7], [0.8, 5 / 7]], rtol=1e-15)


def test_worked_example_singleton_group_gets_no_baseline():
    half = np.full((3, 2), 0.5)
    result = otb.optimal_token_baseline([[0, 1], [0, 3], [0, 0]], np.ones((3, 2)), ["a", "b", "a"], np.log(half),
                                        half)
    np.testing.assert_array_equal(result.advantages[1], [3.0, 3.0])
    np.testing.assert_array_equal(result.baselines[1], [0.0, 0.0])


def test_worked_example_zero_energy_group_means_no_baseline():
    """A deterministic policy (π = 1, Σπ² = 1) has w = 0, so Bₜ = 0/ε = 0: verl then uses the raw return."""
    ones = np.ones((2, 2))
    result = otb.optimal_token_baseline([[0, 1], [0, 0]], ones, [5, 5], np.zeros((2, 2)), ones)
    np.testing.assert_array_equal(result.baselines, np.zeros((2, 2)))
    np.testing.assert_array_equal(result.advantages, [[1, 1], [0, 0]])
    zero_epsilon = otb.optimal_token_baseline([[0, 1], [0, 0]], ones, [5, 5], np.zeros((2, 2)), ones, epsilon=0.0)
    assert np.isfinite(zero_epsilon.advantages).all()
    np.testing.assert_array_equal(zero_epsilon.advantages, [[1, 1], [0, 0]])


def test_worked_example_zero_tail_uses_absolute_positions_with_left_padding():
    """verl's single-turn zero tail zeroes *absolute* positions ≥ the second-longest length, even when the responses
    are left-padded; the multi-turn variant uses compacted positions (docs/verl-differences.md, note on padding)."""
    half = np.full((2, 4), 0.5)
    mask = [[1, 1, 1, 1], [0, 0, 1, 1]]           # member 0: 4 tokens, member 1: 2 tokens (left-padded)
    rewards = [[0, 0, 0, 1], [0, 0, 0, 0]]
    single = otb.optimal_token_baseline(rewards, mask, [1, 1], np.log(half), half, epsilon=0.0)
    # second-longest length is 2 → member 0's baseline is 0 at t ≥ 2, although member 1 is valid exactly there
    np.testing.assert_array_equal(single.baselines[0], [1.0, 1.0, 0.0, 0.0])
    multi = otb.multi_turn_optimal_token_baseline(rewards, mask, [1, 1], np.log(half), half, epsilon=0.0)
    # compacted: member 1's tokens align with member 0's first two; member 0's tokens 2, 3 are the tail
    np.testing.assert_allclose(multi.baselines[0], [0.5, 0.5, 0.0, 0.0])


@pytest.mark.parametrize("function", [otb.optimal_token_baseline, otb.multi_turn_optimal_token_baseline])
def test_all_masked_rows_get_zero_advantages(function):
    half = np.full((3, 3), 0.5)
    mask = [[0, 0, 0], [1, 1, 0], [1, 0, 0]]
    result = function([[5, 5, 5], [0, 1, 0], [1, 0, 0]], mask, [0, 0, 0], np.log(half), half)
    np.testing.assert_array_equal(result.advantages[0], [0.0, 0.0, 0.0])
    np.testing.assert_array_equal(result.baselines[0], [0.0, 0.0, 0.0])
