"""Monte Carlo lab engine: the bias and variance of every estimator's group gradient, against exact ground truth.

For a toy task (``otb_spec.toy``) with exact ∇J, draw G groups of N independent trajectories, apply an estimator to
the whole batch (the reference functions, exactly as a trainer would), and form each group's gradient estimate

    ĝ_g = (1/N)·Σ_{i∈g} Σₜ Aₜⁱ·sₜⁱ .

Reported per estimator, each with a standard error:

* E[ĝ] (per coordinate);
* bias *scale*  E[ĝ]·∇J / ‖∇J‖²  (1 for an unbiased estimator; 1 − 1/N for the self-inclusive group mean);
* bias *angle*  cos(E[ĝ], ∇J) — note that the cosine of a Monte Carlo mean is pulled below 1 by its own noise, by
  about tr Cov(ĝ)/(2G‖∇J‖²); use the scale and the per-coordinate z-scores to test unbiasedness;
* total variance  tr Cov(ĝ) = E‖ĝ − E ĝ‖²;
* bias *tilt*  the angle between E[ĝ] and ∇J corrected for Monte Carlo noise, from the unbiased estimate of the
  perpendicular bias q = ‖E[ĝ]_⊥‖²/‖∇J‖² (E‖m̂_⊥‖² = ‖E[ĝ]_⊥‖² + tr Cov_⊥(ĝ)/G, so subtracting the second term leaves
  an unbiased estimate, which may come out negative when the true tilt is 0);
* tokens consumed per group, Σᵢ Lᵢ (for comparisons at an equal token budget).

Loss aggregation (``aggregations``): how a trainer turns per-token terms into one gradient, with every form scaled to
agree with the sequence sum when all lengths equal E[L] (so a scale of 1 still means "no bias"):

* ``"sequence_sum"``  ĝ = (1/N)·Σᵢ Σₜ Aₜⁱsₜⁱ  (verl ``seq-mean-token-sum``; what the proofs analyse);
* ``"token_mean"``    ĝ = E[L]·Σᵢ Σₜ Aₜⁱsₜⁱ / Σᵢ Lᵢ  (verl ``token-mean``, here normalised over the N trajectories of
  one group — the smallest normalising batch; verl divides by the tokens of its whole mini-batch, so its effect is
  that of a batch of that many trajectories);
* ``"sequence_mean"`` ĝ = (1/N)·Σᵢ (E[L]/Lᵢ)·Σₜ Aₜⁱsₜⁱ  (verl ``seq-mean-token-mean``; every trajectory's gradient
  divided by its own length, whatever the batch).

All estimators see the same sampled groups (common random numbers), so their differences are less noisy than their
values. The standard error of E[ĝ] is per coordinate, from the per-group values; those of the scale, the cosine, the
tilt and the variance come from a jackknife over ``n_batches`` consecutive blocks of groups. Every
:class:`Estimate` keeps its leave-one-block-out replicates, so that a function of several estimates — a variance
ratio between two estimators on the same groups, or between two group sizes sampled independently — gets its
standard error from :func:`derived_statistic` (paired where the samples are shared, in quadrature where they are
independent).

For enumerable tasks and small N, :func:`exact_group_moments` computes E[ĝ] and tr Cov(ĝ) exactly by enumerating all
S^N groups, which validates the Monte Carlo engine itself (tests/test_montecarlo.py).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from otb_spec.estimators import ESTIMATORS, RolloutBatch
from otb_spec.tolerances import summation_tolerance
from otb_spec.toy import EnumerableTask, Rollouts, _group_sum, group_gradients, weighted_score_sums

__all__ = [
    "AGGREGATIONS",
    "Estimate",
    "StatisticWithError",
    "derived_statistic",
    "tilt_from_bias",
    "self_inclusive_bias_coefficient",
    "as_rollout_batch",
    "constant_baseline_estimator",
    "oracle_baselines",
    "population_token_baselines",
    "constant_baseline_variance",
    "exact_group_moments",
    "run_monte_carlo",
    "run_monte_carlo_grid",
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
      cosine: cos(E[ĝ], ∇J) of the Monte Carlo mean (pulled below 1 by noise; see ``perpendicular_bias``).
      total_variance: tr Cov(ĝ).
      exact_gradient: [P] ∇J.
      perpendicular_bias: q = ‖E[ĝ]_⊥‖²/‖∇J‖², the squared component of E[ĝ] orthogonal to ∇J, estimated without the
        noise term (unbiased; may be negative when q = 0).
      tokens_per_group: Σᵢ Lᵢ, the valid tokens a group consumes.
      aggregation: ``"sequence_sum"``, ``"token_mean"`` or ``"sequence_mean"`` (module docstring).
      sample_id: (task, seed, N, G, blocks) of the run: estimates with equal ids were computed on the same groups.
      replicates: statistic name → [k] leave-one-block-out values (jackknife replicates) of ``scale``, ``cosine``,
        ``total_variance``, ``perpendicular_bias`` and ``tokens_per_group``.
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
    perpendicular_bias: StatisticWithError = StatisticWithError(float("nan"), float("nan"))
    tokens_per_group: StatisticWithError = StatisticWithError(float("nan"), float("nan"))
    aggregation: str = "sequence_sum"
    sample_id: tuple = ()
    replicates: Mapping[str, np.ndarray] = field(default_factory=dict)

    @property
    def angle_degrees(self) -> float:
        """∠(Monte Carlo mean, ∇J) in degrees — noise alone makes it positive; prefer :meth:`tilt_degrees`."""
        return float(np.degrees(np.arccos(np.clip(self.cosine.value, -1.0, 1.0))))

    def tilt_degrees(self) -> StatisticWithError:
        """The angle between E[ĝ] and ∇J, θ = atan2(√max(q, 0), scale) in degrees, corrected for Monte Carlo noise.

        Its standard error comes from the jackknife replicates. When q is within 5 standard errors of 0 the tilt is not
        distinguishable from 0; :meth:`tilt_upper_bound` then gives what the data allow.
        """
        return derived_statistic(tilt_from_bias, [(self, "perpendicular_bias"), (self, "scale")])

    def tilt_upper_bound(self) -> float:
        """The largest tilt the data allow: θ at q + 5·SE(q) (degrees)."""
        q = self.perpendicular_bias
        return tilt_from_bias(q.value + 5 * q.standard_error, self.scale.value)

    def tilt_is_resolved(self) -> bool:
        """True when q lies more than 5 standard errors above 0 (the tilt is not Monte Carlo noise)."""
        q = self.perpendicular_bias
        return bool(q.value > 5 * q.standard_error)

    def max_abs_z(self) -> float:
        """max over coordinates of |E[ĝ] − ∇J| / SE.

        A coordinate with SE = 0 took one value c in every group; it must equal ∇J's up to the rounding of averaging G
        copies of c, (G + 2)·ε·|c| (``summation_tolerance``), else the result is ∞ — ∇J taken as exact there
        (enumeration and the dynamic programme give a structural zero exactly). The SE is the sample standard
        error: for a coordinate whose variance comes from sequences too rare to be drawn many times it understates
        the spread (proofs/F1, *Standard errors of the tilt*), so use enough groups that every sequence carrying
        weight is drawn often."""
        difference = self.mean_gradient - self.exact_gradient
        zero = self.mean_gradient_se == 0
        rounding = summation_tolerance(self.n_groups, 1.0).atol * np.abs(self.exact_gradient)
        if np.any(zero & (np.abs(difference) > rounding)):
            return float("inf")
        se = np.where(zero, 1.0, self.mean_gradient_se)
        return float(np.max(np.where(zero, 0.0, np.abs(difference) / se))) if difference.size else 0.0


def tilt_from_bias(perpendicular_bias: float, scale: float) -> float:
    """θ = atan2(√max(q, 0), scale) in degrees: the angle of a vector with components (scale, √q) relative to ∇J."""
    return float(np.degrees(np.arctan2(np.sqrt(max(float(perpendicular_bias), 0.0)), float(scale))))


def _jackknife(replicates: np.ndarray) -> float:
    k = len(replicates)
    if k < 2:
        return float("nan")
    return float(np.sqrt((k - 1) / k * np.sum(np.square(replicates - replicates.mean()))))


def derived_statistic(function: Callable[..., float],
                      arguments: Sequence[tuple[Estimate, str] | float]) -> StatisticWithError:
    """f(x₁, …, x_k) of statistics of Monte Carlo estimates (or exact numbers), with a jackknife standard error.

    Each argument is ``(estimate, statistic name)`` or a plain float (an exact value, e.g. the scale 1 of an unbiased
    estimator). Estimates with the same ``sample_id`` were computed on the same groups: their replicates are
    recomputed together (a paired jackknife — correlations between them are accounted for, which common random
    numbers make large). Estimates from different runs are independent: each run's jackknife contribution is
    computed with the other runs held at their full-sample values, and the contributions add in quadrature.

    Example: the variance of OTB relative to REINFORCE on the same groups,
    ``derived_statistic(lambda a, b: a / b, [(runs["otb"], "total_variance"), (runs["reinforce"], "total_variance")])``.
    """
    def value_of(argument: tuple[Estimate, str] | float) -> float:
        if isinstance(argument, tuple):
            estimate, name = argument
            return float(getattr(estimate, name).value)
        return float(argument)

    full = [value_of(argument) for argument in arguments]
    value = float(function(*full))
    runs: dict[tuple, list[int]] = {}
    for position, argument in enumerate(arguments):
        if isinstance(argument, tuple):
            runs.setdefault(argument[0].sample_id or (id(argument[0]),), []).append(position)
    variance = 0.0
    for positions in runs.values():
        columns = [np.asarray(arguments[p][0].replicates[arguments[p][1]], dtype=np.float64) for p in positions]
        k = len(columns[0])
        if any(len(column) != k for column in columns):
            raise ValueError("derived_statistic: estimates with one sample_id must have the same number of blocks")
        values = np.empty(k)
        for b in range(k):
            args = list(full)
            for p, column in zip(positions, columns):
                args[p] = column[b]
            values[b] = function(*args)
        variance += _jackknife(values) ** 2
    return StatisticWithError(value, float(np.sqrt(variance)))


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


def _ratio_or_zero(numerator: np.ndarray, denominator: np.ndarray) -> np.ndarray:
    """numerator/denominator per position, 0 where no trajectory reaches it (denominator 0)."""
    out = np.zeros(numerator.shape[0])
    np.divide(numerator, denominator, out=out, where=denominator > 0)
    return out


def oracle_baselines(task: EnumerableTask) -> np.ndarray:
    """The variance-optimal per-position constant baseline (T5):  B^opt_t = E[mₜ sₜ·ĝ₀] / E[mₜ‖sₜ‖²]  — [T].

    Exact for enumerable tasks. Positions no trajectory reaches get 0.
    """
    rollouts, weights = _weighted_all(task)
    returns = task.returns()
    numerator = weights @ (_score_dot_gradient(rollouts, returns) * rollouts.response_mask)
    denominator = weights @ (rollouts.score_sq_norms * rollouts.response_mask)
    return _ratio_or_zero(numerator, denominator)


def _population_sums(task: EnumerableTask, energy: str):
    """(rollouts, weights, mₜWₜ per trajectory, E[mₜGₜWₜ], E[mₜWₜ]) by enumeration, with Wₜ the proxy's realized energy
    (``energy="proxy"``) or the exact ‖Sₜ‖² (``"exact"``)."""
    rollouts, weights = _weighted_all(task)
    if energy == "proxy":
        realized = np.cumsum(rollouts.token_energy, axis=1)
    elif energy == "exact":
        realized = rollouts.cumulative_score_sq_norms
    else:
        raise ValueError(f"energy: expected 'proxy' or 'exact', got {energy!r}")
    masked = realized * rollouts.response_mask
    return rollouts, weights, masked, weights @ (task.returns() * masked), weights @ masked


def population_token_baselines(task: EnumerableTask, energy: str = "proxy") -> np.ndarray:
    """Population OTB  Bₜ = E[mₜGₜWₜ]/E[mₜWₜ]  with Wₜ the proxy's realized energy or the exact ‖Sₜ‖²  — [T]."""
    _, _, _, numerator, denominator = _population_sums(task, energy)
    return _ratio_or_zero(numerator, denominator)


