"""One interface for every estimator: registry, requirements, options, and the promised relations between them."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given

import otb_spec as otb
from otb_spec import strategies as otb_st
from otb_spec.examples import example_batch


def test_registry_lists_every_estimator_once():
    assert set(otb.ESTIMATORS) == {
        "reinforce", "group_mean", "grpo", "rloo", "opo", "sequence_optimal", "sequence_optimal_loo", "otb",
        "otb_multi_turn", "otb_loo", "otb_exact", "otb_exact_loo"}
    for name, estimator in otb.ESTIMATORS.items():
        assert estimator.name == name
        assert estimator.level in ("token", "sequence")
    with pytest.raises(TypeError):
        otb.ESTIMATORS["mine"] = otb.ESTIMATORS["otb"]      # read-only


def test_unbiased_flag_marks_exactly_the_baselines_built_without_the_sample():
    unbiased = {name for name, estimator in otb.ESTIMATORS.items() if estimator.unbiased}
    assert unbiased == {"reinforce", "rloo", "sequence_optimal_loo", "otb_loo", "otb_exact_loo"}


@given(batch=otb_st.rollout_batches())
def test_every_estimator_runs_on_a_batch_with_its_fields(batch):
    norms = np.abs(np.asarray(batch.rewards, dtype=np.float64)) + 1.0
    full = otb.RolloutBatch(rewards=batch.rewards, response_mask=batch.response_mask, group_ids=batch.group_ids,
                            log_probs=batch.log_probs, sum_pi_squared=batch.sum_pi_squared,
                            is_weights=batch.is_weights, cumulative_score_sq_norms=np.cumsum(norms, axis=1),
                            sequence_score_sq_norms=norms.sum(axis=1))
    mask = np.asarray(batch.response_mask)
    for name, estimator in otb.ESTIMATORS.items():
        assert estimator.accepts(full)
        result = estimator(full)
        assert result.advantages.shape == mask.shape, name
        assert np.all(result.advantages[mask == 0] == 0.0), name
        assert np.isfinite(result.advantages).all(), name


@pytest.mark.bitexact
@given(batch=otb_st.rollout_batches(is_weights=False))
def test_exact_norm_otb_with_the_proxy_energy_is_otb(batch):
    """Feeding the proxy's realized energy as the 'exact' cumulative norms reproduces OTB and its leave-one-out."""
    mask = np.asarray(batch.response_mask)
    energy = otb.realized_energy(otb.token_energy(np.where(mask > 0, batch.log_probs, 0.0),
                                                  np.where(mask > 0, batch.sum_pi_squared, 1.0)), mask)
    exact = otb.RolloutBatch(rewards=batch.rewards, response_mask=mask, group_ids=batch.group_ids,
                             cumulative_score_sq_norms=energy)
    np.testing.assert_array_equal(otb.estimate("otb_exact", exact).advantages, otb.estimate("otb", batch).advantages)
    np.testing.assert_array_equal(otb.estimate("otb_exact_loo", exact).advantages,
                                  otb.estimate("otb_loo", batch).advantages)


def test_missing_fields_are_named():
    batch = otb.RolloutBatch(rewards=np.zeros((2, 2)), response_mask=np.ones((2, 2)), group_ids=[0, 0])
    assert not otb.ESTIMATORS["otb"].accepts(batch)
    with pytest.raises(ValueError, match="estimator 'otb' needs field\\(s\\) log_probs, sum_pi_squared"):
        otb.ESTIMATORS["otb"](batch)
    with pytest.raises(ValueError, match="unknown estimator 'ppo'"):
        otb.estimate("ppo", batch)
    with pytest.raises(TypeError, match="expected a RolloutBatch"):
        otb.ESTIMATORS["rloo"]({"rewards": 1})


def test_options_pass_through():
    batch = example_batch()
    default = otb.estimate("otb", batch)
    no_tail = otb.estimate("otb", batch, handle_zero_tail=False)
    assert not np.array_equal(default.advantages, no_tail.advantages)
    assert otb.ESTIMATORS["grpo"](batch).advantages.shape == (6, 8)
    with pytest.raises(TypeError):
        otb.estimate("rloo", batch, handle_zero_tail=False)
