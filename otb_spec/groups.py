"""Prompt groups: from arbitrary group ids to integer segments, and segment sums without Python loops.

A *group* is the set of trajectories sampled for one prompt. Trainers identify it with an id per trajectory —
integers, strings, uuid strings, or arbitrary hashable objects in an object array (verl's ``index``). Members of a
group need not be contiguous in the batch, and groups may have any sizes, including 1.

:func:`group_segments` maps the ids once to dense integers ``0 … G−1`` (``np.unique(return_inverse=True)``, or a hash
table when the ids cannot be ordered, e.g. a mix of strings and ``None``). Everything downstream works on those
integers with sort-based segment sums (:func:`segment_sums`), so the reference has no loop over groups or tokens.
Two ids are the same group exactly when they compare equal, as with the dict verl builds (so ``1``, ``1.0`` and
``np.int64(1)`` are one group, ``"1"`` another).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["Segments", "first_appearance_labels", "group_segments", "segment_sums"]


@dataclass(frozen=True)
class Segments:
    """Dense integer encoding of a batch's prompt groups.

    Attributes:
      index: [B] int64, the segment (0 … n_groups−1) of each trajectory.
      n_groups: number of distinct groups G.
      sizes: [G] int64, number of trajectories in each group.
      order: [B] int64, a stable permutation that sorts trajectories by segment.
      starts: [G] int64, where each segment begins in ``order``.
      contiguous: True when the batch is already sorted by segment (``order`` is the identity).
    """

    index: np.ndarray
    n_groups: int
    sizes: np.ndarray
    order: np.ndarray
    starts: np.ndarray
    contiguous: bool = False

    @classmethod
    def from_index(cls, index: Any, n_groups: int | None = None) -> "Segments":
        """Build from integer segment ids already in ``0 … G−1`` (every id in that range must occur)."""
        index = np.asarray(index)
        if index.ndim != 1 or index.dtype.kind not in "iu":
            raise ValueError(f"segment index: expected a 1-D integer array, got dtype {index.dtype}, shape {index.shape}")
        count = int(index.max()) + 1 if index.size else 0
        if n_groups is None:
            n_groups = count
        if index.size and (index.min() < 0 or count > n_groups):
            raise ValueError(f"segment index: ids must lie in [0, {n_groups}), got range [{index.min()}, {index.max()}]")
        sizes = np.bincount(index, minlength=n_groups).astype(np.int64)
        if (sizes == 0).any():
            missing = int(np.flatnonzero(sizes == 0)[0])
            raise ValueError(f"segment index: segment {missing} has no member (empty group)")
        contiguous = bool(np.all(index[1:] >= index[:-1]))
        order = np.arange(index.size, dtype=np.int64) if contiguous else np.argsort(index, kind="stable").astype(np.int64)
        starts = np.concatenate(([0], np.cumsum(sizes)[:-1])).astype(np.int64)
        return cls(index=index.astype(np.int64), n_groups=int(n_groups), sizes=sizes, order=order, starts=starts,
                   contiguous=contiguous)


def group_segments(group_ids: Any, batch_size: int | None = None, *, name: str = "group_ids") -> Segments:
    """Encode the per-trajectory group ids ``[B]`` as dense segments.

    Args:
      group_ids: [B] ids of any hashable kind (ints, strings, uuid strings, object arrays).
      batch_size: expected B (from the ``[B, T]`` arguments); checked when given.
      name: argument name for error messages.

    Returns:
      :class:`Segments`.

    Example (groups need not be contiguous)::

      >>> s = group_segments(["b", "a", "b", "c"])
      >>> s.index.tolist(), s.sizes.tolist()
      ([1, 0, 1, 2], [1, 2, 1])
    """
    if group_ids is None:
        raise TypeError(f"{name}: expected a [B] array of group ids, got None")
    ids = np.asarray(group_ids)
    if ids.ndim != 1:
        raise ValueError(f"{name}: expected a 1-D array of B ids, got shape {ids.shape}")
    if batch_size is not None and ids.shape[0] != batch_size:
        raise ValueError(f"{name}: expected {batch_size} ids (one per trajectory), got {ids.shape[0]}")
    if ids.shape[0] == 0:
        raise ValueError(f"{name}: empty batch (no ids)")
    if ids.dtype.kind == "f" and np.isnan(ids).any():
        raise ValueError(f"{name}: contains NaN, which never compares equal to itself and cannot name a group")
    if ids.dtype.kind == "c":
        raise TypeError(f"{name}: complex ids are not supported")
    inverse = _factorize(ids, name)
    return Segments.from_index(inverse)


def _factorize(ids: np.ndarray, name: str) -> np.ndarray:
    if ids.dtype.kind != "O":
        _, inverse = np.unique(ids, return_inverse=True)
        return inverse.reshape(-1).astype(np.int64)
    try:
        _, inverse = np.unique(ids, return_inverse=True)
        return inverse.reshape(-1).astype(np.int64)
    except TypeError:
        pass  # unorderable mix (e.g. str and None, or objects without "<"): fall back to hashing, like verl's dict
    return first_appearance_labels(ids.tolist(), name)


def first_appearance_labels(keys: list, name: str = "group_ids") -> np.ndarray:
    """[B] int64 labels of hashable ``keys``, numbered 0, 1, … in order of first appearance — one dict pass, the
    partition verl's dict of ids builds. A TypeError names the position of the first unhashable key."""
    table: dict[Any, int] = {}
    try:
        return np.fromiter((table.setdefault(key, len(table)) for key in keys), dtype=np.int64, count=len(keys))
    except TypeError:
        for position, key in enumerate(keys):
            try:
                hash(key)
            except TypeError as exc:
                raise TypeError(f"{name}: id at position {position} is not hashable ({type(key).__name__})") from exc
        raise


def segment_sums(values: np.ndarray, segments: Segments) -> np.ndarray:
    """Σ over the members of each segment, along axis 0.

    ``values``: [B, ...] → [G, ...]; ``out[g] = Σ_{i : segment(i) = g} values[i]`` (sort-based ``np.add.reduceat``).
    """
    values = np.asarray(values)
    if values.shape[0] != segments.index.shape[0]:
        raise ValueError(f"values: expected {segments.index.shape[0]} rows, got {values.shape[0]}")
    ordered = values if segments.contiguous else values[segments.order]
    return np.add.reduceat(ordered, segments.starts, axis=0)