def self_inclusive_bias_coefficient(task: EnumerableTask, energy: str = "proxy") -> np.ndarray:
    """The leading coefficient c of self-inclusive OTB's bias, E[ĝ_self] = ∇J − c/N + O(1/N²) — [P], exactly.

        c = Σₜ E[mₜ·Wₜ·sₜ·(Gₜ − B^pop_t)] / E[mₜWₜ],      B^pop_t = E[mₜWₜGₜ]/E[mₜWₜ]   (population OTB),

    with Wₜ the proxy's realized energy (``energy="proxy"``) or the exact ‖Sₜ‖² (``"exact"``); positions no
    trajectory reaches contribute nothing. Derivation: proofs/T7_self_inclusive_identity.md (from the identity
    A_self = (1 − λ)·A_loo, λ = Wᵢ/(Σⱼ Wⱼ + ε) ≈ Wᵢ/(N·E[mₜWₜ])). The scale of E[ĝ_self] is then
    1 − (c·∇J/‖∇J‖²)/N + O(1/N²).
    """
    rollouts, weights, masked, numerator, mean_energy = _population_sums(task, energy)      # E[mₜWₜ]: [T]
    baselines = _ratio_or_zero(numerator, mean_energy)
    safe = np.where(mean_energy > 0, mean_energy, 1.0)
    per_token = weights[:, None] * masked * (task.returns() - baselines[None, :]) / safe[None, :]
    per_token = np.where(mean_energy[None, :] > 0, per_token, 0.0)
    return weighted_score_sums(rollouts, per_token, np.zeros(rollouts.size, dtype=np.int64), 1)[0]


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
                        chunk: int = 20_000, aggregation: str = "sequence_sum",
                        **options: Any) -> tuple[np.ndarray, float]:
    """(E[ĝ], tr Cov(ĝ)) of an estimator's group gradient, exactly, by enumerating all S^N groups.

    ``aggregation`` is one of :data:`AGGREGATIONS` (module docstring; E[L] exact). Feasible for S^N up to a few
    million (e.g. S = 15 sequences and N ≤ 4).
    """
    rollouts, weights = _weighted_all(task)
    S, N = rollouts.size, int(group_size)
    total = S**N
    if total > 20_000_000:
        raise ValueError(f"group_size: {S}^{N} = {total} groups is too many to enumerate")
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation: expected one of {AGGREGATIONS}, got {aggregation!r}")
    mean_length = task.expected_length()
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
        factors = _aggregation_weights(aggregation, members.response_mask.sum(axis=1), group_index, n_groups,
                                       mean_length)
        gradients = group_gradients(members, advantages * factors[:, None], group_index, n_groups, task.n_params)
        probability = np.prod(weights[block], axis=1)
        first += probability @ gradients
        second += float(probability @ np.sum(np.square(gradients), axis=1))
    return first, second - float(first @ first)


