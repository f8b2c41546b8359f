"""Variance diagnostics: exact identities in consistent units, verl's formulas reproduced, and an unbiasedness check
of the pure-noise estimator by Monte Carlo (fixed seed, 5 standard errors)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import otb_spec as otb
from otb_spec import strategies as otb_st
from otb_spec.tolerances import summation_tolerance

gradients = hnp.arrays(np.float64, st.tuples(st.integers(2, 12), st.integers(1, 6)),
                       elements=st.floats(-100, 100, allow_subnormal=False))


@given(per_sample=gradients)
def test_noise_is_the_mean_squared_deviation_over_n_minus_one(per_sample):
    """P − S = (1/N)Σ‖ĝᵢ − ḡ‖² ≥ 0, so V = (P − S)/(N − 1) ≥ 0, and S − V + V = S."""
    diagnostics = otb.gradient_variance_diagnostics(per_sample)
    n = per_sample.shape[0]
    deviation = np.sum(np.square(per_sample - per_sample.mean(axis=0))) / n
    magnitude = float(np.sum(np.square(per_sample)) + 1.0)
    summation_tolerance(per_sample.size, magnitude).assert_close(diagnostics.total_power - diagnostics.signal_strength,
                                                                 deviation, "P − S")
    assert diagnostics.pure_noise >= 0.0
    assert diagnostics.signal_estimate == diagnostics.signal_strength - diagnostics.pure_noise
    from_norms = otb.variance_diagnostics_from_norms(np.sum(np.square(per_sample), axis=1),
                                                     diagnostics.signal_strength)
    summation_tolerance(per_sample.size, magnitude).assert_close(from_norms.pure_noise, diagnostics.pure_noise,
                                                                 "V from norms")


def test_pure_noise_is_unbiased_for_the_variance_of_the_mean():
    """E[V] = tr Cov(ḡ) = tr Σ / N for iid ĝᵢ ~ N(g, Σ): 20 000 batches, |mean − exact| < 5 SE."""
    rng = np.random.default_rng(20260201)
    n, dim, repeats = 4, 3, 20_000
    scales = np.array([1.0, 2.0, 0.5])
    samples = rng.normal(loc=[1.0, -2.0, 0.5], scale=scales, size=(repeats, n, dim))
    noise = np.array([otb.gradient_variance_diagnostics(batch).pure_noise for batch in samples])
    exact = float(np.sum(scales**2)) / n
    standard_error = noise.std(ddof=1) / np.sqrt(repeats)
    assert abs(noise.mean() - exact) < 5 * standard_error
    signal = np.array([otb.gradient_variance_diagnostics(batch).signal_estimate for batch in samples])
    assert abs(signal.mean() - (1.0 + 4.0 + 0.25)) < 5 * signal.std(ddof=1) / np.sqrt(repeats)


def test_norms_that_violate_jensen_are_rejected():
    with pytest.raises(ValueError, match="mean_gradient_sq_norm: .* exceeds the mean"):
        otb.variance_diagnostics_from_norms([1.0, 1.0], 2.0)
    with pytest.raises(ValueError, match="need at least 2 samples"):
        otb.gradient_variance_diagnostics([[1.0, 2.0]])


@given(batch=otb_st.rollout_batches(vocab_size=5, max_groups=2, max_length=6), data=st.data())
def test_proxy_power_is_the_squared_norm_of_the_logit_space_gradient(batch, data):
    """Pᵢ = Σₜ mₜρₜ²Aₜ²wₜ = ‖(ρₜAₜ(e_{yₜ} − πₜ))ₜ‖² exactly: the logits of different positions are different
    variables, so the squared norm of the stacked per-position gradients is the sum of their squared norms."""
    mask = np.asarray(batch.response_mask)
    advantages = np.asarray(data.draw(hnp.arrays(np.float64, mask.shape, elements=st.floats(-5, 5)),
                                      label="advantages")) * mask
    gradient = otb.logit_gradient(batch.logits, batch.token_ids)            # [B, T, V]
    weights = np.ones(mask.shape) if batch.is_weights is None else np.asarray(batch.is_weights, dtype=np.float64)
    stacked = (weights * advantages * mask)[..., None] * gradient
    expected = np.sum(np.square(stacked), axis=(1, 2))
    power = otb.proxy_total_power(advantages, mask, batch.log_probs, batch.sum_pi_squared,
                                  is_weights=batch.is_weights)
    magnitude = float(np.sum(np.square(weights * advantages)) * 2.0 + 1.0)
    summation_tolerance(mask.shape[1] * 6, magnitude).assert_close(power, expected, "proxy power")


def test_verl_metrics_worked_example():
    """Two trajectories: Ā = (1, −0.5), W = (0.5 + 0.5, 0.5); power = (1·1 + 0.25·0.5)/2 = 0.5625."""
    half = np.full((2, 2), 0.5)
    metrics = otb.verl_variance_proxy_metrics([[1.0, 1.0], [-0.5, 0.0]], [[1, 1], [1, 0]], np.log(half), half,
                                              gradient_norm=0.5)
    assert metrics["variance_proxy/proxy2_total_power"] == pytest.approx(0.5625, rel=1e-7)
    assert metrics["variance_proxy/proxy1_signal_strength"] == 0.25
    assert metrics["variance_proxy/proxy3_pure_noise"] == pytest.approx(0.3125, rel=1e-7)
    assert metrics["variance_proxy/expected_a_squared"] == pytest.approx((1 + 0.25) / 2, rel=1e-7)
    assert metrics["variance_proxy/expected_w"] == pytest.approx(0.75)
    without = otb.verl_variance_proxy_metrics([[1.0, 1.0], [-0.5, 0.0]], [[1, 1], [1, 0]], np.log(half), half)
    assert without["variance_proxy/proxy1_signal_strength"] == 0.0
    assert without["variance_proxy/proxy3_pure_noise"] == 0.0


def test_verl_metrics_mixed_units_can_make_the_noise_clamp():
    """The unit mismatch documented in otb_spec.diagnostics: a parameter-space ‖ḡ‖² larger than the logit-space
    power gives a negative 'noise' that verl silently clamps to 0, while the consistent estimator stays defined."""
    half = np.full((2, 2), 0.5)
    metrics = otb.verl_variance_proxy_metrics([[1.0, 1.0], [-1.0, -1.0]], np.ones((2, 2)), np.log(half), half,
                                              gradient_norm=10.0)
    assert metrics["variance_proxy/proxy2_total_power"] < metrics["variance_proxy/proxy1_signal_strength"]
    assert metrics["variance_proxy/proxy3_pure_noise"] == 0.0


def test_verl_metrics_with_importance_weights():
    """Off-policy power uses the token-mean ρ̄ squared times Ā² times the unweighted W (verl's formula)."""
    half = np.full((1, 2), 0.5)
    rho = np.array([[2.0, 4.0]])
    metrics = otb.verl_variance_proxy_metrics([[1.0, 1.0]], [[1, 1]], np.log(half), half, is_weights=rho)
    mean_rho = 6.0 / (2 + 1e-8)
    mean_a = 2.0 / (2 + 1e-8)
    assert metrics["variance_proxy/proxy2_total_power"] == pytest.approx(mean_rho**2 * mean_a**2 * 1.0, rel=1e-12)
    assert metrics["variance_proxy/expected_w"] == pytest.approx(0.5 * 4 + 0.5 * 16)


def test_verl_metrics_without_valid_tokens_are_zero():
    metrics = otb.verl_variance_proxy_metrics([[1.0]], [[0]], [[0.0]], [[0.0]], gradient_norm=2.0)
    assert metrics["variance_proxy/proxy1_signal_strength"] == 4.0
    assert all(value == 0.0 for key, value in metrics.items() if "proxy1" not in key)
