"""A deliberately naive oracle: verl's OTB semantics transcribed one group and one token at a time.

Written from the specification (docs/verl-differences.md), independently of the vectorized reference: plain Python
loops, a dict of groups in order of first appearance, explicit per-position sums. Slow, obvious, and only used to
cross-check ``otb_spec`` on small batches.
"""

from __future__ import annotations

import numpy as np


def _returns(rewards, mask):
    B, T = rewards.shape
    G = np.zeros((B, T))
    for i in range(B):
        running = 0.0
        for t in range(T - 1, -1, -1):
            running += rewards[i, t] * mask[i, t]
            G[i, t] = running
    return G


def _realized_energy(log_probs, spp, mask, is_weights):
    B, T = log_probs.shape
    W = np.zeros((B, T))
    for i in range(B):
        running = 0.0
        for t in range(T):
            w = 1.0 - 2.0 * np.exp(log_probs[i, t]) + spp[i, t]
            if is_weights is not None:
                w *= is_weights[i, t] ** 2
            running += w * mask[i, t]
            W[i, t] = running
    return W


def _groups(ids, members):
    groups = {}
    for i in members:
        groups.setdefault(ids[i], []).append(i)
    return list(groups.values())


def _zero_tail(lengths, group):
    """(member, second length) if the group has a unique longest member, else None."""
    ordered = sorted(lengths[i] for i in group)
    longest, second = ordered[-1], ordered[-2]
    at_longest = [i for i in group if lengths[i] == longest]
    if len(at_longest) == 1 and longest > second:
        return at_longest[0], second
    return None


def single_turn(rewards, mask, ids, log_probs, spp, is_weights=None, handle_zero_tail=True, epsilon=1e-8):
    rewards, mask, log_probs, spp = (np.asarray(a, dtype=np.float64) for a in (rewards, mask, log_probs, spp))
    is_weights = None if is_weights is None else np.asarray(is_weights, dtype=np.float64)
    ids = list(np.asarray(ids, dtype=object))
    B, T = rewards.shape
    G = _returns(rewards, mask)
    W = _realized_energy(log_probs, spp, mask, is_weights)
    baselines = np.zeros((B, T))
    lengths = [int(mask[i].sum()) for i in range(B)]
    for group in _groups(ids, range(B)):
        if len(group) == 1:
            continue
        for t in range(T):
            numerator = sum(G[i, t] * W[i, t] * mask[i, t] for i in group)
            denominator = sum(W[i, t] * mask[i, t] for i in group) + epsilon
            value = numerator / denominator if denominator != 0 else 0.0
            for i in group:
                baselines[i, t] = value
        if handle_zero_tail:
            found = _zero_tail(lengths, group)
            if found is not None:
                member, second = found
                baselines[member, second:] = 0.0
    return (G - baselines) * mask, G


def multi_turn(rewards, mask, ids, log_probs, spp, is_weights=None, handle_zero_tail=True, epsilon=1e-8):
    rewards, mask, log_probs, spp = (np.asarray(a, dtype=np.float64) for a in (rewards, mask, log_probs, spp))
    is_weights = None if is_weights is None else np.asarray(is_weights, dtype=np.float64)
    ids = list(np.asarray(ids, dtype=object))
    B, T = rewards.shape
    G = _returns(rewards, mask)
    W = _realized_energy(log_probs, spp, mask, is_weights)
    positions = [[t for t in range(T) if mask[i, t] > 0] for i in range(B)]
    lengths = [len(p) for p in positions]
    compact_G = [[G[i, t] for t in positions[i]] for i in range(B)]
    compact_W = [[W[i, t] for t in positions[i]] for i in range(B)]
    compact_B = [[0.0] * lengths[i] for i in range(B)]
    for group in _groups(ids, [i for i in range(B) if lengths[i] > 0]):
        if len(group) == 1:
            continue
        for k in range(max(lengths[i] for i in group)):
            present = [i for i in group if k < lengths[i]]
            numerator = sum(compact_G[i][k] * compact_W[i][k] for i in present)
            denominator = sum(compact_W[i][k] for i in present) + epsilon
            value = numerator / denominator if denominator != 0 else 0.0
            for i in present:
                compact_B[i][k] = value
        if handle_zero_tail:
            found = _zero_tail(lengths, group)
            if found is not None:
                member, second = found
                for k in range(second, lengths[member]):
                    compact_B[member][k] = 0.0
    advantages = np.zeros((B, T))
    for i in range(B):
        for k, t in enumerate(positions[i]):
            advantages[i, t] = compact_G[i][k] - compact_B[i][k]
    return advantages, G


def leave_one_out(rewards, mask, ids, log_probs, spp, is_weights=None, epsilon=1e-8):
    """Position-aligned leave-one-out OTB: for member i at t, sums over the other valid members, each weighed by
    max(W, 0) (the spec's leave-one-out weights: negative energies come only from statistics within the slack)."""
    rewards, mask, log_probs, spp = (np.asarray(a, dtype=np.float64) for a in (rewards, mask, log_probs, spp))
    is_weights = None if is_weights is None else np.asarray(is_weights, dtype=np.float64)
    ids = list(np.asarray(ids, dtype=object))
    B, T = rewards.shape
    G = _returns(rewards, mask)
    W = _realized_energy(log_probs, spp, mask, is_weights)
    advantages = np.zeros((B, T))
    for group in _groups(ids, range(B)):
        for i in group:
            for t in range(T):
                if mask[i, t] == 0:
                    continue
                others = [j for j in group if j != i and mask[j, t] > 0]
                if not others:
                    baseline = 0.0
                else:
                    numerator = sum(G[j, t] * max(W[j, t], 0.0) for j in others)
                    denominator = sum(max(W[j, t], 0.0) for j in others)     # no baseline unless positive
                    baseline = numerator / (denominator + epsilon) if denominator > 0 else 0.0
                advantages[i, t] = G[i, t] - baseline
    return advantages, G


def sequence_baseline(values, weights, ids, leave_one_out):
    """b_i = Σ_j c_j x_j / Σ_j c_j over i's group (j ≠ i when leave_one_out); 0 when undefined."""
    ids = list(np.asarray(ids, dtype=object))
    out = np.zeros(len(ids))
    for group in _groups(ids, range(len(ids))):
        for i in group:
            members = [j for j in group if j != i] if leave_one_out else group
            if (leave_one_out and not members) or (not leave_one_out and len(group) < 2):
                continue
            total = sum(weights[j] for j in members)
            if total > 0:
                out[i] = sum(weights[j] * values[j] for j in members) / total
    return out
