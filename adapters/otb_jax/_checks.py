"""Argument checks for the JAX port, with the reference's rules and messages.

Shapes and dtypes are checked at call time (also while tracing). Values are checked only for concrete arrays (never
inside a trace, where they are unknown): device-side reductions folded into one boolean, and on failure the host copies
go to the NumPy reference's validators so the message is the reference's, with the caller's argument names.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from otb_spec import _validation as reference_checks
from otb_spec.tolerances import input_range_slack

__all__: list[str] = []

Named = tuple[str, jax.Array]


def is_traced(*values: Any) -> bool:
    return any(isinstance(value, jax.core.Tracer) for value in values)


def concrete_flag(flag: Any) -> bool | None:
    """bool(flag) for a concrete flag; None inside the caller's trace (jit, vmap, grad), where even a flag computed
    from closed-over constant arrays is abstract: values there are unknown and go unchecked, as traced inputs do."""
    try:
        return bool(flag)
    except jax.errors.ConcretizationTypeError:
        return None


def narrower(output: Any, compute: Any) -> bool:
    """Whether outputs in ``output`` can overflow where ``compute`` holds the results: float16 against float32 or
    float64, float32 against float64 — not bfloat16 against float32 (as otb_torch._otb._narrower)."""
    output = jnp.dtype(output)
    return bool(jnp.issubdtype(output, jnp.floating)) and float(jnp.finfo(output).max) < 0.5 * float(
        jnp.finfo(compute).max)


def output_range_error(name: str, output: Any) -> ValueError:
    """otb_spec._validation.output_range_error for outputs in ``output``, the dtype they take from ``name``."""
    output = jnp.dtype(output)
    return reference_checks.output_range_error(name, output.name, float(jnp.finfo(output).max))


def raise_if_weights_may_overflow(is_weights: Any, mask: Any, compute_dtype: Any) -> None:
    """Raise naming is_weights where ρ (read where ``mask`` is nonzero) alone can take the realized energy out of
    ``compute_dtype``'s range (2·T·max ρ² beyond it, as otb_torch)."""
    if not np.size(is_weights):
        return
    rho = np.abs(np.asarray(is_weights, dtype=np.float64))
    if mask is not None:
        rho = np.where(np.asarray(mask) != 0, rho, 0.0)
    largest_rho = float(rho.max())
    if reference_checks.weights_may_overflow(largest_rho, rho.shape[-1], float(np.finfo(compute_dtype).max)):
        raise reference_checks.weights_overflow_error(largest_rho, np.dtype(compute_dtype).name, certain=False)


def finite_outputs(enabled: bool, name: str, outputs: Any, compute_dtype: Any, is_weights: Any = None,
                   mask: Any = None) -> None:
    """After the computation (a second synchronisation, skipped while tracing): valid finite inputs whose arithmetic
    left ``compute_dtype``'s range — the returns-to-go, or the group sums Σᵢ GₜⁱWₜⁱ — raise, naming ``name``, instead of
    returning ±inf/NaN (the reference's rule, otb_spec.otb); naming ``is_weights`` (read where ``mask`` is nonzero)
    where ρ alone can overflow the realized energy (2·T·max ρ² beyond the range, as otb_torch); naming the outputs'
    dtype where it is narrower than the compute dtype (float16 rewards) and the values left its range."""
    if not enabled or is_traced(*outputs):
        return
    finite = concrete_flag(jnp.all(jnp.stack([jnp.all(jnp.isfinite(value)) for value in outputs])))
    if finite is None or finite:
        return
    if is_weights is not None:
        raise_if_weights_may_overflow(is_weights, mask, compute_dtype)
    if narrower(outputs[0].dtype, compute_dtype):
        raise output_range_error(name, outputs[0].dtype)
    returns = np.nan_to_num(np.abs(np.asarray(outputs[1], dtype=np.float64)), nan=0.0, posinf=np.inf)
    largest = float(returns.max()) if returns.size else 0.0
    raise ValueError(f"{name}: finite, but OTB's arithmetic overflows {np.dtype(compute_dtype).name}: the returns (up "
                     f"to {largest:.3g} in magnitude) times the realized energies, summed over a group (Σᵢ GₜⁱWₜⁱ), "
                     "leave its range; scale the rewards down, or pass float64 (with jax_enable_x64)")


def concrete_values(values: Any) -> np.ndarray | None:
    """The host copy of a concrete array; None inside the caller's trace (as :func:`concrete_flag`)."""
    try:
        return np.asarray(values)
    except (jax.errors.ConcretizationTypeError, jax.errors.TracerArrayConversionError):
        return None


