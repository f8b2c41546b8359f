"""Peer baselines and variance diagnostics in PyTorch — ports of ``otb_spec.peers`` and ``otb_spec.diagnostics``."""

from __future__ import annotations

from typing import Any

import torch

from otb_torch import _checks as check
from otb_torch._core import Segments, reward_to_go, segment_sum, token_energy
from otb_torch._otb import AdvantageResult, _segments

__all__ = [
    "reinforce_advantage",
    "group_mean_advantage",
    "rloo_advantage",
    "opo_advantage",
    "sequence_optimal_advantage",
    "proxy_total_power",
]


def _sequence_inputs(rewards: Any, response_mask: Any, group_ids: Any, check_values: bool):
    rewards_t = check.batch("rewards", rewards)
    mask_t = check.tensor("response_mask", response_mask, like=rewards_t, like_name="rewards")
    segments = _segments(group_ids, rewards_t.shape[0], rewards_t.device, "group_ids")
    check.check_values(check_values, rewards=("rewards", rewards_t), mask=("response_mask", mask_t))
    dtype = check.accumulation_dtype(rewards_t)
    valid = mask_t != 0
    R = torch.where(valid, rewards_t.to(dtype), torch.zeros((), dtype=dtype, device=rewards_t.device)).sum(-1)
    return R, valid, segments, check.output_dtype(rewards_t)


def _weighted_baseline(values: torch.Tensor, weights: torch.Tensor, segments: Segments,
                       leave_one_out: bool) -> torch.Tensor:
    """bᵢ = Σⱼ cⱼxⱼ/Σⱼ cⱼ over i's group (j ≠ i with leave_one_out); 0 for singletons and zero totals."""
    numerator = segment_sum(weights * values, segments)[segments.index]
    denominator = segment_sum(weights, segments)[segments.index]
    members = segment_sum(torch.ones_like(values, dtype=torch.int64), segments)[segments.index]
    if leave_one_out:
        numerator = numerator - weights * values
        denominator = torch.clamp(denominator - weights, min=0.0)
        members = members - 1
    usable = (denominator > 0) & (members >= (1 if leave_one_out else 2))
    safe = torch.where(usable, denominator, torch.ones_like(denominator))
    return torch.where(usable, numerator / safe, torch.zeros_like(numerator))


def _broadcast(R: torch.Tensor, baseline: torch.Tensor, valid: torch.Tensor, scale: torch.Tensor,
               dtype: torch.dtype) -> AdvantageResult:
    zero = torch.zeros((), dtype=R.dtype, device=R.device)
    returns = R[:, None].expand(valid.shape)
    baselines = torch.where(valid, baseline[:, None], zero)
    advantages = torch.where(valid, ((R - baseline) / scale)[:, None], zero)
    return AdvantageResult(advantages.to(dtype), returns.to(dtype), baselines.to(dtype))


@torch.no_grad()
def reinforce_advantage(rewards: Any, response_mask: Any, *, check_values: bool = True) -> AdvantageResult:
    """Aₜ = Gₜ·mₜ (no baseline)."""
    rewards_t = check.batch("rewards", rewards)
    mask_t = check.tensor("response_mask", response_mask, like=rewards_t, like_name="rewards")
    check.check_values(check_values, rewards=("rewards", rewards_t), mask=("response_mask", mask_t))
    dtype = check.accumulation_dtype(rewards_t)
    valid = mask_t != 0
    G = reward_to_go(rewards_t.to(dtype), valid.to(dtype))
    out = check.output_dtype(rewards_t)
    return AdvantageResult((G * valid).to(out), G.to(out), torch.zeros_like(G).to(out))


@torch.no_grad()
def group_mean_advantage(rewards: Any, response_mask: Any, group_ids: Any, *, normalize_by_std: bool = False,
                         epsilon: float = 1e-6, check_values: bool = True) -> AdvantageResult:
    """GRPO / Dr. GRPO: (Rᵢ − μ) or (Rᵢ − μ)/(σ + ε), σ Bessel-corrected, singleton μ = 0, σ = 1."""
    R, valid, segments, dtype = _sequence_inputs(rewards, response_mask, group_ids, check_values)
    epsilon = check.epsilon(epsilon)
    baseline = _weighted_baseline(R, torch.ones_like(R), segments, leave_one_out=False)
    scale = torch.ones_like(R)
    if check.flag("normalize_by_std", normalize_by_std):
        sizes = segment_sum(torch.ones_like(R), segments)[segments.index]
        mean = segment_sum(R, segments)[segments.index] / sizes
        squares = segment_sum(torch.square(R - mean), segments)[segments.index]
        std = torch.where(sizes > 1, torch.sqrt(squares / torch.clamp(sizes - 1, min=1)), torch.ones_like(R))
        scale = std + epsilon
    return _broadcast(R, baseline, valid, scale, dtype)


