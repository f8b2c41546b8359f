"""The task: write the running sum mod 10 of a digit string, with a scratchpad that makes responses long.

Prompt  d₁ d₂ … dₙ =           (n digits, n ∈ [min_digits, max_digits])
Target  d₁ s₁ d₂ s₂ … dₙ sₙ ⟨eos⟩   with sₖ = (d₁ + … + dₖ) mod 10

so a response has 2n + 1 tokens (9–63 for n ∈ [4, 31]). The reward is terminal and verifiable: 1 if the whole
response is exactly the target (the eos included), else 0. Every sₖ depends on all earlier digits, so a mistake
anywhere fails the episode: credit assignment over tens of tokens matters.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

__all__ = ["VOCAB", "EQUALS", "EOS", "PAD", "Prompts", "make_prompts", "targets", "rewards_of"]

EQUALS, EOS, PAD = 10, 11, 12
VOCAB = 13


class Prompts(NamedTuple):
    """A batch of prompts: ``tokens`` [P, n_max + 1] (digits then "=", right-padded with PAD), ``digits`` [P] (n)."""

    tokens: np.ndarray
    digits: np.ndarray


def make_prompts(rng: np.random.Generator, count: int, min_digits: int, max_digits: int) -> Prompts:
    """``count`` prompts with n uniform in [min_digits, max_digits] and uniform digits."""
    lengths = rng.integers(min_digits, max_digits + 1, count)
    tokens = np.full((count, max_digits + 1), PAD, np.int64)
    for row, n in enumerate(lengths):
        tokens[row, :n] = rng.integers(0, 10, n)
        tokens[row, n] = EQUALS
    return Prompts(tokens, lengths.astype(np.int64))


def targets(prompts: Prompts) -> list[np.ndarray]:
    """The correct response of each prompt: d₁ s₁ … dₙ sₙ eos."""
    out = []
    for row, n in zip(prompts.tokens, prompts.digits):
        digits = row[:n]
        sums = np.cumsum(digits) % 10
        response = np.empty(2 * n + 1, np.int64)
        response[0:2 * n:2] = digits
        response[1:2 * n:2] = sums
        response[-1] = EOS
        out.append(response)
    return out


def rewards_of(prompts: Prompts, responses: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """[P] 1.0 where responses[i, :lengths[i]] is exactly the target, else 0.0."""
    expected = targets(prompts)
    return np.array([float(lengths[i] == len(target) and np.array_equal(responses[i, :lengths[i]], target))
                     for i, target in enumerate(expected)])