def array(name: str, value: Any, *, like: jax.Array | None = None, like_name: str = "") -> jax.Array:
    if value is None:
        raise TypeError(f"{name}: expected an array, got None")
    if not isinstance(value, jax.Array):
        host = np.asarray(value)
        if not reference_checks.is_real_numeric_dtype(host.dtype):
            raise TypeError(f"{name}: expected real numbers (bool, int or float), got dtype {host.dtype}")
        value = jnp.asarray(host)
    dtype = np.dtype(value.dtype)
    if not reference_checks.is_real_numeric_dtype(dtype):
        raise TypeError(f"{name}: expected real numbers (bool, int or float), got dtype {dtype}")
    if like is not None and value.shape != like.shape:
        raise ValueError(f"{name}: expected shape {tuple(like.shape)} (the shape of {like_name}), got "
                         f"{tuple(value.shape)}")
    return value


def token_ids(value: Any, lead: tuple[int, ...], source: str, axis: str) -> jax.Array:
    """Integer token ids of shape ``lead`` (that of ``source`` without its ``axis`` axis), widened to at least 32 bits
    so that comparing them with V does not wrap V around in a narrow dtype (300 is 44 in uint8). 64-bit host ids
    outside 32 bits are refused while ``jax_enable_x64`` is off: JAX would truncate them silently, and 2³² + 1 would
    become the valid id 1."""
    if not isinstance(value, jax.Array):
        host = np.asarray(value)
        if host.dtype.kind in "iu" and host.size:
            canonical = np.dtype(jax.dtypes.canonicalize_dtype(host.dtype))
            info = np.iinfo(canonical)
            outside = (host < info.min) | (host > info.max)
            if canonical != host.dtype and outside.any():
                first = tuple(int(i) for i in np.argwhere(outside)[0])
                raise ValueError(f"token_ids: {int(host[first])} at index {first} does not fit {canonical}, JAX's "
                                 f"integer type while jax_enable_x64 is off (it would wrap into another id); no "
                                 f"vocabulary holds it")
    ids = array("token_ids", value)
    if np.dtype(ids.dtype).kind not in "iu":
        raise TypeError(f"token_ids: expected integer token ids, got dtype {ids.dtype}")
    if tuple(ids.shape) != tuple(lead):
        raise ValueError(f"token_ids: expected shape {tuple(lead)} ({source} without the {axis} axis), got "
                         f"{tuple(ids.shape)}")
    return widened_ids(ids)


def widened_ids(ids: jax.Array) -> jax.Array:
    """Integer ids in at least 32 bits (int32 for narrower ones), so that comparing them with V cannot wrap V."""
    return ids.astype(jnp.int32) if np.dtype(ids.dtype).itemsize < 4 else ids


def batch(name: str, value: Any) -> jax.Array:
    value = array(name, value)
    if value.ndim != 2:
        raise ValueError(f"{name}: expected shape [B, T] (2 dimensions), got {tuple(value.shape)}")
    if value.shape[0] == 0:
        raise ValueError(f"{name}: empty batch (B = 0 trajectories)")
    if value.shape[1] == 0:
        raise ValueError(f"{name}: no positions (T = 0)")
    return value


TOKEN_NAMES = ("rewards", "response_mask", "log_probs", "sum_pi_squared", "is_weights")


def token_batch(rewards: Any, response_mask: Any, log_probs: Any, sum_pi_squared: Any, is_weights: Any,
                names: tuple[str, str, str, str, str] = TOKEN_NAMES
                ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array | None]:
    """The [B, T] token inputs as arrays, each with the first one's shape (metadata only; ``is_weights`` may be
    None). ``names`` are the caller's argument names, first one first."""
    first = batch(names[0], rewards)
    others = [array(name, value, like=first, like_name=names[0])
              for name, value in zip(names[1:4], (response_mask, log_probs, sum_pi_squared))]
    weights = None if is_weights is None else array(names[4], is_weights, like=first, like_name=names[0])
    return first, others[0], others[1], others[2], weights


