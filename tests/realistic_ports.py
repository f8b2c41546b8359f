"""A net of realistic third-party implementations for the verifier's own tests: correct ports written in the styles
people really use, and ports carrying the bugs people really make.

Every port here is written from the math (docs/verl-differences.md), independently of the reference and of one
another, the way a trainer's author would: dict-of-groups loops, ``index_add_``, ``scatter_add_``,
``index_put_(accumulate=True)``, sorted segments with ``np.add.reduceat``, one-hot matrix products, a [B, B]
same-group matrix, returns as total minus prefix, one reversed scan for both the returns and the energy (W as total
minus suffix), both scans in blocks of positions with a running carry (a GPU kernel's tiles of T), the energy as
(1 − π)² + (Σπ² − π²), and Σπ² as a shifted or unshifted log-sum-exp, softmax-then-square or a chunked online pass;
and, for fused token statistics, the plain unfused program (logits, log_softmax, gather) a fused kernel replaces, a
kernel's vocabulary blocks, and its token chunks with a backward pass of their own. Half-precision inputs are computed
in float32, as a correct port must; results come back in the input's dtype (the unfused program returns its float32
statistics).

``CORRECT``: name → (kind, convention, function) — the verifier must accept every one.
``CALLED_POSITIONALLY``: name → (kind, convention, function) — right values, but verl's trainer could not call them
by keyword (no ``**kwargs`` for its ``config``, the author's own parameter names): accepted, with the signature
layer's warning.
``BUGGY``: name → (kind, convention, function, what is wrong) — the verifier must reject every one.
Each bug is a one-line change to one of the correct ports (``_variant``), so a port is rejected for its bug only.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Callable

import numpy as np
import torch

# ----------------------------------------------------------------------------------------------------------------------
# NumPy ports (numpy convention: rewards, response_mask, group_ids, log_probs, sum_pi_squared, *, is_weights, …)


def _np_in(*arrays):
    """Compute in float64 for float64 inputs and float32 otherwise (half precision is widened, exactly)."""
    dtype = np.float64 if any(a is not None and np.asarray(a).dtype == np.float64 for a in arrays) else np.float32
    return dtype, [None if a is None else np.asarray(a).astype(dtype) for a in arrays]


def _np_out(dtype_like, *arrays):
    return tuple(np.asarray(a).astype(np.asarray(dtype_like).dtype) for a in arrays)


def numpy_loops(rewards, response_mask, group_ids, log_probs, sum_pi_squared, *, is_weights=None,
                handle_zero_tail=True, epsilon=1e-8, bugs=frozenset()):
    """Single-turn OTB the way verl writes it: a dict of groups and a loop over them."""
    dtype, (r, m, lp, spp, rho) = _np_in(rewards, response_mask, log_probs, sum_pi_squared, is_weights)
    masked = r if "rewards_unmasked" in bugs else r * m
    returns = np.cumsum(masked, axis=1) if "forward_returns" in bugs else np.flip(np.cumsum(np.flip(masked, 1), 1), 1)
    pi = np.exp(np.minimum(lp, 0))
    w = (1 - pi) ** 2 + (spp - (pi if "pi_for_pi_squared" in bugs else pi * pi))
    if rho is not None:
        w = w * (rho if "rho_not_squared" in bugs else rho * rho)
    if "mask_after_cumsum" in bugs:
        energy = np.cumsum(w, axis=1) * m
    elif "per_step_energy" in bugs:
        energy = w * m
    else:
        energy = np.cumsum(w * m, axis=1)
    groups = defaultdict(list)
    for row, gid in enumerate(np.asarray(group_ids, dtype=object).tolist()):
        groups[gid].append(row)
    baselines = np.zeros_like(returns)
    lengths = m.sum(axis=1)
    for rows in groups.values():
        if len(rows) < (3 if "pairs_are_singletons" in bugs else 2):
            continue
        weight = energy[rows] if "padding_in_group_sums" in bugs else energy[rows] * m[rows]
        numerator = (returns[rows] * weight).sum(axis=0) + (epsilon if "epsilon_in_numerator" in bugs else 0.0)
        baseline = numerator / (weight.sum(axis=0) + epsilon)
        baselines[rows] = baseline
        if handle_zero_tail:
            ranked = [row for row in rows if lengths[row] > 0] if "empty_rows_unranked" in bugs else rows
            ordered = sorted(lengths[ranked])
            if len(ordered) >= 2:
                longest, second = ordered[-1], ordered[-2]
                at_longest = [row for row in ranked if lengths[row] == longest]
                if "ties_get_a_tail" in bugs and len(at_longest) > 1:
                    second = max([length for length in ordered if length < longest], default=0)
                    at_longest = at_longest[:1]
                if len(at_longest) == 1 and longest > second:
                    start = int(second) + (1 if "zero_tail_off_by_one" in bugs else 0)
                    baselines[at_longest[0], start:] = 0.0
    advantages = (returns - baselines) * m
    return _np_out(rewards, advantages, returns)


def numpy_reduceat(rewards, response_mask, group_ids, log_probs, sum_pi_squared, *, is_weights=None,
                   handle_zero_tail=True, epsilon=1e-8):
    """Single-turn OTB on sorted segments: rows stably sorted by group, group sums with np.add.reduceat."""
    dtype, (r, m, lp, spp, rho) = _np_in(rewards, response_mask, log_probs, sum_pi_squared, is_weights)
    ids = np.asarray(group_ids, dtype=object).tolist()
    labels = np.array([{key: k for k, key in enumerate(dict.fromkeys(ids))}[key] for key in ids])
    order = np.argsort(labels, kind="stable")
    starts = np.flatnonzero(np.r_[True, np.diff(labels[order]) != 0])
    counts = np.diff(np.r_[starts, len(order)])
    returns = np.flip(np.cumsum(np.flip(r * m, 1), 1), 1)
    pi = np.exp(np.minimum(lp, 0))
    w = 1 - 2 * pi + spp
    if rho is not None:
        w = w * rho * rho
    energy = np.cumsum(w * m, axis=1)
    weight = (energy * m)[order]
    numerator = np.add.reduceat(returns[order] * weight, starts, axis=0)
    denominator = np.add.reduceat(weight, starts, axis=0) + epsilon
    group = np.repeat(np.arange(len(starts)), counts)
    baseline_sorted = (numerator / denominator)[group]
    baseline_sorted[np.repeat(counts, counts) < 2] = 0.0
    baselines = np.empty_like(baseline_sorted)
    baselines[order] = baseline_sorted
    if handle_zero_tail:
        lengths = m.sum(axis=1)
        for g, (start, count) in enumerate(zip(starts, counts)):
            rows = order[start:start + count]
            if count < 2:
                continue
            ranked = np.sort(lengths[rows])
            winners = rows[lengths[rows] == ranked[-1]]
            if len(winners) == 1 and ranked[-1] > ranked[-2]:
                baselines[winners[0], int(ranked[-2]):] = 0.0
    return _np_out(rewards, (returns - baselines) * m, returns)


def numpy_same_group_matrix(rewards, response_mask, group_ids, log_probs, sum_pi_squared, *, is_weights=None,
                            handle_zero_tail=True, epsilon=1e-8):
    """Single-turn OTB with a [B, B] same-group matrix S: group sums are S @ X (BLAS), zero tail by comparisons."""
    dtype, (r, m, lp, spp, rho) = _np_in(rewards, response_mask, log_probs, sum_pi_squared, is_weights)
    ids = np.asarray(group_ids, dtype=object)
    same = np.array([[a == b for b in ids.tolist()] for a in ids.tolist()], dtype=dtype)
    returns = (r * m).sum(axis=1, keepdims=True) - np.cumsum(r * m, axis=1) + r * m        # total − prefix
    pi = np.exp(np.minimum(lp, 0))
    w = (1 - pi) ** 2 + (spp - pi * pi)
    if rho is not None:
        w = w * np.square(rho)
    weight = np.cumsum(w * m, axis=1) * m
    baselines = (same @ (returns * weight)) / (same @ weight + epsilon)
    sizes = same.sum(axis=1)
    baselines[sizes < 2] = 0.0
    if handle_zero_tail:
        lengths = m.sum(axis=1)
        longer = same * (lengths[None, :] >= lengths[:, None]) - np.eye(len(ids))      # others at least as long
        unique_longest = (longer.sum(axis=1) == 0) & (sizes >= 2)
        second = np.where(same > 0, lengths[None, :], -1.0) - np.eye(len(ids)) * 1e9
        second = second.max(axis=1)
        tail = unique_longest[:, None] & (np.arange(m.shape[1])[None, :] >= second[:, None])
        baselines = np.where(tail, 0.0, baselines)
    return _np_out(rewards, (returns - baselines) * m, returns)


def numpy_multi_turn_loops(rewards, response_mask, group_ids, log_probs, sum_pi_squared, *, is_weights=None,
                           handle_zero_tail=True, epsilon=1e-8, bugs=frozenset()):
    """Multi-turn OTB as verl writes it: compact each row's valid tokens, a dict of non-empty members, scatter back."""
    dtype, (r, m, lp, spp, rho) = _np_in(rewards, response_mask, log_probs, sum_pi_squared, is_weights)
    returns = np.flip(np.cumsum(np.flip(r * m, 1), 1), 1)
    pi = np.exp(np.minimum(lp, 0))
    w = 1 - 2 * pi + spp
    if rho is not None:
        w = w * rho ** 2
    energy = np.cumsum(w * m, axis=1)
    rows, positions = m.shape
    if "tir_keeps_observations" in bugs:            # aligns the span from the first to the last valid token
        spans = [np.arange(np.flatnonzero(m[i])[0], np.flatnonzero(m[i])[-1] + 1) if m[i].any() else np.arange(0)
                 for i in range(rows)]
    else:
        spans = [np.flatnonzero(m[i] > 0) for i in range(rows)]
    lengths = np.array([len(span) for span in spans])
    width = max(int(lengths.max()), 1)
    compact_w, compact_g = np.zeros((rows, width), dtype), np.zeros((rows, width), dtype)
    for i, span in enumerate(spans):
        compact_w[i, :len(span)] = energy[i, span] * m[i, span]
        compact_g[i, :len(span)] = returns[i, span]
    groups = defaultdict(list)
    for i, gid in enumerate(np.asarray(group_ids, dtype=object).tolist()):
        if lengths[i] > 0:
            groups[gid].append(i)
    baselines = np.zeros((rows, width), dtype)
    for members in groups.values():
        if len(members) < 2:
            continue
        baselines[members] = (compact_g[members] * compact_w[members]).sum(0) / (compact_w[members].sum(0) + epsilon)
        if handle_zero_tail:
            ordered = sorted(lengths[members])
            at_longest = [i for i in members if lengths[i] == ordered[-1]]
            if len(at_longest) == 1 and ordered[-1] > ordered[-2]:
                baselines[at_longest[0], ordered[-2]:] = 0.0
    advantages = np.zeros((rows, positions), dtype)
    for i, span in enumerate(spans):
        advantages[i, span] = compact_g[i, :len(span)] - baselines[i, :len(span)]
    return _np_out(rewards, advantages * m, returns)


