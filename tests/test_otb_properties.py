"""Structural properties of the OTB baselines, each true for every input the strategies draw.

Tolerances come from :func:`otb_spec.tolerances.otb_tolerance` (a forward error bound in float64); elements the bound
marks ill-conditioned are not compared.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import assume, given, note
from hypothesis import strategies as st

import otb_spec as otb
from otb_spec import strategies as otb_st
from otb_spec.tolerances import otb_tolerance

VARIANTS = {
    "single_turn": (otb.optimal_token_baseline, dict(align="position", leave_one_out=False)),
    "multi_turn": (otb.multi_turn_optimal_token_baseline, dict(align="valid_token", leave_one_out=False)),
    "leave_one_out": (otb.leave_one_out_token_baseline, dict(align="position", leave_one_out=True)),
}


def _run(variant, batch, **options):
    function, _ = VARIANTS[variant]
    return function(batch.rewards, batch.response_mask, batch.group_ids, batch.log_probs, batch.sum_pi_squared,
                    is_weights=batch.is_weights, **options)


def _tolerance(variant, batch, **options):
    _, bound_options = VARIANTS[variant]
    zero_tail = options.get("handle_zero_tail", True)
    advantages, _ = otb_tolerance(batch.rewards, batch.response_mask, batch.group_ids, batch.log_probs,
                                  batch.sum_pi_squared, is_weights=batch.is_weights, dtype=np.float64,
                                  epsilon=options.get("epsilon", 1e-8), handle_zero_tail=zero_tail, **bound_options)
    return advantages + advantages


def _subset(batch, rows):
    """The batch restricted to ``rows`` (in that order)."""
    def take(array):
        return None if array is None else np.asarray(array)[rows]
    return otb.RolloutBatch(rewards=take(batch.rewards), response_mask=take(batch.response_mask),
                            group_ids=take(batch.group_ids), log_probs=take(batch.log_probs),
                            sum_pi_squared=take(batch.sum_pi_squared), is_weights=take(batch.is_weights))


variants = st.sampled_from(sorted(VARIANTS))


@pytest.mark.bitexact
@given(batch=otb_st.rollout_batches(), variant=variants, data=st.data())
def test_permuting_trajectories_permutes_the_results(batch, variant, data):
    """Reordering the batch (within and across groups) reorders advantages and changes nothing else."""
    order = np.array(data.draw(st.permutations(range(batch.batch_size)), label="permutation"))
    original = _run(variant, batch)
    permuted = _run(variant, _subset(batch, order))
    tolerance = _tolerance(variant, batch)
    permuted_tolerance = type(tolerance)(tolerance.rtol, np.asarray(tolerance.atol)[order], tolerance.reason)
    permuted_tolerance.assert_close(permuted.advantages, original.advantages[order], "permuted advantages")
    np.testing.assert_array_equal(permuted.returns, original.returns[order])


@pytest.mark.bitexact
@given(batch=otb_st.rollout_batches(min_groups=2), variant=variants, data=st.data())
def test_groups_are_independent(batch, variant, data):
    """Dropping other groups leaves a group's results bit-for-bit unchanged (segment sums never mix groups)."""
    ids = np.asarray(batch.group_ids, dtype=object)
    distinct = list(dict.fromkeys(ids.tolist()))
    keep = data.draw(st.lists(st.sampled_from(distinct), min_size=1, unique=True), label="groups kept")
    rows = np.flatnonzero([value in keep for value in ids.tolist()])
    full = _run(variant, batch)
    part = _run(variant, _subset(batch, rows))
    np.testing.assert_array_equal(part.advantages, full.advantages[rows])
    np.testing.assert_array_equal(part.baselines, full.baselines[rows])


