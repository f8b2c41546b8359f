"""OTB in PyTorch: the reference's API on tensors, and verl 0.9.1's drop-in functions.

Every function runs under ``torch.no_grad()`` on detached inputs, accumulates in float32 (float64 when an input is
float64; bfloat16/float16 inputs are accepted), and returns tensors on the input's device in the rewards' dtype.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from otb_torch import _checks as check
from otb_torch._core import (
    Segments,
    realized_energy,
    reward_to_go,
    segments_from_index,
    token_baseline,
    token_energy,
)

__all__ = [
    "AdvantageResult",
    "compute_optimal_token_baseline_advantage",
    "compute_multi_turn_optimal_token_baseline_advantage",
    "optimal_token_baseline",
    "multi_turn_optimal_token_baseline",
    "leave_one_out_token_baseline",
    "exact_norm_token_baseline",
    "token_baseline_from_energy",
    "returns_to_go",
    "realized_energy_of",
]

_ALIGNMENTS = ("position", "valid_token")


class AdvantageResult(NamedTuple):
    """(advantages, returns, baselines), each [B, T] on the input's device in the rewards' dtype."""

    advantages: torch.Tensor
    returns: torch.Tensor
    baselines: torch.Tensor


def _segments(group_ids: Any, rows: int, device: torch.device, name: str) -> Segments:
    segments = segments_from_index(group_ids, device)
    if segments.index.shape[0] != rows:
        raise ValueError(f"{name}: expected {rows} ids (one per trajectory), got {segments.index.shape[0]}")
    if segments.index.device != device:
        raise ValueError(f"{name}: segments on {segments.index.device} but the batch is on {device}")
    return segments


_BLOCK_ELEMENTS = 2**19       # 2 MiB per float32 array: a block's temporaries stay in cache (fastest of 2**18–2**21 here)


def _blocks(segments: Segments, rows: int, positions: int, device: torch.device) -> list[tuple[slice, Segments]]:
    """Row blocks of whole groups (CPU, contiguous equal-size groups); a single block otherwise.

    Groups are independent, so blocking is exact; it keeps the ~20 elementwise passes in cache instead of streaming
    the whole batch through memory for each.
    """
    size = segments.group_size
    if device.type != "cpu" or size is None or rows * positions <= 2 * _BLOCK_ELEMENTS:
        return [(slice(0, rows), segments)]
    groups_per_block = max(1, _BLOCK_ELEMENTS // (positions * size))
    block_rows = groups_per_block * size
    blocks = []
    for first in range(0, rows, block_rows):
        count = min(block_rows, rows - first) // size
        local = Segments(torch.arange(count, device=device).repeat_interleave(size), count, size)
        blocks.append((slice(first, first + count * size), local))
    return blocks


def _block(rewards: torch.Tensor, mask: torch.Tensor, log_probs: torch.Tensor, sum_pi_squared: torch.Tensor,
           is_weights: torch.Tensor | None, local_index: torch.Tensor, num_groups: int, group_size: int | None, *,
           align: str, leave_one_out: bool, handle_zero_tail: bool, epsilon: float, need_baselines: bool,
           out: tuple[torch.Tensor, torch.Tensor] | None = None
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One block in the compute dtype: (advantages, returns, baselines); advantages and returns are written into
    ``out`` = (advantages, returns) when given (eager only: saves a copy of each)."""
    returns = reward_to_go(rewards, mask, out=None if out is None else out[1])
    energy = realized_energy(token_energy(log_probs, sum_pi_squared, mask), None, is_weights)
    advantages, baselines = token_baseline(returns, energy, mask, Segments(local_index, num_groups, group_size),
                                           align=align, leave_one_out=leave_one_out,
                                           handle_zero_tail=handle_zero_tail, epsilon=epsilon,
                                           need_baselines=need_baselines, out=None if out is None else out[0])
    return advantages, returns, baselines


_COMPILED: dict[str, Any] = {}


def _kernel(compiled: bool):
    """The block function, eager or compiled once per process with ``torch.compile`` (opt-in: ``compile=True``)."""
    if not compiled:
        return _block
    if "block" not in _COMPILED:
        _COMPILED["block"] = torch.compile(_block, dynamic=None)
    return _COMPILED["block"]


