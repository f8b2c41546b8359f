"""OTB in JAX: the reference's API over jax.Array with integer segment ids and a static number of segments."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from otb_jax import _checks as check
from otb_jax._core import energy_pipeline_jit, otb_pipeline_jit, realized_energy, reward_to_go, token_energy
from otb_spec import _validation as reference_checks
from otb_spec.groups import group_segments

__all__ = [
    "AdvantageResult",
    "segment_ids",
    "optimal_token_baseline",
    "multi_turn_optimal_token_baseline",
    "leave_one_out_token_baseline",
    "exact_norm_token_baseline",
    "token_baseline",
    "returns_to_go",
    "realized_energy_of",
]


class AdvantageResult(NamedTuple):
    """(advantages, returns, baselines), each [B, T] in the rewards' dtype."""

    advantages: jax.Array
    returns: jax.Array
    baselines: jax.Array


def segment_ids(group_ids: Any) -> tuple[np.ndarray, int]:
    """Host-side: arbitrary group ids [B] (ints, strings, uuids, objects) → (int32 segment ids [B], number of groups).

    The partition is verl's (ids that compare equal share a group); groups are numbered in order of first appearance.
    Call once per batch, outside ``jit``; pass the count as the static ``num_segments``.

    >>> segment_ids(["q7", "q3", "q7"])
    (array([0, 1, 0], dtype=int32), 2)
    """
    segments = group_segments(np.asarray(group_ids) if not isinstance(group_ids, np.ndarray) else group_ids,
                              name="group_ids")
    _, first_rows = np.unique(segments.index, return_index=True)
    rank = np.empty(segments.n_groups, dtype=np.int64)
    rank[np.argsort(first_rows, kind="stable")] = np.arange(segments.n_groups)
    return rank[segments.index].astype(np.int32), segments.n_groups


def _run(rewards: Any, response_mask: Any, segment_ids: Any, num_segments: int, log_probs: Any, sum_pi_squared: Any,
         is_weights: Any, check_values: bool, *, align: str, leave_one_out: bool, handle_zero_tail: bool,
         epsilon: float) -> AdvantageResult:
    rewards_a, mask_a, lp_a, spp_a, weights_a = check.token_batch(rewards, response_mask, log_probs, sum_pi_squared,
                                                                  is_weights)
    check_values = check.flag("check_values", check_values)
    ids = check.segments("segment_ids", segment_ids, num_segments, rewards_a.shape[0], check_values)
    check.check_values(check_values, rewards=("rewards", rewards_a), mask=("response_mask", mask_a),
                       log_probs=("log_probs", lp_a), sum_pi_squared=("sum_pi_squared", spp_a),
                       is_weights=None if weights_a is None else ("is_weights", weights_a))
    compute_dtype = check.compute_dtype(rewards_a, lp_a, spp_a, weights_a)
    outputs = otb_pipeline_jit(rewards_a, mask_a, ids, lp_a, spp_a, weights_a, check.epsilon(epsilon),
                               num_segments=int(num_segments), align=align, leave_one_out=leave_one_out,
                               handle_zero_tail=handle_zero_tail, compute_dtype=compute_dtype,
                               output_dtype=check.output_dtype(rewards_a))
    check.finite_outputs(check_values, "rewards", outputs, compute_dtype, weights_a, mask_a)
    return AdvantageResult(*outputs)


def optimal_token_baseline(rewards: Any, response_mask: Any, segment_ids: Any, num_segments: int, log_probs: Any,
                           sum_pi_squared: Any, *, is_weights: Any = None, handle_zero_tail: bool = True,
                           epsilon: float = 1e-8, check_values: bool = True) -> AdvantageResult:
    """Single-turn OTB (verl semantics); the JAX port of :func:`otb_spec.optimal_token_baseline`.

    ``segment_ids`` [B] int and the static ``num_segments`` come from :func:`segment_ids` (``num_segments`` may be
    larger than the number of groups — fix it, e.g. to B, to avoid recompiling when the group count changes). Jitted
    (no recompilation for batches of the same shape and options); callable inside ``jit`` and ``vmap`` (values are
    then not checked: a segment id outside [0, num_segments) — a ``num_segments`` smaller than the number of groups —
    gives NaN advantages and baselines on its rows, a NaN input spreads over its group). The outputs are
    differentiable functions of ``log_probs`` and ``sum_pi_squared``: in a loss, wrap them in
    ``jax.lax.stop_gradient`` (the advantages are constants of the policy gradient).
    """
    return _run(rewards, response_mask, segment_ids, num_segments, log_probs, sum_pi_squared, is_weights,
                check_values, align="position", leave_one_out=False,
                handle_zero_tail=check.flag("handle_zero_tail", handle_zero_tail), epsilon=epsilon)