@given(batch=otb_st.rollout_batches(), variant=variants, epsilon=st.sampled_from([0.0, 1e-8, 0.5]))
def test_baseline_is_a_shrunk_convex_combination_of_the_valid_returns(batch, variant, epsilon):
    """Bₜ = λ·Σ cᵢGₜⁱ with cᵢ ≥ 0, Σcᵢ = 1 over the members valid at t (the others for leave-one-out) and
    λ = ΣW/(ΣW + ε) ∈ [0, 1]: so Bₜ lies between min(0, minᵢ Gₜⁱ) and max(0, maxᵢ Gₜⁱ) — with ε = 0, between the
    minimum and maximum themselves (where some member has energy)."""
    result = _run(variant, batch, epsilon=epsilon)
    tolerance = np.asarray(_tolerance(variant, batch, epsilon=epsilon).atol)
    mask = np.asarray(batch.response_mask, dtype=bool)
    ids = np.asarray(batch.group_ids, dtype=object).tolist()
    returns = result.returns
    energy = otb.realized_energy(otb.token_energy(np.where(mask, batch.log_probs, 0.0),
                                                  np.where(mask, batch.sum_pi_squared, 1.0)),
                                 mask, is_weights=batch.is_weights)
    for i in range(batch.batch_size):
        for t in np.flatnonzero(mask[i]):
            if result.baselines[i, t] == 0.0 or not np.isfinite(tolerance[i, t]):
                continue
            if variant == "multi_turn":
                continue  # checked through test_multi_turn_equals_single_turn_on_prefix_masks and the oracle
            peers = [j for j in range(batch.batch_size) if ids[j] == ids[i] and mask[j, t]
                     and (variant != "leave_one_out" or j != i)]
            values = returns[peers, t]
            low, high = values.min(), values.max()
            if epsilon > 0 or energy[peers, t].sum() <= 0:
                low, high = min(low, 0.0), max(high, 0.0)
            assert low - tolerance[i, t] <= result.baselines[i, t] <= high + tolerance[i, t], (i, t)


@given(batch=otb_st.rollout_batches(), scale=st.sampled_from([1e-3, 0.5, 3.0, 1e4]),
       align=st.sampled_from(["position", "valid_token"]), leave_one_out=st.booleans(),
       epsilon=st.sampled_from([0.0, 1e-8, 0.1]))
def test_scaling_the_energy_is_the_same_as_scaling_epsilon(batch, scale, align, leave_one_out, epsilon):
    """B(c·W, ε) = B(W, ε/c): the baseline only sees energy ratios; with ε = 0, scaling W changes nothing."""
    mask = batch.response_mask
    returns = otb.returns_to_go(batch.rewards, mask)
    energy = otb.realized_energy(otb.token_energy(np.where(mask, batch.log_probs, 0.0),
                                                  np.where(mask, batch.sum_pi_squared, 1.0)), mask)
    scaled = otb.token_baseline(returns, scale * energy, mask, batch.group_ids, align=align,
                                leave_one_out=leave_one_out, epsilon=epsilon)
    reference = otb.token_baseline(returns, energy, mask, batch.group_ids, align=align,
                                   leave_one_out=leave_one_out, epsilon=epsilon / scale)
    bound, _ = otb_tolerance(batch.rewards, mask, batch.group_ids, np.where(mask, batch.log_probs, 0.0),
                             np.where(mask, batch.sum_pi_squared, 1.0), dtype=np.float64, align=align,
                             leave_one_out=leave_one_out, handle_zero_tail=not leave_one_out,
                             epsilon=epsilon / scale)
    (bound + bound + bound).assert_close(scaled.baselines, reference.baselines, "baselines with scaled energy")