@torch.no_grad()
def rloo_advantage(rewards: Any, response_mask: Any, group_ids: Any, *, check_values: bool = True) -> AdvantageResult:
    """Rᵢ − mean of the other members (singleton: baseline 0)."""
    R, valid, segments, dtype = _sequence_inputs(rewards, response_mask, group_ids, check_values)
    return _broadcast(R, _weighted_baseline(R, torch.ones_like(R), segments, True), valid, torch.ones_like(R), dtype)


@torch.no_grad()
def opo_advantage(rewards: Any, response_mask: Any, group_ids: Any, *, leave_one_out: bool = False,
                  check_values: bool = True) -> AdvantageResult:
    """Rᵢ − Σⱼ LⱼRⱼ/Σⱼ Lⱼ (lengths Lⱼ)."""
    R, valid, segments, dtype = _sequence_inputs(rewards, response_mask, group_ids, check_values)
    lengths = valid.sum(-1).to(R.dtype)
    baseline = _weighted_baseline(R, lengths, segments, check.flag("leave_one_out", leave_one_out))
    return _broadcast(R, baseline, valid, torch.ones_like(R), dtype)


@torch.no_grad()
def sequence_optimal_advantage(rewards: Any, response_mask: Any, group_ids: Any, sequence_score_sq_norms: Any, *,
                               leave_one_out: bool = False, check_values: bool = True) -> AdvantageResult:
    """Rᵢ − Σⱼ‖S(τⱼ)‖²Rⱼ/Σⱼ‖S(τⱼ)‖² from given per-trajectory norms [B]."""
    R, valid, segments, dtype = _sequence_inputs(rewards, response_mask, group_ids, check_values)
    norms = check.tensor("sequence_score_sq_norms", sequence_score_sq_norms)
    if tuple(norms.shape) != (R.shape[0],):
        raise ValueError(f"sequence_score_sq_norms: expected shape ({R.shape[0]},) (the shape of [B]), got "
                         f"{tuple(norms.shape)}")
    check.check_values(check_values, is_weights=("sequence_score_sq_norms", norms))
    baseline = _weighted_baseline(R, norms.to(R.dtype), segments, check.flag("leave_one_out", leave_one_out))
    return _broadcast(R, baseline, valid, torch.ones_like(R), dtype)


@torch.no_grad()
def proxy_total_power(advantages: Any, response_mask: Any, log_probs: Any, sum_pi_squared: Any, *,
                      is_weights: Any = None, check_values: bool = True) -> torch.Tensor:
    """Pᵢ = Σₜ mₜρₜ²Aₜ²wₜ per trajectory [B] (logit-space squared norm); the port of
    :func:`otb_spec.proxy_total_power`."""
    advantages_t, mask_t, lp_t, spp_t, weights_t = check.token_batch(
        advantages, response_mask, log_probs, sum_pi_squared, is_weights, ("advantages",) + check.TOKEN_NAMES[1:])
    check.check_values(check_values, rewards=("advantages", advantages_t), mask=("response_mask", mask_t),
                       log_probs=("log_probs", lp_t), sum_pi_squared=("sum_pi_squared", spp_t),
                       is_weights=None if weights_t is None else ("is_weights", weights_t))
    dtype = check.accumulation_dtype(advantages_t, lp_t, spp_t, weights_t)
    energy = token_energy(lp_t.to(dtype), spp_t.to(dtype)) * torch.square(advantages_t.to(dtype))
    if weights_t is not None:
        energy = energy * torch.square(weights_t.to(dtype))
    energy = torch.where(mask_t != 0, energy, torch.zeros((), dtype=dtype, device=energy.device))
    return energy.sum(-1).to(check.output_dtype(advantages_t))