# ----------------------------------------------------------------------------------------------------------------------
# The Monte Carlo run


AGGREGATIONS = ("sequence_sum", "token_mean", "sequence_mean")
"""Loss aggregations of :func:`run_monte_carlo_grid` (module docstring)."""

_STATISTICS = ("scale", "cosine", "total_variance", "perpendicular_bias", "tokens_per_group")


@dataclass
class _Accumulator:
    n_params: int
    n_batches: int
    unit: np.ndarray           # [P] ∇J/‖∇J‖ (zeros when ∇J = 0)

    def __post_init__(self) -> None:
        self.sums = np.zeros((self.n_batches, self.n_params))
        self.squares = np.zeros((self.n_batches, self.n_params))
        self.norms = np.zeros(self.n_batches)
        self.projections = np.zeros(self.n_batches)
        self.projection_squares = np.zeros(self.n_batches)
        self.tokens = np.zeros(self.n_batches)
        self.counts = np.zeros(self.n_batches)

    def add(self, batch: int, gradients: np.ndarray, tokens: float) -> None:
        self.sums[batch] += gradients.sum(axis=0)
        self.squares[batch] += np.square(gradients).sum(axis=0)
        self.norms[batch] += float(np.sum(np.square(gradients)))
        along = gradients @ self.unit
        self.projections[batch] += float(along.sum())
        self.projection_squares[batch] += float(along @ along)
        self.tokens[batch] += tokens
        self.counts[batch] += gradients.shape[0]

    def summary(self, name: str, group_size: int, exact: np.ndarray, aggregation: str, sample_id: tuple) -> Estimate:
        count = self.counts.sum()
        mean = self.sums.sum(axis=0) / count
        variance_per_coordinate = (self.squares.sum(axis=0) - count * np.square(mean)) / max(count - 1, 1)
        mean_se = np.sqrt(np.maximum(variance_per_coordinate, 0.0) / count)
        exact_norm = float(np.linalg.norm(exact))

        def statistics(sums: np.ndarray, norms: float, projections: float, projection_squares: float, tokens: float,
                       n: float) -> np.ndarray:
            m = sums / n
            along = float(m @ self.unit)
            scale = along / exact_norm if exact_norm > 0 else float("nan")
            norm = float(np.linalg.norm(m)) * exact_norm
            cosine = float(m @ exact) / norm if norm > 0 else 0.0
            variance = (norms - n * float(m @ m)) / max(n - 1, 1)
            variance_along = (projection_squares - n * along * along) / max(n - 1, 1)
            # E‖m̂_⊥‖² = ‖E[ĝ]_⊥‖² + tr Cov_⊥/n, tr Cov_⊥ = tr Cov − Var(ĝ·u): subtract the noise term
            perpendicular = float(m @ m) - along * along - (variance - variance_along) / n
            q = perpendicular / exact_norm**2 if exact_norm > 0 else float("nan")
            return np.array([scale, cosine, variance, q, tokens / n])

        totals = (self.sums.sum(axis=0), float(self.norms.sum()), float(self.projections.sum()),
                  float(self.projection_squares.sum()), float(self.tokens.sum()))
        full = statistics(*totals, count)
        used = np.flatnonzero(self.counts > 0)
        leave_out = np.array([statistics(totals[0] - self.sums[b], totals[1] - self.norms[b],
                                         totals[2] - self.projections[b], totals[3] - self.projection_squares[b],
                                         totals[4] - self.tokens[b], count - self.counts[b]) for b in used])
        errors = [_jackknife(leave_out[:, column]) for column in range(len(_STATISTICS))]
        return Estimate(
            estimator=name, group_size=group_size, n_groups=int(count), mean_gradient=mean, mean_gradient_se=mean_se,
            scale=StatisticWithError(float(full[0]), errors[0]),
            cosine=StatisticWithError(float(full[1]), errors[1]),
            total_variance=StatisticWithError(float(full[2]), errors[2]),
            exact_gradient=exact,
            perpendicular_bias=StatisticWithError(float(full[3]), errors[3]),
            tokens_per_group=StatisticWithError(float(full[4]), errors[4]),
            aggregation=aggregation, sample_id=sample_id,
            replicates={statistic: leave_out[:, column].copy() for column, statistic in enumerate(_STATISTICS)})


