"""Every numerical tolerance used by the project, decided in one place.

Nothing in the tests, the adapters' equivalence suites or the conformance verifier picks a tolerance by hand: they
call the functions below, which derive it from the machine epsilon ``ε`` of the dtype and from the size of the
computation. ``u = ε/2`` is the unit round-off.

============================  ==========================================  =================================================
quantity                      bound                                       reason
============================  ==========================================  =================================================
elementwise formula           ``rtol = 8ε``                               a handful of correctly rounded operations
sum of ``n`` terms            ``atol = n·ε·Σ|terms|``                     the classic recursive-summation bound γₙ ≤ n·u/(1−n·u)
Σπ² / log-sum-exp of logits   ``rtol = 8ε·(V + Δz)``                      ``exp`` amplifies the absolute error of ``z − max z``
                                                                          (≤ ε·Δz, Δz = max z − min z) into a relative error
proxy w from logits           ``atol = 8ε·(V + 4·max|z| + 4)``            log π = z_y − lse(z) carries an absolute error
                                                                          ε·(|z_y| + |lse|); w = 1 − 2π + Σπ² is O(1)
port vs reference             ``rtol = atol = 4·√ε``                      the default for independent implementations (STYLE.md)
OTB advantages and returns    per-element forward error bound              :func:`otb_tolerance`: first-order error analysis
                                                                          of the whole pipeline (docs/tolerances.md); +inf
                                                                          where the problem is ill-conditioned
input range checks            :func:`input_range_slack` table             admits rounding of the producer, not mis-scaling
============================  ==========================================  =================================================

``ε``: float64 2⁻⁵², float32 2⁻²³, float16 2⁻¹⁰, bfloat16 2⁻⁷.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = [
    "Tolerance",
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
]

# Smallest positive normal number: below it results may be subnormal or flushed to zero (compiled and GPU kernels often
# flush), so every operation can add an absolute error up to this much (the "η" term of the floating-point model).
_SMALLEST_NORMAL_BY_NAME = {
    "float64": 2.0**-1022,
    "float32": 2.0**-126,
    "bfloat16": 2.0**-126,
    "float16": 2.0**-14,
}

_EPSILON_BY_NAME = {
    "float64": 2.0**-52,
    "float32": 2.0**-23,
    "float16": 2.0**-10,
    "bfloat16": 2.0**-7,
    "float8_e4m3fn": 2.0**-3,
    "float8_e4m3fnuz": 2.0**-3,
    "float8_e5m2": 2.0**-2,
    "float8_e5m2fnuz": 2.0**-2,
}

# Slack for the range checks of inputs (log π ≤ 0, 0 ≤ Σπ² ≤ 1, Σπ² ≥ π²). It admits the rounding of a producer
# evaluating exp(lse(2z) − 2·lse(z)) in that precision at |z| ≤ 1e4 (float32: ulp(2e4) ≈ 2e-3 in each log-sum-exp),
# and still rejects swapped or mis-scaled arguments (π passed as log π, entropy passed as Σπ²), which are off by O(1).
_RANGE_SLACK_BY_NAME = {
    "float64": 1e-9,
    "float32": 1e-2,
    "float16": 1e-2,
    "bfloat16": 3e-2,
}


def smallest_normal(dtype: Any) -> float:
    """The smallest positive normal number of a floating dtype (float64's for integer and unknown dtypes)."""
    return _SMALLEST_NORMAL_BY_NAME.get(_dtype_name(dtype), _SMALLEST_NORMAL_BY_NAME["float64"])


def machine_epsilon(dtype: Any) -> float:
    """Machine epsilon ε (gap between 1 and the next representable number) of a floating dtype.

    Integer and boolean dtypes are exact inputs; they are computed in float64, so float64's ε is returned.

    >>> machine_epsilon(np.float32) == 2.0**-23
    True
    """
    name = _dtype_name(dtype)
    if name in _EPSILON_BY_NAME:
        return _EPSILON_BY_NAME[name]
    if name.startswith(("int", "uint", "bool")):
        return _EPSILON_BY_NAME["float64"]
    raise ValueError(f"dtype: no machine epsilon known for {name!r}")


@dataclass(frozen=True)
class Tolerance:
    """``|actual − expected| ≤ atol + rtol·|expected|`` elementwise (the :func:`numpy.isclose` rule).

    Attributes:
      rtol: relative tolerance, a float or an array of the compared shape (per-element bounds).
      atol: absolute tolerance, a float or an array of the compared shape (per-element bounds; +inf marks an
        element whose value is ill-conditioned and is not checked).
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
        """Boolean array, True where ``actual`` is outside the tolerance of ``expected`` (NaN is a violation)."""
        actual = np.asarray(actual, dtype=np.float64)
        expected = np.asarray(expected, dtype=np.float64)
        allowed = self.atol + self.rtol * np.abs(expected)
        with np.errstate(invalid="ignore"):
            close = np.abs(actual - expected) <= allowed
        unchecked = np.isinf(allowed) & ~np.isnan(actual)
        return ~(close | unchecked)

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
        allowed = np.broadcast_to(self.atol + self.rtol * np.abs(expected), bad.shape)
        excess = np.where(bad, np.abs(actual - expected) - allowed, -np.inf)
        worst = np.unravel_index(int(np.nanargmax(np.nan_to_num(excess, nan=np.inf))), bad.shape) if bad.ndim else ()
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
    """Σπ² (or any ratio of exponential sums) of ``vocab_size`` logits spanning ``logit_spread = max z − min z``.

    ``z − max z`` carries an absolute rounding error ≤ ε·Δz, which ``exp`` turns into a relative error of the same size;
    the V-term sums add ``V·ε``. Hence ``rtol = 8ε·(V + Δz)``. ``logit_spread`` may be a float or an array of
    per-row spreads (:func:`logit_spread`), giving per-element bounds.
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


def input_range_slack(dtype: Any) -> float:
    """How far outside its mathematical range an input of this dtype may be before it is rejected.

    ============  =======
    dtype         slack
    ============  =======
    float64       1e-9
    float32       1e-2
    float16       1e-2
    bfloat16      3e-2
    int, bool     0
    ============  =======
    """
    name = _dtype_name(dtype)
    if name in _RANGE_SLACK_BY_NAME:
        return _RANGE_SLACK_BY_NAME[name]
    if name.startswith(("int", "uint", "bool")):
        return 0.0
    if name in _EPSILON_BY_NAME:  # float8 formats: a quarter of the unit interval is all they resolve
        return 0.25
    raise ValueError(f"dtype: no input range slack known for {name!r}")


def _dtype_name(dtype: Any) -> str:
    """"float32" for np.float32, np.dtype("float32"), "float32", "torch.float32", torch.float32, jnp.float32, …"""
    if isinstance(dtype, str):
        return dtype.rsplit(".", 1)[-1]
    name = getattr(dtype, "name", None)  # np.dtype, or a torch/jax dtype exposing .name? (torch does not)
    if isinstance(name, str) and not isinstance(dtype, type):
        return name
    try:
        return np.dtype(dtype).name
    except TypeError:
        text = str(dtype)  # e.g. "torch.float32"
        return text.rsplit(".", 1)[-1]


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
) -> tuple[Tolerance, Tolerance]:
    """Per-element tolerances (advantages, returns) for an OTB implementation computing in ``dtype``.

    Each is a rigorous first-order bound on |computed − exact| for *any* summation order, from a forward error
    analysis of w → W → G → (N, D) → B → A (derivation: ``otb_spec.otb._error_bounds`` and docs/tolerances.md). The
    bound grows with T, the group size and 1/(Σ W + ε); where the denominator itself is not known to within a factor
    of two in ``dtype`` (e.g. near-deterministic prefixes with W ≈ ε), the element is ill-conditioned: its tolerance
    is +inf and it is not checked (:meth:`Tolerance.checked_fraction` tells how many are).

    To compare two implementations, add their tolerances: ``otb_tolerance(..., dtype=np.float32)[0] +
    otb_tolerance(..., dtype=np.float64)[0]`` bounds |float32 result − float64 reference|.

    Args:
      rewards, response_mask, group_ids, log_probs, sum_pi_squared, is_weights, handle_zero_tail, epsilon: the
        inputs of the OTB call being checked.
      align: ``"position"`` (single-turn) or ``"valid_token"`` (multi-turn).
      leave_one_out: the leave-one-out variant.
      dtype: the precision the implementation computes in.
    """
    from otb_spec.otb import _validated  # local import: otb imports this module

    prepared = _validated(rewards, response_mask, group_ids, log_probs, sum_pi_squared, is_weights)
    return _otb_bounds(prepared, align=align, leave_one_out=leave_one_out, handle_zero_tail=handle_zero_tail,
                       epsilon=epsilon, dtype=dtype)


