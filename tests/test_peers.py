"""Peer baselines: agreement with naive per-group loops, and the identities that tie them together."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import otb_spec as otb
from otb_spec import strategies as otb_st
from otb_spec.tolerances import summation_tolerance

from naive_otb import sequence_baseline

batches = otb_st.rollout_batches()


def _sequence_returns(batch):
    return np.sum(np.asarray(batch.rewards, dtype=np.float64) * np.asarray(batch.response_mask), axis=1)


def _expected(batch, baseline, scale=None):
    R = _sequence_returns(batch)
    scale = np.ones_like(R) if scale is None else scale
    return ((R - baseline) / scale)[:, None] * np.asarray(batch.response_mask)


def _tolerance(batch, weights=None):
    R = np.abs(_sequence_returns(batch))
    weights = np.ones_like(R) if weights is None else np.asarray(weights)
    return summation_tolerance(4 * batch.batch_size + batch.n_positions, float((R * (1 + weights)).sum() + 1.0)
                               * float(1 + weights.max() / max(weights[weights > 0].min(), 1e-300)
                                       if (weights > 0).any() else 1.0))


@given(batch=batches)
def test_group_mean_matches_naive_loop(batch):
    R = _sequence_returns(batch)
    expected = _expected(batch, sequence_baseline(R, np.ones_like(R), batch.group_ids, leave_one_out=False))
    result = otb.group_mean_advantage(batch.rewards, batch.response_mask, batch.group_ids)
    _tolerance(batch).assert_close(result.advantages, expected, "group mean")


@given(batch=batches)
def test_grpo_std_normalisation_matches_naive_loop(batch):
    """(R − μ)/(σ + 1e-6), σ with Bessel's correction; singleton groups: μ = 0, σ = 1 (verl)."""
    R = _sequence_returns(batch)
    ids = np.asarray(batch.group_ids, dtype=object).tolist()
    mean, std = np.zeros_like(R), np.ones_like(R)
    for i in range(len(R)):
        members = [R[j] for j in range(len(R)) if ids[j] == ids[i]]
        if len(members) > 1:
            mean[i], std[i] = np.mean(members), np.std(members, ddof=1)
    expected = _expected(batch, mean, std + 1e-6)
    result = otb.group_mean_advantage(batch.rewards, batch.response_mask, batch.group_ids, normalize_by_std=True)
    tolerance = summation_tolerance(4 * batch.batch_size, float(np.abs(R).sum() + 1.0) / 1e-6)
    tolerance.assert_close(result.advantages, expected, "GRPO")


@given(batch=batches)
def test_rloo_is_the_leave_one_out_group_mean(batch):
    R = _sequence_returns(batch)
    expected = _expected(batch, sequence_baseline(R, np.ones_like(R), batch.group_ids, leave_one_out=True))
    result = otb.rloo_advantage(batch.rewards, batch.response_mask, batch.group_ids)
    _tolerance(batch).assert_close(result.advantages, expected, "RLOO")


@given(batch=batches, leave_one_out=st.booleans())
def test_opo_matches_naive_loop(batch, leave_one_out):
    R = _sequence_returns(batch)
    lengths = np.asarray(batch.response_mask).sum(axis=1)
    expected = _expected(batch, sequence_baseline(R, lengths, batch.group_ids, leave_one_out))
    result = otb.opo_advantage(batch.rewards, batch.response_mask, batch.group_ids, leave_one_out=leave_one_out)
    _tolerance(batch, lengths).assert_close(result.advantages, expected, "OPO")


@given(batch=batches, leave_one_out=st.booleans(), data=st.data())
def test_sequence_optimal_matches_naive_loop(batch, leave_one_out, data):
    norms = np.array(data.draw(st.lists(st.floats(0.0, 50.0), min_size=batch.batch_size,
                                        max_size=batch.batch_size), label="‖S(τ)‖²"))
    R = _sequence_returns(batch)
    expected = _expected(batch, sequence_baseline(R, norms, batch.group_ids, leave_one_out))
    result = otb.sequence_optimal_advantage(batch.rewards, batch.response_mask, batch.group_ids, norms,
                                            leave_one_out=leave_one_out)
    _tolerance(batch, norms).assert_close(result.advantages, expected, "sequence optimal")


