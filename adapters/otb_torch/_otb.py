"""OTB in PyTorch: the reference's API on tensors, and verl 0.9.1's drop-in functions.

Every function runs under ``torch.no_grad()`` on detached inputs, accumulates in float32 (float64 when an input is
float64; bfloat16/float16 inputs are accepted), and returns tensors on the input's device in the rewards' dtype.
"""

from __future__ import annotations

from typing import Any, ContextManager, NamedTuple

import numpy as np
import torch

from otb_spec import _validation as reference_checks
from otb_torch import _checks as check
from otb_torch import _native
from otb_torch._core import (
    Run,
    Segments,
    grouped_otb,
    grouped_workspace,
    plan_sizes,
    realized_energy,
    reward_to_go,
    segments_from_index,
    token_baseline,
    token_energy,
    value_problems,
    zero_rule_fix,
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


class AdvantageResult(NamedTuple):
    """(advantages, returns, baselines), each [B, T] on the input's device in the rewards' dtype."""

    advantages: torch.Tensor
    returns: torch.Tensor
    baselines: torch.Tensor


def _segments(group_ids: Any, rows: int, device: torch.device, name: str) -> Segments:
    segments = segments_from_index(group_ids, device, name=name)
    if segments.index.shape[0] != rows:
        raise ValueError(f"{name}: expected {rows} ids (one per trajectory), got {segments.index.shape[0]}")
    if segments.index.device != device:
        raise ValueError(f"{name}: segments on {segments.index.device} but the batch is on {device}")
    return segments


_BLOCK_ELEMENTS = 2**18       # elements per array in a CPU block: of 2**16 … 2**19, 2**18 and 2**19 were fastest
# elements per array in an accelerator's block (at least one group, so a group of more rows than 2²⁵/T is a larger
# block of its own): bounds the eager kernels' temporaries (about 12 arrays of the block, 1.5 GiB in float32, 3 GiB
# in float64) while keeping one block, and one launch per op, up to 2²⁵ tokens
_ACCELERATOR_BLOCK_ELEMENTS = 2**25


class _Block(NamedTuple):
    """Rows of whole groups of one size: a slice of the batch or row indices to gather, positions ``begin:end`` of
    the plan's order; ``segments`` numbers their groups. With ``sizes`` (on an accelerator, a plan with groups of
    several sizes): all rows in the plan's order, groups of these sizes on consecutive rows."""

    rows: slice | torch.Tensor
    begin: int
    end: int
    segments: Segments
    sizes: torch.Tensor | None = None


def blocks_as_on_accelerators() -> ContextManager[None]:
    """Within this block (in this thread), CPU batches are cut into blocks as on an accelerator (up to
    ``_ACCELERATOR_BLOCK_ELEMENTS`` per array: one run of equal-size groups per block, or consecutive groups of the
    plan's order with their sums over consecutive rows where the sizes differ) instead of cache-sized ones:
    for the tests and the ``torch-cpu-accelerator-blocks`` adapter, which run that code path on the CPU (with the
    eager kernels, :func:`otb_torch._native.eager_only`), and for benchmarks/count_torch_ops.py."""
    return _native.choosing("accelerator_blocks")


def _accelerator_blocks(device: torch.device) -> bool:
    return device.type != "cpu" or _native.chosen("accelerator_blocks")


# where a plan with groups of several sizes runs as blocks of consecutive groups: torch.segment_reduce is implemented
# there (on the CPU under blocks_as_on_accelerators); other accelerators keep one block per run of equal sizes
_CONSECUTIVE_SUMS = ("cuda", "cpu")


_LOCAL: dict[tuple[int, int | None, str], Segments] = {}


def _local(num_groups: int, group_size: int, device: torch.device) -> Segments:
    key = (num_groups, group_size, str(device))
    if key not in _LOCAL:
        if len(_LOCAL) > 256:
            _LOCAL.clear()
        _LOCAL[key] = Segments(torch.arange(num_groups, device=device).repeat_interleave(group_size), num_groups,
                               group_size)
    return _LOCAL[key]


def _runs(segments: Segments) -> tuple[Run, ...] | None:
    if segments.runs is None and segments.group_size is not None:
        return (Run(segments.group_size, segments.num_groups, 0, 0),)
    return segments.runs


def _blocks(segments: Segments, rows: int, positions: int, device: torch.device) -> list[_Block]:
    """The batch as blocks of whole groups of one size, following the segments' plan (:class:`Segments`).

    Groups are independent, so blocking is exact. On CPU a run of equal-size groups is cut into blocks of about
    ``_BLOCK_ELEMENTS`` per array, so a block's ~20 elementwise passes run in cache instead of streaming the whole
    batch through memory for each. On an accelerator the blocks hold up to ``_ACCELERATOR_BLOCK_ELEMENTS`` (one run
    of equal-size groups per block; a plan with groups of several sizes as blocks of consecutive groups in the plan's
    order, ``sizes`` set: group sums over consecutive rows, where one block per run would cost every kernel launch
    once per distinct size). Rows that are not a contiguous slice are gathered (one ``index_select`` per input, one
    ``index_copy_`` per output). Segments without a plan or group size (built by hand) give one block over the whole
    batch, computed with segment sums.
    """
    runs = _runs(segments)
    if runs is None:
        return [_Block(slice(0, rows), 0, rows, segments)]
    accelerator = _accelerator_blocks(device)
    budget = _ACCELERATOR_BLOCK_ELEMENTS if accelerator else _BLOCK_ELEMENTS
    if accelerator and len(runs) > 1 and device.type in _CONSECUTIVE_SUMS:   # launches whatever the sizes' count
        return _consecutive_blocks(segments, runs, rows, positions, budget, device)
    blocks = []
    for run in runs:
        per_block = max(1, min(run.count, budget // (positions * run.size)))
        for first in range(0, run.count, per_block):
            count = min(per_block, run.count - first)
            begin, end = run.start + first * run.size, run.start + (first + count) * run.size
            if run.first_row >= 0:
                taken: slice | torch.Tensor = slice(run.first_row + begin - run.start, run.first_row + end - run.start)
            else:
                taken = segments.order[begin:end]
            blocks.append(_Block(taken, begin, end, _local(count, run.size, device)))
    return blocks


def _consecutive_blocks(segments: Segments, runs: tuple[Run, ...], rows: int, positions: int, budget: int,
                        device: torch.device) -> list[_Block]:
    """A plan's rows in its order, cut at group boundaries into blocks of at most ``budget`` elements per array (at
    least one group each; one block up to that size), each with its groups' sizes for sums over consecutive rows.
    The cuts come from the plan's runs on the host; on the device only slices and ``repeat_interleave`` with its
    output size given — no synchronisation."""
    host_sizes = plan_sizes(runs)
    sizes = segments.sizes if segments.planned else None      # segments_from_index's own, made from these runs
    if sizes is None:                               # a plan built by hand (its runs checked against the batch, any
        sizes = torch.as_tensor(host_sizes, device=device)    # sizes it was given ignored): copied to the device here
    ends = np.cumsum(host_sizes)                    # each group's last row + 1, in the plan's order
    in_order = all(run.first_row == run.start for run in runs)             # the plan's order is the batch's
    per_block = max(1, budget // max(1, positions))
    blocks, first_group, begin = [], 0, 0
    while first_group < host_sizes.shape[0]:
        stop_group = max(first_group + 1, int(np.searchsorted(ends, begin + per_block, side="right")))
        end = int(ends[stop_group - 1])
        count = stop_group - first_group
        local_sizes = sizes.narrow(0, first_group, count)
        local = Segments(torch.repeat_interleave(torch.arange(count, device=device), local_sizes,
                                                 output_size=end - begin), count)
        taken: slice | torch.Tensor = slice(begin, end) if in_order else segments.order[begin:end]
        blocks.append(_Block(taken, begin, end, local, local_sizes))
        first_group, begin = stop_group, end
    return blocks


def _block(rewards: torch.Tensor, mask: torch.Tensor, log_probs: torch.Tensor, sum_pi_squared: torch.Tensor,
           is_weights: torch.Tensor | None, local_index: torch.Tensor, num_groups: int, group_size: int | None, *,
           align: str, leave_one_out: bool, handle_zero_tail: bool, epsilon: float, need_baselines: bool,
           sizes: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The general block (leave-one-out, segments without a plan, or on an accelerator a plan with groups of several
    sizes: ``sizes``) in the compute dtype: (advantages, returns, baselines)."""
    returns = reward_to_go(rewards, mask)
    energy = realized_energy(token_energy(log_probs, sum_pi_squared, mask), None, is_weights)
    advantages, baselines = token_baseline(returns, energy, mask, Segments(local_index, num_groups, group_size),
                                           align=align, leave_one_out=leave_one_out,
                                           handle_zero_tail=handle_zero_tail, epsilon=epsilon,
                                           need_baselines=need_baselines, sorted_sizes=sizes)
    return advantages, returns, baselines


_COMPILED: dict[str, Any] = {}


def _kernel(name: str, compiled: bool):
    """A block function (``"general"``: :func:`_block`, ``"grouped"``: :func:`grouped_otb`), eager or compiled
    once per process with ``torch.compile`` (opt-in: ``compile=True``)."""
    function = _block if name == "general" else grouped_otb
    if not compiled:
        return function
    if name not in _COMPILED:
        _COMPILED[name] = torch.compile(function, dynamic=None if name == "general" else True)
    return _COMPILED[name]


def _take(value: torch.Tensor, rows: slice | torch.Tensor, dtype: torch.dtype, buffer: torch.Tensor | None
          ) -> torch.Tensor:
    """A block's rows in the compute dtype: a view when they are a slice in that dtype, else copied into ``buffer``
    (preallocated: a fresh block would cost page faults on CPU) or a new tensor."""
    if isinstance(rows, slice):
        taken = value.narrow(0, rows.start, rows.stop - rows.start)
        if taken.dtype == dtype or buffer is None:
            return taken.to(dtype)
        return buffer.narrow(0, 0, taken.shape[0]).copy_(taken)
    if buffer is None:
        return value.index_select(0, rows).to(dtype)
    target = buffer.narrow(0, 0, rows.shape[0])
    if value.dtype == dtype:
        return torch.index_select(value, 0, rows, out=target)
    return target.copy_(value.index_select(0, rows))


def _put(output: torch.Tensor, rows: slice | torch.Tensor, value: torch.Tensor) -> None:
    if isinstance(rows, slice):
        output.narrow(0, rows.start, rows.stop - rows.start).copy_(value)
    else:
        output.index_copy_(0, rows, value.to(output.dtype))


def _apply_zero_rules(segments: Segments, lengths: torch.Tensor, outputs: list[torch.Tensor], mask: torch.Tensor,
                      *, align: str, handle_zero_tail: bool, dtype: torch.dtype) -> None:
    """Zero the self-inclusive baseline where the rules say (:func:`zero_rule_fix`): on at most one row per group,
    from its start on, the advantage becomes the masked return and the baseline 0. ``lengths`` [B] holds the valid
    counts in the plan's order."""
    width = mask.shape[1]
    members, starts = [], []
    for run in _runs(segments):
        if run.size < 2:
            continue                                        # singleton runs were computed with B = 0
        member, start = zero_rule_fix(lengths[run.start:run.start + run.size * run.count], run.size, run.count,
                                      align=align, handle_zero_tail=handle_zero_tail, width=width)
        members.append(member + torch.arange(run.start, run.start + run.size * run.count, run.size,
                                             device=member.device))
        starts.append(start)
    if not members:
        return
    positions = torch.cat(members)
    rows = positions if segments.order is None else segments.order[positions]
    start = torch.cat(starts)[:, None]
    m = mask.index_select(0, rows).to(dtype)
    aligned = torch.arange(width, device=m.device, dtype=dtype) if align == "position" else torch.cumsum(m, -1) - 1.0
    zero = aligned >= start
    advantages, returns = outputs[0], outputs[1]
    fixed = torch.where(zero, returns.index_select(0, rows).to(dtype) * m, advantages.index_select(0, rows).to(dtype))
    advantages.index_copy_(0, rows, fixed.to(advantages.dtype))
    if len(outputs) > 2:
        baselines = outputs[2].index_select(0, rows)
        outputs[2].index_copy_(0, rows, baselines.masked_fill_(zero, 0.0))


def _run(names: tuple[str, str, str, str, str, str], rewards: Any, response_mask: Any, group_ids: Any,
         log_probs: Any, sum_pi_squared: Any, is_weights: Any, check_values: bool, *, align: str,
         leave_one_out: bool, handle_zero_tail: bool, epsilon: float, need_baselines: bool = True,
         compile: bool = False) -> AdvantageResult:
    """Validate and compute (advantages, returns, baselines) in the rewards' dtype, block by block.

    ``baselines`` is None when not needed (the verl drop-ins), which saves a pass over the batch; ``compile=True``
    runs each block through a ``torch.compile``d kernel (the first call compiles). On CPU every variant with a plan
    (self-inclusive and leave-one-out) runs the native kernel (:mod:`otb_torch._native`: one sweep per group, zero
    rules and value flags included) where it is built; otherwise the self-inclusive variants run :func:`grouped_otb`
    on every block, which also reduces what the value checks need while the block is in cache, then the zero rules on
    one row per group; leave-one-out, segments without a plan, and on an accelerator any variant whose groups have
    several sizes (one block in the plan's order, :func:`_blocks`), run the general :func:`token_baseline` with the
    value checks of :func:`otb_torch._checks.problems`. Either way the value checks cost one synchronisation, at the
    end; only if they flag something are the inputs checked exactly, and the reference's error raised.
    """
    r_name, m_name, g_name, lp_name, spp_name, w_name = names
    rewards_t, mask_t, lp_t, spp_t, weights_t = check.token_batch(rewards, response_mask, log_probs, sum_pi_squared,
                                                                  is_weights, (r_name, m_name, lp_name, spp_name,
                                                                               w_name))
    segments = _segments(group_ids, rewards_t.shape[0], rewards_t.device, g_name)
    options = dict(align=align, epsilon=check.epsilon(epsilon), need_baselines=need_baselines,
                   compiled=check.flag("compile", compile), check_values=check_values,
                   dtype=check.accumulation_dtype(rewards_t, lp_t, spp_t, weights_t),
                   out_dtype=check.output_dtype(rewards_t))
    inputs = [rewards_t, mask_t, lp_t, spp_t] + ([] if weights_t is None else [weights_t])
    lengths = None
    runs = _runs(segments)
    offsets = None if runs is None else _native.group_offsets(runs, rewards_t.shape[0])
    if offsets is not None and not segments.planned:                          # hand-built: check before any kernel
        problem = _native.plan_problem(segments.order, offsets, rewards_t.shape[0])
        if problem is not None:
            raise ValueError(f"{g_name}: Segments inconsistent with the batch: {problem}; build them with "
                             "otb_torch.segments_from_index")
    native = (runs is not None and not options["compiled"] and not torch.compiler.is_compiling()
              and _native.usable(rewards_t.device, options["dtype"]))
    if native:                                                                    # one sweep per group, in C
        outputs, bad = _native.grouped(
            *inputs[:4], weights_t, segments.order, offsets, align=align, leave_one_out=leave_one_out,
            handle_zero_tail=handle_zero_tail, epsilon=options["epsilon"], dtype=options["dtype"],
            need_baselines=need_baselines, check=check_values,
            slacks=(check.slack(lp_t), check.slack(spp_t)) if check_values else None)
        if options["out_dtype"] != options["dtype"]:
            outputs = [value.to(options["out_dtype"]) for value in outputs]
    else:
        blocks = _blocks(segments, *rewards_t.shape, rewards_t.device)
        if leave_one_out or runs is None or blocks[0].sizes is not None:
            outputs, bad = _general(blocks, inputs, leave_one_out=leave_one_out, handle_zero_tail=handle_zero_tail,
                                    **options)
        else:
            outputs, bad, lengths = _grouped(blocks, inputs, handle_zero_tail=handle_zero_tail,
                                             slacks=(check.slack(lp_t), check.slack(spp_t)) if check_values else None,
                                             **options)
    # integer token statistics have no input slack and π² may underflow in float32: the reference's validators decide
    exact = not (lp_t.is_floating_point() and spp_t.is_floating_point())
    if check_values and not native:             # the eager kernels' group sums are not checked for overflow on the way
        overflow = ~torch.isfinite(outputs[0]).all()
        bad = overflow if bad is None else bad | overflow
    if check_values and _narrower(options["out_dtype"], options["dtype"]):   # float16 rewards: results beyond
        beyond = ~_sums_finite(outputs)                                      # its range, where the cast made ±inf
        bad = beyond if bad is None else bad | beyond
    if check_values and not native and mask_t.dtype == torch.float64 and options["dtype"] != torch.float64:
        bad = bool(bad) or bool(check.not_binary(mask_t))   # the eager kernels read this mask rounded to float32
        # (the native kernel checks the mask in its own dtype)
    flagged = check_values and (exact or bool(bad))                     # the one synchronisation
    if flagged:
        check.check_values(True, rewards=(r_name, rewards_t), mask=(m_name, mask_t), log_probs=(lp_name, lp_t),
                           sum_pi_squared=(spp_name, spp_t),
                           is_weights=None if weights_t is None else (w_name, weights_t), exact=exact)
    if lengths is not None:
        _apply_zero_rules(segments, lengths, outputs, mask_t, align=align, handle_zero_tail=handle_zero_tail,
                          dtype=options["dtype"])
    if flagged:                                 # valid inputs: a flag left is a sum that overflowed, or nothing
        _check_finite_outputs(outputs, r_name, options["dtype"], None if weights_t is None else (w_name, weights_t),
                              mask_t)
    return AdvantageResult(outputs[0], outputs[1], outputs[2] if need_baselines else None)


def _narrower(output: torch.dtype, compute: torch.dtype) -> bool:
    """Whether outputs in ``output`` (the rewards' dtype) can overflow where ``compute`` holds the results: float16
    (±65504) against float32 or float64, float32 against float64 (float64 token statistics) — not bfloat16 against
    float32, whose ranges are about the same."""
    return output.is_floating_point and torch.finfo(output).max < 0.5 * torch.finfo(compute).max


def _sums_finite(outputs: list[torch.Tensor | None] | tuple[torch.Tensor | None, ...]) -> torch.Tensor:
    """One flag (a tensor, no synchronisation): every output's float32 sum is finite — ±inf or NaN in any value
    makes its sum so; finite float16 values cannot overflow it below 5·10³³ of them, large float32 or float64 ones
    can, so a False is confirmed value by value (:func:`_all_finite`)."""
    return torch.stack([torch.isfinite(value.sum(dtype=torch.float32)) for value in outputs
                        if value is not None]).all()


def _all_finite(outputs: list[torch.Tensor | None] | tuple[torch.Tensor | None, ...]) -> bool:
    """Every value of every output is finite: the sums first (:func:`_sums_finite`), each value where they are not."""
    return bool(_sums_finite(outputs)) or all(bool(torch.isfinite(value).all()) for value in outputs
                                              if value is not None)


def _raise_if_weights_may_overflow(is_weights: torch.Tensor, mask: torch.Tensor | None, dtype: torch.dtype,
                                   positions: int | None = None) -> None:
    """Raise naming is_weights where ρ (read where ``mask`` is nonzero) alone can take the realized energy out of
    ``dtype``'s range: 2·T·max ρ² beyond it (Wₜ ≤ Σ ρ²·2; T = ``positions``, by default ρ's last dimension)."""
    if not is_weights.numel():
        return
    rho = is_weights.abs() if mask is None else torch.where(mask != 0, is_weights.abs(), 0.0)
    largest_rho = float(rho.max())
    if reference_checks.weights_may_overflow(largest_rho, rho.shape[-1] if positions is None else positions,
                                             torch.finfo(dtype).max):
        raise reference_checks.weights_overflow_error(largest_rho, str(dtype).replace("torch.", ""), certain=False)


def _output_range_error(name: str, output: torch.dtype) -> ValueError:
    """otb_spec._validation.output_range_error for outputs in ``output``, the dtype they take from ``name``."""
    return reference_checks.output_range_error(name, str(output).replace("torch.", ""), torch.finfo(output).max)


def _check_finite_outputs(outputs: list[torch.Tensor] | tuple[torch.Tensor, ...], name: str, dtype: torch.dtype,
                          is_weights: tuple[str, torch.Tensor] | None = None, mask: torch.Tensor | None = None,
                          positions: int | None = None) -> None:
    """Valid finite inputs whose arithmetic leaves ``dtype``'s range — the returns-to-go, or the group sums Σᵢ GₜⁱWₜⁱ
    (the native kernel flags a sum outside the range, the eager path a non-finite advantage; otb_torch.distributed
    calls it on every rank's results) — raise, naming the rewards, instead of returning ±inf/NaN; naming the
    importance weights (``is_weights`` = (name, ρ), read where ``mask`` is nonzero) where ρ alone can overflow the
    realized energy (2·T·max ρ² beyond the range: Wₜ ≤ Σ ρ²·2; T = ``positions``, the whole rows' length, by
    default ρ's last dimension); naming the rewards' dtype where the outputs take a narrower one (float16) and their
    values left its range. One float32 sum per output (tens of µs at a rank's half of 64×8×2048), and the exact check
    only if a sum is not finite (:func:`_all_finite`)."""
    if _all_finite(outputs):
        return
    if is_weights is not None:
        _raise_if_weights_may_overflow(is_weights[1], mask, dtype, positions)
    if _narrower(outputs[0].dtype, dtype):
        raise _output_range_error(name, outputs[0].dtype)
    returns = torch.nan_to_num(outputs[1].abs(), nan=0.0, posinf=float("inf"))
    largest = float(returns.max()) if returns.numel() else 0.0
    raise ValueError(f"{name}: finite, but OTB's arithmetic overflows {str(dtype).replace('torch.', '')}: the returns "
                     f"(up to {largest:.3g} in magnitude) times the realized energies, summed over a group "
                     "(Σᵢ GₜⁱWₜⁱ), leave its range; scale the rewards down, or pass float64")


def _grouped(blocks: list[_Block], inputs: list[torch.Tensor], *, align: str, handle_zero_tail: bool, epsilon: float,
             need_baselines: bool, compiled: bool, check_values: bool, slacks: tuple[float, float] | None,
             dtype: torch.dtype, out_dtype: torch.dtype
             ) -> tuple[list[torch.Tensor], torch.Tensor | None, torch.Tensor | None]:
    """The self-inclusive variants: :func:`grouped_otb` block by block. Returns the outputs, the value-check flag
    (None without checks) and the rows' valid-token counts in the plan's order (None when no zero rule applies)."""
    rows, positions = inputs[0].shape
    device = inputs[0].device
    kernel = _kernel("grouped", compiled)
    compiled = compiled or torch.compiler.is_compiling()         # traced by the caller's torch.compile: no buffers
    outputs = [torch.empty((rows, positions), dtype=out_dtype, device=device)
               for _ in range(3 if need_baselines else 2)]
    lengths = None
    if handle_zero_tail or align != "position":
        lengths = torch.empty(rows, dtype=dtype, device=device)
    largest = max(block.end - block.begin for block in blocks)
    sliced = all(isinstance(block.rows, slice) for block in blocks)

    def preallocated(count: int, when: bool = True) -> list[torch.Tensor | None]:
        return [torch.empty((largest, positions), dtype=dtype, device=device) if when and not compiled else None
                for _ in range(count)]

    # eager blocks reuse these (fresh memory costs a page fault per 4 KiB on CPU): the kernel's temporaries, each
    # input's rows when they are gathered or converted, and the block results when they cannot go straight into
    # the outputs (gathered rows, or another output dtype)
    workspace = () if compiled else grouped_workspace(largest, positions, align, dtype, device)
    staging = [buffer for value in inputs for buffer in preallocated(1, not sliced or value.dtype != dtype)]
    results = preallocated(len(outputs), not sliced or out_dtype != dtype)
    reductions = []
    for block in blocks:
        r, m, lp, spp, *rest = (_take(value, block.rows, dtype, buffer) for value, buffer in zip(inputs, staging))
        count = block.end - block.begin
        direct = isinstance(block.rows, slice) and out_dtype == dtype and not compiled
        if direct:                                                    # write straight into the outputs
            result = [output.narrow(0, block.rows.start, count) for output in outputs]
        else:
            result = [] if compiled else [buffer.narrow(0, 0, count) for buffer in results]
        *result, reduced = kernel(
            r, m, lp, spp, rest[0] if rest else None, block.segments.num_groups, block.segments.group_size,
            align=align, epsilon=epsilon, check=check_values, need_baselines=need_baselines,
            workspace=tuple(buffer.narrow(0, 0, count) for buffer in workspace), outputs=tuple(result),
            lengths=None if lengths is None else lengths[block.begin:block.end])
        reductions.append(reduced)
        if not direct:
            for output, value in zip(outputs, result):
                _put(output, block.rows, value)
    bad = value_problems(reductions, slacks) if check_values else None
    return outputs, bad, lengths


def _general(blocks: list[_Block], inputs: list[torch.Tensor], *, align: str, leave_one_out: bool,
             handle_zero_tail: bool, epsilon: float, need_baselines: bool, compiled: bool, check_values: bool,
             dtype: torch.dtype, out_dtype: torch.dtype) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    """Leave-one-out, segments without a plan, or on an accelerator a plan with groups of several sizes:
    :func:`token_baseline` block by block (one block over the whole batch without a plan, or in the plan's order).
    Returns the outputs and the value-check flag (None without checks)."""
    rows, positions = inputs[0].shape
    kernel = _kernel("general", compiled)
    flags, outputs = [], []
    for block in blocks:
        r, m, lp, spp, *rest = (_take(value, block.rows, dtype, None) for value in inputs)
        w = rest[0] if rest else None
        if check_values:
            flags.append(check.problems(rewards=r, mask=m, log_probs=lp, sum_pi_squared=spp, is_weights=w))
        local = block.segments
        result = kernel(r, m, lp, spp, w, local.index, local.num_groups, local.group_size, align=align,
                        leave_one_out=leave_one_out, handle_zero_tail=handle_zero_tail, epsilon=epsilon,
                        need_baselines=need_baselines, sizes=block.sizes)
        if len(blocks) == 1 and isinstance(block.rows, slice):        # the whole batch: its results are the outputs
            outputs = [None if value is None else value.to(out_dtype) for value in result]
            break
        if not outputs:
            outputs = [torch.empty((rows, positions), dtype=out_dtype, device=r.device)
                       for _ in range(3 if need_baselines else 2)]
        for output, value in zip(outputs, result):
            _put(output, block.rows, value)
    return outputs, torch.stack(flags).any() if check_values else None


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
    reference_checks.alignment(align)
    return _run(_NAMES, rewards, response_mask, group_ids, log_probs, sum_pi_squared, is_weights, check_values,
                align=align, leave_one_out=True, handle_zero_tail=False, epsilon=epsilon, compile=compile)


def leave_one_out_advantages(rewards: Any, response_mask: Any, group_ids: Any, log_probs: Any, sum_pi_squared: Any,
                             is_weights: Any, *, align: str, epsilon: float, check_values: bool,
                             compile: bool, names: tuple[str, ...] = _NAMES) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns) of :func:`leave_one_out_token_baseline` without forming the baselines: the
    leave-one-out drop-ins with verl's signature (:mod:`otb_torch.verl`), which return only these two; errors name
    the arguments by ``names`` (verl's, :data:`_VERL_NAMES`, for the drop-ins)."""
    reference_checks.alignment(align)
    result = _run(names, rewards, response_mask, group_ids, log_probs, sum_pi_squared, is_weights, check_values,
                  align=align, leave_one_out=True, handle_zero_tail=False, epsilon=epsilon, need_baselines=False,
                  compile=compile)
    return result.advantages, result.returns


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
    reference_checks.alignment(align)
    leave_one_out = check.flag("leave_one_out", leave_one_out)
    handle_zero_tail = check.zero_tail(handle_zero_tail, leave_one_out)
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
    out = check.output_dtype(rewards_t)
    returns = reward_to_go(rewards_t.to(dtype), (mask_t != 0).to(dtype)).to(out)
    if check_values and not _all_finite((returns,)):                  # finite rewards whose sums left the range
        if _narrower(out, dtype):
            raise _output_range_error("rewards", out)
        raise reference_checks.returns_overflow_error("rewards", str(dtype).replace("torch.", ""))
    return returns


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
    out = check.output_dtype(lp_t)
    energy = energy.to(out)
    if check_values and not _all_finite((energy,)):           # W ≤ 2·T·max ρ²: the weights, or a float16 output
        if weights_t is not None:
            _raise_if_weights_may_overflow(weights_t.to(dtype), mask_t, dtype)
        raise _output_range_error("log_probs", out)
    return energy


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
