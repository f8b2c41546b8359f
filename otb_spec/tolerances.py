"""Every numerical tolerance and error bound used by the project, decided in one place.

Nothing in the tests, the adapters' equivalence suites or the conformance verifier picks a tolerance by hand: they
call the functions below, which derive it from the machine epsilon ``ε`` of the dtypes involved and from the size of
the computation. ``u = ε/2`` is the unit round-off. Derivations: docs/tolerances.md.

==============================  ============================================  ===============================================
quantity                        bound                                         reason
==============================  ============================================  ===============================================
elementwise formula             ``rtol = 8ε``                                 a handful of correctly rounded operations
sum of ``n`` terms              ``atol = (n+2)·ε·Σ|terms|``                   recursive summation, any order: γₙ ≤ n·u/(1−n·u)
Σπ² of a correct implementation ``rtol = expm1(ε_w·(8M + 4·ln V + 4))``        :func:`sum_pi_squared_tolerance`: mixed forward-
                                ``+ 2(V + 2)·ε_a``                            backward error of any evaluation (shifted or
                                                                              unshifted log-sum-exp, softmax-then-square,
                                                                              chunked online); M = max |z| of the row, ε_w of
                                                                              the dtype given, ε_a of the accumulation
Σπ² by a max-shifted evaluation ``rtol = 8ε·(V + Δz)``                        :func:`logsumexp_tolerance`: the reference's own
                                                                              algorithm (Δz = max z − min z)
proxy w from logits             ``atol = 8ε·(V + 4·max|z| + 4)``              log π = z_y − lse(z) carries an absolute error
                                                                              ε·(|z_y| + |lse|); w = 1 − 2π + Σπ² is O(1)
port vs reference               ``rtol = atol = 4·√ε``                        the default for independent implementations
OTB advantages and returns      per-element forward error bound               :func:`otb_tolerance`: first-order error analysis
                                                                              of the whole pipeline with per-token work in the
                                                                              dtype given and sums in the accumulation dtype;
                                                                              +inf where the problem is ill-conditioned
token statistics from hidden    per element: logit error of the matmul         :func:`hidden_statistics_tolerance`: the logits
states and the LM head          E = ((H+2)ε_a + 2ε_w)·|h||W|ᵀ/τ + 2ε_w|z|,    h·Wᵀ/τ carry the error E of an H-term dot product
(log π, H, Σπ²) and their       propagated through each statistic, plus its   in the accumulation dtype; each statistic then
gradients                       evaluation error from those logits            adds the error of any correct evaluation from
                                                                              logits; :func:`hidden_gradient_tolerance` carries
                                                                              both through ∂z = g_lp(e_y − π) − g_Hπ(log π + H)
                                                                              and the two matmuls of the backward pass
output rounding                 ``rtol = ε_out, atol = smallest normal``       :func:`output_rounding`
input range checks              :func:`input_range_slack` table               admits rounding of the producer, not mis-scaling
leave-one-out dominant member   ``Wᵢ > ¾·D``: the others' sums are added      D − Wᵢ ≥ D/4 for every other member loses a few
                                directly (:data:`DOMINANT_SHARE`)             ulps of D; at most one member per column exceeds
                                                                              it (proofs/N1 item 5)
==============================  ============================================  ===============================================

``ε``: float64 2⁻⁵², float32 2⁻²³, float16 2⁻¹⁰, bfloat16 2⁻⁷ (the table lives in ``otb_spec._dtypes``, a leaf module
that argument checking shares without an import cycle).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

import numpy as np

from otb_spec import _validation
from otb_spec._baseline import Grid, forced_zero, grid_baseline, leave_one_out_energy, validated_otb_inputs
from otb_spec._dtypes import dtype_name as _dtype_name
from otb_spec._dtypes import EPSILON_BY_NAME, input_range_slack, machine_epsilon, smallest_normal
from otb_spec.groups import Segments, segment_sums
from otb_spec.lm_head import validated_lm_head_inputs
from otb_spec.trajectory import cumulative_energy, reward_to_go

__all__ = [
    "Tolerance",
    "sum_pi_squared_tolerance",
    "machine_epsilon",
    "smallest_normal",
    "elementwise_tolerance",
    "summation_tolerance",
    "logsumexp_tolerance",
    "logit_spread",
    "proxy_tolerance",
    "port_tolerance",
    "input_range_slack",
    "otb_tolerance",
    "otb_comparison_tolerance",
    "output_rounding",
    "HiddenStatisticsTolerance",
    "hidden_statistics_tolerance",
    "hidden_gradient_tolerance",
    "hidden_comparison_tolerances",
    "DOMINANT_SHARE",
]

DOMINANT_SHARE = 0.75
"""A leave-one-out port in float32 subtracts member i from its column's sums (Nᵢ = N − GᵢWᵢ, Dᵢ = D − Wᵢ) only where
Wᵢ ≤ DOMINANT_SHARE·D, so that Dᵢ ≥ D/4 keeps the cancellation to a few ulps of D; a member above it (at most one per
column: two would sum to more than 1.5·D, rounding included) takes the other members' sums added directly. Exact in
every binary dtype, so a kernel comparing in float32 or float64 applies the same rule. Used by otb_torch (eager and
distributed; the native kernel receives it as an argument) and otb_jax, each bound at import (changing this name at
run time changes nothing); proofs/N1 item 5, docs/distributed.md."""


@dataclass(frozen=True)
class Tolerance:
    """``|actual − expected| ≤ atol + rtol·|expected|`` elementwise (the :func:`numpy.isclose` rule).

    Attributes:
      rtol: relative tolerance, a float or an array of the compared shape (per-element bounds).
      atol: absolute tolerance, a float or an array of the compared shape (per-element bounds; +inf marks an
        element whose value is ill-conditioned: any finite result passes there, ±inf and NaN fail).
      reason: one line saying where the numbers come from (shown in failure reports).
    """

    rtol: Any
    atol: Any
    reason: str = ""

    def __add__(self, other: "Tolerance") -> "Tolerance":
        """The tolerance for |a − b| when a and b each carry their own error bound."""
        return Tolerance(rtol=np.add(self.rtol, other.rtol), atol=np.add(self.atol, other.atol),
                         reason=f"{self.reason} + {other.reason}")

    def checked_fraction(self) -> float:
        """Fraction of elements with a finite tolerance (the rest are ill-conditioned and cannot be checked)."""
        atol = np.asarray(self.atol)
        return float(np.isfinite(atol).mean()) if atol.size else 1.0

    def violations(self, actual: Any, expected: Any) -> np.ndarray:
        """Boolean array of ``expected``'s shape, True where ``actual`` is outside the tolerance of ``expected``.

        NaN is a violation, and so is ±inf where ``expected`` is finite — also at unchecked (ill-conditioned)
        elements: their exact value is finite, only its digits are unknown; where ``expected`` is ±inf or NaN only
        the same value passes. ``actual`` must have ``expected``'s shape, and ``rtol`` and ``atol`` must broadcast to
        it (a ValueError otherwise: broadcasting a wrong shape would compare the wrong elements)."""
        actual = np.asarray(actual, dtype=np.float64)
        expected = np.asarray(expected, dtype=np.float64)
        if actual.shape != expected.shape:
            raise ValueError(f"actual: shape {actual.shape} differs from expected's {expected.shape}")
        allowed = self._allowed(expected)
        with np.errstate(invalid="ignore"):
            within = (np.abs(actual - expected) <= allowed) | np.isinf(allowed)   # +inf: ill-conditioned, unchecked
        close = np.where(np.isfinite(expected), within & np.isfinite(actual), actual == expected)
        return ~close

    def _allowed(self, expected: np.ndarray) -> np.ndarray:
        """atol + rtol·|expected|, of expected's shape (a ValueError naming rtol or atol if either does not fit)."""
        for name in ("rtol", "atol"):
            shape = np.shape(getattr(self, name))
            try:
                fits = np.broadcast_shapes(shape, expected.shape) == expected.shape
            except ValueError:
                fits = False
            if not fits:
                raise ValueError(f"{name}: shape {shape} does not broadcast to the compared shape {expected.shape}")
        with np.errstate(invalid="ignore"):         # 0·inf at an infinite expected value: NaN, which fails below
            return np.broadcast_to(np.add(self.atol, np.multiply(self.rtol, np.abs(expected))), expected.shape)

    def holds(self, actual: Any, expected: Any) -> bool:
        """True when every element is within tolerance."""
        return not bool(self.violations(actual, expected).any())

    def assert_close(self, actual: Any, expected: Any, what: str = "value") -> None:
        """Raise :class:`AssertionError` naming the worst element when the tolerance does not hold."""
        bad = self.violations(actual, expected)
        if not bad.any():
            return
        actual = np.asarray(actual, dtype=np.float64)
        expected = np.asarray(expected, dtype=np.float64)
        allowed = self._allowed(expected)
        with np.errstate(invalid="ignore"):         # inf − inf where an infinity meets an unchecked element
            excess = np.where(bad, np.nan_to_num(np.abs(actual - expected) - allowed, nan=np.inf), -np.inf)
        worst = np.unravel_index(int(np.argmax(excess)), bad.shape) if bad.ndim else ()
        atol_text = f"{float(np.broadcast_to(self.atol, bad.shape)[worst]):.3g}"
        rtol_text = f"{float(np.broadcast_to(self.rtol, bad.shape)[worst]):.3g}"
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {bad.size} elements outside rtol={rtol_text}, atol={atol_text}"
            f" ({self.reason}); worst at {tuple(int(i) for i in worst)}: got {actual[worst]!r},"
            f" expected {expected[worst]!r}"
        )


