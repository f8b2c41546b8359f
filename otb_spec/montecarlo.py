"""Monte Carlo lab engine: the bias and variance of every estimator's group gradient, against exact ground truth.

For a toy task (``otb_spec.toy``) with exact ∇J, draw G groups of N independent trajectories, apply an estimator to
the whole batch (the reference functions, exactly as a trainer would), and form each group's gradient estimate

    ĝ_g = (1/N)·Σ_{i∈g} Σₜ Aₜⁱ·sₜⁱ .

Reported per estimator, each with a standard error:

* E[ĝ] (per coordinate);
* bias *scale*  E[ĝ]·∇J / ‖∇J‖²  (1 for an unbiased estimator; 1 − 1/N for the self-inclusive group mean);
* bias *angle*  cos(E[ĝ], ∇J) — note that the cosine of a Monte Carlo mean is pulled below 1 by its own noise, by
  about tr Cov(ĝ)/(2G‖∇J‖²); use the scale and the per-coordinate z-scores to test unbiasedness;
* total variance  tr Cov(ĝ) = E‖ĝ − E ĝ‖².

All estimators see the same sampled groups (common random numbers), so their differences are less noisy than their
values. The standard error of E[ĝ] is per coordinate, from the per-group values; those of the scale, the cosine and
the variance come from a jackknife over ``n_batches`` consecutive blocks of groups.

For enumerable tasks and small N, :func:`exact_group_moments` computes E[ĝ] and tr Cov(ĝ) exactly by enumerating all
S^N groups, which validates the Monte Carlo engine itself (tests/test_montecarlo.py).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from otb_spec.estimators import ESTIMATORS, RolloutBatch
from otb_spec.toy import EnumerableTask, Rollouts, group_gradients, weighted_score_sums

__all__ = [
    "Estimate",
    "StatisticWithError",
    "as_rollout_batch",
    "constant_baseline_estimator",
    "oracle_baselines",
    "population_token_baselines",
    "constant_baseline_variance",
    "exact_group_moments",
    "run_monte_carlo",
    "estimator_advantages",
]

Task = Any  # EnumerableTask | MarkovTask
AdvantageFunction = Callable[[RolloutBatch], np.ndarray]


@dataclass(frozen=True)
class StatisticWithError:
    """A Monte Carlo estimate and its standard error."""

    value: float
    standard_error: float

    def z_score(self, exact: float) -> float:
        """(value − exact)/standard error (±inf when the standard error is 0 and they differ)."""
        if self.standard_error == 0:
            return 0.0 if self.value == exact else float(np.sign(self.value - exact) * np.inf)
        return (self.value - exact) / self.standard_error

    def __format__(self, spec: str) -> str:
        spec = spec or ".4g"
        return f"{self.value:{spec}} ± {self.standard_error:{spec}}"


@dataclass(frozen=True)
class Estimate:
    """Monte Carlo summary of one estimator's group gradient.

    Attributes:
      estimator: its name.
      group_size: N.
      n_groups: G (groups sampled).
      mean_gradient: [P] E[ĝ] estimate.
      mean_gradient_se: [P] its per-coordinate standard error.
      scale: E[ĝ]·∇J/‖∇J‖².
      cosine: cos(E[ĝ], ∇J).
      total_variance: tr Cov(ĝ).
      exact_gradient: [P] ∇J.
    """

    estimator: str
    group_size: int
    n_groups: int
    mean_gradient: np.ndarray
    mean_gradient_se: np.ndarray
    scale: StatisticWithError
    cosine: StatisticWithError
    total_variance: StatisticWithError
    exact_gradient: np.ndarray

    @property
    def angle_degrees(self) -> float:
        return float(np.degrees(np.arccos(np.clip(self.cosine.value, -1.0, 1.0))))

    def max_abs_z(self) -> float:
        """max over coordinates of |E[ĝ] − ∇J| / SE (coordinates with SE = 0 must match exactly)."""
        difference = self.mean_gradient - self.exact_gradient
        zero = self.mean_gradient_se == 0
        if np.any(zero & (np.abs(difference) > 1e-12 * (1 + np.abs(self.exact_gradient)))):
            return float("inf")
        se = np.where(zero, 1.0, self.mean_gradient_se)
        return float(np.max(np.where(zero, 0.0, np.abs(difference) / se))) if difference.size else 0.0


# ----------------------------------------------------------------------------------------------------------------------
# From rollouts to estimator inputs


def as_rollout_batch(rollouts: Rollouts, group_index: np.ndarray) -> RolloutBatch:
    """The estimator interface's view of toy rollouts (group ids = ``group_index``)."""
    return RolloutBatch(rewards=rollouts.rewards, response_mask=rollouts.response_mask, group_ids=group_index,
                        log_probs=rollouts.log_probs, sum_pi_squared=rollouts.sum_pi_squared,
                        cumulative_score_sq_norms=rollouts.cumulative_score_sq_norms,
                        sequence_score_sq_norms=rollouts.sequence_score_sq_norms)


