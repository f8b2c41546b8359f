"""The OTB computation on tensors: static shapes, segment sums, no host synchronisation.

Mirrors ``otb_spec.otb`` (the math lives in the reference; this is its port), tuned for memory bandwidth:

* masking is a multiplication by the 0/1 mask (as in verl; the value checks guarantee finite inputs);
* group reductions are per-group, per-position numerator and denominator sums — ``index_add_`` in general, and a
  reshape [G, N, T] with broadcasting when the batch holds equal-size groups contiguously (verl's layout), which
  avoids materialising per-member copies of the group totals; a distributed version only all-reduces these sums;
* the rules that force the baseline to 0 (singleton groups, the zero tail) are reduced to one per-row position from
  which the baseline is zero, applied with a single comparison.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from otb_spec.groups import group_segments

__all__: list[str] = []


@dataclass(frozen=True)
class Segments:
    """Integer group segments on a device: ``index`` [B] int64 in [0, num_groups), every segment non-empty.

    ``group_size`` is set when the rows hold ``num_groups`` groups of that size contiguously, in order (then
    ``index`` = [0,…,0, 1,…,1, …]); the computation then uses reshapes instead of scatters.
    Build once per batch with :func:`segments_from_index` (the only step that touches the host).
    """

    index: torch.Tensor
    num_groups: int
    group_size: int | None = None

    def to(self, device: torch.device | str) -> "Segments":
        return Segments(self.index.to(device), self.num_groups, self.group_size)


def _contiguous_size(index: np.ndarray, num_groups: int) -> int | None:
    rows = index.shape[0]
    if num_groups == 0 or rows % num_groups:
        return None
    size = rows // num_groups
    return size if np.array_equal(index, np.repeat(np.arange(num_groups), size)) else None


def segments_from_index(index: Any, device: torch.device | str | None = None) -> Segments:
    """Map arbitrary group ids (a NumPy array of any hashable ids, a list, or an integer tensor) to segments.

    Uses the reference's :func:`otb_spec.group_segments` on the host (the partition verl's dict of ids builds), numbers
    the groups in order of first appearance, and copies the result to ``device`` once. An integer tensor is mapped with
    ``torch.unique`` on its own device (one synchronisation, for the number of groups).
    """
    if isinstance(index, Segments):
        return index if device is None else index.to(device)
    if isinstance(index, torch.Tensor):
        if index.dim() != 1:
            raise ValueError(f"index: expected a 1-D array of B ids, got shape {tuple(index.shape)}")
        if not (index.is_floating_point() or index.is_complex()):
            unique, inverse = torch.unique(index, return_inverse=True)
            inverse = inverse if device is None else inverse.to(device)
            return Segments(inverse.to(torch.int64), int(unique.numel()))
        index = index.detach().cpu().numpy()
    segments = group_segments(index if isinstance(index, np.ndarray) else np.asarray(index), name="index")
    _, first_rows = np.unique(segments.index, return_index=True)
    rank = np.empty(segments.n_groups, dtype=np.int64)
    rank[np.argsort(first_rows, kind="stable")] = np.arange(segments.n_groups)
    relabelled = rank[segments.index]
    return Segments(torch.as_tensor(relabelled, device=device), segments.n_groups,
                    _contiguous_size(relabelled, segments.n_groups))


def segment_sum(values: torch.Tensor, segments: Segments) -> torch.Tensor:
    """[B, ...] → [G, ...]: Σ over the members of each group."""
    out = torch.zeros((segments.num_groups,) + tuple(values.shape[1:]), dtype=values.dtype, device=values.device)
    return out.index_add_(0, segments.index, values)


class Layout:
    """How per-row arrays are grouped: [B, …] as is (scatter/gather), or viewed as [G, N, …] (reshape/broadcast)."""

    def __init__(self, segments: Segments):
        self.segments = segments
        self.grouped = segments.group_size is not None

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
        out = torch.zeros((self.segments.num_groups,) + tuple(values.shape[1:]), dtype=values.dtype,
                          device=values.device)
        return out.index_add_(0, self.segments.index, values)[self.segments.index]

    def group_max(self, values: torch.Tensor, fill: int) -> torch.Tensor:
        """Group maximum of per-row values ([B] or [G, N]), broadcastable against them."""
        if self.grouped:
            return values.amax(1, keepdim=True)
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
                   need_baselines: bool = True, out: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(advantages, baselines or None) from returns G and realized energy W (compute dtype, [B, T]).

    ``mask`` is 0/1 in the compute dtype. Aₜ = mₜ·(Gₜ − Bₜ·keepₜ) is formed in one fused pass (``addcmul``) on the
    aligned grid, then masked into ``out`` when given.
    """
    grid = Grid(mask, align)
    layout = Layout(segments)
    grid_returns = layout.view(grid.gather(returns))
    weights = layout.view(grid.gather(energy) * grid.valid)
    weighted_returns = grid_returns * weights
    numerator = layout.totals(weighted_returns)          # all-reduce these two to scale out
    denominator = layout.totals(weights)
    if leave_one_out:
        valid = layout.view(grid.valid)
        keep = ((layout.totals(valid) - valid) > 0).to(weights.dtype)
        group_baselines = safe_ratio(numerator - weighted_returns,
                                     (denominator - weights).clamp_(min=0.0).add_(epsilon))
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
