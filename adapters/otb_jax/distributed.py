"""OTB and Σπ² over named mesh axes with ``jax.shard_map``: vocab-, data- and context-parallel.

The JAX port of :mod:`otb_spec.distributed` and of the vocab-shard rule. The ``*_local`` functions run *inside*
``shard_map`` (or any context where the named axes are bound) on each device's block; the others wrap them in a
``shard_map`` over a :class:`jax.sharding.Mesh` for arrays given whole, and are what most callers want.

* Vocab parallel (axis ``vocab_axis``): one ``pmax`` of the row maxima M and one ``psum`` of the stacked
  (S₁, S₂, Σa(z − M), z_y − M), a = e^{z − M} — as :func:`otb_torch.distributed.vocab_parallel_token_statistics`.
* Data parallel (axis ``data_axis``): the [G, K] grid sums N, D (and V for leave-one-out) are ``psum``-ed; the
  self-inclusive rules' per-group members and top-two lengths are ``all_gather``-ed as [4, G] integers and merged.
  Leave-one-out ``psum``-s a second [2, G, K] grid, N and D without each cell's dominant member (weight above ¾ of
  the cell's D), which that member takes as its others' sums instead of D − Wᵢ (proofs/N1 item 5).
* Context parallel (axis ``context_axis``, rows cut into equal column blocks in axis order): the per-row totals
  (Σmr, Σmρ²w, Σm) are ``all_gather``-ed and scanned exclusively across the axis. By position a block's grid is
  its own [G, T_c] columns, which only the devices at the same context index add to: it is ``psum``-ed over the
  data axes alone (not at all without one). By valid token the blocks' tokens reach any column: [G, K] over both.

Shapes are static: ``num_groups`` G is a Python int and K is the padded row length (the context blocks' total).
Values are checked on the host before the ``shard_map`` (concrete inputs only), with the reference's messages.
tests/test_jax_distributed.py runs them on several host devices (``--xla_force_host_platform_device_count``).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, PartitionSpec

from otb_jax import _checks as check
from otb_jax._core import leave_one_out_energy, others_denominator, realized_energy, reward_to_go, token_energy
from otb_jax._logits import TokenStatistics
from otb_jax._otb import AdvantageResult
from otb_spec import _validation as reference_checks
from otb_spec.tolerances import DOMINANT_SHARE

__all__ = [
    "vocab_parallel_token_statistics_local",
    "vocab_parallel_token_statistics",
    "distributed_token_baseline_local",
    "distributed_token_baseline",
]


# ----------------------------------------------------------------------------------------------------------------------
# Vocab parallel


def vocab_parallel_token_statistics_local(logits_shard: jax.Array, token_ids: jax.Array | None = None, *,
                                          vocab_axis: Any, vocab_start: Any = None) -> TokenStatistics:
    """Inside ``shard_map``: log π(y), entropy and Σπ² of this device's vocabulary block [..., V_k].

    ``vocab_start`` defaults to axis_index·V_k (shard_map's equal blocks); ``token_ids`` are global ids.
    """
    compute = jnp.float64 if logits_shard.dtype == jnp.float64 else jnp.float32
    out = logits_shard.dtype if jnp.issubdtype(logits_shard.dtype, jnp.floating) else jnp.float32
    z = logits_shard.astype(compute)
    width = z.shape[-1]
    overall = lax.pmax(jnp.max(z, axis=-1), vocab_axis)
    shift = jnp.where(jnp.isinf(overall), 0.0, overall)[..., None]
    d = z - shift
    a = jnp.exp(d)
    weighted = jnp.sum(a * jnp.where(a > 0, d, 0.0), axis=-1)
    parts = [jnp.sum(a, axis=-1), jnp.sum(a * a, axis=-1), weighted]
    if token_ids is not None:
        begin = lax.axis_index(vocab_axis) * width if vocab_start is None else vocab_start
        local = check.widened_ids(token_ids) - begin
        owned = (local >= 0) & (local < width)
        chosen = jnp.take_along_axis(d, jnp.clip(local, 0, width - 1)[..., None], axis=-1)[..., 0]
        parts += [jnp.where(owned, chosen, 0.0), owned.astype(compute)]
    total, squares, weighted, *picked = lax.psum(jnp.stack(parts), vocab_axis)
    log_total = jnp.log(total)
    log_probs = None                 # an id on no device's block (outside [0, V), unchecked): NaN, not −log S₁
    if token_ids is not None:
        log_probs = jnp.where(picked[1] > 0, picked[0] - log_total, jnp.nan).astype(out)
    return TokenStatistics(log_probs, (log_total - weighted / total).astype(out),
                           (squares / jnp.square(total)).astype(out))


def _axis_size(mesh: Mesh, name: Any, argument: str) -> int:
    """The size of ``mesh``'s axis ``name``, or a ValueError naming the argument and the mesh's axes."""
    if name not in mesh.shape:
        axes = ", ".join(map(repr, mesh.axis_names))
        raise ValueError(f"{argument}: the mesh has no axis {name!r} (its axes: {axes})")
    return int(mesh.shape[name])


def vocab_parallel_token_statistics(logits: Any, token_ids: Any = None, *, mesh: Mesh, vocab_axis: str,
                                    check_values: bool = True) -> TokenStatistics:
    """log π(y), entropy and Σπ² of logits [..., V] whose vocabulary is split over ``mesh``'s ``vocab_axis``
    (V divisible by the axis size); each [...] replicated. Equal to :func:`otb_spec.token_statistics_from_logits`
    within :func:`otb_spec.tolerances.sum_pi_squared_tolerance`."""
    z = check.array("logits", logits)
    if z.ndim < 1 or z.shape[-1] == 0:
        raise ValueError(f"logits: expected shape [..., V] with a non-empty vocabulary axis, got {z.shape}")
    size = _axis_size(mesh, vocab_axis, "vocab_axis")
    if z.shape[-1] % size:
        raise ValueError(f"logits: the vocabulary ({z.shape[-1]}) must divide evenly over the {size} devices of "
                         f"mesh axis {vocab_axis!r}")
    if check_values and not check.is_traced(z):
        reference_checks.float_array("logits", check._host(z), allow_neg_inf=True)
        if check.concrete_flag(jnp.any(jnp.all(z == -jnp.inf, axis=-1))):
            raise ValueError("logits: every logit is -inf at some position; the softmax is undefined there")
    ids = None if token_ids is None else check.token_ids(token_ids, tuple(z.shape[:-1]), "logits", "vocabulary")
    if ids is not None and check_values and not check.is_traced(ids):
        if check.concrete_flag(jnp.any((ids < 0) | (ids >= z.shape[-1]))):
            raise ValueError(f"token_ids: must lie in [0, {z.shape[-1]}) (the vocabulary)")
    mapped = _sharded_statistics(mesh, vocab_axis, z.ndim - 1, ids is not None)
    return mapped(z) if ids is None else mapped(z, ids)


@lru_cache(maxsize=64)
def _sharded_statistics(mesh: Mesh, vocab_axis: Any, leading: int, with_ids: bool) -> Any:
    """The jitted ``shard_map`` of :func:`vocab_parallel_token_statistics_local` (cached per mesh and options)."""
    replicated = PartitionSpec(*(None,) * leading)

    def local(block, *ids):
        return vocab_parallel_token_statistics_local(block, ids[0] if ids else None, vocab_axis=vocab_axis)

    in_specs = (PartitionSpec(*(None,) * leading, vocab_axis),) + ((replicated,) if with_ids else ())
    out_specs = TokenStatistics(replicated if with_ids else None, replicated, replicated)
    return jax.jit(jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False))


# ----------------------------------------------------------------------------------------------------------------------
# Data and context parallel OTB


def _merge_lengths(gathered: jax.Array) -> jax.Array:
    """[P, 4, G] → [4, G] (:func:`otb_spec.distributed.combine_group_lengths`)."""
    members, longest, count, second = (gathered[:, k] for k in range(4))
    overall = jnp.max(longest, axis=0)
    reaches = longest == overall
    return jnp.stack([members.sum(0), overall, jnp.where(reaches, count, 0).sum(0),
                      jnp.maximum(jnp.where(reaches, second, longest), -1).max(0)])


def _group_lengths(lengths: jax.Array, ids: jax.Array, inside: jax.Array, num_groups: int, align: str) -> jax.Array:
    members = inside & (lengths > 0) if align == "valid_token" else inside
    count = jnp.zeros(num_groups, jnp.int32).at[ids].add(members.astype(jnp.int32))
    longest = jnp.full(num_groups, -1, jnp.int32).at[ids].max(jnp.where(members, lengths, -1))
    at_longest = members & (lengths == longest[ids])
    count_longest = jnp.zeros(num_groups, jnp.int32).at[ids].add(at_longest.astype(jnp.int32))
    second = jnp.full(num_groups, -1, jnp.int32).at[ids].max(jnp.where(members & ~at_longest, lengths, -1))
    return jnp.stack([count, longest, count_longest, second])


def distributed_token_baseline_local(rewards: jax.Array, response_mask: jax.Array, group_ids: jax.Array,
                                     log_probs: jax.Array, sum_pi_squared: jax.Array, *, num_groups: int,
                                     data_axis: Any, context_axis: Any = None, is_weights: jax.Array | None = None,
                                     align: str = "position", leave_one_out: bool = False,
                                     handle_zero_tail: bool | None = None, epsilon: float = 1e-8) -> AdvantageResult:
    """Inside ``shard_map``: this device's block [B_d, T_c] of the batch's (advantages, returns, baselines).

    ``group_ids`` are global integers in [0, num_groups); ``context_axis`` (optional) cuts rows into equal column
    blocks in axis order; ``data_axis`` may be a tuple of axis names or None (no data split). Values are not
    checked here: an id outside [0, num_groups) gives NaN advantages and baselines on its row (which joins no group),
    and a mask is read as valid where nonzero.
    """
    align = reference_checks.alignment(align)
    handle_zero_tail = check.zero_tail(handle_zero_tail, leave_one_out)
    compute = check.compute_dtype(rewards, log_probs, sum_pi_squared, is_weights)
    m = (response_mask != 0).astype(compute)                     # as the one-device port reads a mask
    returns = reward_to_go(rewards.astype(compute), m)           # this block's rows; whole rows after the scan
    energy = realized_energy(token_energy(log_probs.astype(compute), sum_pi_squared.astype(compute)), m,
                             None if is_weights is None else is_weights.astype(compute))
    valid = jnp.sum(m, axis=-1)
    block = m.shape[1]
    if context_axis is None:
        valid_before = jnp.zeros(valid.shape, jnp.int32)
        lengths = valid.astype(jnp.int32)
        columns_before, width = 0, block
    else:                                                         # G₀ of a block is its reward total
        gathered = lax.all_gather(jnp.stack([returns[:, 0], energy[:, -1], valid]), context_axis)   # [P_c, 3, B]
        me = lax.axis_index(context_axis)
        shards = jnp.arange(gathered.shape[0])[:, None]
        returns = returns + jnp.sum(jnp.where(shards > me, gathered[:, 0], 0.0), axis=0)[:, None]
        energy = energy + jnp.sum(jnp.where(shards < me, gathered[:, 1], 0.0), axis=0)[:, None]
        valid_before = jnp.sum(jnp.where(shards < me, gathered[:, 2], 0.0), axis=0).astype(jnp.int32)
        lengths = jnp.sum(gathered[:, 2], axis=0).astype(jnp.int32)
        columns_before, width = me * block, gathered.shape[0] * block
    data_axes = tuple(axis for axis in (data_axis if isinstance(data_axis, tuple) else (data_axis,))
                      if axis is not None)
    if align == "position":
        # the block's own columns: in equal blocks only the devices at the same context index add to these cells,
        # so the grid is [G, T_c] and sums over the data axes alone
        local_columns = jnp.broadcast_to(jnp.arange(block), m.shape)
        columns, grid_width, grid_axes = columns_before + local_columns, block, data_axes
    else:                                                         # a block's valid tokens reach any column of K
        columns = jnp.minimum((jnp.cumsum(m, axis=-1) - m).astype(jnp.int32) + valid_before[:, None], width - 1)
        local_columns, grid_width = columns, width
        grid_axes = data_axes + (() if context_axis is None else (context_axis,))
    if num_groups * grid_width >= 2**31:
        raise ValueError(f"num_groups: the grid of groups × columns ({num_groups} × {grid_width}) has more than 2³¹ "
                         "cells, beyond int32 indexing; split the batch into fewer groups per call")
    # an id outside [0, num_groups) — unchecked inside a trace — joins no group and gets NaN rows, as in the
    # one-device port (a scatter would wrap a negative id into another group and drop a large one)
    inside = (group_ids >= 0) & (group_ids < num_groups)
    ids = jnp.where(inside, group_ids, 0).astype(jnp.int32)
    cells = (ids[:, None] * grid_width + local_columns).reshape(-1)
    weights = (leave_one_out_energy(energy) if leave_one_out else energy) * m      # leave-one-out: W⁺ = max(W, 0)
    member = inside[:, None].astype(compute)
    planes = [returns * weights * member, weights * member] + ([m * member] if leave_one_out else [])
    grid = jnp.zeros((len(planes), num_groups * grid_width), compute).at[:, cells].add(
        jnp.stack([plane.reshape(-1) for plane in planes]))
    if grid_axes:
        grid = lax.psum(grid, grid_axes)
    numerator = grid[0][cells].reshape(m.shape)
    denominator = grid[1][cells].reshape(m.shape)
    if leave_one_out:
        ratio_num = numerator - returns * weights
        ratio_den = denominator - weights
        # a member whose weight is more than ¾ of its column's D (at most one per cell over all devices) takes the
        # others' sums added directly, not D − Wᵢ, which cancels in float32 to rounding noise where Wᵢ dwarfs the
        # rest (proofs/N1 item 5): a second grid without such members, summed as the first (static shapes: always)
        dominant = weights > DOMINANT_SHARE * denominator
        kept = jnp.where(dominant, 0.0, weights * member)
        rest = jnp.zeros((2, num_groups * grid_width), compute).at[:, cells].add(
            jnp.stack([(returns * kept).reshape(-1), kept.reshape(-1)]))
        if grid_axes:
            rest = lax.psum(rest, grid_axes)
        ratio_num = jnp.where(dominant, rest[0][cells].reshape(m.shape), ratio_num)
        ratio_den = others_denominator(jnp.where(dominant, rest[1][cells].reshape(m.shape), ratio_den), epsilon)
        forced = grid[2][cells].reshape(m.shape) - m <= 0
    else:
        ratio_num, ratio_den = numerator, denominator + epsilon
        stats = _group_lengths(lengths, ids, inside, num_groups, align)
        if data_axes:
            stats = _merge_lengths(lax.all_gather(stats, data_axes))
        members, longest, count_longest, second = stats
        forced = jnp.broadcast_to((members[ids] < 2)[:, None], m.shape)
        if handle_zero_tail:
            unique = (count_longest[ids] == 1) & (lengths == longest[ids])
            forced = forced | (unique[:, None] & (columns >= second[ids][:, None]))
    zero = ratio_den == 0
    baselines = jnp.where(zero | forced, 0.0, ratio_num / jnp.where(zero, 1.0, ratio_den)) * m
    advantages = jnp.where(inside[:, None], (returns - baselines) * m, jnp.nan)
    baselines = jnp.where(inside[:, None], baselines, jnp.nan)
    out = check.output_dtype(rewards)
    return AdvantageResult(advantages.astype(out), returns.astype(out), baselines.astype(out))


def distributed_token_baseline(rewards: Any, response_mask: Any, group_ids: Any, log_probs: Any, sum_pi_squared: Any,
                               *, num_groups: int, mesh: Mesh, data_axis: Any = None, context_axis: Any = None,
                               is_weights: Any = None, align: str = "position", leave_one_out: bool = False,
                               handle_zero_tail: bool | None = None, epsilon: float = 1e-8,
                               check_values: bool = True) -> AdvantageResult:
    """OTB of a whole batch [B, T] laid out on ``mesh``: rows split over ``data_axis`` (B divisible by its size; a
    prompt's members may sit on any device — permute rows freely), columns over ``context_axis`` (T divisible).
    Equal to the single-process reference (:func:`otb_spec.optimal_token_baseline` and its variants) within
    :func:`otb_spec.tolerances.otb_comparison_tolerance`.

    Args:
      rewards, response_mask, log_probs, sum_pi_squared, is_weights: [B, T].
      group_ids: [B] global integer ids in [0, num_groups) (:func:`otb_jax.segment_ids` numbers any ids).
      num_groups: G (static).
      mesh, data_axis, context_axis: the mesh and its axis names (``data_axis`` None: rows are not split;
        ``context_axis`` None: rows are not cut).
      align, leave_one_out, handle_zero_tail, epsilon: as :func:`otb_spec.token_baseline`.
      check_values: check values on the host first (concrete inputs only), and after the computation that finite
        rewards did not overflow the compute dtype in the group sums Σᵢ GₜⁱWₜⁱ (else a ValueError). Unchecked
        (``check_values=False``, or traced inside your ``jit``), as in the one-device port: a group id outside
        [0, num_groups) gives NaN
        advantages and baselines on its row, which joins no group, and a mask is read as valid where nonzero.
    """
    align = reference_checks.alignment(align)
    leave_one_out = check.flag("leave_one_out", leave_one_out)
    zero_tail = check.zero_tail(handle_zero_tail, leave_one_out)
    epsilon = check.epsilon(epsilon)
    r, m, lp, spp, w = check.token_batch(rewards, response_mask, log_probs, sum_pi_squared, is_weights)
    if isinstance(num_groups, bool) or not isinstance(num_groups, (int, np.integer)) or num_groups < 1:
        raise ValueError(f"num_groups: expected a positive integer, got {num_groups!r}")
    try:
        ids = check.segments("group_ids", group_ids, int(num_groups), r.shape[0], check_values)
    except ValueError as exc:                              # the single-process port calls G num_segments
        raise ValueError(str(exc).replace("num_segments", "num_groups")) from None
    check.check_values(check_values, rewards=("rewards", r), mask=("response_mask", m), log_probs=("log_probs", lp),
                       sum_pi_squared=("sum_pi_squared", spp), is_weights=None if w is None else ("is_weights", w))
    for axis, size, what in ((data_axis, r.shape[0], "rows (B)"), (context_axis, r.shape[1], "positions (T)")):
        names = axis if isinstance(axis, tuple) else (axis,)
        count = 1
        for name in names:
            if name is not None:
                count *= _axis_size(mesh, name, "data_axis" if axis is data_axis else "context_axis")
        if size % count:
            raise ValueError(f"rewards: the {size} {what} must divide evenly over the {count} devices of mesh axis "
                             f"{axis!r}")
    mapped = _sharded_baseline(mesh, data_axis, context_axis, int(num_groups), align, leave_one_out, zero_tail,
                               epsilon, w is not None)
    result = mapped(r, m, ids, lp, spp) if w is None else mapped(r, m, ids, lp, spp, w)
    check.finite_outputs(check_values, "rewards", result, check.compute_dtype(r, lp, spp, w), w, m)
    return result


@lru_cache(maxsize=64)
def _sharded_baseline(mesh: Mesh, data_axis: Any, context_axis: Any, num_groups: int, align: str,
                      leave_one_out: bool, handle_zero_tail: bool, epsilon: float, weighted: bool) -> Any:
    """The jitted ``shard_map`` of :func:`distributed_token_baseline_local` for one mesh and set of options (cached:
    a later call with the same shapes reuses the compiled program)."""
    rows = PartitionSpec(data_axis)
    cells = PartitionSpec(data_axis, context_axis)
    options = dict(num_groups=num_groups, data_axis=data_axis, context_axis=context_axis, align=align,
                   leave_one_out=leave_one_out, handle_zero_tail=handle_zero_tail, epsilon=epsilon)

    def local(rewards, mask, ids, log_probs, spp, *weights):
        return distributed_token_baseline_local(rewards, mask, ids, log_probs, spp,
                                                is_weights=weights[0] if weights else None, **options)

    in_specs = (cells, cells, rows, cells, cells) + ((cells,) if weighted else ())
    return jax.jit(jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=AdvantageResult(cells, cells, cells),
                                 check_vma=False))
