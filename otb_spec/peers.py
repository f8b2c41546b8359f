"""Peer baselines, for comparison with OTB: REINFORCE, GRPO / group mean, RLOO, OPO, sequence-level optimal.

Sequence-level estimators give every token of trajectory i the same advantage, built from the sequence return

    Rᵢ = Σₜ mₜⁱ rₜⁱ            (the masked sum of the token rewards)

and a baseline bᵢ computed from the members of i's prompt group. They are all instances of the weighted group mean

    bᵢ = Σⱼ cⱼRⱼ / Σⱼ cⱼ        over j ∈ group(i)          (self-inclusive), or over j ∈ group(i), j ≠ i (leave-one-out)

with weights cⱼ = 1 (GRPO's group mean; RLOO is its leave-one-out form), cⱼ = Lⱼ the number of valid tokens (OPO), or
cⱼ = ‖∇θ log π(τⱼ)‖² (the classic optimal constant baseline E[‖S‖²R]/E[‖S‖²], estimated in the group).

Conventions (docs/verl-differences.md compares them with verl):

* singleton groups — and, for leave-one-out, groups with no other member — get baseline 0 (advantage = Rᵢ);
* a zero weight total (all Lⱼ = 0, all norms 0) gives baseline 0, never NaN;
* GRPO with ``normalize_by_std`` divides by (σ + ε) with σ the Bessel-corrected (N − 1) standard deviation of R in
  the group and ε = 1e-6, as verl's ``compute_grpo_outcome_advantage``; singleton groups use μ = 0, σ = 1.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from otb_spec import _validation as check
from otb_spec.groups import Segments, group_segments, segment_sums
from otb_spec.otb import AdvantageResult
from otb_spec.trajectory import reward_to_go

__all__ = [
    "reinforce_advantage",
    "group_mean_advantage",
    "rloo_advantage",
    "opo_advantage",
    "sequence_optimal_advantage",
    "sequence_returns",
]


def reinforce_advantage(rewards: Any, response_mask: Any, *, gamma: float = 1.0) -> AdvantageResult:
    """No baseline (REINFORCE with reward-to-go): Aₜ = Gₜ·mₜ.

    Uses the token-level return Gₜ (as OTB does), so REINFORCE and OTB differ only by the baseline.

    >>> reinforce_advantage([[0, 1, 2]], [[1, 1, 0]]).advantages.tolist()
    [[1.0, 1.0, 0.0]]
    """
    shape = check.batch_shape("rewards", rewards)
    rewards64 = check.float_array("rewards", rewards, shape=shape)
    mask = check.mask_array("response_mask", response_mask, shape, like="rewards")
    gamma = check.scalar("gamma", gamma, minimum=0.0, maximum=1.0, min_inclusive=False)
    returns = reward_to_go(rewards64, mask, gamma)
    return AdvantageResult(advantages=returns * mask, returns=returns, baselines=np.zeros(shape))


def sequence_returns(rewards: Any, response_mask: Any) -> np.ndarray:
    """Rᵢ = Σₜ mₜⁱ rₜⁱ: [B, T] → [B] float64 (rewards outside the mask do not count)."""
    shape = check.batch_shape("rewards", rewards)
    rewards64 = check.float_array("rewards", rewards, shape=shape)
    mask = check.mask_array("response_mask", response_mask, shape, like="rewards")
    return np.sum(rewards64 * mask, axis=-1)


def group_mean_advantage(
    rewards: Any,
    response_mask: Any,
    group_ids: Any,
    *,
    normalize_by_std: bool = False,
    epsilon: float = 1e-6,
) -> AdvantageResult:
    """GRPO: Aᵢ = (Rᵢ − μ_g)·mₜ, or (Rᵢ − μ_g)/(σ_g + ε)·mₜ with ``normalize_by_std`` (the original GRPO).

    μ_g is the self-inclusive group mean; σ_g the Bessel-corrected standard deviation. Without the std this is the
    Dr. GRPO advantage. The self-inclusive mean makes E[ĝ] = (1 − 1/N)·∇J (proofs/T3_unbiasedness.md).

    >>> group_mean_advantage([[1.0], [0.0], [5.0]], [[1], [1], [1]], ["a", "a", "b"]).advantages.tolist()
    [[0.5], [-0.5], [5.0]]
    """
    shape, R, mask, segments = _sequence_inputs(rewards, response_mask, group_ids)
    normalize_by_std = check.flag("normalize_by_std", normalize_by_std)
    epsilon = check.epsilon(epsilon)
    baseline = weighted_group_baseline(R, np.ones_like(R), segments, leave_one_out=False)
    scale = np.ones_like(R)
    if normalize_by_std:
        scale = group_std(R, segments) + epsilon
    return _broadcast(R, baseline, mask, scale)


def rloo_advantage(rewards: Any, response_mask: Any, group_ids: Any) -> AdvantageResult:
    """RLOO: Aᵢ = (Rᵢ − mean_{j≠i} Rⱼ)·mₜ — the leave-one-out group mean (unbiased). Singleton → baseline 0.

    >>> rloo_advantage([[1.0], [0.0], [2.0]], [[1], [1], [1]], [0, 0, 0]).advantages.tolist()
    [[0.0], [-1.5], [1.5]]
    """
    shape, R, mask, segments = _sequence_inputs(rewards, response_mask, group_ids)
    baseline = weighted_group_baseline(R, np.ones_like(R), segments, leave_one_out=True)
    return _broadcast(R, baseline, mask, np.ones_like(R))


def opo_advantage(rewards: Any, response_mask: Any, group_ids: Any, *, leave_one_out: bool = False) -> AdvantageResult:
    """OPO (length-weighted baseline): bᵢ = Σⱼ LⱼRⱼ / Σⱼ Lⱼ, Lⱼ = number of valid tokens of trajectory j.

    The optimal constant baseline when ‖∇θ log π(τ)‖² is proportional to the length (Hao et al. 2025,
    arXiv 2505.23585; verl ``compute_opo_outcome_advantage``). ``leave_one_out`` sums over j ≠ i instead.

    >>> opo_advantage([[0, 1.0], [2.0, 0]], [[1, 1], [1, 0]], ["p", "p"]).advantages.round(6).tolist()
    [[-0.333333, -0.333333], [0.666667, 0.0]]
    """
    shape, R, mask, segments = _sequence_inputs(rewards, response_mask, group_ids)
    lengths = mask.sum(axis=-1)
    baseline = weighted_group_baseline(R, lengths, segments, leave_one_out=check.flag("leave_one_out", leave_one_out))
    return _broadcast(R, baseline, mask, np.ones_like(R))


def sequence_optimal_advantage(
    rewards: Any,
    response_mask: Any,
    group_ids: Any,
    sequence_score_sq_norms: Any,
    *,
    leave_one_out: bool = False,
) -> AdvantageResult:
    """Sequence-level optimal baseline  bᵢ = Σⱼ‖S(τⱼ)‖²Rⱼ / Σⱼ‖S(τⱼ)‖²  from exact per-trajectory score norms.

    ‖S(τ)‖² = ‖∇θ log π(τ)‖² is the squared norm of the whole trajectory's score; b* = E[‖S‖²R]/E[‖S‖²] is the
    variance-minimising constant baseline (proofs/T4_classic_optimal_baseline.md). This is its in-group estimate.

    Args:
      rewards, response_mask, group_ids: as the other peers.
      sequence_score_sq_norms: [B] ‖S(τᵢ)‖² ≥ 0.
      leave_one_out: sum over the other members only (unbiased).
    """
    shape, R, mask, segments = _sequence_inputs(rewards, response_mask, group_ids)
    norms = check.float_array("sequence_score_sq_norms", sequence_score_sq_norms, shape=(shape[0],), like="[B]")
    check.nonnegative("sequence_score_sq_norms", norms)
    baseline = weighted_group_baseline(R, norms, segments, leave_one_out=check.flag("leave_one_out", leave_one_out))
    return _broadcast(R, baseline, mask, np.ones_like(R))


# ----------------------------------------------------------------------------------------------------------------------


def _sequence_inputs(rewards: Any, response_mask: Any, group_ids: Any
                     ) -> tuple[tuple[int, int], np.ndarray, np.ndarray, Segments]:
    shape = check.batch_shape("rewards", rewards)
    rewards64 = check.float_array("rewards", rewards, shape=shape)
    mask = check.mask_array("response_mask", response_mask, shape, like="rewards")
    segments = group_segments(group_ids, shape[0])
    return shape, np.sum(rewards64 * mask, axis=-1), mask, segments


def weighted_group_baseline(values: np.ndarray, weights: np.ndarray, segments: Segments, *,
                            leave_one_out: bool) -> np.ndarray:
    """bᵢ = Σⱼ cⱼxⱼ / Σⱼ cⱼ over i's group (j ≠ i with ``leave_one_out``); 0 for singletons and zero weight totals.

    values, weights: [B] float64. Returns [B] float64.
    """
    numerator = segment_sums(weights * values, segments)[segments.index]
    denominator = segment_sums(weights, segments)[segments.index]
    members = segments.sizes[segments.index]
    if leave_one_out:
        numerator = numerator - weights * values
        denominator = np.maximum(denominator - weights, 0.0)
        members = members - 1
    out = np.zeros_like(values)
    usable = (denominator > 0) & (members >= (1 if leave_one_out else 2))
    np.divide(numerator, denominator, out=out, where=usable)
    return out


def group_std(values: np.ndarray, segments: Segments) -> np.ndarray:
    """Bessel-corrected standard deviation of ``values`` in each member's group, per member; 1 for singletons."""
    sizes = segments.sizes[segments.index].astype(np.float64)
    mean = segment_sums(values, segments)[segments.index] / sizes
    squares = segment_sums(np.square(values - mean), segments)[segments.index]
    std = np.ones_like(values)
    np.sqrt(squares / np.maximum(sizes - 1.0, 1.0), out=std, where=sizes > 1)
    return std


def _broadcast(R: np.ndarray, baseline: np.ndarray, mask: np.ndarray, scale: np.ndarray) -> AdvantageResult:
    returns = np.broadcast_to(R[:, None], mask.shape).copy()
    baselines = baseline[:, None] * mask
    advantages = ((R - baseline) / scale)[:, None] * mask
    return AdvantageResult(advantages=advantages, returns=returns, baselines=baselines)