def constant_baseline_estimator(baselines: np.ndarray) -> AdvantageFunction:
    """Aₜ = (Gₜ − Bₜ)·mₜ with fixed per-position baselines B [T] (e.g. :func:`oracle_baselines`)."""
    baselines = np.asarray(baselines, dtype=np.float64)

    def advantages(batch: RolloutBatch) -> np.ndarray:
        mask = np.asarray(batch.response_mask)
        rewards = np.asarray(batch.rewards)
        returns = np.flip(np.cumsum(np.flip(rewards * mask, axis=1), axis=1), axis=1)
        return (returns - baselines[None, :]) * mask

    return advantages


def estimator_advantages(estimator: str | AdvantageFunction, batch: RolloutBatch, **options: Any) -> np.ndarray:
    """Advantages [n, T] of a registry estimator (by name) or of a custom advantage function."""
    if callable(estimator):
        return np.asarray(estimator(batch), dtype=np.float64)
    return ESTIMATORS[estimator](batch, **options).advantages


# ----------------------------------------------------------------------------------------------------------------------
# Population baselines (exact for enumerable tasks)


def _weighted_all(task: EnumerableTask) -> tuple[Rollouts, np.ndarray]:
    if not isinstance(task, EnumerableTask):
        raise TypeError("task: exact population quantities need an EnumerableTask")
    return task.all_rollouts(), task.table.probabilities


def _score_dot_gradient(rollouts: Rollouts, returns: np.ndarray) -> np.ndarray:
    """[n, T] sₜ·ĝ₀(τ) with ĝ₀(τ) = Σᵤ mᵤ sᵤ Gᵤ, the REINFORCE gradient of each trajectory: uₜᵀ·Ĝ₀·φₜ."""
    n, T, V = rollouts.logit_gradients.shape
    own = weighted_score_sums(rollouts, returns * rollouts.response_mask, np.arange(n), n).reshape(
        n, V, rollouts.feature_dim)                                                      # [n, V, d]
    if rollouts.feature_values is None:
        columns = np.take_along_axis(own, rollouts.feature_index[:, None, :], axis=2)     # [n, V, T]
        return np.einsum("ntv,nvt->nt", rollouts.logit_gradients, columns)
    return np.einsum("ntv,nvf,ntf->nt", rollouts.logit_gradients, own, rollouts.feature_values)


def oracle_baselines(task: EnumerableTask) -> np.ndarray:
    """The variance-optimal per-position constant baseline (T5):  B^opt_t = E[mₜ sₜ·ĝ₀] / E[mₜ‖sₜ‖²]  — [T].

    Exact for enumerable tasks. Positions no trajectory reaches get 0.
    """
    rollouts, weights = _weighted_all(task)
    returns = task.returns()
    numerator = weights @ (_score_dot_gradient(rollouts, returns) * rollouts.response_mask)
    denominator = weights @ (rollouts.score_sq_norms * rollouts.response_mask)
    out = np.zeros(task.horizon)
    np.divide(numerator, denominator, out=out, where=denominator > 0)
    return out