def _returns_and_energy(rewards, response_mask, log_probs, sum_pi_squared, is_weights):
    """(dtype, m, G, W) of the leave-one-out ports: G by a flipped cumsum, w = (1 − π)² + (Σπ² − π²) with ρ², W its
    masked cumsum (running through masked positions)."""
    dtype, (r, m, lp, spp, rho) = _np_in(rewards, response_mask, log_probs, sum_pi_squared, is_weights)
    returns = np.flip(np.cumsum(np.flip(r * m, 1), 1), 1)
    pi = np.exp(np.minimum(lp, 0))
    w = (1 - pi) ** 2 + (spp - pi * pi)
    if rho is not None:
        w = w * rho * rho
    return dtype, m, returns, np.cumsum(w * m, axis=1)


def numpy_leave_one_out(rewards, response_mask, group_ids, log_probs, sum_pi_squared, *, is_weights=None,
                        epsilon=1e-8, bugs=frozenset()):
    """Leave-one-out OTB: group totals minus the member's own term, 0 where no other member is valid (bug
    ``members_cap16``: a group's members held in a static block of 16, as a kernel sized for the usual group, so the
    17th and later members are left out of the sums — and get no baseline of their own)."""
    dtype, m, returns, energy = _returns_and_energy(rewards, response_mask, log_probs, sum_pi_squared, is_weights)
    weight = energy * m
    ids = np.asarray(group_ids, dtype=object).tolist()
    baselines = np.zeros_like(returns)
    for gid in dict.fromkeys(ids):
        rows = [i for i, value in enumerate(ids) if value == gid]
        if "members_cap16" in bugs:
            rows = rows[:16]
        numerator = (returns[rows] * weight[rows]).sum(0)
        denominator = weight[rows].sum(0)
        valid = m[rows].sum(0)
        for i in rows:
            others = valid - m[i]
            own_weight = 0.0 if "loo_denominator_keeps_self" in bugs else weight[i]
            other_energy = denominator - own_weight
            value = np.divide(numerator - returns[i] * weight[i], other_energy + epsilon,
                              out=np.zeros_like(numerator), where=other_energy > 0)
            baselines[i] = np.where(others > 0, value, 0.0)
    return _np_out(rewards, (returns - baselines) * m, returns)


def numpy_multi_turn_leave_one_out(rewards, response_mask, group_ids, log_probs, sum_pi_squared, *, is_weights=None,
                                   align="position", epsilon=1e-8, bugs=frozenset()):
    """Multi-turn leave-one-out OTB written from the definition: compact each row's valid tokens, and at each member's
    k-th valid token divide the *other* members' Σ G·W by their Σ W (those with a k-th valid token), 0 where none
    has one. ``align`` must be "valid_token" (the bug "tir_loo_aligned_by_position" ignores it)."""
    if "tir_loo_aligned_by_position" in bugs:
        return numpy_leave_one_out(rewards, response_mask, group_ids, log_probs, sum_pi_squared,
                                   is_weights=is_weights, epsilon=epsilon)
    assert align == "valid_token", align
    dtype, m, returns, energy = _returns_and_energy(rewards, response_mask, log_probs, sum_pi_squared, is_weights)
    spans = [np.flatnonzero(row > 0) for row in m]
    ids = np.asarray(group_ids, dtype=object).tolist()
    advantages = np.zeros_like(returns)
    for i, span in enumerate(spans):
        others = [j for j, gid in enumerate(ids) if gid == ids[i] and j != i]
        for k, position in enumerate(span):
            reached = [spans[j][k] for j in others if len(spans[j]) > k]
            holders = [j for j in others if len(spans[j]) > k]
            baseline = 0.0                                     # no other member has a k-th valid token
            if holders:
                numerator = sum(returns[j, t] * energy[j, t] for j, t in zip(holders, reached))
                denominator = sum(energy[j, t] for j, t in zip(holders, reached))
                baseline = numerator / (denominator + epsilon) if denominator > 0 else 0.0
            advantages[i, position] = returns[i, position] - baseline
    return _np_out(rewards, advantages * m, returns)


# ----------------------------------------------------------------------------------------------------------------------
# torch ports (verl convention: token_level_rewards, response_mask, index, old_log_probs, sum_pi_squared, …)


def _t_in(*tensors):
    dtype = torch.float64 if any(t is not None and t.dtype == torch.float64 for t in tensors) else torch.float32
    return dtype, [None if t is None else t.to(dtype) for t in tensors]


def _labels(index, device) -> tuple[torch.Tensor, int]:
    first: dict = {}
    labels = [first.setdefault(key, len(first)) for key in np.asarray(index, dtype=object).tolist()]
    return torch.tensor(labels, device=device), len(first)


def _torch_token_energy(lp, spp, rho, bugs=frozenset()):
    """wₜ = 1 − 2πₜ + Σπ²ₜ (× ρₜ²)."""
    pi = torch.exp(lp.clamp(max=0))
    w = 1 - 2 * pi + spp
    if rho is not None:
        w = w * (rho if "rho_not_squared" in bugs else rho ** 2)
    return w


def _torch_energy(lp, spp, mask, rho, bugs=frozenset()):
    return torch.cumsum(_torch_token_energy(lp, spp, rho, bugs) * mask, dim=-1)


def _index_add_advantages(returns, energy, m, index, dtype, epsilon, handle_zero_tail, out, block_rows=None,
                          bugs=frozenset()):
    """The group step of the index_add_ ports: B = Σ GWm / (Σ Wm + ε) per (group, position), 0 for singletons, the
    zero tail; returns (advantages, returns) in ``out``. ``block_rows``: the group sums taken over blocks of that many
    rows, each block's sums added into the totals, as a GPU kernel with a grid over rows adds them atomically (bug
    ``group_totals_assigned_per_row_block``: each block's sums assigned, so a group holds its last block's rows)."""
    labels, groups = _labels(index, returns.device)
    weight = energy * m

    def group_sums(values):
        totals = torch.zeros(groups, returns.shape[1], dtype=dtype)
        block = block_rows or max(values.shape[0], 1)          # without block_rows, one block: 0 + Σ, exactly Σ
        for start in range(0, values.shape[0], block):
            rows = slice(start, start + block)
            part = torch.zeros_like(totals).index_add_(0, labels[rows], values[rows])
            totals = part if "group_totals_assigned_per_row_block" in bugs else totals + part
        return totals

    numerator, denominator = group_sums(returns * weight), group_sums(weight)
    sizes = torch.bincount(labels, minlength=groups)
    baselines = (numerator / (denominator + epsilon))[labels]
    baselines[sizes[labels] < 2] = 0.0
    if handle_zero_tail:
        baselines = _torch_zero_tail(baselines, m, labels, groups, sizes)
    return ((returns - baselines) * m).to(out), returns.to(out)


