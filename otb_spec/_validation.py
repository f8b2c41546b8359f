"""Argument checking shared by every public function of the reference.

Every check raises :class:`ValueError` (or :class:`TypeError` for values that are not arrays of numbers at all)
whose message starts with the argument's name, so a failing call says which input is wrong and why.

Conventions enforced here:

* arrays are converted with :func:`numpy.asarray` and never written to: callers' inputs are never mutated;
* numeric results are computed in float64 whatever the input precision (float16, bfloat16, float32, float64,
  integers and booleans are accepted);
* NaN and ±inf are rejected everywhere, including at masked positions (a NaN at a padding position would poison
  the cumulative sums of any implementation that multiplies by the mask, as verl does);
* masks must hold exactly 0 or 1.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from otb_spec._dtypes import input_range_slack

__all__: list[str] = []  # private module

# Floating dtypes NumPy does not know natively but array libraries hand over (ml_dtypes registers them with kind "V").
_EXTENSION_FLOATS = frozenset({"bfloat16", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"})


def shown(value: Any) -> str:
    """A number as a user would write it (``-0.1``, not ``np.float64(-0.1)``)."""
    try:
        return repr(float(value))
    except (TypeError, ValueError):
        return repr(value)


def is_real_numeric_dtype(dtype: np.dtype) -> bool:
    """True for bool, integer and real floating dtypes (including bfloat16 from ``ml_dtypes``)."""
    return dtype.kind in "biuf" or (dtype.kind == "V" and dtype.name in _EXTENSION_FLOATS)


def to_numpy(name: str, value: Any) -> np.ndarray:
    """``np.asarray(value)`` with a clear error for things that are not arrays of real numbers."""
    if value is None:
        raise TypeError(f"{name}: expected an array, got None")
    try:
        array = np.asarray(value)
    except Exception as exc:  # e.g. a CUDA tensor, which cannot be viewed from the host
        raise TypeError(f"{name}: cannot be converted to a NumPy array ({type(value).__name__}): {exc}") from exc
    if not is_real_numeric_dtype(array.dtype):
        raise TypeError(f"{name}: expected real numbers (bool, int or float), got dtype {array.dtype}")
    return array


def float_array(
    name: str,
    value: Any,
    *,
    ndim: int | None = None,
    shape: tuple[int, ...] | None = None,
    like: str | None = None,
    allow_neg_inf: bool = False,
) -> np.ndarray:
    """Validate ``value`` and return it as a float64 array (a new array unless it already was float64).

    Args:
      name: the argument's name, used in error messages.
      value: array-like of real numbers.
      ndim: required number of dimensions.
      shape: required shape (checked after ``ndim``).
      like: name of the argument ``shape`` comes from, for the error message.
      allow_neg_inf: accept ``-inf`` (used for logits, where it means "probability exactly 0").
    """
    array = to_numpy(name, value)
    if ndim is not None and array.ndim != ndim:
        raise ValueError(f"{name}: expected {ndim} dimensions, got shape {array.shape}")
    if shape is not None and array.shape != shape:
        where = f" (the shape of {like})" if like else ""
        raise ValueError(f"{name}: expected shape {shape}{where}, got {array.shape}")
    result = np.asarray(array, dtype=np.float64)
    check_finite(name, result, allow_neg_inf=allow_neg_inf)
    return result


def check_finite(name: str, array: np.ndarray, *, allow_neg_inf: bool = False) -> None:
    """Reject NaN and infinities, reporting the first offending index."""
    if allow_neg_inf:
        bad = np.isnan(array) | (array == np.inf)
        what = "NaN or +inf"
    else:
        bad = ~np.isfinite(array)
        what = "NaN or ±inf"
    if bad.any():
        first = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ValueError(f"{name}: contains {what} (first at index {first}: {shown(array[first])})")


def batch_shape(name: str, value: Any) -> tuple[int, int]:
    """Shape ``[B, T]`` of the leading ``[B, T]`` argument, rejecting empty batches."""
    array = to_numpy(name, value)
    if array.ndim != 2:
        raise ValueError(f"{name}: expected shape [B, T] (2 dimensions), got {array.shape}")
    n_rows, n_positions = array.shape
    if n_rows == 0:
        raise ValueError(f"{name}: empty batch (B = 0 trajectories)")
    if n_positions == 0:
        raise ValueError(f"{name}: no positions (T = 0)")
    return n_rows, n_positions


def mask_array(name: str, value: Any, shape: tuple[int, ...], like: str) -> np.ndarray:
    """Validate a {0, 1} mask of the given shape and return it as float64 0.0/1.0."""
    array = to_numpy(name, value)
    if array.shape != shape:
        raise ValueError(f"{name}: expected shape {shape} (the shape of {like}), got {array.shape}")
    if array.dtype.kind == "b":
        return array.astype(np.float64)
    as_float = np.asarray(array, dtype=np.float64)
    bad = ~((as_float == 0.0) | (as_float == 1.0))
    if bad.any():
        first = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ValueError(f"{name}: values must be exactly 0 or 1, found {shown(as_float[first])} at index {first}")
    return as_float


def nonnegative(name: str, array: np.ndarray) -> None:
    """Reject negative entries (importance weights, squared norms)."""
    bad = array < 0
    if bad.any():
        first = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ValueError(f"{name}: must be ≥ 0, found {shown(array[first])} at index {first}")


def nonnegative_where(name: str, array: np.ndarray, where: np.ndarray, input_dtype: np.dtype,
                      what: str = "a squared norm") -> None:
    """Reject entries below −slack(input_dtype) at the positions ``where`` selects (rounding may leave −1e-16)."""
    slack = input_range_slack(input_dtype)
    bad = where & (array < -slack)
    if bad.any():
        first = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ValueError(f"{name}: must be ≥ 0 at valid positions ({what}), found {shown(array[first])} at index {first}")


def scalar(name: str, value: Any, *, minimum: float | None = None, maximum: float | None = None,
           min_inclusive: bool = True) -> float:
    """A finite real scalar, optionally bounded. Text is refused, not parsed: ``float("1e-8")`` would accept it."""
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name}: expected a real number, got a bool")
    if isinstance(value, (str, bytes, bytearray, np.str_, np.bytes_)) or (
            isinstance(value, np.ndarray) and value.dtype.kind in "USO"):
        raise TypeError(f"{name}: expected a real number, got text {value!r}")
    try:
        number = float(value)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"{name}: expected a real number, got {value!r}") from exc
    if not np.isfinite(number):
        raise ValueError(f"{name}: must be finite, got {number!r}")
    if minimum is not None and (number < minimum or (not min_inclusive and number == minimum)):
        sign = "≥" if min_inclusive else ">"
        raise ValueError(f"{name}: must be {sign} {minimum}, got {number!r}")
    if maximum is not None and number > maximum:
        raise ValueError(f"{name}: must be ≤ {maximum}, got {number!r}")
    return number


def token_statistics(
    log_probs: Any,
    sum_pi_squared: Any,
    mask: np.ndarray | None,
    shape: tuple[int, ...],
    like: str,
    *,
    names: tuple[str, str] = ("log_probs", "sum_pi_squared"),
    consistency: bool = True,
) -> tuple[np.ndarray, np.ndarray]:
    """Validate the per-token policy statistics (log π(yₜ), Σ_v π_v²) at the positions ``mask`` selects.

    Checked at valid positions, each with the input-precision slack of :func:`otb_spec.tolerances.input_range_slack`:

    * ``log_probs ≤ 0``                      (a log-probability);
    * ``0 ≤ sum_pi_squared ≤ 1``             (a collision probability);
    * ``sum_pi_squared ≥ exp(2·log_probs)``  (Σ_v π_v² contains the sampled token's own π²; catches arrays taken
      from different forward passes or shifted by one position).

    Masked positions may hold anything finite (padding often carries log π = 0, Σπ² = 0). ``consistency=False``
    leaves out the third rule, for a Σπ² whose own error may exceed its slack (verl's from half-precision logits:
    otb_torch.verl).
    """
    lp_name, spp_name = names
    log_probs_raw = to_numpy(lp_name, log_probs)
    spp_raw = to_numpy(spp_name, sum_pi_squared)
    log_probs64 = float_array(lp_name, log_probs_raw, shape=shape, like=like)
    spp64 = float_array(spp_name, spp_raw, shape=shape, like=like)
    valid = np.ones(shape, dtype=bool) if mask is None else mask > 0
    where = "at valid positions" if mask is not None else "at every position (no mask here)"
    slack_lp = input_range_slack(log_probs_raw.dtype)
    slack_spp = input_range_slack(spp_raw.dtype)
    _check_where(lp_name, log_probs64, valid & (log_probs64 > slack_lp),
                 f"must be ≤ 0 {where} (a log-probability; slack {slack_lp:g})")
    _check_where(spp_name, spp64, valid & ((spp64 < -slack_spp) | (spp64 > 1.0 + slack_spp)),
                 f"must lie in [0, 1] {where} (Σ_v π_v²; slack {slack_spp:g})")
    own = np.exp(2.0 * np.minimum(log_probs64, 0.0))
    inconsistent = valid & (spp64 < own - (slack_spp + 2.0 * slack_lp)) & consistency
    if inconsistent.any():
        first = tuple(int(i) for i in np.argwhere(inconsistent)[0])
        raise ValueError(
            f"{spp_name}: must be ≥ π² = exp(2·{lp_name}) {where} (Σ_v π_v² contains the sampled "
            f"token's own π²); at index {first} {spp_name} = {shown(spp64[first])} < π² = {shown(own[first])}. "
            f"Were {lp_name} and {spp_name} taken from different forward passes or shifted by one position? "
            f"(Or were float32 statistics cast to float64? The slack follows the dtype the arrays arrive in — "
            f"{slack_spp + 2.0 * slack_lp:g} here — so pass them in the precision they were computed in. A Σπ² "
            f"from half-precision logits by exp(lse(2z) − 2·lse(z)) in that precision, as verl's actor computes it "
            f"under bf16, can be tens of percent off: compute it accurately, e.g. otb_torch.sum_pi_squared.)"
        )
    return log_probs64, spp64


def _check_where(name: str, array: np.ndarray, bad: np.ndarray, requirement: str) -> None:
    if bad.any():
        first = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ValueError(f"{name}: {requirement}; found {shown(array[first])} at index {first}")


def flag(name: str, value: Any) -> bool:
    """A boolean option (``handle_zero_tail``, ``leave_one_out``, …): exactly True or False."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name}: expected True or False, got {value!r}")
    return bool(value)