def _otb_bounds(prepared: tuple, *, align: str, leave_one_out: bool, handle_zero_tail: bool, epsilon: float,
                dtype: Any) -> tuple[Tolerance, Tolerance]:
    """:func:`otb_tolerance` on inputs already validated by ``otb_spec.otb._validated``."""
    from otb_spec.otb import _error_bounds  # local import: otb imports this module

    unit = machine_epsilon(dtype)
    advantage_bound, returns_bound = _error_bounds(
        *prepared, align=align, leave_one_out=leave_one_out,
        handle_zero_tail=handle_zero_tail and not leave_one_out, epsilon=float(epsilon), unit=unit)
    name = _dtype_name(dtype)
    # underflow: each of the O(T + group size) operations on an element may add up to the smallest normal number
    mask = np.asarray(prepared[1])
    underflow = (mask.shape[1] + int(prepared[2].sizes.max()) + 16) * smallest_normal(dtype)
    return (Tolerance(rtol=unit, atol=advantage_bound + underflow * mask, reason=f"OTB forward error bound in {name}"),
            Tolerance(rtol=unit, atol=returns_bound + underflow, reason=f"return-to-go error bound in {name}"))


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
) -> tuple[Tolerance, Tolerance]:
    """Tolerances (advantages, returns) for |implementation − float64 reference| on the same inputs.

    = the implementation's bound in ``compute_dtype`` + the reference's float64 bound + the rounding of the output to
    ``output_dtype`` (default: ``compute_dtype``). See :func:`otb_tolerance`.
    """
    from otb_spec.otb import _validated  # local import: otb imports this module

    prepared = _validated(rewards, response_mask, group_ids, log_probs, sum_pi_squared, is_weights)   # once for both
    options = dict(align=align, leave_one_out=leave_one_out, handle_zero_tail=handle_zero_tail, epsilon=epsilon)
    implementation = _otb_bounds(prepared, dtype=compute_dtype, **options)
    reference = _otb_bounds(prepared, dtype=np.float64, **options)
    rounding = output_rounding(compute_dtype if output_dtype is None else output_dtype)
    return (implementation[0] + reference[0] + rounding, implementation[1] + reference[1] + rounding)
