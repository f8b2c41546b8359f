"""Conformance cases: inputs, options, the reference's expected outputs, and the tolerance for an implementation.

A :class:`Case` is framework-neutral (NumPy arrays on the host). Half-precision cases hold float32 arrays whose values
are exactly representable in bfloat16 (the implementation receives bfloat16 tensors; the reference reads the same
values). Kinds:

* ``"otb"`` — single-turn OTB (verl ``compute_optimal_token_baseline_advantage``): outputs advantages, returns;
* ``"tir-otb"`` — multi-turn OTB (verl ``compute_multi_turn_optimal_token_baseline_advantage``): same outputs;
* ``"loo-otb"`` — leave-one-out OTB (position alignment): same outputs;
* ``"tir-loo-otb"`` — multi-turn leave-one-out OTB (``align="valid_token"``: the k-th valid token of each member, as
  ``"tir-otb"`` aligns them; ``otb_torch.verl.install(variant="leave_one_out")`` for verl's multi-turn estimator):
  same outputs;
* ``"sum-pi-squared"`` — Σπ² from logits: output sum_pi_squared;
* ``"fused-token-statistics"`` — log π(y), entropy and (where given) Σπ² of softmax(h·Wᵀ/τ) from hidden states
  [..., H], the LM head [V, H], token ids and τ, without the logits (verl ``FusedLinearForPPO``,
  ``otb_torch.fused_linear_token_statistics``): outputs log_probs, entropy, sum_pi_squared (optional) and the
  gradients grad_hidden, grad_weight of Σ g_lp·log π + g_H·H for the case's cotangents (where the convention can
  differentiate).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
from hypothesis import strategies as st

from otb_spec import _portable as portable
from otb_spec import strategies as otb_st
from otb_spec.lm_head import token_statistics_from_hidden, token_statistics_vjp
from otb_spec.otb import leave_one_out_token_baseline, multi_turn_optimal_token_baseline, optimal_token_baseline
from otb_spec.proxy import sum_pi_squared
from otb_spec.tolerances import (Tolerance, hidden_gradient_tolerance, hidden_statistics_tolerance, logit_spread,
                                 logsumexp_tolerance, otb_comparison_tolerance, output_rounding,
                                 sum_pi_squared_tolerance)

__all__ = ["KINDS", "LEAVE_ONE_OUT_KINDS", "VALID_TOKEN_KINDS", "alignment", "reference_options", "GENERATED_PROFILES",
           "Case", "golden_cases", "generated_cases", "special_cases", "robustness_cases", "compute_dtype_for"]

FUSED = "fused-token-statistics"
KINDS = ("otb", "tir-otb", "loo-otb", "tir-loo-otb", "sum-pi-squared", FUSED)
_OTB_KINDS = ("otb", "tir-otb", "loo-otb", "tir-loo-otb")
LEAVE_ONE_OUT_KINDS = ("loo-otb", "tir-loo-otb")
"""Kinds computed by ``leave_one_out_token_baseline`` (no zero-tail option; ``align`` says which)."""
VALID_TOKEN_KINDS = ("tir-otb", "tir-loo-otb")
"""Kinds whose members are aligned by their k-th valid token (multi-turn: tool output masked inside a response)."""


def alignment(kind: str) -> str:
    """How an OTB kind aligns a group's members: ``"valid_token"`` (multi-turn) or ``"position"``."""
    return "valid_token" if kind in VALID_TOKEN_KINDS else "position"


def reference_options(kind: str) -> dict[str, str]:
    """The keyword a kind adds to the reference's (and a target's) call besides ε and the zero tail:
    ``align="valid_token"`` for multi-turn leave-one-out; nothing otherwise (``"position"`` is the default)."""
    return {"align": "valid_token"} if kind in LEAVE_ONE_OUT_KINDS and alignment(kind) == "valid_token" else {}


_FUSED_OUTPUTS = ("log_probs", "entropy", "sum_pi_squared", "grad_hidden", "grad_weight")


_DTYPES = ("float64", "float32", "bfloat16", "float16")      # what a case can be delivered in


def compute_dtype_for(input_dtype: str) -> str:
    """The precision a correct implementation accumulates in: float64 for float64 inputs, float32 otherwise."""
    return "float64" if input_dtype == "float64" else "float32"


def _round_to(dtype: str, array: np.ndarray) -> np.ndarray:
    """Values exactly representable in ``dtype`` (kept as float32 for bfloat16/float16, which NumPy may lack)."""
    array = np.asarray(array, dtype=np.float64)
    if dtype == "float64":
        return array
    if dtype == "float32":
        return array.astype(np.float32)
    if dtype == "float16":
        return array.astype(np.float16).astype(np.float32)
    # bfloat16: round to nearest even on the float32 bit pattern
    bits = array.astype(np.float32).view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
    return rounded.astype(np.uint32).view(np.float32)


_ARRAY_FIELDS = ("rewards", "response_mask", "group_ids", "log_probs", "sum_pi_squared", "is_weights", "logits",
                 "hidden", "weight", "token_ids", "log_probs_cotangent", "entropy_cotangent")