def multi_turn_optimal_token_baseline(rewards: Any, response_mask: Any, segment_ids: Any, num_segments: int,
                                      log_probs: Any, sum_pi_squared: Any, *, is_weights: Any = None,
                                      handle_zero_tail: bool = True, epsilon: float = 1e-8,
                                      check_values: bool = True) -> AdvantageResult:
    """Multi-turn (valid-token aligned) OTB; the port of :func:`otb_spec.multi_turn_optimal_token_baseline`
    (segment ids, jit and gradients as :func:`optimal_token_baseline`)."""
    return _run(rewards, response_mask, segment_ids, num_segments, log_probs, sum_pi_squared, is_weights,
                check_values, align="valid_token", leave_one_out=False,
                handle_zero_tail=check.flag("handle_zero_tail", handle_zero_tail), epsilon=epsilon)


def leave_one_out_token_baseline(rewards: Any, response_mask: Any, segment_ids: Any, num_segments: int,
                                 log_probs: Any, sum_pi_squared: Any, *, is_weights: Any = None,
                                 align: str = "position", epsilon: float = 1e-8,
                                 check_values: bool = True) -> AdvantageResult:
    """Leave-one-out OTB (unbiased); the port of :func:`otb_spec.leave_one_out_token_baseline` (segment ids, jit
    and gradients as :func:`optimal_token_baseline`)."""
    align = reference_checks.alignment(align)
    return _run(rewards, response_mask, segment_ids, num_segments, log_probs, sum_pi_squared, is_weights,
                check_values, align=align, leave_one_out=True, handle_zero_tail=False, epsilon=epsilon)


def _energy_variant(names: tuple[str, str], first: Any, energy: Any, response_mask: Any, segment_ids: Any,
                    num_segments: int, *, from_rewards: bool, align: str, leave_one_out: bool,
                    handle_zero_tail: bool | None, epsilon: float, check_values: bool) -> AdvantageResult:
    first_name, energy_name = names
    first_a = check.batch(first_name, first)
    energy_a = check.array(energy_name, energy, like=first_a, like_name=first_name)
    mask_a = check.array("response_mask", response_mask, like=first_a, like_name=first_name)
    ids = check.segments("segment_ids", segment_ids, num_segments, first_a.shape[0], check.flag("check_values",
                                                                                                 check_values))
    check.check_values(check_values, rewards=(first_name, first_a), mask=("response_mask", mask_a),
                       energies=[(energy_name, energy_a)])
    align = reference_checks.alignment(align)
    leave_one_out = check.flag("leave_one_out", leave_one_out)
    handle_zero_tail = check.zero_tail(handle_zero_tail, leave_one_out)
    compute_dtype = check.compute_dtype(first_a, energy_a)
    outputs = energy_pipeline_jit(first_a, energy_a, mask_a, ids, check.epsilon(epsilon),
                                  num_segments=int(num_segments), from_rewards=from_rewards, align=align,
                                  leave_one_out=leave_one_out, handle_zero_tail=handle_zero_tail,
                                  compute_dtype=compute_dtype, output_dtype=check.output_dtype(first_a))
    check.finite_outputs(check.flag("check_values", check_values), first_name, outputs, compute_dtype)
    return AdvantageResult(*outputs)