def _torch_zero_tail(baselines, mask, labels, groups, sizes):
    lengths = mask.sum(-1)
    for g in range(groups):
        rows = torch.nonzero(labels == g).flatten()
        if len(rows) < 2:
            continue
        ordered, _ = torch.sort(lengths[rows])
        winners = rows[lengths[rows] == ordered[-1]]
        if len(winners) == 1 and ordered[-1] > ordered[-2]:
            baselines[winners[0], int(ordered[-2]):] = 0.0
    return baselines


@torch.no_grad()
def torch_index_add(token_level_rewards, response_mask, index, old_log_probs, sum_pi_squared,
                    rollout_is_weights=None, handle_zero_tail=True, epsilon=1e-8, block_rows=None, bugs=frozenset(),
                    **kwargs):
    """Single-turn OTB with index_add_ group sums; ``block_rows``: taken over blocks of that many rows and added into
    the totals, as a GPU kernel's grid over the rows of a shuffled batch adds them."""
    out = token_level_rewards.dtype
    dtype, (r, m, lp, spp, rho) = _t_in(token_level_rewards, response_mask, old_log_probs, sum_pi_squared,
                                        rollout_is_weights)
    returns = torch.flip(torch.cumsum(torch.flip(r * m, [-1]), -1), [-1])
    energy = _torch_energy(lp, spp, m, rho, bugs)
    return _index_add_advantages(returns, energy, m, index, dtype, epsilon, handle_zero_tail, out, block_rows, bugs)


@torch.no_grad()
def torch_scatter_add(token_level_rewards, response_mask, index, old_log_probs, sum_pi_squared,
                      rollout_is_weights=None, handle_zero_tail=True, epsilon=1e-8, bugs=frozenset(), **kwargs):
    """Single-turn OTB with scatter_add_ group sums and returns as total minus prefix."""
    out = token_level_rewards.dtype
    dtype, (r, m, lp, spp, rho) = _t_in(token_level_rewards, response_mask, old_log_probs, sum_pi_squared,
                                        rollout_is_weights)
    masked = r * m
    returns = masked.sum(-1, keepdim=True) - torch.cumsum(masked, -1) + masked
    pi = torch.exp(lp.clamp(max=0))
    w = (1 - pi) ** 2 + (spp - pi ** 2)
    if rho is not None:
        w = w * rho * rho
    energy = torch.cumsum(w * m, -1)
    labels, groups = _labels(index, r.device)
    spread = labels[:, None].expand_as(r)
    weight = energy * m
    numerator = torch.zeros(groups, r.shape[1], dtype=dtype).scatter_add_(0, spread, returns * weight)
    denominator = torch.zeros(groups, r.shape[1], dtype=dtype).scatter_add_(0, spread, weight)
    baselines = numerator.gather(0, spread) / (denominator.gather(0, spread) + epsilon)
    sizes = torch.bincount(labels, minlength=groups)
    baselines = torch.where((sizes[labels] > 1)[:, None], baselines, torch.zeros_like(baselines))
    if handle_zero_tail:
        baselines = _torch_zero_tail(baselines, m, labels, groups, sizes)
    return ((returns - baselines) * m).to(out), returns.to(out)


@torch.no_grad()
def torch_one_reversed_scan(token_level_rewards, response_mask, index, old_log_probs, sum_pi_squared,
                            rollout_is_weights=None, handle_zero_tail=True, epsilon=1e-8, bugs=frozenset(), **kwargs):
    """Single-turn OTB with one reversed cumsum for both scans: the returns are its reward half, and the energy its
    energy half read backwards — Wₜ = (row total) − (suffix sum from t) + own term."""
    out = token_level_rewards.dtype
    dtype, (r, m, lp, spp, rho) = _t_in(token_level_rewards, response_mask, old_log_probs, sum_pi_squared,
                                        rollout_is_weights)
    terms = torch.stack([r * m, _torch_token_energy(lp, spp, rho) * m])                     # [2, B, T]
    suffix = torch.flip(torch.cumsum(torch.flip(terms, [-1]), -1), [-1])
    returns = suffix[0]
    energy = suffix[1][:, :1] - suffix[1] + terms[1]
    return _index_add_advantages(returns, energy, m, index, dtype, epsilon, handle_zero_tail, out)


@torch.no_grad()
def torch_index_put_accumulate(token_level_rewards, response_mask, index, old_log_probs, sum_pi_squared,
                               rollout_is_weights=None, handle_zero_tail=True, epsilon=1e-8, bugs=frozenset(),
                               **kwargs):
    """Single-turn OTB with index_put_(accumulate=True) group sums."""
    out = token_level_rewards.dtype
    dtype, (r, m, lp, spp, rho) = _t_in(token_level_rewards, response_mask, old_log_probs, sum_pi_squared,
                                        rollout_is_weights)
    returns = torch.flip(torch.cumsum(torch.flip(r * m, [-1]), -1), [-1])
    energy = _torch_energy(lp, spp, m, rho)
    labels, groups = _labels(index, r.device)
    weight = energy * m
    numerator = torch.zeros(groups, r.shape[1], dtype=dtype)
    denominator = torch.zeros(groups, r.shape[1], dtype=dtype)
    numerator.index_put_((labels,), returns * weight, accumulate=True)
    denominator.index_put_((labels,), weight, accumulate=True)
    baselines = numerator[labels] / (denominator[labels] + epsilon)
    sizes = torch.bincount(labels, minlength=groups)
    baselines = baselines * (sizes[labels] > 1)[:, None]
    if handle_zero_tail:
        baselines = _torch_zero_tail(baselines, m, labels, groups, sizes)
    return ((returns - baselines) * m).to(out), returns.to(out)


@torch.no_grad()
def torch_one_hot_matmul(token_level_rewards, response_mask, index, old_log_probs, sum_pi_squared,
                         rollout_is_weights=None, handle_zero_tail=True, epsilon=1e-8, bugs=frozenset(), **kwargs):
    """Single-turn OTB with a one-hot [G, B] membership matrix: group sums are matrix products; the zero tail from
    vectorised group maxima (bug ``group_codes_in_input_dtype``: the matrix built by comparing the group codes
    0 … G − 1 in the inputs' dtype, where bfloat16 holds integers exactly only up to 256 and float16 up to 2048)."""
    out = token_level_rewards.dtype
    dtype, (r, m, lp, spp, rho) = _t_in(token_level_rewards, response_mask, old_log_probs, sum_pi_squared,
                                        rollout_is_weights)
    returns = torch.flip(torch.cumsum(torch.flip(r * m, [-1]), -1), [-1])
    energy = _torch_energy(lp, spp, m, rho)
    if "contiguous_groups" in bugs:
        groups = len(dict.fromkeys(np.asarray(index, dtype=object).tolist()))
        labels = torch.arange(r.shape[0]) * groups // r.shape[0]
    else:
        labels, groups = _labels(index, r.device)
    if "group_codes_in_input_dtype" in bugs:
        member = (labels.to(out)[None, :] == torch.arange(groups).to(out)[:, None]).to(dtype)
    else:
        member = torch.nn.functional.one_hot(labels, groups).T.to(dtype)
    weight = energy * m
    baselines = (member @ (returns * weight) / (member @ weight + epsilon))[labels]
    sizes = member.sum(1)
    baselines = torch.where((sizes[labels] > 1)[:, None], baselines, 0.0)
    if handle_zero_tail:
        lengths = m.sum(-1)
        per_group = torch.where(member > 0, lengths[None, :], -1.0)
        longest = per_group.amax(1)
        at_longest = (member > 0) & (lengths[None, :] == longest[:, None])
        second = torch.where((member > 0) & ~at_longest, per_group, -1.0).amax(1)
        unique = (at_longest.sum(1) == 1) & (sizes > 1)
        row_is_winner = (at_longest & unique[:, None]).any(0)
        start = second.clamp(min=0)[labels]
        tail = row_is_winner[:, None] & (torch.arange(r.shape[1])[None, :] >= start[:, None])
        baselines = torch.where(tail, 0.0, baselines)
    return ((returns - baselines) * m).to(out), returns.to(out)


