"""The lab report: bias and variance of every estimator across group sizes and regimes (``otb-spec lab``).

Regimes (all with fixed seeds, so every number is reproducible):

* ``random`` — shared-parameter toy policy (V = 4 with EOS, T = 5, 364 sequences), Bernoulli(½) terminal reward per
  sequence: the reward is unrelated to the policy's confidence;
* ``confidence`` — the same policy, reward 1 when the sequence's mean per-token proxy wₜ is below the median over
  sequences (confident sequences are the good ones), 0 otherwise;
* ``long`` — long horizon: a Markov policy on (position bucket, previous token), V = 4, T = 200 (the quick mode: 60),
  with an EOS probability that rises along the sequence, so lengths spread over the whole horizon; reward 1 when the
  length is at most T/2 (reward tied to length).

Estimators: REINFORCE, the group mean (Dr. GRPO), GRPO (std-normalised), RLOO, OPO, OTB (verl, self-inclusive),
leave-one-out OTB, OTB with exact norms, the sequence-level optimal baseline, and the per-position oracle of T5 (exact
for the enumerable regimes, estimated from an independent pilot sample for the long one — still a constant, so still
unbiased).

For each regime, N and loss aggregation (sequence sum, token-mean, sequence-mean; ``otb_spec.montecarlo``) the report
gives, each ± its standard error: the bias scale E[ĝ]·∇J/‖∇J‖²; the tilt, the angle between E[ĝ] and ∇J corrected for
Monte Carlo noise (or its 5-SE upper bound where it is not resolved); the total variance tr Cov(ĝ) relative to
REINFORCE on the same groups; the variance per unit of signal tr Cov(ĝ)/scale² relative to REINFORCE's (what matters
when the optimizer rescales the update); N·tr Cov(ĝ), the variance a budget of N trajectories buys; head-to-head
ratios per unit of signal (OTB against the group mean, leave-one-out OTB against RLOO, on the same groups); and, for
the token-mean and sequence-mean aggregations, the variance relative to the same estimator's sequence sum. It then
answers the question the paper raises — does OTB with N = 4 reach the gradient variance of the group mean with
N = 32? — one group each, per unit of signal, and at equal budgets of trajectories and tokens.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import Any, TextIO

import numpy as np

from otb_spec import montecarlo as mc
from otb_spec.toy import EnumerablePolicy, MarkovPolicy, MarkovTask

__all__ = ["Regime", "regimes", "LabResult", "run_lab", "format_report", "plot_variance", "pilot_oracle_baselines",
           "GROUP_SIZES", "ESTIMATOR_LABELS", "HEAD_TO_HEAD", "N4_VS_N32_VIEWS", "N4_VS_N32_ESTIMATORS"]

GROUP_SIZES = (2, 4, 8, 16, 32)
_UNBIASED = frozenset({"reinforce", "rloo", "otb_loo", "otb_exact_loo", "sequence_optimal_loo", "oracle"})
ESTIMATOR_LABELS = ("reinforce", "group_mean", "grpo", "rloo", "opo", "otb", "otb_loo", "otb_exact",
                    "sequence_optimal", "oracle")


@dataclass(frozen=True)
class Regime:
    """A named task and the number of trajectories sampled per (estimator, N) cell."""

    name: str
    description: str
    task: Any
    trajectories: int


def _enumerable_policy() -> EnumerablePolicy:
    return EnumerablePolicy.log_linear(4, 5, seed=3, scale=1.5)


def regimes(quick: bool = False) -> list[Regime]:
    """The three regimes; ``quick`` shrinks the samples (and the long horizon to T = 60) to run in seconds."""
    policy = _enumerable_policy()
    table = policy.sequences
    random_rewards = np.random.default_rng(0).integers(0, 2, size=table.size).astype(float)
    energy = (1.0 - 2.0 * np.exp(table.log_probs) + table.sum_pi_squared) * table.mask
    mean_energy = energy.sum(axis=1) / table.mask.sum(axis=1)
    confident = (mean_energy < np.median(mean_energy)).astype(float)
    horizon = 60 if quick else 200
    markov = MarkovPolicy.random(vocab_size=4, horizon=horizon, n_buckets=8, seed=0)
    lengths = np.arange(horizon + 1)
    per_cell = 2**12 if quick else 2**17
    return [
        Regime("random", "shared-parameter toy (V=4, T=5), Bernoulli(½) terminal reward per sequence",
               policy.task(policy.terminal_rewards(random_rewards)), per_cell),
        Regime("confidence", "same toy, reward 1 iff the sequence's mean proxy w is below the median",
               policy.task(policy.terminal_rewards(confident)), per_cell),
        Regime("long", f"Markov policy (V=4, T={horizon}, 8 position buckets), reward 1 iff length ≤ T/2",
               markov.task(length_rewards=(lengths <= horizon // 2).astype(float)), 2**10 if quick else 2**16),
    ]


def pilot_oracle_baselines(task: MarkovTask, n: int, seed: int) -> np.ndarray:
    """T5's oracle B^opt_t = E[mₜsₜ·ĝ₀]/E[mₜ‖sₜ‖²] estimated from ``n`` independent pilot trajectories."""
    rollouts = task.sample(n, np.random.default_rng(seed))
    returns = np.flip(np.cumsum(np.flip(rollouts.rewards, axis=1), axis=1), axis=1)
    numerator = (mc._score_dot_gradient(rollouts, returns) * rollouts.response_mask).mean(axis=0)
    denominator = (rollouts.score_sq_norms * rollouts.response_mask).mean(axis=0)
    out = np.zeros(task.horizon)
    np.divide(numerator, denominator, out=out, where=denominator > 0)
    return out