@dataclass(frozen=True)
class Case:
    """One conformance case.

    Attributes:
      kind: one of :data:`KINDS`.
      name: short description (for reports).
      dtype: the dtype the implementation receives: ``"float64"``, ``"float32"``, ``"bfloat16"`` or ``"float16"``.
        The arrays hold values exact in that dtype, stored as float32 for ``"bfloat16"`` and ``"float16"`` (NumPy
        has no bfloat16): cast them to ``dtype`` before calling, e.g. ``torch.tensor(case.rewards,
        dtype=getattr(torch, case.dtype))`` — else the implementation runs in float32 and its half-precision path
        goes untested.
      rewards, response_mask, log_probs, sum_pi_squared, is_weights: [B, T] arrays (OTB kinds; is_weights optional).
      group_ids: [B] ids (object array of strings, ints or other hashables).
      handle_zero_tail, epsilon: OTB options.
      logits: [..., V] (Σπ² kind).
      hidden, weight, token_ids, temperature: [..., H], [V, H], [...] and τ (fused kind; hidden is [N, H] or
        [B, T, H], as trainers pass it).
      log_probs_cotangent, entropy_cotangent: [...] g_lp and g_H, the upstream gradients the fused kind's backward
        pass is checked with (multiples of 1/64 in [−1, 1]: exact in every dtype, so casting them to the dtype of
        the outputs they belong to changes nothing).
      note: why the case is there when its expected value is a definition of otb-spec rather than verl's behaviour
        (shown in reports, so that a user reproducing verl bit for bit knows what to skip).
    """

    kind: str
    name: str
    dtype: str = "float32"
    rewards: np.ndarray | None = None
    response_mask: np.ndarray | None = None
    group_ids: np.ndarray | None = None
    log_probs: np.ndarray | None = None
    sum_pi_squared: np.ndarray | None = None
    is_weights: np.ndarray | None = None
    handle_zero_tail: bool = True
    epsilon: float = 1e-8
    logits: np.ndarray | None = None
    hidden: np.ndarray | None = None
    weight: np.ndarray | None = None
    token_ids: np.ndarray | None = None
    temperature: float = 1.0
    log_probs_cotangent: np.ndarray | None = None
    entropy_cotangent: np.ndarray | None = None
    note: str = ""
    _cache: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        # private read-only copies: an implementation that writes into its inputs cannot corrupt the case (or the
        # caller's arrays), and an accidental write through a shared buffer fails loudly
        for name in _ARRAY_FIELDS:
            value = getattr(self, name)
            if value is not None:
                copy = np.array(value, dtype=object if name == "group_ids" and np.asarray(value).dtype.kind in "USO"
                                else None, copy=True)
                copy.setflags(write=False)
                object.__setattr__(self, name, copy)

    def with_dtype(self, dtype: str) -> "Case":
        """The same case delivered in another dtype (values rounded to it)."""
        def convert(array):
            return None if array is None else _round_to(dtype, array)
        return replace(self, dtype=dtype, rewards=convert(self.rewards), log_probs=convert(self.log_probs),
                       sum_pi_squared=convert(self.sum_pi_squared), is_weights=convert(self.is_weights),
                       logits=convert(self.logits), hidden=convert(self.hidden), weight=convert(self.weight),
                       response_mask=None if self.response_mask is None else
                       np.asarray(self.response_mask, dtype=np.float32 if dtype != "float64" else np.float64),
                       _cache={})

    @property
    def output_names(self) -> tuple[str, ...]:
        if self.kind == FUSED:
            return _FUSED_OUTPUTS
        return ("sum_pi_squared",) if self.kind == "sum-pi-squared" else ("advantages", "returns")

    @property
    def optional_outputs(self) -> tuple[str, ...]:
        """Outputs compared only where the implementation gives them: Σπ² of a fused kernel (verl's gives log π and
        the entropy only) and the gradients (a convention without automatic differentiation checks values only)."""
        return ("sum_pi_squared", "grad_hidden", "grad_weight") if self.kind == FUSED else ()

    def output_shape(self, name: str) -> tuple[int, ...]:
        """The shape output ``name`` must have."""
        if self.kind == FUSED:
            return {"grad_hidden": self.hidden.shape, "grad_weight": self.weight.shape}.get(name, self.token_ids.shape)
        return self.logits.shape[:-1] if self.kind == "sum-pi-squared" else self.rewards.shape

    def expected(self) -> dict[str, np.ndarray]:
        """The reference's outputs (float64)."""
        if "expected" not in self._cache:
            if self.kind == FUSED:
                statistics = token_statistics_from_hidden(self.hidden, self.weight, self.token_ids,
                                                          temperature=self.temperature)
                gradients = token_statistics_vjp(self.hidden, self.weight, self.token_ids, self.log_probs_cotangent,
                                                 self.entropy_cotangent, temperature=self.temperature)
                self._cache["expected"] = {"log_probs": statistics.log_probs, "entropy": statistics.entropy,
                                           "sum_pi_squared": statistics.sum_pi_squared,
                                           "grad_hidden": gradients.hidden, "grad_weight": gradients.weight}
            elif self.kind == "sum-pi-squared":
                self._cache["expected"] = {"sum_pi_squared": sum_pi_squared(self.logits)}
            else:
                function = {"otb": optimal_token_baseline, "tir-otb": multi_turn_optimal_token_baseline,
                            "loo-otb": leave_one_out_token_baseline,
                            "tir-loo-otb": leave_one_out_token_baseline}[self.kind]
                options = {"epsilon": self.epsilon, **reference_options(self.kind)}
                if self.kind not in LEAVE_ONE_OUT_KINDS:
                    options["handle_zero_tail"] = self.handle_zero_tail
                result = function(self.rewards, self.response_mask, self.group_ids, self.log_probs,
                                  self.sum_pi_squared, is_weights=self.is_weights, **options)
                self._cache["expected"] = {"advantages": result.advantages, "returns": result.returns}
        return self._cache["expected"]

    def tolerances(self, output_dtype: str | None = None, compute_dtype: str | None = None,
                   working_dtype: str | None = None) -> dict[str, Tolerance]:
        """Per-output tolerance for |implementation − reference|: the bound of a correct implementation given the
        case's dtype and accumulating in ``compute_dtype`` (default :func:`compute_dtype_for` the case's dtype) + the
        reference's own float64 bound + the rounding of the output to ``output_dtype`` (default the case's dtype).
        Per row for Σπ² (each row's largest logit), per element for OTB (``otb_spec.tolerances``). Fused kind: per
        token and per gradient element (:func:`otb_spec.tolerances.hidden_statistics_tolerance` and
        :func:`~otb_spec.tolerances.hidden_gradient_tolerance`) for an implementation whose working precision — the
        precision of its logits and per-token values — is ``working_dtype`` (default the case's dtype: verl forms
        its logits in the inputs' dtype); OTB kinds: the precision its per-token arithmetic is done in —
        ``working_dtype`` (inputs more precise than it rounded to it, less precise ones widened), default the case's
        dtype, as verl's."""
        compute = compute_dtype or compute_dtype_for(self.dtype)
        out = output_dtype or self.dtype
        if self.kind == FUSED:
            rounding = output_rounding(out)
            return {name: bound + rounding
                    for name, bound in self._fused_bounds(working_dtype or self.dtype, compute).items()}
        working = working_dtype or self.dtype
        key = ("tolerances", out, compute, working)
        if key not in self._cache:
            if self.kind == "sum-pi-squared":
                vocab, spread = self.logits.shape[-1], logit_spread(self.logits)
                tolerance = (sum_pi_squared_tolerance(self.logits, dtype=working, accumulation_dtype=compute)
                             + replace(logsumexp_tolerance(vocab, spread), reason="the reference's own float64 bound")
                             + output_rounding(out))
                self._cache[key] = {"sum_pi_squared": tolerance}
            else:
                leave_one_out = self.kind in LEAVE_ONE_OUT_KINDS
                advantages, returns = otb_comparison_tolerance(
                    self.rewards, self.response_mask, self.group_ids, self.log_probs, self.sum_pi_squared,
                    is_weights=self.is_weights, align=alignment(self.kind), leave_one_out=leave_one_out,
                    handle_zero_tail=self.handle_zero_tail and not leave_one_out, epsilon=self.epsilon,
                    compute_dtype=compute, output_dtype=out, input_dtype=working)
                self._cache[key] = {"advantages": advantages, "returns": returns}
        return self._cache[key]

    def _fused_bounds(self, working: str, compute: str) -> dict[str, Tolerance]:
        """The implementation's bounds (working precision ``working``, sums in ``compute``) + the reference's own
        float64 bounds, per output, before the rounding of the output."""
        key = ("fused-bounds", working, compute)
        if key not in self._cache:
            arguments = (self.hidden, self.weight, self.token_ids)
            cotangents = (self.log_probs_cotangent, self.entropy_cotangent)
            implementation = hidden_statistics_tolerance(*arguments, temperature=self.temperature, dtype=working,
                                                         accumulation_dtype=compute)
            reference = hidden_statistics_tolerance(*arguments, temperature=self.temperature, dtype="float64")
            gradients = hidden_gradient_tolerance(*arguments, *cotangents, temperature=self.temperature,
                                                  dtype=working, accumulation_dtype=compute)
            exact = hidden_gradient_tolerance(*arguments, *cotangents, temperature=self.temperature, dtype="float64")
            own = lambda bound: replace(bound, reason="the reference's own float64 bound")  # noqa: E731
            bounds = {name: mine + own(theirs)
                      for name, mine, theirs in zip(_FUSED_OUTPUTS[:3], implementation, reference)}
            bounds.update(grad_hidden=gradients[0] + own(exact[0]), grad_weight=gradients[1] + own(exact[1]))
            self._cache[key] = bounds
        return self._cache[key]

    def describe(self) -> str:
        if self.kind == FUSED:
            return (f"{self.name} — hidden {tuple(self.hidden.shape)}, V={self.weight.shape[0]}, "
                    f"τ={self.temperature:g}, {self.dtype}")
        if self.kind == "sum-pi-squared":
            return f"{self.name} — logits {tuple(self.logits.shape)} {self.dtype}"
        groups = len({repr(g) for g in np.asarray(self.group_ids, dtype=object).tolist()})
        return (f"{self.name} — B={self.rewards.shape[0]}, T={self.rewards.shape[1]}, {groups} groups, {self.dtype}, "
                f"IS weights {'yes' if self.is_weights is not None else 'no'}, handle_zero_tail={self.handle_zero_tail}"
                f", epsilon={self.epsilon:g}")


# ----------------------------------------------------------------------------------------------------------------------
# golden cases: each isolates one behaviour that real implementations get wrong


def _uniform(shape: tuple[int, int], pi: float = 0.5, spp: float | None = None) -> tuple[np.ndarray, np.ndarray]:
    spp = pi * pi + (1 - pi) * (1 - pi) if spp is None else spp
    return np.full(shape, portable.log(pi)), np.full(shape, spp)


