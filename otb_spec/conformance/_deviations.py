"""Documented deviations: the places where verl 0.9.1 — the authors' trainer — differs from the reference.

The verifier checks an implementation against the reference. Where the reference *defines* a value that verl leaves
undefined, or where verl has a known defect, verl (and any port that follows it literally) fails that check although
it does what verl does. Each such place is a :class:`Deviation` with a *model*: the outputs verl's documented behaviour
gives on a case (NaN where it divides 0/0, the zero tail where its rounded lengths put it), or the exception it raises.
A value check that fails against the reference and matches a deviation's model — within the same tolerance, NaN only
where the model has NaN — is reported as that documented deviation, not as a failure; ``strict=True`` (``--strict``)
makes it a failure. Anything else wrong in the same case still fails: the model is verl's behaviour, not a waiver.

Two categories (docs/verl-differences.md lists both with their case ids):

* **by definition** — ``epsilon-zero-nan``: ε = 0 and a zero denominator Σᵢ Wᵢmᵢ at a position: verl computes 0/0 = NaN,
  the reference defines the baseline as 0 (as 0/ε = 0 for every ε > 0). Leave-one-out too (verl has none): a port
  that divides Σ_{j≠i} GⱼWⱼmⱼ by Σ_{j≠i} Wⱼmⱼ + ε as verl divides gets 0/0 there, singleton groups included.
* **known verl defect** — ``half-precision-lengths``: given a bfloat16 (or float16) ``response_mask`` verl computes
  the response lengths as ``response_mask.sum(-1)`` in that dtype, which rounds lengths above 256 (float16: 2048). The
  single-turn zero tail then follows the rounded lengths (wrong member, wrong start, or a tie that hides it); the
  multi-turn compaction raises a shape error. verl's trainer holds the mask as int64, so only a subject given the mask
  in half precision (the adapter protocol, the ``jax`` convention) can show it; under the ``verl`` convention, which
  passes int64 as the trainer does, a port that rounds its lengths is not excused.
* **known verl defect** — ``fused-float64-in-float32`` (fused token statistics): verl's ``FusedLinearForPPO`` casts
  the logits to float32 whatever the inputs' dtype, so float64 hidden states and weights give log π in float32 and
  statistics and gradients only as accurate as float32's. Its model: the reference's values, judged with the bound of
  a program working in float32, recognised only where log π comes back as float32 (verl's cast shows there: a float64
  output with float32's errors is a bug, not this deviation); the structure layer's "less precise output" finding for
  log π is recognised too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from otb_spec._baseline import Grid, forced_zero, validated_otb_inputs
from otb_spec.conformance._cases import _OTB_KINDS, LEAVE_ONE_OUT_KINDS, Case, _round_to, alignment
from otb_spec.groups import segment_sums
from otb_spec.otb import optimal_token_baseline
from otb_spec.trajectory import cumulative_energy

__all__ = ["Deviation", "DEVIATIONS", "RAISES", "deviations_for"]

RAISES = "raises"     # a model's answer when verl's documented behaviour is to raise on the case


@dataclass(frozen=True)
class Deviation:
    """One documented difference between verl 0.9.1 and the reference.

    Attributes:
      id: short name (``epsilon-zero-nan``), used in reports and JSON.
      category: ``"by definition"`` or ``"known verl defect"``.
      title: one line.
      verl: what verl 0.9.1 does.
      reference: what the reference does.
      why: why the reference does it differently.
      doc: where it is documented (docs/verl-differences.md item).
      kinds: the kinds it concerns.
      applies: ``case → bool``: the case exercises it (the model differs from the reference there).
      model: ``case → {output: expected array (NaN where verl gives NaN)}`` or :data:`RAISES`.
      judged_as: ``case → dtype`` or None: compare with the model within the bound of a program whose working and
        accumulation precision is that dtype (a precision deviation), instead of the subject's own.
      structure: ``(check, case, output, returned dtype) → bool`` or None: the deviation explains this finding of the
        structure layer (e.g. ``"dtypes"``: an output less precise than the inputs).
      nan_optional: where the model has NaN, the output may be NaN or the reference's value, position by position
        (NaN anywhere else still fails); else the model's NaN must be matched by NaN.
      fingerprint: ``(case, output dtypes) → bool`` or None: the outcome must also show verl's behaviour in the form
        of its outputs (``fused-float64-in-float32``: log π returned in float32), so that a port with a bug of the
        deviation's size but not its cause (float64 outputs with float32 errors) is not excused; None: the values
        decide alone.
      mask_dtypes: the dtypes of ``response_mask`` in which verl shows it (``half-precision-lengths``: bfloat16 and
        float16), or None for any: a subject that passes the mask otherwise (the ``verl`` convention: int64, as verl's
        trainer does) cannot be showing verl's behaviour there, so the deviation excuses nothing.
    """

    id: str
    category: str
    title: str
    verl: str
    reference: str
    why: str
    doc: str
    kinds: tuple[str, ...]
    applies: Callable[[Case], bool]
    model: Callable[[Case], Any]
    judged_as: Callable[[Case], str] | None = None
    structure: Callable[[str, Case, str, str], bool] | None = None
    nan_optional: bool = False
    fingerprint: Callable[[Case, dict], bool] | None = None
    mask_dtypes: tuple[str, ...] | None = None

    def to_dict(self) -> dict:
        return {"id": self.id, "category": self.category, "title": self.title, "verl": self.verl,
                "reference": self.reference, "why": self.why, "doc": self.doc, "kinds": list(self.kinds)}


# ----------------------------------------------------------------------------------------------------------------------
# ε = 0 with an empty denominator


def _empty_denominators(case: Case) -> np.ndarray:
    """[B, T] True where verl's baseline is 0/0: a group's Σᵢ Wᵢmᵢ is exactly 0 at an aligned position that no rule
    forces to 0 — at every position of the member's row (single-turn: verl's baseline tensor holds the group value at
    masked positions too, and (G − NaN)·0 is NaN) or at its valid tokens (multi-turn: only those are scattered back)."""
    rewards, mask, segments, energy, weights = validated_otb_inputs(case.rewards, case.response_mask, case.group_ids,
                                                                   case.log_probs, case.sum_pi_squared,
                                                                   case.is_weights)
    align = alignment(case.kind)
    grid = Grid(mask, align)
    realized = grid.gather(cumulative_energy(energy, mask, weights))
    empty = segment_sums(realized * grid.valid, segments)[segments.index] == 0.0
    nan_grid = empty & ~forced_zero(grid, segments, False, case.handle_zero_tail)
    if align == "position":
        return nan_grid
    return grid.scatter(nan_grid.astype(np.float64)) > 0      # valid tokens whose compacted position is 0/0


def _empty_leave_one_out_denominators(case: Case) -> np.ndarray:
    """[B, T] True where member i's leave-one-out denominator Σ_{j≠i} Wⱼmⱼ (over the other members of its group, at
    the same position — or, multi-turn, the same valid-token index, at member i's valid tokens) is exactly 0: every
    other member's energy is 0 there or it is not valid there (a singleton: always). The terms are ≥ 0, so the sum is
    0 exactly where every term is — counted, not summed, so that no rounding decides it."""
    rewards, mask, segments, energy, weights = validated_otb_inputs(case.rewards, case.response_mask, case.group_ids,
                                                                   case.log_probs, case.sum_pi_squared,
                                                                   case.is_weights)
    align = alignment(case.kind)
    grid = Grid(mask, align)
    nonzero = ((grid.gather(cumulative_energy(energy, mask, weights)) * grid.valid) != 0.0).astype(np.int64)
    empty = segment_sums(nonzero, segments)[segments.index] - nonzero == 0
    if align == "position":
        return empty
    return grid.scatter(empty.astype(np.float64)) > 0          # valid tokens whose compacted position is 0/0


def _nan_positions(case: Case) -> np.ndarray:
    return (_empty_leave_one_out_denominators(case) if case.kind in LEAVE_ONE_OUT_KINDS
            else _empty_denominators(case))


def _epsilon_zero_applies(case: Case) -> bool:
    return case.kind in _OTB_KINDS and case.epsilon == 0.0 and bool(_nan_positions(case).any())


def _epsilon_zero_model(case: Case) -> dict[str, np.ndarray]:
    """NaN where the denominator is 0/0: verl's at each such position of the member's row, masked ones included ((G −
    NaN)·0 is NaN; multi-turn: at valid tokens only, nothing else is scattered back). Matched with ``nan_optional``: a
    port may give NaN at any of these positions and the reference's value at the others (one that zeroes masked
    positions by selection, one whose leave-one-out skips positions no other member reaches)."""
    expected = case.expected()
    return {"advantages": np.where(_nan_positions(case), np.nan, expected["advantages"]),
            "returns": expected["returns"]}


# ----------------------------------------------------------------------------------------------------------------------
# lengths rounded to half precision


def _rounded_lengths(case: Case) -> tuple[np.ndarray, np.ndarray]:
    lengths = np.asarray(case.response_mask, dtype=np.float64).sum(axis=-1)
    return lengths, _round_to(case.dtype, lengths).astype(np.float64)


def _half_lengths_applies(case: Case) -> bool:
    if case.kind not in ("otb", "tir-otb") or case.dtype not in ("bfloat16", "float16"):
        return False
    exact, rounded = _rounded_lengths(case)
    if case.kind == "tir-otb":
        return bool(np.any((exact > 0) & (rounded != exact)))
    return case.handle_zero_tail and not np.array_equal(_verl_tail_starts(case, rounded), _verl_tail_starts(case, exact))


def _verl_tail_starts(case: Case, lengths: np.ndarray) -> np.ndarray:
    """[B] verl's zero tail with these lengths: the position from which the row's baseline is 0 (T where none)."""
    ids = [repr(value) for value in np.asarray(case.group_ids, dtype=object).tolist()]
    starts = np.full(len(ids), case.rewards.shape[1], dtype=np.int64)
    for group in dict.fromkeys(ids):
        members = [row for row, value in enumerate(ids) if value == group]
        if len(members) < 2:
            continue
        ordered = sorted(lengths[members])
        longest, second = ordered[-1], ordered[-2]
        at_longest = [row for row in members if lengths[row] == longest]
        if len(at_longest) == 1 and longest > second:
            starts[at_longest[0]] = int(second)
    return starts


def _half_lengths_model(case: Case) -> Any:
    exact, rounded = _rounded_lengths(case)
    if case.kind == "tir-otb":
        return RAISES                  # its compaction assigns len(valid tokens) values into a slice of rounded length
    untailed = optimal_token_baseline(case.rewards, case.response_mask, case.group_ids, case.log_probs,
                                      case.sum_pi_squared, is_weights=case.is_weights, handle_zero_tail=False,
                                      epsilon=case.epsilon)
    positions = np.arange(case.rewards.shape[1])
    keep = positions[None, :] < _verl_tail_starts(case, rounded)[:, None]
    mask = np.asarray(case.response_mask, dtype=np.float64)
    return {"advantages": (untailed.returns - untailed.baselines * keep) * mask, "returns": untailed.returns}


# ----------------------------------------------------------------------------------------------------------------------
# fused token statistics of float64 inputs computed in float32


def _float64_inputs(case: Case) -> bool:
    return case.kind == "fused-token-statistics" and case.dtype == "float64"


def _float32_statistics(check: str, case: Case, output: str, returned: str) -> bool:
    """verl's cast, as the structure layer sees it: log π (not the entropy or a gradient) returned as float32."""
    return check == "dtypes" and _float64_inputs(case) and output == "log_probs" and returned == "float32"