def _estimators(regime: Regime, seed: int, quick: bool) -> dict[str, Any]:
    task = regime.task
    if isinstance(task, MarkovTask):
        oracle = pilot_oracle_baselines(task, 2**12 if quick else 2**15, seed + 10_000)
    else:
        oracle = mc.oracle_baselines(task)
    estimators: dict[str, Any] = {label: label for label in ESTIMATOR_LABELS if label != "oracle"}
    estimators["oracle"] = mc.constant_baseline_estimator(oracle)
    return estimators


def _format(statistic: mc.StatisticWithError, width: int = 14) -> str:
    """value±SE with the SE to two significant digits (at most 4 decimals, at least 0)."""
    value, error = statistic.value, statistic.standard_error
    if not np.isfinite(value):
        return f"{'—':>{width}s}"
    if not np.isfinite(error) or error <= 0:
        return f"{value:>{width}.4g}"
    decimals = int(min(4, max(0, 1 - np.floor(np.log10(error)))))
    return f"{value:.{decimals}f}±{error:.{decimals}f}".rjust(width)


def _verdict(statistic: mc.StatisticWithError) -> str:
    """"yes" when the ratio is more than 5 SE below 1, "no" when more than 5 SE above, "unclear" otherwise."""
    value, error = statistic.value, statistic.standard_error
    return "yes" if value + 5 * error <= 1 else "no" if value - 5 * error > 1 else "unclear"


HEAD_TO_HEAD = (("otb", "group_mean"), ("otb_exact", "group_mean"), ("otb_loo", "rloo"), ("oracle", "group_mean"))
"""Pairs compared per unit of signal on the same groups: each self-inclusive OTB with the self-inclusive group mean,
leave-one-out OTB with RLOO (both unbiased, so per unit of signal = raw), and the oracle constant baseline (T5, the
least variance any constant per-position baseline reaches) with the group mean: how far below it any baseline of that
kind can go (proofs/F1, item 3)."""

N4_VS_N32_VIEWS = ("raw", "scale_adjusted", "equal_trajectories", "equal_trajectories_adjusted", "equal_tokens")
N4_VS_N32_ESTIMATORS = ("otb", "otb_loo", "otb_exact")


