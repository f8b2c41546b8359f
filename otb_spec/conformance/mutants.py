"""Deliberately broken OTB implementations ("mutants"): the verifier's own test.

Each mutant is a function with verl 0.9.1's signature (the ``verl`` convention) carrying exactly one realistic bug —
the kind found in trainers' OTB code: a mask forgotten in one place, π where log π belongs, ρ instead of ρ², a sum
along the wrong axis, a group layout assumed, a zero-tail length off by one, half-precision accumulation, an input
modified in place; and, for fused kernels (``fused_*``, called ``f(hidden, weight, token_ids, temperature=τ)``), a
chunked pass that forgets the global maximum, a backward pass without the entropy term or without 1/τ, Σπ² from
unshifted exponentials, log π off by the temperature, an entropy term with the wrong sign. They share one
straightforward, correct torch implementation per kind (``straightforward_*``, the controls): the bug is the only
difference, so a mutant is rejected for its bug and nothing else.

``otb-spec mutants`` runs the verifier over every mutant and the controls and prints which layers caught each
(docs/conformance.md has the table); ``tests/test_conformance_mutants.py`` asserts that every mutant is rejected and
every control accepted. Needs torch.

    >>> from otb_spec.conformance.mutants import MUTANTS
    >>> MUTANTS["rho_not_squared"].bug
    'importance weights enter the energy as ρ instead of ρ²'
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

__all__ = ["Mutant", "MUTANTS", "CONTROLS", "KillTable", "kill_table", "straightforward_otb",
           "straightforward_multi_turn_otb", "straightforward_sum_pi_squared", "straightforward_fused_token_statistics"]


@dataclass(frozen=True)
class Mutant:
    """A broken implementation: ``name``, the ``kind`` it implements, its ``bug`` in one line, and the function."""

    name: str
    kind: str
    bug: str
    function: Callable[..., Any]

    @property
    def target(self) -> str:
        """How to name it to ``otb-spec verify``."""
        return f"otb_spec.conformance.mutants:{self.function.__name__}"


def _compute_dtype(dtype: torch.dtype, bugs: frozenset) -> torch.dtype:
    if "accumulates_in_input_dtype" in bugs:
        return dtype
    return torch.float64 if dtype == torch.float64 else torch.float32


# ----------------------------------------------------------------------------------------------------------------------
# the shared implementation, with switches for the bugs


def _cumsum(values, bugs):
    """Cumulative sum over positions; with the bug, a running total kept in the input's half precision (as a scan
    in bfloat16 does — torch's own cumsum accumulates half precision in float32)."""
    if "accumulates_in_input_dtype" not in bugs or values.dtype not in (torch.bfloat16, torch.float16):
        return values.cumsum(dim=-1)
    total = torch.zeros_like(values[..., 0])
    out = torch.empty_like(values)
    for t in range(values.shape[-1]):
        total = total + values[..., t]
        out[..., t] = total
    return out


def _returns_and_energy(rewards, mask, log_probs, sum_pi_squared, weights, bugs):
    """G = reverse cumsum of r·m, W = cumsum of m·w with w = (1 − 2π + Σπ²)·ρ²."""
    masked_rewards = rewards if "rewards_not_masked" in bugs else rewards * mask
    if "forward_cumsum_returns" in bugs:
        returns = _cumsum(masked_rewards, bugs)
    else:
        returns = _cumsum(masked_rewards.flip(dims=[-1]), bugs).flip(dims=[-1])
    if "mutates_inputs" in bugs:
        pi = log_probs.exp_()                                  # in place, to save a [B, T] buffer
    elif "log_prob_as_probability" in bugs:
        pi = log_probs
    else:
        pi = log_probs.exp()
    proxy = 1 - 2 * pi + sum_pi_squared
    if weights is not None and "importance_weights_ignored" not in bugs:
        proxy = proxy * (weights if "rho_not_squared" in bugs else weights**2)
    if "energy_ignores_mask" in bugs:
        energy = proxy.cumsum(dim=-1)
    elif "per_step_energy" in bugs:
        energy = proxy * mask
    elif "cumsum_over_batch_axis" in bugs:
        energy = (proxy * mask).cumsum(dim=0)
    else:
        energy = _cumsum(proxy * mask, bugs)
    return returns, energy