def population_token_baselines(task: EnumerableTask, energy: str = "proxy") -> np.ndarray:
    """Population OTB  Bₜ = E[mₜGₜWₜ]/E[mₜWₜ]  with Wₜ the proxy's realized energy or the exact ‖Sₜ‖²  — [T]."""
    rollouts, weights = _weighted_all(task)
    if energy == "proxy":
        realized = np.cumsum(rollouts.token_energy, axis=1)
    elif energy == "exact":
        realized = rollouts.cumulative_score_sq_norms
    else:
        raise ValueError(f"energy: expected 'proxy' or 'exact', got {energy!r}")
    mask = rollouts.response_mask
    numerator = weights @ (task.returns() * realized * mask)
    denominator = weights @ (realized * mask)
    out = np.zeros(task.horizon)
    np.divide(numerator, denominator, out=out, where=denominator > 0)
    return out


def constant_baseline_variance(task: EnumerableTask, baselines: np.ndarray) -> float:
    """Exact tr Cov of the single-trajectory gradient Σₜ mₜ sₜ (Gₜ − Bₜ) for constant per-position baselines B."""
    rollouts, weights = _weighted_all(task)
    advantages = (task.returns() - np.asarray(baselines, dtype=np.float64)[None, :]) * rollouts.response_mask
    per_sequence = group_gradients(rollouts, advantages, np.arange(rollouts.size), rollouts.size, task.n_params)
    mean = weights @ per_sequence
    return float(weights @ np.sum(np.square(per_sequence), axis=1) - mean @ mean)


# ----------------------------------------------------------------------------------------------------------------------
# Exact moments of group estimators by enumeration


def exact_group_moments(task: EnumerableTask, estimator: str | AdvantageFunction, group_size: int, *,
                        chunk: int = 20_000, **options: Any) -> tuple[np.ndarray, float]:
    """(E[ĝ], tr Cov(ĝ)) of an estimator's group gradient, exactly, by enumerating all S^N groups.

    Feasible for S^N up to a few million (e.g. S = 15 sequences and N ≤ 4).
    """
    rollouts, weights = _weighted_all(task)
    S, N = rollouts.size, int(group_size)
    total = S**N
    if total > 20_000_000:
        raise ValueError(f"group_size: {S}^{N} = {total} groups is too many to enumerate")
    first = np.zeros(task.n_params)
    second = 0.0
    combos = itertools.product(range(S), repeat=N)
    while True:
        block = np.array(list(itertools.islice(combos, chunk)), dtype=np.int64)
        if block.size == 0:
            break
        n_groups = block.shape[0]
        rows = block.ravel()
        group_index = np.repeat(np.arange(n_groups), N)
        members = rollouts.take(rows)
        advantages = estimator_advantages(estimator, as_rollout_batch(members, group_index), **options)
        gradients = group_gradients(members, advantages, group_index, n_groups, task.n_params)
        probability = np.prod(weights[block], axis=1)
        first += probability @ gradients
        second += float(probability @ np.sum(np.square(gradients), axis=1))
    return first, second - float(first @ first)


# ----------------------------------------------------------------------------------------------------------------------
# The Monte Carlo run


