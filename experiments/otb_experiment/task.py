"""The task: a running sum mod 10, written at half resolution while the digits stream in.

Prompt   d₁ d₂ … dₙ          n digits, n uniform in [min_digits, max_digits], digits uniform in {0, …, 9}
Response y₁ y₂ … yₙ          yₖ = ⌊(Sₖ mod 10) / 2⌋ ∈ {0, …, 4},   Sₖ = d₁ + … + dₖ

The policy is a streaming transducer: it reads dₖ as it writes yₖ (the prompt is aligned with the response, as an
observation arriving with each step), so the response has exactly n tokens and no end token. Each yₖ reveals Sₖ mod 10
except its parity: the parity of Sₖ is never written and must be carried in the policy's own state from the first
token to the last. The reward is terminal and verifiable: 1 if the whole response is right, else 0 — one slip anywhere
fails the episode, so credit must be assigned across all n tokens.

Why this task (docs/experiment.md, "Pilot"): with the running sum written in full (yₖ = Sₖ mod 10) each token is a
function of the previous token and dₖ, a 100-entry table that supervised learning masters in 50 steps; when the
policy had to recall the prompt from memory (the previous set-up), RL from a supervised foothold did not learn.
The hidden parity bit sits between the two.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

__all__ = ["OUTPUTS", "DIGITS", "BOS", "Prompts", "make_prompts", "targets", "rewards_of", "response_mask"]

OUTPUTS = 5           # response vocabulary {0, …, 4}
DIGITS = 10           # prompt vocabulary {0, …, 9}
BOS = OUTPUTS         # the "previous output" fed to the policy at the first step


class Prompts(NamedTuple):
    """A batch of prompts: ``digits`` [P, L] int64 (zero beyond each prompt's length), ``lengths`` [P] (n)."""

    digits: np.ndarray
    lengths: np.ndarray


def make_prompts(rng: np.random.Generator, count: int, min_digits: int, max_digits: int) -> Prompts:
    """``count`` prompts with n uniform in [min_digits, max_digits] and uniform digits; width L = max_digits."""
    if not 1 <= min_digits <= max_digits:
        raise ValueError(f"min_digits, max_digits: need 1 ≤ min_digits ≤ max_digits, got {min_digits}, {max_digits}")
    lengths = rng.integers(min_digits, max_digits + 1, count).astype(np.int64)
    digits = rng.integers(0, DIGITS, (count, max_digits)).astype(np.int64)
    digits[np.arange(max_digits)[None, :] >= lengths[:, None]] = 0
    return Prompts(digits, lengths)


def response_mask(lengths: np.ndarray, width: int) -> np.ndarray:
    """[P, width] bool: True on the n response tokens of each prompt."""
    return np.arange(width)[None, :] < np.asarray(lengths)[:, None]


def targets(prompts: Prompts) -> np.ndarray:
    """[P, L] the correct responses yₖ = ⌊(Sₖ mod 10)/2⌋ (zero beyond each prompt's length)."""
    answer = (np.cumsum(prompts.digits, axis=1) % 10) // 2
    return np.where(response_mask(prompts.lengths, prompts.digits.shape[1]), answer, 0)


def rewards_of(prompts: Prompts, responses: np.ndarray) -> np.ndarray:
    """[P] 1.0 where the first n tokens of ``responses`` [P, ≥ n] are exactly the target, else 0.0."""
    width = prompts.digits.shape[1]
    responses = np.asarray(responses)[:, :width]
    if responses.shape[1] < int(prompts.lengths.max(initial=0)):
        raise ValueError(f"responses: {responses.shape[1]} tokens per row, shorter than the longest prompt "
                         f"({int(prompts.lengths.max())})")
    mask = response_mask(prompts.lengths, responses.shape[1])
    right = (responses == targets(Prompts(prompts.digits[:, :responses.shape[1]], prompts.lengths))) | ~mask
    return right.all(axis=1).astype(np.float64)