@given(batch=otb_st.rollout_batches(), scale=st.sampled_from([0.5, 2.0, 7.0]))
def test_scaling_importance_weights_is_the_same_as_scaling_epsilon(batch, scale):
    """ρ enters squared: B(s·ρ, ε) = B(ρ, ε/s²)."""
    assume(batch.is_weights is not None)
    scaled = otb.optimal_token_baseline(batch.rewards, batch.response_mask, batch.group_ids, batch.log_probs,
                                        batch.sum_pi_squared, is_weights=scale * np.asarray(batch.is_weights))
    reference = otb.optimal_token_baseline(batch.rewards, batch.response_mask, batch.group_ids, batch.log_probs,
                                           batch.sum_pi_squared, is_weights=batch.is_weights,
                                           epsilon=1e-8 / scale**2)
    bound, _ = otb_tolerance(batch.rewards, batch.response_mask, batch.group_ids, batch.log_probs,
                             batch.sum_pi_squared, is_weights=batch.is_weights, dtype=np.float64,
                             epsilon=1e-8 / scale**2)
    (bound + bound + bound).assert_close(scaled.advantages, reference.advantages, "advantages with scaled ρ")


@given(batch=otb_st.rollout_batches(padding="right", holes=False, empty_rows=False, reward_style="terminal",
                                    is_weights=False), data=st.data())
def test_constant_energy_and_equal_lengths_make_otb_the_group_mean(batch, data):
    """With the same w at every token and every member of a group the same length, Wₜ is equal across the group,
    so Bₜ (ε = 0) is the group mean of Gₜ; with terminal rewards that is Rᵢ − mean R, Dr. GRPO's advantage."""
    n_positions = batch.n_positions
    mask = np.ones((batch.batch_size, n_positions))
    pi = data.draw(st.floats(0.01, 0.99), label="π")
    log_probs = np.full(mask.shape, np.log(pi))
    spp = np.full(mask.shape, pi**2 + (1 - pi) ** 2)
    rewards = np.zeros(mask.shape)
    rewards[:, -1] = np.asarray(batch.rewards).sum(axis=1)
    result = otb.optimal_token_baseline(rewards, mask, batch.group_ids, log_probs, spp, epsilon=0.0)
    expected = otb.group_mean_advantage(rewards, mask, batch.group_ids)
    bound, _ = otb_tolerance(rewards, mask, batch.group_ids, log_probs, spp, dtype=np.float64, epsilon=0.0)
    (bound + bound).assert_close(result.advantages, expected.advantages, "OTB vs group mean")


@pytest.mark.bitexact
@given(batch=otb_st.rollout_batches(padding="right", holes=False), handle_zero_tail=st.booleans(),
       epsilon=st.sampled_from([0.0, 1e-8, 1.0]))
def test_multi_turn_equals_single_turn_on_prefix_masks(batch, handle_zero_tail, epsilon):
    """When every mask is a prefix (right padding, no holes) the compacted index is the position, so TIR-OTB is
    single-turn OTB — exactly, provided that no group is left with a single non-empty member while
    handle_zero_tail=False (see the next test for that documented exception)."""
    mask = np.asarray(batch.response_mask)
    ids = np.asarray(batch.group_ids, dtype=object).tolist()
    nonempty = {}
    for i, group in enumerate(ids):
        nonempty.setdefault(group, []).append(mask[i].sum() > 0)
    lonely = any(sum(flags) == 1 and len(flags) > 1 for flags in nonempty.values())
    assume(handle_zero_tail or not lonely)
    single = _run("single_turn", batch, handle_zero_tail=handle_zero_tail, epsilon=epsilon)
    multi = _run("multi_turn", batch, handle_zero_tail=handle_zero_tail, epsilon=epsilon)
    np.testing.assert_array_equal(multi.advantages, single.advantages)
    np.testing.assert_array_equal(multi.returns, single.returns)


