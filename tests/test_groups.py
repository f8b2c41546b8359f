"""Group ids of any hashable kind map to the same partition verl's dict builds."""

from __future__ import annotations

import uuid

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import otb_spec as otb
from otb_spec import strategies as otb_st


def _dict_partition(ids):
    """Partition as verl builds it: a dict from id to the list of its trajectories."""
    groups = {}
    for position, key in enumerate(np.asarray(ids, dtype=object).tolist()):
        groups.setdefault(key, []).append(position)
    return sorted(groups.values())


def _segment_partition(segments):
    return sorted(np.flatnonzero(segments.index == g).tolist() for g in range(segments.n_groups))


@given(sizes=st.lists(st.integers(1, 5), min_size=1, max_size=6), kind=st.sampled_from(["int", "str", "uuid",
                                                                                        "object"]), data=st.data())
def test_segments_form_the_same_partition_as_a_dict_of_ids(sizes, kind, data):
    ids = data.draw(otb_st.group_ids(sizes, kind=kind), label="ids")
    segments = otb.group_segments(ids)
    assert _segment_partition(segments) == _dict_partition(ids)
    assert segments.sizes.tolist() == [len(group) for group in sorted(_dict_partition(ids), key=lambda g: g[0])] or \
        sorted(segments.sizes.tolist()) == sorted(sizes)
    assert segments.n_groups == len(sizes)


def test_ids_that_compare_equal_are_one_group():
    ids = np.array([1, 1.0, np.int64(1), "1", True, None], dtype=object)
    segments = otb.group_segments(ids)
    # 1, 1.0, np.int64(1) and True compare (and hash) equal, as in a dict; "1" and None are their own groups
    assert _segment_partition(segments) == [[0, 1, 2, 4], [3], [5]]


def test_unorderable_ids_fall_back_to_hashing():
    ids = np.array([("a", 1), None, "x", ("a", 1), uuid.UUID(int=5)], dtype=object)
    assert _segment_partition(otb.group_segments(ids)) == [[0, 3], [1], [2], [4]]


@pytest.mark.bitexact
def test_segment_sums_add_up_the_members_of_each_group():
    segments = otb.group_segments(["b", "a", "b", "c"])
    sums = otb.segment_sums(np.array([[1.0], [2.0], [3.0], [4.0]]), segments)
    np.testing.assert_array_equal(sums[:, 0], [2.0, 4.0, 4.0])      # a = 2, b = 1 + 3, c = 4


@pytest.mark.parametrize("ids, message", [
    (np.array([1.0, np.nan]), "group_ids: contains NaN"),
    (np.zeros((2, 2)), "group_ids: expected a 1-D array"),
    (np.array([], dtype=np.int64), "group_ids: empty batch"),
    (np.array([[1], [2]], dtype=object), "group_ids: expected a 1-D array"),
    (np.array([1 + 2j, 3j]), "group_ids: complex ids"),
])
def test_bad_group_ids_are_rejected(ids, message):
    with pytest.raises((ValueError, TypeError), match=message):
        otb.group_segments(ids)


def test_group_ids_must_match_the_batch_size():
    with pytest.raises(ValueError, match=r"group_ids: expected 3 ids \(one per trajectory\), got 2"):
        otb.optimal_token_baseline(np.zeros((3, 2)), np.ones((3, 2)), [0, 1], np.full((3, 2), -0.5),
                                   np.full((3, 2), 0.5))


def test_unhashable_ids_are_rejected_with_their_position():
    ids = np.empty(3, dtype=object)
    ids[:] = [[1], "x", [1]]
    with pytest.raises(TypeError, match="group_ids: id at position 0 is not hashable"):
        otb.group_segments(ids)


def test_segments_from_integer_index_reject_gaps():
    with pytest.raises(ValueError, match="segment 1 has no member"):
        otb.Segments.from_index(np.array([0, 2, 2]))