@given(batch=otb_st.rollout_batches(padding="right", holes=False, empty_rows=False), data=st.data())
def test_weighted_baselines_with_equal_weights_are_the_group_mean(batch, data):
    """OPO with equal lengths and the sequence-optimal baseline with equal norms both reduce to the group mean."""
    mask = np.ones(np.shape(batch.response_mask))
    batch = otb.RolloutBatch(rewards=batch.rewards, response_mask=mask, group_ids=batch.group_ids)
    constant = data.draw(st.floats(0.5, 10.0), label="norm")
    mean = otb.group_mean_advantage(batch.rewards, mask, batch.group_ids).advantages
    opo = otb.opo_advantage(batch.rewards, mask, batch.group_ids).advantages
    optimal = otb.sequence_optimal_advantage(batch.rewards, mask, batch.group_ids,
                                             np.full(batch.batch_size, constant)).advantages
    tolerance = _tolerance(batch)
    tolerance.assert_close(opo, mean, "OPO vs group mean")
    tolerance.assert_close(optimal, mean, "sequence optimal vs group mean")
    loo_mean = otb.rloo_advantage(batch.rewards, mask, batch.group_ids).advantages
    loo_optimal = otb.sequence_optimal_advantage(batch.rewards, mask, batch.group_ids,
                                                 np.full(batch.batch_size, constant), leave_one_out=True).advantages
    tolerance.assert_close(loo_optimal, loo_mean, "leave-one-out optimal vs RLOO")


@pytest.mark.bitexact
@given(batch=batches)
def test_reinforce_is_the_return_to_go(batch):
    result = otb.reinforce_advantage(batch.rewards, batch.response_mask)
    np.testing.assert_array_equal(result.advantages,
                                  otb.returns_to_go(batch.rewards, batch.response_mask) * batch.response_mask)
    assert np.all(result.baselines == 0.0)


@given(batch=batches)
def test_sequence_level_advantages_are_constant_along_each_row(batch):
    mask = np.asarray(batch.response_mask) > 0
    for result in (otb.group_mean_advantage(batch.rewards, batch.response_mask, batch.group_ids),
                   otb.rloo_advantage(batch.rewards, batch.response_mask, batch.group_ids),
                   otb.opo_advantage(batch.rewards, batch.response_mask, batch.group_ids)):
        for i in range(batch.batch_size):
            values = result.advantages[i][mask[i]]
            assert values.size == 0 or np.all(values == values[0])
        assert np.all(result.advantages[~mask] == 0.0)


@pytest.mark.bitexact
def test_singletons_and_zero_weights_give_baseline_zero():
    rewards = np.array([[1.0, 2.0], [3.0, 0.0], [5.0, 0.0]])
    mask = np.array([[1, 1], [0, 0], [0, 0]])
    # group "a" = rows 0, 1 (row 1 empty); group "b" = row 2 alone (empty)
    opo = otb.opo_advantage(rewards, mask, ["a", "a", "b"])
    np.testing.assert_array_equal(opo.advantages[0], [3.0 - 3.0, 3.0 - 3.0])   # b = (2·3 + 0·0)/2 = 3
    zero_norms = otb.sequence_optimal_advantage(rewards, np.ones((3, 2)), ["a", "a", "b"], [0.0, 0.0, 1.0])
    np.testing.assert_array_equal(zero_norms.baselines, np.zeros((3, 2)))
    rloo = otb.rloo_advantage([[4.0]], [[1]], ["solo"])
    np.testing.assert_array_equal(rloo.advantages, [[4.0]])
