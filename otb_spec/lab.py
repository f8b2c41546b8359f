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

For each regime and N the report gives the bias scale E[ĝ]·∇J/‖∇J‖², the angle between E[ĝ] and ∇J, the total
variance tr Cov(ĝ) relative to REINFORCE at the same N, and the scale-adjusted variance tr Cov(ĝ)/scale² relative to
REINFORCE (what matters when the optimizer rescales the update). It then answers the question the paper raises: does
OTB with N = 4 reach the gradient variance of the group mean with N = 32?
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
           "GROUP_SIZES", "ESTIMATOR_LABELS"]

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


@dataclass
class LabResult:
    """All numbers of a lab run: ``estimates[regime][N][estimator]`` → :class:`otb_spec.montecarlo.Estimate`."""

    quick: bool
    seed: int
    group_sizes: tuple[int, ...]
    regimes: list[Regime]
    estimates: dict[str, dict[int, dict[str, mc.Estimate]]] = field(default_factory=dict)
    seconds: float = 0.0

    def variance_ratio(self, regime: str, n: int, estimator: str, adjusted: bool = False) -> float:
        """tr Cov(ĝ) (divided by scale² when ``adjusted``) relative to REINFORCE's tr Cov(ĝ) at the same N."""
        return self._variance(regime, n, estimator, adjusted) / self._variance(regime, n, "reinforce", False)

    def scale(self, regime: str, n: int, estimator: str) -> float:
        """The bias scale used for adjustment: exact where T3 gives it (1 for the unbiased estimators, 1 − 1/N for the
        self-inclusive group mean, N ≥ 2), the Monte Carlo estimate otherwise."""
        if estimator in _UNBIASED:
            return 1.0
        if estimator == "group_mean" and n >= 2:
            return 1.0 - 1.0 / n
        return self.estimates[regime][n][estimator].scale.value

    def _variance(self, regime: str, n: int, estimator: str, adjusted: bool) -> float:
        variance = self.estimates[regime][n][estimator].total_variance.value
        if not adjusted:
            return variance
        scale = self.scale(regime, n, estimator)
        return variance / (scale * scale) if scale != 0 else float("inf")

    def n4_vs_n32(self, regime: str, estimator: str, adjusted: bool) -> float | None:
        """tr Cov(ĝ, N = 4) of ``estimator`` ÷ tr Cov(ĝ, N = 32) of the group mean (None if not both were run)."""
        if 4 not in self.estimates[regime] or 32 not in self.estimates[regime]:
            return None
        return self._variance(regime, 4, estimator, adjusted) / self._variance(regime, 32, "group_mean", adjusted)

    def n4_vs_n32_standard_error(self, regime: str, estimator: str, adjusted: bool) -> float | None:
        """Delta-method standard error of :meth:`n4_vs_n32` (the two cells are independent samples)."""
        ratio = self.n4_vs_n32(regime, estimator, adjusted)
        if ratio is None:
            return None
        relative = 0.0
        for n, name in ((4, estimator), (32, "group_mean")):
            estimate = self.estimates[regime][n][name]
            relative += (estimate.total_variance.standard_error / estimate.total_variance.value) ** 2
            if adjusted and name not in _UNBIASED and not (name == "group_mean" and n >= 2):
                relative += (2 * estimate.scale.standard_error / estimate.scale.value) ** 2
        return abs(ratio) * float(np.sqrt(relative))

    def to_json(self) -> dict:
        out: dict[str, Any] = {"quick": self.quick, "seed": self.seed, "seconds": round(self.seconds, 2),
                               "group_sizes": list(self.group_sizes), "regimes": {}}
        for regime in self.regimes:
            cells = {}
            for n, by_estimator in self.estimates[regime.name].items():
                cells[str(n)] = {
                    name: {"scale": [e.scale.value, e.scale.standard_error],
                           "cosine": [e.cosine.value, e.cosine.standard_error],
                           "angle_degrees": e.angle_degrees,
                           "total_variance": [e.total_variance.value, e.total_variance.standard_error],
                           "variance_vs_reinforce": self.variance_ratio(regime.name, n, name),
                           "adjusted_variance_vs_reinforce": self.variance_ratio(regime.name, n, name, True),
                           "groups": e.n_groups}
                    for name, e in by_estimator.items()}
            out["regimes"][regime.name] = {"description": regime.description, "cells": cells,
                                           "otb_n4_vs_group_mean_n32": {
                                               name: {"raw": [self.n4_vs_n32(regime.name, name, False),
                                                              self.n4_vs_n32_standard_error(regime.name, name, False)],
                                                      "scale_adjusted": [
                                                          self.n4_vs_n32(regime.name, name, True),
                                                          self.n4_vs_n32_standard_error(regime.name, name, True)]}
                                               for name in ("otb", "otb_loo", "otb_exact")}}
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
    """Run every (regime, N) cell; all estimators share the sampled groups of a cell."""
    chosen = [r for r in regimes(quick) if regime_names is None or r.name in regime_names]
    if regime_names is not None:
        unknown = set(regime_names) - {r.name for r in chosen}
        if unknown:
            raise ValueError(f"regimes: unknown {sorted(unknown)}; known: random, confidence, long")
    result = LabResult(quick, seed, tuple(group_sizes), chosen)
    bar = _ProgressBar(len(chosen) * len(group_sizes), progress)
    start = time.perf_counter()
    for regime_index, regime in enumerate(chosen):
        estimators = _estimators(regime, seed, quick)
        result.estimates[regime.name] = {}
        for n in group_sizes:
            n_groups = max(64, regime.trajectories // n)
            result.estimates[regime.name][n] = mc.run_monte_carlo(
                regime.task, estimators, group_size=n, n_groups=n_groups,
                seed=seed * 1_000_003 + regime_index * 1000 + n, chunk_groups=max(64, 2**15 // n))
            bar.advance(f"{regime.name} N={n}")
    result.seconds = time.perf_counter() - start
    return result


def format_report(result: LabResult, command: str = "otb-spec lab") -> str:
    """The printed tables and the answer to the N = 4 vs N = 32 question."""
    lines = [f"otb-spec lab — {'quick' if result.quick else 'full'} mode, seed {result.seed}, "
             f"{result.seconds:.1f} s. Reproduce: {command}",
             "scale = E[ĝ]·∇J/‖∇J‖² (1 = unbiased); angle = ∠(E[ĝ], ∇J) in degrees (Monte Carlo noise alone gives a",
             "few degrees); var = tr Cov(ĝ) ÷ REINFORCE's at the same N; adj = var ÷ scale², with the exact scale where",
             "T3 gives it (1 for unbiased estimators, 1 − 1/N for the group mean). Standard errors: --json."]
    sizes = result.group_sizes
    for regime in result.regimes:
        cells = result.estimates[regime.name]
        lines += ["", f"== {regime.name}: {regime.description}",
                  f"   ∇J norm {np.linalg.norm(cells[sizes[0]]['reinforce'].exact_gradient):.4g}; "
                  f"{cells[sizes[0]]['reinforce'].n_groups * sizes[0]} trajectories per N"]
        header = f"{'estimator':18s}" + "".join(f"  N={n:<3d}{'':14s}" for n in sizes)
        lines.append(header)
        lines.append(f"{'':18s}" + "".join(f"  {'scale':>5s} {'angle':>5s} {'var':>5s} {'adj':>5s}" for _ in sizes))
        for name in ESTIMATOR_LABELS:
            row = f"{name:18s}"
            for n in sizes:
                e = cells[n][name]
                row += (f"  {e.scale.value:5.2f} {e.angle_degrees:5.1f} {result.variance_ratio(regime.name, n, name):5.2f}"
                        f" {result.variance_ratio(regime.name, n, name, True):5.2f}")
            lines.append(row)
    if 4 in sizes and 32 in sizes:
        lines += ["", "Does OTB at N = 4 reach the gradient variance of the group mean at N = 32?",
                  "(ratio = tr Cov(ĝ) of the estimator at N = 4 ÷ that of the group mean at N = 32; ≤ 1 means yes)"]
        for regime in result.regimes:
            for name in ("otb", "otb_loo", "otb_exact"):
                cells = []
                for adjusted in (False, True):
                    ratio = result.n4_vs_n32(regime.name, name, adjusted)
                    error = result.n4_vs_n32_standard_error(regime.name, name, adjusted)
                    verdict = "yes" if ratio + 5 * error <= 1 else "no" if ratio - 5 * error > 1 else "unclear"
                    cells.append(f"{ratio:7.2f} ± {error:5.2f} ({verdict})")
                lines.append(f"  {regime.name:10s} {name:10s} raw {cells[0]}   scale-adjusted {cells[1]}")
        lines.append("  (yes/no: the ratio is more than 5 standard errors below/above 1)")
    return "\n".join(lines)


def plot_variance(result: LabResult, path: str) -> None:
    """Write a PNG: tr Cov(ĝ) against N (log–log), one panel per regime, one line per estimator."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = len(result.regimes)
    figure, axes = plt.subplots(1, panels, figsize=(5.2 * panels, 4.4), squeeze=False)
    sizes = np.array(result.group_sizes)
    for axis, regime in zip(axes[0], result.regimes):
        for name in ESTIMATOR_LABELS:
            values = np.array([result.estimates[regime.name][n][name].total_variance.value for n in sizes])
            errors = np.array([result.estimates[regime.name][n][name].total_variance.standard_error for n in sizes])
            style = "-" if name.startswith("otb") or name == "oracle" else "--"
            axis.errorbar(sizes, values, yerr=errors, label=name, linestyle=style, marker="o", markersize=3,
                          capsize=2)
        axis.set_xscale("log", base=2)
        axis.set_yscale("log")
        axis.set_xlabel("group size N")
        axis.set_ylabel("tr Cov(ĝ)")
        axis.set_title(regime.name)
        axis.grid(True, which="both", alpha=0.3)
    axes[0][-1].legend(fontsize=7, loc="best")
    figure.suptitle("Gradient variance vs group size (otb-spec lab)")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