def _policy_statistics(shape: tuple[int, int], seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = portable.PortableRandom(seed)
    log_pi = portable.log(rng.uniform(0.02, 0.98, shape))
    pi = portable.exp(log_pi)
    return log_pi, _consistent_sum_pi_squared(pi, rng.uniform(0.05, 1.0, shape))


def _consistent_sum_pi_squared(pi: np.ndarray, spread: np.ndarray) -> np.ndarray:
    """Σπ² = π² + (1 − π)²·spread (spread ∈ (0, 1]): the collision probability of a policy that gives the sampled
    token π and spreads the rest over some other tokens; in correctly rounded operations (bit-portable)."""
    rest = np.subtract(1.0, pi)
    return np.add(np.multiply(pi, pi), np.multiply(np.multiply(rest, rest), spread))


def _ids(*names: str) -> np.ndarray:
    return np.array(list(names), dtype=object)


def _otb_golden(kind: str) -> list[Case]:
    cases = []
    lp, spp = _uniform((2, 3))
    cases.append(Case(kind, "worked example (docstring): two members, w = ½, unique longest", "float64",
                      np.array([[0, 0, 1.0], [0, 0, 0]]), np.array([[1, 1, 1.0], [1, 1, 0]]), _ids("q", "q"), lp, spp,
                      epsilon=0.0))
    lp, spp = _policy_statistics((6, 5), 1)
    rewards = np.zeros((6, 5))
    rewards[:, -1] = [1, 0, 1, 0.5, 1, 1]        # the singleton uid-c has G ≠ 0: a baseline given to it shows
    cases.append(Case(kind, "non-contiguous groups with string ids and a singleton", "float64", rewards,
                      np.ones((6, 5)), _ids("uid-b", "uid-a", "uid-b", "uid-c", "uid-a", "uid-b"), lp, spp))
    mask = np.array([[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1.0],
                     [1, 1, 1, 1, 1, 1.0]])
    lp, spp = _policy_statistics((5, 6), 2)
    rewards = np.array([[0, 0, 0, 0, 0, 1.0], [0, 0, 2.0, 0, 0, 0], [0, 0, 0, -1.0, 0, 0], [0, 0, 0, 0, 0, 0.5],
                        [0, 0, 0, 0, 0, -0.5]])
    cases.append(Case(kind, "unique longest member (zero tail) and a tie for the longest", "float64", rewards, mask,
                      _ids("g1", "g1", "g2", "g2", "g2"), lp, spp))
    cases.append(replace(cases[-1], name="the same with handle_zero_tail=False", handle_zero_tail=False))
    mask = np.array([[1, 1, 0, 0, 1, 1, 1, 0], [1, 1, 1, 1, 1, 0, 0, 0], [1, 0, 0, 1, 1, 0, 1, 1.0],
                     [0, 0, 0, 1, 1, 1, 1, 1.0]])
    lp, spp = _policy_statistics((4, 8), 3)
    rewards = portable.PortableRandom(3).normal((4, 8))
    cases.append(Case(kind, "tool-output holes, left padding and dense rewards", "float64", rewards, mask,
                      _ids("x", "x", "x", "y"), lp, spp))
    mask = np.array([[1, 1, 1, 0], [0, 0, 0, 0], [1, 1, 0, 0.0]])
    lp, spp = _policy_statistics((3, 4), 4)
    cases.append(Case(kind, "an all-masked row inside a group", "float64", np.array([[0, 0, 1.0, 0], [5, 5, 5, 5],
                                                                                     [0, 3.0, 0, 0]]),
                      mask, _ids(7, 7, 7), lp, spp))
    lp, spp = _policy_statistics((5, 4), 9)
    cases.append(Case(kind, "a lone non-empty member among empty ones, handle_zero_tail=False", "float64",
                      portable.PortableRandom(9).normal((5, 4)),
                      np.array([[1, 1, 1, 0], [0, 0, 0, 0], [0, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 1.0]]),
                      _ids("solo", "solo", "solo", "pair", "pair"), lp, spp, handle_zero_tail=False))
    cases.append(replace(cases[-1], name="a lone non-empty member among empty ones, handle_zero_tail=True",
                         handle_zero_tail=True))     # the empty members rank below it: zero tail from t = 0, A = G
    lp, spp = _policy_statistics((3, 8), 10)
    cases.append(Case(kind, "zero tail where valid-token counts and spans disagree (holes)", "float64",
                      portable.PortableRandom(10).normal((3, 8)),
                      np.array([[1, 1, 1, 1, 1, 1, 0, 0], [1, 0, 0, 1, 1, 0, 0, 0], [1, 0, 0, 0, 0, 1, 0, 0.0]]),
                      _ids("h", "h", "h"), lp, spp))
    lp, spp = _policy_statistics((4, 5), 5)
    weights = portable.PortableRandom(5).uniform(0.0, 2.5, (4, 5))
    weights[1, 2] = 0.0
    rewards = np.zeros((4, 5))
    rewards[:, -1] = [1.0, 0.0, 0.5, 1.0]
    cases.append(Case(kind, "rollout importance weights (ρ², one ρ = 0)", "float64", rewards, np.ones((4, 5)),
                      _ids("p", "p", "q", "q"), lp, spp, weights))
    ones = np.ones((3, 3))
    cases.append(Case(kind, "deterministic policy: zero energy, ε decides", "float64",
                      np.array([[0, 0, 1.0], [0, 0, 0], [0, 0, 2.0]]), ones, _ids("d", "d", "d"), np.zeros((3, 3)),
                      ones))
    deviation = ("the documented deviation 'epsilon-zero-nan' (docs/verl-differences.md #3): verify and otb_verify "
                 "report it, not fail it, unless strict; assert_matches_reference compares with the reference alone")
    verl_nan = (f"verl 0.9.1 divides 0/0 = NaN here; otb-spec defines the baseline as 0 — {deviation}"
                if kind not in LEAVE_ONE_OUT_KINDS else
                "ε = 0 and an empty denominator: otb-spec defines the baseline as 0 (the value 0/ε gives for every "
                f"ε > 0); verl has no leave-one-out estimator, but a port dividing as verl does gets 0/0 = NaN here — "
                f"{deviation}")
    cases.append(replace(cases[-1], name="zero energy with ε = 0 (defined as baseline 0)", epsilon=0.0, note=verl_nan))
    lp, spp = _policy_statistics((3, 5), 8)
    cases.append(Case(kind, "ε = 0 and positions no member reaches (defined as baseline 0)", "float64",
                      np.array([[0, 1.0, 0, 0, 0], [0, 0, 2.0, 0, 0], [0, 0, 0, 0, 0]]),
                      np.array([[1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [1, 0, 0, 0, 0.0]]), _ids("z", "z", "z"), lp, spp,
                      epsilon=0.0, note=verl_nan))
    lp, spp = _policy_statistics((4, 4), 6)
    cases.append(Case(kind, "ε large enough to matter (ε = 0.5)", "float64", portable.PortableRandom(6).normal(
        (4, 4)), np.ones((4, 4)), _ids("e", "e", "e", "e"), lp, spp, epsilon=0.5))
    # the unique longest member has left padding and a hole: verl's zero tail starts at position 4 (the second-longest
    # length), not at its 4th valid token (position 5) — what a port placing the tail by valid-token index gets wrong
    lp, spp = _policy_statistics((3, 10), 12)
    cases.append(Case(kind, "zero tail on a longest member with left padding and a hole", "float64",
                      portable.PortableRandom(12).normal((3, 10)),
                      np.array([[0, 1, 1, 0, 1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 0, 0, 0, 0, 0, 0],
                                [1, 1, 0, 0, 0, 0, 0, 0, 0, 0.0]]),
                      _ids("k", "k", "k"), lp, spp))
    # ε = 0 beside a tool-output hole: where no *other* member is valid depends on the alignment — by position, the
    # second member's positions 1–2 (the first member's hole); by valid token, its 3rd and 4th valid tokens (the first
    # has two) — so a leave-one-out port dividing 0/0 gets NaN on different tokens in loo-otb and tir-loo-otb (the
    # self-inclusive kinds have no empty denominator here: each member's own energy is in it)
    lp, spp = _policy_statistics((2, 4), 13)
    cases.append(Case(kind, "ε = 0 beside a tool-output hole (the alignment decides where no other member is)",
                      "float64", np.array([[0, 0, 0, 1.0], [0, 0, 0, 0.5]]), np.array([[1, 0, 0, 1], [1, 1, 1, 1.0]]),
                      _ids("a", "a"), lp, spp, epsilon=0.0, note=verl_nan if kind in LEAVE_ONE_OUT_KINDS else ""))
    # integer ids that only int64 tells apart: 2²⁴ and 2²⁴ + 1 are one float32, 5 and 5 + 2³² one int32, so a port
    # narrowing its ids merges two pairs of groups (all below 2⁵³: exact in float64 and in any JSON reader)
    lp, spp = _policy_statistics((8, 4), 14)
    rewards = np.zeros((8, 4))
    rewards[:, -1] = [1.0, 0.0, 0.0, 1.0, 0.5, 1.0, 0.0, 0.25]
    cases.append(Case(kind, "integer ids that only int64 tells apart (2^24 and 2^24 + 1; 5 and 5 + 2^32)", "float64",
                      rewards, np.ones((8, 4)), np.array([2**24, 2**24 + 1, 5 + 2**32, 5, 2**24 + 1, 2**24, 5,
                                                          5 + 2**32], dtype=np.int64), lp, spp))
    return cases


def _with_excluded_tokens(rng: np.random.Generator) -> np.ndarray:
    """[3, 30] logits with about half the entries −inf, the first column always finite."""
    logits = rng.normal((3, 30))
    excluded = rng.random((3, 30)) < 0.5
    excluded[:, 0] = False
    return np.where(excluded, -np.inf, logits)


def _spp_golden() -> list[Case]:
    rng = portable.PortableRandom(7)
    return [
        Case("sum-pi-squared", "uniform and two-token worked examples", "float64",
             logits=np.array([[0.0, 0.0], [float(portable.log(3.0)), 0.0]])),
        Case("sum-pi-squared", "ordinary logits", "float64", logits=rng.normal((4, 7, 50), scale=3.0)),
        Case("sum-pi-squared", "logits near ±1e4 (overflow without the max shift)", "float64",
             logits=rng.normal((3, 40), scale=5.0) + np.array([[1e4], [-1e4], [0.0]])),
        Case("sum-pi-squared", "logits spread over ±1e4 (most probabilities underflow)", "float64",
             logits=rng.uniform(-1e4, 1e4, (3, 40))),
        Case("sum-pi-squared", "−inf logits (excluded tokens)", "float64", logits=_with_excluded_tokens(rng)),
        Case("sum-pi-squared", "near-deterministic rows (Σπ² → 1)", "float64",
             logits=np.concatenate([np.full((2, 1), 40.0), rng.normal((2, 99))], axis=1)),
        Case("sum-pi-squared", "excluded tokens beside finite logits about 1e4 below zero (excluded is not unlikely)",
             "float64", logits=_with_excluded_tokens(rng) - 1e4),
    ]


# ----------------------------------------------------------------------------------------------------------------------
# fused token statistics: hidden states, an LM head, sampled tokens, τ and cotangents (bit-portable inputs)


def _grid_cotangents(rng: Any, shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """g_lp, g_H: multiples of 1/64 in [−1, 1] (exact in bfloat16, float16, float32 and float64)."""
    return (np.divide(rng.integers(-64, 65, shape).astype(np.float64), 64.0),
            np.divide(rng.integers(-64, 65, shape).astype(np.float64), 64.0))


def _lm_head_case(name: str, seed: int, lead: tuple[int, ...], n_hidden: int, vocab: int, *, logit_scale: float,
                  temperature: float = 1.0, **changes: Any) -> Case:
    """Hidden states N(0, 1) and a head scaled so that the logits z = h·Wᵀ/τ have a standard deviation of about
    ``logit_scale``; uniform token ids; grid cotangents. ``changes`` override any field."""
    rng = portable.PortableRandom(seed)
    hidden = rng.normal(lead + (n_hidden,))
    weight = np.multiply(rng.normal((vocab, n_hidden)), logit_scale * temperature / math.sqrt(n_hidden))
    ids = rng.integers(0, vocab, lead)
    g_lp, g_h = _grid_cotangents(rng, lead)
    fields = dict(hidden=hidden, weight=weight, token_ids=ids, temperature=temperature, log_probs_cotangent=g_lp,
                  entropy_cotangent=g_h)
    fields.update(changes)
    return Case(FUSED, name, "float64", **fields)


def _peak_in_column(name: str, seed: int, n_tokens: int, n_hidden: int, vocab: int, peak: float, column: int) -> Case:
    """Vocabulary entry ``column`` sits at ``peak`` for every token (the others' logits ~N(0, 1)); uniform token ids."""
    base = _lm_head_case(name, seed, (n_tokens,), n_hidden, vocab, logit_scale=1.0)
    hidden, weight = np.array(base.hidden), np.array(base.weight)
    hidden[:, 0] = 4.0
    weight[column] = 0.0
    weight[column, 0] = peak / 4.0
    return replace(base, hidden=hidden, weight=weight, _cache={})


def _peaked(name: str, seed: int, n_tokens: int, n_hidden: int, vocab: int, peak: float) -> Case:
    """Token 5 of the vocabulary sits ``peak`` above the rest (logits of the others ~N(0, 1)): the even tokens sample
    it (π ≈ 1, H ≈ 0), the odd ones another token (log π ≈ −peak)."""
    base = _peak_in_column(name, seed, n_tokens, n_hidden, vocab, peak, 5)
    ids = np.where(np.arange(n_tokens) % 2 == 0, 5, np.add(np.multiply(np.arange(n_tokens), 7) % (vocab - 6), 6))
    return replace(base, token_ids=ids, _cache={})


def _peak_in_last_column(name: str, seed: int, n_tokens: int, n_hidden: int, vocab: int, peak: float) -> Case:
    """The last token of the vocabulary sits at ``peak`` for every token (the others' logits ~N(0, 1)), far fewer than
    the rest together hold of the mass: a kernel over vocabulary blocks sees the running maximum grow in its last
    block, whatever the block's width, after the earlier blocks summed nearly all of S₁ = Σe^{z−m}. A tilt kept
    shifted, U = Σe^{z−m}(z − m), must then gain (m_old − m_new)·S₁ besides its rescaling; one that does not is off
    by about the growth of the maximum in the entropy, where moderate logits keep the bound small (the other large
    vocabulary's logits ~N(0, 3²) admit 0.8 nats there). Uniform token ids."""
    return _peak_in_column(name, seed, n_tokens, n_hidden, vocab, peak, vocab - 1)


def _far_below_zero(name: str, seed: int, n_tokens: int, n_hidden: int, vocab: int, offset: float) -> Case:
    """Every logit about ``offset`` below zero (the others' spread ~N(0, 3²) around it): a running maximum that
    starts at 0 instead of −∞ makes every e^{z − 0} underflow."""
    base = _lm_head_case(name, seed, (n_tokens,), n_hidden, vocab, logit_scale=3.0)
    hidden, weight = np.array(base.hidden), np.array(base.weight)
    hidden[:, 0] = 1.0
    weight[:, 0] = -offset
    return replace(base, hidden=hidden, weight=weight, _cache={})


def _fused_golden() -> list[Case]:
    rng = portable.PortableRandom(20)
    g_lp, g_h = _grid_cotangents(rng, (2,))
    worked = Case(FUSED, "worked example: π = (¾, ¼) and a uniform pair", "float64",
                  hidden=np.array([[float(portable.log(3.0))], [0.0]]), weight=np.array([[1.0], [0.0]]),
                  token_ids=np.array([0, 1]), log_probs_cotangent=g_lp, entropy_cotangent=g_h)
    ordinary = _lm_head_case("ordinary hidden states (N = 7, H = 16, V = 50), τ = 0.7", 21, (7,), 16, 50,
                             logit_scale=2.0, temperature=0.7)
    edges = _lm_head_case("token ids at the edges of the vocabulary (0 and V − 1), V = 37", 27, (6,), 6, 37,
                          logit_scale=2.0, token_ids=np.array([0, 36, 0, 36, 18, 35]))
    flat = _lm_head_case("flat softmax: h = 0, so π is uniform (H = log V, Σπ² = 1/V)", 26, (3,), 5, 29,
                         logit_scale=1.0)
    return [
        worked,
        ordinary,
        _lm_head_case("3-D hidden states [B, T, H] = [2, 3, 8], V = 40", 22, (2, 3), 8, 40, logit_scale=2.0),
        _lm_head_case("τ = 0.5 (sharper than the logits)", 23, (6,), 12, 33, logit_scale=3.0, temperature=0.5),
        _lm_head_case("τ = 3 (flatter than the logits)", 24, (6,), 12, 33, logit_scale=3.0, temperature=3.0),
        _peaked("peaked softmax: tokens at the peak (H ≈ 0) and 60 below it (log π ≈ −60)", 25, 4, 4, 24, 60.0),
        replace(flat, hidden=np.zeros(flat.hidden.shape)),
        edges,
        _lm_head_case("logits up to about ±400 (exp overflows without the max shift)", 28, (5,), 8, 45,
                      logit_scale=150.0),
        replace(ordinary, name="only the entropy in the loss (g_lp = 0)", temperature=1.0,
                log_probs_cotangent=np.zeros(7), _cache={}),
    ]


def golden_cases(kind: str, dtypes: tuple[str, ...] = ("float64", "float32")) -> list[Case]:
    """The hand-built cases of ``kind``, each in every dtype of ``dtypes``."""
    if kind not in KINDS:
        raise ValueError(f"kind: expected one of {', '.join(KINDS)}, got {kind!r}")
    if kind == FUSED:
        return list(_fused_golden_in(tuple(dtypes)))
    base = _spp_golden() if kind == "sum-pi-squared" else _otb_golden(kind)
    return [case.with_dtype(dtype) for case in base for dtype in dtypes]


@functools.lru_cache(maxsize=4)
def _fused_golden_in(dtypes: tuple[str, ...]) -> tuple[Case, ...]:
    """Built once per process and dtypes: their references and bounds are kept across verify runs."""
    return tuple(case.with_dtype(dtype) for case in _fused_golden() for dtype in dtypes)


# ----------------------------------------------------------------------------------------------------------------------
# generated and special cases


# Each generated check draws from one profile, so that every run exercises each feature the issue list names, whatever
# the example budget: name → (what it stresses, rollout_batches options, forced options).
GENERATED_PROFILES: dict[str, dict[str, tuple[str, dict, dict]]] = {
    "otb": {
        "general": ("anything: shuffled int, str or uuid ids, singletons, holes, left padding, empty rows, IS weights or "
                    "not, both zero-tail settings, ε ∈ {1e-8, 1e-3}; masked positions hold what a trainer leaves "
                    "there (the padding token's statistics, or zeros)", {}, {}),
        "zero-tail": ("groups of 2–4 with unequal lengths and dense non-zero rewards, handle_zero_tail=True: unique "
                      "longest members, ties, right and left padding",
                      dict(singleton_groups=False, max_group_size=4, reward_style="dense", min_abs_reward=0.1,
                           empty_rows=False),
                      dict(handle_zero_tail=True)),
        "holes-empty-rows-weights": ("groups of 2–3 with tool-output holes in every row long enough, empty rows "
                                     "(so lone non-empty members, which the zero tail must rank above their empty "
                                     "partners), IS weights always (some ρ = 0), dense non-zero rewards, both "
                                     "zero-tail settings",
                                     dict(holes=True, empty_rows=True, is_weights=True, reward_style="dense",
                                          min_abs_reward=0.1, singleton_groups=False, max_group_size=3),
                                     {}),
    },
    "sum-pi-squared": {
        "general": ("ordinary logits, V from 1 to 64", {}, {}),
        "extreme": ("logits near ±1e4 (exp overflows without the max shift)", {}, {}),
        "excluded-tokens": ("−inf logits (excluded tokens), at least one finite per row", {}, {}),
    },
    FUSED: {
        "general": ("hidden [N, H] or [B, T, H] with N ≤ 10, H ≤ 24, V ≤ 96, logits up to about ±40 from flat to "
                    "sharply peaked softmaxes, τ = 1 or drawn in [0.25, 4], cotangents in [−1, 1]",
                    dict(lead_shapes=((1,), (7,), (2, 5))), {}),
        "large-logits": ("as general with logits up to about ±400: exp overflows (float32 already at 89) without the "
                         "max shift", dict(lead_shapes=((1,), (7,), (2, 5)), max_logit=400.0), {}),
    },
}
GENERATED_PROFILES["tir-otb"] = GENERATED_PROFILES["loo-otb"] = GENERATED_PROFILES["tir-loo-otb"] = \
    GENERATED_PROFILES["otb"]


# one shape for conventions that compile per shape (jax): the generated fused cases then compile once per dtype
_FIXED_LM_HEAD_SHAPE = dict(lead_shapes=((2, 5),), min_hidden_size=8, max_hidden_size=8, min_vocab_size=23,
                            max_vocab_size=23)


def _fused_generated(profile: str, dtypes: tuple[str, ...], fixed_shapes: bool) -> st.SearchStrategy[Case]:
    options = dict(GENERATED_PROFILES[FUSED][profile][1])
    if fixed_shapes:
        options.update(_FIXED_LM_HEAD_SHAPE)

    def build(inputs: otb_st.LMHeadCase, dtype: str) -> Case:
        grid = [np.divide(np.round(np.multiply(g, 64.0)), 64.0) for g in (inputs.log_probs_cotangent,
                                                                          inputs.entropy_cotangent)]
        return Case(FUSED, "generated", "float64", hidden=inputs.hidden, weight=inputs.weight,
                    token_ids=inputs.token_ids, temperature=inputs.temperature, log_probs_cotangent=grid[0],
                    entropy_cotangent=grid[1]).with_dtype(dtype)

    return st.builds(build, otb_st.lm_head_inputs(**options), st.sampled_from(dtypes))


def generated_cases(kind: str, *, profile: str = "general", dtypes: tuple[str, ...] = ("float32", "float64"),
                    equal_groups: bool = False, max_length: int = 12,
                    fixed_shapes: bool = False) -> st.SearchStrategy[Case]:
    """Hypothesis strategy of cases of ``kind`` from one of :data:`GENERATED_PROFILES`.

    OTB kinds — ``"general"``: shuffled non-contiguous groups with string (and other) ids, singletons, unequal lengths
    with unique longest members, holes, left padding, all-masked rows, IS weights or not, both zero-tail settings,
    ε ∈ {1e-8, 1e-3}, masked positions holding what a trainer leaves there (the padding token's log π ≤ 0 and Σπ², or
    zeros; :func:`robustness_cases` has wilder values); ``"zero-tail"`` and ``"holes-empty-rows-weights"`` concentrate
    on those features. (ε = 0, where verl divides 0/0, is in the golden cases, marked with a note.) Σπ² — ``"general"``,
    ``"extreme"`` (±1e4), ``"excluded-tokens"`` (−inf). Fused token statistics — ``"general"`` and
    ``"large-logits"`` (:func:`otb_spec.strategies.lm_head_inputs`; ``fixed_shapes``: one shape, hidden [2, 5, 8]
    and V = 23, for conventions that compile once per shape). Cases come in each dtype of ``dtypes``.
    ``equal_groups`` restricts to contiguous groups of one size (conventions with a [G, N, T] layout).
    """
    if kind not in KINDS:
        raise ValueError(f"kind: expected one of {', '.join(KINDS)}, got {kind!r}")
    if profile not in GENERATED_PROFILES[kind]:
        raise ValueError(f"profile: expected one of {', '.join(GENERATED_PROFILES[kind])}, got {profile!r}")
    if isinstance(dtypes, str) or not isinstance(dtypes, (tuple, list)) or not dtypes or any(
            dtype not in _DTYPES for dtype in dtypes):
        raise ValueError(f"dtypes: expected a non-empty tuple of {', '.join(_DTYPES)}, got {dtypes!r}")
    if kind == FUSED:
        return _fused_generated(profile, dtypes, fixed_shapes)
    if kind == "sum-pi-squared":
        logits = {"general": otb_st.logits((3,), min_vocab_size=1, max_vocab_size=64),
                  "extreme": otb_st.logits((2, 3), min_vocab_size=2, max_vocab_size=64, extreme=True),
                  "excluded-tokens": otb_st.logits((4,), min_vocab_size=2, max_vocab_size=64,
                                                   allow_neg_inf=True)}[profile]
        return st.builds(lambda values, dtype: Case(kind, "generated", "float64", logits=values).with_dtype(dtype),
                         logits, st.sampled_from(dtypes))
    _, options, forced = GENERATED_PROFILES[kind][profile]
    if equal_groups:
        options = {key: value for key, value in options.items() if key not in ("singleton_groups", "max_group_size")}
        low = 2 if profile == "zero-tail" else 1
        batches = st.integers(low, 4).flatmap(lambda n: otb_st.rollout_batches(
            min_group_size=n, max_group_size=n, shuffle=False, max_length=max_length, fill_masked="trainer",
            id_kind="trainer", **options))
    else:
        batches = otb_st.rollout_batches(max_length=max_length, fill_masked="trainer", id_kind="trainer", **options)

    def build(batch: Any, dtype: str, handle_zero_tail: bool, epsilon: float) -> Case:
        ids = np.asarray(batch.group_ids)
        if ids.dtype.kind in "US":
            ids = ids.astype(object)
        return Case(kind, "generated", "float64", np.asarray(batch.rewards, dtype=np.float64),
                    np.asarray(batch.response_mask, dtype=np.float64), ids,
                    np.asarray(batch.log_probs, dtype=np.float64), np.asarray(batch.sum_pi_squared, dtype=np.float64),
                    None if batch.is_weights is None else np.asarray(batch.is_weights, dtype=np.float64),
                    handle_zero_tail=handle_zero_tail, epsilon=epsilon).with_dtype(dtype)

    zero_tail = st.just(forced["handle_zero_tail"]) if "handle_zero_tail" in forced else st.booleans()
    return st.builds(build, batches, st.sampled_from(dtypes), zero_tail, st.sampled_from([1e-8, 1e-3]))


# the smallest prime above 2¹⁴ (as the OTB kinds' T): a fused kernel's token chunks of any width up to 2¹⁴ take two or
# more, the last partial. A kernel that sizes its chunks by a budget of logits takes budget/V tokens a chunk, thousands
# at this case's V = 127: with 4099 tokens, 8192-token chunks took the case in one and a ∂W assigned per chunk hid.
_PRIME_TOKENS = 16411


@functools.lru_cache(maxsize=1)
def _fused_special() -> tuple[Case, ...]:
    flat = _lm_head_case("nearly flat softmax, V = 4096 (logits within about ±0.003)", 32, (8,), 32, 4096,
                         logit_scale=1e-3)
    return (
        _lm_head_case("large |z|: logits up to about ±3000", 30, (8,), 32, 512, logit_scale=1000.0).with_dtype(
            "float32"),
        _peaked("peaked softmax, V = 4096: tokens at the peak and 80 below it", 31, 8, 32, 4096, 80.0).with_dtype(
            "float32"),
        flat.with_dtype("float32"),
        _lm_head_case("τ = 0.25, V = 2048", 33, (8,), 32, 2048, logit_scale=4.0, temperature=0.25).with_dtype(
            "float32"),
        _lm_head_case("τ = 4, V = 2048", 34, (8,), 32, 2048, logit_scale=4.0, temperature=4.0).with_dtype("float32"),
        _lm_head_case("vocabulary not a multiple of any chunk (V = 4099, a prime), N = 520 tokens", 35, (520,), 16,
                      4099, logit_scale=3.0).with_dtype("float32"),
        _lm_head_case("3-D hidden states [B, T, H] = [4, 130, 16], V = 1031", 36, (4, 130), 16, 1031,
                      logit_scale=3.0).with_dtype("float32"),
        _lm_head_case("a large prime vocabulary, V = 65537: vocabulary blocks of any width below it take two or more",
                      39, (8,), 32, 65537, logit_scale=3.0).with_dtype("float32"),
        _lm_head_case(f"a prime number of tokens, N = {_PRIME_TOKENS} (H = 16, V = 127): token chunks of any width up "
                      "to 2^14 take two or more", 42, (_PRIME_TOKENS,), 16, 127, logit_scale=3.0).with_dtype("float32"),
        _lm_head_case(f"float64, N = {_PRIME_TOKENS} tokens (H = 16, V = 127): a token lost or counted twice at a "
                      "chunk's edge of ∂W shows", 42, (_PRIME_TOKENS,), 16, 127, logit_scale=3.0).with_dtype("float64"),
        _far_below_zero("every logit far below zero (about −200)", 40, 8, 32, 1024, 200.0).with_dtype("float32"),
        _peak_in_last_column("V = 65537, each token's largest logit (8) in the last column: the running maximum grows "
                             "in the last block", 43, 8, 32, 65537, 8.0).with_dtype("float32"),
        _peak_in_last_column("float64, V = 65537, each token's largest logit (8) in the last column: a column lost or "
                             "counted twice at a vocabulary block's edge shows", 43, 8, 32, 65537, 8.0).with_dtype(
            "float64"),
        _lm_head_case("bfloat16 hidden states and LM head, V = 32768, nearly flat (logits ~N(0, ½²))", 37, (16,), 64,
                      32768, logit_scale=0.5).with_dtype("bfloat16"),
        _lm_head_case("float16 hidden states and LM head, V = 8191 (a prime)", 38, (16,), 64, 8191,
                      logit_scale=4.0).with_dtype("float16"),
    )


# the smallest prime above the LM head of Qwen2.5 (up to 3B) and Qwen3, 151936 = 2⁷·1187 rows: above 2¹⁷, so chunks of
# any width up to 2¹⁷ take two or more (65536: three; 131072: two, the last 20865 wide), the last one partial
_PRIME_VOCABULARY = 151937


def _prime_vocabulary_logits(scale: float = 3.0, seed: int = 16) -> np.ndarray:
    """[4, 151937] logits ~N(0, ``scale``²), each row's largest logit swapped into its last column.

    An online pass over vocabulary chunks keeps (m, S₁ = Σe^{z−m}, S₂ = Σe^{2(z−m)}) and, when the running maximum
    grows from m to m', must rescale S₁ by e^{m−m'} and S₂ by e^{2(m−m')}. Where the row's maximum sits in the last
    column, the maximum grows in the last chunk whatever the chunk width, so a pass whose chunks are as wide as the
    largest power of two below V still rescales once: S₂ rescaled by e^{m−m'} alone is then e^{m'−m} times too large
    in its earlier part — 20 to 33 times the bound for chunks 1000 to 131072 wide, where 65536-wide chunks took the
    V = 65536 case in one and passed it.

    With ``scale`` = 1 (flat: every term of the sums comparable) in float64, whose bound is about (V + 2)·2⁻⁵² where
    float32's is (V + 2)·2⁻²³, a chunk that starts one column late or ends one column past its edge moves Σπ² by about
    one term in V, 10⁻⁵: far inside float32's bound, about 10⁵ times float64's.
    """
    logits = portable.PortableRandom(seed).normal((4, _PRIME_VOCABULARY), scale=scale)
    rows, largest = np.arange(logits.shape[0]), np.argmax(logits, axis=-1)
    logits[rows, largest], logits[rows, -1] = logits[rows, -1], logits[rows, largest]
    return logits


def special_cases(kind: str, *, equal_groups: bool = False) -> list[Case]:
    """Cases where low precision shows: long sequences (T = 4096) in float32 and as bfloat16 inputs (which must be
    accumulated in float32), and for Σπ² large vocabularies (V = 65536, and a prime V = 151937 whose rows peak in their
    last column: :func:`_prime_vocabulary_logits`), extreme logits in float32, and bfloat16 logits — spread (N(0, 4²))
    and nearly flat (N(0, ½²), where summing 32768 comparable terms in bfloat16 would stall), and flat float32 logits
    (N(0, 1), V = 65536: a sum over the largest probabilities only misses mass there), and flat float64 logits at V =
    151937 (a column lost or counted twice at a chunk's edge, inside float32's bound, shows). Fused token statistics
    (float32 unless said): logits up to ±3000, peaked and nearly flat softmaxes over V = 4096, τ = 0.25 and τ = 4, a
    prime vocabulary (4099) over 520 tokens (more than one of verl's 512-token chunks), 3-D hidden states [4, 130, 16],
    a large prime vocabulary (65537: a kernel's vocabulary blocks, whatever their width below it, take two or more, so a
    block-local maximum never rescaled shows in float32), a prime number of tokens (N = 16411: a kernel's token chunks,
    whatever their width up to 2¹⁴, take two or more, so a backward pass that assigns ∂W = Σₙ ∂zₙᵀhₙ/τ chunk by chunk
    instead of adding the chunks shows; again in float64, where one token lost from ∂W at a chunk's edge shows), every
    logit far below zero (about −200: a running maximum started at 0 instead of −∞ underflows), the same large prime
    vocabulary with each token's largest logit in the last column (:func:`_peak_in_last_column`: the running maximum
    grows in the last block, whatever its width; again in float64, where a column lost at a block's edge shows), and
    bfloat16 (V = 32768, nearly flat: summing 32768 comparable terms in bfloat16 would stall) and float16 (V = 8191, a
    prime) hidden states and heads. OTB kinds also get a prime number of positions (:func:`_prime_positions_case`: T =
    16411, so that a kernel's position blocks, whatever their width up to 2¹⁴, take two or more, and a carry lost
    between them shows in the returns or the energy), a batch of a trainer's size (:func:`_trainer_batch_case`: over a
    hundred rows, groups of up to 16 scattered, importance weights above 5) and a prime number of rows
    (:func:`_prime_rows_case`: B = 4099, so that a kernel's row blocks, whatever their width up to 4096, take two or
    more, and group sums stored per block instead of added show), large groups (:func:`_large_groups_case`: 257, 129,
    65, 33 and 17 members, so that members held in a static block of any width up to 256 are left out, with ids only
    int64 tells apart), and, except for contiguous equal groups, many groups as bfloat16 inputs
    (:func:`_many_groups_case`: 2731 groups, more than bfloat16 holds integers exactly, so group codes handled in the
    inputs' dtype merge groups)."""
    if kind == FUSED:
        return list(_fused_special())       # built once per process: their references and bounds are kept
    if kind == "sum-pi-squared":
        rng = portable.PortableRandom(11)
        large = rng.normal((8, 65536), scale=3.0)
        extreme = rng.normal((8, 4096), scale=5.0) + rng.choice([-1e4, 1e4], (8, 1))
        return [Case(kind, "large vocabulary (V = 65536)", "float64", logits=large).with_dtype("float32"),
                Case(kind, f"a large prime vocabulary, V = {_PRIME_VOCABULARY}, peaking in the last column: chunks of "
                     "any width up to 2^17 take two or more", "float64",
                     logits=_prime_vocabulary_logits()).with_dtype("float32"),
                Case(kind, "logits near ±1e4", "float64", logits=extreme).with_dtype("float32"),
                Case(kind, "bfloat16 logits, V = 32768", "float64",
                     logits=rng.normal((8, 32768), scale=4.0)).with_dtype("bfloat16"),
                Case(kind, "nearly flat bfloat16 logits, V = 32768", "float64",
                     logits=rng.normal((8, 32768), scale=0.5)).with_dtype("bfloat16"),
                Case(kind, "flat float32 logits (N(0, 1)), V = 65536: no few tokens hold the mass", "float64",
                     logits=rng.normal((8, 65536), scale=1.0)).with_dtype("float32"),
                Case(kind, f"flat float64 logits (N(0, 1)), V = {_PRIME_VOCABULARY}, each row's largest in the last "
                     "column: a column lost or counted twice at a chunk's edge shows", "float64",
                     logits=_prime_vocabulary_logits(scale=1.0, seed=17)).with_dtype("float64")]
    rng = portable.PortableRandom(12)
    rows, positions = 16, 4096
    lengths = rng.integers(positions // 2, positions + 1, rows)
    mask = (np.arange(positions)[None, :] < lengths[:, None]).astype(np.float64)
    if kind in VALID_TOKEN_KINDS:
        mask[::3, 100:300] = 0.0                                                     # tool output
    log_pi = portable.log(rng.uniform(0.3, 0.999, (rows, positions)))
    pi = portable.exp(log_pi)
    spp = _consistent_sum_pi_squared(pi, rng.uniform(0.05, 1.0, pi.shape))
    rewards = np.zeros((rows, positions))
    rewards[np.arange(rows), lengths - 1] = rng.integers(0, 2, rows)
    ids = np.array([f"long-{i // 8}" for i in range(rows)], dtype=object)
    if not equal_groups:
        ids = ids[rng.permutation(rows)]
    layout = ", contiguous groups" if equal_groups else ""
    base = Case(kind, f"long sequences (T = 4096){layout}", "float64", rewards, mask, ids, log_pi, spp)
    return [base.with_dtype("float32"),
            replace(base, name=f"long sequences as bfloat16 inputs{layout}").with_dtype("bfloat16"),
            _energy_timing_case(kind, equal_groups).with_dtype("bfloat16"),
            _prime_positions_case(kind, equal_groups).with_dtype("float32"),
            _trainer_batch_case(kind, equal_groups).with_dtype("float32"),
            _prime_rows_case(kind, equal_groups).with_dtype("float32"),
            _large_groups_case(kind, equal_groups).with_dtype("float32"),
            *([] if equal_groups else [_many_groups_case(kind).with_dtype("bfloat16")])]


def _terminal_reward_rows(rng: portable.PortableRandom, kind: str, rows: int, positions: int,
                          hole: tuple[slice, slice]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(rewards, mask, log π, Σπ²) [rows, positions]: right-padded lengths 1 … T, tool output at ``hole`` (rows,
    positions) for the valid-token kinds, π ~ U(0.05, 0.999) with a consistent Σπ², a 0/1 reward at the last token."""
    lengths = rng.integers(1, positions + 1, rows)
    mask = (np.arange(positions)[None, :] < lengths[:, None]).astype(np.float64)
    if kind in VALID_TOKEN_KINDS:
        mask[hole] = 0.0
    log_pi = portable.log(rng.uniform(0.05, 0.999, (rows, positions)))
    spp = _consistent_sum_pi_squared(portable.exp(log_pi), rng.uniform(0.05, 1.0, (rows, positions)))
    rewards = np.zeros((rows, positions))
    rewards[np.arange(rows), lengths - 1] = rng.integers(0, 2, rows)
    return rewards, mask, log_pi, spp


def _prompt_ids(sizes: np.ndarray) -> np.ndarray:
    """Group ids ``prompt-g``, ``sizes[g]`` rows each, in order."""
    return np.array([f"prompt-{group}" for group, size in enumerate(sizes) for _ in range(int(size))], dtype=object)


def _trainer_batch_case(kind: str, equal_groups: bool) -> Case:
    """A batch of a trainer's size: 16 prompts of 4 to 16 samples (8 each with ``equal_groups``: 128 rows), rows
    shuffled as verl's balance_batch leaves them, right-padded lengths 1 … 256 (tool-output holes for the valid-token
    kinds), terminal 0/1 rewards, and importance weights ρ = e^{N(0, 0.6²)} — up to about 10, above 5 at some
    60 valid tokens, as untruncated rollout corrections give. Every smaller case fits in 24 rows: a port that
    computes groups per micro-batch (slices of 32 rows, a group cut in two) or truncates ρ again passes them."""
    rng = portable.PortableRandom(15)
    sizes = np.full(16, 8) if equal_groups else rng.integers(4, 17, 16)
    rows, positions = int(sizes.sum()), 256
    tool_output = (slice(None, None, 4), slice(20, 40))
    rewards, mask, log_pi, spp = _terminal_reward_rows(rng, kind, rows, positions, tool_output)
    is_weights = portable.exp(rng.normal((rows, positions), scale=0.6))
    ids = _prompt_ids(sizes)
    if not equal_groups:
        ids = ids[rng.permutation(rows)]
    layout = ", contiguous groups" if equal_groups else ", rows shuffled"
    return Case(kind, f"a trainer's batch: {rows} rows in 16 groups, ρ up to ~10{layout}", "float64", rewards, mask,
                ids, log_pi, spp, is_weights=is_weights)


def _energy_timing_case(kind: str, equal_groups: bool) -> Case:
    """T = 4096, groups of 4, full rows: half the members spend their first 512 tokens far from the sampled token
    (π ≈ 0.01 with another token near-certain: w ≈ 1.9) and the rest near a coin flip (π ≈ ½: w ≈ ½), the other half
    the other way round (coin flips first, the 512 high-energy tokens last); dense rewards on every token, and a bonus
    at the end for the first half. A running total kept in bfloat16 stops growing once its increments fall below half
    its spacing (G and W stall near 256 increments), which leaves returns wrong by hundreds: a port whose returns
    stall is rejected here; per-token work in bfloat16 — every w well away from 0 here — and float32 sums pass. A
    stalled W alone moves the baselines (W-weighted means of the members' returns) by less than the bfloat16 bound
    admits: a port keeping only W as a bfloat16 running total passed this case by default (0.006× its allowed error,
    0.28× under ``working_dtype="float32"``) — as verl's own bfloat16 arithmetic, less accurate still, must — and
    failed ``working_dtype="float32"`` on the long bfloat16 case only (2.8×; a review's probe, 2026-11-27)."""
    rng = portable.PortableRandom(14)
    rows, positions, burst = 8, 4096, 512
    high = np.zeros((rows, positions), dtype=bool)
    high[0::2, :burst] = True                             # even rows: high energy first
    high[1::2, -burst:] = True                            # odd rows: high energy last
    pi = np.where(high, rng.uniform(0.005, 0.015, (rows, positions)), rng.uniform(0.45, 0.55, (rows, positions)))
    spread = np.where(high, rng.uniform(0.95, 1.0, (rows, positions)), rng.uniform(0.9, 1.0, (rows, positions)))
    log_pi = portable.log(pi)
    spp = _consistent_sum_pi_squared(portable.exp(log_pi), spread)
    rewards = rng.uniform(0.0, 0.5, (rows, positions))    # dense rewards: returns run up to ~1000
    rewards[0::2, -1] += 1.0
    ids = np.array([f"timing-{i // 4}" for i in range(rows)], dtype=object)
    if not equal_groups:
        ids = ids[rng.permutation(rows)]
    layout = ", contiguous groups" if equal_groups else ""
    return Case(kind, f"dense rewards, energy early or late, T = 4096, as bfloat16 inputs{layout}", "float64", rewards,
                np.ones((rows, positions)), ids, log_pi, spp)


# the smallest prime above 2¹⁴: blocks of any width b ≤ 2¹⁴ split the positions into ⌈T/b⌉ ≥ 2 blocks, and since no
# b > 1 divides a prime the last is partial (2¹⁴: two, the last 27 wide; 4096: five, the last 27 wide)
_PRIME_POSITIONS = 16411


def _prime_positions_case(kind: str, equal_groups: bool) -> Case:
    """T = 16411 positions, one group of 4: a GPU port scanning BLOCK_T positions at a time with a running carry.

    Gₜ = Σ_{k≥t} mₖrₖ and Wₜ = Σ_{j≤t} mⱼwⱼ taken per block of b positions must add the other blocks' totals (the
    carry); a port that loses it has Gₜ = Σ_{k≥t, k in t's block} mₖrₖ and Wₜ restarting at every multiple of b, which
    no case of T ≤ b shows (the long special cases have T = 4096, one block of a 4096-wide kernel). Here b ≤ 2¹⁴ < T
    gives two blocks or more, so: each row has rewards r ~ U(−1, 1) at 12 valid positions, one in its first 64 valid
    tokens and one at its last valid token, past 2¹⁴ in three of the four rows (lengths T, T, T − 14, 11678,
    right-padded; holes at 100 … 299 in every other row for the valid-token kinds) — a lost return carry drops the
    rewards of the later blocks from every earlier position; and half the members spend their first 4096 positions
    far from the sampled token (π ≈ 0.01: w from 1 to 2) and the others their last 4096, the rest π ~ U(0.3, 0.999)
    (w below 1) — so a W restarted at a block boundary changes the ratio of the members' weights, and with it the
    baseline. Three members reach past 2¹⁴, because a leave-one-out baseline with one other member,
    Gⱼ·Wⱼ/(Wⱼ + ε) ≈ Gⱼ, does not depend on the energy. In every OTB kind, for blocks 512 to 2¹⁴ wide, a lost return
    carry is 72 to 276 times the bound and a lost energy carry 24 to 80 times; correct float32 scans over the 16411
    positions stay within 2·10⁻⁴ of it (the bound's a·(T + 3)·Σ|·| terms are worst cases)."""
    rng = portable.PortableRandom(17)
    positions = _PRIME_POSITIONS
    lengths = np.array([positions, positions, positions - 14, rng.integers(positions // 2, positions - 4096, 1)[0]])
    rows = len(lengths)
    mask = (np.arange(positions)[None, :] < lengths[:, None]).astype(np.float64)
    if kind in VALID_TOKEN_KINDS:
        mask[0::2, 100:300] = 0.0                                                    # tool output
    burst = 4096
    high = np.zeros((rows, positions), dtype=bool)
    high[0::2, :burst] = True                             # even rows: high energy first
    high[1::2, -burst:] = True                            # odd rows: high energy last
    pi = np.where(high, rng.uniform(0.005, 0.015, (rows, positions)), rng.uniform(0.3, 0.999, (rows, positions)))
    log_pi = portable.log(pi)
    spp = _consistent_sum_pi_squared(portable.exp(log_pi), rng.uniform(0.05, 1.0, (rows, positions)))
    rewards = np.zeros((rows, positions))
    for row in range(rows):
        valid = np.flatnonzero(mask[row])
        where = np.concatenate([valid[rng.integers(0, 64, 1)], valid[rng.integers(0, len(valid), 10)], valid[-1:]])
        rewards[row, where] = rng.uniform(-1.0, 1.0, len(where))
    ids = np.array(["blocked"] * rows, dtype=object)
    layout = ", contiguous groups"
    if not equal_groups:
        order = rng.permutation(rows)
        rewards, mask, log_pi, spp = rewards[order], mask[order], log_pi[order], spp[order]
        layout = ", rows shuffled"
    return Case(kind, f"a prime number of positions, T = {positions}: blocks of any width up to 2^14 take two or "
                f"more{layout}", "float64", rewards, mask, ids, log_pi, spp)


# the smallest prime above 2¹²: a kernel's row blocks of any width up to 4096 split the batch into two or more, the last
# partial (contiguous groups of 8, for the grouped convention: 4104 rows, the last block of 4096 holding 8)
_PRIME_ROWS = 4099


def _prime_rows_case(kind: str, equal_groups: bool) -> Case:
    """B = 4099 rows of T = 8 positions in groups of 1 to 16 members, rows shuffled (513 contiguous groups of 8 with
    ``equal_groups``): a GPU port whose grid runs over blocks of rows must add every block's group sums ΣᵢGᵢWᵢmᵢ and
    ΣᵢWᵢmᵢ into the group's totals. One that stores them (each block's sums assigned, as a plain store where an atomic
    add belongs) keeps, for each group, the rows of the last block that holds any — the other cases have at most 175
    rows, and blocks 256 to 4096 rows wide passed them. Lengths 1 … 8, right-padded, a hole at positions 2–3 in every
    fifth row for the valid-token kinds, terminal 0/1 rewards, π ~ U(0.05, 0.999)."""
    rng = portable.PortableRandom(18)
    positions = 8
    if equal_groups:
        sizes = np.full(-(-_PRIME_ROWS // 8), 8)
    else:
        sizes = rng.integers(1, 17, _PRIME_ROWS)
        sizes = sizes[:int(np.searchsorted(np.cumsum(sizes), _PRIME_ROWS)) + 1]
        sizes[-1] -= int(sizes.sum()) - _PRIME_ROWS
    rows = int(sizes.sum())
    tool_output = (slice(None, None, 5), slice(2, 4))
    rewards, mask, log_pi, spp = _terminal_reward_rows(rng, kind, rows, positions, tool_output)
    ids = _prompt_ids(sizes)
    layout = ", contiguous groups of 8" if equal_groups else ", rows shuffled"
    if not equal_groups:
        ids = ids[rng.permutation(rows)]
    return Case(kind, f"a prime number of rows, B = {_PRIME_ROWS} (T = 8, {len(sizes)} groups): row blocks of any "
                f"width up to 4096 take two or more{layout}", "float64", rewards, mask, ids, log_pi, spp)


# group sizes above every power of two up to 2⁸ (a GRPO group of 64 or 256 samples is common): a member block of any
# width up to 256 leaves members out or takes two or more blocks
_LARGE_GROUPS = (257, 129, 65, 33, 17, 1, 2, 3)
# ids told apart only as int64: 2⁵³ and 2⁵³ + 1, 2⁶² and 2⁶² + 1 are one float64 each; hash(−1) == hash(−2) in CPython
_LARGE_GROUP_IDS = (2**53, 2**53 + 1, -1, -2, 2**62 + 1, 2**62, 7, 0)


def _large_groups_case(kind: str, equal_groups: bool) -> Case:
    """Groups of 257, 129, 65, 33 and 17 members beside groups of 1, 2 and 3 (B = 507, T = 16), rows shuffled, with
    integer ids that only int64 tells apart — 2⁵³ and 2⁵³ + 1 (the two largest groups) and 2⁶² and 2⁶² + 1 are one
    float64 each, −1 and −2 one CPython hash — (two contiguous groups of 257 with ``equal_groups``): a port whose
    members are held in a static block (16 members, say, as a kernel sized for the usual group) leaves the later
    members out of the group sums, or loses the sums between two such blocks; ids narrowed through float64 or coded by
    ``hash`` merge groups. Every other case has at most 16 members a group. Lengths 1 … 16, right-padded, a hole at
    positions 3–5 in every seventh row for the valid-token kinds, terminal 0/1 rewards, π ~ U(0.05, 0.999)."""
    rng = portable.PortableRandom(20)
    positions = 16
    sizes = np.array((257, 257) if equal_groups else _LARGE_GROUPS)
    rows = int(sizes.sum())
    tool_output = (slice(None, None, 7), slice(3, 6))
    rewards, mask, log_pi, spp = _terminal_reward_rows(rng, kind, rows, positions, tool_output)
    if equal_groups:
        return Case(kind, "two contiguous groups of 257 members (T = 16)", "float64", rewards, mask, _prompt_ids(sizes),
                    log_pi, spp)
    ids = np.repeat(np.array(_LARGE_GROUP_IDS, dtype=np.int64), sizes)[rng.permutation(rows)]
    return Case(kind, "groups of up to 257 members (B = 507, T = 16), rows shuffled, ids only int64 tells apart "
                "(2^53 and 2^53 + 1; -1 and -2)", "float64", rewards, mask, ids, log_pi, spp)


# more groups than half precision holds integers exactly (bfloat16: 256; float16: 2048)
_MANY_GROUPS = 2731


def _many_groups_case(kind: str) -> Case:
    """4099 rows of T = 8 positions in 2731 groups of 1 or 2 members, rows shuffled, delivered as bfloat16: a port that
    handles the group codes 0 … G − 1 in the inputs' dtype (a one-hot matrix built by comparing codes as bfloat16,
    say) merges neighbouring groups above 256 — every other case delivered in half precision has at most 16 groups.
    The OTB kinds get no float16 cases: there verl's default ε = 1e-8 rounds to 0, and verl's baseline is 0/0 = NaN
    wherever no member is valid (docs/verl-differences.md #3); the groups exceed float16's 2048 too, for a caller who
    converts the case. (The ``grouped`` convention takes no ids: not built there.) Lengths 1 … 8, right-padded, a hole
    at positions 2–3 in every fifth row for the valid-token kinds, terminal 0/1 rewards, π ~ U(0.05, 0.999)."""
    rng = portable.PortableRandom(19)
    positions = 8
    sizes = np.ones(_MANY_GROUPS, dtype=np.int64)
    sizes[rng.permutation(_MANY_GROUPS)[:_PRIME_ROWS - _MANY_GROUPS]] = 2
    rows = int(sizes.sum())
    tool_output = (slice(None, None, 5), slice(2, 4))
    rewards, mask, log_pi, spp = _terminal_reward_rows(rng, kind, rows, positions, tool_output)
    ids = _prompt_ids(sizes)[rng.permutation(rows)]
    return Case(kind, f"many groups, G = {_MANY_GROUPS} of 1 or 2 members (B = {rows}, T = 8): beyond half "
                "precision's exact integers, rows shuffled", "float64", rewards, mask, ids, log_pi, spp)


def robustness_cases(kind: str) -> list[Case]:
    """Inputs no trainer produces, on which the verifier reports a difference as a warning, never a failure: masked
    positions holding log π up to +50 (π = e⁵⁰), Σπ² outside [0, 1], ρ up to 50 and rewards up to ±99 (float32 and
    float64; a correct implementation may overflow on them, e.g. by forming (1 − π)² before masking), and group ids
    of mixed types that cannot be ordered (a port using ``np.unique`` on the ids fails there). None for
    ``"sum-pi-squared"`` (logits have neither masks nor ids). Fused token statistics: a one-token vocabulary (V = 1:
    π = 1, log π = 0, H = 0, Σπ² = 1) and logits near ±1e4 in float32 — no language model has either."""
    if kind not in KINDS:
        raise ValueError(f"kind: expected one of {', '.join(KINDS)}, got {kind!r}")
    if kind == FUSED:
        single = _lm_head_case("a one-token vocabulary (V = 1)", 40, (5,), 4, 1, logit_scale=3.0,
                               note="robustness only: a vocabulary of one token")
        huge = _lm_head_case("logits near ±1e4", 41, (6,), 16, 64, logit_scale=5000.0,
                             note="robustness only: no language model produces logits of this size")
        return [single.with_dtype("float64"), single.with_dtype("float32"), huge.with_dtype("float32")]
    if kind == "sum-pi-squared":
        return []
    base = next(case for case in golden_cases(kind, ("float64",)) if case.name.startswith("tool-output holes"))
    rng = portable.PortableRandom(13)
    masked = base.response_mask == 0
    shape = base.rewards.shape
    junk = replace(base, name="values no trainer produces at masked positions (log π ≤ 50, Σπ² ∈ [−5, 5], ρ ≤ 50)",
                   rewards=np.where(masked, rng.uniform(-99.0, 99.0, shape), base.rewards),
                   log_probs=np.where(masked, rng.uniform(-50.0, 50.0, shape), base.log_probs),
                   sum_pi_squared=np.where(masked, rng.uniform(-5.0, 5.0, shape), base.sum_pi_squared),
                   is_weights=np.where(masked, rng.uniform(0.0, 50.0, shape), rng.uniform(0.5, 1.5, shape)),
                   note="robustness only: no trainer leaves these values at masked positions")
    mixed = replace(base, name="ids of mixed types that cannot be ordered (an int, a str and a tuple)",
                    group_ids=np.array([3, 3, ("prompt", 3), "3"], dtype=object),
                    note="robustness only: trainers use ids of one type (verl: uid strings); the reference accepts "
                         "any hashable ids, as verl's dict of ids does")
    return [junk.with_dtype(dtype) for dtype in ("float64", "float32")] + [mixed.with_dtype("float32")]