@dataclass
class LabResult:
    """All numbers of a lab run.

    ``aggregated[regime][aggregation][N][estimator]`` → :class:`otb_spec.montecarlo.Estimate` for every loss
    aggregation (:data:`otb_spec.montecarlo.AGGREGATIONS`); ``estimates[regime][N][estimator]`` is the sequence-sum
    part, the gradient the proofs analyse. Every ratio below comes with a standard error from
    :func:`otb_spec.montecarlo.derived_statistic` (paired on the same groups, in quadrature across group sizes).
    """

    quick: bool
    seed: int
    group_sizes: tuple[int, ...]
    regimes: list[Regime]
    aggregated: dict[str, dict[str, dict[int, dict[str, mc.Estimate]]]] = field(default_factory=dict)
    expected_lengths: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def estimates(self) -> dict[str, dict[int, dict[str, mc.Estimate]]]:
        return {regime: by_aggregation["sequence_sum"] for regime, by_aggregation in self.aggregated.items()}

    def cell(self, regime: str, n: int, estimator: str, aggregation: str = "sequence_sum") -> mc.Estimate:
        return self.aggregated[regime][aggregation][n][estimator]

    def scale(self, regime: str, n: int, estimator: str) -> float:
        """The bias scale used for adjustment (sequence sum): exact where T3 gives it (1 for the unbiased estimators,
        1 − 1/N for the self-inclusive group mean, N ≥ 2), the Monte Carlo estimate otherwise."""
        argument = self._scale_argument(regime, n, estimator, "sequence_sum")
        return argument if isinstance(argument, float) else self.cell(regime, n, estimator).scale.value

    def _scale_argument(self, regime: str, n: int, estimator: str, aggregation: str) -> float | tuple:
        if aggregation == "sequence_sum":
            if estimator in _UNBIASED:
                return 1.0
            if estimator == "group_mean" and n >= 2:
                return 1.0 - 1.0 / n
        return (self.cell(regime, n, estimator, aggregation), "scale")

    def _variance_arguments(self, regime: str, n: int, estimator: str, adjusted: bool,
                            aggregation: str = "sequence_sum") -> list:
        variance = (self.cell(regime, n, estimator, aggregation), "total_variance")
        return [variance, self._scale_argument(regime, n, estimator, aggregation) if adjusted else 1.0]

    def variance_ratio(self, regime: str, n: int, estimator: str, adjusted: bool = False,
                       aggregation: str = "sequence_sum") -> mc.StatisticWithError:
        """tr Cov(ĝ) (÷ scale² when ``adjusted``: the variance per unit of signal) ÷ REINFORCE's tr Cov(ĝ) at the same
        N, on the same groups."""
        return mc.derived_statistic(
            lambda variance, scale, reference: variance / (scale * scale) / reference,
            self._variance_arguments(regime, n, estimator, adjusted, aggregation)
            + [(self.cell(regime, n, "reinforce", aggregation), "total_variance")])

    def aggregation_ratio(self, regime: str, n: int, estimator: str, aggregation: str) -> mc.StatisticWithError:
        """tr Cov(ĝ) under ``aggregation`` ÷ the same estimator's under the sequence sum, on the same groups."""
        return mc.derived_statistic(lambda a, b: a / b,
                                    [(self.cell(regime, n, estimator, aggregation), "total_variance"),
                                     (self.cell(regime, n, estimator), "total_variance")])

    def head_to_head(self, regime: str, n: int, first: str, second: str) -> mc.StatisticWithError:
        """(tr Cov/scale²) of ``first`` ÷ that of ``second`` at the same N, on the same groups (paired SE)."""
        return mc.derived_statistic(
            lambda a, s, b, t: (a / (s * s)) / (b / (t * t)),
            self._variance_arguments(regime, n, first, True) + self._variance_arguments(regime, n, second, True))

    def variance_times_trajectories(self, regime: str, n: int, estimator: str) -> mc.StatisticWithError:
        """N·tr Cov(ĝ): the variance of the gradient a budget of N trajectories buys, whatever N is per group."""
        return mc.derived_statistic(lambda variance: n * variance,
                                    [(self.cell(regime, n, estimator), "total_variance")])

    def n4_vs_n32(self, regime: str, estimator: str, view: str = "raw") -> mc.StatisticWithError | None:
        """``estimator`` at N = 4 against the group mean at N = 32 (None if not both were run). ``view``:

        * ``"raw"`` — tr Cov(ĝ₄)/tr Cov(ĝ₃₂), one group each (the paper's comparison: 8× fewer trajectories);
        * ``"scale_adjusted"`` — the same per unit of signal, (tr Cov/scale²)₄/(tr Cov/scale²)₃₂;
        * ``"equal_trajectories"`` — at an equal budget of trajectories: 4·tr Cov(ĝ₄)/(32·tr Cov(ĝ₃₂)), the variance of
          the mean of 8 groups of 4 against one group of 32;
        * ``"equal_trajectories_adjusted"`` — the same per unit of signal (the raw view ÷ 8, each side ÷ its scale²);
        * ``"equal_tokens"`` — at an equal budget of tokens: tokens₄·tr Cov(ĝ₄)/(tokens₃₂·tr Cov(ĝ₃₂)) with the measured
          tokens per group.
        """
        sizes = self.aggregated[regime]["sequence_sum"]
        if 4 not in sizes or 32 not in sizes:
            return None
        if view not in N4_VS_N32_VIEWS:
            raise ValueError(f"view: expected one of {N4_VS_N32_VIEWS}, got {view!r}")
        small, large = self.cell(regime, 4, estimator), self.cell(regime, 32, "group_mean")
        if view in ("raw", "scale_adjusted", "equal_trajectories_adjusted"):
            adjusted = view != "raw"
            budget = 4 / 32 if view == "equal_trajectories_adjusted" else 1.0
            arguments = (self._variance_arguments(regime, 4, estimator, adjusted)
                         + self._variance_arguments(regime, 32, "group_mean", adjusted))
            return mc.derived_statistic(lambda a, s, b, t: budget * (a / (s * s)) / (b / (t * t)), arguments)
        if view == "equal_trajectories":
            return mc.derived_statistic(lambda a, b: 4 * a / (32 * b),
                                        [(small, "total_variance"), (large, "total_variance")])
        return mc.derived_statistic(lambda a, x, b, y: a * x / (b * y),
                                    [(small, "total_variance"), (small, "tokens_per_group"),
                                     (large, "total_variance"), (large, "tokens_per_group")])

    def to_json(self) -> dict:
        def pair(statistic: mc.StatisticWithError) -> list[float]:
            return [statistic.value, statistic.standard_error]

        def describe(e: mc.Estimate) -> dict[str, Any]:
            return {"scale": pair(e.scale), "cosine": pair(e.cosine), "angle_degrees": e.angle_degrees,
                    "perpendicular_bias": pair(e.perpendicular_bias),
                    "tilt_degrees": pair(e.tilt_degrees()) if e.tilt_is_resolved() else None,
                    "tilt_resolved": e.tilt_is_resolved(), "tilt_upper_bound_degrees": e.tilt_upper_bound(),
                    "total_variance": pair(e.total_variance), "tokens_per_group": pair(e.tokens_per_group),
                    "groups": e.n_groups}

        out: dict[str, Any] = {"quick": self.quick, "seed": self.seed, "seconds": round(self.seconds, 2),
                               "group_sizes": list(self.group_sizes), "regimes": {}}
        for regime in self.regimes:
            name = regime.name
            cells = {}
            for n in self.group_sizes:
                cells[str(n)] = {}
                for estimator in self.aggregated[name]["sequence_sum"][n]:
                    entry = describe(self.cell(name, n, estimator))
                    entry["variance_vs_reinforce"] = pair(self.variance_ratio(name, n, estimator))
                    entry["adjusted_variance_vs_reinforce"] = pair(self.variance_ratio(name, n, estimator, True))
                    entry["variance_times_trajectories"] = pair(self.variance_times_trajectories(name, n, estimator))
                    cells[str(n)][estimator] = entry
            aggregations = {}
            for aggregation in self.aggregated[name]:
                if aggregation == "sequence_sum":
                    continue
                aggregations[aggregation] = {
                    str(n): {estimator: {**describe(self.cell(name, n, estimator, aggregation)),
                                         "variance_vs_reinforce": pair(self.variance_ratio(
                                             name, n, estimator, aggregation=aggregation)),
                                         "variance_vs_sequence_sum": pair(self.aggregation_ratio(
                                             name, n, estimator, aggregation))}
                             for estimator in self.aggregated[name][aggregation][n]}
                    for n in self.group_sizes}
            pairs = {f"{first}/{second}": {str(n): pair(self.head_to_head(name, n, first, second))
                                           for n in self.group_sizes}
                     for first, second in HEAD_TO_HEAD}
            comparison = {}
            if self.n4_vs_n32(name, "otb") is not None:
                comparison = {estimator: {view: pair(self.n4_vs_n32(name, estimator, view))
                                          for view in N4_VS_N32_VIEWS}
                              for estimator in N4_VS_N32_ESTIMATORS}
            out["regimes"][name] = {"description": regime.description,
                                    "expected_length": self.expected_lengths[name],
                                    "gradient_norm": float(np.linalg.norm(
                                        self.cell(name, self.group_sizes[0], "reinforce").exact_gradient)),
                                    "cells": cells, "aggregations": aggregations, "head_to_head": pairs,
                                    "otb_n4_vs_group_mean_n32": comparison}
        return out


