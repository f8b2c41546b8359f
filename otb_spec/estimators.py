"""Every advantage estimator of the reference behind one interface, so studies can swap them.

    batch = RolloutBatch(rewards=..., response_mask=..., group_ids=..., log_probs=..., sum_pi_squared=...)
    for name, estimator in ESTIMATORS.items():
        if estimator.accepts(batch):
            result = estimator(batch)          # AdvantageResult(advantages, returns, baselines)

Each :class:`Estimator` says which batch fields it needs (``requires``), whether its baseline is built without the
sample's own trajectory (``unbiased``: then E[ĝ] = ∇J, proofs/T3_unbiasedness.md), and whether it credits tokens
(``level="token"``) or whole sequences (``level="sequence"``). Options are passed through:
``ESTIMATORS["otb"](batch, handle_zero_tail=False)``.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from types import MappingProxyType
from typing import Any, Callable, Literal, Mapping

import numpy as np

from otb_spec.otb import (
    AdvantageResult,
    exact_norm_token_baseline,
    leave_one_out_token_baseline,
    multi_turn_optimal_token_baseline,
    optimal_token_baseline,
)
from otb_spec.peers import (
    group_mean_advantage,
    opo_advantage,
    reinforce_advantage,
    rloo_advantage,
    sequence_optimal_advantage,
)

__all__ = ["RolloutBatch", "Estimator", "ESTIMATORS", "estimate"]


@dataclass(frozen=True)
class RolloutBatch:
    """A batch of rollouts and everything any estimator may need. Arrays are held, not copied or validated here
    (each estimator validates what it uses).

    Attributes:
      rewards: [B, T] token-level rewards.
      response_mask: [B, T] {0, 1}.
      group_ids: [B] prompt-group ids (any hashable ids).
      log_probs: [B, T] log π(yₜ) (for the proxy), or None.
      sum_pi_squared: [B, T] Σπ² (for the proxy), or None.
      is_weights: [B, T] rollout importance weights ρ, or None.
      cumulative_score_sq_norms: [B, T] exact ‖Sₜ‖² (for ``otb_exact``), or None.
      sequence_score_sq_norms: [B] exact ‖S(τ)‖² (for ``sequence_optimal``), or None.
      logits: [B, T, V] logits the token statistics came from, or None (not used by estimators).
      token_ids: [B, T] sampled token ids, or None (not used by estimators).
    """

    rewards: Any
    response_mask: Any
    group_ids: Any
    log_probs: Any = None
    sum_pi_squared: Any = None
    is_weights: Any = None
    cumulative_score_sq_norms: Any = None
    sequence_score_sq_norms: Any = None
    logits: Any = None
    token_ids: Any = None

    @property
    def batch_size(self) -> int:
        """B."""
        return int(np.shape(self.rewards)[0])

    @property
    def n_positions(self) -> int:
        """T."""
        return int(np.shape(self.rewards)[1])

    def available(self) -> frozenset[str]:
        """Names of the fields that are set (not None)."""
        return frozenset(f.name for f in fields(self) if getattr(self, f.name) is not None)


@dataclass(frozen=True)
class Estimator:
    """One advantage estimator.

    Attributes:
      name: registry key.
      description: one line.
      requires: batch fields it reads besides rewards, response_mask (and group_ids when grouped).
      unbiased: True when every member's baseline is independent of its own trajectory (E[ĝ] = ∇J).
      level: ``"token"`` (Aₜ from Gₜ and a per-token baseline) or ``"sequence"`` (one advantage per trajectory).
      compute: function(batch, **options) → AdvantageResult.
    """

    name: str
    description: str
    requires: tuple[str, ...]
    unbiased: bool
    level: Literal["token", "sequence"]
    compute: Callable[..., AdvantageResult]

    def accepts(self, batch: RolloutBatch) -> bool:
        """True when ``batch`` has every field this estimator requires."""
        return set(self.requires) <= batch.available()

    def __call__(self, batch: RolloutBatch, **options: Any) -> AdvantageResult:
        if not isinstance(batch, RolloutBatch):
            raise TypeError(f"batch: expected a RolloutBatch, got {type(batch).__name__}")
        missing = [name for name in self.requires if getattr(batch, name) is None]
        if missing:
            raise ValueError(f"batch: estimator {self.name!r} needs field(s) {', '.join(missing)}, which are None")
        return self.compute(batch, **options)


def _proxy(function: Callable[..., AdvantageResult]) -> Callable[..., AdvantageResult]:
    def compute(batch: RolloutBatch, **options: Any) -> AdvantageResult:
        return function(batch.rewards, batch.response_mask, batch.group_ids, batch.log_probs, batch.sum_pi_squared,
                        is_weights=batch.is_weights, **options)
    return compute


def _exact(leave_one_out: bool) -> Callable[..., AdvantageResult]:
    def compute(batch: RolloutBatch, **options: Any) -> AdvantageResult:
        return exact_norm_token_baseline(batch.rewards, batch.response_mask, batch.group_ids,
                                         batch.cumulative_score_sq_norms, leave_one_out=leave_one_out, **options)
    return compute


def _sequence_optimal(leave_one_out: bool) -> Callable[..., AdvantageResult]:
    def compute(batch: RolloutBatch, **options: Any) -> AdvantageResult:
        return sequence_optimal_advantage(batch.rewards, batch.response_mask, batch.group_ids,
                                          batch.sequence_score_sq_norms, leave_one_out=leave_one_out, **options)
    return compute


_PROXY = ("log_probs", "sum_pi_squared")

_REGISTRY = [
    Estimator("reinforce", "no baseline: Aₜ = Gₜ (REINFORCE with reward-to-go)", (), True, "token",
              lambda batch, **o: reinforce_advantage(batch.rewards, batch.response_mask, **o)),
    Estimator("group_mean", "Rᵢ − mean of the group (Dr. GRPO; self-inclusive)", (), False, "sequence",
              lambda batch, **o: group_mean_advantage(batch.rewards, batch.response_mask, batch.group_ids, **o)),
    Estimator("grpo", "(Rᵢ − μ)/(σ + ε) in the group (GRPO)", (), False, "sequence",
              lambda batch, **o: group_mean_advantage(batch.rewards, batch.response_mask, batch.group_ids,
                                                      normalize_by_std=True, **o)),
    Estimator("rloo", "Rᵢ − mean of the other members (RLOO)", (), True, "sequence",
              lambda batch, **o: rloo_advantage(batch.rewards, batch.response_mask, batch.group_ids, **o)),
    Estimator("opo", "Rᵢ − length-weighted group mean (OPO; self-inclusive)", (), False, "sequence",
              lambda batch, **o: opo_advantage(batch.rewards, batch.response_mask, batch.group_ids, **o)),
    Estimator("sequence_optimal", "Rᵢ − ‖S(τ)‖²-weighted group mean (self-inclusive)",
              ("sequence_score_sq_norms",), False, "sequence", _sequence_optimal(False)),
    Estimator("sequence_optimal_loo", "Rᵢ − ‖S(τ)‖²-weighted mean of the other members",
              ("sequence_score_sq_norms",), True, "sequence", _sequence_optimal(True)),
    Estimator("otb", "OTB single-turn, verl semantics (self-inclusive)", _PROXY, False, "token",
              _proxy(optimal_token_baseline)),
    Estimator("otb_multi_turn", "OTB multi-turn, verl semantics (valid-token alignment)", _PROXY, False, "token",
              _proxy(multi_turn_optimal_token_baseline)),
    Estimator("otb_loo", "OTB leave-one-out (proxy energy)", _PROXY, True, "token",
              _proxy(leave_one_out_token_baseline)),
    Estimator("otb_exact", "OTB with exact ‖Sₜ‖² (self-inclusive)", ("cumulative_score_sq_norms",), False, "token",
              _exact(False)),
    Estimator("otb_exact_loo", "OTB with exact ‖Sₜ‖², leave-one-out", ("cumulative_score_sq_norms",), True, "token",
              _exact(True)),
]

ESTIMATORS: Mapping[str, Estimator] = MappingProxyType({estimator.name: estimator for estimator in _REGISTRY})
"""Read-only registry: name → :class:`Estimator`."""


def estimate(name: str, batch: RolloutBatch, **options: Any) -> AdvantageResult:
    """``ESTIMATORS[name](batch, **options)`` with a clear error for unknown names."""
    if name not in ESTIMATORS:
        raise ValueError(f"name: unknown estimator {name!r}; known: {', '.join(ESTIMATORS)}")
    return ESTIMATORS[name](batch, **options)
