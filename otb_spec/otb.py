"""The Optimal Token Baseline: single-turn and multi-turn (verl semantics), leave-one-out, and exact-norm variants.

For prompt group g with members i, return-to-go Gₜⁱ, realized energy Wₜⁱ and mask mₜⁱ, OTB's baseline at token t is

    Bₜ = Σᵢ Gₜⁱ·Wₜⁱ·mₜⁱ / (Σᵢ Wₜⁱ·mₜⁱ + ε)          shared by every member of the group,

and the advantage is Aₜⁱ = (Gₜⁱ − Bₜ)·mₜⁱ. It is the sample version of E[mₜGₜ‖Sₜ‖²]/E[mₜ‖Sₜ‖²] (Sₜ the
cumulative score) — the constant that minimises the second moment of each prefix term mₜSₜ(Gₜ − b) (proofs/T6; not
the variance-optimal baseline of the whole gradient, which is T5's oracle) — with ‖Sₜ‖² replaced by the realized
energy of the Logit-Gradient Proxy (Li, Xu et al. 2026, arXiv 2602.07078).

Two alignments of "token t" across the members of a group:

* ``"position"`` — absolute position t (verl ``compute_optimal_token_baseline_advantage``, single-turn);
* ``"valid_token"`` — the k-th *valid* token of each member: valid tokens are compacted, aligned, and the results
  scattered back (verl ``compute_multi_turn_optimal_token_baseline_advantage``, for tool-integrated reasoning where
  tool output punches holes into the mask). Members with no valid token are left out of their group.

Defined corners (each matches verl where verl is defined; docs/verl-differences.md lists where we differ):

* singleton group (one member, after leaving out empty members in the valid-token alignment) → baseline 0,
  advantage = return;
* zero tail (``handle_zero_tail=True``, the default): if exactly one member has the largest number of valid tokens
  L₁ and the next largest is L₂ < L₁, that member's baseline is 0 at aligned positions ≥ L₂ — there the group has no
  other member to compare with, and the self-inclusive ratio would return Gₜ itself (advantage ≈ 0, no signal);
* zero-energy group at t (all Wₜ = 0, e.g. a deterministic policy) → Bₜ = 0/ε = 0, advantage = return; with ε = 0 a
  zero denominator also gives 0, never NaN;
* masked positions: advantages and baselines are exactly 0; returns carry verl's value (see
  :func:`otb_spec.returns_to_go`).

The self-inclusive baseline uses the member's own Gₜ, so its policy gradient is biased; the leave-one-out baseline
:func:`leave_one_out_token_baseline` is not (proofs/T3_unbiasedness.md).
"""

from __future__ import annotations

from typing import Any, Literal, NamedTuple

import numpy as np

from otb_spec import _validation as check
from otb_spec._baseline import token_baseline as _core_token_baseline
from otb_spec._baseline import validated_otb_inputs
from otb_spec.groups import Segments, group_segments
from otb_spec.trajectory import cumulative_energy, reward_to_go

__all__ = [
    "AdvantageResult",
    "Alignment",
    "optimal_token_baseline",
    "multi_turn_optimal_token_baseline",
    "leave_one_out_token_baseline",
    "exact_norm_token_baseline",
    "token_baseline",
]

Alignment = Literal["position", "valid_token"]


class AdvantageResult(NamedTuple):
    """What every estimator in the reference returns.

    Attributes:
      advantages: [B, T] float64 Aₜ, exactly 0 at masked positions.
      returns: [B, T] float64, the return the baseline is subtracted from (Gₜ for token-level estimators, the
        sequence return R broadcast over the row for sequence-level ones).
      baselines: [B, T] float64 the baseline used at each valid token, exactly 0 at masked positions.
    """

    advantages: np.ndarray
    returns: np.ndarray
    baselines: np.ndarray


