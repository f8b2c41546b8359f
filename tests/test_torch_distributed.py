"""otb_torch.distributed on real processes: gloo on loopback, 2–4 ranks, every collective bounded in time.

Each rank's result is compared with the single-process NumPy reference on the whole batch, within the reference's
error bound for any summation order (``otb_comparison_tolerance``, ``sum_pi_squared_tolerance``), on
Hypothesis-generated batches and splits and on adversarial ones: a group entirely on one rank, a rank without valid
tokens, uneven shards, a context piece of one column. Bad input must raise on every rank, never hang.
"""

from __future__ import annotations

import dataclasses
import socket
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.distributed.is_available():  # pragma: no cover
    pytest.skip("torch.distributed is not available in this build", allow_module_level=True)

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import otb_spec as otb  # noqa: E402
from distributed_pool import WORLD_SIZE, Pool  # noqa: E402
from forced_openings import forced_opening_with_one_deviant, groups_outside, returns_range  # noqa: E402
from otb_spec import strategies  # noqa: E402
from otb_spec.groups import group_segments  # noqa: E402
from otb_spec.tolerances import DOMINANT_SHARE  # noqa: E402
from otb_spec.tolerances import (  # noqa: E402
    Tolerance,
    otb_comparison_tolerance,
    proxy_tolerance,
    sum_pi_squared_tolerance,
)

pytestmark = pytest.mark.distributed

DATA_LAYOUTS = {"world": 4, "three": 3, "two": 2, "last two": 2}
CONTEXT_LAYOUTS = {"context": (4, 1), "context two": (2, 1), "mesh": (2, 2)}     # (context size, data shards)
_FIRST_RANK = {"last two": 2}


@pytest.fixture(scope="module")
def pool():
    workers = Pool()
    yield workers
    workers.close()


def _sliced(tolerance: Tolerance, rows: np.ndarray, columns: slice) -> Tolerance:
    def cut(value):
        value = np.asarray(value)
        return value if value.ndim == 0 else value[rows][:, columns]
    return Tolerance(rtol=cut(tolerance.rtol), atol=cut(tolerance.atol), reason=tolerance.reason)


def _reference(batch, ids, *, align, leave_one_out, epsilon):
    common = dict(is_weights=batch.is_weights, epsilon=epsilon)
    if leave_one_out:
        return otb.leave_one_out_token_baseline(batch.rewards, batch.response_mask, ids, batch.log_probs,
                                                batch.sum_pi_squared, align=align, **common)
    function = otb.optimal_token_baseline if align == "position" else otb.multi_turn_optimal_token_baseline
    return function(batch.rewards, batch.response_mask, ids, batch.log_probs, batch.sum_pi_squared, **common)


def _split_arguments(batch, ids, num_groups, row_shards, column_cuts, context_size, *, align, leave_one_out,
                     epsilon):
    """Per rank (rank = context_size·d + c): the rows of data shard d, columns of context piece c."""
    total = batch.rewards.shape[1]
    cuts = [0, *column_cuts, total]
    arguments, pieces = [], []
    for rows in row_shards:
        for c in range(context_size):
            columns = slice(cuts[c], cuts[c + 1])

            def take(array, rows=rows, columns=columns):
                return None if array is None else np.ascontiguousarray(np.asarray(array)[rows][:, columns])

            arguments.append(dict(rewards=take(batch.rewards), response_mask=take(batch.response_mask),
                                  group_ids=np.ascontiguousarray(ids[rows]), log_probs=take(batch.log_probs),
                                  sum_pi_squared=take(batch.sum_pi_squared), is_weights=take(batch.is_weights),
                                  num_groups=num_groups, align=align, leave_one_out=leave_one_out,
                                  epsilon=epsilon))
            pieces.append((rows, columns))
    return arguments, pieces


KERNELS = ["native", "eager"]       # otb_torch's native CPU kernel (where it builds), and the eager fallback


def _run_on_layout(pool, name, layout, arguments):
    """``arguments[k]`` to the k-th rank of the layout's group (the ranks outside it sit out); the outcomes in that
    order."""
    first = _FIRST_RANK.get(layout, 0)                      # the layout's group starts at this global rank
    placed = [None] * first + list(arguments) + [None] * (WORLD_SIZE - first - len(arguments))
    return pool.run(name, layout, placed)[first:first + len(arguments)]


def _check_split(pool, batch, row_shards, *, layout, column_cuts=(), align="position", leave_one_out=False,
                 epsilon=1e-8, kernel="native", float32_exact_below=None):
    ids = group_segments(batch.group_ids).index
    num_groups = int(ids.max()) + 1
    context_size = len(column_cuts) + 1
    arguments, pieces = _split_arguments(batch, ids, num_groups, row_shards, list(column_cuts), context_size,
                                         align=align, leave_one_out=leave_one_out, epsilon=epsilon)
    if kernel == "eager":
        arguments = [dict(argument, _eager=True) for argument in arguments]
    if float32_exact_below is not None:
        arguments = [dict(argument, _float32_exact_below=float32_exact_below) for argument in arguments]
    outcomes = _run_on_layout(pool, "distributed_token_baseline", layout, arguments)
    expected = _reference(batch, ids, align=align, leave_one_out=leave_one_out, epsilon=epsilon)
    dtype = np.asarray(batch.rewards).dtype
    advantage_tol, returns_tol = otb_comparison_tolerance(
        batch.rewards, batch.response_mask, ids, batch.log_probs, batch.sum_pi_squared, is_weights=batch.is_weights,
        align=align, leave_one_out=leave_one_out, handle_zero_tail=not leave_one_out, epsilon=epsilon,
        compute_dtype=dtype, clamped_weights=True)
    for rank, ((status, result), (rows, columns)) in enumerate(zip(outcomes, pieces)):
        assert status == "ok", f"rank {rank}: {result[0]}: {result[1]}\n{result[2]}"
        _sliced(advantage_tol, rows, columns).assert_close(result.advantages, expected.advantages[rows][:, columns],
                                                           f"rank {rank} advantages")
        _sliced(returns_tol, rows, columns).assert_close(result.returns, expected.returns[rows][:, columns],
                                                         f"rank {rank} returns")
        mask = np.asarray(batch.response_mask)[rows][:, columns]
        assert np.all(result.baselines[mask == 0] == 0) and np.all(result.advantages[mask == 0] == 0)
    return [result for _, result in outcomes]


def test_the_ranks_have_the_native_kernel(pool):
    """The distributed tests run the native kernel on the ranks where it builds (as on CI), the eager one where
    asked (``_eager``): set OTB_REQUIRE_NATIVE=0 to allow a machine without a C compiler."""
    import os
    if os.environ.get("OTB_REQUIRE_NATIVE", "1") == "0" or os.environ.get("OTB_TORCH_NATIVE") == "0":
        pytest.skip("the eager fallback is allowed here")
    assert [result for _, result in pool.run("native_kernel_status", "world", [{}] * WORLD_SIZE)] == [True] * 4


@st.composite
def _row_shards(draw, rows: int, shards: int):
    """A random partition of the rows into ``shards`` non-empty parts (any order: groups scattered)."""
    order = np.asarray(draw(st.permutations(range(rows))), dtype=np.int64)
    cuts = sorted(draw(st.lists(st.integers(1, rows - 1), min_size=shards - 1, max_size=shards - 1,
                                unique=True)))
    return [order[a:b] for a, b in zip([0, *cuts], [*cuts, rows])]


_BATCHES = dict(min_groups=1, max_groups=4, max_group_size=5, min_length=4, max_length=10)


@pytest.mark.parametrize("kernel", KERNELS)
@settings(max_examples=25)
@given(data=st.data(), layout=st.sampled_from(sorted(DATA_LAYOUTS)), align=st.sampled_from(["position", "valid_token"]),
       leave_one_out=st.booleans(), dtype=st.sampled_from([np.float64, np.float32]))
def test_data_parallel_equals_one_process(pool, kernel, data, layout, align, leave_one_out, dtype):
    shards = DATA_LAYOUTS[layout]
    batch = data.draw(strategies.rollout_batches(**_BATCHES, min_group_size=2, dtype=dtype).filter(
        lambda b: b.rewards.shape[0] >= shards))
    row_shards = data.draw(_row_shards(batch.rewards.shape[0], shards))
    _check_split(pool, batch, row_shards, layout=layout, align=align, leave_one_out=leave_one_out, kernel=kernel)