@torch.no_grad()
def torch_multi_turn_scatter(token_level_rewards, response_mask, index, old_log_probs, sum_pi_squared,
                             rollout_is_weights=None, handle_zero_tail=True, epsilon=1e-8, bugs=frozenset(),
                             **kwargs):
    """Multi-turn OTB vectorised: compaction by scatter into [B, T], index_add_ over non-empty members, gather back."""
    out = token_level_rewards.dtype
    dtype, (r, m, lp, spp, rho) = _t_in(token_level_rewards, response_mask, old_log_probs, sum_pi_squared,
                                        rollout_is_weights)
    returns = torch.flip(torch.cumsum(torch.flip(r * m, [-1]), -1), [-1])
    energy = _torch_energy(lp, spp, m, rho)
    rows, positions = m.shape
    valid = m > 0
    rank = torch.where(valid, torch.cumsum(valid.long(), -1) - 1, positions)
    lengths = valid.sum(-1)

    def compact(values):
        return torch.zeros(rows, positions + 1, dtype=dtype).scatter_(1, rank, values)[:, :positions]

    present = (torch.arange(positions)[None, :] < lengths[:, None]).to(dtype)
    labels, groups = _labels(index, r.device)
    nonempty = lengths > 0
    if "tir_keeps_empty_members" not in bugs:
        labels = torch.where(nonempty, labels, groups)               # empty rows to a discarded extra group
    weight = compact(energy * m) * present
    grid_returns = compact(returns)
    numerator = torch.zeros(groups + 1, positions, dtype=dtype).index_add_(0, labels, grid_returns * weight)
    denominator = torch.zeros(groups + 1, positions, dtype=dtype).index_add_(0, labels, weight)
    sizes = torch.bincount(labels, minlength=groups + 1)
    baselines = numerator[labels] / (denominator[labels] + epsilon)
    baselines = torch.where(((sizes[labels] > 1) & (labels < groups))[:, None], baselines, 0.0)
    if handle_zero_tail:
        for g in range(groups):
            members = torch.nonzero(labels == g).flatten()
            if len(members) < 2:
                continue
            ordered, _ = torch.sort(lengths[members])
            winners = members[lengths[members] == ordered[-1]]
            if len(winners) == 1 and ordered[-1] > ordered[-2]:
                baselines[winners[0], int(ordered[-2]):] = 0.0
    grid_advantages = grid_returns - baselines
    advantages = torch.where(valid, grid_advantages.gather(1, rank.clamp(max=positions - 1)), 0.0)
    return advantages.to(out), returns.to(out)


def _blocked_scan(values, block: int, *, reverse: bool, carried: bool = True):
    """Inclusive scan of [B, T] values along positions, ``block`` positions at a time as a GPU kernel's BLOCK_T-wide
    tiles take it: each block's local cumsum plus the carry, the total of the blocks already done (those before it;
    after it with ``reverse``, Gₜ = Σ_{k≥t}) — without ``carried`` every block restarts at 0."""
    out = torch.empty_like(values)
    carry = torch.zeros_like(values[:, :1])
    starts = range(0, values.shape[1], block)
    for start in reversed(starts) if reverse else starts:
        tile = values[:, start:start + block]
        local = torch.flip(torch.cumsum(torch.flip(tile, [-1]), -1), [-1]) if reverse else torch.cumsum(tile, -1)
        out[:, start:start + block] = local + carry if carried else local
        carry = carry + tile.sum(-1, keepdim=True)
    return out


@torch.no_grad()
def torch_blocked_scans(token_level_rewards, response_mask, index, old_log_probs, sum_pi_squared,
                        rollout_is_weights=None, handle_zero_tail=True, epsilon=1e-8, block=4096, bugs=frozenset(),
                        **kwargs):
    """Single-turn OTB with the returns and the energy scanned ``block`` positions at a time with a running carry
    (:func:`_blocked_scan`), as a GPU kernel tiles T (bugs ``returns_carry_lost``, ``energy_carry_lost``: that scan's
    carry dropped, so Gₜ sums t's own block only, or Wₜ restarts at every multiple of ``block``)."""
    out = token_level_rewards.dtype
    dtype, (r, m, lp, spp, rho) = _t_in(token_level_rewards, response_mask, old_log_probs, sum_pi_squared,
                                        rollout_is_weights)
    returns = _blocked_scan(r * m, block, reverse=True, carried="returns_carry_lost" not in bugs)
    energy = _blocked_scan(_torch_token_energy(lp, spp, rho) * m, block, reverse=False,
                           carried="energy_carry_lost" not in bugs)
    return _index_add_advantages(returns, energy, m, index, dtype, epsilon, handle_zero_tail, out)


# ----------------------------------------------------------------------------------------------------------------------
# Σπ² ports (one argument: logits [..., V])


def _spp_in(logits):
    return logits.to(torch.float64 if logits.dtype == torch.float64 else torch.float32)


@torch.no_grad()
def spp_shifted_log_sum_exp(logits, **kwargs):
    """Σπ² = exp(lse(2(z − m)) − 2·lse(z − m)), the row maximum m subtracted first."""
    z = _spp_in(logits)
    shifted = z - z.amax(-1, keepdim=True)
    return torch.exp(torch.logsumexp(2 * shifted, -1) - 2 * torch.logsumexp(shifted, -1)).to(logits.dtype)


@torch.no_grad()
def spp_unshifted_log_sum_exp(logits, **kwargs):
    """Σπ² = exp(lse(2z) − 2·lse(z)), written independently of verl but with its formula (computed in float32)."""
    z = _spp_in(logits)
    return torch.exp(torch.logsumexp(2 * z, dim=-1) - 2 * torch.logsumexp(z, dim=-1)).to(logits.dtype)


@torch.no_grad()
def spp_softmax_then_square(logits, bugs=frozenset(), top: int = 16384, **kwargs):
    """Σπ² = Σ softmax(z)² (bug ``largest_squares_only``: the sum over the ``top`` largest π only, as a port that
    reuses a top-k sampling buffer would — exact where the softmax is peaked, not where it is flat)."""
    p = torch.softmax(_spp_in(logits), dim=-1)
    if "largest_squares_only" in bugs and p.shape[-1] > top:
        p = p.topk(top, dim=-1).values
    return (p * p).sum(-1).to(logits.dtype)


@torch.no_grad()
def spp_chunked_online(logits, chunk: int = 1000, bugs=frozenset(), **kwargs):
    """One online pass over vocabulary chunks keeping (max, Σe, Σe²), rescaled as the maximum grows (bug
    ``half_running_totals``: for bfloat16/float16 logits the pass and its running totals stay in that dtype;
    ``excluded_as_minus_1e4``: −inf logits replaced by −1e4 first, an "excluded" token made merely unlikely;
    ``rescale_not_squared``: Σe² rescaled by e^{m_old − m_new} instead of its square, wrong only once a later chunk
    raises the maximum; ``chunk_starts_one_late``: every chunk after the first starts one column past its edge, so one
    column in ``chunk`` is never summed)."""
    z = logits if "half_running_totals" in bugs and logits.dtype in (torch.bfloat16, torch.float16) else _spp_in(logits)
    if "excluded_as_minus_1e4" in bugs:
        z = torch.nan_to_num(z, neginf=-1e4)
    running = torch.full(z.shape[:-1], -torch.inf, dtype=z.dtype)
    first, second = torch.zeros_like(running), torch.zeros_like(running)
    for index, part in enumerate(z.split(chunk, dim=-1)):
        if "chunk_starts_one_late" in bugs and index > 0:
            part = part[..., 1:]
            if part.shape[-1] == 0:
                continue
        new = torch.maximum(running, part.amax(-1))
        safe = torch.where(torch.isfinite(new), new, torch.zeros_like(new))
        scale = torch.exp(running - safe)
        e = torch.exp(part - safe[..., None])
        if "chunk_local_softmax" in bugs:                       # each chunk normalised on its own, never rescaled
            first, second = first + 1.0, second + ((e / e.sum(-1, keepdim=True)) ** 2).sum(-1)
        else:
            first = first * scale + e.sum(-1)
            second = second * (scale if "rescale_not_squared" in bugs else scale * scale) + (e * e).sum(-1)
        running = new
    if "chunk_local_softmax" in bugs:
        return (second / first).to(logits.dtype)
    return (second / (first * first)).to(logits.dtype)


def spp_numpy_ratio(logits, **kwargs):
    """NumPy: S₂/S₁² with shifted exponentials, float64 for float64 logits and float32 otherwise."""
    z = np.asarray(logits)
    z = z.astype(np.float64 if z.dtype == np.float64 else np.float32)
    e = np.exp(z - z.max(axis=-1, keepdims=True))
    return (np.square(e).sum(-1) / np.square(e.sum(-1))).astype(np.asarray(logits).dtype)