def elementwise_tolerance(dtype: Any = np.float64) -> Tolerance:
    """A formula of a few correctly rounded operations: ``rtol = 8ε``, ``atol = 8ε`` (for results near 0)."""
    eps = machine_epsilon(dtype)
    return Tolerance(rtol=8 * eps, atol=8 * eps, reason="elementwise formula: 8ε")


def summation_tolerance(n_terms: int, magnitude: float, dtype: Any = np.float64) -> Tolerance:
    """A sum of ``n_terms`` terms whose absolute values add up to ``magnitude``: ``atol = (n+2)·ε·magnitude``."""
    eps = machine_epsilon(dtype)
    atol = (n_terms + 2) * eps * max(float(magnitude), np.finfo(np.float64).tiny)
    return Tolerance(rtol=8 * eps, atol=atol, reason=f"sum of {n_terms} terms of total size {magnitude:.3g}")


def logsumexp_tolerance(vocab_size: int, logit_spread: Any, dtype: Any = np.float64) -> Tolerance:
    """Σπ² (or any ratio of exponential sums) of ``vocab_size`` logits spanning ``logit_spread = max z − min z``, by an
    evaluation that subtracts the row maximum first — the reference's own algorithm (``otb_spec.proxy``).

    ``z − max z`` carries an absolute rounding error ≤ ε·Δz, which ``exp`` turns into a relative error of the same size;
    the V-term sums add ``V·ε``. Hence ``rtol = 8ε·(V + Δz)``. ``logit_spread`` may be a float or an array of
    per-row spreads (:func:`logit_spread`), giving per-element bounds. An implementation that does not subtract the
    maximum (verl's ``exp(lse(2z) − 2·lse(z))``) is not covered: judge it with :func:`sum_pi_squared_tolerance`.
    """
    eps = machine_epsilon(dtype)
    spread = np.asarray(logit_spread, dtype=np.float64)
    spread = np.where(np.isfinite(spread), spread, 0.0)
    rtol = 8 * eps * (vocab_size + spread)
    largest = float(spread.max()) if spread.size else 0.0
    return Tolerance(rtol=float(rtol) if rtol.ndim == 0 else rtol, atol=0.0,
                     reason=f"exp-sum over V={vocab_size} logits of spread ≤ {largest:.3g} in {_dtype_name(dtype)}")


def logit_spread(logits: Any) -> np.ndarray:
    """Per-row spread ``Δz = max z − min z`` over the finite logits of each row (``[..., V]`` → ``[...]``; 0 for a
    row with at most one finite logit). −inf logits (excluded tokens) contribute nothing to Σπ², so they are ignored."""
    logits = np.asarray(logits, dtype=np.float64)
    finite = np.isfinite(logits)
    high = np.where(finite, logits, -np.inf).max(axis=-1, initial=-np.inf)
    low = np.where(finite, logits, np.inf).min(axis=-1, initial=np.inf)
    with np.errstate(invalid="ignore"):
        spread = high - low
    return np.where(np.isfinite(spread), spread, 0.0)