@pytest.mark.parametrize("kernel", KERNELS)
@settings(max_examples=20)
@given(data=st.data(), layout=st.sampled_from(sorted(CONTEXT_LAYOUTS)),
       align=st.sampled_from(["position", "valid_token"]), leave_one_out=st.booleans())
def test_context_parallel_equals_one_process(pool, kernel, data, layout, align, leave_one_out):
    context_size, data_shards = CONTEXT_LAYOUTS[layout]
    batch = data.draw(strategies.rollout_batches(**_BATCHES, min_group_size=2).filter(
        lambda b: b.rewards.shape[0] >= data_shards))
    total = batch.rewards.shape[1]
    column_cuts = sorted(data.draw(st.lists(st.integers(1, total - 1), min_size=context_size - 1,
                                            max_size=context_size - 1, unique=True)))
    row_shards = data.draw(_row_shards(batch.rewards.shape[0], data_shards)) if data_shards > 1 else [
        np.arange(batch.rewards.shape[0])]
    _check_split(pool, batch, row_shards, layout=layout, column_cuts=column_cuts, align=align,
                 leave_one_out=leave_one_out, kernel=kernel)


def _fixed_batch(rows: int = 8, positions: int = 6, seed: int = 3):
    rng = np.random.default_rng(seed)
    mask = np.ones((rows, positions))
    lengths = rng.integers(1, positions + 1, rows)
    mask[np.arange(positions)[None, :] >= lengths[:, None]] = 0.0
    log_probs = np.log(rng.uniform(0.05, 1.0, (rows, positions)))
    spp = np.clip(np.exp(2 * log_probs) + rng.uniform(0, 0.5, (rows, positions)), 0, 1)
    return otb.RolloutBatch(rewards=rng.normal(size=(rows, positions)), response_mask=mask,
                            group_ids=np.array([0, 0, 0, 1, 1, 1, 2, 2]), log_probs=log_probs,
                            sum_pi_squared=spp, is_weights=rng.uniform(0.5, 1.5, (rows, positions)))


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("leave_one_out", [False, True])
@pytest.mark.parametrize("align", ["position", "valid_token"])
def test_adversarial_splits(pool, align, leave_one_out, kernel):
    batch = _fixed_batch()
    # group 1 entirely on rank 2; rank 3 without a valid token; uneven shards; group 0 split 2 + 1; tool-output holes
    # (inside a later context piece too, where the earlier pieces' energy must not reach a masked position)
    mask = batch.response_mask.copy()
    mask[7] = 0.0
    mask[0, :5] = [1.0, 1.0, 1.0, 0.0, 1.0]                   # a hole inside the context piece [2, 5)
    mask[1, :4] = 1.0
    mask[3, :4] = [1.0, 1.0, 0.0, 1.0]
    batch = dataclasses.replace(batch, response_mask=mask)
    row_shards = [np.array([0, 1, 6]), np.array([2]), np.array([3, 4, 5]), np.array([7])]
    _check_split(pool, batch, row_shards, layout="world", align=align, leave_one_out=leave_one_out, kernel=kernel)
    # a context piece of a single column, and a piece with no valid token in any row
    _check_split(pool, batch, [np.arange(8)], layout="context", column_cuts=(1, 2, 5), align=align,
                 leave_one_out=leave_one_out, kernel=kernel)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("align", ["position", "valid_token"])
