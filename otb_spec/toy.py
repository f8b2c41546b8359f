"""Toy autoregressive policies with exact gradients — the ground truth of the Monte Carlo lab and of the proofs.

Every toy is log-linear: at a prefix y<ₜ the logits are zₜ = Θ·φ(y<ₜ) with Θ ∈ ℝ^{V×d} and a feature vector
φ ∈ ℝᵈ, so the per-token score (gradient of log π(yₜ | y<ₜ) with respect to Θ) is the outer product

    sₜ = (e_{yₜ} − πₜ) ⊗ φₜ,        ‖sₜ‖² = wₜ·‖φₜ‖²,        sₜ·sᵤ = ((e_{yₜ} − πₜ)·(e_{yᵤ} − πᵤ))·(φₜ·φᵤ).

* **Tabular per prefix** (``EnumerablePolicy.tabular``): φ = one-hot of the prefix. Different positions of one
  sequence have different prefixes, so their scores live in disjoint parameter blocks: sₜ·sᵤ = 0 for t ≠ u and the
  Logit-Gradient Proxy is exact, Wₜ = Σ_{j≤t} wⱼ = ‖Sₜ‖².
* **Shared parameters** (``EnumerablePolicy.log_linear``): φ = (1, one-hot previous token, t/T, fraction of token 1 so
  far) is shared across prefixes. Two things then separate the proxy from the exact norm: ‖sₜ‖² = wₜ·‖φₜ‖² with
  ‖φₜ‖² ∈ [2, 4), a factor the proxy misses even in expectation (E[mₜ‖Sₜ‖²]/E[mₜWₜ] runs from 2.0 to 3.5 along the
  lab's policy), and cross terms sₜ·sᵤ ≠ 0, which vanish only in expectation (proofs/T2_score_orthogonality.md).
* **Long horizon** (``MarkovPolicy``): a policy on (position bucket, previous token) with horizon T in the hundreds and
  EOS probabilities that vary with position, so lengths are heterogeneous. Not enumerable; J and ∇J are exact by
  dynamic programming over (position, previous token) for rewards of the form rₜ = c[t, yₜ] plus f(L) at the end.

Sequences: vocabulary {0 = EOS, 1, …, V−1}; a sequence stops at the first EOS or after T tokens. The response mask is 1
on the L tokens of the sequence (EOS included) and 0 after. Scores are stored in factored form — uₜ = e_{yₜ} − πₜ and
φₜ (a one-hot feature index, or dense features) — and gradients are flattened from Θ's [V, d] layout, row-major
(parameter index v·d + f for the logit v and feature f).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np

__all__ = ["Rollouts", "EnumerablePolicy", "EnumerableTask", "MarkovPolicy", "MarkovTask", "group_gradients",
           "weighted_score_sums"]

EOS = 0


@dataclass(frozen=True)
class Rollouts:
    """Sampled (or enumerated) trajectories with everything the estimators and the gradient need.

    Attributes:
      rewards: [n, T] token rewards.
      response_mask: [n, T] 1 on the sequence's tokens.
      log_probs: [n, T] log π(yₜ) (0 at masked positions).
      sum_pi_squared: [n, T] Σπ² (1 at masked positions, so w = 0 there).
      logit_gradients: [n, T, V] uₜ = e_{yₜ} − πₜ (0 at masked positions).
      feature_index: [n, T] index of the one active feature when φ is one-hot, else None.
      feature_values: [n, T, d] φₜ when φ is dense, else None.
      feature_dim: d (the score sₜ = uₜ ⊗ φₜ has V·d entries).
      cumulative_score_sq_norms: [n, T] ‖Sₜ‖² = ‖Σ_{j≤t} sⱼ‖².
      sequence_score_sq_norms: [n] ‖S(τ)‖² = ‖S_L‖².
      tokens: [n, T] token ids (−1 after the end).
      sequence_ids: [n] index into the enumerated sequences, or −1 for sampled Markov trajectories.
    """

    rewards: np.ndarray
    response_mask: np.ndarray
    log_probs: np.ndarray
    sum_pi_squared: np.ndarray
    logit_gradients: np.ndarray
    feature_index: np.ndarray | None
    feature_values: np.ndarray | None
    feature_dim: int
    cumulative_score_sq_norms: np.ndarray
    sequence_score_sq_norms: np.ndarray
    tokens: np.ndarray
    sequence_ids: np.ndarray

    @property
    def size(self) -> int:
        return int(self.rewards.shape[0])

    @property
    def n_params(self) -> int:
        return int(self.logit_gradients.shape[-1] * self.feature_dim)

    @property
    def token_energy(self) -> np.ndarray:
        """wₜ = 1 − 2πₜ + Σπ²ₜ (0 at masked positions)."""
        return (1.0 - 2.0 * np.exp(self.log_probs) + self.sum_pi_squared) * self.response_mask

    @property
    def score_sq_norms(self) -> np.ndarray:
        """[n, T] ‖sₜ‖² = ‖uₜ‖²·‖φₜ‖²."""
        u_norms = np.sum(np.square(self.logit_gradients), axis=-1)
        if self.feature_values is None:
            return u_norms
        return u_norms * np.sum(np.square(self.feature_values), axis=-1)

    def take(self, rows: np.ndarray) -> "Rollouts":
        """The rollouts at ``rows``."""
        values = {}
        for name in self.__dataclass_fields__:
            value = getattr(self, name)
            values[name] = value[rows] if isinstance(value, np.ndarray) else value
        return Rollouts(**values)

    def dense_scores(self) -> np.ndarray:
        """[n, T, V·d] the per-token score vectors sₜ, explicitly (for small problems and tests)."""
        n, T, V = self.logit_gradients.shape
        if self.feature_values is None:
            phi = np.zeros((n, T, self.feature_dim))
            np.put_along_axis(phi, np.maximum(self.feature_index, 0)[..., None], 1.0, axis=-1)
        else:
            phi = self.feature_values
        return (self.logit_gradients[..., :, None] * phi[..., None, :]).reshape(n, T, V * self.feature_dim)


def group_gradients(rollouts: Rollouts, advantages: np.ndarray, group_index: np.ndarray, n_groups: int,
                    n_params: int | None = None) -> np.ndarray:
    """Per-group policy-gradient estimates  ĝ_g = (1/N_g)·Σ_{i∈g} Σₜ Aₜⁱ·sₜⁱ:  [n_groups, V·d].

    With sₜ = uₜ ⊗ φₜ, ĝ_g = (1/N_g) Σ (Aₜuₜ) φₜᵀ: a scatter-add (``bincount``) when φ is one-hot, a batched matrix
    product when it is dense.

    Args:
      rollouts: the trajectories.
      advantages: [n, T] advantages (0 at masked positions).
      group_index: [n] group of each trajectory, in [0, n_groups).
      n_groups: G.
      n_params: V·d, checked when given.
    """
    if n_params is not None and n_params != rollouts.n_params:
        raise ValueError(f"n_params: the rollouts have {rollouts.n_params} parameters, not {n_params}")
    sizes = np.bincount(group_index, minlength=n_groups).astype(np.float64)
    return weighted_score_sums(rollouts, advantages / sizes[group_index][:, None], group_index, n_groups)


def weighted_score_sums(rollouts: Rollouts, weights: np.ndarray, group_index: np.ndarray,
                        n_groups: int) -> np.ndarray:
    """Σ_{i∈g} Σₜ weights[i, t]·sₜⁱ for every group g: [n_groups, V·d] (no normalisation)."""
    n, T, V = rollouts.logit_gradients.shape
    d = rollouts.feature_dim
    weighted = rollouts.logit_gradients * weights[..., None]                                       # [n, T, V]
    if rollouts.feature_values is None:
        keys = (group_index[:, None, None] * V + np.arange(V)) * d + rollouts.feature_index[..., None]
        flat = np.bincount(keys.ravel(), weights=weighted.ravel(), minlength=n_groups * V * d)
        return flat.reshape(n_groups, V * d)
    per_trajectory = np.einsum("ntv,ntf->nvf", weighted, rollouts.feature_values)                   # [n, V, d]
    return _group_sum(per_trajectory, group_index, n_groups).reshape(n_groups, V * d)


def _group_sum(values: np.ndarray, group_index: np.ndarray, n_groups: int) -> np.ndarray:
    """Σ over trajectories of each group along axis 0 (groups of equal size in order: one reshape)."""
    n = values.shape[0]
    if n % n_groups == 0 and np.array_equal(group_index, np.repeat(np.arange(n_groups), n // n_groups)):
        return values.reshape(n_groups, n // n_groups, *values.shape[1:]).sum(axis=1)
    out = np.zeros((n_groups,) + values.shape[1:])
    np.add.at(out, group_index, values)
    return out


# ----------------------------------------------------------------------------------------------------------------------
# Enumerable policies


def _softmax(logits: np.ndarray) -> np.ndarray:
    shifted = np.exp(logits - logits.max(axis=-1, keepdims=True))
    return shifted / shifted.sum(axis=-1, keepdims=True)


@dataclass(frozen=True)
class EnumerablePolicy:
    """A log-linear autoregressive policy small enough to list every sequence with its probability.

    Use the constructors :meth:`tabular` and :meth:`log_linear`.

    Attributes:
      vocab_size: V (token 0 is EOS).
      horizon: T, the maximum length.
      theta: [V, d] parameters.
      prefix_features: [n_prefixes, d] φ of every prefix the policy acts at.
      parametrization: ``"tabular"`` or ``"log_linear"``.
    """

    vocab_size: int
    horizon: int
    theta: np.ndarray
    prefix_features: np.ndarray
    parametrization: str
    _prefixes: tuple = field(repr=False)

    # -- construction ------------------------------------------------------------------------------------------------

    @staticmethod
    def _enumerate_prefixes(vocab_size: int, horizon: int) -> list[tuple[int, ...]]:
        tokens = range(1, vocab_size)
        return [prefix for length in range(horizon) for prefix in itertools.product(tokens, repeat=length)]

    @classmethod
    def tabular(cls, vocab_size: int = 3, horizon: int = 3, *, seed: int = 0, scale: float = 1.5) -> "EnumerablePolicy":
        """Each prefix owns a logit vector: θ ~ N(0, scale²) per (token, prefix)."""
        _check_sizes(vocab_size, horizon)
        prefixes = cls._enumerate_prefixes(vocab_size, horizon)
        features = np.eye(len(prefixes))
        theta = np.random.default_rng(seed).normal(scale=scale, size=(vocab_size, len(prefixes)))
        return cls(vocab_size, horizon, theta, features, "tabular", tuple(prefixes))

    @classmethod
    def log_linear(cls, vocab_size: int = 3, horizon: int = 3, *, seed: int = 0,
                   scale: float = 1.5) -> "EnumerablePolicy":
        """Shared parameters: φ(y<ₜ) = (1, one-hot(previous token or BOS), t/T, #{j<t: yⱼ = 1}/T)."""
        _check_sizes(vocab_size, horizon)
        prefixes = cls._enumerate_prefixes(vocab_size, horizon)
        dim = 1 + vocab_size + 2
        features = np.zeros((len(prefixes), dim))
        for row, prefix in enumerate(prefixes):
            previous = prefix[-1] if prefix else 0          # slot 0 doubles as BOS (EOS never precedes a token)
            features[row, 0] = 1.0
            features[row, 1 + previous] = 1.0
            features[row, 1 + vocab_size] = len(prefix) / horizon
            features[row, 2 + vocab_size] = sum(token == 1 for token in prefix) / horizon
        theta = np.random.default_rng(seed).normal(scale=scale, size=(vocab_size, dim))
        return cls(vocab_size, horizon, theta, features, "log_linear", tuple(prefixes))

    # -- structure ---------------------------------------------------------------------------------------------------

    @property
    def n_params(self) -> int:
        """P = V·d."""
        return int(self.theta.size)

    @property
    def feature_dim(self) -> int:
        return int(self.prefix_features.shape[1])

    def prefix_probabilities(self) -> np.ndarray:
        """[n_prefixes, V] π(·|prefix)."""
        return _softmax(self.prefix_features @ self.theta.T)

    @cached_property
    def sequences(self) -> "_SequenceTable":
        """Every sequence with its probability, token statistics and exact scores (built once)."""
        return _build_table(self)

    def with_theta(self, theta: np.ndarray) -> "EnumerablePolicy":
        """The same policy with other parameters (e.g. for finite-difference checks)."""
        theta = np.asarray(theta, dtype=np.float64).reshape(self.theta.shape)
        return EnumerablePolicy(self.vocab_size, self.horizon, theta, self.prefix_features, self.parametrization,
                                self._prefixes)

    def task(self, rewards: Any) -> "EnumerableTask":
        """Attach per-token rewards [S, T] (S = number of sequences) to get a task with exact J and ∇J.

        Rewards must be *causal*: rₜ may depend on y≤ₜ only, so sequences sharing their first t+1 tokens must have the
        same rₜ (as token rewards in RL for LLMs do). The reward-to-go form of the policy gradient, E[Σₜ sₜGₜ], which
        OTB and every token-level estimator rely on, holds only then. Build causal rewards with
        :meth:`terminal_rewards` or :meth:`step_rewards`.
        """
        table = self.sequences
        rewards = np.asarray(rewards, dtype=np.float64)
        if rewards.shape != table.mask.shape:
            raise ValueError(f"rewards: expected shape {table.mask.shape} (sequences × horizon), got {rewards.shape}")
        rewards = rewards * table.mask
        valid = table.step_ids >= 0
        ids, values = table.step_ids[valid], rewards[valid]
        low = np.full(table.n_steps, np.inf)
        high = np.full(table.n_steps, -np.inf)
        np.minimum.at(low, ids, values)
        np.maximum.at(high, ids, values)
        if np.any(high - low > 0):
            step = int(np.argmax(high - low))
            raise ValueError(f"rewards: not causal — sequences sharing the step {step} (the same first tokens) have "
                             f"different rewards there ({low[step]!r} and {high[step]!r}); rₜ may depend on y≤ₜ only")
        return EnumerableTask(self, rewards)

    def step_rewards(self, values: Any) -> np.ndarray:
        """[S, T] causal rewards rₜ = values[id of y≤ₜ] (``values`` has one entry per distinct step,
        ``sequences.n_steps``)."""
        table = self.sequences
        values = np.asarray(values, dtype=np.float64)
        if values.shape != (table.n_steps,):
            raise ValueError(f"values: expected shape ({table.n_steps},), one per step y≤ₜ, got {values.shape}")
        return np.where(table.step_ids >= 0, values[np.maximum(table.step_ids, 0)], 0.0)

    def terminal_rewards(self, values: Any) -> np.ndarray:
        """[S, T] rewards with ``values[s]`` on the last token of sequence s and 0 elsewhere."""
        table = self.sequences
        values = np.asarray(values, dtype=np.float64)
        if values.shape != (table.size,):
            raise ValueError(f"values: expected shape ({table.size},), one per sequence, got {values.shape}")
        rewards = np.zeros(table.mask.shape)
        rewards[np.arange(table.size), table.lengths - 1] = values
        return rewards


def _check_sizes(vocab_size: int, horizon: int) -> None:
    if vocab_size < 2:
        raise ValueError(f"vocab_size: need EOS and at least one other token, got {vocab_size}")
    if horizon < 1:
        raise ValueError(f"horizon: must be ≥ 1, got {horizon}")
    count = sum((vocab_size - 1) ** length for length in range(horizon))
    if count * vocab_size > 2_000_000:
        raise ValueError(f"vocab_size={vocab_size}, horizon={horizon}: {count} prefixes is too many to enumerate")


@dataclass(frozen=True)
class _SequenceTable:
    """Every sequence of an :class:`EnumerablePolicy`, padded to the horizon."""

    tokens: np.ndarray            # [S, T], −1 after the end
    lengths: np.ndarray           # [S]
    mask: np.ndarray              # [S, T]
    prefix_ids: np.ndarray        # [S, T] prefix the policy acted at (−1 after the end)
    probabilities: np.ndarray     # [S]
    log_probs: np.ndarray         # [S, T]
    sum_pi_squared: np.ndarray    # [S, T]
    logit_gradients: np.ndarray   # [S, T, V]   e_y − π (0 after the end)
    feature_index: np.ndarray | None        # [S, T] one-hot φ (tabular), else None
    feature_values: np.ndarray | None       # [S, T, d] dense φ (shared parameters), else None
    feature_dim: int
    cumulative_score_sq_norms: np.ndarray   # [S, T]
    step_ids: np.ndarray          # [S, T] id of the step y≤ₜ (shared by sequences with the same first t+1 tokens)
    n_steps: int

    @property
    def size(self) -> int:
        return int(self.lengths.shape[0])


def _build_table(policy: EnumerablePolicy) -> _SequenceTable:
    V, T = policy.vocab_size, policy.horizon
    prefixes = policy._prefixes
    prefix_id = {prefix: row for row, prefix in enumerate(prefixes)}
    sequences = []
    for prefix in prefixes:
        if len(prefix) < T - 1:
            sequences.append(prefix + (EOS,))
        else:                                     # last step: any token, EOS or not, ends the sequence
            sequences.extend(prefix + (token,) for token in range(V))
    S = len(sequences)
    tokens = np.full((S, T), -1, dtype=np.int64)
    prefix_ids = np.full((S, T), -1, dtype=np.int64)
    step_ids = np.full((S, T), -1, dtype=np.int64)
    step_id: dict[tuple[int, ...], int] = {}
    lengths = np.array([len(sequence) for sequence in sequences], dtype=np.int64)
    for row, sequence in enumerate(sequences):
        tokens[row, :len(sequence)] = sequence
        for t in range(len(sequence)):
            prefix_ids[row, t] = prefix_id[sequence[:t]]
            step_ids[row, t] = step_id.setdefault(sequence[:t + 1], len(step_id))
    mask = (tokens >= 0).astype(np.float64)
    probs = policy.prefix_probabilities()                                    # [n_prefixes, V]
    safe_prefix = np.where(prefix_ids >= 0, prefix_ids, 0)
    pi_all = probs[safe_prefix] * mask[..., None]                            # [S, T, V]
    safe_tokens = np.where(tokens >= 0, tokens, 0)
    pi_y = np.take_along_axis(pi_all, safe_tokens[..., None], axis=-1)[..., 0]
    log_probs = np.where(mask > 0, np.log(np.where(mask > 0, pi_y, 1.0)), 0.0)
    spp = np.where(mask > 0, np.sum(np.square(pi_all), axis=-1), 1.0)
    onehot = np.eye(V)[safe_tokens] * mask[..., None]
    logit_gradients = onehot - pi_all                                        # zero after the end
    features = policy.prefix_features[safe_prefix] * mask[..., None]         # [S, T, d]
    one_hot = policy.parametrization == "tabular"
    cumulative = _cumulative_norms(logit_gradients, features, safe_prefix, mask, one_hot)
    return _SequenceTable(tokens, lengths, mask, prefix_ids, np.exp(log_probs.sum(axis=1)), log_probs, spp,
                          logit_gradients, safe_prefix if one_hot else None, None if one_hot else features,
                          policy.feature_dim, cumulative, step_ids, len(step_id))


def _cumulative_norms(logit_gradients: np.ndarray, features: np.ndarray, prefix_ids: np.ndarray, mask: np.ndarray,
                      one_hot: bool) -> np.ndarray:
    """‖Sₜ‖² = Σ_{j,k≤t} (uⱼ·uₖ)(φⱼ·φₖ) from the [T, T] Gram matrices of each sequence."""
    gram_u = np.einsum("stv,suv->stu", logit_gradients, logit_gradients)
    if one_hot:
        gram_phi = (prefix_ids[:, :, None] == prefix_ids[:, None, :]).astype(np.float64)
    else:
        gram_phi = np.einsum("std,sud->stu", features, features)
    gram = gram_u * gram_phi * mask[:, :, None] * mask[:, None, :]
    # ‖Sₜ‖² = sum of the leading (t+1)×(t+1) block of the Gram matrix
    return np.cumsum(np.cumsum(gram, axis=1), axis=2)[:, np.arange(gram.shape[1]), np.arange(gram.shape[1])]


@dataclass(frozen=True)
class EnumerableTask:
    """An :class:`EnumerablePolicy` with per-token rewards: exact J, ∇J and exact sampling.

    Attributes:
      policy: the policy.
      rewards: [S, T] token rewards of every sequence (0 after the end).
    """

    policy: EnumerablePolicy
    rewards: np.ndarray

    @property
    def table(self) -> _SequenceTable:
        return self.policy.sequences

    @property
    def n_params(self) -> int:
        return self.policy.n_params

    @property
    def horizon(self) -> int:
        return self.policy.horizon

    def returns(self) -> np.ndarray:
        """[S, T] Gₜ of every sequence."""
        return np.flip(np.cumsum(np.flip(self.rewards, axis=1), axis=1), axis=1)

    def expected_length(self) -> float:
        """E[L] = Σ_τ π(τ)·L(τ), exactly."""
        return float(self.table.probabilities @ self.table.lengths)

    def objective(self) -> float:
        """J = E[Σₜ rₜ] = Σ_τ π(τ)·R(τ)."""
        return float(self.table.probabilities @ self.rewards.sum(axis=1))

    def gradient(self) -> np.ndarray:
        """∇J = E[S(τ)·R(τ)] with S(τ) = Σₜ sₜ and R(τ) = Σₜ rₜ (the score-function identity), exactly: [P].

        Computed from the total return, so it does not presuppose the reward-to-go form E[Σₜ sₜGₜ]; the two agree for
        causal rewards, which the unbiasedness tests of REINFORCE check.
        """
        rollouts = self.all_rollouts()
        weights = (self.table.probabilities * self.rewards.sum(axis=1))[:, None] * rollouts.response_mask
        return weighted_score_sums(rollouts, weights, np.zeros(rollouts.size, dtype=np.int64), 1)[0]

    def all_rollouts(self) -> Rollouts:
        """Every sequence once (use ``table.probabilities`` as weights)."""
        table = self.table
        return Rollouts(self.rewards, table.mask, table.log_probs, table.sum_pi_squared, table.logit_gradients,
                        table.feature_index, table.feature_values, table.feature_dim, table.cumulative_score_sq_norms,
                        table.cumulative_score_sq_norms[np.arange(table.size), table.lengths - 1],
                        table.tokens, np.arange(table.size))

    def sample(self, n: int, rng: np.random.Generator) -> Rollouts:
        """n independent trajectories (inverse-CDF sampling over the enumerated sequences)."""
        cdf = np.cumsum(self.table.probabilities)
        ids = np.minimum(np.searchsorted(cdf, rng.uniform(0.0, cdf[-1], size=n), side="right"), self.table.size - 1)
        return self.all_rollouts().take(ids)


# ----------------------------------------------------------------------------------------------------------------------
# Long-horizon Markov policy


@dataclass(frozen=True)
class MarkovPolicy:
    """π(yₜ | y<ₜ) = softmax(Θ[bucket(t), yₜ₋₁])  — a policy on (position bucket, previous token).

    Attributes:
      vocab_size: V (token 0 = EOS).
      horizon: T (hundreds are fine).
      theta: [n_buckets, V, V] logits; the previous-token slot 0 means BOS at t = 0 (EOS never precedes a token).
      bucket_of_position: [T] bucket of each position (buckets = T: per-position parameters, the proxy is exact;
        fewer buckets share parameters across positions).
    """

    vocab_size: int
    horizon: int
    theta: np.ndarray
    bucket_of_position: np.ndarray

    @classmethod
    def random(cls, vocab_size: int = 4, horizon: int = 200, *, n_buckets: int = 8, seed: int = 0,
               scale: float = 1.0, eos_ramp: tuple[float, float] = (-6.0, 1.0)) -> "MarkovPolicy":
        """Random Θ, with the EOS logit ramping from ``eos_ramp[0]`` to ``eos_ramp[1]`` across buckets so that
        lengths spread over the whole horizon."""
        if vocab_size < 2 or horizon < 1 or n_buckets < 1:
            raise ValueError("vocab_size ≥ 2, horizon ≥ 1 and n_buckets ≥ 1 are required")
        rng = np.random.default_rng(seed)
        theta = rng.normal(scale=scale, size=(n_buckets, vocab_size, vocab_size))
        theta[:, :, EOS] += np.linspace(*eos_ramp, n_buckets)[:, None]
        buckets = np.minimum((np.arange(horizon) * n_buckets) // horizon, n_buckets - 1)
        return cls(vocab_size, horizon, theta, buckets)

    @property
    def n_params(self) -> int:
        return int(self.theta.size)

    def flatten(self, per_parameter: np.ndarray) -> np.ndarray:
        """[n_buckets, V(previous), V(next)] → the score layout [V(next), d] (f = bucket·V + previous), row-major."""
        per_parameter = np.asarray(per_parameter).reshape(self.theta.shape)
        return np.transpose(per_parameter, (2, 0, 1)).reshape(self.vocab_size, -1).ravel()

    def probabilities(self) -> np.ndarray:
        """[T, V(previous), V(next)] π(next | t, previous)."""
        return _softmax(self.theta[self.bucket_of_position])

    def task(self, token_rewards: Any = None, length_rewards: Any = None) -> "MarkovTask":
        """Rewards rₜ = token_rewards[t, yₜ] plus length_rewards[L] on the last token (L = 1 … T; entry 0 unused)."""
        T, V = self.horizon, self.vocab_size
        token = np.zeros((T, V)) if token_rewards is None else np.asarray(token_rewards, dtype=np.float64)
        length = np.zeros(T + 1) if length_rewards is None else np.asarray(length_rewards, dtype=np.float64)
        if token.shape != (T, V):
            raise ValueError(f"token_rewards: expected shape {(T, V)}, got {token.shape}")
        if length.shape != (T + 1,):
            raise ValueError(f"length_rewards: expected shape {(T + 1,)} (index = length), got {length.shape}")
        return MarkovTask(self, token, length)


@dataclass(frozen=True)
class MarkovTask:
    """A :class:`MarkovPolicy` with rewards: exact J and ∇J by dynamic programming, fast sampling."""

    policy: MarkovPolicy
    token_rewards: np.ndarray
    length_rewards: np.ndarray

    @property
    def n_params(self) -> int:
        return self.policy.n_params

    @property
    def horizon(self) -> int:
        return self.policy.horizon

    def _values(self) -> tuple[np.ndarray, np.ndarray]:
        """β[t, a] = E[Gₜ | alive at step t, previous token a] and Q[t, y] = E[Gₜ | yₜ = y] (independent of a).

        Taking y at step t earns token_rewards[t, y]; the sequence then ends (length t + 1, earning
        length_rewards[t + 1]) if y is EOS or t is the last step, and otherwise continues from (t + 1, y).
        """
        T, V = self.policy.horizon, self.policy.vocab_size
        probs = self.policy.probabilities()
        beta = np.zeros((T + 1, V))
        q = np.zeros((T, V))
        for t in range(T - 1, -1, -1):
            future = np.full(V, self.length_rewards[t + 1]) if t == T - 1 else beta[t + 1].copy()
            future[EOS] = self.length_rewards[t + 1]
            q[t] = self.token_rewards[t] + future
            beta[t] = probs[t] @ q[t]
        return beta, q

    def _occupancy(self) -> np.ndarray:
        """α[t, a] = P(alive at step t with previous token a) (a = 0 is BOS at t = 0)."""
        T, V = self.policy.horizon, self.policy.vocab_size
        probs = self.policy.probabilities()
        alpha = np.zeros((T, V))
        alpha[0, 0] = 1.0
        for t in range(T - 1):
            moved = alpha[t] @ probs[t]              # next-token distribution
            moved[EOS] = 0.0                         # EOS ends the sequence
            alpha[t + 1] = moved
        return alpha

    def objective(self) -> float:
        return float(self._values()[0][0, 0])

    def expected_length(self) -> float:
        """E[L] = Σₜ P(alive at step t) = Σₜ Σₐ α[t, a], exactly (dynamic programming)."""
        return float(self._occupancy().sum())

    def gradient(self) -> np.ndarray:
        """∇J = Σₜ Σₐ α[t,a] Σ_y π(y|t,a)(e_y − π(·|t,a)) Q[t,y], in the [V(next), d] layout with feature
        f = bucket·V + previous token (the layout of the rollouts' scores), flattened row-major."""
        probs = self.policy.probabilities()
        _, q = self._values()
        alpha = self._occupancy()
        # Σ_y π_y (e_y − π) Q_y = π ⊙ (Q − π·Q)   per (t, a)
        expected_q = probs @ q[:, :, None]                                    # [T, V(prev), 1]
        per_position = alpha[:, :, None] * probs * (q[:, None, :] - expected_q)   # [T, V(prev), V(next)]
        gradient = np.zeros_like(self.policy.theta)                             # [bucket, previous, next]
        np.add.at(gradient, self.policy.bucket_of_position, per_position)
        return self.policy.flatten(gradient)

    def sample(self, n: int, rng: np.random.Generator) -> Rollouts:
        """n trajectories, sampled step by step (vectorized over trajectories)."""
        policy = self.policy
        T, V = policy.horizon, policy.vocab_size
        n_buckets = policy.theta.shape[0]
        probs = policy.probabilities()                                        # [T, V, V]
        cdf = np.cumsum(probs, axis=2)
        tokens = np.full((n, T), -1, dtype=np.int64)
        previous = np.zeros(n, dtype=np.int64)
        alive = np.ones(n, dtype=bool)
        for t in range(T):
            rows = np.flatnonzero(alive)
            if rows.size == 0:
                break
            draws = rng.uniform(size=rows.size) * cdf[t, previous[rows], -1]
            chosen = np.minimum((draws[:, None] > cdf[t, previous[rows]]).sum(axis=1), V - 1)
            tokens[rows, t] = chosen
            previous[rows] = chosen
            alive[rows] = chosen != EOS
        mask = (tokens >= 0).astype(np.float64)
        lengths = mask.sum(axis=1).astype(np.int64)
        prev = np.concatenate([np.zeros((n, 1), dtype=np.int64), np.maximum(tokens[:, :-1], 0)], axis=1)
        positions = np.broadcast_to(np.arange(T), (n, T))
        safe_tokens = np.maximum(tokens, 0)
        pi_all = probs[positions, prev] * mask[..., None]                     # [n, T, V]
        pi_y = np.take_along_axis(pi_all, safe_tokens[..., None], axis=-1)[..., 0]
        log_probs = np.where(mask > 0, np.log(np.where(mask > 0, pi_y, 1.0)), 0.0)
        spp = np.where(mask > 0, np.sum(np.square(pi_all), axis=-1), 1.0)
        logit_gradients = (np.eye(V)[safe_tokens] - pi_all) * mask[..., None]
        block = policy.bucket_of_position[positions] * V + prev               # which Θ[bucket, prev] row
        rewards = self.token_rewards[positions, safe_tokens] * mask
        rewards[np.arange(n), lengths - 1] += self.length_rewards[lengths]
        cumulative = _markov_cumulative_norms(logit_gradients, block, mask, n_buckets * V)
        return Rollouts(rewards, mask, log_probs, spp, logit_gradients, block.astype(np.int64), None, n_buckets * V,
                        cumulative,
                        cumulative[np.arange(n), lengths - 1], tokens, np.full(n, -1, dtype=np.int64))


def _markov_cumulative_norms(logit_gradients: np.ndarray, block: np.ndarray, mask: np.ndarray,
                             n_blocks: int) -> np.ndarray:
    """‖Sₜ‖² by running per-block sums: ‖Sₜ‖² = ‖Sₜ₋₁‖² + 2uₜ·Sₜ₋₁[blockₜ] + ‖uₜ‖²."""
    del mask  # masked tokens have u = 0 and change nothing
    n, T, V = logit_gradients.shape
    running = np.zeros((n, n_blocks, V))
    norms = np.zeros((n, T))
    total = np.zeros(n)
    rows = np.arange(n)
    for t in range(T):
        u = logit_gradients[:, t]
        b = block[:, t]
        total = total + 2.0 * np.einsum("nv,nv->n", u, running[rows, b]) + np.einsum("nv,nv->n", u, u)
        running[rows, b] += u
        norms[:, t] = total
    return norms          # after the end u = 0, so the total carries, like the realized energy