def zero_tail(handle_zero_tail: Any, leave_one_out: bool) -> bool:
    """verl's zero-tail rule as asked for: None means on for the self-inclusive baseline and off for leave-one-out;
    asking for it with leave-one-out is an error (no other member valid already gives a 0 baseline there)."""
    if handle_zero_tail is None:
        return not leave_one_out
    handle_zero_tail = flag("handle_zero_tail", handle_zero_tail)
    if handle_zero_tail and leave_one_out:
        raise ValueError("handle_zero_tail: not applicable to the leave-one-out baseline (leave_one_out=True, "
                         "variant='leave_one_out'): where no other member is valid it is already 0; leave it unset")
    return handle_zero_tail


ALIGNMENTS = ("position", "valid_token")


def alignment(value: Any) -> str:
    """The ``align`` option: ``"position"`` (single-turn) or ``"valid_token"`` (multi-turn)."""
    if not isinstance(value, str) or value not in ALIGNMENTS:
        raise ValueError(f"align: expected one of {ALIGNMENTS}, got {value!r}")
    return value


def epsilon(value: Any) -> float:
    """The ε of a baseline's denominator: a finite scalar ≥ 0."""
    return scalar("epsilon", value, minimum=0.0)


def weights_may_overflow(largest_rho: float, positions: int, dtype_max: float) -> bool:
    """Whether importance weights up to ``largest_rho`` can take the realized energy Σ ρ²·(1 − 2π + Σπ²) out of a
    dtype whose largest value is ``dtype_max`` on their own: 2·T·max ρ² ≥ it (each w ≤ 2, T terms)."""
    return largest_rho > 0 and 2 * math.log(largest_rho) >= math.log(dtype_max) - math.log(2.0 * max(positions, 1))


