"""otb_jax.distributed on several host devices (``--xla_force_host_platform_device_count``, set in conftest.py):
``shard_map`` over 1-D and 2-D meshes, compared with the single-process NumPy reference on the whole batch within
the reference's error bounds, on Hypothesis-generated batches whose rows are permuted (groups scattered over devices).
"""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

import otb_spec as otb  # noqa: E402
from forced_openings import forced_opening_with_one_deviant, groups_outside, returns_range  # noqa: E402
from otb_jax import distributed as jax_distributed  # noqa: E402
from otb_spec import strategies  # noqa: E402
from otb_spec.groups import group_segments  # noqa: E402
from otb_spec.tolerances import otb_comparison_tolerance, proxy_tolerance, sum_pi_squared_tolerance  # noqa: E402

pytestmark = pytest.mark.distributed

if len(jax.devices("cpu")) < 4:  # pragma: no cover - only when XLA_FLAGS was set by hand without the device count
    pytest.skip("needs 4 host devices (--xla_force_host_platform_device_count=4)", allow_module_level=True)

MESHES = {
    "data4": (("data",), (4,), "data", None),
    "data2": (("data",), (2,), "data", None),
    "context4": (("context",), (4,), None, "context"),
    "data2xcontext2": (("data", "context"), (2, 2), "data", "context"),
}


def _mesh(name: str) -> tuple[Mesh, object, object]:
    axes, shape, data_axis, context_axis = MESHES[name]
    devices = np.array(jax.devices("cpu")[:int(np.prod(shape))]).reshape(shape)
    return Mesh(devices, axes), data_axis, context_axis


ROWS, COLUMNS, GROUPS = 8, 12, 12      # fixed shapes: one compiled program per mesh and options


def _fit(batch, order: np.ndarray):
    """The batch's rows permuted (groups scattered over the devices), then padded to ROWS × COLUMNS: extra rows are
    empty singleton groups of their own, extra columns masked — neither changes the other rows' reference result."""
    rows, columns = batch.rewards.shape
    extra_rows, extra_columns = ROWS - rows, COLUMNS - columns

    def fit(array, fill=0.0):
        if array is None:
            return None
        return np.pad(np.asarray(array)[order], [(0, extra_rows), (0, extra_columns)], constant_values=fill)

    ids = group_segments(np.asarray(batch.group_ids)[order]).index
    ids = np.concatenate([ids, ids.max() + 1 + np.arange(extra_rows)])
    return dict(rewards=fit(batch.rewards), response_mask=fit(batch.response_mask),
                log_probs=fit(batch.log_probs), sum_pi_squared=fit(batch.sum_pi_squared),
                is_weights=fit(batch.is_weights, 1.0)), ids


@settings(max_examples=25)
@given(data=st.data(), mesh_name=st.sampled_from(sorted(MESHES)), align=st.sampled_from(["position", "valid_token"]),
       leave_one_out=st.booleans())