def optimal_token_baseline(
    rewards: Any,
    response_mask: Any,
    group_ids: Any,
    log_probs: Any,
    sum_pi_squared: Any,
    *,
    is_weights: Any = None,
    handle_zero_tail: bool = True,
    epsilon: float = 1e-8,
) -> AdvantageResult:
    """Single-turn OTB, exactly verl 0.9.1 ``compute_optimal_token_baseline_advantage``.

    Gₜ = Σ_{k≥t} mₖrₖ;  wₜ = 1 − 2πₜ + Σπ²ₜ;  Wₜ = Σ_{j≤t} mⱼρⱼ²wⱼ;
    Bₜ = Σᵢ GₜⁱWₜⁱmₜⁱ / (Σᵢ Wₜⁱmₜⁱ + ε) over the group, aligned by absolute position t;  Aₜ = (Gₜ − Bₜ)·mₜ.

    Args:
      rewards: [B, T] token-level rewards rₜ (verl ``token_level_rewards``).
      response_mask: [B, T] {0, 1}; holes (tool output) allowed.
      group_ids: [B] prompt-group id of each trajectory (any hashable ids; verl ``index``).
      log_probs: [B, T] log π(yₜ) under the training policy (verl ``old_log_probs``).
      sum_pi_squared: [B, T] Σ_v π_v² at each position.
      is_weights: optional [B, T] rollout importance weights ρₜ ≥ 0 (verl ``rollout_is_weights``); W uses ρ².
      handle_zero_tail: zero the unique longest member's baseline past the second-longest length (module docstring).
      epsilon: ε ≥ 0 added to the denominator.

    Returns:
      :class:`AdvantageResult` (advantages, returns = Gₜ, baselines).

    Worked example (ε = 0): a uniform two-token policy (π = ½, Σπ² = ½, so w = ½); member 0 has three tokens and
    reward 1, member 1 two tokens and reward 0. B = (½, ½) on the shared positions; member 0 is the unique longest,
    so its baseline at t = 2 is 0::

      >>> r = [[0, 0, 1], [0, 0, 0]]; m = [[1, 1, 1], [1, 1, 0]]
      >>> half = np.full((2, 3), 0.5)
      >>> result = optimal_token_baseline(r, m, ["q", "q"], np.log(half), half, epsilon=0.0)
      >>> result.advantages.tolist()
      [[0.5, 0.5, 1.0], [-0.5, -0.5, 0.0]]

    Reference: Li, Xu et al. 2026, arXiv 2602.07078; verl ``verl/trainer/ppo/core_algos.py``.
    """
    prepared = _prepare(rewards, response_mask, group_ids, log_probs, sum_pi_squared, is_weights)
    return _token_baseline(*prepared, align="position", leave_one_out=False,
                           handle_zero_tail=check.flag("handle_zero_tail", handle_zero_tail),
                           epsilon=check.epsilon(epsilon))


def multi_turn_optimal_token_baseline(
    rewards: Any,
    response_mask: Any,
    group_ids: Any,
    log_probs: Any,
    sum_pi_squared: Any,
    *,
    is_weights: Any = None,
    handle_zero_tail: bool = True,
    epsilon: float = 1e-8,
) -> AdvantageResult:
    """Multi-turn (tool-integrated) OTB, exactly verl 0.9.1 ``compute_multi_turn_optimal_token_baseline_advantage``.

    Same Gₜ, wₜ, Wₜ as :func:`optimal_token_baseline` (computed on the uncompacted rows), but the k-th valid token
    of each member is aligned with the k-th valid token of the others; members with no valid token are left out of
    their group (so a group can become a singleton, baseline 0); the zero tail uses the compacted lengths.

    Args and returns as :func:`optimal_token_baseline`.

    Worked example (ε = 0, w = ½ everywhere): member 0's second token is tool output (t = 1 masked), so its valid
    tokens sit at t = 0, 2, 3 and are aligned with member 1's t = 0, 1, 2::

      >>> r = [[0, 0, 0, 1], [0, 0, 0, 0]]; m = [[1, 0, 1, 1], [1, 1, 1, 0]]
      >>> half = np.full((2, 4), 0.5)
      >>> multi_turn_optimal_token_baseline(r, m, [7, 7], np.log(half), half, epsilon=0.0).advantages.tolist()
      [[0.5, 0.0, 0.5, 0.5], [-0.5, -0.5, -0.5, 0.0]]

    With absolute alignment (:func:`optimal_token_baseline`) member 1's third token would be compared with member 0's
    second valid token instead.
    """
    prepared = _prepare(rewards, response_mask, group_ids, log_probs, sum_pi_squared, is_weights)
    return _token_baseline(*prepared, align="valid_token", leave_one_out=False,
                           handle_zero_tail=check.flag("handle_zero_tail", handle_zero_tail),
                           epsilon=check.epsilon(epsilon))


