"""The OTB computation in JAX: pure, shape-static functions over [B, T] arrays with integer segment ids.

Mirrors ``otb_spec.otb`` and the torch port ``otb_torch._core`` operation for operation; what differs is only what JAX
forces: the number of groups is a static argument (output shapes depend on it), segment reductions are
``jax.ops.segment_sum``/``segment_max``, and compaction of valid tokens is a scatter-add into a [B, T] grid (no
data-dependent shapes).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from otb_spec.tolerances import DOMINANT_SHARE

__all__: list[str] = []


def reward_to_go(rewards: jax.Array, mask: jax.Array) -> jax.Array:
    """Gₜ = Σ_{k≥t} mₖrₖ as the row total minus the exclusive prefix."""
    masked = rewards * mask
    prefix = jnp.cumsum(masked, axis=-1)
    return prefix[:, -1:] - prefix + masked


def token_energy(log_probs: jax.Array, sum_pi_squared: jax.Array) -> jax.Array:
    """wₜ = 1 − 2πₜ + Σπ²ₜ, π = exp(min(log π, 0))."""
    pi = jnp.exp(jnp.minimum(log_probs, 0))
    return sum_pi_squared + 1 - 2 * pi


def realized_energy(energy: jax.Array, mask: jax.Array, is_weights: jax.Array | None) -> jax.Array:
    """Wₜ = Σ_{j≤t} mⱼρⱼ²wⱼ."""
    per_token = energy * mask
    if is_weights is not None:
        per_token = per_token * is_weights * is_weights
    return jnp.cumsum(per_token, axis=-1)


class Grid:
    """The aligned layout [B, T]: column k is "token k" of every member (absolute, or the k-th valid token)."""

    def __init__(self, mask: jax.Array, align: str):
        self.mask = mask
        self.align = align
        rows, width = mask.shape
        self.lengths = jnp.sum(mask, axis=-1).astype(jnp.int32)
        self.positions = jnp.arange(width, dtype=jnp.int32)
        if align == "position":
            self.valid = mask
            self.members = jnp.ones((rows,), dtype=bool)
        else:
            self.index = jnp.maximum(jnp.cumsum(mask.astype(jnp.int32), axis=-1) - 1, 0)
            self.rows = jnp.arange(rows)[:, None]
            self.valid = (self.positions[None, :] < self.lengths[:, None]).astype(mask.dtype)
            self.members = self.lengths > 0

    def gather(self, values: jax.Array) -> jax.Array:
        if self.align == "position":
            return values
        return jnp.zeros_like(values).at[self.rows, self.index].add(values * self.mask)

    def scatter(self, grid: jax.Array) -> jax.Array:
        values = grid if self.align == "position" else jnp.take_along_axis(grid, self.index, axis=1)
        return values * self.mask


def leave_one_out_energy(energy: jax.Array) -> jax.Array:
    """W⁺ = max(W, 0), a member's leave-one-out weight (:func:`otb_spec._baseline.leave_one_out_energy`; a NaN stays
    NaN)."""
    return jnp.where(energy < 0, 0, energy).astype(energy.dtype)


def others_denominator(others: jax.Array, epsilon: jax.Array) -> jax.Array:
    """Leave-one-out: Dᵢ + ε where the other members' energy Dᵢ is positive, 0 (B = 0 by the safe ratio) where not
    (:func:`otb_spec._baseline.others_denominator`; a NaN stays NaN)."""
    return jnp.where(others <= 0, 0, others + epsilon)


def _safe_ratio(numerator: jax.Array, denominator: jax.Array) -> jax.Array:
    zero = denominator == 0
    return jnp.where(zero, 0, numerator / jnp.where(zero, 1, denominator))


def _zero_from(grid: Grid, segment_ids: jax.Array, num_segments: int, handle_zero_tail: bool) -> jax.Array:
    """Per row, the first aligned position where the self-inclusive baseline is 0 by rule (see otb_torch._core)."""
    lengths, members = grid.lengths, grid.members
    width = grid.positions.shape[0]
    count = jax.ops.segment_sum(members.astype(jnp.int32), segment_ids, num_segments)[segment_ids]
    start = jnp.where(count < 2, 0, width).astype(jnp.int32)
    if not handle_zero_tail:
        return start
    longest = jax.ops.segment_max(jnp.where(members, lengths, -1), segment_ids, num_segments)[segment_ids]
    at_longest = members & (lengths == longest)
    unique = at_longest & (jax.ops.segment_sum(at_longest.astype(jnp.int32), segment_ids,
                                               num_segments)[segment_ids] == 1) & (count >= 2)
    second = jax.ops.segment_max(jnp.where(members & ~at_longest, lengths, -1), segment_ids,
                                 num_segments)[segment_ids]
    return jnp.where(unique, second, start)


def token_baseline(returns: jax.Array, energy: jax.Array, mask: jax.Array, segment_ids: jax.Array,
                   num_segments: int, epsilon: jax.Array, *, align: str, leave_one_out: bool,
                   handle_zero_tail: bool) -> tuple[jax.Array, jax.Array]:
    """(advantages, baselines) from G and W (compute dtype, [B, T]); ``mask`` 0/1 in the compute dtype."""
    grid = Grid(mask, align)
    grid_returns = grid.gather(returns)
    weights = grid.gather(leave_one_out_energy(energy) if leave_one_out else energy) * grid.valid
    weighted_returns = grid_returns * weights
    numerator = jax.ops.segment_sum(weighted_returns, segment_ids, num_segments)     # [G, T]  (all-reduce to scale)
    denominator = jax.ops.segment_sum(weights, segment_ids, num_segments)
    if leave_one_out:
        others = jax.ops.segment_sum(grid.valid, segment_ids, num_segments)[segment_ids] - grid.valid
        keep = (others > 0).astype(weights.dtype)
        # a member with Wᵢ > ¾D takes the others' sums added directly, not D − Wᵢ, which cancels in float32 where its
        # energy dwarfs theirs (at most one per column; otb_torch._core.others_sums)
        dominant = weights > DOMINANT_SHARE * denominator[segment_ids]

        def rest_total(values):
            return jax.ops.segment_sum(jnp.where(dominant, 0.0, values), segment_ids, num_segments)[segment_ids]

        others_n = jnp.where(dominant, rest_total(weighted_returns), numerator[segment_ids] - weighted_returns)
        others_d = jnp.where(dominant, rest_total(weights), denominator[segment_ids] - weights)
        member_baselines = _safe_ratio(others_n, others_denominator(others_d, epsilon))
    else:
        start = _zero_from(grid, segment_ids, num_segments, handle_zero_tail)
        keep = (grid.positions[None, :] < start[:, None]).astype(weights.dtype)
        member_baselines = _safe_ratio(numerator, denominator + epsilon)[segment_ids]
    baselines = grid.scatter(member_baselines * keep)
    advantages = grid.scatter(grid_returns - member_baselines * keep)
    # an id outside [0, num_segments) — unchecked under jit — has no sums: its row is NaN, not silently wrong
    outside = ((segment_ids < 0) | (segment_ids >= num_segments))[:, None]
    return jnp.where(outside, jnp.nan, advantages), jnp.where(outside, jnp.nan, baselines)


def otb_pipeline(rewards: jax.Array, mask: jax.Array, segment_ids: jax.Array, log_probs: jax.Array,
                 sum_pi_squared: jax.Array, is_weights: jax.Array | None, epsilon: jax.Array, *, num_segments: int,
                 align: str, leave_one_out: bool, handle_zero_tail: bool, compute_dtype: str,
                 output_dtype: str) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Rewards and token statistics → (advantages, returns, baselines) in ``output_dtype``."""
    dtype = jnp.dtype(compute_dtype)
    mask = (mask != 0).astype(dtype)
    returns = reward_to_go(rewards.astype(dtype), mask)
    energy = realized_energy(token_energy(log_probs.astype(dtype), sum_pi_squared.astype(dtype)), mask,
                             None if is_weights is None else is_weights.astype(dtype))
    advantages, baselines = token_baseline(returns, energy, mask, segment_ids, num_segments,
                                           jnp.asarray(epsilon, dtype), align=align, leave_one_out=leave_one_out,
                                           handle_zero_tail=handle_zero_tail)
    out = jnp.dtype(output_dtype)
    return advantages.astype(out), returns.astype(out), baselines.astype(out)


