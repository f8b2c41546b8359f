"""Peer baselines and proxy power in JAX — ports of ``otb_spec.peers`` and ``otb_spec.diagnostics``."""

from __future__ import annotations

from functools import partial
from typing import Any

import jax
import jax.numpy as jnp

from otb_jax import _checks as check
from otb_jax._core import reward_to_go, token_energy
from otb_jax._otb import AdvantageResult

__all__ = ["reinforce_advantage", "group_mean_advantage", "rloo_advantage", "opo_advantage",
           "sequence_optimal_advantage", "proxy_total_power"]


def _weighted_baseline(values, weights, ids, num_segments, leave_one_out):
    numerator = jax.ops.segment_sum(weights * values, ids, num_segments)[ids]
    denominator = jax.ops.segment_sum(weights, ids, num_segments)[ids]
    members = jax.ops.segment_sum(jnp.ones_like(ids), ids, num_segments)[ids]
    if leave_one_out:
        numerator = numerator - weights * values
        denominator = jnp.maximum(denominator - weights, 0)
        members = members - 1
    usable = (denominator > 0) & (members >= (1 if leave_one_out else 2))
    return jnp.where(usable, numerator / jnp.where(usable, denominator, 1), 0)


@partial(jax.jit, static_argnames=("num_segments", "kind", "leave_one_out", "normalize", "compute_dtype",
                                   "output_dtype"))
def _sequence(rewards, mask, ids, norms, epsilon, *, num_segments, kind, leave_one_out, normalize, compute_dtype,
              output_dtype):
    dtype = jnp.dtype(compute_dtype)
    mask = (mask != 0).astype(dtype)
    R = jnp.sum(rewards.astype(dtype) * mask, axis=-1)
    if kind == "mean":
        weights = jnp.ones_like(R)
    elif kind == "length":
        weights = jnp.sum(mask, axis=-1)
    else:
        weights = norms.astype(dtype)
    baseline = _weighted_baseline(R, weights, ids, num_segments, leave_one_out)
    scale = jnp.ones_like(R)
    if normalize:
        sizes = jax.ops.segment_sum(jnp.ones_like(R), ids, num_segments)[ids]
        mean = jax.ops.segment_sum(R, ids, num_segments)[ids] / sizes
        squares = jax.ops.segment_sum(jnp.square(R - mean), ids, num_segments)[ids]
        scale = jnp.where(sizes > 1, jnp.sqrt(squares / jnp.maximum(sizes - 1, 1)), 1) + epsilon
    out = jnp.dtype(output_dtype)
    returns = jnp.broadcast_to(R[:, None], mask.shape)
    return (((R - baseline) / scale)[:, None] * mask).astype(out), returns.astype(out), \
        (baseline[:, None] * mask).astype(out)


def _sequence_call(rewards, response_mask, segment_ids, num_segments, *, kind, leave_one_out=False, normalize=False,
                   norms=None, epsilon=1e-6, check_values=True) -> AdvantageResult:
    rewards_a = check.batch("rewards", rewards)
    mask_a = check.array("response_mask", response_mask, like=rewards_a, like_name="rewards")
    ids = check.segments("segment_ids", segment_ids, num_segments, rewards_a.shape[0],
                         check.flag("check_values", check_values))
    norms_a = None
    if norms is not None:
        norms_a = check.array("sequence_score_sq_norms", norms)
        if tuple(norms_a.shape) != (rewards_a.shape[0],):
            raise ValueError(f"sequence_score_sq_norms: expected shape ({rewards_a.shape[0]},) (the shape of [B]), got "
                             f"{tuple(norms_a.shape)}")
    check.check_values(check_values, rewards=("rewards", rewards_a), mask=("response_mask", mask_a),
                       is_weights=None if norms_a is None else ("sequence_score_sq_norms", norms_a))
    return AdvantageResult(*_sequence(rewards_a, mask_a, ids, norms_a, check.epsilon(epsilon),
                                      num_segments=int(num_segments), kind=kind,
                                      leave_one_out=check.flag("leave_one_out", leave_one_out),
                                      normalize=check.flag("normalize_by_std", normalize),
                                      compute_dtype=check.compute_dtype(rewards_a),
                                      output_dtype=check.output_dtype(rewards_a)))