def leave_one_out_token_baseline(
    rewards: Any,
    response_mask: Any,
    group_ids: Any,
    log_probs: Any,
    sum_pi_squared: Any,
    *,
    is_weights: Any = None,
    align: Alignment = "position",
    epsilon: float = 1e-8,
) -> AdvantageResult:
    """Leave-one-out OTB: member i's baseline uses only the *other* members of its group.

    Bₜ⁽⁻ⁱ⁾ = Σ_{j≠i} GₜʲWₜʲmₜʲ / (Σ_{j≠i} Wₜʲmₜʲ + ε)   where some other member j is valid at t, each W read as
                                                          W⁺ = max(W, 0),
    Bₜ⁽⁻ⁱ⁾ = 0                                           where none is (this also covers singleton groups and
                                                          replaces the zero-tail rule, which has nothing left to do),
                                                          or where the others' energy Σ_{j≠i} Wₜʲmₜʲ ≤ 0.

    The clamp and the last rule change nothing on consistent statistics (π² ≤ Σπ², so W ≥ 0 but for a rounding hair:
    the others' energy is 0 only where each of their terms is, and then so is the numerator). Statistics within the
    input slack below π² — float32 near π = 1, or a Σπ² rounded to bf16 — make energies negative at confident tokens
    (proofs/N1 item 5); with the bare W of mixed signs the others' energy can be a small positive sum of large terms
    and B ≫ max|G| (|A| up to 386·max|G| on bf16 statistics of a forced opening). With the weights W⁺ every baseline
    is a weighted mean of the other members' returns — |B| ≤ max|G| up to the rounding of D − Wᵢ, which matters only
    where the others' weights are within rounding of 0 next to the member's own — and still a function of the others
    only (unbiased).

    Because Bₜ⁽⁻ⁱ⁾ is a function of the other trajectories only, which are independent of trajectory i,
    E[mₜ sₜ Bₜ⁽⁻ⁱ⁾] = 0 and the gradient estimator Σₜ mₜ sₜ (Gₜ − Bₜ⁽⁻ⁱ⁾) is unbiased (proofs/T3_unbiasedness.md).
    With N = 2 and ε = 0 the baseline is exactly the other member's Gₜ wherever its Wₜ > 0 (in floating point: where
    it is not absorbed below the rounding of the member's own in the group sum).

    Args:
      rewards, response_mask, group_ids, log_probs, sum_pi_squared, is_weights, epsilon: as
        :func:`optimal_token_baseline`.
      align: ``"position"`` (single-turn) or ``"valid_token"`` (multi-turn compaction).

    Returns:
      :class:`AdvantageResult`.

    Worked example (the batch of :func:`optimal_token_baseline`): each member's baseline is the other's return; at
    t = 2 member 0 has no valid partner, so its baseline is 0::

      >>> r = [[0, 0, 1], [0, 0, 0]]; m = [[1, 1, 1], [1, 1, 0]]
      >>> half = np.full((2, 3), 0.5)
      >>> leave_one_out_token_baseline(r, m, ["q", "q"], np.log(half), half, epsilon=0.0).advantages.tolist()
      [[1.0, 1.0, 1.0], [-1.0, -1.0, 0.0]]
    """
    prepared = _prepare(rewards, response_mask, group_ids, log_probs, sum_pi_squared, is_weights)
    return _token_baseline(*prepared, align=check.alignment(align), leave_one_out=True, handle_zero_tail=False,
                           epsilon=check.epsilon(epsilon))