def _run(names: tuple[str, str, str, str, str, str], rewards: Any, response_mask: Any, group_ids: Any,
         log_probs: Any, sum_pi_squared: Any, is_weights: Any, check_values: bool, *, align: str,
         leave_one_out: bool, handle_zero_tail: bool, epsilon: float, need_baselines: bool = True,
         compile: bool = False) -> AdvantageResult:
    """Validate and compute (advantages, returns, baselines) in the rewards' dtype, block by block.

    ``baselines`` is None when not needed (the verl drop-ins), which saves a pass over the batch; ``compile=True``
    runs each block through a ``torch.compile``d kernel (fused passes; the first call compiles).
    """
    r_name, m_name, g_name, lp_name, spp_name, w_name = names
    rewards_t = check.batch(r_name, rewards)
    mask_t = check.tensor(m_name, response_mask, like=rewards_t, like_name=r_name)
    lp_t = check.tensor(lp_name, log_probs, like=rewards_t, like_name=r_name)
    spp_t = check.tensor(spp_name, sum_pi_squared, like=rewards_t, like_name=r_name)
    weights_t = None if is_weights is None else check.tensor(w_name, is_weights, like=rewards_t, like_name=r_name)
    segments = _segments(group_ids, rewards_t.shape[0], rewards_t.device, g_name)
    epsilon = check.epsilon(epsilon)
    kernel = _kernel(check.flag("compile", compile))
    dtype = check.accumulation_dtype(rewards_t, lp_t, spp_t, weights_t)
    out_dtype = check.output_dtype(rewards_t)
    rows, positions = rewards_t.shape
    device = rewards_t.device
    blocks = _blocks(segments, rows, positions, device)
    if len(blocks) == 1 and out_dtype == dtype:          # one block: no output buffers to copy into
        blocks_outputs = None
    else:
        blocks_outputs = [torch.empty((rows, positions), dtype=out_dtype, device=device)
                          for _ in range(3 if need_baselines else 2)]
    # eager blocks write advantages and returns straight into the outputs; compiled ones return them to copy
    direct = blocks_outputs is not None and kernel is _block and out_dtype == dtype
    bad = torch.zeros((), dtype=torch.bool, device=device)
    result: tuple = ()
    for block, local in blocks:
        r, m, lp, spp = rewards_t[block], mask_t[block], lp_t[block], spp_t[block]
        w = None if weights_t is None else weights_t[block]
        if check_values:
            bad = bad | check.problems(rewards=r, mask=m, log_probs=lp, sum_pi_squared=spp, is_weights=w)
        result = kernel(r.to(dtype), m.to(dtype), lp.to(dtype), spp.to(dtype), None if w is None else w.to(dtype),
                        local.index, local.num_groups, local.group_size, align=align, leave_one_out=leave_one_out,
                        handle_zero_tail=handle_zero_tail, epsilon=epsilon, need_baselines=need_baselines,
                        **({"out": (blocks_outputs[0][block], blocks_outputs[1][block])} if direct else {}))
        if blocks_outputs is not None:
            for output, value in list(zip(blocks_outputs, result))[2 if direct else 0:]:
                output[block] = value
    if check_values and bool(bad):                                      # the one synchronisation
        check.check_values(True, rewards=(r_name, rewards_t), mask=(m_name, mask_t), log_probs=(lp_name, lp_t),
                           sum_pi_squared=(spp_name, spp_t),
                           is_weights=None if weights_t is None else (w_name, weights_t))
    if blocks_outputs is None:
        return AdvantageResult(*result)
    return AdvantageResult(blocks_outputs[0], blocks_outputs[1], blocks_outputs[2] if need_baselines else None)


_NAMES = ("rewards", "response_mask", "group_ids", "log_probs", "sum_pi_squared", "is_weights")
_VERL_NAMES = ("token_level_rewards", "response_mask", "index", "old_log_probs", "sum_pi_squared",
               "rollout_is_weights")


@torch.no_grad()
def optimal_token_baseline(rewards: Any, response_mask: Any, group_ids: Any, log_probs: Any, sum_pi_squared: Any, *,
                           is_weights: Any = None, handle_zero_tail: bool = True, epsilon: float = 1e-8,
                           check_values: bool = True, compile: bool = False) -> AdvantageResult:
    """Single-turn OTB (verl semantics); the torch port of :func:`otb_spec.optimal_token_baseline`.

    ``group_ids`` may be any ids (mapped once on the host) or precomputed :class:`otb_torch.Segments`;
    ``check_values=False`` skips the value checks (no host synchronisation); ``compile=True`` fuses the computation
    with ``torch.compile`` (the first call compiles).
    """
    return _run(_NAMES, rewards, response_mask, group_ids, log_probs, sum_pi_squared, is_weights, check_values,
                align="position", leave_one_out=False,
                handle_zero_tail=check.flag("handle_zero_tail", handle_zero_tail), epsilon=epsilon, compile=compile)


@torch.no_grad()
def multi_turn_optimal_token_baseline(rewards: Any, response_mask: Any, group_ids: Any, log_probs: Any,
                                      sum_pi_squared: Any, *, is_weights: Any = None, handle_zero_tail: bool = True,
                                      epsilon: float = 1e-8, check_values: bool = True,
                                      compile: bool = False) -> AdvantageResult:
    """Multi-turn (valid-token aligned) OTB; the port of :func:`otb_spec.multi_turn_optimal_token_baseline`."""
    return _run(_NAMES, rewards, response_mask, group_ids, log_probs, sum_pi_squared, is_weights, check_values,
                align="valid_token", leave_one_out=False,
                handle_zero_tail=check.flag("handle_zero_tail", handle_zero_tail), epsilon=epsilon, compile=compile)


