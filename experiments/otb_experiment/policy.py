"""The policy: a 2-layer GRU language model over the task's 13 tokens (45 037 parameters), its sampler, and the
per-token statistics OTB needs, computed from the model's own logits with otb_torch."""

from __future__ import annotations

from typing import Callable, NamedTuple

import numpy as np
import torch
from torch import nn

import otb_torch

from otb_experiment.task import EOS, PAD, VOCAB, Prompts

__all__ = ["Policy", "Rollouts", "sample", "teacher_forced", "greedy", "token_log_probs", "token_statistics"]


class Policy(nn.Module):
    """Embedding (32) → GRU (2 × 64) → linear head over the vocabulary."""

    def __init__(self, embed: int = 32, hidden: int = 64, layers: int = 2):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, embed)
        self.gru = nn.GRU(embed, hidden, num_layers=layers, batch_first=True)
        self.head = nn.Linear(hidden, VOCAB)

    def forward(self, tokens: torch.Tensor, state: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        output, state = self.gru(self.embed(tokens), state)
        return self.head(output), state


class Rollouts(NamedTuple):
    """Sampled responses: ``tokens`` [B, L] (PAD after eos), ``mask`` [B, L] float, ``lengths`` [B],
    ``prompt_rows`` [B] (which prompt each sample answers)."""

    tokens: torch.Tensor
    mask: torch.Tensor
    lengths: np.ndarray
    prompt_rows: np.ndarray


def _prefix_states(policy: Policy, prompts: Prompts) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the prompts (of unequal lengths) through the GRU; return the state after each prompt's "=" and the logits
    there (the first response token's distribution)."""
    tokens = torch.from_numpy(prompts.tokens)
    logits, _ = policy(tokens)
    ends = torch.from_numpy(prompts.digits)                   # index of "=" in each row
    packed = nn.utils.rnn.pack_padded_sequence(policy.embed(tokens), (ends + 1).tolist(), batch_first=True,
                                               enforce_sorted=False)
    _, state = policy.gru(packed)
    return state, logits[torch.arange(len(ends)), ends]


@torch.no_grad()
def _decode(policy: Policy, prompts: Prompts, rows: np.ndarray, max_length: int,
            choose: Callable[[torch.Tensor], torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Responses to ``prompts.tokens[rows]``, one token per step from ``choose(logits)`` until eos or ``max_length``:
    tokens [len(rows), max_length] (PAD after eos) and lengths [len(rows)]."""
    state, first = _prefix_states(policy, prompts)
    index = torch.from_numpy(rows)
    state, logits = state[:, index].contiguous(), first[index]
    batch = len(rows)
    tokens = torch.full((batch, max_length), PAD, dtype=torch.int64)
    done = torch.zeros(batch, dtype=torch.bool)
    lengths = torch.full((batch,), max_length, dtype=torch.int64)
    for step in range(max_length):
        choice = torch.where(done, torch.full((batch,), PAD, dtype=torch.int64), choose(logits))
        tokens[:, step] = choice
        ended = (~done) & (choice == EOS)
        lengths = torch.where(ended, torch.full_like(lengths, step + 1), lengths)
        done = done | ended
        if bool(done.all()):
            break
        out, state = policy(choice[:, None], state)
        logits = out[:, 0]
    return tokens, lengths


def sample(policy: Policy, prompts: Prompts, samples_per_prompt: int, generator: torch.Generator,
           max_length: int) -> Rollouts:
    """N samples per prompt, ancestral sampling until eos or ``max_length`` tokens."""
    rows = np.repeat(np.arange(len(prompts.digits)), samples_per_prompt)
    tokens, lengths = _decode(policy, prompts, rows, max_length,
                              lambda logits: torch.multinomial(torch.softmax(logits, -1), 1, generator=generator)[:, 0])
    mask = (torch.arange(max_length)[None, :] < lengths[:, None]).to(torch.float32)
    return Rollouts(tokens, mask, lengths.numpy(), rows)


def greedy(policy: Policy, prompts: Prompts, max_length: int) -> tuple[np.ndarray, np.ndarray]:
    """Greedy responses [P, max_length] and their lengths (for held-out accuracy)."""
    tokens, lengths = _decode(policy, prompts, np.arange(len(prompts.digits)), max_length,
                              lambda logits: logits.argmax(-1))
    return tokens.numpy(), lengths.numpy()


def teacher_forced(policy: Policy, prompts: Prompts, rollouts: Rollouts) -> torch.Tensor:
    """Logits [B, L, V] of each response token given the prompt and the response so far (with gradients)."""
    state, first = _prefix_states(policy, prompts)
    index = torch.from_numpy(rollouts.prompt_rows)
    inputs = rollouts.tokens[:, :-1].clamp(max=VOCAB - 1)
    rest, _ = policy(inputs, state[:, index].contiguous())
    return torch.cat([first[index][:, None], rest], dim=1)


def token_log_probs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log π(y) [B, L] of ``tokens`` under ``logits`` [B, L, V], with gradients (PAD read as a valid index)."""
    return torch.log_softmax(logits, -1).gather(-1, tokens.clamp(max=VOCAB - 1)[..., None])[..., 0]


def token_statistics(logits: torch.Tensor, tokens: torch.Tensor) -> otb_torch.TokenStatistics:
    """log π(y), entropy and Σπ² of the sampled tokens from the model's own logits (otb_torch, one pass)."""
    return otb_torch.token_statistics_from_logits(logits.detach(), tokens.clamp(max=VOCAB - 1))