def reinforce_advantage(rewards: Any, response_mask: Any, *, check_values: bool = True) -> AdvantageResult:
    """Aₜ = Gₜ·mₜ (no baseline)."""
    rewards_a = check.batch("rewards", rewards)
    mask_a = check.array("response_mask", response_mask, like=rewards_a, like_name="rewards")
    check.check_values(check_values, rewards=("rewards", rewards_a), mask=("response_mask", mask_a))
    dtype = jnp.dtype(check.compute_dtype(rewards_a))
    mask = (mask_a != 0).astype(dtype)
    G = reward_to_go(rewards_a.astype(dtype), mask)
    out = check.output_dtype(rewards_a)
    return AdvantageResult((G * mask).astype(out), G.astype(out), jnp.zeros_like(G).astype(out))


def group_mean_advantage(rewards: Any, response_mask: Any, segment_ids: Any, num_segments: int, *,
                         normalize_by_std: bool = False, epsilon: float = 1e-6,
                         check_values: bool = True) -> AdvantageResult:
    """GRPO / Dr. GRPO; the port of :func:`otb_spec.group_mean_advantage`."""
    return _sequence_call(rewards, response_mask, segment_ids, num_segments, kind="mean",
                          normalize=normalize_by_std, epsilon=epsilon, check_values=check_values)


def rloo_advantage(rewards: Any, response_mask: Any, segment_ids: Any, num_segments: int, *,
                   check_values: bool = True) -> AdvantageResult:
    """RLOO; the port of :func:`otb_spec.rloo_advantage`."""
    return _sequence_call(rewards, response_mask, segment_ids, num_segments, kind="mean", leave_one_out=True,
                          check_values=check_values)


def opo_advantage(rewards: Any, response_mask: Any, segment_ids: Any, num_segments: int, *,
                  leave_one_out: bool = False, check_values: bool = True) -> AdvantageResult:
    """OPO (length-weighted); the port of :func:`otb_spec.opo_advantage`."""
    return _sequence_call(rewards, response_mask, segment_ids, num_segments, kind="length",
                          leave_one_out=leave_one_out, check_values=check_values)


def sequence_optimal_advantage(rewards: Any, response_mask: Any, segment_ids: Any, num_segments: int,
                               sequence_score_sq_norms: Any, *, leave_one_out: bool = False,
                               check_values: bool = True) -> AdvantageResult:
    """Sequence-level optimal baseline; the port of :func:`otb_spec.sequence_optimal_advantage`."""
    return _sequence_call(rewards, response_mask, segment_ids, num_segments, kind="norms",
                          leave_one_out=leave_one_out, norms=sequence_score_sq_norms, check_values=check_values)


def proxy_total_power(advantages: Any, response_mask: Any, log_probs: Any, sum_pi_squared: Any, *,
                      is_weights: Any = None, check_values: bool = True) -> jax.Array:
    """Pᵢ = Σₜ mₜρₜ²Aₜ²wₜ [B]; the port of :func:`otb_spec.proxy_total_power`."""
    advantages_a, mask_a, lp_a, spp_a, weights_a = check.token_batch(
        advantages, response_mask, log_probs, sum_pi_squared, is_weights, ("advantages",) + check.TOKEN_NAMES[1:])
    check.check_values(check_values, rewards=("advantages", advantages_a), mask=("response_mask", mask_a),
                       log_probs=("log_probs", lp_a), sum_pi_squared=("sum_pi_squared", spp_a),
                       is_weights=None if weights_a is None else ("is_weights", weights_a))
    dtype = jnp.dtype(check.compute_dtype(advantages_a, lp_a, spp_a, weights_a))
    energy = token_energy(lp_a.astype(dtype), spp_a.astype(dtype)) * jnp.square(advantages_a.astype(dtype))
    if weights_a is not None:
        energy = energy * jnp.square(weights_a.astype(dtype))
    return jnp.sum(energy * (mask_a != 0), axis=-1).astype(check.output_dtype(advantages_a))