def _log_probs_in_float32(case: Case, output_dtypes: dict) -> bool:
    """verl's cast shows in its output: float64 inputs, log π returned as float32."""
    return output_dtypes.get("log_probs") == "float32"


DEVIATIONS: tuple[Deviation, ...] = (
    Deviation(
        id="epsilon-zero-nan", category="by definition",
        title="ε = 0 and an empty denominator: verl's baseline is 0/0 = NaN",
        verl="divides Σᵢ GᵢWᵢmᵢ by Σᵢ Wᵢmᵢ + ε; with ε = 0 and every Wᵢmᵢ = 0 at a position (a deterministic policy so "
             "far, or a position no member reaches) the baseline is 0/0 = NaN, and so is the advantage — single-turn "
             "also at masked positions, since (G − NaN)·0 is NaN (a port that zeroes them by selection instead: at "
             "valid positions only). verl has no leave-one-out OTB; a leave-one-out port dividing the same way gets "
             "0/0 where every other member's Wⱼmⱼ is 0, singleton groups included",
        reference="defines the baseline as 0 there, the value 0/ε gives for every ε > 0; advantages stay finite",
        why="a defined value instead of a silent NaN; identical to verl for every ε > 0 (verl's default is 1e-8)",
        doc="docs/verl-differences.md #3", kinds=_OTB_KINDS,
        applies=_epsilon_zero_applies, model=_epsilon_zero_model, nan_optional=True),
    Deviation(
        id="half-precision-lengths", category="known verl defect",
        title="a bfloat16/float16 response_mask: verl rounds response lengths, so the zero tail lands in the wrong "
              "place",
        verl="computes lengths as response_mask.sum(-1) in the mask's dtype; bfloat16 holds integers exactly only up "
             "to 256 (float16: 2048), so longer lengths are rounded — the single-turn zero tail then starts at the "
             "rounded second-longest length, or disappears when rounding ties the longest; the multi-turn compaction "
             "raises a shape error. Its trainer's mask is int64, so the trainer never shows it; a caller passing the "
             "mask in the inputs' half precision does (recognised only where the target is given such a mask)",
        reference="counts lengths exactly (integers) in every precision",
        why="lengths are integers; rounding them is a defect of verl 0.9.1, listed so that it stays visible",
        doc="docs/verl-differences.md #11", kinds=("otb", "tir-otb"),
        applies=_half_lengths_applies, model=_half_lengths_model, mask_dtypes=("bfloat16", "float16")),
    Deviation(
        id="fused-float64-in-float32", category="known verl defect",
        title="float64 hidden states and LM head: verl's FusedLinearForPPO computes in float32",
        verl="casts the logits h·Wᵀ/τ to float32 whatever the inputs' dtype (`logits.to(torch.float32)`, meant to "
             "widen bfloat16), so with float64 inputs log π comes back as float32 and log π, the entropy and both "
             "gradients are only as accurate as a float32 computation (observed: within float32's bound, 10⁵ to 10⁷ "
             "times float64's)",
        reference="computes float64 inputs in float64",
        why="a kernel given float64 must not lose precision silently (float64 is what gradient checks run in); the "
            "cast is a defect of verl 0.9.1, harmless for its bfloat16/float32 training, listed so that it stays "
            "visible",
        doc="docs/verl-differences.md #13", kinds=("fused-token-statistics",),
        applies=_float64_inputs, model=lambda case: case.expected(), judged_as=lambda case: "float32",
        structure=_float32_statistics, fingerprint=_log_probs_in_float32),
)


def deviations_for(kind: str) -> tuple[Deviation, ...]:
    """The documented deviations that concern ``kind`` (for the leave-one-out kinds only ε = 0's 0/0, as a port
    dividing as verl does gets it; none for sum-pi-squared: verl's Σπ² is within the tolerance of a correct
    implementation; for fused token statistics the float64-in-float32 cast of ``FusedLinearForPPO``)."""
    return tuple(deviation for deviation in DEVIATIONS if kind in deviation.kinds)