def test_sharded_otb_equals_one_process(data, mesh_name, align, leave_one_out):
    mesh, data_axis, context_axis = _mesh(mesh_name)
    batch = data.draw(strategies.rollout_batches(min_groups=1, max_groups=4, min_group_size=2, max_group_size=4,
                                                 min_length=2, max_length=COLUMNS, dtype=np.float32,
                                                 is_weights=True).filter(lambda b: b.rewards.shape[0] <= ROWS))
    order = np.asarray(data.draw(st.permutations(range(batch.rewards.shape[0]))), dtype=np.int64)
    inputs, ids = _fit(batch, order)
    num_groups = GROUPS
    result = jax_distributed.distributed_token_baseline(
        inputs["rewards"], inputs["response_mask"], ids, inputs["log_probs"], inputs["sum_pi_squared"],
        num_groups=num_groups, mesh=mesh, data_axis=data_axis, context_axis=context_axis,
        is_weights=inputs["is_weights"], align=align, leave_one_out=leave_one_out)
    common = dict(is_weights=inputs["is_weights"])
    if leave_one_out:
        expected = otb.leave_one_out_token_baseline(inputs["rewards"], inputs["response_mask"], ids,
                                                    inputs["log_probs"], inputs["sum_pi_squared"], align=align,
                                                    **common)
    else:
        function = otb.optimal_token_baseline if align == "position" else otb.multi_turn_optimal_token_baseline
        expected = function(inputs["rewards"], inputs["response_mask"], ids, inputs["log_probs"],
                            inputs["sum_pi_squared"], **common)
    advantage_tol, returns_tol = otb_comparison_tolerance(
        inputs["rewards"], inputs["response_mask"], ids, inputs["log_probs"], inputs["sum_pi_squared"], align=align,
        leave_one_out=leave_one_out, handle_zero_tail=not leave_one_out, compute_dtype=np.float32,
        clamped_weights=True, **common)
    advantage_tol.assert_close(np.asarray(result.advantages), expected.advantages, f"{mesh_name} advantages")
    returns_tol.assert_close(np.asarray(result.returns), expected.returns, f"{mesh_name} returns")
    mask = inputs["response_mask"]
    assert np.all(np.asarray(result.baselines)[mask == 0] == 0)


@pytest.mark.parametrize("mesh_name", ["context4", "data2xcontext2"])
@pytest.mark.parametrize("align", ["position", "valid_token"])
def test_leave_one_out_weighs_whole_energies_clamped_at_zero(mesh_name, align):
    """Leave-one-out weighs by max(W, 0) of the whole row's W (proofs/N1 item 5): a context block clamps after the
    earlier blocks' energy is added. float32 statistics of a forced 6-token opening with Σπ² = π² ± 10⁻³ token by
    token (within the input slack; the blocks cut it) give energies of both signs: the result matches the reference
    within the verifier's tolerance and every baseline stays a weighted mean of the others' returns (|A| ≤ 2·max|G|)."""
    rng = np.random.default_rng(5)
    pi = rng.uniform(0.2, 0.9, size=(ROWS, COLUMNS))
    spp = pi**2 + (1 - pi) ** 2 * rng.uniform(0.1, 1.0, size=(ROWS, COLUMNS))
    pi[:, :6] = 0.999
    spp[:, :6] = pi[:, :6] ** 2 + 1e-3 * rng.choice([-1.0, 1.0], size=(ROWS, 6))
    rewards = np.zeros((ROWS, COLUMNS), np.float32)
    rewards[:, -1] = rng.integers(0, 2, size=ROWS)
    mask = np.ones((ROWS, COLUMNS), np.float32)
    log_probs, spp = np.log(pi).astype(np.float32), spp.astype(np.float32)
    ids = np.array([0, 1, 0, 1, 0, 1, 0, 1])                    # each group on both data shards
    advantages, _ = _leave_one_out_matches_the_reference(mesh_name, align, rewards, mask, ids, log_probs, spp,
                                                         GROUPS)
    assert np.abs(advantages).max() <= 2.0


def _leave_one_out_matches_the_reference(mesh_name, align, rewards, mask, ids, log_probs, spp, num_groups):
    """Leave-one-out on the mesh, checked against the reference within the verifier's tolerance (float32, weights
    clamped at 0); returns (advantages, the reference's result)."""
    mesh, data_axis, context_axis = _mesh(mesh_name)
    result = jax_distributed.distributed_token_baseline(
        rewards, mask, ids, log_probs, spp, num_groups=num_groups, mesh=mesh, data_axis=data_axis,
        context_axis=context_axis, align=align, leave_one_out=True)
    expected = otb.leave_one_out_token_baseline(rewards, mask, ids, log_probs, spp, align=align)
    advantage_tol, _ = otb_comparison_tolerance(rewards, mask, ids, log_probs, spp, align=align, leave_one_out=True,
                                                handle_zero_tail=False, compute_dtype=np.float32,
                                                clamped_weights=True)
    advantages = np.asarray(result.advantages)
    advantage_tol.assert_close(advantages, expected.advantages, f"{mesh_name} advantages")
    return advantages, expected