def weights_overflow_error(largest_rho: float, dtype_name: str, *, certain: bool) -> ValueError:
    """The error naming is_weights where ρ² overflowed the realized energy (``certain``: the reference saw it) or can
    leave ``dtype_name``'s range (the ports' attribution of a non-finite result, :func:`weights_may_overflow`)."""
    what = (f"ρ² in the realized energy Σ ρ²·(1 − 2π + Σπ²) overflows {dtype_name}" if certain
            else f"the realized energy Σ ρ²·(1 − 2π + Σπ²) can leave {dtype_name}'s range")
    return ValueError(f"is_weights: finite, but {what} (ρ up to {largest_rho:.3g}); weights this large carry no usable "
                      "gradient: truncate them, or check how they were computed")


def output_range_error(name: str, dtype_name: str, dtype_max: float) -> ValueError:
    """The error naming the input whose narrower dtype the outputs take (the rewards; log_probs for the realized
    energy) where OTB's results, finite in the compute dtype, leave that dtype's range (float16: ±65504)."""
    wider = "float64" if dtype_name == "float32" else "float32"
    remedy = ", or scale them down" if name == "rewards" else ""
    return ValueError(f"{name}: finite, but OTB's results leave {dtype_name}'s range (±{dtype_max:.5g}), the dtype "
                      f"the outputs take from {name}: pass {name} in {wider}{remedy}")