def exact_norm_token_baseline(
    rewards: Any,
    response_mask: Any,
    group_ids: Any,
    cumulative_score_sq_norms: Any,
    *,
    align: Alignment = "position",
    leave_one_out: bool = False,
    handle_zero_tail: bool | None = None,
    epsilon: float = 1e-8,
) -> AdvantageResult:
    """OTB with the exact cumulative score norms Wₜ = ‖Sₜ‖² = ‖Σ_{j≤t} ∇θ log π(yⱼ | y<ⱼ)‖² in place of the proxy.

    This is the estimator OTB approximates; it needs per-token parameter gradients, so it exists for studies
    (e.g. the toy policies of the lab), not for trainers.

    Args:
      rewards, response_mask, group_ids, epsilon: as :func:`optimal_token_baseline`.
      cumulative_score_sq_norms: [B, T] ‖Sₜ‖² ≥ 0 at valid positions (ignored at masked positions).
      align: ``"position"`` or ``"valid_token"``.
      leave_one_out: use only the other members (unbiased).
      handle_zero_tail: as :func:`optimal_token_baseline`; defaults to True for the self-inclusive baseline and must
        stay unset (or False) with ``leave_one_out``.
    """
    shape = check.batch_shape("rewards", rewards)
    rewards64 = check.float_array("rewards", rewards, shape=shape)
    mask = check.mask_array("response_mask", response_mask, shape, like="rewards")
    segments = group_segments(group_ids, shape[0])
    raw_norms = check.to_numpy("cumulative_score_sq_norms", cumulative_score_sq_norms)
    norms = check.float_array("cumulative_score_sq_norms", raw_norms, shape=shape, like="rewards")
    check.nonnegative_where("cumulative_score_sq_norms", norms, mask > 0, raw_norms.dtype)
    leave_one_out = check.flag("leave_one_out", leave_one_out)
    with np.errstate(over="ignore", invalid="ignore"):      # returns-to-go beyond float64: _token_baseline raises
        returns = reward_to_go(rewards64, mask)
    return _token_baseline(returns, norms, mask, segments, align=check.alignment(align),
                           leave_one_out=leave_one_out,
                           handle_zero_tail=check.zero_tail(handle_zero_tail, leave_one_out),
                           epsilon=check.epsilon(epsilon))


def token_baseline(
    returns: Any,
    realized_energy: Any,
    response_mask: Any,
    group_ids: Any,
    *,
    align: Alignment = "position",
    leave_one_out: bool = False,
    handle_zero_tail: bool | None = None,
    epsilon: float = 1e-8,
) -> AdvantageResult:
    """The general energy-weighted token baseline, for returns and energies computed any way you like.

    Bₜ = Σᵢ GₜⁱWₜⁱmₜⁱ / (Σᵢ Wₜⁱmₜⁱ + ε) (or the leave-one-out sum over j ≠ i, each W read as max(W, 0)), aligned as
    ``align`` says.
    Every OTB variant in this module is this function applied to a particular (G, W); use it for discounted returns
    (:func:`otb_spec.returns_to_go` with γ < 1) or your own energy.

    Args:
      returns: [B, T] Gₜ.
      realized_energy: [B, T] Wₜ ≥ 0 at valid positions.
      response_mask: [B, T] {0, 1}.
      group_ids: [B] ids.
      align, leave_one_out, handle_zero_tail, epsilon: as :func:`exact_norm_token_baseline`.

    Returns:
      :class:`AdvantageResult` with ``returns`` the array given.
    """
    shape = check.batch_shape("returns", returns)
    returns64 = check.float_array("returns", returns, shape=shape)
    mask = check.mask_array("response_mask", response_mask, shape, like="returns")
    raw_energy = check.to_numpy("realized_energy", realized_energy)
    energy = check.float_array("realized_energy", raw_energy, shape=shape, like="returns")
    check.nonnegative_where("realized_energy", energy, mask > 0, raw_energy.dtype)
    segments = group_segments(group_ids, shape[0])
    leave_one_out = check.flag("leave_one_out", leave_one_out)
    return _token_baseline(returns64, energy, mask, segments, align=check.alignment(align), leave_one_out=leave_one_out,
                           handle_zero_tail=check.zero_tail(handle_zero_tail, leave_one_out),
                           epsilon=check.epsilon(epsilon), name="returns")


