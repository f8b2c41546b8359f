"""A batch where one member's energy dwarfs its group's: the case where leave-one-out's D − Wᵢ cancels in float32
(proofs/N1 item 5), for the adapters' tests (tests/test_adapters.py) and the distributed ports' (test_torch_distributed,
test_jax_distributed)."""

from __future__ import annotations

import numpy as np

import otb_spec as otb

__all__ = ["forced_opening_with_one_deviant", "returns_range", "groups_outside"]


def forced_opening_with_one_deviant(groups: int, members: int = 8, positions: int = 12, seed: int = 0,
                                    vocab: int = 152_064) -> otb.RolloutBatch:
    """Groups whose responses open with a token forced by a logit gap of 22–30 over V = 152k (the others N(0, 1):
    their exponentials sum to ≈ (V − 1)·e^½, their squares to ≈ (V − 1)·e²), where one member per group sampled a
    token of the other V − 1 (log π ≈ −gap): that member's energy is ≈ 2 while the others' is ≈ (1 − π)² ≈ 10⁻⁹ …
    10⁻¹⁴ (in float32, rounding noise of π). Statistics exact in float64, then free tokens; rewards 0/1 at the end."""
    rng = np.random.default_rng(seed)
    rows = groups * members
    gap = rng.uniform(22.0, 30.0, size=rows)
    others_sum = (vocab - 1) * np.exp(0.5) * rng.uniform(0.95, 1.05, size=rows)
    others_squares = (vocab - 1) * np.exp(2.0) * rng.uniform(0.9, 1.1, size=rows)
    log_normaliser = np.logaddexp(gap, np.log(others_sum))
    log_pi = np.log(rng.uniform(0.2, 0.9, size=(rows, positions)))
    spp = np.exp(2 * log_pi) + (1 - np.exp(log_pi)) ** 2 * rng.uniform(0.1, 1.0, size=(rows, positions))
    log_pi[:, 0] = gap - log_normaliser
    spp[:, 0] = np.minimum(np.exp(2 * (gap - log_normaliser)) + others_squares * np.exp(-2 * log_normaliser), 1.0)
    deviant = np.arange(groups) * members + rng.integers(0, members, size=groups)
    log_pi[deviant, 0] = rng.normal(1.0, 1.0, size=groups) - log_normaliser[deviant]
    rewards = np.zeros((rows, positions))
    rewards[:, -1] = rng.integers(0, 2, size=rows)
    return otb.RolloutBatch(rewards=rewards, response_mask=np.ones((rows, positions)), log_probs=log_pi,
                            sum_pi_squared=spp, group_ids=np.repeat(np.arange(groups), members))


def returns_range(returns: np.ndarray, group_ids: np.ndarray, num_groups: int) -> tuple[np.ndarray, np.ndarray]:
    """Per group [G], (min(G, 0), max(G, 0)) over its members' returns [B, T]: where an ε-shrunk weighted mean of the
    other members' returns — a leave-one-out baseline — must lie."""
    low, high = np.zeros(num_groups), np.zeros(num_groups)
    np.minimum.at(low, group_ids, returns.min(axis=1))
    np.maximum.at(high, group_ids, returns.max(axis=1))
    return low, high


def groups_outside(baselines: np.ndarray, group_ids: np.ndarray, low: np.ndarray, high: np.ndarray) -> set[int]:
    """The groups (of ``group_ids``, one per row of ``baselines``) where a float32 baseline leaves [low, high] of its
    group by more than 8·ε₃₂: the baseline read back as G − A, rounded once, with |G| ≤ 1."""
    slack = 8 * np.finfo(np.float32).eps
    wrong = (baselines < low[group_ids][:, None] - slack) | (baselines > high[group_ids][:, None] + slack)
    return set(np.asarray(group_ids)[wrong.any(axis=1)].tolist())
