"""Conformance cases: inputs, options, the reference's expected outputs, and the tolerance for an implementation.

A :class:`Case` is framework-neutral (NumPy arrays on the host). Half-precision cases hold float32 arrays whose values
are exactly representable in bfloat16 (the implementation receives bfloat16 tensors; the reference reads the same
values). Kinds:

* ``"otb"`` — single-turn OTB (verl ``compute_optimal_token_baseline_advantage``): outputs advantages, returns;
* ``"tir-otb"`` — multi-turn OTB (verl ``compute_multi_turn_optimal_token_baseline_advantage``): same outputs;
* ``"loo-otb"`` — leave-one-out OTB (position alignment): same outputs;
* ``"sum-pi-squared"`` — Σπ² from logits: output sum_pi_squared.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
from hypothesis import strategies as st

from otb_spec import _portable as portable
from otb_spec import strategies as otb_st
from otb_spec.otb import leave_one_out_token_baseline, multi_turn_optimal_token_baseline, optimal_token_baseline
from otb_spec.proxy import sum_pi_squared
from otb_spec.tolerances import (Tolerance, logit_spread, logsumexp_tolerance, otb_comparison_tolerance,
                                 output_rounding, sum_pi_squared_tolerance)

__all__ = ["KINDS", "GENERATED_PROFILES", "Case", "golden_cases", "generated_cases", "special_cases",
           "robustness_cases", "compute_dtype_for"]

KINDS = ("otb", "tir-otb", "loo-otb", "sum-pi-squared")
_OTB_KINDS = ("otb", "tir-otb", "loo-otb")


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


_ARRAY_FIELDS = ("rewards", "response_mask", "group_ids", "log_probs", "sum_pi_squared", "is_weights", "logits")


@dataclass(frozen=True)
class Case:
    """One conformance case.

    Attributes:
      kind: one of :data:`KINDS`.
      name: short description (for reports).
      dtype: the dtype the implementation receives: ``"float64"``, ``"float32"``, ``"bfloat16"`` or ``"float16"``.
      rewards, response_mask, log_probs, sum_pi_squared, is_weights: [B, T] arrays (OTB kinds; is_weights optional).
      group_ids: [B] ids (object array of strings, ints or other hashables).
      handle_zero_tail, epsilon: OTB options.
      logits: [..., V] (Σπ² kind).
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
                       logits=convert(self.logits), response_mask=None if self.response_mask is None else
                       np.asarray(self.response_mask, dtype=np.float32 if dtype != "float64" else np.float64),
                       _cache={})

    @property
    def output_names(self) -> tuple[str, ...]:
        return ("sum_pi_squared",) if self.kind == "sum-pi-squared" else ("advantages", "returns")

    def expected(self) -> dict[str, np.ndarray]:
        """The reference's outputs (float64)."""
        if "expected" not in self._cache:
            if self.kind == "sum-pi-squared":
                self._cache["expected"] = {"sum_pi_squared": sum_pi_squared(self.logits)}
            else:
                function = {"otb": optimal_token_baseline, "tir-otb": multi_turn_optimal_token_baseline,
                            "loo-otb": leave_one_out_token_baseline}[self.kind]
                options = {"epsilon": self.epsilon}
                if self.kind != "loo-otb":
                    options["handle_zero_tail"] = self.handle_zero_tail
                result = function(self.rewards, self.response_mask, self.group_ids, self.log_probs,
                                  self.sum_pi_squared, is_weights=self.is_weights, **options)
                self._cache["expected"] = {"advantages": result.advantages, "returns": result.returns}
        return self._cache["expected"]

    def tolerances(self, output_dtype: str | None = None, compute_dtype: str | None = None) -> dict[str, Tolerance]:
        """Per-output tolerance for |implementation − reference|: the bound of a correct implementation given the
        case's dtype and accumulating in ``compute_dtype`` (default :func:`compute_dtype_for` the case's dtype) + the
        reference's own float64 bound + the rounding of the output to ``output_dtype`` (default the case's dtype).
        Per row for Σπ² (each row's largest logit), per element for OTB (``otb_spec.tolerances``)."""
        compute = compute_dtype or compute_dtype_for(self.dtype)
        out = output_dtype or self.dtype
        key = ("tolerances", out, compute)
        if key not in self._cache:
            if self.kind == "sum-pi-squared":
                vocab, spread = self.logits.shape[-1], logit_spread(self.logits)
                tolerance = (sum_pi_squared_tolerance(self.logits, dtype=self.dtype, accumulation_dtype=compute)
                             + logsumexp_tolerance(vocab, spread) + output_rounding(out))
                self._cache[key] = {"sum_pi_squared": tolerance}
            else:
                align = "valid_token" if self.kind == "tir-otb" else "position"
                advantages, returns = otb_comparison_tolerance(
                    self.rewards, self.response_mask, self.group_ids, self.log_probs, self.sum_pi_squared,
                    is_weights=self.is_weights, align=align, leave_one_out=self.kind == "loo-otb",
                    handle_zero_tail=self.handle_zero_tail and self.kind != "loo-otb", epsilon=self.epsilon,
                    compute_dtype=compute, output_dtype=out, input_dtype=self.dtype)
                self._cache[key] = {"advantages": advantages, "returns": returns}
        return self._cache[key]

    def describe(self) -> str:
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
    rewards[:, -1] = [1, 0, 1, 0, 1, 1]
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
    verl_nan = ("verl 0.9.1 divides 0/0 = NaN here; otb-spec defines the baseline as 0 — the documented deviation "
                "'epsilon-zero-nan' (docs/verl-differences.md #3): reported, not failed, unless --strict")
    cases.append(replace(cases[-1], name="zero energy with ε = 0 (defined as baseline 0)", epsilon=0.0, note=verl_nan))
    lp, spp = _policy_statistics((3, 5), 8)
    cases.append(Case(kind, "ε = 0 and positions no member reaches (defined as baseline 0)", "float64",
                      np.array([[0, 1.0, 0, 0, 0], [0, 0, 2.0, 0, 0], [0, 0, 0, 0, 0]]),
                      np.array([[1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [1, 0, 0, 0, 0.0]]), _ids("z", "z", "z"), lp, spp,
                      epsilon=0.0, note=verl_nan))
    lp, spp = _policy_statistics((4, 4), 6)
    cases.append(Case(kind, "ε large enough to matter (ε = 0.5)", "float64", portable.PortableRandom(6).normal(
        (4, 4)), np.ones((4, 4)), _ids("e", "e", "e", "e"), lp, spp, epsilon=0.5))
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
    ]