@torch.no_grad()
def spp_in_float16(logits, **kwargs):
    """BUG: Σπ² evaluated in float16 whatever the input precision."""
    z = logits.to(torch.float16)
    e = torch.exp(z - z.amax(-1, keepdim=True))
    return ((e * e).sum(-1, dtype=torch.float32) / e.sum(-1, dtype=torch.float32) ** 2).to(logits.dtype)


# ----------------------------------------------------------------------------------------------------------------------
# fused token statistics (f(hidden, weight, token_ids, temperature=τ) → (log π, entropy, Σπ²))


def torch_unfused_token_statistics(hidden, weight, token_ids, temperature=1.0, bugs=frozenset(), **kwargs):
    """The plain program a fused kernel replaces: the whole [N, V] logits (float32 for half precision inputs),
    log_softmax, a gather, H = −Σ p·log p and Σπ² = Σ p²; autograd does the backward pass."""
    compute = torch.float64 if torch.float64 in (hidden.dtype, weight.dtype) else torch.float32
    if "logits_cast_to_float32" in bugs:          # verl's FusedLinearForPPO: logits in the inputs' dtype, then float32
        logits = (hidden @ weight.T / temperature).to(torch.float32)
    else:
        logits = hidden.to(compute) @ weight.to(compute).T
    if "temperature_after_log_softmax" not in bugs and "logits_cast_to_float32" not in bugs:
        logits = logits / temperature
    log_probs = torch.log_softmax(logits, dim=-1)
    if "temperature_after_log_softmax" in bugs:
        log_probs = log_probs / temperature
    probs = log_probs.exp()
    chosen = log_probs.gather(-1, token_ids[..., None].to(torch.int64))[..., 0]
    entropy = -(log_probs if "entropy_without_probabilities" in bugs else probs * log_probs).sum(-1)
    spp = probs.square().sum(-1).detach()
    if "logits_cast_to_float32" in bugs:          # as verl returns them: log π float32, the rest in the logits' dtype
        orig = torch.promote_types(hidden.dtype, weight.dtype)
        entropy, spp = entropy.to(orig), spp.to(orig)
    return chosen, entropy, spp


def torch_vocabulary_blocks_token_statistics(hidden, weight, token_ids, temperature=1.0, block=8192,
                                             bugs=frozenset(), **kwargs):
    """The structure of a fused LM-head kernel: the logits of ``block`` vocabulary columns at a time (float32 for
    half-precision inputs), folded into a running maximum m, S₁ = Σ e^{z−m}, T = Σ e^{z−m}·z and S₂ = Σ e^{2(z−m)},
    each rescaled when m grows; log π = z_y − (m + log S₁), H = m + log S₁ − T/S₁, Σπ² = S₂/S₁². Autograd does the
    backward pass. (Bug ``shifted_tilt_not_corrected``: the tilt kept shifted, U = Σ e^{z−m}·(z − m), and H =
    log S₁ − U/S₁, but U only rescaled when m grows, without the (m_old − m_new)·S₁ it gains; ``block_starts_one_late``:
    every block after the first starts one column past its edge, so one column in ``block`` is never summed.)"""
    compute = torch.float64 if torch.float64 in (hidden.dtype, weight.dtype) else torch.float32
    lead = token_ids.shape
    h = hidden.to(compute).reshape(-1, hidden.shape[-1])
    ids = token_ids.reshape(-1).to(torch.int64)
    tokens = h.shape[0]
    maximum = torch.full((tokens,), 0.0 if "running_max_starts_at_zero" in bugs else -torch.inf, dtype=compute)
    s1, tilt, s2, chosen = (torch.zeros(tokens, dtype=compute) for _ in range(4))
    for edge in range(0, weight.shape[0], block):
        start = edge + 1 if "block_starts_one_late" in bugs and edge > 0 else edge
        if start >= min(edge + block, weight.shape[0]):
            continue
        z = h @ weight[start:edge + block].to(compute).T / temperature
        block_max = z.detach().amax(-1)
        grown = torch.maximum(maximum, block_max)
        scale = torch.exp(maximum - grown)
        if "block_max_not_rescaled" in bugs:        # each block against its own maximum, the sums added as they are
            grown, scale = block_max, torch.ones_like(scale)
        e = torch.exp(z - grown[:, None])
        if "shifted_tilt_not_corrected" in bugs:
            tilt = tilt * scale + (e * (z - grown[:, None])).sum(-1)
        else:
            tilt = tilt * scale + (e * z).sum(-1)
        s1, s2 = s1 * scale + e.sum(-1), s2 * scale**2 + (e * e).sum(-1)
        maximum = torch.maximum(maximum, grown)
        inside = (ids >= start) & (ids < start + z.shape[1])
        picked = z.gather(1, (ids - start).clamp(0, z.shape[1] - 1)[:, None])[:, 0]
        chosen = chosen + torch.where(inside, picked, torch.zeros_like(picked))
    log_sum = maximum + torch.log(s1)
    entropy = torch.log(s1) - tilt / s1 if "shifted_tilt_not_corrected" in bugs else log_sum - tilt / s1
    return ((chosen - log_sum).reshape(lead), entropy.reshape(lead), (s2 / s1**2).detach().reshape(lead))


def torch_reentrant_checkpoint_token_statistics(hidden, weight, token_ids, temperature=1.0, chunk=512, **kwargs):
    """The plain program over ``chunk`` tokens at a time, each chunk under ``torch.utils.checkpoint`` with
    ``use_reentrant=True`` (the activation-memory saving of older trainers): its gradients reach the leaves through
    ``backward()`` only — ``torch.autograd.grad`` refuses such a graph."""
    from torch.utils.checkpoint import checkpoint
    h, ids = hidden.reshape(-1, hidden.shape[-1]), token_ids.reshape(-1)
    parts = [checkpoint(torch_unfused_token_statistics, h[start:start + chunk], weight, ids[start:start + chunk],
                        temperature, use_reentrant=True) for start in range(0, h.shape[0], chunk)]
    return tuple(torch.cat(values).reshape(token_ids.shape) for values in zip(*parts))


class _TokenChunkStatistics(torch.autograd.Function):
    """The forward and backward passes of a fused kernel chunked over tokens (rows of h), ``chunk`` at a time: per
    chunk the logits z = h·Wᵀ/τ (float32 for half-precision inputs), log π = log_softmax(z), H = −Σ π·log π and
    Σπ² = Σ π²; backward rebuilds each chunk's logits and forms ∂z = g_lp·(onehot(y) − π) − g_H·π·(log π + H),
    ∂h = ∂z·W/τ, and adds the chunk's ∂zᵀh/τ into ∂W (bug ``grad_weight_assigned_per_chunk``: ∂W assigned per chunk,
    so it holds the last chunk's tokens only; ``grad_weight_chunk_starts_one_late``: each chunk after the first adds
    ∂zᵀh/τ from its second token on, so one token in ``chunk`` is missing from ∂W alone)."""

    @staticmethod
    def forward(ctx, hidden, weight, token_ids, temperature, chunk, bugs):
        compute = torch.float64 if torch.float64 in (hidden.dtype, weight.dtype) else torch.float32
        h, w = hidden.reshape(-1, hidden.shape[-1]).to(compute), weight.to(compute)
        ids = token_ids.reshape(-1).to(torch.int64)
        per_chunk = []
        for start in range(0, h.shape[0], chunk):
            log_p = torch.log_softmax(h[start:start + chunk] @ w.T / temperature, dim=-1)
            p = log_p.exp()
            per_chunk.append((log_p.gather(1, ids[start:start + chunk, None])[:, 0], -(p * log_p).sum(-1),
                              p.square().sum(-1)))
        log_probs, entropy, spp = (torch.cat(parts) for parts in zip(*per_chunk))
        ctx.save_for_backward(h, w, ids, entropy)
        ctx.temperature, ctx.chunk, ctx.bugs = temperature, chunk, bugs
        ctx.input_shape, ctx.input_dtypes = hidden.shape, (hidden.dtype, weight.dtype)
        log_probs, entropy, spp = (value.reshape(token_ids.shape) for value in (log_probs, entropy, spp))
        ctx.mark_non_differentiable(spp)
        return log_probs, entropy, spp

    @staticmethod
    def backward(ctx, grad_log_probs, grad_entropy, _):
        h, w, ids, entropy = ctx.saved_tensors
        g_lp, g_h = grad_log_probs.reshape(-1).to(h.dtype), grad_entropy.reshape(-1).to(h.dtype)
        grad_hidden, grad_weight = torch.empty_like(h), torch.zeros_like(w)
        for start in range(0, h.shape[0], ctx.chunk):
            rows = slice(start, start + ctx.chunk)
            log_p = torch.log_softmax(h[rows] @ w.T / ctx.temperature, dim=-1)
            p = log_p.exp()
            dz = -g_lp[rows, None] * p - g_h[rows, None] * p * (log_p + entropy[rows, None])
            dz.scatter_add_(1, ids[rows, None], g_lp[rows, None])
            grad_hidden[rows] = dz @ w / ctx.temperature
            if "grad_weight_assigned_per_chunk" in ctx.bugs:
                grad_weight = dz.T @ h[rows] / ctx.temperature
            elif "grad_weight_chunk_starts_one_late" in ctx.bugs and start > 0:
                grad_weight += dz[1:].T @ h[start + 1:start + ctx.chunk] / ctx.temperature
            else:
                grad_weight += dz.T @ h[rows] / ctx.temperature
        return (grad_hidden.reshape(ctx.input_shape).to(ctx.input_dtypes[0]), grad_weight.to(ctx.input_dtypes[1]),
                None, None, None, None)