def energy_pipeline(returns: jax.Array, energy: jax.Array, mask: jax.Array, segment_ids: jax.Array,
                    epsilon: jax.Array, *, num_segments: int, from_rewards: bool, align: str, leave_one_out: bool,
                    handle_zero_tail: bool, compute_dtype: str,
                    output_dtype: str) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Given (rewards or returns, realized energy) → (advantages, returns, baselines)."""
    dtype = jnp.dtype(compute_dtype)
    mask = (mask != 0).astype(dtype)
    returns = reward_to_go(returns.astype(dtype), mask) if from_rewards else returns.astype(dtype)
    advantages, baselines = token_baseline(returns, energy.astype(dtype), mask, segment_ids, num_segments,
                                           jnp.asarray(epsilon, dtype), align=align, leave_one_out=leave_one_out,
                                           handle_zero_tail=handle_zero_tail)
    out = jnp.dtype(output_dtype)
    return advantages.astype(out), returns.astype(out), baselines.astype(out)


_STATIC = ("num_segments", "align", "leave_one_out", "handle_zero_tail", "compute_dtype", "output_dtype")
otb_pipeline_jit = jax.jit(otb_pipeline, static_argnames=_STATIC)
energy_pipeline_jit = jax.jit(energy_pipeline, static_argnames=_STATIC + ("from_rewards",))