def golden_cases(kind: str, dtypes: tuple[str, ...] = ("float64", "float32")) -> list[Case]:
    """The hand-built cases of ``kind``, each in every dtype of ``dtypes``."""
    if kind not in KINDS:
        raise ValueError(f"kind: expected one of {', '.join(KINDS)}, got {kind!r}")
    base = _spp_golden() if kind == "sum-pi-squared" else _otb_golden(kind)
    return [case.with_dtype(dtype) for case in base for dtype in dtypes]


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
}
GENERATED_PROFILES["tir-otb"] = GENERATED_PROFILES["loo-otb"] = GENERATED_PROFILES["otb"]


def generated_cases(kind: str, *, profile: str = "general", dtypes: tuple[str, ...] = ("float32", "float64"),
                    equal_groups: bool = False, max_length: int = 12) -> st.SearchStrategy[Case]:
    """Hypothesis strategy of cases of ``kind`` from one of :data:`GENERATED_PROFILES`.

    OTB kinds — ``"general"``: shuffled non-contiguous groups with string (and other) ids, singletons, unequal lengths
    with unique longest members, holes, left padding, all-masked rows, IS weights or not, both zero-tail settings,
    ε ∈ {1e-8, 1e-3}, masked positions holding what a trainer leaves there (the padding token's log π ≤ 0 and Σπ², or
    zeros; :func:`robustness_cases` has wilder values); ``"zero-tail"`` and ``"holes-empty-rows-weights"`` concentrate
    on those features. (ε = 0, where verl divides 0/0, is in the golden cases, marked with a note.) Σπ² — ``"general"``,
    ``"extreme"`` (±1e4), ``"excluded-tokens"`` (−inf). Cases come in each dtype of ``dtypes``. ``equal_groups``
    restricts to contiguous groups of one size (conventions with a [G, N, T] layout).
    """
    if kind not in KINDS:
        raise ValueError(f"kind: expected one of {', '.join(KINDS)}, got {kind!r}")
    if profile not in GENERATED_PROFILES[kind]:
        raise ValueError(f"profile: expected one of {', '.join(GENERATED_PROFILES[kind])}, got {profile!r}")
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


