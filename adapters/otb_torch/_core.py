"""The OTB computation on tensors: static shapes, segment sums, no host synchronisation.

Mirrors ``otb_spec.otb`` (the math lives in the reference; this is its port), tuned for memory bandwidth:

* masking is a multiplication by the 0/1 mask (as in verl; the value checks guarantee finite inputs);
* group reductions are per-group, per-position numerator and denominator sums over a reshape [g, N, T] of whole
  groups of one size N, with the baseline broadcast back, which avoids materialising per-member copies of the group
  totals; any row order and any group sizes get there through the plan :func:`segments_from_index` makes (blocks of
  equal-size groups, gathered when their rows are not a slice), and segments without a plan through ``index_add_``;
  a distributed version only all-reduces these sums;
* the rules that force the baseline to 0 (singleton groups, the zero tail) are reduced to one per-row position from
  which the baseline is zero: a comparison over the batch (:func:`token_baseline`), or a fix-up of at most one row per
  group (:func:`zero_rule_fix`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import torch

from otb_spec.groups import first_appearance_labels, group_segments
from otb_spec.tolerances import DOMINANT_SHARE

__all__: list[str] = []


class Run(NamedTuple):
    """``count`` consecutive groups of ``size`` members in :attr:`Segments.order`, from position ``start``; their rows
    are ``first_row, first_row + 1, …`` of the batch when ``first_row ≥ 0`` (no gather needed), anywhere otherwise."""

    size: int
    count: int
    start: int
    first_row: int


@dataclass(frozen=True)
class Segments:
    """Integer group segments on a device: ``index`` [B] int64 in [0, num_groups), every segment non-empty.

    ``group_size`` is set when the rows hold ``num_groups`` groups of that size contiguously, in order (then
    ``index`` = [0,…,0, 1,…,1, …]); the computation then uses reshapes instead of scatters.

    ``order`` and ``runs`` are the plan for any other layout (rows in any order, groups of any sizes): ``order`` [B]
    lists the rows group by group — groups sorted by size, then by first appearance; members in batch order — and
    ``runs`` says where the groups of each size lie in it. On CPU the batch is then processed as blocks of whole
    groups of one size: gather a block's rows, run the reshape kernel on [groups, size, T], write its rows back.
    Build once per batch with :func:`segments_from_index` (the only step that touches the host); segments built
    by hand without a plan use segment sums (``index_add_``) instead, and a hand-built plan is checked against the
    batch on every call (a host synchronisation).

    On an accelerator each run of equal-size groups is a block, and on CUDA a plan with groups of several sizes runs
    as blocks of consecutive groups in the plan's order (one block up to 2²⁵ tokens) whose group sums are over
    consecutive rows (``torch.segment_reduce``: in PyTorch's CUDA code a loop over each group's rows per output
    element, no atomics), so a call's kernel launches do not grow with the number of distinct sizes. ``sizes`` [G]
    int64 holds the groups' sizes in the plan's order on the device, set by :func:`segments_from_index` and used only
    from its segments (``planned``); for a plan built by hand they are made from ``runs`` at each call (a
    host-to-device copy, after the plan's check against the batch).
    """

    index: torch.Tensor
    num_groups: int
    group_size: int | None = None
    order: torch.Tensor | None = None
    runs: tuple[Run, ...] | None = None
    planned: bool = field(default=False, repr=False, compare=False)   # made by segments_from_index: consistent
    sizes: torch.Tensor | None = field(default=None, repr=False, compare=False)   # [G]: the plan's sizes, in order

    def to(self, device: torch.device | str) -> "Segments":
        return Segments(self.index.to(device), self.num_groups, self.group_size,
                        None if self.order is None else self.order.to(device), self.runs, self.planned,
                        None if self.sizes is None else self.sizes.to(device))


def _contiguous_size(index: np.ndarray, num_groups: int) -> int | None:
    rows = index.shape[0]
    if num_groups == 0 or rows % num_groups:
        return None
    size = rows // num_groups
    return size if np.array_equal(index, np.repeat(np.arange(num_groups), size)) else None


def _plan(index: np.ndarray, num_groups: int) -> tuple[np.ndarray, tuple[Run, ...]]:
    """(order, runs) for groups numbered in order of first appearance (see :class:`Segments`)."""
    sizes = np.bincount(index, minlength=num_groups)
    by_size = np.argsort(sizes, kind="stable")                     # ties keep first-appearance order
    rank = np.empty(num_groups, dtype=np.int64)
    rank[by_size] = np.arange(num_groups)
    order = np.argsort(rank[index], kind="stable").astype(np.int64)
    sorted_sizes = sizes[by_size]
    edges = np.flatnonzero(np.diff(sorted_sizes)) + 1
    runs = []
    start = 0
    for first_group, stop_group in zip(np.concatenate(([0], edges)), np.concatenate((edges, [num_groups]))):
        size, count = int(sorted_sizes[first_group]), int(stop_group - first_group)
        rows = order[start:start + size * count]
        contiguous = bool(np.all(np.diff(rows) == 1))
        runs.append(Run(size, count, start, int(rows[0]) if contiguous else -1))
        start += size * count
    return order, tuple(runs)


def segments_from_index(index: Any, device: torch.device | str | None = None, *, name: str = "index") -> Segments:
    """Map arbitrary group ids (a NumPy array of any hashable ids, a list, or an integer tensor) to segments.

    Uses the reference's :func:`otb_spec.group_segments` on the host (the partition verl's dict of ids builds) — for
    strings (verl's uids) the same partition from one dict pass — numbers the groups in order of first appearance,
    plans the blocks (:class:`Segments`), and copies the result to ``device`` once. An integer tensor is mapped with
    ``torch.unique`` on its own device and planned on the host (one synchronisation). Errors name the argument
    ``name`` (verl's ``index`` by default; otb_torch's functions pass ``group_ids``).
    """
    if isinstance(index, Segments):
        return index if device is None else index.to(device)
    if isinstance(index, torch.Tensor):
        if index.dim() != 1:
            raise ValueError(f"{name}: expected a 1-D array of B ids, got shape {tuple(index.shape)}")
        if device is None:
            device = index.device
        if not (index.is_floating_point() or index.is_complex()):
            _, inverse = torch.unique(index, return_inverse=True)
            index = inverse.cpu().numpy()
        else:
            index = index.detach().cpu().numpy()
    ids = index if isinstance(index, np.ndarray) else np.asarray(index)
    relabelled = _string_labels(ids, name)
    if relabelled is None:
        segments = group_segments(ids, name=name)
        _, first_rows = np.unique(segments.index, return_index=True)
        rank = np.empty(segments.n_groups, dtype=np.int64)
        rank[np.argsort(first_rows, kind="stable")] = np.arange(segments.n_groups)
        relabelled = rank[segments.index]
    num_groups = int(relabelled.max()) + 1
    order, runs = _plan(relabelled, num_groups)
    return Segments(torch.as_tensor(relabelled, device=device), num_groups, _contiguous_size(relabelled, num_groups),
                    torch.as_tensor(order, device=device), runs, planned=True,
                    sizes=torch.as_tensor(plan_sizes(runs), device=device))


def plan_sizes(runs: tuple[Run, ...]) -> np.ndarray:
    """[G] int64: the groups' sizes in the plan's order (each run's size, once per group of the run)."""
    return np.repeat(np.array([run.size for run in runs], dtype=np.int64), [run.count for run in runs])


def _string_labels(ids: np.ndarray, name: str = "index") -> np.ndarray | None:
    """Group labels in order of first appearance for a non-empty 1-D array of strings (verl's uids: an object array of
    str), from one dict pass — the partition :func:`otb_spec.group_segments` finds by sorting, for strings, where
    equality and order agree; None for any other array (the reference then plans it)."""
    if ids.ndim != 1 or ids.shape[0] == 0 or ids.dtype.kind not in "OUS":
        return None
    keys = ids.tolist()
    if ids.dtype.kind == "O" and not all(type(key) is str for key in keys):
        return None
    return first_appearance_labels(keys, name)


def segment_sum(values: torch.Tensor, segments: Segments) -> torch.Tensor:
    """[B, ...] → [G, ...]: Σ over the members of each group."""
    out = torch.zeros((segments.num_groups,) + tuple(values.shape[1:]), dtype=values.dtype, device=values.device)
    return out.index_add_(0, segments.index, values)


def consecutive_reduce(values: torch.Tensor, sizes: torch.Tensor, reduce: str) -> torch.Tensor:
    """[B, …] rows sorted by group → [G, …]: the ``reduce`` ("sum" or "max") of each group's ``sizes[g]`` consecutive
    rows, in row order (``torch.segment_reduce``, unchecked: the caller's sizes add up to B, each ≥ 1). Integers go
    through float64, exact below 2⁵³ (segment_reduce takes floating point only)."""
    if values.is_floating_point():
        return torch.segment_reduce(values, reduce, lengths=sizes, axis=0, unsafe=True)
    reduced = torch.segment_reduce(values.to(torch.float64), reduce, lengths=sizes, axis=0, unsafe=True)
    return reduced.to(values.dtype)


class Layout:
    """How per-row arrays are grouped: [B, …] as is (scatter/gather), or viewed as [G, N, …] (reshape/broadcast).

    ``sizes`` (rows sorted by group, ``index`` their group, numbered in order): group reductions over consecutive
    rows (:func:`consecutive_reduce`) instead of scatters."""

    def __init__(self, segments: Segments, sizes: torch.Tensor | None = None):
        self.segments = segments
        self.grouped = segments.group_size is not None
        self.sizes = None if self.grouped else sizes

    def view(self, values: torch.Tensor) -> torch.Tensor:
        """[B, …] → the layout ([B, …] or [G, N, …])."""
        if self.grouped:
            return values.reshape((self.segments.num_groups, self.segments.group_size) + tuple(values.shape[1:]))
        return values

    def unview(self, values: torch.Tensor) -> torch.Tensor:
        """The layout → [B, …]."""
        return values.reshape((-1,) + tuple(values.shape[2:])) if self.grouped else values

    def totals(self, values: torch.Tensor) -> torch.Tensor:
        """Group totals, broadcastable against ``values`` in the layout (materialised per row in general)."""
        if self.grouped:
            return values.sum(1, keepdim=True)
        if self.sizes is not None:
            return consecutive_reduce(values, self.sizes, "sum").index_select(0, self.segments.index)
        out = torch.zeros((self.segments.num_groups,) + tuple(values.shape[1:]), dtype=values.dtype,
                          device=values.device)
        return out.index_add_(0, self.segments.index, values)[self.segments.index]

    def group_max(self, values: torch.Tensor, fill: int) -> torch.Tensor:
        """Group maximum of per-row values ([B] or [G, N]), broadcastable against them."""
        if self.grouped:
            return values.amax(1, keepdim=True)
        if self.sizes is not None:
            return consecutive_reduce(values, self.sizes, "max").index_select(0, self.segments.index)
        out = torch.full((self.segments.num_groups,), fill, dtype=values.dtype, device=values.device)
        return out.scatter_reduce_(0, self.segments.index, values, reduce="amax", include_self=True)[
            self.segments.index]


def reward_to_go(rewards: torch.Tensor, mask: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Gₜ = Σ_{k≥t} mₖrₖ, as the row total minus the exclusive prefix (covered by the reference's error bound),
    written into ``out`` when given."""
    masked = rewards * mask
    prefix = torch.cumsum(masked, -1)
    return torch.sub(prefix[:, -1:], prefix, out=out).add_(masked)


def token_energy(log_probs: torch.Tensor, sum_pi_squared: torch.Tensor, mask: torch.Tensor | None = None
                 ) -> torch.Tensor:
    """wₜ = 1 − 2πₜ + Σπ²ₜ with π = exp(min(log π, 0)) (the clamp keeps junk at masked positions finite); with a
    ``mask``, mₜwₜ = mₜ + mₜ(Σπ²ₜ − 2πₜ), in two passes instead of the three of w·m."""
    pi = torch.clamp(log_probs, max=0.0).exp_()
    if mask is None:
        return (sum_pi_squared + 1.0).sub_(pi, alpha=2.0)
    return torch.addcmul(mask, torch.sub(sum_pi_squared, pi, alpha=2.0), mask)


def realized_energy(energy: torch.Tensor, mask: torch.Tensor | None, is_weights: torch.Tensor | None
                    ) -> torch.Tensor:
    """Wₜ = Σ_{j≤t} mⱼρⱼ²wⱼ (``mask`` None: ``energy`` is already mⱼwⱼ)."""
    per_token = energy if mask is None else energy * mask
    if is_weights is not None:
        per_token = per_token * is_weights
        per_token.mul_(is_weights)
    return torch.cumsum(per_token, -1)


class Grid:
    """The aligned layout [B, T]: column k is "token k" of every member (absolute, or the k-th valid token)."""

    def __init__(self, mask: torch.Tensor, align: str):
        self.mask = mask
        self.align = align
        self.lengths = mask.sum(-1).to(torch.int64)
        self.positions = torch.arange(mask.shape[1], device=mask.device)
        if align == "position":
            self.valid = mask
            self.members = torch.ones(mask.shape[0], dtype=torch.bool, device=mask.device)
        else:
            self.index = torch.clamp(torch.cumsum(mask.to(torch.int64), -1) - 1, min=0)   # compacted index
            self.valid = (self.positions[None, :] < self.lengths[:, None]).to(mask.dtype)
            self.members = self.lengths > 0

    def gather(self, values: torch.Tensor) -> torch.Tensor:
        """[B, T] → grid [B, T]."""
        if self.align == "position":
            return values
        return torch.zeros_like(values).scatter_add_(1, self.index, values * self.mask)

    def scatter(self, grid: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """grid [B, T] → [B, T], 0 at masked positions (written into ``out`` when given)."""
        values = grid if self.align == "position" else grid.gather(1, self.index)
        return torch.mul(values, self.mask, out=out)


def leave_one_out_energy(energy: torch.Tensor) -> torch.Tensor:
    """W⁺ = max(W, 0), a member's leave-one-out weight (:func:`otb_spec._baseline.leave_one_out_energy`; a NaN stays
    NaN)."""
    return energy.clamp(min=0.0)


def others_denominator(others: torch.Tensor, epsilon: float) -> torch.Tensor:
    """Leave-one-out: Dᵢ + ε where the other members' energy Dᵢ is positive, 0 (B = 0 by :func:`safe_ratio`) where
    not, in place (:func:`otb_spec._baseline.others_denominator`; a NaN stays NaN)."""
    return others.masked_fill_(others <= 0, -epsilon).add_(epsilon)


def others_sums(weighted: torch.Tensor, weights: torch.Tensor, numerator: torch.Tensor, denominator: torch.Tensor,
                totals: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Leave-one-out: (Nᵢ, Dᵢ) = (Σ_{j≠i} GⱼWⱼmⱼ, Σ_{j≠i} Wⱼmⱼ) per member, from its terms and the group totals N, D
    (broadcastable against them; ``totals`` sums per-member values into such totals). Overwrites ``weighted`` and
    ``weights`` (a dominant member's own terms become 0).

    N − GᵢWᵢ and D − Wᵢ lose a few ulps of D, nothing against Dᵢ ≥ D/4 where Wᵢ ≤ ¾D. A member with Wᵢ > ¾D (at
    most one per column: two would make D > 1.5·D even after rounding) takes the sums of the others, added directly:
    with one member's energy far above the rest (a forced opening where one member sampled another token), D − Wᵢ
    cancels in float32 to rounding noise of either sign and the baseline left the range of the returns (proofs/N1
    item 5). The weights are W⁺ ≥ 0; a NaN stays NaN. Extra memory: a boolean per element and one sum of per-member
    size at a time (none with whole groups, whose sums broadcast)."""
    dominant = weights > DOMINANT_SHARE * denominator
    others_numerator = numerator - weighted
    others_denominator_ = denominator - weights
    weighted.masked_fill_(dominant, 0.0)          # what is left of each column without its dominant member
    weights.masked_fill_(dominant, 0.0)
    torch.where(dominant, totals(weighted), others_numerator, out=others_numerator)
    torch.where(dominant, totals(weights), others_denominator_, out=others_denominator_)
    return others_numerator, others_denominator_


def safe_ratio(numerator: torch.Tensor, denominator: torch.Tensor) -> torch.Tensor:
    """numerator/denominator, 0 where the denominator is 0 (only possible with ε = 0)."""
    zero = denominator == 0
    return (numerator / denominator.masked_fill(zero, 1.0)).masked_fill_(zero, 0.0)


def zero_from(grid: Grid, layout: Layout, handle_zero_tail: bool) -> torch.Tensor:
    """Per row, the first aligned position where the self-inclusive baseline is 0 by rule (in the layout's shape):
    0 for rows of singleton groups, the second-longest length for the unique longest member (zero tail), T otherwise.
    """
    lengths, members = layout.view(grid.lengths), layout.view(grid.members)
    width = grid.positions.shape[0]
    count = layout.totals(members.to(torch.int64))
    start = torch.where(count < 2, torch.zeros_like(lengths), torch.full_like(lengths, width))
    if not handle_zero_tail:
        return start
    minus_one = torch.full_like(lengths, -1)
    longest = layout.group_max(torch.where(members, lengths, minus_one), -1)
    at_longest = members & (lengths == longest)
    unique = at_longest & (layout.totals(at_longest.to(torch.int64)) == 1) & (count >= 2)
    second = layout.group_max(torch.where(members & ~at_longest, lengths, minus_one), -1)
    return torch.where(unique, second, start)


_EXACT_INTEGERS = {torch.float32: 2**24, torch.float64: 2**53}    # every integer up to here is representable


def token_baseline(returns: torch.Tensor, energy: torch.Tensor, mask: torch.Tensor, segments: Segments, *,
                   align: str, leave_one_out: bool, handle_zero_tail: bool, epsilon: float,
                   need_baselines: bool = True, out: torch.Tensor | None = None,
                   sorted_sizes: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(advantages, baselines or None) from returns G and realized energy W (compute dtype, [B, T]).

    ``mask`` is 0/1 in the compute dtype. Aₜ = mₜ·(Gₜ − Bₜ·keepₜ) is formed in one fused pass (``addcmul``) on the
    aligned grid, then masked into ``out`` when given. ``sorted_sizes``: the rows are sorted by group, of these sizes
    (:class:`Layout`).
    """
    grid = Grid(mask, align)
    layout = Layout(segments, sorted_sizes)
    grid_returns = layout.view(grid.gather(returns))
    weights = layout.view(grid.gather(leave_one_out_energy(energy) if leave_one_out else energy) * grid.valid)
    weighted_returns = grid_returns * weights
    numerator = layout.totals(weighted_returns)          # all-reduce these two to scale out
    denominator = layout.totals(weights)
    if leave_one_out:
        valid = layout.view(grid.valid)
        keep = ((layout.totals(valid) - valid) > 0).to(weights.dtype)
        others_n, others_d = others_sums(weighted_returns, weights, numerator, denominator, layout.totals)
        group_baselines = safe_ratio(others_n, others_denominator(others_d, epsilon))
    else:
        start = zero_from(grid, layout, handle_zero_tail)
        if grid.positions.shape[0] <= _EXACT_INTEGERS.get(weights.dtype, 0):
            # keepₜ = 1[t < start] as clamp(start − t, 0, 1), exact while positions are exact in the compute dtype
            # (comparisons producing bool tensors are several times slower on CPU)
            keep = (start.unsqueeze(-1).to(weights.dtype) - grid.positions.to(weights.dtype)).clamp_(0.0, 1.0)
        else:
            keep = (grid.positions < start.unsqueeze(-1)).to(weights.dtype)
        group_baselines = safe_ratio(numerator, denominator + epsilon)
    baselines = None
    if need_baselines:
        baselines = grid.scatter(layout.unview(group_baselines * keep))
    grid_advantages = layout.unview(torch.addcmul(grid_returns, group_baselines, keep, value=-1.0))
    return grid.scatter(grid_advantages, out=out), baselines


def grouped_otb(rewards: torch.Tensor, mask: torch.Tensor, log_probs: torch.Tensor, sum_pi_squared: torch.Tensor,
                is_weights: torch.Tensor | None, num_groups: int, group_size: int, *, align: str, epsilon: float,
                check: bool, need_baselines: bool, workspace: tuple[torch.Tensor, ...] = (),
                outputs: tuple[torch.Tensor, ...] = (), lengths: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, tuple[torch.Tensor, ...]]:
    """Self-inclusive OTB on whole groups of one size N, before the rules that zero the baseline (see
    :func:`zero_rule_fix`): the rows are [g·N, T], group k in rows kN … kN+N−1, inputs in the compute dtype.

    Gₜ = Σ_{k≥t} mₖrₖ,  Wₜ = Σ_{j≤t} mⱼρⱼ²(1 − 2πⱼ + Σπ²ⱼ),  Bₜ = Σᵢ GᵢₜWᵢₜ / (Σᵢ Wᵢₜ + ε)  over the members' aligned
    token t (``align="position"``: the position; ``"valid_token"``: the t-th valid token, found as column
    Σ_{j≤t} mⱼ − 1 of a grid [rows, T + 1] whose last column takes the masked positions), and Aₜ = mₜ(Gₜ − Bₜ),
    with B = 0 for N = 1. The same math as :func:`token_baseline`, in fewer passes: group sums are sums over N of a
    [g, N, T] view, and the baseline is broadcast from [g, T]. In eager mode every full-size temporary lives in
    ``workspace`` (:func:`grouped_workspace`) and the results go into ``outputs`` = (advantages, returns[,
    baselines]), so no block allocates (fresh memory costs a page fault per 4 KiB on CPU); without them (as compiled,
    where allocation is the compiler's business) everything is allocated.

    Returns (advantages, returns, baselines or None, reductions), and writes each row's number of valid tokens into
    ``lengths`` [g·N] when given. With ``check``, ``reductions`` are what :func:`value_problems` turns into the
    reference's value rules, computed on the way while the block is in cache; otherwise ().
    """
    g, n = num_groups, group_size
    width = rewards.shape[1]
    first, second, third, column_buffer, grid_buffer = tuple(workspace) + (None,) * (5 - len(workspace))
    advantages, returns, baselines = tuple(outputs) + (None,) * (3 - len(outputs))
    masked_rewards = torch.mul(rewards, mask, out=first)
    prefix = torch.cumsum(masked_rewards, -1, out=second)
    G = torch.sub(prefix.narrow(1, width - 1, 1), prefix, out=returns).add_(masked_rewards)   # total − exclusive prefix
    if lengths is not None:
        torch.sum(mask, -1, out=lengths)
    reductions: tuple[torch.Tensor, ...] = ()
    need_energy = n > 1 or need_baselines
    if check:
        # log π·m: NaN or ±inf anywhere leave NaN or ±inf in its min/max, and masked positions become 0 (and so do
        # those of Σπ²·m); the reward row totals are NaN or ±inf if any reward is
        reward_totals = prefix.narrow(1, width - 1, 1).sum()
        pi = torch.mul(log_probs, mask, out=first)
        lp_low, lp_high = torch.aminmax(pi)
        pi.clamp_(max=0.0).exp_()                                                        # π (1 at masked positions)
        spp = torch.mul(sum_pi_squared, mask, out=second)
        spp_low, spp_high = torch.aminmax(spp)
        squares = torch.mul(pi, pi, out=third)
        own = torch.addcmul(spp, squares, mask, value=-1.0, out=squares).amin()            # min m(Σπ² − π²)
        flips = torch.addcmul(mask, mask, mask, value=-1.0, out=squares)                   # m − m² = 0 iff m ∈ {0, 1}
        flip_low, flip_high = torch.aminmax(flips)
        reductions = (reward_totals, lp_low, lp_high, spp_low, spp_high, own, flip_low, flip_high)
        if is_weights is not None:
            reductions += tuple(torch.aminmax(is_weights))
        if need_energy:
            energy = spp.add_(mask).addcmul_(pi, mask, value=-2.0)                        # m(1 − 2π + Σπ²)
    elif need_energy:
        pi = torch.clamp(log_probs, max=0.0, out=first).exp_()       # the clamp keeps junk at masked positions finite
        energy = torch.sub(sum_pi_squared, pi, alpha=2.0, out=second)
        energy = torch.addcmul(mask, energy, mask, out=energy)                          # m(1 − 2π + Σπ²)
    if n == 1:                                                                           # singletons: B = 0
        advantages = torch.mul(G, mask, out=advantages)
        if need_baselines:
            baselines = torch.zeros_like(G) if baselines is None else baselines.zero_()
        return advantages, G, baselines, reductions
    if is_weights is not None:
        energy.mul_(is_weights).mul_(is_weights)
    weights = energy.cumsum_(-1).mul_(mask)                                              # mₜWₜ
    weighted = torch.mul(G, weights, out=pi)
    if align == "position":
        numerator = weighted.view(g, n, width).sum(1)
        denominator = weights.view(g, n, width).sum(1)
    else:
        column = torch.cumsum(mask, -1, out=third).sub_(1.0 + width).mul_(mask).add_(width)
        column = column.to(torch.int64) if column_buffer is None else column_buffer.copy_(column)
        grid = (torch.zeros((g * n, width + 1), dtype=G.dtype, device=G.device) if grid_buffer is None
                else grid_buffer.zero_())                                                # [g·N, T + 1]
        numerator = grid.scatter_(1, column, weighted).view(g, n, width + 1).sum(1)
        # the second scatter overwrites every entry the first one wrote
        denominator = grid.scatter_(1, column, weights).view(g, n, width + 1).sum(1)
    group_baselines = safe_ratio(numerator, denominator.add_(epsilon)).unsqueeze(1)      # [g, 1, T(+1)]
    if align != "position":
        group_baselines = torch.gather(group_baselines.expand(g, n, width + 1), 2, column.view(g, n, width),
                                       out=None if third is None else third.view(g, n, width))
    shaped = (g, n, width)
    advantages = torch.sub(G.view(shaped), group_baselines, out=None if advantages is None else advantages.view(shaped)
                           ).mul_(mask.view(shaped)).view(g * n, width)
    if need_baselines:
        baselines = torch.mul(group_baselines, mask.view(shaped), out=None if baselines is None else baselines.view(
            shaped)).view(g * n, width)
    return advantages, G, baselines, reductions


def grouped_workspace(rows: int, width: int, align: str, dtype: torch.dtype, device: torch.device
                      ) -> tuple[torch.Tensor, ...]:
    """Temporaries for :func:`grouped_otb` on blocks of up to ``rows`` rows (use the first rows of each)."""
    buffers = [torch.empty((rows, width), dtype=dtype, device=device) for _ in range(3)]
    if align != "position":
        buffers += [torch.empty((rows, width), dtype=torch.int64, device=device),
                    torch.empty((rows, width + 1), dtype=dtype, device=device)]
    return tuple(buffers)


def value_problems(reductions: list[tuple[torch.Tensor, ...]], slacks: tuple[float, float]) -> torch.Tensor:
    """True (0-dim, on the device) if the reductions of :func:`grouped_otb` show a possible value problem: a non-finite
    input, a mask value outside {0, 1}, log π > slack, Σπ² outside [−slack, 1 + slack] or Σπ² < π² − slack at a
    valid position, or ρ < 0. Every input the reference rejects is flagged; a few it accepts may be too (finite
    rewards or energies whose row sums overflow), so a flag calls for the exact check before any error.
    """
    slack_lp, slack_spp = slacks
    stacked = [torch.stack(column) for column in zip(*reductions)]
    reward_totals, lp_low, lp_high, spp_low, spp_high, own, flip_low, flip_high = stacked[:8]
    largest = torch.finfo(reward_totals.dtype).max
    excess = [reward_totals.abs() - largest, lp_low.abs() - largest, lp_high - slack_lp, -slack_spp - spp_low,
              spp_high - (1.0 + slack_spp), -(slack_spp + 2.0 * slack_lp) - own, flip_low.abs(), flip_high.abs()]
    if len(stacked) > 8:                                                                 # ρ: finite and ≥ 0
        excess += [-stacked[8], stacked[9].abs() - largest]
    return ~(torch.cat(excess) <= 0).all()                              # NaN compares false: flagged


def zero_rule_fix(lengths: torch.Tensor, size: int, count: int, *, align: str, handle_zero_tail: bool, width: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Where the rules zero the self-inclusive baseline, for ``count`` groups of ``size`` members whose valid-token
    counts are ``lengths`` [count·size]: per group (member, start) — the baseline of that member is 0 from aligned
    token ``start`` on (``start`` = ``width``: nowhere).

    The rules (``otb_spec.otb``): a group with fewer than two members (``align="valid_token"``: rows with no valid
    token are not members) has no baseline — its only member, the longest, from 0; with ``handle_zero_tail``, the
    unique longest member has none from the second-longest length on. At most one member per group is affected.
    """
    lengths = lengths.view(count, size)
    longest, member = lengths.max(1)
    at_longest = lengths == longest[:, None]
    unique = at_longest.sum(1) == 1
    never = torch.full_like(longest, float(width))
    if handle_zero_tail:
        second = torch.where(at_longest, torch.full_like(lengths, -1.0), lengths).amax(1)
        start = torch.where(unique, second, never)
    else:
        start = never
    if align != "position":
        start = torch.where((lengths > 0).sum(1) < 2, torch.zeros_like(start), start)
    return member, start