def torch_token_chunks_token_statistics(hidden, weight, token_ids, temperature=1.0, chunk=1024, bugs=frozenset(),
                                        **kwargs):
    """A fused kernel's other chunking: ``chunk`` tokens at a time over the whole vocabulary, with its own backward
    pass (:class:`_TokenChunkStatistics`) instead of autograd's."""
    return _TokenChunkStatistics.apply(hidden, weight, token_ids, temperature, chunk, bugs)


# ----------------------------------------------------------------------------------------------------------------------
# the net

def _variant(function: Callable, *bugs: str, **settings: Any) -> Callable:
    def port(*args, **kwargs):
        return function(*args, bugs=frozenset(bugs), **settings, **kwargs)
    suffix = "_".join(list(bugs) + [f"{name}{value}" for name, value in settings.items()])
    port.__name__ = port.__qualname__ = f"{function.__name__}__{suffix}"
    return port


def _torch_output_float32(function: Callable) -> Callable:
    def port(*args, **kwargs):
        return tuple(value.float() for value in function(*args, **kwargs))
    port.__name__ = port.__qualname__ = f"{function.__name__}__outputs_float32"
    return port


def _is_weights_on_returns(token_level_rewards, response_mask, index, old_log_probs, sum_pi_squared,
                           rollout_is_weights=None, **options):
    """BUG: the importance weights scale the rewards instead of the energy."""
    rewards = token_level_rewards if rollout_is_weights is None else token_level_rewards * rollout_is_weights
    return torch_index_add(rewards, response_mask, index, old_log_probs, sum_pi_squared, None, **options)


def _masks_rewards_in_place(token_level_rewards, response_mask, index, old_log_probs, sum_pi_squared, **options):
    """BUG: the caller's rewards masked in place (rewards.mul_(mask)) — the results are right, and only masked
    positions change, so the change shows only on inputs with padding."""
    token_level_rewards.mul_(response_mask)
    return torch_index_add(token_level_rewards, response_mask, index, old_log_probs, sum_pi_squared, **options)


def _clamps_weights_in_place(token_level_rewards, response_mask, index, old_log_probs, sum_pi_squared,
                             rollout_is_weights=None, **options):
    """BUG: the caller's importance weights clamped in place (a truncated-IS habit) — only weights above the clamp
    change."""
    if rollout_is_weights is not None:
        rollout_is_weights.clamp_(max=2.0)
    return torch_index_add(token_level_rewards, response_mask, index, old_log_probs, sum_pi_squared,
                           rollout_is_weights, **options)


def _groups_per_micro_batch(token_level_rewards, response_mask, index, old_log_probs, sum_pi_squared,
                            rollout_is_weights=None, **options):
    """BUG: OTB computed inside the actor's micro-batch loop (where Σπ² is at hand), 32 rows at a time: a group whose
    rows straddle two micro-batches is split in two (its parts may be singletons)."""
    parts = []
    for start in range(0, token_level_rewards.shape[0], 32):
        rows = slice(start, start + 32)
        parts.append(torch_index_add(token_level_rewards[rows], response_mask[rows], np.asarray(index)[rows],
                                     old_log_probs[rows], sum_pi_squared[rows],
                                     None if rollout_is_weights is None else rollout_is_weights[rows], **options))
    return torch.cat([part[0] for part in parts]), torch.cat([part[1] for part in parts])


def _truncates_weights_again(token_level_rewards, response_mask, index, old_log_probs, sum_pi_squared,
                             rollout_is_weights=None, **options):
    """BUG: the rollout importance weights truncated again at 5 inside the estimator (a truncated-IS habit; the
    trainer has already applied its own threshold)."""
    weights = None if rollout_is_weights is None else rollout_is_weights.clamp(max=5.0)
    return torch_index_add(token_level_rewards, response_mask, index, old_log_probs, sum_pi_squared, weights,
                           **options)


def torch_keywords_in_another_order(index, token_level_rewards, response_mask, sum_pi_squared, old_log_probs,
                                    rollout_is_weights=None, epsilon=1e-8, handle_zero_tail=True, **kwargs):
    """Correct: verl's parameter names in another order — verl's trainer passes every argument by keyword."""
    return torch_index_add(token_level_rewards, response_mask, index, old_log_probs, sum_pi_squared,
                           rollout_is_weights, handle_zero_tail, epsilon)


def _zero_tail_off_by_default(token_level_rewards, response_mask, index, old_log_probs, sum_pi_squared,
                              rollout_is_weights=None, handle_zero_tail=False, epsilon=1e-8, **kwargs):
    """BUG: the zero tail off unless asked for (verl's multi-turn docstring says "Default: False"; its code and its
    trainer's call — which never passes the option — give True)."""
    return torch_index_add(token_level_rewards, response_mask, index, old_log_probs, sum_pi_squared,
                           rollout_is_weights, handle_zero_tail, epsilon)


def _epsilon_default_1e6(token_level_rewards, response_mask, index, old_log_probs, sum_pi_squared,
                         rollout_is_weights=None, handle_zero_tail=True, epsilon=1e-6, **kwargs):
    """BUG: ε defaults to 1e-6 where verl's is 1e-8 — what the trainer, which never passes it, gets."""
    return torch_index_add(token_level_rewards, response_mask, index, old_log_probs, sum_pi_squared,
                           rollout_is_weights, handle_zero_tail, epsilon)


def torch_without_room_for_config(token_level_rewards, response_mask, index, old_log_probs, sum_pi_squared,
                                  rollout_is_weights=None, handle_zero_tail=True, epsilon=1e-8):
    """Right values, but no ``**kwargs``: verl's trainer also passes ``config=…`` and would raise TypeError."""
    return torch_index_add(token_level_rewards, response_mask, index, old_log_probs, sum_pi_squared,
                           rollout_is_weights, handle_zero_tail, epsilon)


def torch_own_parameter_names(rewards, mask, uid, logp, spp, rollout_is_weights=None, handle_zero_tail=True,
                              epsilon=1e-8, **kwargs):
    """Right values in verl's positional order, under the author's own parameter names."""
    return torch_index_add(rewards, mask, uid, logp, spp, rollout_is_weights, handle_zero_tail, epsilon)


def _names_of_log_pi_and_sum_swapped(token_level_rewards, response_mask, index, sum_pi_squared, old_log_probs,
                                     rollout_is_weights=None, handle_zero_tail=True, epsilon=1e-8, **kwargs):
    """BUG: the 4th and 5th parameters named in the wrong order while the body takes them by position (verl's
    positional order) — right for a positional caller, wrong for verl's trainer, which passes them by name."""
    return torch_index_add(token_level_rewards, response_mask, index, sum_pi_squared, old_log_probs,
                           rollout_is_weights, handle_zero_tail, epsilon)


def torch_options_from_config(token_level_rewards, response_mask, index, old_log_probs, sum_pi_squared,
                              rollout_is_weights=None, handle_zero_tail=True, epsilon=1e-8, config=None, **kwargs):
    """Correct: written as verl's own config-reading estimators are (``assert config is not None``, the options from
    ``config.get`` with the given ones as defaults) — right in the trainer, which always passes its algorithm
    config."""
    assert config is not None, "this estimator reads its options from verl's algorithm config"
    return torch_index_add(token_level_rewards, response_mask, index, old_log_probs, sum_pi_squared,
                           rollout_is_weights, config.get("otb_handle_zero_tail", handle_zero_tail),
                           config.get("otb_epsilon", epsilon))


