"""The public strategies draw what their documentation promises, and reject bad options at once."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.errors import InvalidArgument

import otb_spec as otb
from otb_spec import strategies as otb_st


def _groups(batch):
    groups = {}
    for position, key in enumerate(np.asarray(batch.group_ids, dtype=object).tolist()):
        groups.setdefault(key, []).append(position)
    return list(groups.values())


@given(batch=otb_st.rollout_batches(min_groups=2, max_groups=3, min_group_size=2, max_group_size=4,
                                    min_length=3, max_length=7, singleton_groups=False))
def test_batches_respect_their_bounds(batch):
    groups = _groups(batch)
    assert 2 <= len(groups) <= 3
    assert all(2 <= len(group) <= 4 for group in groups)
    assert 3 <= batch.n_positions <= 7
    mask = np.asarray(batch.response_mask)
    assert set(np.unique(mask)) <= {0.0, 1.0}
    otb.optimal_token_baseline(batch.rewards, mask, batch.group_ids, batch.log_probs, batch.sum_pi_squared,
                               is_weights=batch.is_weights)        # consistent inputs: the reference accepts them


@given(batch=otb_st.rollout_batches(padding="right", holes=False, empty_rows=False))
def test_right_padding_without_holes_gives_nonempty_prefix_masks(batch):
    mask = np.asarray(batch.response_mask)
    lengths = mask.sum(axis=1).astype(int)
    assert np.all(lengths >= 1)
    for row, length in zip(mask, lengths):
        np.testing.assert_array_equal(row, (np.arange(batch.n_positions) < length).astype(float))


@given(batch=otb_st.rollout_batches(padding="left", holes=False))
def test_left_padding_puts_the_valid_tokens_last(batch):
    for row in np.asarray(batch.response_mask):
        valid = np.flatnonzero(row)
        if valid.size:
            assert valid[-1] == row.shape[0] - 1 and np.all(np.diff(valid) == 1)


@given(batch=otb_st.rollout_batches(holes=True, min_length=5, max_length=9, empty_rows=False))
def test_holes_are_inside_responses(batch):
    for row in np.asarray(batch.response_mask):
        valid = np.flatnonzero(row)
        if valid.size >= 3:
            inside = row[valid[0]:valid[-1] + 1]
            assert inside[0] == 1 and inside[-1] == 1


@given(batch=otb_st.rollout_batches(is_weights=True, fill_masked="zero"))
def test_zero_fill_and_weights(batch):
    mask = np.asarray(batch.response_mask) == 0
    assert batch.is_weights is not None and np.all(np.asarray(batch.is_weights) >= 0)
    assert np.all(np.asarray(batch.rewards)[mask] == 0) and np.all(np.asarray(batch.log_probs)[mask] == 0)
    assert np.all(np.asarray(batch.is_weights)[mask] == 1)


@given(batch=otb_st.rollout_batches(reward_style="dense", min_abs_reward=0.5, max_abs_reward=2.0))
def test_min_abs_reward_keeps_rewarded_positions_away_from_zero(batch):
    valid = np.asarray(batch.response_mask) > 0
    magnitudes = np.abs(np.asarray(batch.rewards)[valid])
    assert np.all((magnitudes >= 0.5) & (magnitudes <= 2.0))


@given(batch=otb_st.rollout_batches(vocab_size=7, max_length=5, fill_masked="zero", dtype=np.float32))
def test_batches_with_logits_have_consistent_token_statistics(batch):
    assert batch.logits.shape == (batch.batch_size, batch.n_positions, 7)
    assert batch.rewards.dtype == np.float32
    mask = np.asarray(batch.response_mask) > 0
    expected = otb.token_log_probs(batch.logits, batch.token_ids)
    np.testing.assert_allclose(np.asarray(batch.log_probs)[mask], expected[mask], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(batch.sum_pi_squared)[mask], otb.sum_pi_squared(batch.logits)[mask],
                               rtol=1e-6)


@given(data=st.data(), kind=st.sampled_from(["int", "str", "uuid", "object"]))
def test_group_ids_have_the_requested_kind_and_sizes(data, kind):
    ids = data.draw(otb_st.group_ids([3, 1, 2], kind=kind))
    assert len(ids) == 6
    counts = sorted({key: list(ids.tolist()).count(key) for key in ids.tolist()}.values())
    assert counts == [1, 2, 3]
    if kind == "uuid":
        import uuid
        assert all(uuid.UUID(value).version == 4 for value in ids)
    if kind == "object":
        assert ids.dtype == object


@given(pair=otb_st.token_statistics((4, 3)))
def test_token_statistics_are_consistent_with_a_policy(pair):
    log_probs, spp = pair
    assert np.all(log_probs <= 0.0)
    assert np.all(spp <= 1.0) and np.all(spp >= np.exp(2 * log_probs) * (1 - 1e-12))
    w = otb.token_energy(log_probs, spp)
    assert np.all(w >= -1e-12) and np.all(w < 2.0)


@pytest.mark.parametrize("factory, options, message", [
    (otb_st.rollout_batches, dict(max_groups=0), "max_groups=0: must be ≥ 1"),
    (otb_st.rollout_batches, dict(min_groups=3, max_groups=2), "min_groups=3 exceeds max_groups=2"),
    (otb_st.rollout_batches, dict(padding="middle"), "padding='middle': expected one of"),
    (otb_st.rollout_batches, dict(holes="sometimes"), "holes='sometimes': expected True, False or None"),
    (otb_st.rollout_batches, dict(max_group_size=1, singleton_groups=False),
     "singleton_groups=False needs max_group_size ≥ 2, got max_group_size=1"),
    (otb_st.rollout_batches, dict(dtype=np.int32), "dtype=.*expected float32 or float64"),
    (otb_st.rollout_batches, dict(max_abs_reward=float("inf")), "max_abs_reward=inf: must be finite"),
    (otb_st.rollout_batches, dict(id_kind="bytes"), "id_kind='bytes'"),
    (otb_st.rollout_batches, dict(min_abs_reward=3.0, max_abs_reward=2.0), "min_abs_reward=3.0 exceeds"),
    (otb_st.logits, dict(shape=(2,), vocab_size=0), "vocab_size=0: must be ≥ 1"),
    (otb_st.group_ids, dict(sizes=[2, 0]), r"sizes\[1\]=0: must be ≥ 1"),
    (otb_st.token_statistics, dict(shape=(2,), min_vocab_size=1), "min_vocab_size=1: must be ≥ 2"),
    (otb_st.token_statistics, dict(shape=4), "shape=4: expected a sequence of sizes"),
    (otb_st.logits, dict(shape=3), "shape=3: expected a sequence of sizes"),
    (otb_st.logits, dict(shape=(2,), max_abs=1e39, dtype=np.float32), "max_abs=1e\\+39: larger than the largest finite"),
    (otb_st.group_ids, dict(sizes=3), "sizes=3: expected a sequence of group sizes"),
    (otb_st.lm_head_inputs, dict(lead_shapes=(7,)), r"lead_shapes\[0\]=7: expected a sequence of sizes"),
])
def test_bad_options_raise_invalid_argument_at_once(factory, options, message):
    with pytest.raises(InvalidArgument, match=message):
        factory(**options)


@given(policy=otb_st.toy_policies(max_scale=0.05))
def test_a_small_max_scale_draws_policies_within_it(policy):
    """max_scale below the usual lower end of the draw (0.1): policies near uniform, drawn, not an error."""
    assert np.abs(policy.theta).max() < 1.0


def test_large_arrays_are_filled_from_a_seeded_generator():
    """Above 4096 elements values come from a generator seeded by Hypothesis: still deterministic per seed."""
    strategy = otb_st.rollout_batches(min_groups=8, max_groups=8, min_group_size=8, max_group_size=8,
                                      min_length=512, max_length=512)

    @given(batch=strategy)
    def check(batch):
        assert batch.rewards.shape == (64, 512)
        assert np.isfinite(batch.log_probs).all()

    check()


@settings(max_examples=4, deadline=None)
@given(batch=otb_st.rollout_batches(min_groups=256, max_groups=256, min_group_size=8, max_group_size=8, min_length=48,
                                    max_length=48, padding="any", holes=None, empty_rows=False))
def test_trainer_sized_batches_draw(batch):
    """256 prompts × 8 samples (more than 64 groups and rows: per-group and per-row choices come from a seeded
    generator, not one Hypothesis draw each): every group has 8 members, scattered; each row is one response, padded
    on either side; the reference accepts the batch."""
    groups = _groups(batch)
    assert len(groups) == 256 and all(len(group) == 8 for group in groups)
    assert any(np.any(np.diff(group) != 1) for group in groups)          # shuffled, not contiguous
    mask = np.asarray(batch.response_mask)
    assert mask.shape == (2048, 48) and np.all(mask.sum(axis=1) >= 1)
    sides = {("right" if row[0] == 1 else "") + ("left" if row[-1] == 1 else "") for row in mask}
    assert {"right", "left"} <= sides                                    # padding="any" varies per row
    otb.optimal_token_baseline(batch.rewards, mask, batch.group_ids, batch.log_probs, batch.sum_pi_squared,
                               is_weights=batch.is_weights)


@settings(max_examples=3, deadline=None)
@given(ids=otb_st.group_ids([1, 2, 3] * 100, kind="int"))
def test_many_group_ids_are_distinct_per_group(ids):
    """300 groups: 300 distinct ids with the requested sizes (600 rows, shuffled from a seeded generator)."""
    _, counts = np.unique(ids, return_counts=True)
    assert sorted(counts.tolist()) == sorted([1, 2, 3] * 100)


@settings(max_examples=20, deadline=None)
@given(ids=otb_st.group_ids([2] * 256, kind="uuid"))
def test_many_uuid_groups_keep_their_sizes(ids):
    """version=4 overwrites 4 bits of a uuid: codes placed over them merged groups (codes 2¹² apart gave one uuid; 36
    of 100 draws of 64 uuid groups merged two)."""
    _, counts = np.unique(ids, return_counts=True)
    assert counts.tolist() == [2] * 256


@settings(max_examples=3, deadline=None, derandomize=True)
@given(batch=otb_st.rollout_batches(min_groups=100, max_groups=100, min_length=60, max_length=60, reward_style="sparse",
                                    vocab_size=3, dtype=np.float32))
def test_large_batches_with_logits_are_consistent(batch):
    """Above 4096 elements token ids come from a seeded generator too: the statistics still come from the drawn
    logits and tokens exactly."""
    assert batch.token_ids.shape == batch.rewards.shape and batch.token_ids.min() >= 0 and batch.token_ids.max() < 3
    valid = np.asarray(batch.response_mask) > 0
    expected = otb.token_log_probs(np.asarray(batch.logits, np.float64), batch.token_ids)
    np.testing.assert_allclose(np.asarray(batch.log_probs)[valid], expected[valid], rtol=1e-6, atol=1e-6)


def test_batches_without_any_reward_are_the_exception():
    """Element-wise array draws repeat one fill value, and Hypothesis fills the end of many examples with its simplest
    choice, 0: when rewards were drawn so, about half the batches held no reward at all, and half of every test budget
    checked 0 = 0. Seeded, a batch of at least 4 non-empty rows is reward-free only where every 0/1 outcome fails
    (≤ (3/4)⁴ ≈ 0.32 at the lowest rate, for the terminal style, a sixth of the draws): a few percent at most.
    Deterministic (derandomized draws)."""
    counts = [0, 0]

    @settings(max_examples=200, derandomize=True, database=None, deadline=None)
    @given(batch=otb_st.rollout_batches(min_groups=2, min_group_size=2, empty_rows=False))
    def count(batch):
        counts[0] += 1
        counts[1] += not np.any(np.asarray(batch.rewards) * np.asarray(batch.response_mask))

    count()
    assert counts[0] == 200 and counts[1] <= 0.1 * counts[0], counts       # 106 of 200 before, 0 now