def exact_norm_token_baseline(rewards: Any, response_mask: Any, segment_ids: Any, num_segments: int,
                              cumulative_score_sq_norms: Any, *, align: str = "position", leave_one_out: bool = False,
                              handle_zero_tail: bool | None = None, epsilon: float = 1e-8,
                              check_values: bool = True) -> AdvantageResult:
    """OTB with exact ‖Sₜ‖²; the port of :func:`otb_spec.exact_norm_token_baseline`."""
    return _energy_variant(("rewards", "cumulative_score_sq_norms"), rewards, cumulative_score_sq_norms,
                           response_mask, segment_ids, num_segments, from_rewards=True, align=align,
                           leave_one_out=leave_one_out, handle_zero_tail=handle_zero_tail, epsilon=epsilon,
                           check_values=check_values)


def token_baseline(returns: Any, realized_energy: Any, response_mask: Any, segment_ids: Any, num_segments: int, *,
                   align: str = "position", leave_one_out: bool = False, handle_zero_tail: bool | None = None,
                   epsilon: float = 1e-8, check_values: bool = True) -> AdvantageResult:
    """The general energy-weighted baseline for given (G, W); the port of :func:`otb_spec.token_baseline`."""
    return _energy_variant(("returns", "realized_energy"), returns, realized_energy, response_mask, segment_ids,
                           num_segments, from_rewards=False, align=align, leave_one_out=leave_one_out,
                           handle_zero_tail=handle_zero_tail, epsilon=epsilon, check_values=check_values)


def returns_to_go(rewards: Any, response_mask: Any, *, check_values: bool = True) -> jax.Array:
    """Gₜ = Σ_{k≥t} mₖrₖ (γ = 1); the port of :func:`otb_spec.returns_to_go`."""
    rewards_a = check.batch("rewards", rewards)
    mask_a = check.array("response_mask", response_mask, like=rewards_a, like_name="rewards")
    check.check_values(check_values, rewards=("rewards", rewards_a), mask=("response_mask", mask_a))
    dtype = jnp.dtype(check.compute_dtype(rewards_a))
    out = jnp.dtype(check.output_dtype(rewards_a))
    returns = reward_to_go(rewards_a.astype(dtype), (mask_a != 0).astype(dtype)).astype(out)
    if check_values and check.concrete_flag(jnp.all(jnp.isfinite(returns))) is False:   # finite rewards, sums beyond
        if check.narrower(out, dtype):
            raise check.output_range_error("rewards", out)
        raise reference_checks.returns_overflow_error("rewards", dtype.name)
    return returns


def realized_energy_of(log_probs: Any, sum_pi_squared: Any, response_mask: Any, *, is_weights: Any = None,
                       check_values: bool = True) -> jax.Array:
    """Wₜ = Σ_{j≤t} mⱼρⱼ²(1 − 2πⱼ + Σπ²ⱼ): [B, T]."""
    lp_a = check.batch("log_probs", log_probs)
    spp_a = check.array("sum_pi_squared", sum_pi_squared, like=lp_a, like_name="log_probs")
    mask_a = check.array("response_mask", response_mask, like=lp_a, like_name="log_probs")
    weights_a = None if is_weights is None else check.array("is_weights", is_weights, like=lp_a,
                                                            like_name="log_probs")
    check.check_values(check_values, mask=("response_mask", mask_a), log_probs=("log_probs", lp_a),
                       sum_pi_squared=("sum_pi_squared", spp_a),
                       is_weights=None if weights_a is None else ("is_weights", weights_a))
    dtype = jnp.dtype(check.compute_dtype(lp_a, spp_a, weights_a))
    energy = realized_energy(token_energy(lp_a.astype(dtype), spp_a.astype(dtype)), (mask_a != 0).astype(dtype),
                             None if weights_a is None else weights_a.astype(dtype))
    out = jnp.dtype(check.output_dtype(lp_a))
    energy = energy.astype(out)
    if check_values and check.concrete_flag(jnp.all(jnp.isfinite(energy))) is False:   # the weights, or float16
        if weights_a is not None:
            check.raise_if_weights_may_overflow(weights_a, mask_a, dtype)
        raise check.output_range_error("log_probs", out)
    return energy