def _config_defaults_of_its_own(token_level_rewards, response_mask, index, old_log_probs, sum_pi_squared,
                                rollout_is_weights=None, handle_zero_tail=True, epsilon=1e-8, config=None, **kwargs):
    """BUG: where a config is given, ε read from it with a default of the author's own (1e-6) — what verl's trainer,
    whose algorithm config has no such key, gets; right when called without a config."""
    if config is not None:
        epsilon = config.get("otb_epsilon", 1e-6)
    return torch_index_add(token_level_rewards, response_mask, index, old_log_probs, sum_pi_squared,
                           rollout_is_weights, handle_zero_tail, epsilon)


def _baselines_like_the_mask(token_level_rewards, response_mask, index, old_log_probs, sum_pi_squared,
                             rollout_is_weights=None, handle_zero_tail=True, epsilon=1e-8, **kwargs):
    """BUG: the baselines kept in ``torch.zeros_like(response_mask)`` — an integer buffer with verl's int64 mask, so
    every baseline is truncated toward 0; right with a float mask."""
    advantages, returns = torch_index_add(token_level_rewards, response_mask, index, old_log_probs, sum_pi_squared,
                                          rollout_is_weights, handle_zero_tail, epsilon)
    baselines = torch.zeros_like(response_mask)
    baselines[...] = returns - advantages
    return (returns - baselines) * response_mask, returns


def _counts_members_with_index_add(token_level_rewards, response_mask, index, old_log_probs, sum_pi_squared,
                                   rollout_is_weights=None, handle_zero_tail=True, epsilon=1e-8, **kwargs):
    """BUG: the valid members per group and position counted by ``index_add_`` of the mask into a float buffer —
    raises with verl's int64 mask (index_add_ needs one dtype); right with a float mask."""
    labels, groups = _labels(index, token_level_rewards.device)
    valid = torch.zeros(groups, response_mask.shape[1], dtype=token_level_rewards.dtype)
    valid.index_add_(0, labels, response_mask)
    return torch_index_add(token_level_rewards, response_mask, index, old_log_probs, sum_pi_squared,
                           rollout_is_weights, handle_zero_tail, epsilon)


def _narrowed(index, dtype: torch.dtype):
    ids = np.asarray(index)
    return torch.as_tensor(ids).to(dtype).numpy() if ids.dtype.kind in "iu" else index


def ids_through_float32(token_level_rewards, response_mask, index, old_log_probs, sum_pi_squared,
                        rollout_is_weights=None, handle_zero_tail=True, epsilon=1e-8, **kwargs):
    """BUG: integer ids passed through a float32 tensor before grouping: neighbours above 2²⁴ merge."""
    return torch_index_add(token_level_rewards, response_mask, _narrowed(index, torch.float32), old_log_probs,
                           sum_pi_squared, rollout_is_weights, handle_zero_tail, epsilon)


def ids_through_int32(token_level_rewards, response_mask, index, old_log_probs, sum_pi_squared,
                      rollout_is_weights=None, handle_zero_tail=True, epsilon=1e-8, **kwargs):
    """BUG: integer ids passed through an int32 tensor before grouping: ids 2³² apart merge."""
    return torch_index_add(token_level_rewards, response_mask, _narrowed(index, torch.int32), old_log_probs,
                           sum_pi_squared, rollout_is_weights, handle_zero_tail, epsilon)


def ids_through_float64(token_level_rewards, response_mask, index, old_log_probs, sum_pi_squared,
                        rollout_is_weights=None, handle_zero_tail=True, epsilon=1e-8, **kwargs):
    """BUG: integer ids passed through a float64 tensor before grouping: neighbours above 2⁵³ (64-bit hashes) merge."""
    return torch_index_add(token_level_rewards, response_mask, _narrowed(index, torch.float64), old_log_probs,
                           sum_pi_squared, rollout_is_weights, handle_zero_tail, epsilon)


CORRECT: dict[str, tuple[str, str, Callable[..., Any]]] = {
    "numpy_loops": ("otb", "numpy", numpy_loops),
    "numpy_reduceat": ("otb", "numpy", numpy_reduceat),
    "numpy_same_group_matrix": ("otb", "numpy", numpy_same_group_matrix),
    "numpy_multi_turn_loops": ("tir-otb", "numpy", numpy_multi_turn_loops),
    "numpy_leave_one_out": ("loo-otb", "numpy", numpy_leave_one_out),
    "numpy_multi_turn_leave_one_out": ("tir-loo-otb", "numpy", numpy_multi_turn_leave_one_out),
    "torch_index_add": ("otb", "verl", torch_index_add),
    "torch_scatter_add": ("otb", "verl", torch_scatter_add),
    "torch_index_put_accumulate": ("otb", "verl", torch_index_put_accumulate),
    "torch_one_reversed_scan": ("otb", "verl", torch_one_reversed_scan),
    "torch_one_hot_matmul": ("otb", "verl", torch_one_hot_matmul),
    "torch_keywords_in_another_order": ("otb", "verl", torch_keywords_in_another_order),
    "torch_options_from_config": ("otb", "verl", torch_options_from_config),
    "torch_multi_turn_scatter": ("tir-otb", "verl", torch_multi_turn_scatter),
    "torch_blocked_scans": ("otb", "verl", torch_blocked_scans),
    "torch_row_blocks": ("otb", "verl", _variant(torch_index_add, block_rows=1024)),
    "spp_shifted_log_sum_exp": ("sum-pi-squared", "verl", spp_shifted_log_sum_exp),
    "spp_unshifted_log_sum_exp": ("sum-pi-squared", "verl", spp_unshifted_log_sum_exp),
    "spp_softmax_then_square": ("sum-pi-squared", "verl", spp_softmax_then_square),
    "spp_chunked_online": ("sum-pi-squared", "verl", spp_chunked_online),
    "spp_numpy_ratio": ("sum-pi-squared", "numpy", spp_numpy_ratio),
    "torch_unfused_token_statistics": ("fused-token-statistics", "verl", torch_unfused_token_statistics),
    "torch_vocabulary_blocks_token_statistics": ("fused-token-statistics", "verl",
                                                 torch_vocabulary_blocks_token_statistics),
    "torch_token_chunks_token_statistics": ("fused-token-statistics", "verl", torch_token_chunks_token_statistics),
    "torch_reentrant_checkpoint_token_statistics": ("fused-token-statistics", "verl",
                                                    torch_reentrant_checkpoint_token_statistics),
}

# right values, but verl's trainer could not call them by keyword: checked positionally, with a signature warning
CALLED_POSITIONALLY: dict[str, tuple[str, str, Callable[..., Any]]] = {
    "torch_without_room_for_config": ("otb", "verl", torch_without_room_for_config),
    "torch_own_parameter_names": ("otb", "verl", torch_own_parameter_names),
}

