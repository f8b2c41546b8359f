"""Argument checks for the torch adapter, with the reference's rules and messages.

Metadata (shapes, dtypes, devices) is checked for free. Values (NaN/inf, binary masks, ranges of the token statistics,
negative IS weights) are checked with device-side reductions folded into a single boolean — one host synchronisation
per call — and only if that flag says something is wrong are the offending tensors copied to the host and handed to the
NumPy reference's validators, so the error message is exactly the reference's (with the caller's argument names).
``check_values=False`` skips the value checks: the hot path is then free of host–device synchronisation.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from otb_spec import _validation as reference_checks
from otb_spec.tolerances import input_range_slack

__all__: list[str] = []

Named = tuple[str, torch.Tensor]


def tensor(name: str, value: Any, *, like: torch.Tensor | None = None, like_name: str = "") -> torch.Tensor:
    """A detached tensor of real numbers, on ``like``'s device and with its shape when given (metadata only)."""
    if value is None:
        raise TypeError(f"{name}: expected a tensor, got None")
    if not isinstance(value, torch.Tensor):
        try:
            value = torch.as_tensor(np.asarray(value), device=None if like is None else like.device)
        except Exception as exc:
            raise TypeError(f"{name}: cannot be converted to a tensor ({type(value).__name__}): {exc}") from exc
    if value.is_complex() or not (value.is_floating_point() or value.dtype in (
            torch.bool, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)):
        raise TypeError(f"{name}: expected real numbers (bool, int or float), got dtype {value.dtype}")
    if like is not None:
        if value.device != like.device:
            raise ValueError(f"{name}: on {value.device} but {like_name} is on {like.device}; move all inputs to one "
                             "device")
        if value.shape != like.shape:
            raise ValueError(f"{name}: expected shape {tuple(like.shape)} (the shape of {like_name}), got "
                             f"{tuple(value.shape)}")
    return value.detach()


def batch(name: str, value: Any) -> torch.Tensor:
    """The leading [B, T] tensor: 2-D, non-empty."""
    value = tensor(name, value)
    if value.dim() != 2:
        raise ValueError(f"{name}: expected shape [B, T] (2 dimensions), got {tuple(value.shape)}")
    if value.shape[0] == 0:
        raise ValueError(f"{name}: empty batch (B = 0 trajectories)")
    if value.shape[1] == 0:
        raise ValueError(f"{name}: no positions (T = 0)")
    return value


TOKEN_NAMES = ("rewards", "response_mask", "log_probs", "sum_pi_squared", "is_weights")


def token_batch(rewards: Any, response_mask: Any, log_probs: Any, sum_pi_squared: Any, is_weights: Any,
                names: tuple[str, str, str, str, str] = TOKEN_NAMES
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The [B, T] token inputs as detached tensors, each with the first one's shape and device (metadata only;
    ``is_weights`` may be None). ``names`` are the caller's argument names, first one first."""
    first = batch(names[0], rewards)
    others = [tensor(name, value, like=first, like_name=names[0])
              for name, value in zip(names[1:4], (response_mask, log_probs, sum_pi_squared))]
    weights = None if is_weights is None else tensor(names[4], is_weights, like=first, like_name=names[0])
    return first, others[0], others[1], others[2], weights


def accumulation_dtype(*tensors: torch.Tensor | None) -> torch.dtype:
    """float64 if any floating input is float64, else float32 (half precision is accumulated in float32)."""
    return torch.float64 if any(t is not None and t.dtype == torch.float64 for t in tensors) else torch.float32


def output_dtype(reference: torch.Tensor) -> torch.dtype:
    """Outputs take the dtype of the rewards (float32 when those are integers or booleans)."""
    return reference.dtype if reference.is_floating_point() else torch.float32


def slack(value: torch.Tensor) -> float:
    """The reference's input-range slack for this tensor's dtype (:func:`otb_spec.tolerances.input_range_slack`)."""
    return input_range_slack(value.dtype)


_slack = slack


def _not_finite(value: torch.Tensor) -> torch.Tensor:
    """True if any element is NaN or ±inf: one min/max pass (both propagate NaN)."""
    low, high = torch.aminmax(value)
    return ~(torch.isfinite(low) & torch.isfinite(high))


def not_binary(mask: torch.Tensor) -> torch.Tensor:
    """True if any element is outside {0, 1}.

    Floating masks: m − m·m is exactly 0 only for m ∈ {0, 1} (fl(m·m) = m has no other solution: it would need
    |m − 1| below half an ulp of 1; NaN and ±inf give NaN), checked with one fused pass and one min/max pass —
    comparisons producing bool tensors cost several times more on CPU. Other dtypes: the direct comparison.
    """
    if mask.dtype == torch.bool:
        return torch.zeros((), dtype=torch.bool, device=mask.device)
    if not mask.is_floating_point():
        return ((mask != 0) & (mask != 1)).any()
    low, high = torch.aminmax(torch.addcmul(mask, mask, mask, value=-1.0))
    return (low != 0) | (high != 0)