# ----------------------------------------------------------------------------------------------------------------------
# Argument handling


def _prepare(rewards: Any, response_mask: Any, group_ids: Any, log_probs: Any, sum_pi_squared: Any,
             is_weights: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray, Segments]:
    """Validate the verl-style arguments and return (G, W, m, segments)."""
    rewards64, mask, segments, energy, weights = validated_otb_inputs(rewards, response_mask, group_ids, log_probs,
                                                                     sum_pi_squared, is_weights)
    with np.errstate(over="ignore", invalid="ignore"):      # returns-to-go or ρ² beyond float64: raised below
        returns = reward_to_go(rewards64, mask)
        realized = cumulative_energy(energy, mask, weights)
    _raise_if_weights_overflow(realized, mask, weights)
    return returns, realized, mask, segments


def _raise_if_weights_overflow(realized: np.ndarray, mask: np.ndarray, weights: np.ndarray | None) -> None:
    """The error naming is_weights where ρ² makes the realized energy leave float64 (also raised by
    otb_spec.distributed)."""
    if weights is not None and not np.isfinite(realized[mask > 0]).all():
        largest = float(np.abs(np.where(mask > 0, weights, 0.0)).max(initial=0.0))
        raise check.weights_overflow_error(largest, "float64", certain=True)


# ----------------------------------------------------------------------------------------------------------------------
# The computation (float64 arrays, already validated)


def _token_baseline(returns: np.ndarray, energy: np.ndarray, mask: np.ndarray, segments: Segments, *,
                    align: str, leave_one_out: bool, handle_zero_tail: bool, epsilon: float,
                    name: str = "rewards") -> AdvantageResult:
    """The computation, and a ValueError naming ``name`` where finite inputs overflow float64 (returns-to-go beyond
    its range, or products GₜⁱWₜⁱ and their group sums): every output is then finite, or the call raises."""
    with np.errstate(over="ignore", invalid="ignore"):
        result = AdvantageResult(*_core_token_baseline(returns, energy, mask, segments, align=align,
                                                       leave_one_out=leave_one_out, handle_zero_tail=handle_zero_tail,
                                                       epsilon=epsilon))
    if not all(np.isfinite(array).all() for array in result):
        raise _overflow_error(name, returns, energy, mask)
    return result


def _overflow_error(name: str, returns: np.ndarray, energy: np.ndarray, mask: np.ndarray) -> ValueError:
    """The error for finite inputs whose float64 arithmetic overflowed (also raised by otb_spec.distributed)."""
    valid = mask > 0
    with np.errstate(invalid="ignore"):
        largest_return = float(np.abs(np.where(valid, returns, 0.0)).max(initial=0.0))
        largest_energy = float(np.abs(np.where(valid, energy, 0.0)).max(initial=0.0))
    return ValueError(f"{name}: finite, but the baseline's float64 arithmetic overflows: returns up to "
                      f"{largest_return:.3g} in magnitude times realized energies up to {largest_energy:.3g}, "
                      f"summed over a group (Σᵢ GₜⁱWₜⁱ), exceed {np.finfo(np.float64).max:.3g} (or the "
                      "returns-to-go do); scale them down")
