"""The straightforward per-group loop implementation of single-turn OTB (the pattern trainers use today), in torch.

Written from the specification (docs/verl-differences.md): group the batch with a dict of ids, then for each group
gather its rows, sum numerator and denominator over members, assign the baseline, and apply the zero tail with host
reads of the lengths. Used only as the baseline of benchmarks/bench_torch.py.
"""

from __future__ import annotations

import torch


@torch.no_grad()
def loop_optimal_token_baseline(rewards, response_mask, index, log_probs, sum_pi_squared, rollout_is_weights=None,
                                handle_zero_tail=True, epsilon=1e-8):
    returns = (rewards * response_mask).flip(dims=[-1]).cumsum(dim=-1).flip(dims=[-1])
    w = 1 - 2 * torch.exp(log_probs) + sum_pi_squared
    if rollout_is_weights is not None:
        w = w * rollout_is_weights**2
    cumulative = (w * response_mask).cumsum(dim=-1)
    groups: dict = {}
    for row in range(rewards.shape[0]):
        groups.setdefault(index[row], []).append(row)
    baselines = torch.zeros_like(returns)
    for members in groups.values():
        if len(members) == 1:
            continue
        rows = torch.tensor(members, device=rewards.device)
        group_returns, group_energy, group_mask = returns[rows], cumulative[rows], response_mask[rows]
        numerator = (group_returns * group_energy * group_mask).sum(dim=0)
        denominator = (group_energy * group_mask).sum(dim=0) + epsilon
        baselines[rows] = (numerator / denominator).unsqueeze(0).expand(len(members), -1)
        if handle_zero_tail:
            lengths = group_mask.sum(dim=-1)
            ordered, _ = torch.sort(lengths)
            longest, second = int(ordered[-1].item()), int(ordered[-2].item())
            at_longest = (lengths == longest).nonzero(as_tuple=True)[0]
            if at_longest.numel() == 1 and longest > second:
                baselines[members[int(at_longest[0])], second:] = 0.0
    return (returns - baselines) * response_mask, returns
