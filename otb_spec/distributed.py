"""OTB split across processes: what each shard computes, what it communicates, and how the pieces combine.

Three ways a batch outgrows one process, and the numbers each needs from the others (the vocab split is
:func:`otb_spec.vocab_shard_partials` / :func:`otb_spec.combine_vocab_shards`):

* **Context (sequence) parallel** — row i's positions are cut into consecutive column ranges, shard c holding
  [t_c, t_{c+1}). Gₜ is a suffix sum and Wₜ a prefix sum, so shard c needs, per row, the reward total of the shards
  after it and the energy total (and valid-token count) of the shards before it — exclusive scans of the per-row
  totals (:func:`context_shard_totals`, :func:`context_offsets`):

      Gₜ = Σ_{k≥t, k in c} mₖrₖ + Σ_{c' > c} R_{c'},        Wₜ = Σ_{j≤t, j in c} mⱼρⱼ²wⱼ + Σ_{c' < c} E_{c'}.

* **Data parallel** — a prompt group's members sit on different shards (verl's ``balance_batch`` scatters them).
  The baseline at aligned column k of group g needs the group's sums N_gk = Σᵢ GᵢWᵢmᵢ, D_gk = Σᵢ Wᵢmᵢ and (for
  leave-one-out) the count of valid members V_gk; each shard adds its members' terms into a [G, K] grid
  (:func:`shard_group_totals`) and the grids are summed over shards (:func:`combine_group_totals`). The
  self-inclusive rules also need, per group, the number of members and the two largest lengths with the count at the
  largest (the zero tail): :func:`shard_group_lengths`, merged with :func:`combine_group_lengths`.

* Both at once — the same grids, summed over every shard of the batch.

Group ids are global integers in [0, num_groups) (the same prompt has the same id on every shard); the aligned column
of a valid token is its absolute position (``"position"``) or its index among the row's valid tokens
(``"valid_token"``) — for a context shard, offset by the columns or valid tokens of the shards before it. ``width``
K bounds the aligned columns: the longest padded row length over all shards serves both alignments.

Given the combined totals, :func:`shard_token_baseline` returns exactly (up to the order of summation) the rows'
advantages, returns and baselines of the single-process :func:`otb_spec.optimal_token_baseline`,
:func:`otb_spec.multi_turn_optimal_token_baseline` or :func:`otb_spec.leave_one_out_token_baseline`; the error bound
of :func:`otb_spec.tolerances.otb_tolerance` holds for any summation order, so it covers every split.
:func:`sharded_token_baseline` runs the whole protocol for a given split in one process: the oracle that the torch and
JAX distributed ports are tested against (docs/distributed.md).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import numpy as np

from otb_spec import _validation as check
from otb_spec._baseline import leave_one_out_energy, others_denominator, safe_ratio, validated_otb_inputs
from otb_spec.groups import group_segments
from otb_spec.otb import AdvantageResult, _overflow_error, _raise_if_weights_overflow
from otb_spec.proxy import _energy
from otb_spec.trajectory import cumulative_energy, importance_weights, reward_to_go, valid_token_index

__all__ = [
    "RowTotals",
    "ContextOffsets",
    "GroupTotals",
    "GroupLengths",
    "context_shard_totals",
    "context_offsets",
    "context_shard_returns_and_energy",
    "shard_group_totals",
    "combine_group_totals",
    "shard_group_lengths",
    "combine_group_lengths",
    "shard_token_baseline",
    "sharded_token_baseline",
]


class RowTotals(NamedTuple):
    """Per-row totals of one context shard, [B] each: R = Σ mₜrₜ, E = Σ mₜρₜ²wₜ, V = Σ mₜ (int64)."""

    reward: np.ndarray
    energy: np.ndarray
    valid: np.ndarray


class ContextOffsets(NamedTuple):
    """What context shard c adds to its local scans, [B] each (``columns_before`` a scalar).

    Attributes:
      return_after: Σ_{c' > c} R_{c'}, the reward of the row's later shards.
      energy_before: Σ_{c' < c} E_{c'}, the realized energy of its earlier shards.
      valid_before: Σ_{c' < c} V_{c'}, valid tokens in earlier shards (int64).
      length: Σ_{c'} V_{c'}, the row's valid tokens in all shards (int64).
      columns_before: Σ_{c' < c} T_{c'}, the absolute position of the shard's first column.
    """

    return_after: np.ndarray
    energy_before: np.ndarray
    valid_before: np.ndarray
    length: np.ndarray
    columns_before: int


class GroupTotals(NamedTuple):
    """Sums over a group's members on the aligned grid, [G, K] each (float64; ``valid`` exact counts).

    Attributes:
      weighted_returns: N_gk = Σᵢ Gᵢ Wᵢ mᵢ.
      energy: D_gk = Σᵢ Wᵢ mᵢ.
      valid: V_gk = Σᵢ mᵢ (valid members at column k).
      leave_one_out: the sums of the leave-one-out variant, whose weights are W⁺ = max(W, 0) — what
        :func:`shard_token_baseline` checks against its own ``leave_one_out`` (a fourth field since 2026-11-27:
        totals built by hand after one's own all-reduce pass it by name).
    """

    weighted_returns: np.ndarray
    energy: np.ndarray
    valid: np.ndarray
    leave_one_out: bool = False


class GroupLengths(NamedTuple):
    """Per group, [G] int64 each: members, the largest length L₁, how many members have it, and the largest length
    below L₁ (−1 where there is none). Lengths count valid tokens; members are all rows (``"position"``) or the rows
    with at least one valid token (``"valid_token"``)."""

    members: np.ndarray
    longest: np.ndarray
    count_longest: np.ndarray
    second: np.ndarray


# ----------------------------------------------------------------------------------------------------------------------
# Context parallel: exclusive scans of per-row totals


def _shard_inputs(rewards: Any, response_mask: Any, log_probs: Any, sum_pi_squared: Any, is_weights: Any
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(rewards, mask, the shard's own realized energy Σ_{j≤t in the shard} mⱼρⱼ²wⱼ), validated as the single-process
    reference does."""
    shape = check.batch_shape("rewards", rewards)
    rewards64 = check.float_array("rewards", rewards, shape=shape)
    mask = check.mask_array("response_mask", response_mask, shape, like="rewards")
    log_probs64, spp64 = check.token_statistics(log_probs, sum_pi_squared, mask, shape, like="rewards")
    weights = None if is_weights is None else importance_weights(is_weights, shape, like="rewards")
    return rewards64, mask, cumulative_energy(_energy(log_probs64, spp64), mask, weights)


def context_shard_totals(rewards: Any, response_mask: Any, log_probs: Any, sum_pi_squared: Any, *,
                         is_weights: Any = None) -> RowTotals:
    """The per-row totals (R, E, V) a context shard sends: [B, T_c] inputs → three [B] arrays.

    Worked example: one row, shard holding r = (0, 1), m = (1, 1), uniform two-token policy (w = ½)::

      >>> half = np.full((1, 2), 0.5)
      >>> totals = context_shard_totals([[0.0, 1.0]], [[1, 1]], np.log(half), half)
      >>> totals.reward.tolist(), totals.energy.tolist(), totals.valid.tolist()
      ([1.0], [1.0], [2])
    """
    rewards64, mask, energy = _shard_inputs(rewards, response_mask, log_probs, sum_pi_squared, is_weights)
    return RowTotals((rewards64 * mask).sum(axis=-1), energy[:, -1], mask.sum(axis=-1).astype(np.int64))


def context_offsets(totals: Sequence[RowTotals], widths: Sequence[int], shard: int) -> ContextOffsets:
    """Exclusive scans of the shards' totals, seen from ``shard``.

    Args:
      totals: one :class:`RowTotals` per context shard, in column order, all for the same B rows.
      widths: T_c of each shard (its number of columns).
      shard: c, the shard asking.
    """
    items = list(totals)
    if not items:
        raise ValueError("totals: need at least one context shard")
    if len(widths) != len(items):
        raise ValueError(f"widths: expected {len(items)} widths (one per shard), got {len(widths)}")
    if not 0 <= shard < len(items):
        raise ValueError(f"shard: expected an index in [0, {len(items)}), got {shard}")
    rows = items[0].reward.shape
    for position, item in enumerate(items):
        if not isinstance(item, RowTotals):
            raise TypeError(f"totals[{position}]: expected RowTotals, got {type(item).__name__}")
        if any(np.shape(field) != rows for field in item):
            raise ValueError(f"totals[{position}]: expected fields of shape {rows} (the rows of totals[0])")
    zero = np.zeros(rows)
    return ContextOffsets(
        return_after=sum((np.asarray(item.reward, dtype=np.float64) for item in items[shard + 1:]), zero),
        energy_before=sum((np.asarray(item.energy, dtype=np.float64) for item in items[:shard]), zero),
        valid_before=sum((np.asarray(item.valid, dtype=np.int64) for item in items[:shard]), np.zeros(rows, np.int64)),
        length=sum((np.asarray(item.valid, dtype=np.int64) for item in items), np.zeros(rows, np.int64)),
        columns_before=int(sum(int(width) for width in widths[:shard])))


def context_shard_returns_and_energy(rewards: Any, response_mask: Any, log_probs: Any, sum_pi_squared: Any,
                                     offsets: ContextOffsets, *, is_weights: Any = None
                                     ) -> tuple[np.ndarray, np.ndarray]:
    """(Gₜ, Wₜ) [B, T_c] of a context shard: the local suffix and prefix scans plus the offsets of the others.

    Equal to the shard's columns of :func:`otb_spec.returns_to_go` and :func:`otb_spec.realized_energy` on the whole
    rows (masked positions included: G carries the next valid token's return, W the energy so far).
    """
    rewards64, mask, energy = _shard_inputs(rewards, response_mask, log_probs, sum_pi_squared, is_weights)
    returns = reward_to_go(rewards64, mask) + np.asarray(offsets.return_after, dtype=np.float64)[:, None]
    return returns, energy + np.asarray(offsets.energy_before, dtype=np.float64)[:, None]


# ----------------------------------------------------------------------------------------------------------------------
# Data parallel: group sums on the aligned grid


def _group_ids(group_ids: Any, rows: int, num_groups: Any) -> tuple[np.ndarray, int]:
    if isinstance(num_groups, bool) or not isinstance(num_groups, (int, np.integer)) or num_groups < 1:
        raise ValueError(f"num_groups: expected a positive integer, got {num_groups!r}")
    ids = check.to_numpy("group_ids", group_ids)
    if ids.ndim != 1 or ids.shape[0] != rows:
        raise ValueError(f"group_ids: expected {rows} integer ids (one per row), got shape {ids.shape}")
    if ids.dtype.kind not in "iu":
        raise TypeError(f"group_ids: expected global integer group ids in [0, num_groups), got dtype {ids.dtype}")
    if ids.size and (ids.min() < 0 or ids.max() >= num_groups):
        bad = int(np.flatnonzero((ids < 0) | (ids >= num_groups))[0])
        raise ValueError(f"group_ids: must lie in [0, {int(num_groups)}) (num_groups), found {int(ids[bad])} at "
                         f"index {bad}")
    return ids.astype(np.int64), int(num_groups)


def _columns(mask: np.ndarray, align: str, columns_before: int, valid_before: Any) -> np.ndarray:
    """[B, T_c] int64: the aligned column of every valid token of the shard (meaningless where m = 0)."""
    if align == "position":
        return np.broadcast_to(columns_before + np.arange(mask.shape[1], dtype=np.int64), mask.shape)
    before = np.zeros(mask.shape[0], np.int64) if valid_before is None else np.asarray(valid_before, dtype=np.int64)
    return valid_token_index(mask) + before[:, None]


def _checked_width(width: Any, columns: np.ndarray, mask: np.ndarray) -> int:
    if isinstance(width, bool) or not isinstance(width, (int, np.integer)) or width < 1:
        raise ValueError(f"width: expected a positive integer number of aligned columns, got {width!r}")
    valid = mask > 0
    if valid.any() and int(columns[valid].max()) >= width:
        raise ValueError(f"width: {int(width)} is too small for aligned column {int(columns[valid].max())}; use the "
                         "longest padded row length over all shards")
    return int(width)


def shard_group_totals(returns: Any, realized_energy: Any, response_mask: Any, group_ids: Any, *, num_groups: int,
                       width: int, align: str = "position", columns_before: int = 0,
                       valid_before: Any = None, leave_one_out: bool = False) -> GroupTotals:
    """This shard's terms of the group sums (N, D, V) on the [G, K] aligned grid (leave-one-out: of the weights
    W⁺ = max(W, 0), :func:`otb_spec._baseline.leave_one_out_energy`).

    Args:
      returns: [B, T_c] Gₜ of the shard's rows (whole-row returns: :func:`context_shard_returns_and_energy` for a
        context shard).
      realized_energy: [B, T_c] Wₜ.
      response_mask: [B, T_c] {0, 1}.
      group_ids: [B] global group ids in [0, num_groups).
      num_groups: G, the same on every shard.
      width: K, the same on every shard: at least every aligned column + 1.
      align: ``"position"`` or ``"valid_token"``.
      columns_before, valid_before: a context shard's offsets (:class:`ContextOffsets`); 0 / None otherwise.
      leave_one_out: the totals of the leave-one-out variant (the same on every shard).
    """
    shape = check.batch_shape("returns", returns)
    returns64 = check.float_array("returns", returns, shape=shape)
    energy = check.float_array("realized_energy", realized_energy, shape=shape, like="returns")
    leave_one_out = check.flag("leave_one_out", leave_one_out)
    if leave_one_out:
        energy = leave_one_out_energy(energy)
    mask = check.mask_array("response_mask", response_mask, shape, like="returns")
    ids, groups = _group_ids(group_ids, shape[0], num_groups)
    columns = _columns(mask, check.alignment(align), columns_before, valid_before)
    width = _checked_width(width, columns, mask)
    rows, cols = np.nonzero(mask)
    cells = ids[rows] * width + columns[rows, cols]
    size = groups * width

    def grid(values: np.ndarray) -> np.ndarray:
        return np.bincount(cells, weights=values, minlength=size).reshape(groups, width)

    weights = energy[rows, cols]
    return GroupTotals(grid(returns64[rows, cols] * weights), grid(weights),
                       np.bincount(cells, minlength=size).reshape(groups, width).astype(np.int64), leave_one_out)


def _same_shape_items(name: str, items: Sequence[Any], kind: type, hint: str) -> list[Any]:
    """The shards' partials as a list, each a ``kind`` whose fields all have the first one's shape."""
    items = list(items)
    if not items:
        raise ValueError(f"{name}: need at least one shard")
    shape = np.shape(items[0][0]) if isinstance(items[0], kind) else None
    for position, item in enumerate(items):
        if not isinstance(item, kind):
            raise TypeError(f"{name}[{position}]: expected {kind.__name__}, got {type(item).__name__}")
        if any(np.shape(getattr(item, field)) != shape for field in item._fields if field != "leave_one_out"):
            raise ValueError(f"{name}[{position}]: shape differs from {name}[0] ({shape}); {hint}")
    return items


def combine_group_totals(totals: Sequence[GroupTotals]) -> GroupTotals:
    """Σ over shards of their :class:`GroupTotals` (an all-reduce SUM)."""
    items = _same_shape_items("totals", totals, GroupTotals, "every shard must use the same num_groups and width")
    variants = {bool(item.leave_one_out) for item in items}
    if len(variants) > 1:
        raise ValueError("totals: some shards summed for leave-one-out and some not; pass the same leave_one_out to "
                         "shard_group_totals on every shard")
    return GroupTotals(*(np.sum([np.asarray(item[k]) for item in items], axis=0) for k in range(3)),
                       leave_one_out=variants.pop())


def shard_group_lengths(lengths: Any, group_ids: Any, *, num_groups: int, align: str = "position") -> GroupLengths:
    """This shard's :class:`GroupLengths` from its rows' whole-row valid-token counts [B] (for a context shard:
    ``ContextOffsets.length``; count each row once — on one shard of its context group)."""
    counts = check.to_numpy("lengths", lengths)
    if counts.ndim != 1 or counts.dtype.kind not in "iu" or (counts.size and counts.min() < 0):
        raise ValueError(f"lengths: expected a 1-D array of non-negative integer counts, got dtype {counts.dtype}, "
                         f"shape {counts.shape}")
    ids, groups = _group_ids(group_ids, counts.shape[0], num_groups)
    counts = counts.astype(np.int64)
    members = counts > 0 if check.alignment(align) == "valid_token" else np.ones(counts.shape, dtype=bool)
    member_count = np.bincount(ids[members], minlength=groups).astype(np.int64)
    longest = np.full(groups, -1, np.int64)
    np.maximum.at(longest, ids[members], counts[members])
    at_longest = members & (counts == longest[ids])
    count_longest = np.bincount(ids[at_longest], minlength=groups).astype(np.int64)
    second = np.full(groups, -1, np.int64)
    below = members & ~at_longest
    np.maximum.at(second, ids[below], counts[below])
    return GroupLengths(member_count, longest, count_longest, second)


def combine_group_lengths(lengths: Sequence[GroupLengths]) -> GroupLengths:
    """Merge shards' :class:`GroupLengths`: members add; L₁ = max L₁; the count at L₁ adds over the shards that reach
    it; the second largest is the largest of the shards' values below L₁ (their L₁ or their second)."""
    items = _same_shape_items("lengths", lengths, GroupLengths, "every shard must use the same num_groups")
    stacked = GroupLengths(*(np.stack([np.asarray(item[k], dtype=np.int64) for item in items]) for k in range(4)))
    longest = stacked.longest.max(axis=0)
    reaches = stacked.longest == longest
    count_longest = np.where(reaches, stacked.count_longest, 0).sum(axis=0)
    second = np.maximum(np.where(reaches, stacked.second, stacked.longest), -1).max(axis=0)
    return GroupLengths(stacked.members.sum(axis=0), longest, count_longest, second)


def shard_token_baseline(totals: GroupTotals, group_lengths: GroupLengths, returns: Any, realized_energy: Any,
                         response_mask: Any, group_ids: Any, lengths: Any, *, align: str = "position",
                         leave_one_out: bool = False, handle_zero_tail: bool | None = None,
                         epsilon: float = 1e-8, columns_before: int = 0, valid_before: Any = None
                         ) -> AdvantageResult:
    """The shard's rows' (advantages, returns, baselines) from the combined totals.

    Self-inclusive:  Bₜ = N_gk / (D_gk + ε), 0 where the group has fewer than two members or (``handle_zero_tail``)
    the row is its group's unique longest and k ≥ L₂.  Leave-one-out:  Bₜ = (N_gk − GₜWₜ⁺) / (D_gk − Wₜ⁺ + ε) with
    W⁺ = max(W, 0) (the totals too: ``shard_group_totals(..., leave_one_out=True)``), 0 where no other member is
    valid at k or D_gk − Wₜ⁺ ≤ 0.  Aₜ = (Gₜ − Bₜ)·mₜ.

    Args:
      totals, group_lengths: combined over every shard (:func:`combine_group_totals`, :func:`combine_group_lengths`).
      returns, realized_energy, response_mask, group_ids: this shard's, as :func:`shard_group_totals`.
      lengths: [B] whole-row valid-token counts.
      align, leave_one_out, handle_zero_tail, epsilon: as :func:`otb_spec.token_baseline`.
      columns_before, valid_before: a context shard's offsets.
    """
    shape = check.batch_shape("returns", returns)
    returns64 = check.float_array("returns", returns, shape=shape)
    energy = check.float_array("realized_energy", realized_energy, shape=shape, like="returns")
    mask = check.mask_array("response_mask", response_mask, shape, like="returns")
    groups, width = np.shape(totals.energy)
    ids, _ = _group_ids(group_ids, shape[0], groups)
    counts = np.asarray(lengths, dtype=np.int64)
    if counts.shape != (shape[0],):
        raise ValueError(f"lengths: expected {shape[0]} counts (one per row), got shape {counts.shape}")
    align = check.alignment(align)
    leave_one_out = check.flag("leave_one_out", leave_one_out)
    if bool(getattr(totals, "leave_one_out", False)) != leave_one_out:
        raise ValueError(f"totals: summed with leave_one_out={not leave_one_out}, but leave_one_out={leave_one_out} "
                         "here; pass the same leave_one_out to shard_group_totals, or build "
                         f"GroupTotals(..., leave_one_out={leave_one_out}) from totals of the weights "
                         f"{'max(W, 0)' if leave_one_out else 'W'}")
    zero_tail = check.zero_tail(handle_zero_tail, leave_one_out)
    epsilon = check.epsilon(epsilon)
    columns = _columns(mask, align, columns_before, valid_before)
    _checked_width(width, columns, mask)                    # a valid token beyond the grid: the totals do not fit
    columns = np.minimum(columns, width - 1)                # masked positions only
    numerator = totals.weighted_returns[ids[:, None], columns]
    denominator = totals.energy[ids[:, None], columns]
    if leave_one_out:
        own = leave_one_out_energy(energy) * mask
        baselines = safe_ratio(numerator - returns64 * own, others_denominator(denominator - own, epsilon))
        forced = totals.valid[ids[:, None], columns] - mask <= 0
    else:
        baselines = safe_ratio(numerator, denominator + epsilon)
        forced = np.broadcast_to((group_lengths.members[ids] < 2)[:, None], shape)
        if zero_tail:
            unique = (group_lengths.count_longest[ids] == 1) & (counts == group_lengths.longest[ids])
            forced = forced | (unique[:, None] & (columns >= group_lengths.second[ids][:, None]))
    baselines = np.where(forced, 0.0, baselines) * mask
    return AdvantageResult((returns64 - baselines) * mask, returns64, baselines)


# ----------------------------------------------------------------------------------------------------------------------
# The whole protocol in one process


def sharded_token_baseline(rewards: Any, response_mask: Any, group_ids: Any, log_probs: Any, sum_pi_squared: Any, *,
                           row_shards: Sequence[Any], column_cuts: Sequence[int] = (), is_weights: Any = None,
                           align: str = "position", leave_one_out: bool = False, handle_zero_tail: bool | None = None,
                           epsilon: float = 1e-8) -> list[list[AdvantageResult]]:
    """Run the distributed protocol for a given split of one batch, in one process; result[d][c] is what data shard
    d's context shard c returns for its rows (``row_shards[d]``) and columns.

    Args:
      rewards, response_mask, group_ids, log_probs, sum_pi_squared, is_weights: the whole batch, as
        :func:`otb_spec.optimal_token_baseline` (group ids of any kind: they are numbered globally here).
      row_shards: the rows of each data shard (index arrays; together a partition of 0 … B−1, any order, a shard may
        be empty of valid tokens but not of rows).
      column_cuts: the interior cut points 0 < t₁ < … < T of the context split (none: no context split).
      align, leave_one_out, handle_zero_tail, epsilon: as :func:`otb_spec.token_baseline`.

    Every [d][c] equals the matching block of the single-process result up to the order of summation. Finite rewards
    whose float64 sums Σᵢ GₜⁱWₜⁱ (or returns-to-go) overflow raise the single-process reference's ValueError naming
    them, instead of returning ±inf/NaN; finite importance weights whose ρ² makes the realized energy overflow, its
    error naming is_weights.
    """
    rewards64, mask64, _, token_energy, weights64 = validated_otb_inputs(rewards, response_mask, group_ids, log_probs,
                                                                         sum_pi_squared, is_weights)
    inputs = [np.asarray(check.to_numpy(name, value)) for name, value in (
        ("rewards", rewards), ("response_mask", response_mask), ("log_probs", log_probs),
        ("sum_pi_squared", sum_pi_squared), ("is_weights", 0.0 if is_weights is None else is_weights))]
    segments = group_segments(group_ids, inputs[0].shape[0])
    total_rows, total_columns = inputs[0].shape
    shards = [np.asarray(rows, dtype=np.int64).reshape(-1) for rows in row_shards]
    covered = np.sort(np.concatenate(shards)) if shards else np.zeros(0, np.int64)
    if any(rows.size == 0 for rows in shards) or not np.array_equal(covered, np.arange(total_rows)):
        raise ValueError(f"row_shards: expected non-empty index arrays that partition the {total_rows} rows")
    cuts = [0, *(int(cut) for cut in column_cuts), total_columns]
    if any(b <= a for a, b in zip(cuts, cuts[1:])):
        raise ValueError(f"column_cuts: expected increasing cut points strictly inside (0, {total_columns}), got "
                         f"{list(column_cuts)}")
    spans = list(zip(cuts, cuts[1:]))
    widths = [b - a for a, b in spans]
    options = dict(num_groups=segments.n_groups, align=check.alignment(align))

    with np.errstate(over="ignore"):                  # ρ² beyond float64 in the rows' energy: named as in one process
        _raise_if_weights_overflow(cumulative_energy(token_energy, mask64, weights64), mask64, weights64)
    with np.errstate(over="ignore", invalid="ignore"):       # sums beyond float64: raised below, as the reference does
        results = _protocol(inputs, is_weights, segments, shards, spans, widths, total_columns, options,
                            leave_one_out=leave_one_out, handle_zero_tail=handle_zero_tail, epsilon=epsilon)
    if not all(np.isfinite(array).all() for row in results for result in row for array in result):
        with np.errstate(over="ignore", invalid="ignore"):
            returns = reward_to_go(rewards64, mask64)
            energy = cumulative_energy(token_energy, mask64, weights64)
        raise _overflow_error("rewards", returns, energy, mask64)
    return results


def _protocol(inputs: list[np.ndarray], is_weights: Any, segments: Any, shards: list[np.ndarray],
              spans: list[tuple[int, int]], widths: list[int], total_columns: int, options: dict, *,
              leave_one_out: bool, handle_zero_tail: bool | None, epsilon: float) -> list[list[AdvantageResult]]:
    """:func:`sharded_token_baseline`'s protocol on validated inputs."""
    def piece(rows: np.ndarray, span: tuple[int, int]) -> tuple[list[np.ndarray], dict]:
        """A shard's (rewards, mask, log π, Σπ²) and its is_weights keyword."""
        r, m, lp, spp, w = (array[rows][:, span[0]:span[1]] if array.ndim == 2 else None for array in inputs)
        return [r, m, lp, spp], dict(is_weights=None if is_weights is None else w)

    shard_results = []                        # per data shard, per context shard: (G, W, m, offsets)
    for rows in shards:
        pieces = [piece(rows, span) for span in spans]
        totals = [context_shard_totals(*args, **weights) for args, weights in pieces]
        row = []
        for c, (args, weights) in enumerate(pieces):
            offsets = context_offsets(totals, widths, c)
            returns, energy = context_shard_returns_and_energy(*args, offsets, **weights)
            row.append((returns, energy, args[1], offsets))
        shard_results.append(row)
    group_totals = combine_group_totals([
        shard_group_totals(returns, energy, mask, segments.index[rows], width=total_columns,
                           columns_before=offsets.columns_before, valid_before=offsets.valid_before,
                           leave_one_out=leave_one_out, **options)
        for rows, row in zip(shards, shard_results) for returns, energy, mask, offsets in row])
    group_lengths = combine_group_lengths([                       # each row counted once: on its first context shard
        shard_group_lengths(row[0][3].length, segments.index[rows], **options)
        for rows, row in zip(shards, shard_results)])
    return [[shard_token_baseline(group_totals, group_lengths, returns, energy, mask, segments.index[rows],
                                  offsets.length, align=options["align"], leave_one_out=leave_one_out,
                                  handle_zero_tail=handle_zero_tail, epsilon=epsilon,
                                  columns_before=offsets.columns_before, valid_before=offsets.valid_before)
             for returns, energy, mask, offsets in row] for rows, row in zip(shards, shard_results)]