def proxy_tolerance(vocab_size: int, max_abs_logit: float, dtype: Any = np.float64) -> Tolerance:
    """The per-token proxy w = 1 − 2π + Σπ² computed from logits of magnitude ≤ ``max_abs_logit``.

    log π = z_y − lse(z) has an absolute error ≤ ε·(|z_y| + |lse z|) ≤ ε·(2·max|z| + log V), which ``exp`` turns into an
    absolute error of π ≤ 1; Σπ² carries the relative error of :func:`logsumexp_tolerance`; the remaining operations
    are on O(1) numbers. Hence ``atol = 8ε·(V + 4·max|z| + 4)`` (absolute: w itself may be ~0).
    """
    eps = machine_epsilon(dtype)
    magnitude = float(max_abs_logit) if math.isfinite(max_abs_logit) else 0.0
    return Tolerance(rtol=8 * eps, atol=8 * eps * (vocab_size + 4 * magnitude + 4),
                     reason=f"proxy from V={vocab_size} logits of magnitude {magnitude:.3g}")


def port_tolerance(dtype: Any) -> Tolerance:
    """An independent implementation in ``dtype`` compared with the float64 reference: ``rtol = atol = 4·√ε``."""
    eps = machine_epsilon(dtype)
    value = 4 * math.sqrt(eps)
    return Tolerance(rtol=value, atol=value, reason=f"independent implementation in {_dtype_name(dtype)}: 4·√ε")


def sum_pi_squared_tolerance(logits: Any, *, dtype: Any = np.float32, accumulation_dtype: Any = None) -> Tolerance:
    """Per-row tolerance for |Σπ² computed by a correct implementation − exact Σπ²|.

    A correct implementation given logits of ``dtype`` returns, for each row z ∈ ℝⱽ with M = max_v |z_v| over the finite
    logits (−inf are excluded tokens), Σπ²(z)·(1 + θ) with

        |θ| ≤ expm1(ε_w·(8M + 4·ln V + 4)) + 2(V + 2)·ε_a,

    ε_w the machine epsilon of ``dtype`` (its working precision) and ε_a that of ``accumulation_dtype`` (its sums over
    the vocabulary). The exponential term is a mixed backward-forward error: perturbing the logits by δ changes
    ln Σπ² by at most 4‖δ‖∞ (|∂ ln Σπ²/∂z|₁ ≤ 4), and any evaluation through log-sum-exps or exponentials of logits of
    size M commits an error of a few u_w·(M + ln V) in the exponent — a log-sum-exp of such logits is itself only
    known to that absolute precision — which grows with M, not only with the spread of the row. The second term is
    the V-term summation. docs/tolerances.md derives the constants for the four evaluations in use (shifted ratio
    S₂/S₁², verl's unshifted exp(lse(2z) − 2·lse(z)), softmax-then-square, chunked online rescaling), and
    tests/test_tolerances.py checks the bound against a high-precision oracle for float16, bfloat16, float32 and
    float64 logits with |z| up to 1e4 and V up to 2¹⁷.

    Every per-token term formed in the working dtype may also underflow: ``atol = 2(V + 2)·η_w`` (η_w its smallest
    normal number: results below it may be flushed to zero), negligible except in float16.

    Args:
      logits: [..., V] the logits the implementation was given (any array of their values).
      dtype: the dtype it was given.
      accumulation_dtype: the precision of its sums over the vocabulary; default float64 for float64 inputs and
        float32 otherwise.
    Returns:
      :class:`Tolerance` with an rtol per row ([...]) and the underflow atol.
    """
    values = np.asarray(logits, dtype=np.float64)
    if values.ndim < 1 or values.shape[-1] == 0:
        raise ValueError(f"logits: expected shape [..., V] with V ≥ 1, got {values.shape}")
    vocab = values.shape[-1]
    finite = np.isfinite(values)
    largest = np.where(finite, np.abs(values), 0.0).max(axis=-1)
    working = machine_epsilon(dtype)
    accumulation = machine_epsilon(accumulation_dtype if accumulation_dtype is not None else
                                   ("float64" if _dtype_name(dtype) == "float64" else "float32"))
    with np.errstate(over="ignore"):
        rtol = np.expm1(working * (8.0 * largest + 4.0 * math.log(vocab) + 4.0)) + 2.0 * (vocab + 2) * accumulation
    # underflow: each of the ~2V per-token terms (exponentials, probabilities, their squares) formed in the working
    # dtype may lose up to its smallest normal number (flushed to zero); negligible except in float16, whose normal
    # range ends at 6.1e-5 — above π² ≈ 1/V² for V ≳ 128, so float16 cannot resolve Σπ² of a wide, flat vocabulary
    underflow = 2.0 * (vocab + 2) * smallest_normal(dtype)
    return Tolerance(rtol=float(rtol) if rtol.ndim == 0 else rtol, atol=underflow,
                     reason=f"Σπ² of V={vocab} logits (max |z| ≤ {float(largest.max(initial=0.0)):.3g}) given in "
                            f"{_dtype_name(dtype)}: mixed backward-forward error bound")