BUGGY: dict[str, tuple[str, str, Callable[..., Any], str]] = {
    "forward_returns": ("otb", "numpy", _variant(numpy_loops, "forward_returns"),
                        "returns by a forward cumsum (reward so far)"),
    "epsilon_in_numerator": ("otb", "numpy", _variant(numpy_loops, "epsilon_in_numerator"),
                             "ε added to the numerator as well: (ΣGWm + ε)/(ΣWm + ε)"),
    "pi_for_pi_squared": ("otb", "numpy", _variant(numpy_loops, "pi_for_pi_squared"),
                          "π in place of π²: w = (1 − π)² + (Σπ² − π)"),
    "mask_after_cumsum": ("otb", "numpy", _variant(numpy_loops, "mask_after_cumsum"),
                          "the mask applied after the cumsum: W = cumsum(w)·m"),
    "rho_not_squared": ("otb", "numpy", _variant(numpy_loops, "rho_not_squared"), "ρ instead of ρ² in the energy"),
    "rho_not_squared_torch": ("otb", "verl", _variant(torch_index_add, "rho_not_squared"),
                              "ρ instead of ρ² (torch port)"),
    "padding_in_group_sums": ("otb", "numpy", _variant(numpy_loops, "padding_in_group_sums"),
                              "padding counted in the group sums (W not masked there)"),
    "per_step_energy": ("otb", "numpy", _variant(numpy_loops, "per_step_energy"), "per-step energy m·w, not W"),
    "rewards_unmasked": ("otb", "numpy", _variant(numpy_loops, "rewards_unmasked"),
                         "returns from unmasked rewards"),
    "zero_tail_off_by_one": ("otb", "numpy", _variant(numpy_loops, "zero_tail_off_by_one"),
                             "the zero tail starts one position late"),
    "ties_get_a_tail": ("otb", "numpy", _variant(numpy_loops, "ties_get_a_tail"),
                        "rare input: all-tied (or tied) longest lengths still get a zero tail"),
    "empty_rows_unranked": ("otb", "numpy", _variant(numpy_loops, "empty_rows_unranked"),
                            "rare input: empty rows left out of the zero-tail ranking (a lone non-empty member "
                            "keeps its baseline)"),
    "pairs_are_singletons": ("otb", "numpy", _variant(numpy_loops, "pairs_are_singletons"),
                             "rare input: groups of two treated as singletons (N < 3 instead of N < 2)"),
    "contiguous_groups": ("otb", "verl", _variant(torch_one_hot_matmul, "contiguous_groups"),
                          "groups assumed contiguous blocks (balance_batch reorders rows)"),
    "is_weights_on_returns": ("otb", "verl", _is_weights_on_returns, "ρ scales the rewards instead of the energy"),
    "masks_rewards_in_place": ("otb", "verl", _masks_rewards_in_place,
                               "the caller's rewards masked in place (only padded positions change)"),
    "clamps_weights_in_place": ("otb", "verl", _clamps_weights_in_place,
                                "the caller's importance weights clamped in place"),
    "outputs_float32": ("otb", "verl", _torch_output_float32(torch_index_add),
                        "outputs always float32 (float64 inputs lose precision)"),
    "zero_tail_off_by_default": ("otb", "verl", _zero_tail_off_by_default,
                                 "handle_zero_tail defaults to False (the trainer never passes it)"),
    "epsilon_default_1e6": ("otb", "verl", _epsilon_default_1e6, "ε defaults to 1e-6 (the trainer never passes it)"),
    "config_defaults_of_its_own": ("otb", "verl", _config_defaults_of_its_own,
                                   "ε read from the trainer's config with a default of its own (1e-6)"),
    "baselines_like_the_mask": ("otb", "verl", _baselines_like_the_mask,
                                "baselines in zeros_like(response_mask): integers with verl's int64 mask"),
    "counts_members_with_index_add": ("otb", "verl", _counts_members_with_index_add,
                                      "index_add_ of the mask into a float buffer (raises with an int64 mask)"),
    "ids_through_float32": ("otb", "verl", ids_through_float32,
                            "integer ids through a float32 tensor (neighbours above 2²⁴ merge)"),
    "ids_through_int32": ("otb", "verl", ids_through_int32,
                          "integer ids through an int32 tensor (ids 2³² apart merge)"),
    "ids_through_float64": ("otb", "verl", ids_through_float64,
                            "integer ids through a float64 tensor (neighbours above 2⁵³ merge)"),
    "group_codes_in_input_dtype": ("otb", "verl", _variant(torch_one_hot_matmul, "group_codes_in_input_dtype"),
                                   "the one-hot group matrix from group codes compared in the inputs' dtype "
                                   "(bfloat16: groups above 256 merge)"),
    "names_of_log_pi_and_sum_swapped": ("otb", "verl", _names_of_log_pi_and_sum_swapped,
                                        "old_log_probs and sum_pi_squared named in each other's places"),
    "groups_per_micro_batch": ("otb", "verl", _groups_per_micro_batch,
                               "groups formed per 32-row micro-batch (a group straddling two is split)"),
    "truncates_weights_again": ("otb", "verl", _truncates_weights_again, "ρ truncated again at 5 in the estimator"),
    "group_totals_assigned_per_row_block": (
        "otb", "verl", _variant(torch_index_add, "group_totals_assigned_per_row_block", block_rows=1024),
        "group sums over blocks of 1024 rows, each block's sums stored into the group's totals instead of added"),
    "returns_carry_lost_4096": ("otb", "verl", _variant(torch_blocked_scans, "returns_carry_lost"),
                                "returns scanned in 4096-position blocks, the later blocks' carry lost"),
    "energy_carry_lost_4096": ("otb", "verl", _variant(torch_blocked_scans, "energy_carry_lost"),
                               "the energy scanned in 4096-position blocks, the earlier blocks' carry lost"),
    "tir_keeps_observations": ("tir-otb", "numpy", _variant(numpy_multi_turn_loops, "tir_keeps_observations"),
                               "TIR compaction keeps the observation (tool-output) tokens inside a response"),
    "tir_keeps_empty_members": ("tir-otb", "verl", _variant(torch_multi_turn_scatter, "tir_keeps_empty_members"),
                                "TIR keeps members with no valid token in their group"),
    "loo_denominator_keeps_self": ("loo-otb", "numpy", _variant(numpy_leave_one_out, "loo_denominator_keeps_self"),
                                   "leave-one-out: own term removed from the numerator only"),
    "loo_members_cap16": ("loo-otb", "numpy", _variant(numpy_leave_one_out, "members_cap16"),
                          "leave-one-out over a static block of 16 members (the 17th and later left out)"),
    "tir_loo_aligned_by_position": ("tir-loo-otb", "numpy",
                                    _variant(numpy_multi_turn_leave_one_out, "tir_loo_aligned_by_position"),
                                    "multi-turn leave-one-out aligned by absolute position, tool holes not skipped"),
    "spp_in_float16": ("sum-pi-squared", "verl", spp_in_float16, "Σπ² evaluated in float16"),
    "spp_largest_16384_only": ("sum-pi-squared", "verl",
                               _variant(spp_softmax_then_square, "largest_squares_only", top=16384),
                               "Σπ² summed over the 16384 largest probabilities only (flat softmaxes lose mass)"),
    "spp_excluded_as_minus_1e4": ("sum-pi-squared", "verl", _variant(spp_chunked_online, "excluded_as_minus_1e4"),
                                  "−inf logits replaced by −1e4 (wrong only beside logits near −1e4: a golden case)"),
    "spp_chunk_local_softmax": ("sum-pi-squared", "verl", _variant(spp_chunked_online, "chunk_local_softmax"),
                                "Σπ² from a chunk-local softmax (chunks never rescaled to the row maximum)"),
    "spp_rescale_not_squared_65536": ("sum-pi-squared", "verl",
                                      _variant(spp_chunked_online, "rescale_not_squared", chunk=65536),
                                      "65536-wide vocabulary chunks, Σe² rescaled by e^{m_old − m_new}, not its "
                                      "square"),
    "spp_chunk_starts_one_late": ("sum-pi-squared", "verl",
                                  _variant(spp_chunked_online, "chunk_starts_one_late", chunk=8192),
                                  "8192-column chunks, each after the first starting one column late (one term in "
                                  "8192 never summed: inside float32's bound, shown by the flat float64 case)"),
    "temperature_after_log_softmax": ("fused-token-statistics", "verl",
                                      _variant(torch_unfused_token_statistics, "temperature_after_log_softmax"),
                                      "log_softmax of h·Wᵀ, then divided by τ (instead of the softmax of h·Wᵀ/τ)"),
    "block_max_not_rescaled": ("fused-token-statistics", "verl",
                               _variant(torch_vocabulary_blocks_token_statistics, "block_max_not_rescaled"),
                               "vocabulary blocks of 8192 columns, each against its own maximum, never rescaled"),
    "shifted_tilt_not_corrected_32768": ("fused-token-statistics", "verl",
                                         _variant(torch_vocabulary_blocks_token_statistics,
                                                  "shifted_tilt_not_corrected", block=32768),
                                         "32768-column vocabulary blocks, the entropy's tilt kept shifted and only "
                                         "rescaled as the maximum grows (the (m_old − m_new)·S₁ term forgotten)"),
    "block_starts_one_late": ("fused-token-statistics", "verl",
                              _variant(torch_vocabulary_blocks_token_statistics, "block_starts_one_late"),
                              "vocabulary blocks of 8192 columns, each after the first starting one column late"),
    "running_max_starts_at_zero": ("fused-token-statistics", "verl",
                                   _variant(torch_vocabulary_blocks_token_statistics, "running_max_starts_at_zero"),
                                   "the running maximum of the vocabulary blocks started at 0 instead of −∞"),
    "grad_weight_assigned_per_chunk": ("fused-token-statistics", "verl",
                                       _variant(torch_token_chunks_token_statistics, "grad_weight_assigned_per_chunk"),
                                       "a backward pass over 1024-token chunks assigns ∂W = ∂zᵀh/τ per chunk, not +="),
    "grad_weight_assigned_per_8192_token_chunk": (
        "fused-token-statistics", "verl",
        _variant(torch_token_chunks_token_statistics, "grad_weight_assigned_per_chunk", chunk=8192),
        "the same over 8192-token chunks, as a kernel that sizes its chunks by a budget of logits takes at small V"),
    "grad_weight_chunk_starts_one_late": (
        "fused-token-statistics", "verl",
        _variant(torch_token_chunks_token_statistics, "grad_weight_chunk_starts_one_late"),
        "a backward pass over 1024-token chunks whose ∂W sum starts one token late in every chunk after the first"),
    "entropy_without_probabilities": ("fused-token-statistics", "verl",
                                      _variant(torch_unfused_token_statistics, "entropy_without_probabilities"),
                                      "the entropy as −Σ log π (the probabilities forgotten)"),
}
