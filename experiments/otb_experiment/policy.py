"""The policy: a 2-layer GRU streaming transducer over the task's vocabularies (50 757 parameters with the default
sizes), its sampler and greedy decoder, and the per-token statistics OTB needs, computed from the model's own logits
with otb_torch.

At step k the GRU reads the pair (yₖ₋₁, dₖ) — its own previous output (BOS at k = 1) and the prompt's k-th digit —
and its head gives the distribution of yₖ over the 5 outputs. Responses have exactly n tokens (the prompt's length).
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import numpy as np
import torch
from torch import nn

import otb_torch

from otb_experiment.task import BOS, DIGITS, OUTPUTS, Prompts

__all__ = ["Policy", "Rollouts", "sample", "greedy", "teacher_forced", "token_log_probs", "token_statistics",
           "gradient_norm"]


class Policy(nn.Module):
    """Embeddings of the previous output (6 symbols) and of the digit (10), concatenated → GRU (layers × hidden) →
    linear head over the 5 outputs."""

    def __init__(self, embed: int = 32, hidden: int = 64, layers: int = 2):
        super().__init__()
        self.previous = nn.Embedding(OUTPUTS + 1, embed)
        self.digit = nn.Embedding(DIGITS, embed)
        self.gru = nn.GRU(2 * embed, hidden, num_layers=layers, batch_first=True)
        self.head = nn.Linear(hidden, OUTPUTS)

    def forward(self, previous: torch.Tensor, digits: torch.Tensor,
                state: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits [B, T, 5] for inputs previous [B, T] and digits [B, T]; and the GRU state after them."""
        output, state = self.gru(torch.cat([self.previous(previous), self.digit(digits)], dim=-1), state)
        return self.head(output), state


class Rollouts(NamedTuple):
    """Responses: ``tokens`` [B, L] int64 (0 beyond each response), ``mask`` [B, L] float (1 on the n tokens),
    ``lengths`` [B], ``prompt_rows`` [B] (which prompt each sample answers). L is the longest prompt's length."""

    tokens: torch.Tensor
    mask: torch.Tensor
    lengths: np.ndarray
    prompt_rows: np.ndarray


def _width(prompts: Prompts, rows: np.ndarray) -> int:
    return int(prompts.lengths[rows].max(initial=1))


@torch.no_grad()
def _decode(policy: Policy, prompts: Prompts, rows: np.ndarray,
            choose: Callable[[torch.Tensor], torch.Tensor]) -> Rollouts:
    """Responses to the prompts ``rows``, one token per step from ``choose(logits)``; all rows run to the longest
    prompt (tokens beyond a row's length are zeroed and masked)."""
    width = _width(prompts, rows)
    digits = torch.from_numpy(prompts.digits[rows, :width])
    lengths = prompts.lengths[rows]
    batch = len(rows)
    tokens = torch.zeros((batch, width), dtype=torch.int64)
    previous = torch.full((batch, 1), BOS, dtype=torch.int64)
    state = None
    for step in range(width):
        logits, state = policy(previous, digits[:, step:step + 1], state)
        choice = choose(logits[:, 0])
        tokens[:, step] = choice
        previous = choice[:, None]
    mask = torch.from_numpy(np.arange(width)[None, :] < lengths[:, None]).to(torch.float32)
    return Rollouts(tokens * mask.to(torch.int64), mask, lengths, rows)


def sample(policy: Policy, prompts: Prompts, samples_per_prompt: int, generator: torch.Generator) -> Rollouts:
    """N samples per prompt, ancestral sampling at temperature 1."""
    rows = np.repeat(np.arange(len(prompts.lengths)), samples_per_prompt)
    return _decode(policy, prompts, rows,
                   lambda logits: torch.multinomial(torch.softmax(logits, -1), 1, generator=generator)[:, 0])


def greedy(policy: Policy, prompts: Prompts) -> np.ndarray:
    """Greedy responses [P, L] (for held-out accuracy), one batched decoding pass."""
    return _decode(policy, prompts, np.arange(len(prompts.lengths)), lambda logits: logits.argmax(-1)).tokens.numpy()


def teacher_forced(policy: Policy, prompts: Prompts, rollouts: Rollouts) -> torch.Tensor:
    """Logits [B, L, 5] of each response token given its prompt digits and the response so far (with gradients)."""
    width = rollouts.tokens.shape[1]
    digits = torch.from_numpy(prompts.digits[rollouts.prompt_rows, :width])
    previous = torch.cat([torch.full((rollouts.tokens.shape[0], 1), BOS, dtype=torch.int64),
                          rollouts.tokens[:, :-1]], dim=1)
    return policy(previous, digits)[0]


def token_log_probs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log π(y) [B, L] of ``tokens`` under ``logits`` [B, L, V], with gradients."""
    return torch.log_softmax(logits, -1).gather(-1, tokens[..., None])[..., 0]


def token_statistics(logits: torch.Tensor, tokens: torch.Tensor) -> otb_torch.TokenStatistics:
    """log π(y), entropy and Σπ² of the sampled tokens from the model's own logits (otb_torch, one pass)."""
    return otb_torch.token_statistics_from_logits(logits.detach(), tokens)


def gradient_norm(policy: Policy) -> float:
    """‖∇θ‖₂ over all parameters (after ``backward``; parameters without a gradient count as zero)."""
    squares = [p.grad.detach().double().square().sum() for p in policy.parameters() if p.grad is not None]
    return float(torch.stack(squares).sum().sqrt()) if squares else 0.0