def otb_tolerance(
    rewards: Any,
    response_mask: Any,
    group_ids: Any,
    log_probs: Any,
    sum_pi_squared: Any,
    *,
    is_weights: Any = None,
    align: str = "position",
    leave_one_out: bool = False,
    handle_zero_tail: bool = True,
    epsilon: float = 1e-8,
    dtype: Any = np.float32,
    input_dtype: Any = None,
    clamped_weights: bool = False,
) -> tuple[Tolerance, Tolerance]:
    """Per-element tolerances (advantages, returns) for an OTB implementation.

    Each is a rigorous first-order bound on |computed − exact| for *any* summation order, from an error analysis of
    w → W → G → (N, D) → B → A (docs/tolerances.md) in which every per-token quantity (π, w, ρ², products, the ratio,
    and any intermediate stored between steps) may carry the rounding of ``input_dtype`` — the dtype the implementation
    was given — and every sum (over positions or over group members) the rounding of ``dtype``, the precision it
    accumulates in. For float32 or float64 inputs accumulated in the same precision the two coincide; for bfloat16
    inputs, per-token work in bfloat16 is allowed but sums must be accumulated in float32 (``dtype=np.float32``).
    The bound grows with T, the group size and 1/(Σ W + ε); where the denominator itself is not known to within a
    factor of two, the element is ill-conditioned: its tolerance is +inf and it is not checked
    (:meth:`Tolerance.checked_fraction` tells how many are).

    To compare two implementations, add their tolerances: ``otb_tolerance(..., dtype=np.float32)[0] +
    otb_tolerance(..., dtype=np.float64)[0]`` bounds |float32 result − float64 reference|.

    Args:
      rewards, response_mask, group_ids, log_probs, sum_pi_squared, is_weights, handle_zero_tail, epsilon: the
        inputs of the OTB call being checked.
      align: ``"position"`` (single-turn) or ``"valid_token"`` (multi-turn).
      leave_one_out: the leave-one-out variant.
      dtype: the precision the implementation accumulates in.
      input_dtype: the dtype it was given (default: ``dtype``).
      clamped_weights: leave-one-out only. The reference weighs each member by W⁺ = max(W, 0)
        (:func:`otb_spec.leave_one_out_token_baseline`); W < 0 only where statistics within the input slack sit
        below π². False (default): the implementation may also weigh by its bare W, as the formula is written — where
        some W < 0 the bound then allows for both readings (docs/tolerances.md item 5), so it cannot tell whether the
        clamp is there. True: it claims the clamp, and is judged around W⁺ by its rounding alone.
    """
    prepared = validated_otb_inputs(rewards, response_mask, group_ids, log_probs, sum_pi_squared, is_weights)
    return _otb_bounds(prepared, align=align, leave_one_out=leave_one_out, handle_zero_tail=handle_zero_tail,
                       epsilon=epsilon, dtype=dtype, input_dtype=dtype if input_dtype is None else input_dtype,
                       clamped_weights=_validation.flag("clamped_weights", clamped_weights))


def _otb_bounds(prepared: tuple, *, align: str, leave_one_out: bool, handle_zero_tail: bool, epsilon: float,
                dtype: Any, input_dtype: Any, clamped_weights: bool) -> tuple[Tolerance, Tolerance]:
    """:func:`otb_tolerance` on inputs already validated by ``otb_spec._baseline.validated_otb_inputs``."""
    accumulation = machine_epsilon(_floating("dtype", dtype))
    try:
        input_unit = machine_epsilon(input_dtype)
    except ValueError:
        raise ValueError(f"input_dtype: expected a floating, integer or boolean dtype, got {input_dtype!r}") from None
    elementwise = max(input_unit, accumulation)
    leave_one_out = _validation.flag("leave_one_out", leave_one_out)
    # None: verl's default, as the baselines read it (on for the self-inclusive baseline); True with leave-one-out is
    # ignored here (the bound of the rule that applies), not an error
    handle_zero_tail = not leave_one_out if handle_zero_tail is None else \
        _validation.flag("handle_zero_tail", handle_zero_tail)
    advantage_bound, returns_bound = _otb_error_bounds(
        *prepared, align=_validation.alignment(align), leave_one_out=leave_one_out,
        handle_zero_tail=handle_zero_tail and not leave_one_out, epsilon=_validation.epsilon(epsilon),
        elementwise_unit=elementwise, accumulation_unit=accumulation, clamped_weights=clamped_weights)
    name = _dtype_name(dtype)
    given = _dtype_name(input_dtype)
    where = name if given == name else f"{given} (sums in {name})"
    # underflow: each of the O(T + group size) operations on an element may add up to the smallest normal number
    mask = np.asarray(prepared[1])
    tiny = max(smallest_normal(dtype), smallest_normal(input_dtype))
    underflow = (mask.shape[1] + int(prepared[2].sizes.max()) + 16) * tiny
    return (Tolerance(rtol=elementwise, atol=advantage_bound + underflow * mask,
                      reason=f"OTB forward error bound in {where}"),
            Tolerance(rtol=elementwise, atol=returns_bound + underflow, reason=f"return-to-go error bound in {where}"))