@torch.no_grad()
def leave_one_out_token_baseline(rewards: Any, response_mask: Any, group_ids: Any, log_probs: Any,
                                 sum_pi_squared: Any, *, is_weights: Any = None, align: str = "position",
                                 epsilon: float = 1e-8, check_values: bool = True,
                                 compile: bool = False) -> AdvantageResult:
    """Leave-one-out OTB (unbiased); the port of :func:`otb_spec.leave_one_out_token_baseline`."""
    if align not in _ALIGNMENTS:
        raise ValueError(f"align: expected one of {_ALIGNMENTS}, got {align!r}")
    return _run(_NAMES, rewards, response_mask, group_ids, log_probs, sum_pi_squared, is_weights, check_values,
                align=align, leave_one_out=True, handle_zero_tail=False, epsilon=epsilon, compile=compile)


def _energy_variant(names: tuple[str, str, str, str], returns_or_rewards: Any, energy: Any, response_mask: Any,
                    group_ids: Any, *, from_rewards: bool, align: str, leave_one_out: bool,
                    handle_zero_tail: bool | None, epsilon: float, check_values: bool) -> AdvantageResult:
    first_name, energy_name, m_name, g_name = names
    first = check.batch(first_name, returns_or_rewards)
    energy_t = check.tensor(energy_name, energy, like=first, like_name=first_name)
    mask_t = check.tensor(m_name, response_mask, like=first, like_name=first_name)
    segments = _segments(group_ids, first.shape[0], first.device, g_name)
    check.check_values(check_values, rewards=(first_name, first), mask=(m_name, mask_t),
                       energies=[(energy_name, energy_t)])
    if align not in _ALIGNMENTS:
        raise ValueError(f"align: expected one of {_ALIGNMENTS}, got {align!r}")
    leave_one_out = check.flag("leave_one_out", leave_one_out)
    if handle_zero_tail is None:
        handle_zero_tail = not leave_one_out
    elif check.flag("handle_zero_tail", handle_zero_tail) and leave_one_out:
        raise ValueError("handle_zero_tail: not applicable with leave_one_out=True (where no other member is valid the "
                         "leave-one-out baseline is already 0); leave it unset")
    dtype = check.accumulation_dtype(first, energy_t)
    mask = (mask_t != 0).to(dtype)
    returns = reward_to_go(first.to(dtype), mask) if from_rewards else first.to(dtype)
    advantages, baselines = token_baseline(returns, energy_t.to(dtype), mask, segments, align=align,
                                           leave_one_out=leave_one_out, handle_zero_tail=handle_zero_tail,
                                           epsilon=check.epsilon(epsilon))
    out = check.output_dtype(first)
    return AdvantageResult(advantages.to(out), returns.to(out), baselines.to(out))


@torch.no_grad()
def exact_norm_token_baseline(rewards: Any, response_mask: Any, group_ids: Any, cumulative_score_sq_norms: Any, *,
                              align: str = "position", leave_one_out: bool = False,
                              handle_zero_tail: bool | None = None, epsilon: float = 1e-8,
                              check_values: bool = True) -> AdvantageResult:
    """OTB with exact ‖Sₜ‖²; the port of :func:`otb_spec.exact_norm_token_baseline`."""
    return _energy_variant(("rewards", "cumulative_score_sq_norms", "response_mask", "group_ids"), rewards,
                           cumulative_score_sq_norms, response_mask, group_ids, from_rewards=True, align=align,
                           leave_one_out=leave_one_out, handle_zero_tail=handle_zero_tail, epsilon=epsilon,
                           check_values=check_values)


@torch.no_grad()
def token_baseline_from_energy(returns: Any, realized_energy: Any, response_mask: Any, group_ids: Any, *,
                               align: str = "position", leave_one_out: bool = False,
                               handle_zero_tail: bool | None = None, epsilon: float = 1e-8,
                               check_values: bool = True) -> AdvantageResult:
    """The general energy-weighted baseline for given (G, W); the port of :func:`otb_spec.token_baseline`."""
    return _energy_variant(("returns", "realized_energy", "response_mask", "group_ids"), returns, realized_energy,
                           response_mask, group_ids, from_rewards=False, align=align, leave_one_out=leave_one_out,
                           handle_zero_tail=handle_zero_tail, epsilon=epsilon, check_values=check_values)


