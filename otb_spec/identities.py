"""Self-inclusive OTB is leave-one-out OTB shrunk token by token — and the way back from verl's outputs.

For member i of a prompt group, at an aligned token t, let Wⱼ be the realized energies, D = Σⱼ Wⱼmⱼ + ε and
D₋ᵢ = Σ_{j≠i} Wⱼmⱼ + ε. Wherever the self-inclusive baseline is the energy-weighted ratio (the group has at least two
members and verl's zero tail does not apply there),

    Aₜ^self = (1 − λₜⁱ)·Aₜ^loo,        λₜⁱ = Wₜⁱmₜⁱ / D = 1 − D₋ᵢ/D ∈ [0, 1],

exactly, ε included — the OTB analogue of group mean = (1 − 1/N)·RLOO (proofs/T7_self_inclusive_identity.md). verl's
``compute_optimal_token_baseline_advantage`` returns (Aₜ^self, Gₜ); this module turns them into the unbiased
leave-one-out advantages without touching verl's code.

Index convention: B trajectories × T positions, ``response_mask`` mₜ ∈ {0, 1}, ``group_ids`` [B]; float64 out.
Reference: Li, Xu et al. 2026, arXiv 2602.07078; verl ``verl/trainer/ppo/core_algos.py``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from otb_spec import _validation as check
from otb_spec._baseline import Grid, forced_zero, others_denominator, safe_ratio
from otb_spec.groups import group_segments, segment_sums
from otb_spec.otb import AdvantageResult
from otb_spec.proxy import _energy
from otb_spec.trajectory import cumulative_energy, importance_weights

__all__ = ["leave_one_out_from_self_inclusive"]


def leave_one_out_from_self_inclusive(
    advantages: Any,
    returns: Any,
    response_mask: Any,
    group_ids: Any,
    log_probs: Any,
    sum_pi_squared: Any,
    *,
    is_weights: Any = None,
    align: str = "position",
    handle_zero_tail: bool = True,
    epsilon: float = 1e-8,
) -> AdvantageResult:
    """Leave-one-out OTB advantages recovered from self-inclusive OTB's outputs (verl's ``(advantages, returns)``).

    With W, D and D₋ᵢ as in the module docstring (on the grid ``align`` chooses), at every valid token:

        Aₜ^loo = Aₜ^self · D/D₋ᵢ     where the self-inclusive baseline was the ratio and D₋ᵢ > 0 (the identity),
        Aₜ^loo = Gₜ                  where no other member is valid at t, or D₋ᵢ ≤ 0 (the leave-one-out baseline is 0),
        Aₜ^loo = Gₜ − Σ_{j≠i} GₜʲWₜʲmₜʲ/D₋ᵢ   where verl forced the baseline to 0 (zero tail) although another member is
                                      valid — only possible with ``align="position"`` and masks that are not a prefix
                                      (left padding, tool-output holes); A^self = G carries nothing there, so the
                                      others' returns are used.

    The result equals :func:`otb_spec.leave_one_out_token_baseline` on the same inputs (tests/test_claims.py) where
    every W ≥ 0, as on consistent statistics. Where statistics within the input slack make some W negative, the
    identity (which verl's A^self carries) is that of the bare weights, while leave_one_out_token_baseline weighs by
    max(W, 0) (proofs/N1 item 5): recompute from the returns there.

    Conditioning: the identity multiplies A^self by D/D₋ᵢ = 1/(1 − λ), so an absolute error δ in the advantages given
    (e.g. verl's float32 rounding, ≈ 2⁻²⁴·(|G| + |B|)) becomes δ/(1 − λ). Where one member carries almost all of its
    group's energy at t (λ → 1), recompute from the returns instead
    (``token_baseline(returns, W, mask, ids, leave_one_out=True)``).

    Args:
      advantages: [B, T] self-inclusive OTB advantages (verl's first output; :func:`otb_spec.optimal_token_baseline`
        or, with ``align="valid_token"``, :func:`otb_spec.multi_turn_optimal_token_baseline`).
      returns: [B, T] Gₜ (verl's second output).
      response_mask, group_ids, log_probs, sum_pi_squared, is_weights, epsilon: the inputs of that call.
      align: ``"position"`` (single-turn) or ``"valid_token"`` (multi-turn).
      handle_zero_tail: the value used in that call.

    Returns:
      :class:`otb_spec.AdvantageResult` (leave-one-out advantages, ``returns`` as given, baselines Gₜ − Aₜ^loo), 0 at
      masked positions.

    Worked example (the batch of :func:`otb_spec.optimal_token_baseline`, ε = 0): λ = ½ at the two shared positions,
    so the advantages double; at t = 2 member 0 is alone and keeps its return::

      >>> r = [[0, 0, 1], [0, 0, 0]]; m = [[1, 1, 1], [1, 1, 0]]
      >>> half = np.full((2, 3), 0.5)
      >>> self_inclusive = [[0.5, 0.5, 1.0], [-0.5, -0.5, 0.0]]
      >>> G = [[1, 1, 1], [0, 0, 0]]
      >>> leave_one_out_from_self_inclusive(self_inclusive, G, m, ["q", "q"], np.log(half), half,
      ...                                   epsilon=0.0).advantages.tolist()
      [[1.0, 1.0, 1.0], [-1.0, -1.0, 0.0]]
    """
    shape = check.batch_shape("advantages", advantages)
    given = check.float_array("advantages", advantages, shape=shape)
    returns64 = check.float_array("returns", returns, shape=shape, like="advantages")
    mask = check.mask_array("response_mask", response_mask, shape, like="advantages")
    segments = group_segments(group_ids, shape[0])
    log_probs64, spp64 = check.token_statistics(log_probs, sum_pi_squared, mask, shape, like="advantages")
    weights = None if is_weights is None else importance_weights(is_weights, shape, like="advantages")
    align = check.alignment(align)
    handle_zero_tail = check.flag("handle_zero_tail", handle_zero_tail)
    epsilon = check.epsilon(epsilon)

    grid = Grid(mask, align)
    energy = grid.gather(cumulative_energy(_energy(log_probs64, spp64), mask, weights)) * grid.valid
    G, A = grid.gather(returns64), grid.gather(given)
    total = segment_sums(energy, segments)[segments.index]                      # Σⱼ Wⱼmⱼ
    others = others_denominator(total - energy, epsilon)                        # Σ_{j≠i} Wⱼmⱼ + ε, 0 where ≤ 0
    rescaled = safe_ratio(A * (total + epsilon), others)                        # A^self / (1 − λ)
    weighted = G * energy
    from_returns = G - safe_ratio(segment_sums(weighted, segments)[segments.index] - weighted, others)
    alone = forced_zero(grid, segments, leave_one_out=True, handle_zero_tail=False) | (others == 0)
    forced = forced_zero(grid, segments, leave_one_out=False, handle_zero_tail=handle_zero_tail)
    on_grid = np.where(alone, G, np.where(forced, from_returns, rescaled)) * grid.valid
    recovered = grid.scatter(on_grid)
    return AdvantageResult(recovered, returns64, (returns64 - recovered) * mask)
