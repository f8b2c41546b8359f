"""otb_spec.distributed: the shard → combine protocol reproduces the single-process reference for every split.

Properties: for any partition of the rows (groups scattered, unequal) and any cut of the columns, every shard's
(advantages, returns, baselines) equal the matching block of the one-process result within the reference's error
bound for any summation order; the merges are associative and commutative; bad arguments are named. A meta-test shows
that deciding the zero tail from one shard's own rows — the natural porting bug — is caught.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import otb_spec as otb
from otb_spec import distributed as spec
from otb_spec import strategies
from otb_spec.groups import group_segments
from otb_spec.tolerances import Tolerance, otb_comparison_tolerance

pytestmark = pytest.mark.distributed


def _reference(batch, *, align, leave_one_out):
    if leave_one_out:
        return otb.leave_one_out_token_baseline(batch.rewards, batch.response_mask, batch.group_ids, batch.log_probs,
                                                batch.sum_pi_squared, is_weights=batch.is_weights, align=align)
    function = otb.optimal_token_baseline if align == "position" else otb.multi_turn_optimal_token_baseline
    return function(batch.rewards, batch.response_mask, batch.group_ids, batch.log_probs, batch.sum_pi_squared,
                    is_weights=batch.is_weights)


@st.composite
def _splits(draw, rows: int, columns: int):
    shards = draw(st.integers(1, min(rows, 4)))
    order = np.asarray(draw(st.permutations(range(rows))), dtype=np.int64)
    cuts = sorted(draw(st.lists(st.integers(1, rows - 1), min_size=shards - 1, max_size=shards - 1, unique=True))) \
        if rows > 1 else []
    row_shards = [order[a:b] for a, b in zip([0, *cuts], [*cuts, rows])]
    pieces = draw(st.integers(1, min(columns, 4)))
    column_cuts = sorted(draw(st.lists(st.integers(1, columns - 1), min_size=pieces - 1, max_size=pieces - 1,
                                       unique=True))) if columns > 1 else []
    return row_shards, column_cuts


@settings(max_examples=60)
@given(data=st.data(), align=st.sampled_from(["position", "valid_token"]), leave_one_out=st.booleans())
def test_any_split_equals_one_process(data, align, leave_one_out):
    batch = data.draw(strategies.rollout_batches(max_groups=4, max_group_size=5, max_length=10))
    row_shards, column_cuts = data.draw(_splits(*batch.rewards.shape))
    results = spec.sharded_token_baseline(batch.rewards, batch.response_mask, batch.group_ids, batch.log_probs,
                                          batch.sum_pi_squared, row_shards=row_shards, column_cuts=column_cuts,
                                          is_weights=batch.is_weights, align=align, leave_one_out=leave_one_out)
    expected = _reference(batch, align=align, leave_one_out=leave_one_out)
    advantage_tol, returns_tol = otb_comparison_tolerance(
        batch.rewards, batch.response_mask, batch.group_ids, batch.log_probs, batch.sum_pi_squared,
        is_weights=batch.is_weights, align=align, leave_one_out=leave_one_out, handle_zero_tail=not leave_one_out,
        compute_dtype=np.float64)
    for rows, shard in zip(row_shards, results):
        advantages = np.concatenate([piece.advantages for piece in shard], axis=1)
        returns = np.concatenate([piece.returns for piece in shard], axis=1)
        assert advantages.shape == (len(rows), batch.rewards.shape[1])
        atol = np.asarray(advantage_tol.atol)[rows]
        np.testing.assert_array_less(np.abs(advantages - expected.advantages[rows]),
                                     atol + advantage_tol.rtol * np.abs(expected.advantages[rows]) + 1e-300)
        atol = np.asarray(returns_tol.atol)[rows]
        np.testing.assert_array_less(np.abs(returns - expected.returns[rows]),
                                     atol + returns_tol.rtol * np.abs(expected.returns[rows]) + 1e-300)


@settings(max_examples=40)
@given(data=st.data(), align=st.sampled_from(["position", "valid_token"]))
def test_length_merge_is_associative_and_commutative(data, align):
    groups = data.draw(st.integers(1, 4))
    shards = []
    for _ in range(3):
        lengths = np.asarray(data.draw(st.lists(st.integers(0, 6), min_size=1, max_size=5)), dtype=np.int64)
        ids = np.asarray(data.draw(st.lists(st.integers(0, groups - 1), min_size=lengths.size,
                                            max_size=lengths.size)), dtype=np.int64)
        shards.append((lengths, ids))
    a, b, c = (spec.shard_group_lengths(lengths, ids, num_groups=groups, align=align) for lengths, ids in shards)
    whole = spec.shard_group_lengths(np.concatenate([s[0] for s in shards]), np.concatenate([s[1] for s in shards]),
                                     num_groups=groups, align=align)
    for merged in (spec.combine_group_lengths([spec.combine_group_lengths([a, b]), c]),
                   spec.combine_group_lengths([a, spec.combine_group_lengths([b, c])]),
                   spec.combine_group_lengths([c, a, b])):
        for field, expected in zip(merged, whole):
            np.testing.assert_array_equal(field, expected)


def test_context_scans_worked_example():
    """One row split in two: r = (0, 1 | 0, 2), m = (1, 1 | 0, 1), w = ½: G = (3, 3 | 2, 2), W = (½, 1 | 1, 1.5)."""
    half = np.full((1, 2), 0.5)
    first = ([[0.0, 1.0]], [[1, 1]], np.log(half), half)
    second = ([[0.0, 2.0]], [[0, 1]], np.log(half), half)
    totals = [spec.context_shard_totals(*first), spec.context_shard_totals(*second)]
    for shard, (arguments, returns, energy) in enumerate([(first, [3.0, 3.0], [0.5, 1.0]),
                                                          (second, [2.0, 2.0], [1.0, 1.5])]):
        offsets = spec.context_offsets(totals, [2, 2], shard)
        got_returns, got_energy = spec.context_shard_returns_and_energy(*arguments, offsets)
        assert got_returns.tolist() == [returns] and got_energy.tolist() == [energy]
        assert offsets.length.tolist() == [3] and offsets.columns_before == 2 * shard


def test_zero_tail_from_local_lengths_is_caught():
    """The porting bug "each shard decides the zero tail from its own rows" changes the result; the protocol's
    merged lengths do not."""
    mask = np.array([[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 0, 0], [1, 1, 0, 0, 0, 0]], float)
    half = np.full(mask.shape, 0.5)
    rewards = np.arange(24.0).reshape(4, 6) % 3
    ids = np.zeros(4, np.int64)
    expected = otb.optimal_token_baseline(rewards, mask, ids, np.log(half), half)
    shards = [np.array([0, 1]), np.array([2, 3])]
    results = spec.sharded_token_baseline(rewards, mask, ids, np.log(half), half, row_shards=shards)
    bound, _ = otb_comparison_tolerance(rewards, mask, ids, np.log(half), half, compute_dtype=np.float64)
    rows = Tolerance(rtol=bound.rtol, atol=np.asarray(bound.atol)[shards[0]], reason=bound.reason)
    rows.assert_close(results[0][0].advantages, expected.advantages[shards[0]], "the protocol's shard 0")
    returns = otb.returns_to_go(rewards, mask)
    energy = otb.realized_energy(otb.token_energy(np.log(half), half), mask)
    totals = spec.combine_group_totals([spec.shard_group_totals(returns[s], energy[s], mask[s], ids[s], num_groups=1,
                                                                width=6) for s in shards])
    lengths = mask.sum(-1).astype(np.int64)
    local_only = spec.shard_group_lengths(lengths[shards[0]], ids[shards[0]], num_groups=1)   # the bug
    buggy = spec.shard_token_baseline(totals, local_only, returns[shards[0]], energy[shards[0]], mask[shards[0]],
                                      ids[shards[0]], lengths[shards[0]])
    assert not np.allclose(buggy.advantages, expected.advantages[shards[0]], atol=1e-6)


def _totals(leave_one_out: bool):
    return spec.shard_group_totals(np.ones((2, 3)), np.ones((2, 3)), np.ones((2, 3)), [0, 1], num_groups=2, width=3,
                                   leave_one_out=leave_one_out)


def _lengths():
    return spec.shard_group_lengths([3, 3], [0, 1], num_groups=2)


@pytest.mark.parametrize("call, message", [
    (lambda: spec.shard_group_totals(np.ones((2, 3)), np.ones((2, 3)), np.ones((2, 3)), [0, 2], num_groups=2,
                                     width=3), r"group_ids: must lie in \[0, 2\)"),
    (lambda: spec.shard_group_totals(np.ones((2, 3)), np.ones((2, 3)), np.ones((2, 3)), [0.0, 1.0], num_groups=2,
                                     width=3), "group_ids: expected global integer"),
    (lambda: spec.shard_group_totals(np.ones((2, 3)), np.ones((2, 3)), np.ones((2, 3)), [0, 1], num_groups=2,
                                     width=2), "width: 2 is too small"),
    (lambda: spec.shard_group_totals(np.ones((2, 3)), np.ones((2, 3)), np.ones((2, 3)), [0, 1], num_groups=0,
                                     width=3), "num_groups: expected a positive integer"),
    (lambda: spec.combine_group_totals([]), "totals: need at least one shard"),
    (lambda: spec.combine_group_lengths([_lengths()._replace(second=np.array([-1]))] * 2), "lengths\\[0\\]: shape"),
    (lambda: spec.combine_group_totals([_totals(False), _totals(True)]), "totals: some shards summed for leave-one"),
    (lambda: spec.shard_token_baseline(_totals(False), _lengths(), np.ones((2, 3)), np.ones((2, 3)), np.ones((2, 3)),
                                       [0, 1], [3, 3], leave_one_out=True), "totals: summed with leave_one_out=False"),
    (lambda: spec.shard_token_baseline(_totals(True), _lengths(), np.ones((2, 3)), np.ones((2, 3)), np.ones((2, 3)),
                                       [0, 1], [3, 3]), "totals: summed with leave_one_out=True"),
    (lambda: spec.context_offsets([], [], 0), "totals: need at least one context shard"),
    (lambda: spec.shard_group_lengths([-1, 2], [0, 0], num_groups=1), "lengths: expected"),
    (lambda: spec.sharded_token_baseline(np.ones((2, 3)), np.ones((2, 3)), [0, 0], np.zeros((2, 3)), np.ones((2, 3)),
                                         row_shards=[[0]]), "row_shards: expected non-empty index arrays"),
    (lambda: spec.sharded_token_baseline(np.ones((2, 3)), np.ones((2, 3)), [0, 0], np.zeros((2, 3)), np.ones((2, 3)),
                                         row_shards=[[0, 1]], column_cuts=[3]), "column_cuts: expected increasing"),
])
def test_bad_arguments_are_named(call, message):
    with pytest.raises((ValueError, TypeError), match=message):
        call()


def test_inputs_are_not_modified():
    batch = otb.RolloutBatch(rewards=np.ones((3, 4)), response_mask=np.ones((3, 4)), group_ids=np.array([0, 0, 1]),
                             log_probs=np.full((3, 4), -1.0), sum_pi_squared=np.full((3, 4), 0.5))
    copies = [np.copy(a) for a in (batch.rewards, batch.response_mask, batch.log_probs, batch.sum_pi_squared)]
    spec.sharded_token_baseline(batch.rewards, batch.response_mask, batch.group_ids, batch.log_probs,
                                batch.sum_pi_squared, row_shards=[[2, 0], [1]], column_cuts=[1, 3])
    for before, after in zip(copies, (batch.rewards, batch.response_mask, batch.log_probs, batch.sum_pi_squared)):
        np.testing.assert_array_equal(before, after)
    assert group_segments(batch.group_ids).n_groups == 2


@pytest.mark.parametrize("leave_one_out", [False, True])
@pytest.mark.parametrize("column_cuts", [(), (3,)])
def test_finite_rewards_whose_sums_overflow_raise_as_in_one_process(leave_one_out, column_cuts):
    """Rewards of 10³⁰⁸ on half the rows: each fits float64, the group sums Σᵢ GₜⁱWₜⁱ do not. The protocol raises the
    one-process reference's error naming the rewards (it returned ±inf/NaN with RuntimeWarnings before); 10³⁰⁷
    computes, finite, on every shard."""
    rows, positions = 4, 6
    mask, spp = np.ones((rows, positions)), np.full((rows, positions), 0.5)
    log_probs = np.log(spp)
    for scale in (1e307, 1e308):
        rewards = np.zeros((rows, positions))
        rewards[:, -1] = [scale, 0.0, scale, scale / 2]
        call = lambda: spec.sharded_token_baseline(rewards, mask, [0, 0, 0, 0], log_probs, spp,  # noqa: E731
                                                   row_shards=[[0, 1], [2, 3]], column_cuts=column_cuts,
                                                   leave_one_out=leave_one_out)
        if scale > 1e307:
            with pytest.raises(ValueError, match=r"^rewards: finite, but the baseline's float64 arithmetic overflows"):
                call()
            continue
        assert all(np.isfinite(result.advantages).all() for row in call() for result in row)


@pytest.mark.parametrize("leave_one_out", [False, True])
@pytest.mark.parametrize("column_cuts", [(), (3,)])
def test_importance_weights_whose_squares_overflow_are_named_as_in_one_process(leave_one_out, column_cuts):
    """ρ = 10¹⁶⁰ at one valid token: ρ² leaves float64 in the realized energy. The protocol raises the one-process
    reference's error naming is_weights (it named the rewards before); ρ = 10¹⁵⁰ computes, finite, on every shard."""
    rows, positions = 4, 6
    mask, spp = np.ones((rows, positions)), np.full((rows, positions), 0.5)
    rewards = np.zeros((rows, positions))
    rewards[:, -1] = [1.0, 0.0, 1.0, 0.5]
    for rho in (1e150, 1e160):
        weights = np.ones((rows, positions))
        weights[2, 1] = rho
        call = lambda: spec.sharded_token_baseline(rewards, mask, [0, 0, 0, 0], np.log(spp), spp,  # noqa: E731
                                                   row_shards=[[0, 1], [2, 3]], column_cuts=column_cuts,
                                                   is_weights=weights, leave_one_out=leave_one_out)
        if rho > 1e150:
            with pytest.raises(ValueError, match=r"^is_weights: finite, but ρ² in the realized energy .* overflows "
                                                 r"float64 \(ρ up to 1e\+160\)"):
                call()
            with pytest.raises(ValueError, match=r"^is_weights: finite, but ρ²"):
                otb.optimal_token_baseline(rewards, mask, [0, 0, 0, 0], np.log(spp), spp, is_weights=weights)
            continue
        assert all(np.isfinite(result.advantages).all() for row in call() for result in row)