def returns_overflow_error(name: str, dtype_name: str) -> ValueError:
    """The error naming the rewards where their returns-to-go Σ_{k≥t} mₖrₖ, each reward finite, leave the compute
    dtype (the ports' returns_to_go; the OTB functions say so in their own overflow error)."""
    return ValueError(f"{name}: finite, but their returns-to-go Σ_{{k≥t}} mₖrₖ overflow {dtype_name}; scale them down, "
                      "or pass float64")


def raise_value_error(host: Any, *, rewards: tuple[str, Any] | None = None, mask: tuple[str, Any] | None = None,
                      log_probs: tuple[str, Any] | None = None, sum_pi_squared: tuple[str, Any] | None = None,
                      is_weights: tuple[str, Any] | None = None, others: list[tuple[str, Any]] | None = None,
                      energies: list[tuple[str, Any]] | None = None, flagged: bool = True,
                      consistency: bool = True) -> None:
    """Raise the reference's error, naming the argument, for (name, array) pairs a port's device-side check flagged.

    ``host`` copies a port's array to a NumPy array. The rules run in the reference's order: finite values
    (``rewards``, ``others``, ``energies``), a 0/1 ``mask``, ``energies`` ≥ 0 at valid positions, the token
    statistics, ``is_weights`` ≥ 0. If none fires, the device and the host disagree: that is reported as such —
    unless ``flagged=False`` (the port asks for the exact check without a device flag), when it returns.
    ``consistency=False``: without the rule Σπ² ≥ π² (:func:`token_statistics`).
    """
    others, energies = others or [], energies or []
    like = rewards[0] if rewards is not None else "the first argument"
    for item in (rewards, *others, *energies):
        if item is not None:
            float_array(item[0], host(item[1]))
    mask_host = None
    if mask is not None:
        mask_host = mask_array(mask[0], host(mask[1]), tuple(mask[1].shape), like=like)
    for name, energy in energies:
        energy_host = host(energy)
        where = np.ones(tuple(energy.shape), dtype=bool) if mask_host is None else mask_host > 0
        nonnegative_where(name, float_array(name, energy_host), where, energy_host.dtype)
    if log_probs is not None and sum_pi_squared is not None:
        token_statistics(host(log_probs[1]), host(sum_pi_squared[1]), mask_host, tuple(log_probs[1].shape),
                         like=like, names=(log_probs[0], sum_pi_squared[0]), consistency=consistency)
    if is_weights is not None:
        nonnegative(is_weights[0], float_array(is_weights[0], host(is_weights[1])))
    if flagged:
        raise ValueError("inputs: a value check failed on the device but not on the host copy; please report this")