@pytest.mark.parametrize("mesh_name", ["data4", "data2xcontext2"])
@pytest.mark.parametrize("align", ["position", "valid_token"])
def test_leave_one_out_of_a_member_whose_energy_dwarfs_the_others_across_devices(mesh_name, align):
    """A forced opening where one member of 8 sampled another token (tests/forced_openings.py), float32, rows
    permuted over the devices: at t = 0 that member's W ≈ 2 against the others' total of 10⁻⁷ or less, where D − Wᵢ
    from the summed grid cancels to rounding noise. It takes the others' sums from a second grid without dominant
    members: every baseline stays in [min(G, 0), max(G, 0)] of its group, and the result matches the reference within
    the verifier's tolerance. With D − Wᵢ, 3 of the 1000 groups' baselines leave that range here (|B| up to 1.85)."""
    groups = 1000
    batch = forced_opening_with_one_deviant(groups, positions=4, seed=1)
    order = np.random.default_rng(2).permutation(groups * 8)
    rewards, mask, log_probs, spp = (np.asarray(getattr(batch, name), np.float32)[order] for name in (
        "rewards", "response_mask", "log_probs", "sum_pi_squared"))
    ids = batch.group_ids[order]
    advantages, expected = _leave_one_out_matches_the_reference(mesh_name, align, rewards, mask, ids, log_probs, spp,
                                                                groups)
    baselines = expected.returns - advantages
    outside = groups_outside(baselines, ids, *returns_range(expected.returns, ids, groups))
    assert not outside, (f"{len(outside)} groups' baselines leave [min(G, 0), max(G, 0)] "
                         f"(worst |B| = {np.abs(baselines).max():.3g})")


@settings(max_examples=20)
@given(data=st.data(), size=st.sampled_from([2, 4]), with_ids=st.booleans())
def test_vocab_parallel_statistics_equal_one_process(data, size, with_ids):
    mesh = Mesh(np.array(jax.devices("cpu")[:size]), ("vocab",))
    vocab = 16
    logits = data.draw(strategies.logits((3, 2), vocab_size=vocab)).astype(np.float32)
    ids = np.asarray(data.draw(st.lists(st.integers(0, vocab - 1), min_size=6, max_size=6))).reshape(3, 2) \
        if with_ids else None
    result = jax_distributed.vocab_parallel_token_statistics(logits, ids, mesh=mesh, vocab_axis="vocab")
    expected = otb.token_statistics_from_logits(logits, ids)
    spp_tol = sum_pi_squared_tolerance(logits, dtype=np.float32) + sum_pi_squared_tolerance(logits, dtype=np.float64)
    spp_tol.assert_close(np.asarray(result.sum_pi_squared), expected.sum_pi_squared, "Σπ²")
    proxy = proxy_tolerance(vocab, float(np.abs(logits[np.isfinite(logits)]).max(initial=0.0)), dtype=np.float32)
    proxy.assert_close(np.asarray(result.entropy), expected.entropy, "entropy")
    if with_ids:
        proxy.assert_close(np.asarray(result.log_probs), expected.log_probs, "log π(y)")


def test_vocab_parallel_ids_on_no_block_give_nan_and_narrow_ids_are_their_values():
    """An id on no device's block (outside [0, V), unchecked or under jit) gives log π = NaN, not −log S₁; uint8 ids
    with V = 320 are read as their values, checked or not."""
    mesh = Mesh(np.array(jax.devices("cpu")[:4]), ("vocab",))
    logits = np.random.default_rng(3).normal(size=(2, 320)).astype(np.float32)
    wide = np.array([200, 7])
    expected = jax_distributed.vocab_parallel_token_statistics(logits, wide, mesh=mesh, vocab_axis="vocab")
    narrow = jax_distributed.vocab_parallel_token_statistics(logits, wide.astype(np.uint8), mesh=mesh,
                                                            vocab_axis="vocab")
    np.testing.assert_array_equal(np.asarray(narrow.log_probs), np.asarray(expected.log_probs))
    outside = jax_distributed.vocab_parallel_token_statistics(logits, np.array([320, -1]), mesh=mesh,
                                                             vocab_axis="vocab", check_values=False)
    assert np.isnan(np.asarray(outside.log_probs)).all()
    np.testing.assert_array_equal(np.asarray(outside.entropy), np.asarray(expected.entropy))