def test_leave_one_out_weighs_whole_energies_clamped_at_zero_across_pieces(pool, align, kernel):
    """Leave-one-out weighs by max(W, 0) (proofs/N1 item 5), where W is the whole row's energy: a context piece must
    clamp after the earlier pieces' energy is added, not its own partial sum. float32 statistics of a forced opening
    with Σπ² = π² ± 10⁻³ token by token (within the input slack) make energies small and of both signs, with the cut
    inside the opening and between data shards; every rank matches the reference within the verifier's tolerance,
    and every baseline stays a weighted mean of the others' returns (|A| ≤ 2·max|G|; up to 10²·max|G| with the
    bare weights)."""
    rng = np.random.default_rng(5)
    rows, positions, opening = 16, 12, 6
    pi = rng.uniform(0.2, 0.9, size=(rows, positions))
    spp = pi**2 + (1 - pi) ** 2 * rng.uniform(0.1, 1.0, size=(rows, positions))
    pi[:, :opening] = 0.999
    spp[:, :opening] = pi[:, :opening] ** 2 + 1e-3 * rng.choice([-1.0, 1.0], size=(rows, opening))
    rewards = np.zeros((rows, positions))
    rewards[:, -1] = rng.integers(0, 2, size=rows)
    batch = otb.RolloutBatch(rewards=rewards.astype(np.float32), response_mask=np.ones((rows, positions), np.float32),
                             group_ids=np.repeat([0, 1], rows // 2), log_probs=np.log(pi).astype(np.float32),
                             sum_pi_squared=spp.astype(np.float32), is_weights=None)
    expected = _reference(batch, group_segments(batch.group_ids).index, align=align, leave_one_out=True,
                          epsilon=1e-8)
    assert np.abs(expected.advantages).max() <= 2.0
    results = _check_split(pool, batch, [np.arange(0, rows, 2), np.arange(1, rows, 2)], layout="mesh",
                           column_cuts=(3,), align=align, leave_one_out=True, kernel=kernel)
    results += _check_split(pool, batch, [np.arange(rows)], layout="context", column_cuts=(2, 4, 8), align=align,
                            leave_one_out=True, kernel=kernel)
    assert max(np.abs(result.advantages).max() for result in results) <= 2.0


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("align", ["position", "valid_token"])
@pytest.mark.parametrize("layout, column_cuts", [("two", ()), ("world", ()), ("context two", (1,)), ("mesh", (1,))])
def test_leave_one_out_of_a_member_whose_energy_dwarfs_the_others_across_ranks(pool, kernel, align, layout,
                                                                              column_cuts):
    """A forced opening where one member of 8 sampled another token (tests/forced_openings.py), in float32, its
    groups scattered over the ranks (and cut after the opening's column): at t = 0 that member's W ≈ 2 against the
    others' total of 10⁻⁷ or less, where D − Wᵢ from the summed grid cancels to rounding noise of either sign. Its rank
    gets the others' sums added directly (otb_torch.distributed._sums_without_dominant): every baseline stays in
    [min(G, 0), max(G, 0)] of its group, and every rank matches the reference within the verifier's tolerance. With
    D − Wᵢ instead, 1–3 of the 400 groups' baselines left that range in 15 of these 16 cases."""
    groups = 400
    source = forced_opening_with_one_deviant(groups, positions=3, seed=1)
    batch = dataclasses.replace(source, **{name: np.asarray(getattr(source, name), np.float32) for name in (
        "rewards", "response_mask", "log_probs", "sum_pi_squared")})
    rows = groups * 8
    order = np.random.default_rng(2).permutation(rows)                       # balance_batch scatters the groups
    shards = DATA_LAYOUTS.get(layout) or CONTEXT_LAYOUTS[layout][1]
    row_shards = [np.sort(order[k::shards]) for k in range(shards)]
    results = _check_split(pool, batch, row_shards, layout=layout, column_cuts=column_cuts, align=align,
                           leave_one_out=True, kernel=kernel)
    context_size = len(column_cuts) + 1
    cuts = [0, *column_cuts, batch.rewards.shape[1]]
    returns = _reference(batch, group_segments(batch.group_ids).index, align=align, leave_one_out=True,
                         epsilon=1e-8).returns
    low, high = returns_range(returns, batch.group_ids, groups)
    outside, worst = set(), 0.0
    for rank, result in enumerate(results):
        rows_here, columns = row_shards[rank // context_size], slice(cuts[rank % context_size],
                                                                     cuts[rank % context_size + 1])
        baselines = returns[rows_here][:, columns] - result.advantages
        outside |= groups_outside(baselines, batch.group_ids[rows_here], low, high)
        worst = max(worst, float(np.abs(baselines).max()))
    assert not outside, f"{len(outside)} groups' baselines leave [min(G, 0), max(G, 0)] (worst |B| = {worst:.3g})"


@pytest.mark.parametrize("align", ["position", "valid_token"])
def test_group_statistics_by_all_gather_when_float32_cannot_hold_them(pool, align):
    """float32 batches of 2²⁴ rows or positions cannot carry the members and lengths in the grid's float32 all-reduce;
    the native path then all-gathers them as integers. Forced here (the bound lowered to 1 on every rank, as every
    rank decides alike from the handshake): self-inclusive with the zero tail, data and context parallel."""
    batch = _fixed_batch()
    batch = dataclasses.replace(batch, **{name: np.asarray(getattr(batch, name), np.float32)
                                          for name in ("rewards", "response_mask", "log_probs", "sum_pi_squared",
                                                       "is_weights")})
    row_shards = [np.array([0, 1, 6]), np.array([2]), np.array([3, 4, 5]), np.array([7])]
    _check_split(pool, batch, row_shards, layout="world", align=align, float32_exact_below=1)
    _check_split(pool, batch, [np.array([0, 2, 4, 6]), np.array([1, 3, 5, 7])], layout="mesh", column_cuts=(3,),
                 align=align, float32_exact_below=1)


@pytest.mark.parametrize("layout", ["two", "last two"])
def test_zero_tail_needs_the_global_top_two(pool, layout):
    """The unique longest member is on one rank, the second longest on another: only the global lengths give the
    right zero tail (a rank deciding from its own rows would zero from its local second length). On two ranks the
    grid's sum is one exchange between them: ``"last two"`` (global ranks 2–3) checks that it finds the peer's
    global rank."""
    mask = np.array([[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 0, 0], [1, 1, 0, 0, 0, 0]], float)
    half = np.full(mask.shape, 0.5)
    batch = otb.RolloutBatch(rewards=np.arange(24.0).reshape(4, 6) % 3, response_mask=mask,
                             group_ids=np.zeros(4, np.int64), log_probs=np.log(half), sum_pi_squared=half,
                             is_weights=None)
    _check_split(pool, batch, [np.array([0, 1]), np.array([2, 3])], layout=layout)


# ----------------------------------------------------------------------------------------------------------------------
# Vocab parallel


def _vocab_split(logits: np.ndarray, shards: int, cuts: list[int]):
    edges = [0, *cuts, logits.shape[-1]]
    return [np.ascontiguousarray(logits[..., a:b]) for a, b in zip(edges, edges[1:])]


@settings(max_examples=20)
@given(data=st.data(), layout=st.sampled_from(sorted(DATA_LAYOUTS)), dtype=st.sampled_from([np.float64, np.float32]),
       with_ids=st.booleans())
def test_vocab_parallel_statistics_equal_one_process(pool, data, layout, dtype, with_ids):
    shards = DATA_LAYOUTS[layout]
    vocab = data.draw(st.integers(shards, 40))
    logits = data.draw(strategies.logits((3, 2), vocab_size=vocab)).astype(dtype)
    cuts = sorted(data.draw(st.lists(st.integers(1, vocab - 1), min_size=shards - 1, max_size=shards - 1,
                                     unique=True)))
    ids = data.draw(st.lists(st.integers(0, vocab - 1), min_size=6, max_size=6))
    ids = np.asarray(ids, dtype=np.int64).reshape(3, 2) if with_ids else None
    pieces = _vocab_split(logits, shards, cuts)
    outcomes = _run_on_layout(pool, "vocab_parallel_token_statistics", layout,
                              [dict(logits_shard=piece, token_ids=ids) for piece in pieces])
    expected = otb.token_statistics_from_logits(logits, ids)
    spp_tol = sum_pi_squared_tolerance(logits, dtype=dtype) + sum_pi_squared_tolerance(logits, dtype=np.float64)
    proxy = proxy_tolerance(vocab, float(np.abs(logits[np.isfinite(logits)]).max(initial=0.0)),
                                           dtype=dtype)
    for rank, (status, result) in enumerate(outcomes):
        assert status == "ok", f"rank {rank}: {result}"
        # every rank holds the same rows' statistics: the reductions (gloo's, or one exchange over two ranks) must
        # give every rank the same bits
        for field in ("sum_pi_squared", "entropy", "log_probs"):
            mine, first = getattr(result, field), getattr(outcomes[0][1], field)
            assert (mine is None and first is None) or np.array_equal(mine, first, equal_nan=True), (rank, field)
        spp_tol.assert_close(result.sum_pi_squared, expected.sum_pi_squared, f"rank {rank} Σπ²")
        proxy.assert_close(result.entropy, expected.entropy, f"rank {rank} entropy")
        if with_ids:
            proxy.assert_close(result.log_probs, expected.log_probs, f"rank {rank} log π(y)")
        else:
            assert result.log_probs is None


def test_vocab_parallel_unchecked_ids_outside_the_vocabulary_give_nan(pool):
    """check_values=False: an id on no rank's shard gives log π = NaN on every rank (not −log S₁, a finite number);
    narrow integer ids (uint8 with V = 300) are read as their values; the other statistics are unchanged."""
    logits = np.random.default_rng(3).normal(size=(2, 300))
    pieces = _vocab_split(logits, 2, [170])
    ids = np.array([200, 7], dtype=np.uint8)
    outcomes = _run_on_layout(pool, "vocab_parallel_token_statistics", "two",
                              [dict(logits_shard=p, token_ids=ids) for p in pieces])
    expected = otb.token_statistics_from_logits(logits, ids.astype(np.int64))
    for status, result in outcomes:
        assert status == "ok", result
        np.testing.assert_allclose(result.log_probs, expected.log_probs, rtol=1e-13)
    outside = np.array([300, -1])
    outcomes = _run_on_layout(pool, "vocab_parallel_token_statistics", "two",
                              [dict(logits_shard=p, token_ids=outside, check_values=False) for p in pieces])
    for status, result in outcomes:
        assert status == "ok", result
        assert np.isnan(result.log_probs).all()
        np.testing.assert_allclose(result.entropy, expected.entropy, rtol=1e-13)


def test_vocab_parallel_sum_pi_squared_rows_excluded_on_some_shards(pool):
    """A row whose logits are −inf on one shard (excluded tokens) but not on all: that shard contributes nothing."""
    logits = np.array([[0.0, 1.0, -np.inf, -np.inf, 2.0, 0.5], [-np.inf, -np.inf, 3.0, -1.0, -np.inf, -np.inf]])
    pieces = _vocab_split(logits, 3, [2, 4])
    outcomes = _run_on_layout(pool, "vocab_parallel_sum_pi_squared", "three", [dict(logits_shard=p) for p in pieces])
    expected = otb.sum_pi_squared(logits)
    for status, result in outcomes:
        assert status == "ok", result
        np.testing.assert_allclose(result, expected, rtol=1e-14)


def test_explicit_vocab_starts_in_any_rank_order_equal_one_process(pool):
    """Shards held out of rank order (rank k holds the (3 − k)-th slice), placed by explicit ``vocab_start``."""
    logits = np.random.default_rng(1).normal(size=(2, 3, 10)) * 3
    ids = np.array([[0, 9, 4], [2, 7, 5]])
    edges = [0, 2, 5, 6, 10]
    slices = [(edges[k], edges[k + 1]) for k in range(4)][::-1]
    arguments = [dict(logits_shard=np.ascontiguousarray(logits[..., a:b]), token_ids=ids, vocab_start=a)
                 for a, b in slices]
    outcomes = pool.run("vocab_parallel_token_statistics", "world", arguments)
    expected = otb.token_statistics_from_logits(logits, ids)
    for rank, (status, result) in enumerate(outcomes):
        assert status == "ok", f"rank {rank}: {result}"
        np.testing.assert_allclose(result.log_probs, expected.log_probs, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(result.sum_pi_squared, expected.sum_pi_squared, rtol=1e-12)


@pytest.mark.parametrize("starts, expected", [([0, 2, 6, 7], "token ids [5, 6) lie on no rank's shard"),
                                              ([0, 2, 4, 6], "rank 2's shard [4, 5) overlaps rank 1's"),
                                              ([1, 2, 5, 6], "token ids [0, 1) lie on no rank's shard"),
                                              ([0, 2, 5, 5], "overlaps")])
def test_vocab_starts_that_do_not_tile_the_vocabulary_raise_on_every_rank(pool, starts, expected):
    """Explicit offsets with a gap or an overlap would put some token ids on no rank, or on two: every rank raises
    naming vocab_start (widths 2, 3, 1, 4 — a vocabulary of 10)."""
    logits = np.random.default_rng(2).normal(size=(2, 10))
    pieces = _vocab_split(logits, 4, [2, 5, 6])
    arguments = [dict(logits_shard=piece, vocab_start=start) for piece, start in zip(pieces, starts)]
    outcomes = pool.run("vocab_parallel_token_statistics", "world", arguments)
    for _, kind, message in _errors(outcomes, range(4)):
        assert kind == "ValueError" and message.startswith("vocab_start") and expected in message, message


# ----------------------------------------------------------------------------------------------------------------------
# Bad input: every rank raises, none hangs


def _errors(outcomes, ranks):
    for rank in ranks:
        status, payload = outcomes[rank]
        assert status == "error", f"rank {rank} did not raise: {payload}"
        yield rank, payload[0], payload[1]


def test_a_row_excluded_on_every_shard_raises_on_every_rank(pool):
    """Every logit of a row is −inf on every rank: the softmax is undefined there — an error, not a NaN."""
    logits = np.array([[0.0, 1.0, 2.0, -1.0], [-np.inf, -np.inf, -np.inf, -np.inf]])
    pieces = _vocab_split(logits, 2, [2])
    outcomes = _run_on_layout(pool, "vocab_parallel_sum_pi_squared", "two", [dict(logits_shard=p) for p in pieces])
    for _, kind, message in _errors(outcomes, range(2)):
        assert kind == "ValueError" and "every logit is -inf on every rank" in message, message


def test_mismatched_vocab_shapes_raise_on_every_rank(pool):
    pieces = [np.zeros((2, 3, 4)), np.zeros((2, 3, 5)), np.zeros((3, 2, 4)), np.zeros((2, 3, 4))]
    outcomes = pool.run("vocab_parallel_sum_pi_squared", "world", [dict(logits_shard=p) for p in pieces])
    for _, kind, message in _errors(outcomes, range(4)):
        assert kind == "ValueError" and "logits_shard" in message and "differs between ranks" in message


_CORRUPTIONS = [("rewards", "masked", np.nan), ("rewards", "valid", np.inf), ("log_probs", "valid", 0.5),
                ("sum_pi_squared", "valid", 1.5), ("response_mask", "valid", 0.5), ("is_weights", "valid", -1.0)]


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("layout, leave_one_out", [("world", False), ("world", True), ("context", False)])
@pytest.mark.parametrize("name, where, value", _CORRUPTIONS)
def test_bad_values_on_one_rank_raise_on_every_rank(pool, kernel, layout, leave_one_out, name, where, value):
    """A value the reference rejects, on rank 2 only: that rank raises the reference's error naming the argument,
    every other rank says rank 2 rejected its inputs — data or context parallel, either kernel (the native one
    finds it inside its first sweep and sends its verdict with the grid; with a context group spanning the ranks, with
    the row totals)."""
    batch = _fixed_batch()
    context = layout == "context"
    row_shards = [np.arange(8)] if context else [np.array([0, 1]), np.array([2, 3]), np.array([4, 5]),
                                                 np.array([6, 7])]
    arguments, _ = _split_arguments(batch, group_segments(batch.group_ids).index, 3, row_shards,
                                    [1, 3, 4] if context else [], 4 if context else 1, align="position",
                                    leave_one_out=leave_one_out, epsilon=1e-8)
    mask = arguments[2]["response_mask"]
    rows, columns = np.nonzero(mask > 0) if where == "valid" else np.nonzero(mask == 0)
    arguments[2][name] = arguments[2][name].copy()
    arguments[2][name][rows[0], columns[0]] = value
    if kernel == "eager":
        arguments = [dict(argument, _eager=True) for argument in arguments]
    outcomes = pool.run("distributed_token_baseline", layout, arguments)
    errors = dict((rank, (kind, message)) for rank, kind, message in _errors(outcomes, range(4)))
    assert errors[2][0] == "ValueError" and errors[2][1].startswith(name), errors[2]
    for rank in (0, 1, 3):
        assert errors[rank][0] == "ValueError" and "rank 2 rejected its inputs" in errors[rank][1], errors[rank]


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("leave_one_out", [False, True])
def test_finite_rewards_whose_float32_group_sums_overflow_raise_on_every_rank(pool, kernel, leave_one_out):
    """Rewards of 2·10³⁷ on every rank's rows of one group (one row per rank): each rank's own sums Σ GW fit float32
    (about 2.7·10³⁸ at most), the all-reduced ones do not. Every rank raises, naming the rewards, instead of returning
    ±inf/NaN advantages (as before the check: the whole group's)."""
    rows, positions = 4, 16
    batch = otb.RolloutBatch(rewards=np.zeros((rows, positions), np.float32),
                             response_mask=np.ones((rows, positions), np.float32), group_ids=np.zeros(rows, np.int64),
                             log_probs=np.full((rows, positions), -2.5, np.float32),
                             sum_pi_squared=np.full((rows, positions), 0.05, np.float32), is_weights=None)
    batch.rewards[:, -1] = 2e37
    arguments, _ = _split_arguments(batch, np.zeros(rows, np.int64), 1, [np.array([row]) for row in range(rows)],
                                    [], 1, align="position", leave_one_out=leave_one_out, epsilon=1e-8)
    if kernel == "eager":
        arguments = [dict(argument, _eager=True) for argument in arguments]
    outcomes = pool.run("distributed_token_baseline", "world", arguments)
    for rank, kind, message in _errors(outcomes, range(rows)):
        assert kind == "ValueError" and message.startswith("rewards: finite, but OTB's arithmetic overflows "
                                                           "float32"), (rank, kind, message)


@pytest.mark.parametrize("kernel", KERNELS)
def test_importance_weights_whose_squares_overflow_a_context_split_are_named(pool, kernel):
    """ρ = 10¹⁹ at every token of rows cut into four one-column pieces, π = 0.01: the energy reaches
    ≈ 1.5·10³⁸·(t + 1), beyond float32 from t = 2. A piece's own ρ² fits 2·T_c·ρ² = 2·10³⁸ < 3.4·10³⁸, the row's
    2·K·ρ² does not: every rank whose results overflow names is_weights, judged on the whole row's width K (its
    own width named the rewards before)."""
    rows, positions = 4, 4
    batch = otb.RolloutBatch(rewards=np.ones((rows, positions), np.float32),
                             response_mask=np.ones((rows, positions), np.float32), group_ids=np.zeros(rows, np.int64),
                             log_probs=np.full((rows, positions), np.log(0.01), np.float32),
                             sum_pi_squared=np.full((rows, positions), 0.5, np.float32),
                             is_weights=np.full((rows, positions), 1e19, np.float32))
    arguments, _ = _split_arguments(batch, np.zeros(rows, np.int64), 1, [np.arange(rows)], [1, 2, 3], 4,
                                    align="position", leave_one_out=False, epsilon=1e-8)
    if kernel == "eager":
        arguments = [dict(argument, _eager=True) for argument in arguments]
    outcomes = pool.run("distributed_token_baseline", "context", arguments)
    raised = [rank for rank, (status, _) in enumerate(outcomes) if status == "error"]
    assert raised, outcomes
    for rank, kind, message in _errors(outcomes, raised):
        assert kind == "ValueError" and message.startswith("is_weights: finite, but the realized energy"), (
            rank, kind, message)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("leave_one_out", [False, True])
def test_float16_rewards_whose_results_leave_float16_raise(pool, kernel, leave_one_out):
    """float16 rewards of 3·10⁴ and 6·10⁴ at the last two positions of rank 0's rows: their returns-to-go (9·10⁴) leave
    float16, the outputs' dtype — rank 0 raises naming the rewards and the dtype (it returned inf); rank 1, whose rows
    hold rewards of 1, returns finite results self-inclusive (baselines ≈ 4.5·10⁴) and raises too with leave-one-out
    (its baselines are the other member's returns, 9·10⁴)."""
    rows, positions = 4, 8
    rewards = np.zeros((rows, positions), np.float16)
    rewards[:2, -2:] = [3e4, 6e4]
    rewards[2:, -1] = 1.0
    batch = otb.RolloutBatch(rewards=rewards, response_mask=np.ones((rows, positions), np.float32),
                             group_ids=np.array([0, 1, 0, 1]), log_probs=np.full((rows, positions), -1.0, np.float32),
                             sum_pi_squared=np.full((rows, positions), 0.3, np.float32), is_weights=None)
    arguments, _ = _split_arguments(batch, batch.group_ids, 2, [np.array([0, 1]), np.array([2, 3])], [], 1,
                                    align="position", leave_one_out=leave_one_out, epsilon=1e-8)
    if kernel == "eager":
        arguments = [dict(argument, _eager=True) for argument in arguments]
    outcomes = _run_on_layout(pool, "distributed_token_baseline", "two", arguments)
    for _, kind, message in _errors(outcomes, [0, 1] if leave_one_out else [0]):
        assert kind == "ValueError" and message.startswith("rewards: finite, but OTB's results leave float16's range")
    if not leave_one_out:
        status, result = outcomes[1]
        assert status == "ok" and result.advantages.dtype == np.float16 and all(np.isfinite(value).all()
                                                                                for value in result), result


@pytest.mark.parametrize("kernel", KERNELS)
def test_huge_finite_rewards_raise_only_where_the_results_overflow(pool, kernel):
    """Three cases on two data-parallel ranks, float32, rewards of ±2·10³⁷ or 3·10³⁷ at the last position: a
    singleton group whose sums overflow but whose baseline is 0 by rule (A = G: finite, no error, equal to the
    reference); leave-one-out with mixed signs [−2, 2, 2]·10³⁷ (rows 0–1 on rank 0, row 2 on rank 1), where every
    sum fits but N − G₀W₀ does not (rank 0, which holds that member, raises; rank 1 returns); and the same batch
    self-inclusive, which fits (no error)."""
    rows, positions = 4, 16
    statistics = dict(response_mask=np.ones((rows, positions), np.float32),
                      log_probs=np.full((rows, positions), -2.5, np.float32),
                      sum_pi_squared=np.full((rows, positions), 0.05, np.float32), is_weights=None)
    singleton = np.zeros((rows, positions), np.float32)
    singleton[:, -1] = [3e37, 1.0, 1.0, 1.0]
    mixed = np.zeros((rows, positions), np.float32)
    mixed[:, -1] = [-2e37, 2e37, 2e37, 0.0]
    shards = [np.array([0, 1]), np.array([2, 3])]       # each rank's own part of every sum fits float32
    for rewards, ids, leave_one_out, raising in ((singleton, [0, 1, 1, 1], False, set()),
                                                 (mixed, [0, 0, 0, 1], True, {0}), (mixed, [0, 0, 0, 1], False, set())):
        batch = otb.RolloutBatch(rewards=rewards, group_ids=np.asarray(ids), **statistics)
        arguments, _ = _split_arguments(batch, np.asarray(ids), 2, shards, [], 1, align="position",
                                        leave_one_out=leave_one_out, epsilon=1e-8)
        if kernel == "eager":
            arguments = [dict(argument, _eager=True) for argument in arguments]
        outcomes = _run_on_layout(pool, "distributed_token_baseline", "two", arguments)
        for rank, (status, payload) in enumerate(outcomes):
            if rank in raising:
                assert status == "error" and payload[1].startswith("rewards: finite, but OTB's arithmetic"), payload
            else:
                assert status == "ok", (leave_one_out, rank, payload)
                assert np.isfinite(payload.advantages).all()
        if not raising:
            _check_split(pool, batch, shards, layout="two", leave_one_out=leave_one_out, kernel=kernel)


def test_the_output_check_tells_a_value_out_of_range_from_values_whose_sum_is():
    """The output check sums each output first: values each finite whose sum overflows pass (the exact check then
    clears them); a ±inf or NaN value raises; nothing is checked without check_values."""
    from otb_torch.distributed import _check_outputs

    _check_outputs((torch.tensor([3e38, 3e38, 1.0]), torch.zeros(3)), True)
    for bad in (float("inf"), float("nan"), -float("inf")):
        with pytest.raises(ValueError, match="^rewards: finite, but OTB's arithmetic overflows float32"):
            _check_outputs((torch.zeros(3), torch.tensor([1.0, bad, 2.0])), True)
        _check_outputs((torch.zeros(3), torch.tensor([1.0, bad, 2.0])), False)


@pytest.mark.parametrize("layout", ["last two", "context two"])
@pytest.mark.parametrize("leave_one_out", [False, True])
@pytest.mark.parametrize("name, where, value", [("rewards", "masked", np.nan), ("log_probs", "valid", 0.5)])
def test_bad_values_on_one_of_two_ranks_raise_on_both(pool, layout, leave_one_out, name, where, value):
    """Over a group of two ranks the native kernel's verdict on the values travels in the exchange instead of gloo's
    all-reduce — with the grid (data parallel over global ranks 2 and 3) or alone (the rows cut in two along T over
    ranks 0 and 1, where no grid is sent): the group's second rank raises the reference's error, the first says that
    the second's global rank rejected its inputs."""
    batch = _fixed_batch()
    context = layout == "context two"
    arguments, _ = _split_arguments(batch, group_segments(batch.group_ids).index, 3,
                                    [np.arange(8)] if context else [np.arange(4), np.arange(4, 8)],
                                    [3] if context else [], 2 if context else 1, align="position",
                                    leave_one_out=leave_one_out, epsilon=1e-8)
    mask = arguments[1]["response_mask"]
    rows, columns = np.nonzero(mask > 0) if where == "valid" else np.nonzero(mask == 0)
    arguments[1][name] = arguments[1][name].copy()
    arguments[1][name][rows[0], columns[0]] = value
    errors = dict((rank, (kind, message)) for rank, kind, message in
                  _errors(_run_on_layout(pool, "distributed_token_baseline", layout, arguments), range(2)))
    second = _FIRST_RANK.get(layout, 0) + 1
    assert errors[1][0] == "ValueError" and errors[1][1].startswith(name), errors[1]
    assert errors[0][0] == "ValueError" and f"rank {second} rejected its inputs" in errors[0][1], errors[0]


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("layout, align, grid_sent", [
    ("context two", "position", False), ("context", "position", False), ("context two", "valid_token", True),
    ("mesh", "position", True), ("two", "position", True)])
def test_the_grid_is_summed_only_where_other_ranks_add_to_its_cells(pool, kernel, layout, align, grid_sent):
    """Every rank of the group holding every row (one context group of them all) and columns by position: the grid
    cells a rank reads hold every row's terms already, and every rank can count the group statistics, so nothing is
    summed (the native kernel's value verdicts ride with the pieces' totals), and its grid holds the piece's own
    columns, not all K. By valid token the pieces' columns overlap, and data-parallel ranks hold different rows: there
    the whole grid is summed (native: with the group statistics and verdicts, P·4·G + P values). The results equal
    one process's either way."""
    batch = _fixed_batch()
    ids = group_segments(batch.group_ids).index
    context_size, data_shards = CONTEXT_LAYOUTS.get(layout, (1, DATA_LAYOUTS.get(layout)))
    row_shards = [np.arange(8)] if data_shards == 1 else [np.arange(0, 8, 2), np.arange(1, 8, 2)]
    cuts = {4: (1, 3, 4), 2: (3,), 1: ()}[context_size]
    arguments, pieces = _split_arguments(batch, ids, 3, row_shards, list(cuts), context_size, align=align,
                                         leave_one_out=False, epsilon=1e-8)
    arguments = [dict(argument, _count_reduced=True, _eager=kernel == "eager") for argument in arguments]
    outcomes = _run_on_layout(pool, "distributed_token_baseline", layout, arguments)
    # the native path's statistics and verdicts ride in the grid's buffer: where the ranks run it (on a machine without
    # a C compiler the eager path runs in its place)
    native = kernel == "native" and all(answer for _, answer in pool.run("native_kernel_status", "world",
                                                                          [{}] * WORLD_SIZE))
    expected = _reference(batch, ids, align=align, leave_one_out=False, epsilon=1e-8)
    tolerance, _ = otb_comparison_tolerance(batch.rewards, batch.response_mask, ids, batch.log_probs,
                                            batch.sum_pi_squared, is_weights=batch.is_weights, align=align,
                                            compute_dtype=np.float64)
    ranks, grid = len(arguments), 2 * 3 * batch.rewards.shape[1]          # 2 planes × G × K
    for rank, ((status, answer), (rows, columns)) in enumerate(zip(outcomes, pieces)):
        assert status == "ok", f"rank {rank}: {answer}"
        result, reduced, grids = answer
        _sliced(tolerance, rows, columns).assert_close(result.advantages, expected.advantages[rows][:, columns],
                                                       f"rank {rank} advantages")
        statistics = ranks * 4 * 3 + ranks if native else 0
        assert reduced == (grid + statistics if grid_sent else 0), (rank, reduced)
        if native:   # the last grid the kernel allocated: the first sweep's, or after it a context piece's (a grid
            # widened to K for the sum is not recorded; in these layouts every rank's rows are K wide)
            own = columns.stop - columns.start
            assert grids[-1] == (batch.rewards.shape[1] if grid_sent else own), (rank, grids)


@pytest.mark.parametrize("layout", ["two", "world"])
def test_leave_one_out_sums_its_grid_once_and_only_the_dominant_cells_besides(pool, layout):
    """Leave-one-out, native kernel: the grid (3 planes × G × K) with the statistics and verdicts is summed once; over
    two ranks nothing else (the exchange brings the other rank's sums, which a dominant member's rank reads); over four
    the others' sums of the dominant cells, 2 values per cell. The results equal one process's."""
    if not all(answer for _, answer in pool.run("native_kernel_status", "world", [{}] * WORLD_SIZE)):
        pytest.skip("the native kernel does not build here")
    batch = _fixed_batch()
    ids = group_segments(batch.group_ids).index
    ranks = DATA_LAYOUTS[layout]
    row_shards = [np.arange(k, 8, ranks) for k in range(ranks)]
    arguments, pieces = _split_arguments(batch, ids, 3, row_shards, [], 1, align="position", leave_one_out=True,
                                         epsilon=1e-8)
    outcomes = _run_on_layout(pool, "distributed_token_baseline", layout,
                              [dict(argument, _count_reduced=True) for argument in arguments])
    expected = _reference(batch, ids, align="position", leave_one_out=True, epsilon=1e-8)
    tolerance, _ = otb_comparison_tolerance(batch.rewards, batch.response_mask, ids, batch.log_probs,
                                            batch.sum_pi_squared, is_weights=batch.is_weights, leave_one_out=True,
                                            handle_zero_tail=False, compute_dtype=np.float64, clamped_weights=True)
    # the dominant cells of the whole batch (weights W⁺ above ¾ of their cell's D), as the ranks find them
    energy = otb.realized_energy(otb.token_energy(batch.log_probs, batch.sum_pi_squared), batch.response_mask,
                                 is_weights=batch.is_weights)
    energy = np.maximum(energy, 0.0) * batch.response_mask
    column_sums = np.zeros((3, batch.rewards.shape[1]))
    np.add.at(column_sums, ids, energy)
    dominant = int((energy > DOMINANT_SHARE * column_sums[ids]).sum())
    grid = 3 * 3 * batch.rewards.shape[1] + ranks * 4 * 3 + ranks
    for rank, ((status, answer), (rows, columns)) in enumerate(zip(outcomes, pieces)):
        assert status == "ok", f"rank {rank}: {answer}"
        result, reduced, _ = answer
        _sliced(tolerance, rows, columns).assert_close(result.advantages, expected.advantages[rows][:, columns],
                                                       f"rank {rank} advantages")
        assert reduced == grid + (0 if ranks == 2 else 2 * dominant), (rank, reduced, dominant)


@pytest.mark.parametrize("problem", ["id outside num_groups", "num_groups differs", "ids differ in context group",
                                     "rows differ in context group", "align differs", "token id outside vocab",
                                     "NaN logit"])
def test_disagreeing_ranks_raise_on_every_rank(pool, problem):
    batch = _fixed_batch()
    ids = group_segments(batch.group_ids).index
    if problem in ("token id outside vocab", "NaN logit"):
        logits = np.random.default_rng(0).normal(size=(2, 3, 8))
        pieces = _vocab_split(logits, 4, [2, 4, 6])
        token_ids = np.zeros((2, 3), np.int64)
        arguments = [dict(logits_shard=p, token_ids=token_ids) for p in pieces]
        if problem == "NaN logit":
            arguments[1]["logits_shard"] = pieces[1].copy()
            arguments[1]["logits_shard"][0, 0, 0] = np.nan
        else:
            arguments = [dict(a, token_ids=np.full((2, 3), 8, np.int64)) for a in arguments]
        outcomes = pool.run("vocab_parallel_token_statistics", "world", arguments)
        for _, kind, message in _errors(outcomes, range(4)):
            assert kind == "ValueError"
            assert ("logits_shard" in message) if problem == "NaN logit" else ("token_ids" in message)
        return
    layout, context = ("context", [1, 3, 4]) if "context group" in problem else ("world", [])
    row_shards = [np.arange(8)] if context else [np.array([0, 1]), np.array([2, 3]), np.array([4, 5]),
                                                 np.array([6, 7])]
    arguments, _ = _split_arguments(batch, ids, 3, row_shards, context, len(context) + 1, align="position",
                                    leave_one_out=False, epsilon=1e-8)
    if problem == "id outside num_groups":
        arguments[1]["group_ids"] = np.array([0, 5])
    elif problem == "num_groups differs":
        arguments[3]["num_groups"] = 4
    elif problem == "ids differ in context group":
        arguments[2]["group_ids"] = arguments[2]["group_ids"][::-1].copy()
    elif problem == "rows differ in context group":
        arguments[1] = {key: (value[:7] if isinstance(value, np.ndarray) else value)
                        for key, value in arguments[1].items()}
    elif problem == "align differs":
        arguments[0]["align"] = "valid_token"
    outcomes = pool.run("distributed_token_baseline", layout, arguments)
    names = {"id outside num_groups": "group_ids", "num_groups differs": "num_groups",
             "ids differ in context group": "group_ids", "rows differ in context group": "rewards",
             "align differs": "align"}
    for _, kind, message in _errors(outcomes, range(4)):
        assert kind == "ValueError"
        assert message.startswith(names[problem]) or "rejected its inputs" in message, message


def _four_ranks(batch):
    arguments, _ = _split_arguments(batch, group_segments(batch.group_ids).index, 3,
                                    [np.array([0, 1]), np.array([2, 3]), np.array([4, 5]), np.array([6, 7])], [], 1,
                                    align="position", leave_one_out=False, epsilon=1e-8)
    return arguments


def test_a_missing_rank_times_out_instead_of_hanging(pool):
    """Rank 3 never calls: the others must fail within their timeout (then the pool is restarted)."""
    arguments = _four_ranks(_fixed_batch())
    for argument in arguments:
        argument["timeout"] = 2.0
    outcomes = pool.run("distributed_token_baseline", "world", arguments[:3] + [None])
    for _, kind, message in _errors(outcomes, range(3)):
        assert kind in ("RuntimeError", "DistBackendError") and "within timeout=2.0 s" in message, message


@pytest.mark.parametrize("function", ["distributed_token_baseline", "vocab_parallel_token_statistics"])
def test_a_rank_skipping_the_value_checks_raises_on_every_rank(pool, function):
    """check_values=False on one rank, with a NaN there: that rank would pass NaN into the others' sums — so the flag
    must agree over the ranks, and every rank raises naming it (it did return NaN on the checking ranks before)."""
    if function == "distributed_token_baseline":
        arguments = _four_ranks(_fixed_batch())
        arguments[1]["rewards"] = arguments[1]["rewards"].copy()
        arguments[1]["rewards"][0, 0] = np.nan
        arguments[1]["check_values"] = False
    else:
        pieces = _vocab_split(np.random.default_rng(0).normal(size=(2, 3, 8)), 4, [2, 4, 6])
        arguments = [dict(logits_shard=piece, token_ids=np.zeros((2, 3), np.int64)) for piece in pieces]
        arguments[1]["logits_shard"] = pieces[1].copy()
        arguments[1]["logits_shard"][0, 0, 0] = np.nan
        arguments[1]["check_values"] = False
    for _, kind, message in _errors(pool.run(function, "world", arguments), range(4)):
        assert kind == "ValueError" and message.startswith("check_values: differs between ranks"), message
        assert "rank 1: False" in message and "rank 0: True" in message, message


@pytest.mark.parametrize("leave_one_out", [False, True])
def test_a_rank_on_the_other_kernel_raises_on_every_rank(pool, leave_one_out):
    """One rank on the eager path (no C compiler there, or OTB_TORCH_NATIVE=0) while the others run the native kernel:
    the two paths exchange different buffers and, for leave-one-out over two ranks, different collectives, so every
    rank raises naming the kernel instead of failing in the exchange or waiting out the timeout."""
    if not all(answer for _, answer in pool.run("native_kernel_status", "world", [{}] * WORLD_SIZE)):
        pytest.skip("the native kernel does not build here")
    arguments = [dict(argument, leave_one_out=leave_one_out, timeout=60.0) for argument in _four_ranks(_fixed_batch())]
    arguments[3]["_eager"] = True
    for _, kind, message in _errors(pool.run("distributed_token_baseline", "world", arguments), range(4)):
        assert kind == "ValueError" and message.startswith("the kernel (native where"), message
        assert "rank 3: 'eager'" in message and "rank 0: 'native'" in message, message


def test_a_bad_timeout_on_one_rank_raises_on_every_rank_at_once(pool):
    """timeout=-1 on one rank: that rank's error names the argument, the others say which rank rejected its inputs —
    after the handshake, not after their own timeout, and the group stays usable (the next call succeeds)."""
    arguments = _four_ranks(_fixed_batch())
    for argument in arguments:
        argument["timeout"] = 60.0
    arguments[2]["timeout"] = -1
    errors = dict((rank, (kind, message)) for rank, kind, message in
                  _errors(pool.run("distributed_token_baseline", "world", arguments), range(4)))
    assert errors[2][0] == "ValueError" and errors[2][1].startswith("timeout: expected a positive number"), errors[2]
    for rank in (0, 1, 3):
        assert errors[rank][0] == "ValueError" and "rank 2 rejected its inputs" in errors[rank][1], errors[rank]
    arguments[2]["timeout"] = 60.0
    for rank, (status, payload) in enumerate(pool.run("distributed_token_baseline", "world", arguments)):
        assert status == "ok", (rank, payload)


@pytest.mark.parametrize("option, values, shown", [
    ("epsilon", (1e-8, 1e-3), ("rank 0: 1e-08", "rank 3: 0.001")),
    ("align", ("position", "valid_token"), ("rank 0: 'position'", "rank 3: 'valid_token'")),
    ("leave_one_out", (False, True), ("rank 0: False", "rank 3: True")),
])
def test_options_that_differ_between_ranks_are_shown_as_passed(pool, option, values, shown):
    arguments = _four_ranks(_fixed_batch())
    for argument in arguments:
        argument[option] = values[0]
        argument.pop("handle_zero_tail", None)
    arguments[3][option] = values[1]
    for _, kind, message in _errors(pool.run("distributed_token_baseline", "world", arguments), range(4)):
        assert kind == "ValueError" and message.startswith(f"{option}: differs between ranks"), message
        assert all(text in message for text in shown), message


@pytest.mark.parametrize("function", ["distributed_token_baseline", "context_parallel_returns_and_energy",
                                      "vocab_parallel_token_statistics"])
@pytest.mark.parametrize("other", ["float16", "float64"])
def test_ranks_given_different_dtypes_raise_on_every_rank(pool, function, other):
    """Rank 2's floating inputs in another dtype than the others' float32: its results would come back in that dtype
    (float16) or its sums would differ (float64), and a later collective over the results would mix dtypes — every
    rank raises, naming each rank's dtypes (float16 beside float32 passed unnoticed before)."""
    batch = _fixed_batch()
    if function == "vocab_parallel_token_statistics":
        logits = np.random.default_rng(0).normal(size=(2, 3, 8))
        arguments = [dict(logits_shard=piece.astype(np.float32), token_ids=np.zeros((2, 3), np.int64))
                     for piece in _vocab_split(logits, 4, [2, 4, 6])]
    elif function == "context_parallel_returns_and_energy":
        cuts = [0, 2, 3, 5, 6]
        arguments = [{name: np.ascontiguousarray(getattr(batch, name)[:, a:b], dtype=np.float32)
                      for name in ("rewards", "response_mask", "log_probs", "sum_pi_squared")}
                     for a, b in zip(cuts, cuts[1:])]
    else:
        arguments = [{key: value.astype(np.float32) if isinstance(value, np.ndarray) and value.dtype.kind == "f" else
                      value for key, value in argument.items()} for argument in _four_ranks(batch)]
    arguments[2] = {key: value.astype(other) if isinstance(value, np.ndarray) and value.dtype.kind == "f" else value
                    for key, value in arguments[2].items()}
    layout = "context" if function == "context_parallel_returns_and_energy" else "world"
    for _, kind, message in _errors(pool.run(function, layout, arguments), range(4)):
        assert kind == "ValueError" and "differs between ranks" in message, message
        assert "rank 0: 'float32 results, sums in float32'" in message, message
        assert f"rank 2: '{other} results, sums in {'float64' if other == 'float64' else 'float32'}'" in message


def test_a_type_error_on_one_rank_is_a_type_error_on_every_rank(pool):
    """Float group ids on rank 1: its own error is the reference's TypeError, and the other ranks raise the same type
    (naming rank 1), so that one except clause serves every rank."""
    arguments = _four_ranks(_fixed_batch())
    arguments[1]["group_ids"] = np.asarray(arguments[1]["group_ids"], dtype=np.float64)
    errors = dict((rank, (kind, message)) for rank, kind, message in
                  _errors(pool.run("distributed_token_baseline", "world", arguments), range(4)))
    assert errors[1][0] == "TypeError" and errors[1][1].startswith("group_ids"), errors[1]
    for rank in (0, 2, 3):
        assert errors[rank][0] == "TypeError" and "rank 1 rejected its inputs" in errors[rank][1], errors[rank]


def test_global_group_ids(pool):
    local = [np.array(["a", "b", "a"]), np.array(["c", "a"]), np.array(["b"]), np.array(["d", "c"])]
    outcomes = pool.run("global_group_ids", "world", [dict(ids=ids) for ids in local])
    numbered = [result for status, result in outcomes]
    assert [ids.tolist() for ids, _ in numbered] == [[0, 1, 0], [2, 0], [1], [3, 2]]
    assert {count for _, count in numbered} == {4}


def test_context_parallel_returns_and_energy(pool):
    batch = _fixed_batch()
    cuts = [0, 2, 3, 5, 6]
    arguments = [dict(rewards=np.ascontiguousarray(batch.rewards[:, a:b]),
                      response_mask=np.ascontiguousarray(batch.response_mask[:, a:b]),
                      log_probs=np.ascontiguousarray(batch.log_probs[:, a:b]),
                      sum_pi_squared=np.ascontiguousarray(batch.sum_pi_squared[:, a:b]),
                      is_weights=np.ascontiguousarray(batch.is_weights[:, a:b])) for a, b in zip(cuts, cuts[1:])]
    outcomes = pool.run("context_parallel_returns_and_energy", "context", arguments)
    returns = otb.returns_to_go(batch.rewards, batch.response_mask)
    energy = otb.realized_energy(otb.token_energy(batch.log_probs, batch.sum_pi_squared), batch.response_mask,
                                 is_weights=batch.is_weights)
    for rank, ((status, scan), a, b) in enumerate(zip(outcomes, cuts, cuts[1:])):
        assert status == "ok", scan
        np.testing.assert_allclose(scan.returns, returns[:, a:b], rtol=1e-13, atol=1e-13)
        np.testing.assert_allclose(scan.energy, energy[:, a:b], rtol=1e-13, atol=1e-13)
        assert scan.columns_before == a
        assert scan.lengths.tolist() == batch.response_mask.sum(-1).astype(int).tolist()


def test_context_groups_of_different_lengths(pool):
    """Data shards padded to different lengths, each cut over its own context pair: K is the longest row of all."""
    batch = _fixed_batch()
    mask = batch.response_mask.copy()
    mask[4:, 4:] = 0.0                                        # the second pair's rows fit in 4 columns
    batch = dataclasses.replace(batch, response_mask=mask)
    ids = group_segments(batch.group_ids).index
    expected = otb.optimal_token_baseline(batch.rewards, mask, ids, batch.log_probs, batch.sum_pi_squared,
                                          is_weights=batch.is_weights)
    tolerance, _ = otb_comparison_tolerance(batch.rewards, mask, ids, batch.log_probs, batch.sum_pi_squared,
                                            is_weights=batch.is_weights, compute_dtype=np.float64)
    pieces = [(np.arange(4), slice(0, 3)), (np.arange(4), slice(3, 6)), (np.arange(4, 8), slice(0, 2)),
              (np.arange(4, 8), slice(2, 4))]
    arguments = [dict(rewards=np.ascontiguousarray(batch.rewards[rows][:, cut]),
                      response_mask=np.ascontiguousarray(mask[rows][:, cut]), group_ids=ids[rows],
                      log_probs=np.ascontiguousarray(batch.log_probs[rows][:, cut]),
                      sum_pi_squared=np.ascontiguousarray(batch.sum_pi_squared[rows][:, cut]),
                      is_weights=np.ascontiguousarray(batch.is_weights[rows][:, cut]), num_groups=3)
                 for rows, cut in pieces]
    outcomes = pool.run("distributed_token_baseline", "mesh", arguments)
    for rank, ((status, result), (rows, cut)) in enumerate(zip(outcomes, pieces)):
        assert status == "ok", f"rank {rank}: {result}"
        _sliced(tolerance, rows, cut).assert_close(result.advantages, expected.advantages[rows][:, cut],
                                                   f"rank {rank} advantages")


def test_a_rank_without_its_context_group_raises_on_every_rank(pool):
    batch = _fixed_batch()
    arguments, _ = _split_arguments(batch, group_segments(batch.group_ids).index, 3, [np.arange(4), np.arange(4, 8)],
                                    [3], 2, align="position", leave_one_out=False, epsilon=1e-8)
    outcomes = pool.run("distributed_token_baseline", "mesh-broken", arguments)
    for _, kind, message in _errors(outcomes, range(4)):
        assert kind == "ValueError" and message.startswith("context_group"), message


def test_global_group_ids_bad_id_on_one_rank_raises_on_every_rank(pool):
    local = [np.array([1.0, 2.0]), np.array([np.nan]), np.array([3.0]), np.array([1.0])]
    outcomes = pool.run("global_group_ids", "world", [dict(ids=ids) for ids in local])
    for _, kind, message in _errors(outcomes, range(4)):
        assert kind == "ValueError" and ("NaN" in message or "rank 1" in message), message
    local[1] = np.array([[1, 2]], dtype=object)[:, :1].reshape(1).copy()
    local[1][0] = [1, 2]                                                              # unhashable: a TypeError
    outcomes = pool.run("global_group_ids", "world", [dict(ids=ids) for ids in local])
    for _, kind, message in _errors(outcomes, range(4)):
        assert kind == "TypeError" and ("hashable" in message or "rank 1" in message), message


# ----------------------------------------------------------------------------------------------------------------------
# One rank on the backend's own device: gloo on the CPU here; NCCL on a CUDA device where there is one (the path a
# multi-GPU trainer takes: the handshake, the row totals' all-gather and, called directly, the all-reduce and all-gather
# a wider group sums the grid and gathers the statistics with — a world of one holds every row and sums nothing — on
# the inputs' device). In a fresh process with a world of one, so that no process group of this test process is touched
# and a collective cannot hang the suite. NaN rewards must still raise there, with and without a context group.

_ONE_RANK = r"""
import datetime, os, sys
import numpy as np, torch, torch.distributed as dist
from otb_torch import distributed as otb_dist
backend, device, folder, port, hide = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5] == "1"
if hide and hasattr(dist, "all_gather_single"):          # as torch 2.11, which has all_gather_into_tensor alone
    del dist.all_gather_single
dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                        timeout=datetime.timedelta(seconds=60))
inputs = np.load(os.path.join(folder, "inputs.npz"))
on = {name: torch.as_tensor(inputs[name], device=device) for name in inputs.files}
for case in ("self-inclusive", "leave-one-out", "multi-turn", "context parallel"):
    options = dict(leave_one_out=case == "leave-one-out", align="valid_token" if case == "multi-turn" else "position")
    if case == "context parallel":
        options["context_group"] = dist.group.WORLD
    result = otb_dist.distributed_token_baseline(on["rewards"], on["mask"], on["ids"], on["log_probs"], on["spp"],
                                                 num_groups=int(inputs["ids"].max()) + 1, is_weights=on["weights"],
                                                 timeout=60.0, **options)
    assert result.advantages.device.type == torch.device(device).type, (case, result.advantages.device)
    np.savez(os.path.join(folder, case + ".npz"), advantages=result.advantages.cpu().numpy(),
             returns=result.returns.cpu().numpy())
summed = torch.arange(4.0, device=device, dtype=on["rewards"].dtype)
otb_dist._all_reduce(summed, dist.ReduceOp.SUM, None, 60.0)
gathered = otb_dist._all_gather(summed, None, 60.0)
assert summed.device.type == gathered.device.type == torch.device(device).type
assert summed.tolist() == [0.0, 1.0, 2.0, 3.0] and gathered.tolist() == [[0.0, 1.0, 2.0, 3.0]], (summed, gathered)
bad = on["rewards"].clone()
bad[0, 0] = float("nan")
for context in (None, dist.group.WORLD):
    try:
        otb_dist.distributed_token_baseline(bad, on["mask"], on["ids"], on["log_probs"], on["spp"], num_groups=int(
            inputs["ids"].max()) + 1, is_weights=on["weights"], context_group=context, timeout=60.0)
    except ValueError as error:
        assert str(error).startswith("rewards"), error
    else:
        raise AssertionError(f"NaN rewards in a world of one were not rejected (context group: {context})")
print("checked", flush=True)
dist.destroy_process_group()
print("destroyed", flush=True)
sys.stderr.flush()
os._exit(0)         # the work is done and written: no interpreter finalization (see the test's docstring)
"""


def _nccl_usable() -> bool:
    return torch.cuda.is_available() and torch.distributed.is_nccl_available()


@pytest.mark.parametrize("backend, device, hide_all_gather_single", [
    pytest.param("gloo", "cpu", False, id="gloo-cpu"),
    # torch releases without torch.distributed.all_gather_single (2.11, on the lent GPU machine) failed here with
    # AttributeError until the adapter fell back to all_gather_into_tensor: this case hides the newer name (on such a
    # release it has nothing to hide and repeats gloo-cpu)
    pytest.param("gloo", "cpu", True, id="gloo-cpu-without-all_gather_single"),
    pytest.param("nccl", "cuda", False, id="nccl-cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
        not _nccl_usable(), reason="no CUDA device with NCCL visible to torch")]),
])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_one_rank_on_the_backends_device_equals_the_reference(tmp_path, backend, device, hide_all_gather_single,
                                                              dtype):
    """A world of one in a process of its own, on the backend's device: every variant equals the reference, the
    collectives keep the device, NaN rewards are rejected. The child reports its stages on stdout and leaves with
    ``os._exit(0)`` once the process group is destroyed and its results are written: one run of this test in CI
    (2026-11-27, torch 2.13.0, gloo) aborted with "terminate called without an active exception" and nothing else
    printed, not reproduced in 820 runs of the child here since (stage markers and core dumps at the ready); a gloo
    child of the TRL test did the same at interpreter exit before it destroyed its group (tests/trl_tiny.py). With
    the markers, an abort before the child's work is done still fails here and says at which stage."""
    batch = _fixed_batch(rows=8, positions=6, seed=11)
    ids = group_segments(batch.group_ids).index
    cast = {name: np.asarray(value, dtype=dtype) for name, value in dict(
        rewards=batch.rewards, mask=batch.response_mask, log_probs=batch.log_probs, spp=batch.sum_pi_squared,
        weights=batch.is_weights).items()}
    np.savez(tmp_path / "inputs.npz", ids=ids, **cast)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    completed = subprocess.run([sys.executable, "-c", _ONE_RANK, backend, device, str(tmp_path), str(port),
                                "1" if hide_all_gather_single else "0"],
                               capture_output=True, text=True, timeout=180)
    assert completed.returncode == 0, (f"exit status {completed.returncode}; the child's stages reached: "
                                       f"{completed.stdout.split()}; stderr: {completed.stderr[-3000:]}")
    exact = dataclasses.replace(batch, **{field: cast[name] for field, name in (
        ("rewards", "rewards"), ("response_mask", "mask"), ("log_probs", "log_probs"), ("sum_pi_squared", "spp"),
        ("is_weights", "weights"))})
    for case in ("self-inclusive", "leave-one-out", "multi-turn", "context parallel"):
        leave_one_out, align = case == "leave-one-out", "valid_token" if case == "multi-turn" else "position"
        expected = _reference(exact, ids, align=align, leave_one_out=leave_one_out, epsilon=1e-8)
        advantage_tol, returns_tol = otb_comparison_tolerance(
            exact.rewards, exact.response_mask, ids, exact.log_probs, exact.sum_pi_squared,
            is_weights=exact.is_weights, align=align, leave_one_out=leave_one_out, handle_zero_tail=not leave_one_out,
            epsilon=1e-8, compute_dtype=np.dtype(dtype))
        got = np.load(tmp_path / f"{case}.npz")
        advantage_tol.assert_close(got["advantages"], expected.advantages, f"{backend} {case} advantages")
        returns_tol.assert_close(got["returns"], expected.returns, f"{backend} {case} returns")