def _otb_error_bounds(rewards: np.ndarray, mask: np.ndarray, segments: Segments, token_energy: np.ndarray,
                      is_weights: np.ndarray | None, *, align: str, leave_one_out: bool, handle_zero_tail: bool,
                      epsilon: float, elementwise_unit: float, accumulation_unit: float, clamped_weights: bool
                      ) -> tuple[np.ndarray, np.ndarray]:
    """Rigorous first-order bounds on |computed − exact| for (advantages, returns) of an implementation whose per-token
    operations (and stored intermediates) have relative error ≤ e = ``elementwise_unit`` and whose sums have relative
    error ≤ a = ``accumulation_unit`` per term (inputs are the given numbers exactly).

    Derivation (docs/tolerances.md): with T positions, n_g members,

      |Δ(ρ²w)ⱼ| ≤ e(8ρⱼ² + 3ρⱼ²|wⱼ|)                                 w = 1 − 2π + Σπ² from O(1) operands
      |ΔWₜ|    ≤ e·Σ_{j≤t} mⱼρⱼ²(8 + 3|wⱼ|) + a(T+3)·Σⱼ mⱼρⱼ²|wⱼ| + e|Wₜ|   any order; also W = total − suffix
      |ΔGₜ|    ≤ (a(T+1) + e)·Σₖ|mₖrₖ|                               also covers G = total − prefix
      |ΔN|     ≤ Σᵢ(|Gᵢ||ΔWᵢ| + Wᵢ|ΔGᵢ|) + (a(n_g+2) + e)·Σᵢ|Gᵢ|Wᵢ     N = Σᵢ GᵢWᵢ (leave-one-out: full-group sums)
      |ΔD|     ≤ Σᵢ|ΔWᵢ| + (a(n_g+2) + e)·(ΣᵢWᵢ + ε)                  D = ΣᵢWᵢ + ε (or over j ≠ i)
      |ΔB|     ≤ (|ΔN| + |B||ΔD|)/(D − |ΔD|) + e|B|                 the ratio's exact bound; +inf when |ΔD| > D/2
      |ΔA|     ≤ |ΔG| + |ΔB| + e(|G| + |B|)

    where the baseline is 0 by rule (singleton, zero tail, no other member) ΔB = 0: those decisions use exact integer
    lengths. Masked advantages are exactly 0 (bound 0).
    """
    e, a = elementwise_unit, accumulation_unit
    n_positions = mask.shape[1]
    rho2 = np.ones(mask.shape) if is_weights is None else np.square(is_weights)
    energy_terms = mask * rho2 * (8.0 + 3.0 * np.abs(token_energy))
    realized = cumulative_energy(token_energy, mask, is_weights)
    returns = reward_to_go(rewards, mask)
    # the sums' rounding is bounded by the whole row's energy mass, as G's by its reward mass: that also covers
    # W = total − suffix (one reversed scan for both), whose error at t is of the row's mass, not of Wₜ's
    energy_mass = (mask * rho2 * np.abs(token_energy)).sum(axis=-1, keepdims=True)
    energy_error = (e * np.cumsum(energy_terms, axis=-1) + a * (n_positions + 3) * energy_mass
                    + e * np.abs(realized))
    return_error = np.broadcast_to((a * (n_positions + 1) + e) * np.abs(rewards * mask).sum(axis=-1, keepdims=True),
                                   mask.shape)

    grid = Grid(mask, align)
    G, W, dW, dG = (grid.gather(array) for array in (returns, realized, energy_error, return_error))
    if leave_one_out:
        # The reference weighs by W⁺ = max(W, 0) (leave_one_out_energy). A port that clamps its W' too is within
        # |max(W', 0) − W⁺| ≤ |ΔW| of it; one that weighs by the bare W' (the formula as written) within
        # |ΔW| + max(−W, 0), which is what it gets unless it claims the clamp (a rounding hair on consistent
        # statistics, where W ≥ 0 up to rounding).
        if not clamped_weights:
            dW = dW + np.maximum(-W, 0.0)
            bare_magnitude = np.abs(W)      # the bare reading's products and sums carry |W'| ≈ |W| ≥ W⁺: bound with it
        W = leave_one_out_energy(W)
    baselines = grid_baseline(G, W, grid, segments, leave_one_out=leave_one_out, handle_zero_tail=handle_zero_tail,
                              epsilon=epsilon)
    v = grid.valid
    sum_unit = a * (segments.sizes[segments.index] + 2.0)[:, None] + e
    W_abs = bare_magnitude if leave_one_out and not clamped_weights else np.abs(W)   # W < 0 within the input slack
    sum_gw = segment_sums(np.abs(G) * W_abs * v, segments)[segments.index]
    sum_w = segment_sums(W * v, segments)[segments.index]
    sum_w_abs = segment_sums(W_abs * v, segments)[segments.index]
    numerator_error = segment_sums((np.abs(G) * dW + W_abs * dG) * v, segments)[segments.index] + sum_unit * sum_gw
    denominator_error = segment_sums(dW * v, segments)[segments.index] + sum_unit * (sum_w_abs + epsilon)
    others = sum_w - W * v                                              # leave-one-out: Dᵢ = Σ_{j≠i} Wⱼmⱼ
    denominator = (np.maximum(others, 0.0) if leave_one_out else sum_w) + epsilon
    if leave_one_out:
        numerator_error = numerator_error + e * (sum_gw + np.abs(G) * W_abs * v)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):   # overflow only where ill-conditioned
        baseline_error = np.where(
            denominator_error > 0.5 * np.abs(denominator), np.inf,
            (numerator_error + np.abs(baselines) * denominator_error)
            / np.where(denominator != 0, np.abs(denominator) - denominator_error, 1.0) + e * np.abs(baselines))
        if leave_one_out:
            # Where the others' energy Dᵢ is not surely positive (Dᵢ ≤ |ΔD|) a port may compute Dᵢ' ≤ 0 and take
            # B = 0 (the reference's rule, others_denominator), or read the formula otherwise — the bare ratio
            # Nᵢ'/(Dᵢ' + ε), a clamp Nᵢ'/(max(Dᵢ', 0) + ε). Each has |B'| ≤ |Nᵢ'|/(ε + Dᵢ − |ΔD|) while that
            # floor is positive (Dᵢ' ≥ Dᵢ − |ΔD|), with |Nᵢ'| ≤ Σ_{j≠i}|GⱼWⱼ| + |ΔN|: the bound |B| + that. Where the
            # floor is not positive (ε ≤ |ΔD| − Dᵢ: energies that cancel or go negative beyond ε, proofs/N1 item 5)
            # the baseline is undetermined and not judged.
            spread = sum_gw - np.abs(G) * W_abs * v + numerator_error  # ≥ |Nᵢ'|
            floor = epsilon + others - denominator_error
            either = np.abs(baselines) + np.where(spread > 0, spread / np.where(floor > 0, floor, 1.0), 0.0)
            either = np.where((floor > 0) | (spread == 0), either, np.inf)
            baseline_error = np.where(others > denominator_error, baseline_error, either)
    baseline_error = np.where(forced_zero(grid, segments, leave_one_out, handle_zero_tail), 0.0, baseline_error)
    full_baselines = grid.scatter(baselines)
    advantage_error = (return_error + grid.scatter(np.where(v > 0, baseline_error, 0.0))
                       + e * (np.abs(returns) + np.abs(full_baselines))) * mask
    returns_bound = return_error + e * np.abs(returns)
    return advantage_error, returns_bound


def _floating(name: str, dtype: Any) -> Any:
    """``dtype`` if it is a floating dtype whose precision is known (the precision of sums: an integer or boolean
    dtype accumulates nothing), else a ValueError naming the argument."""
    if _dtype_name(dtype) not in EPSILON_BY_NAME:
        raise ValueError(f"{name}: expected a floating dtype ({', '.join(EPSILON_BY_NAME)}), got {dtype!r}")
    return dtype


def output_rounding(dtype: Any) -> Tolerance:
    """Rounding a result to ``dtype`` on output: relative error ≤ u = ε/2 (written as rtol = ε), plus the smallest
    normal number of ``dtype`` for results that become subnormal or are flushed to zero."""
    return Tolerance(rtol=machine_epsilon(dtype), atol=smallest_normal(dtype),
                     reason=f"output rounded to {_dtype_name(dtype)}")