def test_bad_input_is_named():
    mesh, data_axis, _ = _mesh("data4")
    ones = np.ones((6, 3))
    with pytest.raises(ValueError, match="rewards: the 6 rows"):
        jax_distributed.distributed_token_baseline(ones, ones, np.zeros(6, np.int32), ones * 0, ones, num_groups=1,
                                                   mesh=mesh, data_axis=data_axis)
    bad = np.ones((4, 3))
    bad[1, 1] = np.nan
    with pytest.raises(ValueError, match="^rewards"):
        jax_distributed.distributed_token_baseline(bad, np.ones((4, 3)), np.zeros(4, np.int32), np.zeros((4, 3)),
                                                   np.ones((4, 3)), num_groups=1, mesh=mesh, data_axis=data_axis)
    huge = np.zeros((4, 64), np.float32)          # finite rewards whose float32 group sums Σᵢ GₜⁱWₜⁱ overflow
    huge[:, -1] = 1e37
    with pytest.raises(ValueError, match=r"^rewards: finite, but OTB's arithmetic overflows float32"):
        jax_distributed.distributed_token_baseline(huge, np.ones((4, 64), np.float32), np.zeros(4, np.int32),
                                                   np.full((4, 64), -2.5, np.float32),
                                                   np.full((4, 64), 0.05, np.float32), num_groups=1, mesh=mesh,
                                                   data_axis=data_axis)
    with pytest.raises(ValueError, match="group_ids"):
        jax_distributed.distributed_token_baseline(np.ones((4, 3)), np.ones((4, 3)), np.array([0, 1, 2, 3]),
                                                   np.zeros((4, 3)), np.ones((4, 3)), num_groups=2, mesh=mesh,
                                                   data_axis=data_axis)
    vocab_mesh = Mesh(np.array(jax.devices("cpu")[:4]), ("vocab",))
    with pytest.raises(ValueError, match="logits: the vocabulary"):
        jax_distributed.vocab_parallel_token_statistics(np.zeros((2, 6)), mesh=vocab_mesh, vocab_axis="vocab")
    with pytest.raises(ValueError, match=r"vocab_axis: the mesh has no axis 'model' \(its axes: 'vocab'\)"):
        jax_distributed.vocab_parallel_token_statistics(np.zeros((2, 8)), mesh=vocab_mesh, vocab_axis="model")
    ones = np.ones((4, 3))
    for axis_options, argument in ((dict(data_axis="batch"), "data_axis"),
                                   (dict(data_axis="data", context_axis="seq"), "context_axis")):
        with pytest.raises(ValueError, match=f"{argument}: the mesh has no axis"):
            jax_distributed.distributed_token_baseline(ones, ones, np.zeros(4, np.int32), ones * 0, ones,
                                                       num_groups=1, mesh=mesh, **axis_options)
    # the per-device function inside your own shard_map checks its options too: an unknown alignment is not read as
    # "valid_token"
    for function, options in ((jax_distributed.distributed_token_baseline, dict(mesh=mesh, data_axis=data_axis)),
                              (jax_distributed.distributed_token_baseline_local, dict(data_axis=data_axis))):
        with pytest.raises(ValueError, match=r"^align: expected one of \('position', 'valid_token'\), got 'turn'"):
            function(ones, ones, np.zeros(4, np.int32), ones * 0, ones, num_groups=1, align="turn", **options)