def _group_labels(index: Any, rows: int, device: torch.device, bugs: frozenset) -> torch.Tensor:
    """[B] group number of each row: dict of ids in order of first appearance (as verl)."""
    ids = [repr(i) for i in np.asarray(index, dtype=object).tolist()]
    first: dict = {}
    labels = [first.setdefault(i, len(first)) for i in ids]
    if "batch_wide_baseline" in bugs:
        labels = [0] * rows
    elif "contiguous_groups" in bugs:
        size = max(rows // len(first), 1)                     # "groups are blocks of N consecutive rows"
        labels = [min(row // size, len(first) - 1) for row in range(rows)]
    return torch.tensor(labels, device=device, dtype=torch.int64)


def _lengths(mask: torch.Tensor, bugs: frozenset) -> torch.Tensor:
    """Lengths as exact counts (in the mask's float dtype only where that dtype holds them exactly)."""
    if "length_from_last_index" in bugs:
        positions = torch.arange(1, mask.shape[-1] + 1, device=mask.device, dtype=torch.float32)
        return (positions * mask).amax(dim=-1)              # index of the last valid token + 1
    return mask.sum(dim=-1, dtype=torch.float32)


def _baseline(returns, energy, mask, labels, lengths, handle_zero_tail, epsilon, bugs):
    """B_t = Σ_i G W m / (Σ_i W m + ε) per group, singleton → 0, then the zero tail."""
    groups = int(labels.max()) + 1 if labels.numel() else 0
    membership = torch.nn.functional.one_hot(labels, groups).T.to(returns.dtype)        # [G, B]
    numerator = membership @ (returns * energy * mask)
    denominator = membership @ (energy if "denominator_without_mask" in bugs else energy * mask) + epsilon
    group_baseline = torch.where(denominator > 0, numerator / torch.where(denominator > 0, denominator, 1.0), 0.0)
    baseline = group_baseline[labels]
    sizes = membership.sum(dim=1)
    if "singleton_gets_baseline" not in bugs:
        baseline = torch.where((sizes[labels] > 1)[:, None], baseline, torch.zeros_like(baseline))
    if handle_zero_tail and "zero_tail_ignored" not in bugs and groups:
        member = membership > 0
        spread = torch.where(member, lengths[None, :], torch.full_like(membership, -1.0))
        longest = spread.amax(dim=1)
        at_longest = member & (lengths[None, :] == longest[:, None])
        second = torch.where(member & ~at_longest, spread, torch.full_like(spread, -1.0)).amax(dim=1)
        if "zero_tail_second_distinct_length" in bugs:
            # "the longest" = the first member at the maximum; "second" = the next distinct length
            first_longest = torch.zeros_like(at_longest)
            first_longest[torch.arange(groups), at_longest.to(torch.int8).argmax(dim=1)] = True
            applies = (sizes > 1) & (second >= 0)
            chosen = first_longest
        else:
            second = torch.where(at_longest.sum(dim=1) > 1, longest, second)
            applies = (sizes > 1) & (longest > second)
            chosen = at_longest
        row_applies = (chosen & applies[:, None]).any(dim=0)                                  # [B]
        start = second.clamp(min=0)[labels] + (1 if "zero_tail_off_by_one" in bugs else 0)
        positions = torch.arange(mask.shape[-1], device=mask.device, dtype=start.dtype)
        tail = row_applies[:, None] & (positions[None, :] >= start[:, None])
        baseline = torch.where(tail, torch.zeros_like(baseline), baseline)
    return baseline


def _finish(advantages, returns, mask, dtype, bugs):
    if "advantages_not_masked" not in bugs:
        advantages = advantages * mask
    if "returns_masked" in bugs:
        returns = returns * mask
    out = torch.float32 if "upcasts_output" in bugs else dtype
    return advantages.to(out), returns.to(out)


@torch.no_grad()
def _single_turn(token_level_rewards, response_mask, index, old_log_probs, sum_pi_squared, rollout_is_weights=None,
                 handle_zero_tail=True, epsilon=1e-8, bugs=frozenset()):
    dtype = token_level_rewards.dtype
    compute = _compute_dtype(dtype, bugs)
    log_probs = old_log_probs if "mutates_inputs" in bugs else old_log_probs.to(compute)
    rewards, mask, spp = (x.to(compute) for x in (token_level_rewards, response_mask, sum_pi_squared))
    weights = None if rollout_is_weights is None else rollout_is_weights.to(compute)
    returns, energy = _returns_and_energy(rewards, mask, log_probs, spp, weights, bugs)
    labels = _group_labels(index, rewards.shape[0], rewards.device, bugs)
    baseline = _baseline(returns, energy, mask, labels, _lengths(mask, bugs), handle_zero_tail, epsilon, bugs)
    return _finish(returns - baseline, returns, mask, dtype, bugs)


@torch.no_grad()
def _multi_turn(token_level_rewards, response_mask, index, old_log_probs, sum_pi_squared, rollout_is_weights=None,
                handle_zero_tail=True, epsilon=1e-8, bugs=frozenset()):
    if "tir_without_compaction" in bugs:
        return _single_turn(token_level_rewards, response_mask, index, old_log_probs, sum_pi_squared,
                            rollout_is_weights, handle_zero_tail, epsilon)
    dtype = token_level_rewards.dtype
    compute = _compute_dtype(dtype, bugs)
    rewards, mask, log_probs, spp = (x.to(compute) for x in (token_level_rewards, response_mask, old_log_probs,
                                                             sum_pi_squared))
    weights = None if rollout_is_weights is None else rollout_is_weights.to(compute)
    returns, energy = _returns_and_energy(rewards, mask, log_probs, spp, weights, bugs)
    rows, positions = mask.shape
    valid = mask > 0
    # compaction: the k-th valid token of each row goes to column k (invalid tokens to a discarded extra column)
    rank = torch.where(valid, valid.to(torch.int64).cumsum(dim=-1) - 1, positions)
    lengths = valid.sum(dim=-1)

    def compact(values):
        grid = torch.zeros(rows, positions + 1, dtype=values.dtype, device=values.device)
        return grid.scatter(1, rank, values)[:, :positions]

    compact_mask = (torch.arange(positions, device=mask.device)[None, :] < lengths[:, None]).to(compute)
    labels = _group_labels(index, rows, mask.device, bugs)
    if "tir_keeps_empty_members" not in bugs:
        empty = lengths == 0
        labels = torch.where(empty, labels.max() + 1 + torch.arange(rows, device=mask.device), labels)
        labels = torch.unique(labels, return_inverse=True)[1]
    if "tir_zero_tail_on_absolute_lengths" in bugs:
        compact_lengths = _lengths(mask, frozenset({"length_from_last_index"}))
    else:
        compact_lengths = lengths.to(torch.float32)
    compact_baseline = _baseline(compact(returns), compact(energy), compact_mask, labels, compact_lengths,
                                 handle_zero_tail, epsilon, bugs)
    baseline = compact_baseline.gather(1, rank.clamp(max=positions - 1))
    return _finish((returns - baseline) * mask, returns, mask, dtype, bugs)


@torch.no_grad()
def _sum_pi_squared(logits, bugs=frozenset()):
    dtype = logits.dtype
    z = logits.to(_compute_dtype(dtype, bugs))
    if "softmax_without_max_shift" in bugs:
        e = z.exp()
        return ((e * e).sum(dim=-1) / e.sum(dim=-1) ** 2).to(dtype)
    if "inverted_log_ratio" in bugs:
        return torch.exp(2 * torch.logsumexp(z, dim=-1) - torch.logsumexp(2 * z, dim=-1)).to(dtype)
    # one online pass over vocabulary chunks, keeping (max, Σ exp, Σ exp²) with rescaling
    running_max = torch.full(z.shape[:-1], -torch.inf, dtype=z.dtype, device=z.device)
    first = torch.zeros(z.shape[:-1], dtype=z.dtype, device=z.device)
    second = torch.zeros_like(first)
    for chunk in z.split(16, dim=-1):
        new_max = torch.maximum(running_max, chunk.amax(dim=-1))
        shift = torch.where(torch.isfinite(new_max), new_max, torch.zeros_like(new_max))
        scale = torch.exp(running_max - shift)
        shifted = torch.exp(chunk - shift[..., None])
        first = first * scale + shifted.sum(dim=-1)
        second = second * (scale if "online_rescale_not_squared" in bugs else scale * scale) + (shifted * shifted).sum(
            dim=-1)
        running_max = new_max
    return (second / (first * first)).to(dtype)


# ----------------------------------------------------------------------------------------------------------------------
# fused token statistics: a chunked kernel with a custom backward, with switches for the bugs

def _fused_chunk(vocab: int) -> int:
    """Vocabulary columns per block: 16, or V/8 for large vocabularies (at most about nine blocks per pass)."""
    return max(16, vocab // 8)


def _row_sum(values, bugs, running=None):
    """``running`` (the rescaled total of the earlier chunks) + Σ over the vocabulary axis; with the half-precision
    bug, one running total kept in the inputs' precision across the whole vocabulary and fed 16-column tiles (as a
    kernel with a bfloat16 accumulator does: torch's own sum accumulates in float32)."""
    if "accumulates_in_input_dtype" not in bugs or values.dtype not in (torch.bfloat16, torch.float16):
        return values.sum(1) if running is None else running + values.sum(1)
    total = torch.zeros(values.shape[0], dtype=values.dtype) if running is None else running
    for tile in values.split(16, dim=1):
        total = total + tile.sum(1)
    return total


class _FusedStatistics(torch.autograd.Function):
    """(hidden [N, H], weight [V, H], ids [N]) → (log π, H, Σπ²) [N], walking the vocabulary in chunks of
    max(16, V/8) columns with online rescaling; the backward pass rebuilds each block of ∂z from lse and H."""

    @staticmethod
    def forward(ctx, hidden, weight, ids, temperature, bugs):
        half = hidden.dtype in (torch.bfloat16, torch.float16)
        compute = hidden.dtype if half and "accumulates_in_input_dtype" in bugs else (
            torch.float64 if torch.float64 in (hidden.dtype, weight.dtype) else torch.float32)
        if "mutates_hidden" in bugs:
            hidden.mul_(1.0 / temperature)                   # "scale once, in place, to save a copy"
            h = hidden.to(compute)
        else:
            h = hidden.to(compute) / temperature
        w = weight.to(compute)
        n, vocab = h.shape[0], w.shape[0]
        chunk = _fused_chunk(vocab)
        columns = vocab // chunk * chunk if "drops_partial_chunk" in bugs and vocab > chunk else vocab
        peak = torch.full((n,), -torch.inf, dtype=compute)
        s1, s2, tilt, chosen = (torch.zeros(n, dtype=compute) for _ in range(4))
        unshifted = torch.zeros(n, dtype=compute)
        for start in range(0, columns, chunk):
            stop = min(start + chunk, columns)
            z = h @ w[start:stop].T
            inside = (ids >= start) & (ids < stop)
            local_ids = (ids - start).clamp(0, stop - start - 1)
            picked = z.gather(1, local_ids[:, None])[:, 0]
            if "log_probs_off_by_temperature" in bugs:
                picked = picked * temperature                # the chosen logit taken before dividing by τ
            chosen = torch.where(inside, picked, chosen)
            unshifted = unshifted + torch.exp(2 * z).sum(1)  # only read by the unshifted-Σπ² bug
            local = z.amax(1)
            if "forgets_global_max" in bugs:                 # each chunk against its own maximum, never rescaled
                a = torch.exp(z - local[:, None])
                s1, s2 = s1 + a.sum(1), s2 + (a * a).sum(1)
                tilt = tilt + (a * (z - local[:, None])).sum(1)
                peak = torch.maximum(peak, local)
                continue
            new = torch.maximum(peak, local)
            a = torch.exp(z - new[:, None])
            terms = (a, a * a, a * (z - new[:, None]))
            if start == 0:
                s1, s2, tilt = (_row_sum(x, bugs) for x in terms)
            else:
                shift = peak - new
                factor = torch.exp(shift)
                tilt = _row_sum(terms[2], bugs, factor * (tilt + shift * s1))
                s1 = _row_sum(terms[0], bugs, factor * s1)
                s2 = _row_sum(terms[1], bugs, factor * factor * s2)
            peak = new
        lse = peak + torch.log(s1)
        log_probs = chosen - lse
        entropy = torch.log(s1) + tilt / s1 if "entropy_wrong_sign" in bugs else torch.log(s1) - tilt / s1
        if "sum_pi_squared_unshifted" in bugs:
            spp = unshifted / torch.square(torch.exp(lse))
        else:
            spp = s2 / torch.square(s1)
        ctx.save_for_backward(hidden, weight, ids, lse, entropy)
        ctx.configuration = (temperature, bugs, compute)
        ctx.mark_non_differentiable(spp)
        return log_probs, entropy, spp

    @staticmethod
    def backward(ctx, g_log_probs, g_entropy, _):
        hidden, weight, ids, lse, entropy = ctx.saved_tensors
        temperature, bugs, compute = ctx.configuration
        scale = 1.0 if "backward_forgets_temperature" in bugs else 1.0 / temperature
        if "mutates_hidden" in bugs:                         # the saved tensor holds h/τ
            scaled, h = hidden.to(compute), hidden.to(compute) * temperature
        else:
            scaled, h = hidden.to(compute) / temperature, hidden.to(compute)
        w = weight.to(compute)
        g_lp = torch.zeros_like(lse) if g_log_probs is None else g_log_probs.to(compute)
        g_h = torch.zeros_like(lse) if g_entropy is None else g_entropy.to(compute)
        d_hidden, d_weight = torch.zeros_like(h), torch.zeros_like(w)
        chunk = _fused_chunk(w.shape[0])
        for start in range(0, w.shape[0], chunk):
            stop = min(start + chunk, w.shape[0])
            log_probs = scaled @ w[start:stop].T - lse[:, None]
            probs = torch.exp(log_probs)
            d_logits = -g_lp[:, None] * probs
            if "backward_without_entropy_term" not in bugs:
                d_logits = d_logits - g_h[:, None] * probs * (log_probs + entropy[:, None])
            inside = (ids >= start) & (ids < stop)
            rows = torch.nonzero(inside)[:, 0]
            d_logits[rows, ids[rows] - start] += g_lp[rows]
            d_hidden += d_logits @ w[start:stop] * scale
            d_weight[start:stop] += d_logits.T @ h * scale
        return d_hidden.to(hidden.dtype), d_weight.to(weight.dtype), None, None, None


def _fused(hidden, weight, token_ids, temperature=1.0, bugs=frozenset()):
    n_hidden = hidden.shape[-1]
    lead = token_ids.shape
    if "flattens_3d_in_wrong_order" in bugs and hidden.dim() == 3:
        flat = hidden.transpose(0, 1).reshape(-1, n_hidden)          # [T, B, H] order; the ids stay [B, T]
    else:
        flat = hidden.reshape(-1, n_hidden)
    log_probs, entropy, spp = _FusedStatistics.apply(flat, weight, token_ids.reshape(-1).to(torch.int64),
                                                     float(temperature), bugs)
    return log_probs.reshape(lead), entropy.reshape(lead), spp.reshape(lead)


# ----------------------------------------------------------------------------------------------------------------------
# the controls (correct) and the mutants


def straightforward_otb(token_level_rewards, response_mask, index, old_log_probs, sum_pi_squared,
                        rollout_is_weights=None, handle_zero_tail=True, epsilon=1e-8, **kwargs):
    """A correct single-turn OTB (verl signature): group-membership matrix products, float32 accumulation."""
    return _single_turn(token_level_rewards, response_mask, index, old_log_probs, sum_pi_squared, rollout_is_weights,
                        handle_zero_tail, epsilon)


def straightforward_multi_turn_otb(token_level_rewards, response_mask, index, old_log_probs, sum_pi_squared,
                                   rollout_is_weights=None, handle_zero_tail=True, epsilon=1e-8, **kwargs):
    """A correct multi-turn OTB (verl signature): compaction by scatter, the single-turn baseline, gather back."""
    return _multi_turn(token_level_rewards, response_mask, index, old_log_probs, sum_pi_squared, rollout_is_weights,
                       handle_zero_tail, epsilon)


def straightforward_sum_pi_squared(logits, **kwargs):
    """A correct Σπ²: one online pass over vocabulary chunks of 16 with rescaled (max, Σexp, Σexp²)."""
    return _sum_pi_squared(logits)


def straightforward_fused_token_statistics(hidden, weight, token_ids, temperature=1.0, **kwargs):
    """A correct fused kernel (verl's signature for FusedLinearForPPO's forward): log π, entropy and Σπ² through
    vocabulary chunks of max(16, V/8) columns with online rescaling, a custom backward that rebuilds each block from
    lse and H, float32 accumulation for half precision."""
    return _fused(hidden, weight, token_ids, temperature)


CONTROLS: dict[str, tuple[str, Callable[..., Any]]] = {
    "otb": ("straightforward_otb", straightforward_otb),
    "tir-otb": ("straightforward_multi_turn_otb", straightforward_multi_turn_otb),
    "sum-pi-squared": ("straightforward_sum_pi_squared", straightforward_sum_pi_squared),
    "fused-token-statistics": ("straightforward_fused_token_statistics", straightforward_fused_token_statistics),
}

_OTB_BUGS = {
    "energy_ignores_mask": "the mask is forgotten in the realized energy: W = cumsum(w)",
    "per_step_energy": "per-step energy m·w instead of the cumulative W = cumsum(m·w)",
    "log_prob_as_probability": "log π used where π belongs: w = 1 − 2·log π + Σπ²",
    "rho_not_squared": "importance weights enter the energy as ρ instead of ρ²",
    "importance_weights_ignored": "rollout_is_weights accepted but never applied",
    "forward_cumsum_returns": "returns by a forward cumsum (return-so-far) instead of the reverse (return-to-go)",
    "rewards_not_masked": "returns from the unmasked rewards (rewards at masked positions leak in)",
    "cumsum_over_batch_axis": "the energy cumsum runs over the batch axis (dim=0) instead of positions",
    "batch_wide_baseline": "one baseline for the whole batch instead of one per prompt group",
    "contiguous_groups": "groups assumed to be blocks of N consecutive rows (index ignored beyond its count)",
    "denominator_without_mask": "the mask is forgotten in the denominator Σ W (but kept in the numerator)",
    "singleton_gets_baseline": "a group of one member gets G·W/(W + ε) ≈ G instead of baseline 0",
    "zero_tail_off_by_one": "the zero tail starts one position late (t > L₂ instead of t ≥ L₂)",
    "zero_tail_second_distinct_length": "ties for the longest: L₂ taken as the next distinct length, tail applied",
    "length_from_last_index": "length = index of the last valid token + 1, wrong with holes and left padding",
    "zero_tail_ignored": "handle_zero_tail is accepted but the zero tail is never applied",
    "advantages_not_masked": "advantages not multiplied by the mask (non-zero at padding and tool output)",
    "returns_masked": "returns multiplied by the mask (verl returns G unmasked)",
    "accumulates_in_input_dtype": "bfloat16 inputs: the cumulative sums (W, G) kept as running totals in bfloat16 "
                                  "instead of float32",
    "mutates_inputs": "π computed in place (old_log_probs.exp_()), overwriting the caller's log-probs",
    "upcasts_output": "outputs returned as float32 whatever the input dtype",
}
_TIR_BUGS = {
    "tir_without_compaction": "multi-turn computed like single-turn: members aligned by absolute position",
    "tir_keeps_empty_members": "members with no valid token stay in their group (a lone non-empty member is no "
                               "singleton)",
    "tir_zero_tail_on_absolute_lengths": "the zero tail uses the span to the last valid token, not the compacted "
                                         "length",
}
_SPP_BUGS = {
    "softmax_without_max_shift": "softmax without subtracting the max: exp overflows for logits near 1e4",
    "online_rescale_not_squared": "online pass rescales Σexp² by exp(m_old − m_new) instead of its square",
    "accumulates_in_input_dtype": "bfloat16 logits are exponentiated and summed in bfloat16",
    "inverted_log_ratio": "Σπ² = exp(2·lse(z) − lse(2z)) — the log-ratio inverted",
}

_FUSED_BUGS = {
    "forgets_global_max": "vocabulary chunks each summed against their own maximum and added without rescaling to "
                          "the global one",
    "backward_without_entropy_term": "the backward pass drops the entropy's term −g_H·π(log π + H) from ∂z",
    "backward_forgets_temperature": "the backward pass forgets 1/τ: ∂h = ∂z·W and ∂W = ∂zᵀh",
    "sum_pi_squared_unshifted": "Σπ² as Σe^{2z}/(Σe^z)² from unshifted exponentials, which overflow",
    "log_probs_off_by_temperature": "log π from the chosen logit taken before dividing by τ (z_y·τ − lse)",
    "entropy_wrong_sign": "the entropy as log S₁ + T/S₁: the sign of the tilt term flipped",
    "drops_partial_chunk": "the vocabulary loop stops at the last full chunk: the final tokens (V mod the chunk) are "
                           "left out",
    "flattens_3d_in_wrong_order": "3-D hidden states [B, T, H] flattened as [T, B, H] while the ids stay [B, T]",
    "mutates_hidden": "the hidden states scaled by 1/τ in place, overwriting the caller's tensor",
    "accumulates_in_input_dtype": "bfloat16 inputs: logits, exponentials and the running sums over 16-column tiles "
                                  "kept in bfloat16",
}


def _make(kind: str, bug: str, description: str) -> Mutant:
    bugs = frozenset({bug})
    if kind == "sum-pi-squared":
        def function(logits, **kwargs):
            return _sum_pi_squared(logits, bugs)
    elif kind == "fused-token-statistics":
        def function(hidden, weight, token_ids, temperature=1.0, **kwargs):
            return _fused(hidden, weight, token_ids, temperature, bugs)
    else:
        core = _multi_turn if kind == "tir-otb" else _single_turn

        def function(token_level_rewards, response_mask, index, old_log_probs, sum_pi_squared,
                     rollout_is_weights=None, handle_zero_tail=True, epsilon=1e-8, **kwargs):
            return core(token_level_rewards, response_mask, index, old_log_probs, sum_pi_squared, rollout_is_weights,
                        handle_zero_tail, epsilon, bugs)
    prefix = {"otb": "", "tir-otb": "", "sum-pi-squared": "spp_", "fused-token-statistics": "fused_"}[kind]
    name = prefix + bug
    function.__name__ = function.__qualname__ = name
    function.__doc__ = f"Mutant ({kind}): {description}."
    return Mutant(name, kind, description, function)


MUTANTS: dict[str, Mutant] = {}
for _kind, _bugs in (("otb", _OTB_BUGS), ("tir-otb", _TIR_BUGS), ("sum-pi-squared", _SPP_BUGS),
                     ("fused-token-statistics", _FUSED_BUGS)):
    for _bug, _description in _bugs.items():
        _mutant = _make(_kind, _bug, _description)
        MUTANTS[_mutant.name] = _mutant
        globals()[_mutant.name] = _mutant.function


# ----------------------------------------------------------------------------------------------------------------------
# the kill table

_TABLE_LAYERS = ("structure", "golden", "generated", "special")


@dataclass
class KillTable:
    """Which layers of the verifier reject each mutant, and whether the controls pass.

    ``rows``: ``(mutant, {layer: number of failed checks}, killed)``; ``controls``: ``(name, kind, conformant)``.
    """

    rows: list[tuple[Mutant, dict[str, int], bool]]
    controls: list[tuple[str, str, bool]]
    max_examples: int
    seed: int
    seconds: float

    @property
    def all_killed(self) -> bool:
        return all(killed for _, _, killed in self.rows)

    @property
    def controls_pass(self) -> bool:
        return all(ok for _, _, ok in self.controls)

    @property
    def kill_rate(self) -> str:
        killed = sum(killed for _, _, killed in self.rows)
        return f"{killed}/{len(self.rows)}"

    def _cells(self) -> list[list[str]]:
        cells = []
        for mutant, failed, killed in self.rows:
            cells.append([mutant.name, mutant.kind] + [str(failed.get(layer, 0)) for layer in _TABLE_LAYERS]
                         + ["killed" if killed else "SURVIVED", mutant.bug])
        return cells

    def _footer(self) -> list[str]:
        controls = ", ".join(f"{name} ({kind}): {'conformant' if ok else 'NOT CONFORMANT'}"
                             for name, kind, ok in self.controls)
        return [f"kill rate {self.kill_rate}; controls — {controls}",
                f"(failed checks per layer; otb-spec mutants --max-examples {self.max_examples} --seed {self.seed}, "
                f"{self.seconds:.0f} s)"]

    def to_text(self) -> str:
        header = ["mutant", "kind"] + list(_TABLE_LAYERS) + ["verdict", "bug"]
        rows = [header] + self._cells()
        widths = [max(len(row[c]) for row in rows) for c in range(len(header) - 1)]
        lines = ["  ".join(cell.ljust(width) for cell, width in zip(row[:-1], widths)) + "  " + row[-1]
                 for row in rows]
        return "\n".join(lines[:1] + ["─" * len(lines[0])] + lines[1:] + [""] + self._footer())

    def to_markdown(self) -> str:
        header = ["mutant", "kind"] + list(_TABLE_LAYERS) + ["verdict", "bug"]
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        for cells in self._cells():
            cells[0] = f"`{cells[0]}`"
            lines.append("| " + " | ".join(cells) + " |")
        return "\n".join(lines + [""] + self._footer())


def kill_table(*, max_examples: int = 100, seed: int = 0, progress: Any = None) -> KillTable:
    """Run the verifier (verl convention, CPU, every layer) over the controls and every mutant. Failing generated
    cases are not shrunk (only the verdict matters here)."""
    import time

    from otb_spec.conformance import verify

    start = time.perf_counter()
    controls = []
    for kind, (name, _) in CONTROLS.items():
        report = verify(f"otb_spec.conformance.mutants:{name}", kind, max_examples=max_examples, seed=seed,
                        shrink_budget=0)
        controls.append((name, kind, report.conformant))
    rows = []
    for number, mutant in enumerate(MUTANTS.values(), 1):
        if progress is not None:
            print(f"\r[{number}/{len(MUTANTS)}] {mutant.name:<40}", end="", file=progress, flush=True)
        report = verify(mutant.target, mutant.kind, max_examples=max_examples, seed=seed, shrink_budget=0)
        failed = {layer: sum(r.layer == layer for r in report.failures) for layer in _TABLE_LAYERS}
        rows.append((mutant, failed, not report.conformant))
    if progress is not None:
        print(file=progress)
    return KillTable(rows, controls, max_examples, seed, time.perf_counter() - start)