def otb_comparison_tolerance(
    rewards: Any,
    response_mask: Any,
    group_ids: Any,
    log_probs: Any,
    sum_pi_squared: Any,
    *,
    is_weights: Any = None,
    align: str = "position",
    leave_one_out: bool = False,
    handle_zero_tail: bool = True,
    epsilon: float = 1e-8,
    compute_dtype: Any = np.float32,
    output_dtype: Any = None,
    input_dtype: Any = None,
    clamped_weights: bool = False,
) -> tuple[Tolerance, Tolerance]:
    """Tolerances (advantages, returns) for |implementation − float64 reference| on the same inputs.

    = the implementation's bound (:func:`otb_tolerance`: given ``input_dtype``, default ``compute_dtype``, and
    accumulating in ``compute_dtype``) + the reference's float64 bound + the rounding of the output to ``output_dtype``
    (default: the lower precision of ``input_dtype`` and ``compute_dtype``). ``clamped_weights``: as
    :func:`otb_tolerance` (for the implementation; the reference weighs by W⁺).
    """
    prepared = validated_otb_inputs(rewards, response_mask, group_ids, log_probs, sum_pi_squared, is_weights)
    options = dict(align=align, leave_one_out=leave_one_out, handle_zero_tail=handle_zero_tail, epsilon=epsilon)
    _floating("compute_dtype", compute_dtype)
    if output_dtype is not None:
        _floating("output_dtype", output_dtype)
    given = compute_dtype if input_dtype is None else input_dtype
    implementation = _otb_bounds(prepared, dtype=compute_dtype, input_dtype=given,
                                 clamped_weights=_validation.flag("clamped_weights", clamped_weights), **options)
    reference = tuple(replace(bound, reason="the reference's own float64 bound")   # the reference weighs by W⁺
                      for bound in _otb_bounds(prepared, dtype=np.float64, input_dtype=np.float64,
                                               clamped_weights=True, **options))
    if output_dtype is None:
        output_dtype = given if machine_epsilon(given) >= machine_epsilon(compute_dtype) else compute_dtype
    rounding = output_rounding(output_dtype)
    return (implementation[0] + reference[0] + rounding, implementation[1] + reference[1] + rounding)


class HiddenStatisticsTolerance(NamedTuple):
    """Per-token tolerances ([...] arrays) of the three statistics computed from hidden states and the LM head."""

    log_probs: Tolerance
    entropy: Tolerance
    sum_pi_squared: Tolerance


class _HiddenErrorTerms(NamedTuple):
    """Exact quantities and first-order error terms of one chunk of tokens (float64, [n, V] or [n])."""

    logits: np.ndarray          # z
    probs: np.ndarray           # π
    log_probs: np.ndarray       # log π (every token of the vocabulary)
    entropy: np.ndarray         # H [n]
    spp: np.ndarray             # Σπ² [n]
    logit_error: np.ndarray     # E: bound on |Δz| of the implementation's logits
    lse_error: np.ndarray       # |Δ lse| caused by E [n]
    evaluation: np.ndarray      # r: error of a log-domain quantity evaluated from given logits [n]
    entropy_error: np.ndarray   # total bound on |ΔH| [n]


def _hidden_error_terms(hidden: np.ndarray, weight: np.ndarray, temperature: float, working: float,
                        accumulation: float) -> _HiddenErrorTerms:
    """The error analysis of docs/tolerances.md ("Token statistics from hidden states") for a chunk of tokens.

    An implementation forms z = h·Wᵀ/τ with an H-term dot product accumulated with unit ε_a and may round per-token
    values to its working precision ε_w (the dtype it was given, e.g. bfloat16 logits): |Δz_v| ≤ E_v. Then, with
    p a probability vector and ‖δ‖∞ ≤ Ē, |log Σ_v p_v e^{δ_v}| ≤ e^{2Ē}·Σ_v p_v|δ_v| (from e^x − 1 ≤ |x|e^{|x|} and
    log(1 − s) ≥ −s/(1 − s)), which bounds how the log-sum-exps move. Evaluating from the (perturbed) logits adds
    r = 3ε_w·L + (V + 2)ε_a (L = max|z| + ln V + 1) to every log-domain quantity: the shift and exponent roundings
    and a V-term sum in any order.
    """
    n_hidden = hidden.shape[1]
    vocab = weight.shape[0]
    logits = hidden @ weight.T / temperature
    magnitude = np.abs(hidden) @ np.abs(weight).T / temperature
    logit_error = ((n_hidden + 2) * accumulation + 2 * working) * magnitude + 2 * working * np.abs(logits)
    worst = logit_error.max(axis=-1)
    peak = logits.max(axis=-1, keepdims=True)
    shifted = np.exp(logits - peak)
    total = shifted.sum(axis=-1, keepdims=True)
    probs = shifted / total
    log_probs = logits - peak - np.log(total)
    entropy = -np.sum(probs * log_probs, axis=-1)
    spp = np.sum(np.square(probs), axis=-1)
    with np.errstate(over="ignore"):
        lse_error = np.exp(2 * worst) * np.sum(probs * logit_error, axis=-1)
        perturbation = np.exp(4 * worst) * np.sum(probs * (np.abs(log_probs + entropy[:, None]) + 4 * worst[:, None])
                                                  * logit_error, axis=-1)
    scale = np.abs(logits).max(axis=-1) + math.log(vocab) + 1.0
    evaluation = 3 * working * scale + (vocab + 2) * accumulation
    entropy_error = perturbation + 2 * scale * (evaluation + (vocab + 2) * accumulation + working)
    return _HiddenErrorTerms(logits, probs, log_probs, entropy, spp, logit_error, lse_error, evaluation, entropy_error)


def _hidden_units(dtype: Any, accumulation_dtype: Any) -> tuple[float, float]:
    working = machine_epsilon(dtype)
    accumulation = machine_epsilon(_accumulation_dtype(dtype, accumulation_dtype))
    return max(working, accumulation), accumulation


def _accumulation_dtype(dtype: Any, accumulation_dtype: Any) -> Any:
    if accumulation_dtype is not None:
        return accumulation_dtype
    return "float64" if _dtype_name(dtype) == "float64" else "float32"


def _working_underflow(dtype: Any, accumulation_dtype: Any) -> float:
    """η_w: the smallest normal number of the working precision (the less precise of the two dtypes)."""
    accumulation = _accumulation_dtype(dtype, accumulation_dtype)
    working = dtype if machine_epsilon(dtype) >= machine_epsilon(accumulation) else accumulation
    return smallest_normal(working)