@torch.no_grad()
def returns_to_go(rewards: Any, response_mask: Any, *, check_values: bool = True) -> torch.Tensor:
    """Gₜ = Σ_{k≥t} mₖrₖ (undiscounted, as verl); the port of :func:`otb_spec.returns_to_go` with γ = 1."""
    rewards_t = check.batch("rewards", rewards)
    mask_t = check.tensor("response_mask", response_mask, like=rewards_t, like_name="rewards")
    check.check_values(check_values, rewards=("rewards", rewards_t), mask=("response_mask", mask_t))
    dtype = check.accumulation_dtype(rewards_t)
    return reward_to_go(rewards_t.to(dtype), (mask_t != 0).to(dtype)).to(check.output_dtype(rewards_t))


@torch.no_grad()
def realized_energy_of(log_probs: Any, sum_pi_squared: Any, response_mask: Any, *, is_weights: Any = None,
                       check_values: bool = True) -> torch.Tensor:
    """Wₜ = Σ_{j≤t} mⱼρⱼ²(1 − 2πⱼ + Σπ²ⱼ) from the token statistics: [B, T], in log_probs' floating dtype."""
    lp_t = check.batch("log_probs", log_probs)
    spp_t = check.tensor("sum_pi_squared", sum_pi_squared, like=lp_t, like_name="log_probs")
    mask_t = check.tensor("response_mask", response_mask, like=lp_t, like_name="log_probs")
    weights_t = None if is_weights is None else check.tensor("is_weights", is_weights, like=lp_t,
                                                             like_name="log_probs")
    check.check_values(check_values, mask=("response_mask", mask_t), log_probs=("log_probs", lp_t),
                       sum_pi_squared=("sum_pi_squared", spp_t),
                       is_weights=None if weights_t is None else ("is_weights", weights_t))
    dtype = check.accumulation_dtype(lp_t, spp_t, weights_t)
    energy = realized_energy(token_energy(lp_t.to(dtype), spp_t.to(dtype)), (mask_t != 0).to(dtype),
                             None if weights_t is None else weights_t.to(dtype))
    return energy.to(check.output_dtype(lp_t))


# ----------------------------------------------------------------------------------------------------------------------
# verl 0.9.1 drop-ins


def _verl_options(kwargs: dict) -> dict:
    """verl passes extra keyword arguments (e.g. ``config``) and ignores them; so do we, except our own options
    ``check_values`` and ``compile``."""
    return {"check_values": check.flag("check_values", kwargs.pop("check_values", True)),
            "compile": check.flag("compile", kwargs.pop("compile", False))}


@torch.no_grad()
def compute_optimal_token_baseline_advantage(token_level_rewards: torch.Tensor, response_mask: torch.Tensor,
                                             index: Any, old_log_probs: torch.Tensor, sum_pi_squared: torch.Tensor,
                                             rollout_is_weights: torch.Tensor | None = None,
                                             handle_zero_tail: bool = True, epsilon: float = 1e-8,
                                             **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Drop-in for verl 0.9.1 ``compute_optimal_token_baseline_advantage``: returns (advantages, returns).

    Same arguments and results (within float tolerance); vectorized, with at most one host synchronisation (the value
    checks; pass ``check_values=False`` to skip them). ``index`` is verl's NumPy array of ids, or precomputed
    :class:`otb_torch.Segments`. ``compile=True`` fuses the computation with ``torch.compile``.
    """
    options = _verl_options(kwargs)
    result = _run(_VERL_NAMES, token_level_rewards, response_mask, index, old_log_probs, sum_pi_squared,
                  rollout_is_weights, options["check_values"], align="position", leave_one_out=False,
                  handle_zero_tail=check.flag("handle_zero_tail", handle_zero_tail), epsilon=epsilon,
                  need_baselines=False, compile=options["compile"])
    return result.advantages, result.returns


@torch.no_grad()
def compute_multi_turn_optimal_token_baseline_advantage(token_level_rewards: torch.Tensor,
                                                        response_mask: torch.Tensor, index: Any,
                                                        old_log_probs: torch.Tensor, sum_pi_squared: torch.Tensor,
                                                        rollout_is_weights: torch.Tensor | None = None,
                                                        handle_zero_tail: bool = True, epsilon: float = 1e-8,
                                                        **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Drop-in for verl 0.9.1 ``compute_multi_turn_optimal_token_baseline_advantage``: (advantages, returns)."""
    options = _verl_options(kwargs)
    result = _run(_VERL_NAMES, token_level_rewards, response_mask, index, old_log_probs, sum_pi_squared,
                  rollout_is_weights, options["check_values"], align="valid_token", leave_one_out=False,
                  handle_zero_tail=check.flag("handle_zero_tail", handle_zero_tail), epsilon=epsilon,
                  need_baselines=False, compile=options["compile"])
    return result.advantages, result.returns