@pytest.mark.bitexact
def test_multi_turn_differs_from_single_turn_when_only_one_member_is_nonempty():
    """The exception to the identity above, recorded in docs/verl-differences.md: with handle_zero_tail=False, a group
    whose only non-empty member has an empty partner is a singleton for TIR (baseline 0) but not for single-turn
    (baseline G·W/(W + ε) ≈ G). With the default handle_zero_tail=True both give baseline 0."""
    half = np.full((2, 2), 0.5)
    args = ([[0, 1], [0, 0]], [[1, 1], [0, 0]], ["g", "g"], np.log(half), half)
    single = otb.optimal_token_baseline(*args, handle_zero_tail=False)
    multi = otb.multi_turn_optimal_token_baseline(*args, handle_zero_tail=False)
    np.testing.assert_array_equal(multi.advantages[0], [1.0, 1.0])
    assert np.all(np.abs(single.advantages[0]) < 1e-7)
    for function in (otb.optimal_token_baseline, otb.multi_turn_optimal_token_baseline):
        np.testing.assert_array_equal(function(*args).advantages[0], [1.0, 1.0])


def _proxy_energy(batch):
    """Wₜ from the batch's token statistics (masked positions neutralised)."""
    mask = np.asarray(batch.response_mask) > 0
    weights = None if batch.is_weights is None else np.where(mask, batch.is_weights, 0.0)
    return otb.realized_energy(otb.token_energy(np.where(mask, batch.log_probs, 0.0),
                                                np.where(mask, batch.sum_pi_squared, 1.0)), mask, is_weights=weights)


@given(batch=otb_st.rollout_batches(min_group_size=2, max_group_size=2))
def test_leave_one_out_with_two_members_uses_exactly_the_other(batch):
    """For N = 2 and ε = 0, member i's baseline at t is the other member's Gₜ wherever the other is valid at t and
    has energy there, and 0 where the other is not valid."""
    result = otb.leave_one_out_token_baseline(batch.rewards, batch.response_mask, batch.group_ids, batch.log_probs,
                                              batch.sum_pi_squared, is_weights=batch.is_weights, epsilon=0.0)
    mask = np.asarray(batch.response_mask) > 0
    ids = np.asarray(batch.group_ids, dtype=object).tolist()
    energy = _proxy_energy(batch)
    tolerance = np.asarray(_tolerance("leave_one_out", batch, epsilon=0.0).atol)
    for i in range(batch.batch_size):
        j = next(k for k in range(batch.batch_size) if k != i and ids[k] == ids[i])
        for t in np.flatnonzero(mask[i]):
            if not mask[j, t]:
                assert result.baselines[i, t] == 0.0
            elif energy[j, t] > 0:
                assert abs(result.baselines[i, t] - result.returns[j, t]) <= tolerance[i, t], (i, t)


@given(batch=otb_st.rollout_batches(min_group_size=2, max_group_size=2))
def test_leave_one_out_with_two_members_valid_token_alignment(batch):
    """The valid-token version of the previous property: the k-th valid token of one member is compared with the
    k-th valid token of the other."""
    result = otb.leave_one_out_token_baseline(batch.rewards, batch.response_mask, batch.group_ids, batch.log_probs,
                                              batch.sum_pi_squared, is_weights=batch.is_weights,
                                              align="valid_token", epsilon=0.0)
    mask = np.asarray(batch.response_mask) > 0
    ids = np.asarray(batch.group_ids, dtype=object).tolist()
    energy = _proxy_energy(batch)
    bound, _ = otb_tolerance(batch.rewards, batch.response_mask, batch.group_ids, batch.log_probs,
                             batch.sum_pi_squared, is_weights=batch.is_weights, dtype=np.float64, epsilon=0.0,
                             align="valid_token", leave_one_out=True, handle_zero_tail=False)
    tolerance = 2 * np.asarray(bound.atol)
    for i in range(batch.batch_size):
        j = next(k for k in range(batch.batch_size) if k != i and ids[k] == ids[i])
        own_baselines, own_tolerance = result.baselines[i][mask[i]], tolerance[i][mask[i]]
        other_returns, other_energy = result.returns[j][mask[j]], energy[j][mask[j]]
        for k in range(own_baselines.shape[0]):
            if k >= other_returns.shape[0]:
                assert own_baselines[k] == 0.0
            elif other_energy[k] > 0:
                assert abs(own_baselines[k] - other_returns[k]) <= own_tolerance[k], (i, k)


