"""The per-sample loop implementation of multi-turn (TIR) OTB, in torch — used by benchmarks/bench_torch.py only when
verl itself is not installed.

Written from the specification (docs/verl-differences.md, step 6): compact each row's valid tokens with a Python loop
over samples, group the non-empty rows with a dict of ids, compute the per-token baseline per group on the compacted
grid (zero tail on compacted lengths), and scatter the advantages back row by row.
"""

from __future__ import annotations

import torch


@torch.no_grad()
def loop_multi_turn_optimal_token_baseline(rewards, response_mask, index, log_probs, sum_pi_squared,
                                           rollout_is_weights=None, handle_zero_tail=True, epsilon=1e-8):
    returns = (rewards * response_mask).flip(dims=[-1]).cumsum(dim=-1).flip(dims=[-1])
    w = 1 - 2 * torch.exp(log_probs) + sum_pi_squared
    if rollout_is_weights is not None:
        w = w * rollout_is_weights**2
    cumulative = (w * response_mask).cumsum(dim=-1)
    lengths = response_mask.sum(dim=-1).to(torch.long)
    width = int(lengths.max().item())
    grid_w = cumulative.new_zeros((rewards.shape[0], width))
    grid_g = torch.zeros_like(grid_w)
    for row in range(rewards.shape[0]):
        length = int(lengths[row].item())
        if length:
            valid = response_mask[row].bool()
            grid_w[row, :length] = cumulative[row, valid]
            grid_g[row, :length] = returns[row, valid]
    groups: dict = {}
    for row in range(rewards.shape[0]):
        if lengths[row] > 0:
            groups.setdefault(index[row], []).append(row)
    baselines = torch.zeros_like(grid_g)
    for members in groups.values():
        if len(members) == 1:
            continue
        rows = torch.tensor(members, device=rewards.device)
        group_w, group_g = grid_w[rows], grid_g[rows]
        baselines[rows] = ((group_g * group_w).sum(dim=0) / (group_w.sum(dim=0) + epsilon)).to(baselines.dtype)
        if handle_zero_tail:
            group_lengths = lengths[rows]
            ordered, _ = torch.sort(group_lengths)
            longest, second = int(ordered[-1].item()), int(ordered[-2].item())
            at_longest = (group_lengths == longest).nonzero(as_tuple=True)[0]
            if at_longest.numel() == 1 and longest > second:
                baselines[members[int(at_longest[0])], second:] = 0.0
    grid_advantages = grid_g - baselines
    advantages = torch.zeros_like(returns)
    for row in range(rewards.shape[0]):
        length = int(lengths[row].item())
        if length:
            advantages[row, response_mask[row].bool()] = grid_advantages[row, :length]
    return advantages * response_mask, returns