def problems(*, rewards: torch.Tensor | None = None, mask: torch.Tensor | None = None,
             log_probs: torch.Tensor | None = None, sum_pi_squared: torch.Tensor | None = None,
             is_weights: torch.Tensor | None = None, others: tuple[torch.Tensor, ...] = (),
             energies: tuple[torch.Tensor, ...] = (), consistency: bool = True) -> torch.Tensor:
    """A 0-dim bool tensor on the inputs' device: True if any value rule of the reference is violated (without
    Σπ² ≥ π² where ``consistency`` is False).

    No synchronisation; the rules are evaluated in the inputs' precision (at least float32), which is exact enough
    for slacks of 1e-9 (float64) and 1e-2 (float32 and below). Rules that hold "at valid positions" are evaluated on
    ``value · mask`` (masked positions become 0, inside every range; a non-binary mask raises its own flag, and the
    host check then reports it), with min/max reductions rather than bool tensors, which are slow on CPU.
    """
    flags = []
    for value in (rewards, log_probs, sum_pi_squared, is_weights, *others, *energies):
        if value is not None and value.is_floating_point():
            flags.append(_not_finite(value))
    if mask is not None:
        flags.append(not_binary(mask))
    if is_weights is not None:
        flags.append(is_weights.amin() < 0)

    def at_valid(value: torch.Tensor) -> torch.Tensor:
        return value if mask is None else value * mask

    for energy in energies:
        flags.append(at_valid(energy).amin() < -_slack(energy))
    if log_probs is not None and sum_pi_squared is not None:
        wide = torch.float64 if torch.float64 in (log_probs.dtype, sum_pi_squared.dtype) else torch.float32
        lp, spp = log_probs.to(wide), sum_pi_squared.to(wide)
        slack_lp, slack_spp = _slack(log_probs), _slack(sum_pi_squared)
        flags.append(at_valid(lp).amax() > slack_lp)                                   # log π ≤ 0
        low, high = torch.aminmax(at_valid(spp))                                       # 0 ≤ Σπ² ≤ 1
        flags.append((low < -slack_spp) | (high > 1.0 + slack_spp))
        if consistency:
            own_minus_spp = torch.clamp(lp, max=0.0).mul_(2.0).exp_().sub_(spp)        # π² − Σπ² ≤ slack
            flags.append(at_valid(own_minus_spp).amax() > slack_spp + 2 * slack_lp)
    if not flags:
        return torch.zeros((), dtype=torch.bool)
    device = flags[0].device
    return torch.stack([flag.to(device) for flag in flags]).any()


def _host(value: torch.Tensor) -> np.ndarray:
    """A host copy for the reference (NumPy has no bfloat16: widened to float32, exactly)."""
    value = value.detach().cpu()
    return (value.float() if value.dtype == torch.bfloat16 else value).numpy()


def check_values(enabled: bool, *, rewards: Named | None = None, mask: Named | None = None,
                 log_probs: Named | None = None, sum_pi_squared: Named | None = None,
                 is_weights: Named | None = None, others: list[Named] | None = None,
                 energies: list[Named] | None = None, exact: bool = False, consistency: bool = True) -> None:
    """One synchronisation; if any value rule is violated, raise the reference's error naming the argument.

    ``others`` must be finite; ``energies`` must also be ≥ 0 (up to the input-precision slack) at valid positions.
    ``exact=True`` skips the device pre-check and runs the reference's validators on host copies directly.
    ``consistency=False`` leaves out the rule Σπ² ≥ π² (otb_torch.verl, for verl's half-precision Σπ²).
    """
    others, energies = others or [], energies or []
    if enabled and exact:
        reference_checks.raise_value_error(_host, rewards=rewards, mask=mask, log_probs=log_probs,
                                           sum_pi_squared=sum_pi_squared, is_weights=is_weights, others=others,
                                           energies=energies, flagged=False, consistency=consistency)
        return
    flag = problems(rewards=None if rewards is None else rewards[1], mask=None if mask is None else mask[1],
                    log_probs=None if log_probs is None else log_probs[1],
                    sum_pi_squared=None if sum_pi_squared is None else sum_pi_squared[1],
                    is_weights=None if is_weights is None else is_weights[1], others=tuple(v for _, v in others),
                    energies=tuple(v for _, v in energies), consistency=consistency)
    if not enabled or not bool(flag):
        return
    reference_checks.raise_value_error(_host, rewards=rewards, mask=mask, log_probs=log_probs,
                                       sum_pi_squared=sum_pi_squared, is_weights=is_weights, others=others,
                                       energies=energies, consistency=consistency)


epsilon = reference_checks.epsilon
flag = reference_checks.flag
zero_tail = reference_checks.zero_tail