@given(batch=otb_st.rollout_batches(), variant=variants)
def test_masked_positions_are_exactly_zero(batch, variant):
    result = _run(variant, batch)
    masked = np.asarray(batch.response_mask) == 0
    assert np.all(result.advantages[masked] == 0.0)
    assert np.all(result.baselines[masked] == 0.0)
    assert np.isfinite(result.advantages).all() and np.isfinite(result.baselines).all()


@given(batch=otb_st.rollout_batches(), variant=variants)
def test_inputs_are_never_modified(batch, variant):
    """Inputs are read-only views during the call (any write would raise) and compare equal afterwards."""
    arrays = {name: np.array(getattr(batch, name), copy=True) for name in
              ("rewards", "response_mask", "group_ids", "log_probs", "sum_pi_squared")}
    frozen = {}
    for name, array in arrays.items():
        view = array.view()
        view.flags.writeable = False
        frozen[name] = view
    weights = None
    if batch.is_weights is not None:
        weights = np.array(batch.is_weights, copy=True)
        weights.flags.writeable = False
    function, _ = VARIANTS[variant]
    function(frozen["rewards"], frozen["response_mask"], frozen["group_ids"], frozen["log_probs"],
             frozen["sum_pi_squared"], is_weights=weights)
    for name, array in arrays.items():
        np.testing.assert_array_equal(array, np.asarray(getattr(batch, name)), err_msg=name)


@pytest.mark.bitexact
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_low_precision_inputs_are_read_exactly(dtype):
    """float32/float16 inputs are converted exactly to float64: the result equals the float64 call on the same
    (rounded) values, bit for bit."""
    rng = np.random.default_rng(3)
    mask = (rng.uniform(size=(6, 9)) < 0.8).astype(dtype)
    pi = rng.uniform(0.05, 0.95, size=(6, 9))
    log_probs = np.log(pi).astype(dtype)
    spp = np.minimum(np.exp(2 * log_probs.astype(np.float64)) + 0.1, 1.0).astype(dtype)
    rewards = rng.normal(size=(6, 9)).astype(dtype)
    ids = [0, 1, 0, 1, 2, 2]
    low = otb.optimal_token_baseline(rewards, mask, ids, log_probs, spp)
    high = otb.optimal_token_baseline(*(np.asarray(a, dtype=np.float64) for a in (rewards, mask)), ids,
                                      log_probs.astype(np.float64), spp.astype(np.float64))
    np.testing.assert_array_equal(low.advantages, high.advantages)
    assert low.advantages.dtype == np.float64


@pytest.mark.bitexact
@given(batch=otb_st.rollout_batches(), variant=variants, extra_rows=st.integers(0, 3),
       extra_positions=st.integers(0, 3))
def test_padding_changes_nothing(batch, variant, extra_rows, extra_positions):
    """Appending empty rows (each its own group) and masked positions at the end leaves the real results unchanged —
    what lets JAX callers pad to fixed shapes."""
    B, T = batch.batch_size, batch.n_positions
    pad = [(0, extra_rows), (0, extra_positions)]
    ids = np.concatenate([np.asarray(batch.group_ids, dtype=object),
                          np.array([("padding", k) for k in range(extra_rows)] + [None], dtype=object)[:-1]])
    padded = otb.RolloutBatch(
        rewards=np.pad(np.asarray(batch.rewards, dtype=np.float64), pad), response_mask=np.pad(batch.response_mask, pad),
        group_ids=ids, log_probs=np.pad(batch.log_probs, pad), sum_pi_squared=np.pad(batch.sum_pi_squared, pad),
        is_weights=None if batch.is_weights is None else np.pad(batch.is_weights, pad))
    original = _run(variant, batch)
    bigger = _run(variant, padded)
    np.testing.assert_array_equal(bigger.advantages[:B, :T], original.advantages)
    np.testing.assert_array_equal(bigger.returns[:B, :T], original.returns)