def _chunks(n_rows: int, vocab: int) -> list[slice]:
    step = max(1, 2**21 // max(vocab, 1))
    return [slice(start, min(start + step, n_rows)) for start in range(0, n_rows, step)]


def hidden_statistics_tolerance(hidden: Any, weight: Any, token_ids: Any, *, temperature: float = 1.0,
                                dtype: Any = np.float32, accumulation_dtype: Any = None) -> HiddenStatisticsTolerance:
    """Per-token bounds on |computed − exact| of log π(y), H and Σπ² from hidden states and the LM head.

    For an implementation given ``hidden`` and ``weight`` in ``dtype`` (its working precision ε_w: per-token values
    such as the logits may be rounded to it) that accumulates its dot products and vocabulary sums with the unit ε_a
    of ``accumulation_dtype`` (default float32, float64 for float64 inputs), in any order and chunking — tokens or
    vocabulary, with or without online rescaling (docs/tolerances.md, "Token statistics from hidden states"):

      logit error   E_v = ((H + 2)ε_a + 2ε_w)·Σₖ|hₖ||W_vk|/τ + 2ε_w|z_v|,   Ē = max_v E_v
      |Δ log π(y)| ≤ E_y + e^{2Ē}Σ_v π_v E_v + 2r + ε_w|log π(y)|
      |ΔH|         ≤ e^{4Ē}Σ_v π_v(|log π_v + H| + 4Ē)E_v + 2L(r + (V + 2)ε_a + ε_w)
      |ΔΣπ²|/Σπ²   ≤ expm1(2e^{4Ē}Σ_v(π_v²/Σπ²)E_v + 2e^{2Ē}Σ_v π_v E_v) ⊕ (the rtol of :func:`sum_pi_squared_tolerance`)

    with L = max|z| + ln V + 1 and r = 3ε_w·L + (V + 2)ε_a (a ⊕ b = a + b + ab). The entropy's evaluation term covers
    lse(z) − Σπz (verl's form, which cancels), −Σπ log π and log S₁ + Σ(a/S₁)(m − z) alike.

    Args:
      hidden, weight, token_ids, temperature: the inputs of the call being checked (as for
        :func:`otb_spec.token_statistics_from_hidden`).
      dtype: the dtype the implementation was given.
      accumulation_dtype: the precision of its sums (default: float32, or float64 for float64 inputs).
    Returns:
      :class:`HiddenStatisticsTolerance` with per-token ([...]) bounds.
    """
    inputs = validated_lm_head_inputs(hidden, weight, token_ids, temperature)
    if inputs.token_ids is None:
        raise TypeError("token_ids: expected integer token ids, got None")
    working, accumulation = _hidden_units(dtype, accumulation_dtype)
    n_rows, vocab = inputs.hidden.shape[0], inputs.weight.shape[0]
    log_prob_atol, entropy_atol, spp_rtol = (np.empty(n_rows) for _ in range(3))
    for rows in _chunks(n_rows, vocab):
        terms = _hidden_error_terms(inputs.hidden[rows], inputs.weight, inputs.temperature, working, accumulation)
        ids = inputs.token_ids[rows, None]
        chosen = np.take_along_axis(terms.log_probs, ids, axis=-1)[:, 0]
        log_prob_atol[rows] = (np.take_along_axis(terms.logit_error, ids, axis=-1)[:, 0] + terms.lse_error
                               + 2 * terms.evaluation + working * np.abs(chosen))
        entropy_atol[rows] = terms.entropy_error
        worst = terms.logit_error.max(axis=-1)
        with np.errstate(over="ignore"):
            moved = np.expm1(2 * np.exp(4 * worst) * np.sum(np.square(terms.probs) * terms.logit_error, axis=-1)
                             / terms.spp + 2 * terms.lse_error)
        evaluated = np.asarray(sum_pi_squared_tolerance(terms.logits, dtype=dtype,
                                                        accumulation_dtype=accumulation_dtype).rtol)
        spp_rtol[rows] = moved + evaluated + moved * evaluated
    shape = inputs.lead_shape
    where = f"from hidden states given in {_dtype_name(dtype)} (V={vocab}, H={inputs.hidden.shape[1]})"
    underflow = 2.0 * (vocab + 2) * smallest_normal(dtype)
    return HiddenStatisticsTolerance(
        Tolerance(rtol=0.0, atol=log_prob_atol.reshape(shape), reason=f"log π {where}: logit error + evaluation"),
        Tolerance(rtol=0.0, atol=entropy_atol.reshape(shape), reason=f"entropy {where}: logit error + evaluation"),
        Tolerance(rtol=spp_rtol.reshape(shape), atol=underflow, reason=f"Σπ² {where}: logit error + evaluation"))


def hidden_gradient_tolerance(hidden: Any, weight: Any, token_ids: Any, log_probs_cotangent: Any,
                              entropy_cotangent: Any, *, temperature: float = 1.0, dtype: Any = np.float32,
                              accumulation_dtype: Any = None) -> tuple[Tolerance, Tolerance]:
    """Bounds (hidden [..., H], weight [V, H]) on |computed − exact| of the vector-Jacobian product of (log π, H)
    (:func:`otb_spec.lm_head.token_statistics_vjp`) for an implementation with the precisions of
    :func:`hidden_statistics_tolerance`.

    Each log π_v carries λ_v = E_v + e^{2Ē}Σπ E + r, so π_v carries the relative error ρ_v = expm1(λ_v); H carries the
    entropy bound ΔH above. The logit cotangent ∂z_v = g_lp(δ_vy − π_v) − g_Hπ_v(log π_v + H) then carries

      D_v = |g_lp|π_vρ_v + |g_H|π_v(ρ_v|log π_v + H| + (1 + ρ_v)(λ_v + ΔH)) + 4ε_w(|g_lp|(δ_vy + π_v) + |g_H|π_v(|log π_v| + H))

    (the last term: forming and storing ∂z in the working precision), plus, because π_v = e^{log π_v} and the
    products forming ∂z may be flushed to zero below η_w, the smallest normal number of the working precision,

      U_v = η_w·(2 + |g_lp| + |g_H|(|log π_v + H| + 1))

    (negligible unless the gradients are returned more precisely than they were computed: a float32 program
    returning float64 gradients gives 0 where the exact ∂W is π_v·… ≈ 1e-168). The two matmuls of the backward pass
    add their sums' errors, and each of their products and partial sums may be flushed to zero below η_a, the smallest
    normal number of the accumulation precision (XLA's CPU backend flushes subnormals):

      |Δ∂h_k|  ≤ (Σ_v (D_v + U_v)|W_vk| + ((V + 2)ε_a + 2ε_w)Σ_v|∂z_v||W_vk|)/τ + ε_w|∂h_k| + (2V + 2)η_a·max(1, 1/τ)
      |Δ∂W_vk| ≤ (Σₙ (Dₙᵥ + Uₙᵥ)|hₙₖ| + ((N + 2)ε_a + 2ε_w)Σₙ|∂zₙᵥ||hₙₖ|)/τ + ε_w|∂W_vk| + (2N + 2)η_a·max(1, 1/τ)

    for N tokens, any order of the sums and any chunking. ``log_probs_cotangent`` / ``entropy_cotangent``: [...] or
    None (0).
    """
    inputs = validated_lm_head_inputs(hidden, weight, token_ids, temperature)
    if inputs.token_ids is None:
        raise TypeError("token_ids: expected integer token ids, got None")
    n_rows, vocab = inputs.hidden.shape[0], inputs.weight.shape[0]
    cotangents = []
    for name, value in (("log_probs_cotangent", log_probs_cotangent), ("entropy_cotangent", entropy_cotangent)):
        cotangents.append(np.zeros(n_rows) if value is None else
                          _validation.float_array(name, value, shape=inputs.lead_shape, like="token_ids").reshape(-1))
    g_lp, g_h = cotangents
    working, accumulation = _hidden_units(dtype, accumulation_dtype)
    underflow = _working_underflow(dtype, accumulation_dtype)
    tau = inputs.temperature
    # a product or partial sum of the two matmuls below η_a may be flushed to zero (XLA's CPU backend flushes
    # subnormals), and the scaling by 1/τ multiplies what was lost
    flushed = smallest_normal(_accumulation_dtype(dtype, accumulation_dtype)) * max(1.0, 1.0 / tau)
    hidden_error = np.empty_like(inputs.hidden)
    weight_error = np.zeros_like(inputs.weight)
    weight_gradient = np.zeros_like(inputs.weight)
    abs_weight = np.abs(inputs.weight)
    for rows in _chunks(n_rows, vocab):
        terms = _hidden_error_terms(inputs.hidden[rows], inputs.weight, tau, working, accumulation)
        count = rows.stop - rows.start
        chosen = np.zeros_like(terms.probs)
        chosen[np.arange(count), inputs.token_ids[rows]] = 1.0
        glp, gh = np.abs(g_lp[rows])[:, None], np.abs(g_h[rows])[:, None]
        log_error = terms.logit_error + terms.lse_error[:, None] + terms.evaluation[:, None]
        with np.errstate(over="ignore"):
            relative = np.expm1(log_error)
        centred = np.abs(terms.log_probs + terms.entropy[:, None])
        d_logits_error = (glp * terms.probs * relative
                          + gh * terms.probs * (relative * centred
                                                + (1 + relative) * (log_error + terms.entropy_error[:, None]))
                          + 4 * working * (glp * (chosen + terms.probs)
                                           + gh * terms.probs * (np.abs(terms.log_probs) + terms.entropy[:, None]))
                          + underflow * (2 + glp + gh * (centred + 1)))
        d_logits = (g_lp[rows, None] * (chosen - terms.probs)
                    - g_h[rows, None] * terms.probs * (terms.log_probs + terms.entropy[:, None]))
        abs_d_logits = np.abs(d_logits)
        abs_hidden = np.abs(inputs.hidden[rows])
        hidden_error[rows] = (d_logits_error @ abs_weight
                              + ((vocab + 2) * accumulation + 2 * working) * (abs_d_logits @ abs_weight)) / tau \
            + working * np.abs(d_logits @ inputs.weight / tau) + (2 * vocab + 2) * flushed
        weight_error += (d_logits_error.T @ abs_hidden
                         + ((n_rows + 2) * accumulation + 2 * working) * (abs_d_logits.T @ abs_hidden)) / tau
        weight_gradient += d_logits.T @ inputs.hidden[rows] / tau
    weight_error += working * np.abs(weight_gradient) + (2 * n_rows + 2) * flushed
    where = f"from hidden states given in {_dtype_name(dtype)} (N={n_rows}, V={vocab}, H={inputs.hidden.shape[1]})"
    return (Tolerance(rtol=0.0, atol=hidden_error.reshape(inputs.lead_shape + (inputs.hidden.shape[1],)),
                      reason=f"∂hidden {where}"),
            Tolerance(rtol=0.0, atol=weight_error, reason=f"∂weight {where}"))


def hidden_comparison_tolerances(hidden: Any, weight: Any, token_ids: Any, *, temperature: float = 1.0,
                                 log_probs_cotangent: Any = None, entropy_cotangent: Any = None,
                                 input_dtype: Any = np.float32, compute_dtype: Any = None,
                                 output_dtype: Any = None) -> tuple[HiddenStatisticsTolerance, tuple[Tolerance, Tolerance]]:
    """Tolerances for |implementation − float64 reference| of the three statistics and of the two gradients.

    = the implementation's bounds (given ``input_dtype``, accumulating in ``compute_dtype``, default float32 or
    float64 for float64 inputs) + the reference's own float64 bounds + the rounding of each output to ``output_dtype``
    (default: the lower precision of the input and compute dtypes).
    """
    compute = compute_dtype if compute_dtype is not None else (
        "float64" if _dtype_name(input_dtype) == "float64" else "float32")
    if output_dtype is None:
        output_dtype = input_dtype if machine_epsilon(input_dtype) >= machine_epsilon(compute) else compute
    rounding = output_rounding(output_dtype)
    implementation = hidden_statistics_tolerance(hidden, weight, token_ids, temperature=temperature, dtype=input_dtype,
                                                 accumulation_dtype=compute)
    reference = hidden_statistics_tolerance(hidden, weight, token_ids, temperature=temperature, dtype=np.float64)
    statistics = HiddenStatisticsTolerance(*(mine + theirs + rounding for mine, theirs in zip(implementation, reference)))
    gradients = tuple(
        mine + theirs + rounding for mine, theirs in zip(
            hidden_gradient_tolerance(hidden, weight, token_ids, log_probs_cotangent, entropy_cotangent,
                                      temperature=temperature, dtype=input_dtype, accumulation_dtype=compute),
            hidden_gradient_tolerance(hidden, weight, token_ids, log_probs_cotangent, entropy_cotangent,
                                      temperature=temperature, dtype=np.float64)))
    return statistics, gradients