class _ProgressBar:
    def __init__(self, total: int, stream: TextIO | None):
        self.total, self.done, self.stream, self.start = total, 0, stream, time.perf_counter()

    def advance(self, label: str) -> None:
        self.done += 1
        if self.stream is None:
            return
        width = 30
        filled = int(width * self.done / self.total)
        elapsed = time.perf_counter() - self.start
        self.stream.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} {label:<24s} "
                          f"{elapsed:6.1f}s")
        if self.done == self.total:
            self.stream.write("\n")
        self.stream.flush()


def run_lab(*, quick: bool = False, seed: int = 0, group_sizes: tuple[int, ...] = GROUP_SIZES,
            regime_names: tuple[str, ...] | None = None, progress: TextIO | None = sys.stderr) -> LabResult:
    """Run every (regime, N) cell; all estimators and all loss aggregations share the sampled groups of a cell."""
    every = regimes(quick)
    chosen = [r for r in every if regime_names is None or r.name in regime_names]
    if regime_names is not None:
        unknown = set(regime_names) - {r.name for r in chosen}
        if unknown:
            raise ValueError(f"regimes: unknown {sorted(unknown)}; known: random, confidence, long")
    result = LabResult(quick, seed, tuple(group_sizes), chosen)
    bar = _ProgressBar(len(chosen) * len(group_sizes), progress)
    start = time.perf_counter()
    for regime in chosen:
        # the regime's seed follows its place among all regimes, not among the chosen ones: ``--regime long`` alone
        # samples the same groups as the full run (and docs/lab-results.json)
        regime_index = every.index(regime)
        estimators = _estimators(regime, seed, quick)
        result.expected_lengths[regime.name] = regime.task.expected_length()
        by_aggregation: dict[str, dict[int, dict[str, mc.Estimate]]] = {name: {} for name in mc.AGGREGATIONS}
        for n in group_sizes:
            n_groups = max(64, regime.trajectories // n)
            grid = mc.run_monte_carlo_grid(
                regime.task, estimators, group_size=n, n_groups=n_groups, aggregations=mc.AGGREGATIONS,
                seed=seed * 1_000_003 + regime_index * 1000 + n, chunk_groups=max(64, 2**15 // n))
            for aggregation, cells in grid.items():
                by_aggregation[aggregation][n] = cells
            bar.advance(f"{regime.name} N={n}")
        result.aggregated[regime.name] = by_aggregation
    result.seconds = time.perf_counter() - start
    return result


_AGGREGATION_TITLES = {
    "token_mean": "token-mean: ĝ = E[L]·Σᵢ Σₜ Aₜsₜ / Σᵢ Lᵢ over the group (verl's default, normalised per group)",
    "sequence_mean": "sequence-mean: ĝ = (1/N)·Σᵢ (E[L]/Lᵢ)·Σₜ Aₜsₜ (verl seq-mean-token-mean)",
}


def _table(lines: list[str], title: str, sizes: tuple[int, ...], cell) -> None:
    lines += ["", f"   {title}", f"   {'estimator':17s}" + "".join(f"{'N=' + str(n):>15s}" for n in sizes)]
    for name in ESTIMATOR_LABELS:
        lines.append(f"   {name:17s}" + "".join(" " + cell(n, name) for n in sizes))


def _tilt(estimate: mc.Estimate) -> str:
    if estimate.tilt_is_resolved():
        return _format(estimate.tilt_degrees())
    return f"<{estimate.tilt_upper_bound():.2g}".rjust(14)


def format_report(result: LabResult, command: str = "otb-spec lab") -> str:
    """The printed tables (every ratio ± its standard error) and the answer to the N = 4 vs N = 32 question."""
    lines = [f"otb-spec lab — {'quick' if result.quick else 'full'} mode, seed {result.seed}, "
             f"{result.seconds:.1f} s. Reproduce: {command}",
             "Every number is value±SE (SE: jackknife over 32 blocks of groups; ratios of estimators on the same "
             "groups",
             "are paired). scale = E[ĝ]·∇J/‖∇J‖² (1 = unbiased). tilt = ∠(E[ĝ], ∇J) in degrees, corrected for Monte",
             "Carlo noise; \"<x\" = not resolved (within 5 SE of 0), x the 5-SE upper bound. var = tr Cov(ĝ) ÷ "
             "REINFORCE's",
             "on the same groups; per unit of signal = (tr Cov(ĝ)/scale²) ÷ REINFORCE's, with the exact scale where T3",
             "gives it (1 for unbiased estimators, 1 − 1/N for the group mean); N·tr Cov(ĝ) = variance × trajectories."]
    sizes = result.group_sizes
    for regime in result.regimes:
        name = regime.name
        reference = result.cell(name, sizes[0], "reinforce")
        lines += ["", f"== {name}: {regime.description}",
                  f"   ∇J norm {np.linalg.norm(reference.exact_gradient):.4g}; E[L] = "
                  f"{result.expected_lengths[name]:.4g} tokens; {reference.n_groups * sizes[0]} trajectories per N",
                  "   loss aggregation: sequence sum, ĝ = (1/N)·Σᵢ Σₜ Aₜsₜ (the proofs' gradient)"]
        _table(lines, "scale", sizes, lambda n, e: _format(result.cell(name, n, e).scale))
        _table(lines, "tilt (degrees)", sizes, lambda n, e: _tilt(result.cell(name, n, e)))
        _table(lines, "var: tr Cov(ĝ) ÷ REINFORCE's", sizes,
               lambda n, e: _format(result.variance_ratio(name, n, e)))
        _table(lines, "per unit of signal: (tr Cov(ĝ)/scale²) ÷ REINFORCE's", sizes,
               lambda n, e: _format(result.variance_ratio(name, n, e, adjusted=True)))
        _table(lines, "N·tr Cov(ĝ): variance × trajectories consumed", sizes,
               lambda n, e: _format(result.variance_times_trajectories(name, n, e)))
        lines += ["", "   head to head per unit of signal, (tr Cov/scale²) ÷ (tr Cov/scale²), same groups; "
                  "lower/higher: more than 5 SE", f"   {'pair':24s}" + "".join(f"{'N=' + str(n):>24s}" for n in sizes)]
        for first, second in HEAD_TO_HEAD:
            cells = []
            for n in sizes:
                statistic = result.head_to_head(name, n, first, second)
                verdict = {"yes": "lower", "no": "higher", "unclear": "unclear"}[_verdict(statistic)]
                cells.append(f"{_format(statistic, 15)} ({verdict})".rjust(24))
            lines.append(f"   {first + ' ÷ ' + second:24s}" + "".join(cells))
        for aggregation in mc.AGGREGATIONS[1:]:
            if aggregation not in result.aggregated[name]:
                continue
            lines += ["", f"   loss aggregation: {_AGGREGATION_TITLES[aggregation]}"]
            _table(lines, "scale", sizes, lambda n, e, a=aggregation: _format(result.cell(name, n, e, a).scale))
            _table(lines, "tilt (degrees)", sizes, lambda n, e, a=aggregation: _tilt(result.cell(name, n, e, a)))
            _table(lines, "tr Cov(ĝ) ÷ the same estimator's with the sequence sum", sizes,
                   lambda n, e, a=aggregation: _format(result.aggregation_ratio(name, n, e, a)))
    if 4 in sizes and 32 in sizes:
        headers = {"raw": "raw", "scale_adjusted": "per unit of signal", "equal_trajectories": "equal trajectories",
                   "equal_trajectories_adjusted": "equal traj., per signal", "equal_tokens": "equal tokens"}
        lines += ["", "Does OTB at N = 4 reach the gradient variance of the group mean at N = 32?",
                  "raw: tr Cov(ĝ₄) ÷ tr Cov(ĝ₃₂), one group each (8× fewer trajectories at N = 4); per unit of "
                  "signal: each",
                  "side ÷ its scale²; equal trajectories: 4·tr Cov(ĝ₄) ÷ 32·tr Cov(ĝ₃₂) (8 groups of 4 against 1 "
                  "group of",
                  "32), also per unit of signal; equal tokens: tokens₄·tr Cov(ĝ₄) ÷ tokens₃₂·tr Cov(ĝ₃₂) (measured "
                  "tokens",
                  "per group). ≤ 1 means yes; yes/no: more than 5 SE below/above 1.",
                  f"  {'regime':10s} {'estimator':10s}" + "".join(f"{headers[view]:>25s}" for view in N4_VS_N32_VIEWS)]
        for regime in result.regimes:
            for estimator in N4_VS_N32_ESTIMATORS:
                cells = []
                for view in N4_VS_N32_VIEWS:
                    statistic = result.n4_vs_n32(regime.name, estimator, view)
                    cells.append(f"{_format(statistic, 15)} ({_verdict(statistic)})".rjust(25))
                lines.append(f"  {regime.name:10s} {estimator:10s}" + "".join(cells))
    return "\n".join(lines)


def plot_variance(result: LabResult, path: str) -> None:
    """Write a PNG: tr Cov(ĝ) (top) and N·tr Cov(ĝ) (bottom, variance × trajectories) against N, log–log, one column
    per regime, one line per estimator, error bars of one standard error."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = len(result.regimes)
    figure, axes = plt.subplots(2, panels, figsize=(5.2 * panels, 8.4), squeeze=False)
    sizes = np.array(result.group_sizes)
    for column, regime in enumerate(result.regimes):
        for name in ESTIMATOR_LABELS:
            style = "-" if name.startswith("otb") or name == "oracle" else "--"
            values = np.array([result.cell(regime.name, n, name).total_variance.value for n in sizes])
            errors = np.array([result.cell(regime.name, n, name).total_variance.standard_error for n in sizes])
            for row, factor in ((0, np.ones(len(sizes))), (1, sizes.astype(float))):
                axes[row][column].errorbar(sizes, values * factor, yerr=errors * factor, label=name, linestyle=style,
                                           marker="o", markersize=3, capsize=2)
        for row, label in ((0, "tr Cov(ĝ)"), (1, "N·tr Cov(ĝ)  (variance × trajectories)")):
            axis = axes[row][column]
            axis.set_xscale("log", base=2)
            axis.set_yscale("log")
            axis.set_xlabel("group size N")
            axis.set_ylabel(label)
            axis.set_title(regime.name)
            axis.grid(True, which="both", alpha=0.3)
    axes[0][-1].legend(fontsize=7, loc="best")
    figure.suptitle("Gradient variance vs group size (otb-spec lab, sequence-sum aggregation)")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