@dataclass
class _Accumulator:
    n_params: int
    n_batches: int

    def __post_init__(self) -> None:
        self.sums = np.zeros((self.n_batches, self.n_params))
        self.squares = np.zeros((self.n_batches, self.n_params))
        self.norms = np.zeros(self.n_batches)
        self.counts = np.zeros(self.n_batches)

    def add(self, batch: int, gradients: np.ndarray) -> None:
        self.sums[batch] += gradients.sum(axis=0)
        self.squares[batch] += np.square(gradients).sum(axis=0)
        self.norms[batch] += float(np.sum(np.square(gradients)))
        self.counts[batch] += gradients.shape[0]

    def summary(self, name: str, group_size: int, exact: np.ndarray) -> Estimate:
        count = self.counts.sum()
        mean = self.sums.sum(axis=0) / count
        variance_per_coordinate = (self.squares.sum(axis=0) - count * np.square(mean)) / max(count - 1, 1)
        mean_se = np.sqrt(np.maximum(variance_per_coordinate, 0.0) / count)
        unit = exact / max(float(exact @ exact), 1e-300)

        def statistics(sums: np.ndarray, norms: float, n: float) -> tuple[float, float, float]:
            m = sums / n
            scale = float(m @ unit)
            norm = float(np.linalg.norm(m) * np.linalg.norm(exact))
            cosine = float(m @ exact) / norm if norm > 0 else 0.0
            variance = (norms - n * float(m @ m)) / max(n - 1, 1)
            return scale, cosine, variance

        full = statistics(self.sums.sum(axis=0), float(self.norms.sum()), count)
        used = np.flatnonzero(self.counts > 0)
        leave_out = np.array([statistics(self.sums.sum(axis=0) - self.sums[b], float(self.norms.sum() - self.norms[b]),
                                         count - self.counts[b]) for b in used])
        k = len(used)
        jackknife = np.sqrt((k - 1) / k * np.sum(np.square(leave_out - leave_out.mean(axis=0)), axis=0)) if k > 1 \
            else np.full(3, np.nan)
        return Estimate(
            estimator=name, group_size=group_size, n_groups=int(count), mean_gradient=mean, mean_gradient_se=mean_se,
            scale=StatisticWithError(full[0], float(jackknife[0])),
            cosine=StatisticWithError(full[1], float(jackknife[1])),
            total_variance=StatisticWithError(full[2], float(jackknife[2])),
            exact_gradient=exact)


def run_monte_carlo(
    task: Task,
    estimators: Mapping[str, str | AdvantageFunction] | Sequence[str],
    *,
    group_size: int,
    n_groups: int,
    seed: int = 0,
    chunk_groups: int = 20_000,
    n_batches: int = 32,
    options: Mapping[str, Mapping[str, Any]] | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, Estimate]:
    """Draw ``n_groups`` groups of ``group_size`` trajectories and summarise every estimator's group gradient.

    Args:
      task: an :class:`~otb_spec.toy.EnumerableTask` or :class:`~otb_spec.toy.MarkovTask`.
      estimators: registry names, or a mapping from a label to a registry name or an advantage function
        (``batch → [n, T] advantages``), e.g. ``{"oracle": constant_baseline_estimator(oracle_baselines(task))}``.
      group_size: N.
      n_groups: G.
      seed: seed of the NumPy generator (the run is deterministic given it).
      chunk_groups: groups sampled and processed at once (bounds memory: chunk × P floats per estimator).
      n_batches: blocks for the jackknife standard errors.
      options: per-label keyword options for registry estimators.
      progress: called as progress(done_groups, n_groups) after each chunk.

    Returns:
      label → :class:`Estimate`.
    """
    if not isinstance(estimators, Mapping):
        estimators = {name: name for name in estimators}
    if group_size < 1 or n_groups < 2:
        raise ValueError(f"group_size ≥ 1 and n_groups ≥ 2 are required, got {group_size} and {n_groups}")
    options = options or {}
    n_batches = max(2, min(n_batches, n_groups))
    rng = np.random.default_rng(seed)
    exact = task.gradient()
    accumulators = {label: _Accumulator(task.n_params, n_batches) for label in estimators}
    boundaries = np.linspace(0, n_groups, n_batches + 1).astype(np.int64)
    done = 0
    while done < n_groups:
        batch = int(np.searchsorted(boundaries, done, side="right") - 1)
        count = int(min(chunk_groups, n_groups - done, boundaries[batch + 1] - done))
        rollouts = task.sample(count * group_size, rng)
        group_index = np.repeat(np.arange(count), group_size)
        view = as_rollout_batch(rollouts, group_index)
        for label, estimator in estimators.items():
            advantages = estimator_advantages(estimator, view, **options.get(label, {}))
            accumulators[label].add(batch, group_gradients(rollouts, advantages, group_index, count, task.n_params))
        done += count
        if progress is not None:
            progress(done, n_groups)
    return {label: accumulators[label].summary(label, group_size, exact) for label in estimators}
