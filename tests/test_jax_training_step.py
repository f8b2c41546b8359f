"""examples/jax_otb_training_step.py: OTB advantages computed inside a jitted JAX training step equal the NumPy
reference on the step's own inputs, the token statistics equal the reference's from the same logits, the loss is
finite, the parameters move, and the step compiles once for batches of the same shape."""

from __future__ import annotations

import importlib.util
import os

import numpy as np
import pytest

jax = pytest.importorskip("jax")
otb_jax = pytest.importorskip("otb_jax")

import otb_spec as otb  # noqa: E402
from otb_spec.tolerances import (  # noqa: E402
    logit_spread,
    logsumexp_tolerance,
    otb_comparison_tolerance,
    proxy_tolerance,
)

EXAMPLE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples",
                       "jax_otb_training_step.py")


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("jax_otb_training_step", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def check_step_advantages(batch, output, *, leave_one_out: bool) -> None:
    """The step's advantages vs the reference on the step's own float32 log π and Σπ² (otb_comparison_tolerance),
    and those statistics vs the reference's from the step's logits (Σπ²: exp-sum bound; log π through the proxy)."""
    rewards, mask = np.asarray(batch.rewards), np.asarray(batch.response_mask)
    log_probs, sum_pi_squared = np.asarray(output.log_probs), np.asarray(output.sum_pi_squared)
    logits = np.asarray(output.logits, dtype=np.float64)
    inputs = dict(rewards=rewards, response_mask=mask, group_ids=batch.group_ids, log_probs=log_probs,
                  sum_pi_squared=sum_pi_squared)
    if leave_one_out:
        expected = otb.leave_one_out_token_baseline(**inputs)
        tolerance = otb_comparison_tolerance(**inputs, leave_one_out=True, handle_zero_tail=False,
                                             compute_dtype=np.float32)
    else:
        expected = otb.optimal_token_baseline(**inputs)
        tolerance = otb_comparison_tolerance(**inputs, compute_dtype=np.float32)
    tolerance[0].assert_close(np.asarray(output.advantages), expected.advantages, "advantages inside the jitted step")

    reference = otb.token_statistics_from_logits(logits, np.asarray(batch.tokens))
    vocab = logits.shape[-1]
    (logsumexp_tolerance(vocab, logit_spread(logits), np.float32)
     + logsumexp_tolerance(vocab, logit_spread(logits), np.float64)).assert_close(
        sum_pi_squared, reference.sum_pi_squared, "Σπ² inside the step")
    proxy = proxy_tolerance(vocab, float(np.abs(logits).max()), np.float32)
    proxy.assert_close(np.exp(log_probs), np.exp(reference.log_probs), "π(y) inside the step")


@pytest.mark.parametrize("leave_one_out", [False, True], ids=["otb", "leave-one-out"])
def test_advantages_inside_the_jitted_step_equal_the_reference(example, leave_one_out):
    history = example.train(3, seed=1, leave_one_out=leave_one_out)
    first_params = example.init_params(jax.random.split(jax.random.PRNGKey(1))[1])
    for batch, output in history:
        check_step_advantages(batch, output, leave_one_out=leave_one_out)
        assert np.isfinite(float(output.loss))
        lengths = np.asarray(batch.response_mask).sum(axis=1)
        assert lengths.min() < lengths.max(), "the batch should hold responses of different lengths"
        assert len(set(batch.group_ids[:6])) > 1, "groups should not be contiguous"
    # the update: from the parameters the first batch was sampled with, learning rate 0 leaves them as they are and
    # learning rate 1 moves them
    batch, _ = history[0]
    unchanged, _ = example.train_step(first_params, batch.prompts, batch.tokens, batch.response_mask, batch.rewards,
                                      batch.segment_ids, 0.0, num_segments=int(batch.prompts.shape[0]),
                                      leave_one_out=leave_one_out)
    moved, _ = example.train_step(first_params, batch.prompts, batch.tokens, batch.response_mask, batch.rewards,
                                  batch.segment_ids, 1.0, num_segments=int(batch.prompts.shape[0]),
                                  leave_one_out=leave_one_out)
    assert np.array_equal(np.asarray(unchanged["w"]), np.asarray(first_params["w"]))
    assert not np.allclose(np.asarray(moved["w"]), np.asarray(first_params["w"]))


def test_the_step_compiles_once_for_batches_of_the_same_shape(example):
    example.train(1, seed=2)
    compiled = example.train_step._cache_size()
    example.train(3, seed=3)
    assert example.train_step._cache_size() == compiled


def test_check_rejects_advantages_computed_outside_the_groups(example):
    """Meta-test: the check above fails for a step whose advantages ignore the groups (one batch-wide group)."""
    batch, output = example.train(1, seed=4)[0]
    wrong = batch._replace(segment_ids=np.zeros_like(np.asarray(batch.segment_ids)))
    _, wrong_output = example.train_step(example.init_params(jax.random.split(jax.random.PRNGKey(4))[1]),
                                         wrong.prompts, wrong.tokens, wrong.response_mask, wrong.rewards,
                                         wrong.segment_ids, 1.0, num_segments=int(batch.prompts.shape[0]))
    with pytest.raises(AssertionError, match="advantages inside the jitted step"):
        check_step_advantages(batch, wrong_output, leave_one_out=False)