def test_junk_weights_at_masked_positions_are_ignored():
    """float32, a huge importance weight where the mask is 0: the result is finite and the reference's."""
    mesh, data_axis, context_axis = _mesh("data2xcontext2")
    rng = np.random.default_rng(0)
    mask = np.ones((4, 4), np.float32)
    mask[0, 1:] = 0.0
    weights = np.ones((4, 4), np.float32)
    weights[0, 1] = 1e20
    half = np.full((4, 4), 0.5, np.float32)
    rewards = rng.normal(size=(4, 4)).astype(np.float32)
    ids = np.zeros(4, np.int32)
    got = jax_distributed.distributed_token_baseline(rewards, mask, ids, np.log(half), half, num_groups=1, mesh=mesh,
                                                     data_axis=data_axis, context_axis=context_axis,
                                                     is_weights=weights)
    expected = otb.optimal_token_baseline(rewards, mask, ids, np.log(half), half, is_weights=weights)
    tolerance, _ = otb_comparison_tolerance(rewards, mask, ids, np.log(half), half, is_weights=weights,
                                            compute_dtype=np.float32)
    tolerance.assert_close(np.asarray(got.advantages), expected.advantages, "advantages")


@pytest.mark.parametrize("mesh_name", ["data4", "data2xcontext2"])
@pytest.mark.parametrize("align, leave_one_out", [("position", False), ("valid_token", False),
                                                  ("position", True), ("valid_token", True)])
def test_unchecked_ids_outside_the_groups_give_nan_rows_and_masks_are_read_as_nonzero(mesh_name, align,
                                                                                      leave_one_out):
    """Unchecked (check_values=False, as under jit): a group id outside [0, num_groups) gives its row NaN advantages
    and baselines and joins no group — the other rows are those of the batch without it, as in the one-device port
    (a scatter would wrap −1 into the last group and drop or clamp an id ≥ G); a mask of 2s is read as 1s."""
    mesh, data_axis, context_axis = _mesh(mesh_name)
    rng = np.random.default_rng(7)
    rows, columns, groups = ROWS, COLUMNS, GROUPS         # the shapes compiled above: no new program to compile
    rewards = rng.normal(size=(rows, columns)).astype(np.float32)
    mask = (rng.random((rows, columns)) < 0.8).astype(np.float32)
    pi = rng.uniform(0.05, 0.9, size=(rows, columns)).astype(np.float32)
    spp = (pi**2 + (1 - pi) ** 2 / 3).astype(np.float32)
    ids = np.array([0, 1, 2, 0, 1, 2, 0, 1], np.int32)    # three groups of the twelve
    options = dict(num_groups=groups, mesh=mesh, data_axis=data_axis, context_axis=context_axis, align=align,
                   leave_one_out=leave_one_out)

    def call(ids, mask):
        result = jax_distributed.distributed_token_baseline(rewards, mask, ids, np.log(pi), spp, check_values=False,
                                                            **options)
        return np.asarray(result.advantages), np.asarray(result.baselines)

    for outside in (-1, groups, groups + 5):             # scattered: −1 into the last group, ≥ G dropped/clamped
        bad = ids.copy()
        bad[3] = outside
        advantages, baselines = call(bad, mask)
        assert np.isnan(advantages[3]).all() and np.isnan(baselines[3]).all(), outside
        keep = np.arange(rows) != 3
        reference = (otb.leave_one_out_token_baseline(rewards[keep], mask[keep], ids[keep], np.log(pi[keep]),
                                                      spp[keep], align=align) if leave_one_out else
                     (otb.optimal_token_baseline if align == "position" else otb.multi_turn_optimal_token_baseline)(
                         rewards[keep], mask[keep], ids[keep], np.log(pi[keep]), spp[keep]))
        tolerance, _ = otb_comparison_tolerance(rewards[keep], mask[keep], ids[keep], np.log(pi[keep]), spp[keep],
                                                align=align, leave_one_out=leave_one_out,
                                                handle_zero_tail=not leave_one_out, compute_dtype=np.float32)
        tolerance.assert_close(advantages[keep], reference.advantages, f"the other rows, id {outside}")
    np.testing.assert_array_equal(call(ids, 2 * mask)[0], call(ids, mask)[0])