def segments(name: str, segment_ids: Any, num_segments: Any, rows: int, check_values: bool) -> jax.Array:
    """Integer segment ids [B] in [0, num_segments) (checked when concrete).

    ``num_segments`` may exceed the number of groups: empty segments contribute nothing, so a caller can fix it (e.g.
    to B) and avoid a recompilation whenever the number of groups changes.
    """
    if isinstance(num_segments, bool) or not isinstance(num_segments, (int, np.integer)) or num_segments < 1:
        raise ValueError(f"num_segments: expected a positive Python int (static), got {num_segments!r}")
    ids = array(name, segment_ids)
    if ids.ndim != 1 or ids.shape[0] != rows:
        raise ValueError(f"{name}: expected {rows} ids (one per trajectory) in a 1-D array, got shape "
                         f"{tuple(ids.shape)}")
    if np.dtype(ids.dtype).kind not in "iu":
        raise TypeError(f"{name}: expected integer segment ids (see otb_jax.segment_ids), got dtype {ids.dtype}")
    if check_values and not is_traced(ids):
        host = np.asarray(ids)
        if host.min() < 0 or host.max() >= num_segments:
            raise ValueError(f"{name}: ids must lie in [0, {num_segments}) (num_segments), got range "
                             f"[{host.min()}, {host.max()}]")
    return ids.astype(jnp.int32)


def compute_dtype(*values: jax.Array | None) -> str:
    return "float64" if any(v is not None and v.dtype == jnp.float64 for v in values) else "float32"


def output_dtype(reference: jax.Array) -> str:
    dtype = np.dtype(reference.dtype)
    return dtype.name if dtype.kind == "f" or dtype.name == "bfloat16" else "float32"


def _static(name: str, value: Any) -> None:
    """An option the computation branches on must be a Python value, not one traced by jax.jit."""
    if is_traced(value):
        raise TypeError(f"{name}: expected a static Python value, got a traced one — under jax.jit, pass {name} with "
                        "static_argnames (or close over it)")


def epsilon(value: Any) -> float:
    _static("epsilon", value)
    return reference_checks.epsilon(value)


def flag(name: str, value: Any) -> bool:
    _static(name, value)
    return reference_checks.flag(name, value)


def zero_tail(handle_zero_tail: Any, leave_one_out: bool) -> bool:
    _static("handle_zero_tail", handle_zero_tail)
    return reference_checks.zero_tail(handle_zero_tail, leave_one_out)


def _slack(value: jax.Array) -> float:
    return input_range_slack(np.dtype(value.dtype))


def _floating(value: jax.Array) -> bool:
    return jnp.issubdtype(value.dtype, jnp.floating)


def _problems(rewards, mask, log_probs, sum_pi_squared, is_weights, others, energies) -> jax.Array:
    flags = []
    for item in (rewards, log_probs, sum_pi_squared, is_weights, *others, *energies):
        if item is not None and _floating(item[1]):
            flags.append(~jnp.all(jnp.isfinite(item[1])))
    valid = None if mask is None else mask[1] != 0
    if mask is not None:
        flags.append(jnp.any((mask[1] != 0) & (mask[1] != 1)))
    if is_weights is not None:
        flags.append(jnp.any(is_weights[1] < 0))
    for _, energy in energies:
        low = energy < -_slack(energy)
        flags.append(jnp.any(low if valid is None else low & valid))
    if log_probs is not None and sum_pi_squared is not None:
        wide = jnp.float64 if jnp.float64 in (log_probs[1].dtype, sum_pi_squared[1].dtype) else jnp.float32
        lp, spp = log_probs[1].astype(wide), sum_pi_squared[1].astype(wide)
        slack_lp, slack_spp = _slack(log_probs[1]), _slack(sum_pi_squared[1])
        own = jnp.exp(2 * jnp.minimum(lp, 0))
        bad = (lp > slack_lp) | (spp < -slack_spp) | (spp > 1 + slack_spp) | (spp < own - (slack_spp + 2 * slack_lp))
        flags.append(jnp.any(bad if valid is None else bad & valid))
    return jnp.any(jnp.stack(flags)) if flags else jnp.asarray(False)


def _host(value: jax.Array) -> np.ndarray:
    host = np.asarray(value)
    return host.astype(np.float32) if host.dtype.name == "bfloat16" else host


def check_values(enabled: bool, *, rewards: Named | None = None, mask: Named | None = None,
                 log_probs: Named | None = None, sum_pi_squared: Named | None = None,
                 is_weights: Named | None = None, others: list[Named] | None = None,
                 energies: list[Named] | None = None) -> None:
    """One synchronisation (skipped while tracing); raise the reference's error if a value rule is violated."""
    others, energies = others or [], energies or []
    present = [item[1] for item in (rewards, mask, log_probs, sum_pi_squared, is_weights, *others, *energies)
               if item is not None]
    if not enabled or is_traced(*present):
        return
    if not concrete_flag(_problems(rewards, mask, log_probs, sum_pi_squared, is_weights, others, energies)):
        return
    reference_checks.raise_value_error(_host, rewards=rewards, mask=mask, log_probs=log_probs,
                                       sum_pi_squared=sum_pi_squared, is_weights=is_weights, others=others,
                                       energies=energies)