def _aggregation_weights(aggregation: str, lengths: np.ndarray, group_index: np.ndarray, n_groups: int,
                         mean_length: float) -> np.ndarray:
    """[n] per-trajectory factor c such that ĝ_g = (1/N)·Σᵢ cᵢ·Σₜ Aₜⁱsₜⁱ is the requested aggregation."""
    if aggregation == "sequence_sum":
        return np.ones(lengths.shape[0])
    if aggregation == "sequence_mean":
        return mean_length / np.maximum(lengths, 1.0)
    if aggregation == "token_mean":
        sizes = np.bincount(group_index, minlength=n_groups).astype(np.float64)
        tokens = np.bincount(group_index, weights=lengths, minlength=n_groups)
        return (sizes * mean_length / np.maximum(tokens, 1.0))[group_index]
    raise ValueError(f"aggregation: expected one of {AGGREGATIONS}, got {aggregation!r}")


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
      label → :class:`Estimate` of the sequence-sum gradient ĝ = (1/N)·Σᵢ Σₜ Aₜⁱsₜⁱ
      (:func:`run_monte_carlo_grid` for other loss aggregations).
    """
    return run_monte_carlo_grid(task, estimators, group_size=group_size, n_groups=n_groups, seed=seed,
                                chunk_groups=chunk_groups, n_batches=n_batches, options=options, progress=progress,
                                aggregations=("sequence_sum",))["sequence_sum"]


def run_monte_carlo_grid(
    task: Task,
    estimators: Mapping[str, str | AdvantageFunction] | Sequence[str],
    *,
    group_size: int,
    n_groups: int,
    aggregations: Sequence[str] = AGGREGATIONS,
    seed: int = 0,
    chunk_groups: int = 20_000,
    n_batches: int = 32,
    options: Mapping[str, Mapping[str, Any]] | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, dict[str, Estimate]]:
    """:func:`run_monte_carlo` for several loss aggregations at once, on the same groups.

    Args as :func:`run_monte_carlo`, and ``aggregations``: a subset of :data:`AGGREGATIONS` (module docstring; the
    token-mean and sequence-mean forms are scaled by the exact E[L] of ``task``).

    Returns:
      aggregation → label → :class:`Estimate`; every estimate of one call has the same ``sample_id``.
    """
    if not isinstance(estimators, Mapping):
        estimators = {name: name for name in estimators}
    if group_size < 1 or n_groups < 2:
        raise ValueError(f"group_size ≥ 1 and n_groups ≥ 2 are required, got {group_size} and {n_groups}")
    aggregations = tuple(aggregations)
    for aggregation in aggregations:
        if aggregation not in AGGREGATIONS:
            raise ValueError(f"aggregations: expected a subset of {AGGREGATIONS}, got {aggregation!r}")
    options = options or {}
    n_batches = max(2, min(n_batches, n_groups))
    rng = np.random.default_rng(seed)
    exact = task.gradient()
    exact_norm = float(np.linalg.norm(exact))
    unit = exact / exact_norm if exact_norm > 0 else np.zeros_like(exact)
    mean_length = task.expected_length() if aggregations != ("sequence_sum",) else 1.0
    accumulators = {(aggregation, label): _Accumulator(task.n_params, n_batches, unit)
                    for aggregation in aggregations for label in estimators}
    boundaries = np.linspace(0, n_groups, n_batches + 1).astype(np.int64)
    done = 0
    while done < n_groups:
        batch = int(np.searchsorted(boundaries, done, side="right") - 1)
        count = int(min(chunk_groups, n_groups - done, boundaries[batch + 1] - done))
        rollouts = task.sample(count * group_size, rng)
        group_index = np.repeat(np.arange(count), group_size)
        view = as_rollout_batch(rollouts, group_index)
        trajectories = np.arange(count * group_size)
        lengths = rollouts.response_mask.sum(axis=1)
        tokens = float(lengths.sum())
        factors = {aggregation: _aggregation_weights(aggregation, lengths, group_index, count, mean_length)
                   for aggregation in aggregations}
        for label, estimator in estimators.items():
            advantages = estimator_advantages(estimator, view, **options.get(label, {}))
            if len(aggregations) == 1:
                only = aggregations[0]
                weighted = advantages if only == "sequence_sum" else advantages * factors[only][:, None]
                accumulators[only, label].add(
                    batch, group_gradients(rollouts, weighted, group_index, count, task.n_params), tokens)
                continue
            # the aggregations differ by a factor per trajectory: score sums per trajectory once, then group sums
            per_trajectory = weighted_score_sums(rollouts, advantages, trajectories, trajectories.size)
            for aggregation in aggregations:
                accumulators[aggregation, label].add(
                    batch, _group_sum(per_trajectory * (factors[aggregation] / group_size)[:, None], group_index,
                                      count), tokens)
        done += count
        if progress is not None:
            progress(done, n_groups)
    sample_id = (id(task), seed, group_size, n_groups, n_batches)
    return {aggregation: {label: accumulators[aggregation, label].summary(label, group_size, exact, aggregation,
                                                                          sample_id)
                          for label in estimators}
            for aggregation in aggregations}
