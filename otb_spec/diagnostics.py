"""Variance diagnostics of a batch policy gradient: signal strength, total power, pure noise — in consistent units.

For N independent per-sample gradients ĝ₁ … ĝ_N with mean g and covariance Σ, the batch gradient ḡ = (1/N)Σᵢĝᵢ has

    signal strength   S = ‖ḡ‖²                     E[S] = ‖g‖² + tr Σ / N
    total power       P = (1/N)·Σᵢ‖ĝᵢ‖²           E[P] = ‖g‖² + tr Σ
    pure noise        V = (P − S)/(N − 1)          E[V] = tr Σ / N = E‖ḡ − g‖²   (unbiased, and V ≥ 0 always)

because P − S = (1/N)·Σᵢ‖ĝᵢ − ḡ‖². V is the variance of the batch gradient; S − V is an unbiased estimate of ‖g‖².
These identities hold only when S and P are measured in the *same* space (proofs/diagnostics_units.md).

What verl logs (``compute_variance_proxy_metrics``), reproduced by :func:`verl_variance_proxy_metrics`, mixes units:
its "signal strength" is the optimizer's gradient norm² in *parameter* space (after loss aggregation and clipping),
while its "total power" is E[Āᵢ²·Wᵢ] with the Logit-Gradient Proxy Wᵢ = Σₜ wₜ in *logit* space and Āᵢ the token-mean
advantage. Their difference is then not a variance: it can be negative (verl clamps it at 0) or dominated by either
term's scale. This module offers the consistent forms instead:

* :func:`gradient_variance_diagnostics` — S, P, V from per-sample gradients (parameter space, exact);
* :func:`variance_diagnostics_from_norms` — the same from ‖ĝᵢ‖² and ‖ḡ‖² you measured in one space;
* :func:`proxy_total_power` — the per-sample power in logit space, Pᵢ = Σₜ mₜ ρₜ² Aₜ² wₜ, which is *exactly*
  ‖∇_z Σₜ ρₜAₜ log π(yₜ)‖² (the logits of different positions are different variables); in logit space the
  trajectories share no coordinates, so there is no proxy-unit signal strength to pair it with.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from otb_spec import _validation as check
from otb_spec.proxy import _energy
from otb_spec.trajectory import importance_weights

__all__ = [
    "VarianceDiagnostics",
    "gradient_variance_diagnostics",
    "variance_diagnostics_from_norms",
    "proxy_total_power",
    "verl_variance_proxy_metrics",
]


class VarianceDiagnostics(NamedTuple):
    """Signal strength S = ‖ḡ‖², total power P = mean‖ĝᵢ‖², pure noise V = (P − S)/(N − 1), all in one unit.

    Attributes:
      signal_strength: S.
      total_power: P.
      pure_noise: V, an unbiased estimate of E‖ḡ − g‖² = tr Cov(ḡ).
      signal_estimate: S − V, an unbiased estimate of ‖g‖² (may be negative when noise dominates).
      n_samples: N.
    """

    signal_strength: float
    total_power: float
    pure_noise: float
    signal_estimate: float
    n_samples: int


def gradient_variance_diagnostics(per_sample_gradients: Any) -> VarianceDiagnostics:
    """S, P, V from per-sample gradient vectors ĝᵢ: [N, D] (N ≥ 2 samples, D parameters).

    V is computed from the deviations ĝᵢ − ḡ (no cancellation), so it is ≥ 0 in floating point too.

    >>> d = gradient_variance_diagnostics([[1.0, 0.0], [3.0, 0.0]])
    >>> d.signal_strength, d.total_power, d.pure_noise
    (4.0, 5.0, 1.0)
    """
    gradients = check.float_array("per_sample_gradients", per_sample_gradients, ndim=2)
    n_samples = gradients.shape[0]
    if n_samples < 2:
        raise ValueError(f"per_sample_gradients: need at least 2 samples to estimate a variance, got {n_samples}")
    mean = gradients.mean(axis=0)
    signal = float(np.dot(mean, mean))
    power = float(np.mean(np.sum(np.square(gradients), axis=1)))
    noise = float(np.sum(np.square(gradients - mean)) / (n_samples * (n_samples - 1)))
    return VarianceDiagnostics(signal, power, noise, signal - noise, n_samples)


def variance_diagnostics_from_norms(per_sample_sq_norms: Any, mean_gradient_sq_norm: Any) -> VarianceDiagnostics:
    """S, P, V from ‖ĝᵢ‖² ([N]) and ‖ḡ‖² (scalar), both measured in the same space for the same N samples.

    ḡ must be the plain mean (1/N)Σᵢĝᵢ of exactly those per-sample gradients — not a token-mean-aggregated or clipped
    optimizer gradient. Since ‖ḡ‖² ≤ mean‖ĝᵢ‖² for any vectors (Jensen), inputs violating it cannot both be right
    and are rejected.
    """
    norms = check.float_array("per_sample_sq_norms", per_sample_sq_norms, ndim=1)
    check.nonnegative("per_sample_sq_norms", norms)
    n_samples = norms.shape[0]
    if n_samples < 2:
        raise ValueError(f"per_sample_sq_norms: need at least 2 samples to estimate a variance, got {n_samples}")
    signal = check.scalar("mean_gradient_sq_norm", mean_gradient_sq_norm, minimum=0.0)
    power = float(norms.mean())
    if signal > power * (1 + 1e-12) + 1e-300:
        raise ValueError(
            f"mean_gradient_sq_norm: ‖ḡ‖² = {signal!r} exceeds the mean of ‖ĝᵢ‖² = {power!r}, impossible for the mean "
            "of those gradients (Jensen); are the two measured in different units or with different normalisations?"
        )
    noise = max(power - signal, 0.0) / (n_samples - 1)
    return VarianceDiagnostics(signal, power, noise, signal - noise, n_samples)


def proxy_total_power(advantages: Any, response_mask: Any, log_probs: Any, sum_pi_squared: Any, *,
                      is_weights: Any = None) -> np.ndarray:
    """Per-trajectory power in logit space  Pᵢ = Σₜ mₜ·ρₜ²·Aₜ²·wₜ,  wₜ = 1 − 2πₜ + Σπ²ₜ.

    Exactly ‖∇_z Σₜ mₜρₜAₜ log π(yₜ)‖² where z are the logits of all positions of trajectory i. Returns [B] float64.
    Unlike verl's Āᵢ²·Wᵢ it keeps token-varying advantages apart (the two agree when Aₜ is constant along the row).
    """
    shape = check.batch_shape("advantages", advantages)
    advantages64 = check.float_array("advantages", advantages, shape=shape)
    mask = check.mask_array("response_mask", response_mask, shape, like="advantages")
    log_probs64, spp64 = check.token_statistics(log_probs, sum_pi_squared, mask, shape, like="advantages")
    energy = _energy(log_probs64, spp64) * mask * np.square(advantages64)
    if is_weights is not None:
        energy = energy * np.square(importance_weights(is_weights, shape, like="advantages"))
    return energy.sum(axis=-1)


def verl_variance_proxy_metrics(advantages: Any, response_mask: Any, log_probs: Any, sum_pi_squared: Any, *,
                                is_weights: Any = None, gradient_norm: float | None = None) -> dict[str, float]:
    """verl's ``compute_variance_proxy_metrics``, reproduced formula for formula (mixed units — see module docstring).

    Over trajectories with at least one valid token: Āᵢ = Σₜ Aₜmₜ/(Σₜ mₜ + 10⁻⁸), Wᵢ = Σₜ mₜ ρₜ² wₜ;

    * proxy1_signal_strength = gradient_norm² (0.0 when not given);
    * proxy2_total_power = mean(Āᵢ²·max(Wᵢ, 0)) without IS weights, and with them
      mean(ρ̄ᵢ²·Āᵢ²·max(W'ᵢ, 0)) with ρ̄ᵢ the token-mean IS weight and W'ᵢ = Σₜ mₜ ρₜ² wₜ / max(ρₜ², 10⁻¹⁰);
    * proxy3_pure_noise = max(0, (proxy2 − proxy1)/(N − 1)) when gradient_norm is given and N > 1, else 0.0;
    * expected_a_squared = mean(Āᵢ²); expected_w = mean(Wᵢ).

    When no trajectory has a valid token, every metric is 0.0 except proxy1. Returns a dict with verl's keys.
    """
    shape = check.batch_shape("advantages", advantages)
    advantages64 = check.float_array("advantages", advantages, shape=shape)
    mask = check.mask_array("response_mask", response_mask, shape, like="advantages")
    log_probs64, spp64 = check.token_statistics(log_probs, sum_pi_squared, mask, shape, like="advantages")
    weights = None if is_weights is None else importance_weights(is_weights, shape, like="advantages")
    signal = None
    if gradient_norm is not None:
        signal = check.scalar("gradient_norm", gradient_norm, minimum=0.0) ** 2
    keys = ("proxy1_signal_strength", "proxy2_total_power", "proxy3_pure_noise", "expected_a_squared", "expected_w")
    valid_rows = mask.sum(axis=-1) > 0
    if not valid_rows.any():
        values = dict.fromkeys(keys, 0.0)
        values["proxy1_signal_strength"] = 0.0 if signal is None else signal
        return {f"variance_proxy/{key}": value for key, value in values.items()}
    per_token = 1.0 - 2.0 * np.exp(log_probs64) + spp64           # verl's literal formula
    if weights is not None:
        per_token = per_token * np.square(weights)
    mean_advantage = ((advantages64 * mask).sum(axis=-1) / (mask.sum(axis=-1) + 1e-8))[valid_rows]
    energy = (per_token * mask).sum(axis=-1)[valid_rows]
    if weights is None:
        power = float(np.mean(np.square(mean_advantage) * np.maximum(energy, 0.0)))
    else:
        mean_weight = ((weights * mask).sum(axis=-1) / (mask.sum(axis=-1) + 1e-8))[valid_rows]
        unweighted = (per_token / np.maximum(np.square(weights), 1e-10) * mask).sum(axis=-1)[valid_rows]
        power = float(np.mean(np.square(mean_weight) * np.square(mean_advantage) * np.maximum(unweighted, 0.0)))
    noise = 0.0
    n_rows = int(valid_rows.sum())
    if signal is not None and n_rows > 1:
        noise = max(0.0, (power - signal) / (n_rows - 1))
    return {
        "variance_proxy/proxy1_signal_strength": 0.0 if signal is None else signal,
        "variance_proxy/proxy2_total_power": power,
        "variance_proxy/proxy3_pure_noise": noise,
        "variance_proxy/expected_a_squared": float(np.mean(np.square(mean_advantage))),
        "variance_proxy/expected_w": float(np.mean(energy)),
    }
