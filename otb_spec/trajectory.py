"""Per-trajectory cumulative quantities: realized energy (forward in time) and return-to-go (backward in time).

Index convention: trajectory i ∈ [0, B), absolute position t ∈ [0, T); mₜ ∈ {0, 1} is the response mask (1 on tokens
the policy generated, 0 on padding and on tool output inside a multi-turn response). Masks may have holes.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from scipy.signal import lfilter

from otb_spec import _validation as check

__all__ = ["realized_energy", "returns_to_go", "valid_token_index"]


def realized_energy(token_energy: Any, response_mask: Any, *, is_weights: Any = None) -> np.ndarray:
    """Realized energy  Wₜ = Σ_{j≤t} mⱼ·ρⱼ²·wⱼ  (cumulative Logit-Gradient Proxy).

    Args:
      token_energy: [B, T] per-token energy wₜ ≥ 0 — the proxy 1 − 2πₜ + Σπ²ₜ (:func:`otb_spec.token_energy`) or an
        exact per-token squared score norm.
      response_mask: [B, T] 1 on generated tokens, 0 on padding and tool output.
      is_weights: optional [B, T] rollout importance weights ρₜ ≥ 0; they enter squared, as in verl.

    Returns:
      [B, T] float64 Wₜ; positions with mₜ = 0 carry the running total (mask before use).

    Worked example: w = (0.5, 0.25, 1.0), m = (1, 0, 1) → W = (0.5, 0.5, 1.5)::

      >>> realized_energy([[0.5, 0.25, 1.0]], [[1, 0, 1]]).tolist()
      [[0.5, 0.5, 1.5]]

    Reference: Li, Xu et al. 2026, arXiv 2602.07078 (Realized Energy); verl ``w_cumulative``.
    """
    shape = check.batch_shape("token_energy", token_energy)
    raw = check.to_numpy("token_energy", token_energy)
    energy = check.float_array("token_energy", raw, shape=shape)
    mask = check.mask_array("response_mask", response_mask, shape, like="token_energy")
    check.nonnegative_where("token_energy", energy, mask > 0, raw.dtype)
    weights = None if is_weights is None else importance_weights(is_weights, shape, like="token_energy")
    return cumulative_energy(energy, mask, weights)


def importance_weights(is_weights: Any, shape: tuple[int, int], like: str) -> np.ndarray:
    """Validate rollout importance weights ρ ≥ 0 of the batch shape; returns float64."""
    weights = check.float_array("is_weights", is_weights, shape=shape, like=like)
    check.nonnegative("is_weights", weights)
    return weights


def cumulative_energy(energy: np.ndarray, mask: np.ndarray, weights: np.ndarray | None) -> np.ndarray:
    """Unchecked core of :func:`realized_energy` (float64 arrays of one shape)."""
    per_token = energy * mask
    if weights is not None:
        per_token = per_token * np.square(weights)
    return np.cumsum(per_token, axis=-1)


def returns_to_go(rewards: Any, response_mask: Any, *, gamma: float = 1.0) -> np.ndarray:
    """Return-to-go  Gₜ = Σ_{k≥t} γ^{n(t,k)}·mₖ·rₖ,  n(t,k) = #{valid j : t ≤ j < k}.

    With γ = 1 (the default, as in verl) this is the reverse cumulative sum of m·r. Discounting counts *generated*
    tokens only: stepping over padding or tool output does not discount, so Gₜ obeys

        Gₜ = rₜ + γ·Gₜ₊₁  where mₜ = 1,        Gₜ = Gₜ₊₁  where mₜ = 0,        G_T = 0,

    and the returns of the compacted valid tokens (multi-turn alignment) are the plain discounted returns.

    Args:
      rewards: [B, T] token-level rewards rₜ (rewards at masked positions are ignored).
      response_mask: [B, T] {0, 1} mask.
      gamma: discount γ ∈ (0, 1].

    Returns:
      [B, T] float64 Gₜ. Masked positions carry the return of the next valid token (0 after the last one), which is
      what verl returns.

    Worked example: r = (0, 1, 0, 2), m = (1, 1, 0, 1) → G = (3, 3, 2, 2); with γ = ½ → (1, 2, 2, 2)::

      >>> returns_to_go([[0, 1, 0, 2]], [[1, 1, 0, 1]]).tolist()
      [[3.0, 3.0, 2.0, 2.0]]
      >>> returns_to_go([[0, 1, 0, 2]], [[1, 1, 0, 1]], gamma=0.5).tolist()
      [[1.0, 2.0, 2.0, 2.0]]

    Reference: verl ``(token_level_rewards * response_mask).flip(-1).cumsum(-1).flip(-1)``.
    """
    shape = check.batch_shape("rewards", rewards)
    rewards64 = check.float_array("rewards", rewards, shape=shape)
    mask = check.mask_array("response_mask", response_mask, shape, like="rewards")
    gamma = check.scalar("gamma", gamma, minimum=0.0, maximum=1.0, min_inclusive=False)
    return reward_to_go(rewards64, mask, gamma)


def reward_to_go(rewards: np.ndarray, mask: np.ndarray, gamma: float = 1.0) -> np.ndarray:
    """Unchecked core of :func:`returns_to_go` (float64 arrays of one shape)."""
    masked = rewards * mask
    if gamma == 1.0:   # contiguous result (a flipped view has negative strides, which torch.from_numpy refuses)
        return np.ascontiguousarray(np.flip(np.cumsum(np.flip(masked, axis=-1), axis=-1), axis=-1))
    # Discount per generated token: compact the valid tokens, run the constant-coefficient recursion
    # Gᶜ_a = rᶜ_a + γ·Gᶜ_{a+1} backwards (an IIR filter), then read Gₜ = Gᶜ[#valid tokens before t].
    rows, cols = np.nonzero(mask)
    before = valid_token_index(mask)
    lengths = mask.sum(axis=-1).astype(np.int64)
    compact = np.zeros((mask.shape[0], int(lengths.max()) + 1))
    compact[rows, before[rows, cols]] = masked[rows, cols]
    compact_returns = np.flip(lfilter([1.0], [1.0, -gamma], np.flip(compact, axis=-1), axis=-1), axis=-1)
    return np.take_along_axis(compact_returns, before, axis=-1)


def valid_token_index(mask: np.ndarray) -> np.ndarray:
    """[B, T] int64: number of valid tokens strictly before position t (the compacted index of a valid token)."""
    counts = np.cumsum(mask, axis=-1) - mask
    return counts.astype(np.int64)