def special_cases(kind: str, *, equal_groups: bool = False) -> list[Case]:
    """Cases where low precision shows: long sequences (T = 4096) in float32 and as bfloat16 inputs (which must be
    accumulated in float32), and for Σπ² a large vocabulary, extreme logits in float32, and bfloat16 logits — spread
    (N(0, 4²)) and nearly flat (N(0, ½²), where summing 32768 comparable terms in bfloat16 would stall)."""
    if kind == "sum-pi-squared":
        rng = portable.PortableRandom(11)
        large = rng.normal((8, 65536), scale=3.0)
        extreme = rng.normal((8, 4096), scale=5.0) + rng.choice([-1e4, 1e4], (8, 1))
        return [Case(kind, "large vocabulary (V = 65536)", "float64", logits=large).with_dtype("float32"),
                Case(kind, "logits near ±1e4", "float64", logits=extreme).with_dtype("float32"),
                Case(kind, "bfloat16 logits, V = 32768", "float64",
                     logits=rng.normal((8, 32768), scale=4.0)).with_dtype("bfloat16"),
                Case(kind, "nearly flat bfloat16 logits, V = 32768", "float64",
                     logits=rng.normal((8, 32768), scale=0.5)).with_dtype("bfloat16")]
    rng = portable.PortableRandom(12)
    rows, positions = 16, 4096
    lengths = rng.integers(positions // 2, positions + 1, rows)
    mask = (np.arange(positions)[None, :] < lengths[:, None]).astype(np.float64)
    if kind == "tir-otb":
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
            _energy_timing_case(kind, equal_groups).with_dtype("bfloat16")]


def _energy_timing_case(kind: str, equal_groups: bool) -> Case:
    """T = 4096, groups of 4, full rows: half the members spend their first 512 tokens far from the sampled token
    (π ≈ 0.01 with another token near-certain: w ≈ 1.9) and the rest near a coin flip (π ≈ ½: w ≈ ½), the other half
    the other way round (coin flips first, the 512 high-energy tokens last); dense rewards on every token, and a bonus
    at the end for the first half. A running total kept in bfloat16 stops growing once its increments fall below half
    its spacing (G and W stall near 256 increments), which leaves returns wrong by hundreds and distorts how the
    halves' energies compare; per-token work in bfloat16 — every w well away from 0 here — and float32 sums do not."""
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


def robustness_cases(kind: str) -> list[Case]:
    """Inputs no trainer produces, on which the verifier reports a difference as a warning, never a failure: masked
    positions holding log π up to +50 (π = e⁵⁰), Σπ² outside [0, 1], ρ up to 50 and rewards up to ±99 (float32 and
    float64; a correct implementation may overflow on them, e.g. by forming (1 − π)² before masking), and group ids
    of mixed types that cannot be ordered (a port using ``np.unique`` on the ids fails there). None for
    ``"sum-pi-squared"`` (logits have neither masks nor ids)."""
    if kind not in KINDS:
        raise ValueError(f"kind: expected one of {', '.join(KINDS)}, got {kind!r}")
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