def _psums(jaxpr) -> list[tuple[tuple, tuple]]:
    """(axes, operand shapes) of every psum in a traced program, nested programs included."""
    found = []
    for equation in jaxpr.eqns:
        if equation.primitive.name.startswith("psum"):
            found.append((tuple(equation.params["axes"]), tuple(tuple(v.aval.shape) for v in equation.invars)))
        for value in equation.params.values():
            for inner in value if isinstance(value, (list, tuple)) else [value]:
                inner = getattr(inner, "jaxpr", inner)
                if hasattr(inner, "eqns"):
                    found.extend(_psums(inner))
    return found


@pytest.mark.parametrize("mesh_name, align, expected", [
    ("data2xcontext2", "position", [(("data",), (2, GROUPS * COLUMNS // 2))]),
    ("context4", "position", []),
    ("data2xcontext2", "valid_token", [(("data", "context"), (2, GROUPS * COLUMNS))]),
    ("context4", "valid_token", [(("context",), (2, GROUPS * COLUMNS))]),
    ("data4", "position", [(("data",), (2, GROUPS * COLUMNS))])])
def test_the_grid_is_summed_over_the_devices_that_add_to_its_cells(mesh_name, align, expected):
    """By position a context block's grid cells get terms only from the devices at the same context index (equal
    blocks): its grid is [G, T_c], summed over the data axes alone (nothing to sum without one). By valid token a
    block's tokens reach any column of K: [G, K], summed over every axis. The values are checked against the
    reference by test_sharded_otb_equals_one_process; this checks what travels (the traced program's psums)."""
    mesh, data_axis, context_axis = _mesh(mesh_name)
    program = jax_distributed._sharded_baseline(mesh, data_axis, context_axis, GROUPS, align, False, True, 1e-8, False)
    cells, rows = jax.ShapeDtypeStruct((ROWS, COLUMNS), np.float32), jax.ShapeDtypeStruct((ROWS,), np.int32)
    traced = jax.make_jaxpr(program)(cells, cells, rows, cells, cells)
    grids = [(axes, shapes[0]) for axes, shapes in _psums(traced.jaxpr) if len(shapes[0]) == 2]
    assert grids == expected, grids


def test_the_shard_map_snippet_of_the_docs_runs_as_written():
    """docs/distributed.md's `shard_map` example, executed verbatim on a 2 × 2 (dp, cp) mesh, equals the reference."""
    import pathlib
    import re

    from jax.sharding import PartitionSpec

    import otb_jax
    text = (pathlib.Path(__file__).parents[1] / "docs" / "distributed.md").read_text(encoding="utf-8")
    snippet = re.search(r"\*\*JAX, inside your own jitted step:\*\*.*?```python\n(.*?)```", text, re.S).group(1)
    rng = np.random.default_rng(0)
    rows, columns = 8, 16
    rewards = rng.normal(size=(rows, columns)).astype(np.float32)
    mask = (rng.random((rows, columns)) < 0.9).astype(np.float32)
    pi = rng.uniform(0.1, 0.9, (rows, columns)).astype(np.float32)
    spp = (pi**2 + (1 - pi) ** 2 / 3).astype(np.float32)
    uids = np.array(["a", "b", "c", "d", "b", "a", "d", "c"])
    devices = np.array(jax.devices("cpu")[:4]).reshape(2, 2)
    namespace = dict(jax=jax, otb_jax=otb_jax, P=PartitionSpec, mesh=Mesh(devices, ("dp", "cp")), uids=uids,
                     distributed_token_baseline_local=jax_distributed.distributed_token_baseline_local)
    exec(snippet, namespace)
    got = namespace["advantages"](rewards, mask, namespace["ids"], np.log(pi), spp)
    expected = otb.leave_one_out_token_baseline(rewards, mask, uids, np.log(pi), spp)
    tolerance, _ = otb_comparison_tolerance(rewards, mask, uids, np.log(pi), spp, leave_one_out=True,
                                            handle_zero_tail=False, compute_dtype=np.float32)
    tolerance.assert_close(np.asarray(got), expected.advantages, "the snippet's advantages")
