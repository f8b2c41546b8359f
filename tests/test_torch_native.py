"""The native CPU kernel of otb_torch (adapters/otb_torch/_kernel.c): its exponential, its equality with the eager
kernel and the reference in the layouts trainers produce, its independence of the thread split, and the fallback.

The shared suite (tests/test_adapters.py) runs it as ``torch-cpu`` and the eager kernel as ``torch-cpu-eager``; the
value checks of both are tested in tests/test_torch_adapter.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import textwrap
import types

import numpy as np
import pytest

torch = pytest.importorskip("torch")
otb_torch = pytest.importorskip("otb_torch")

from otb_spec import otb  # noqa: E402
from otb_spec.tolerances import otb_comparison_tolerance  # noqa: E402
from otb_torch import _native  # noqa: E402

STATUS = otb_torch.native_kernel_status()
needs_native = pytest.mark.skipif(not STATUS.available, reason=f"native kernel not available: {STATUS.reason}")


def test_the_kernel_is_built_where_a_compiler_exists():
    """CI and development machines have a C compiler: the kernel must build there (set OTB_REQUIRE_NATIVE=0 to allow
    the eager fallback on a machine without one)."""
    if os.environ.get("OTB_REQUIRE_NATIVE", "1") == "0" or os.environ.get("OTB_TORCH_NATIVE") == "0":
        pytest.skip("the eager fallback is allowed here")
    assert STATUS.available, STATUS.reason
    assert os.path.exists(STATUS.path)


@needs_native
def test_exponential_is_within_one_ulp():
    """exp(min(x, 0)) of the float32 kernel: relative error ≤ 2ε = 2⁻²² against float64 on a dense grid of (−87, 0]
    (measured ≤ 0.82 ε), exactly 1 at 0 and for x > 0, 0 from −87 down, NaN for NaN."""
    grid = torch.cat([torch.linspace(-86.999, 0.0, 1_000_003), -torch.rand(100_000, dtype=torch.float64).float() * 5])
    got = _native.exp_float32(grid).double()
    exact = torch.exp(grid.double())
    relative = ((got - exact).abs() / exact).max().item()
    assert relative <= 2.0**-22, relative
    special = torch.tensor([0.0, -0.0, 3.0, float("inf"), -87.0, -88.0, -1e30, -float("inf"), float("nan")])
    out = _native.exp_float32(special)
    assert out[:4].tolist() == [1.0, 1.0, 1.0, 1.0]
    assert out[4] <= 1.7e-38 and out[5:8].tolist() == [0.0, 0.0, 0.0]
    assert torch.isnan(out[8])


def _batch(seed: int, layout: str, multi_turn: bool):
    from test_adapters import realistic_batch, unequal_sizes
    sizes = [4] * 6 if layout == "contiguous" else unequal_sizes(seed, 9)
    return realistic_batch(seed, sizes, 33, scattered=layout != "contiguous", holes=multi_turn,
                           empty_rows=0 if layout == "contiguous" else 3, is_weights=True)


_MASK_DTYPES = [torch.bool, torch.uint8, torch.int32, torch.int64, torch.float32, torch.float64, torch.bfloat16]


# variant → (otb_torch function, the reference's, the alignment, leave-one-out)
_VARIANTS = {
    "single_turn": ("optimal_token_baseline", "position", False),
    "multi_turn": ("multi_turn_optimal_token_baseline", "valid_token", False),
    "leave_one_out": ("leave_one_out_token_baseline", "position", True),
    "leave_one_out_multi_turn": ("leave_one_out_token_baseline", "valid_token", True),
}


def _options(variant: str) -> list[dict]:
    """The rules' corners each variant runs: the zero tail on and off (self-inclusive), ε = 0."""
    _, align, leave_one_out = _VARIANTS[variant]
    if leave_one_out:
        return [dict(align=align, epsilon=1e-8), dict(align=align, epsilon=0.0)]
    return [dict(handle_zero_tail=True, epsilon=1e-8), dict(handle_zero_tail=False, epsilon=0.0)]


@needs_native
@pytest.mark.parametrize("layout", ["contiguous", "scattered-unequal"])
@pytest.mark.parametrize("variant", sorted(_VARIANTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
@pytest.mark.parametrize("mask_dtype", _MASK_DTYPES, ids=str)
def test_native_equals_eager_and_the_reference(layout, variant, dtype, mask_dtype):
    """Every mask dtype the kernel reads in place (and one it converts), every compute dtype, IS weights, the zero
    tail on and off, ε = 0, self-inclusive and leave-one-out in both alignments: the native result is within the
    reference's derived tolerance of the reference and of the eager kernel's (both are correct programs, with
    different rounding), baselines included."""
    function, align, leave_one_out = _VARIANTS[variant]
    batch = _batch(5, layout, align == "valid_token")
    tensor = lambda array, kind=dtype: torch.as_tensor(np.asarray(array)).to(kind)  # noqa: E731
    wide = torch.float64 if dtype == torch.float64 else torch.float32          # what the reference is given: the
    seen = {name: tensor(getattr(batch, name)).to(wide).numpy()                # rounded values, in a dtype whose
            for name in ("rewards", "log_probs", "sum_pi_squared", "is_weights")}  # input slack covers the rounding
    compute = "float64" if dtype == torch.float64 else "float32"
    for options in _options(variant):
        call = lambda: getattr(otb_torch, function)(  # noqa: E731
            tensor(batch.rewards), tensor(batch.response_mask, mask_dtype), batch.group_ids, tensor(batch.log_probs),
            tensor(batch.sum_pi_squared), is_weights=tensor(batch.is_weights), **options)
        native = call()
        with _native.eager_only():
            eager = call()
        expected = getattr(otb, function)(seen["rewards"], batch.response_mask, batch.group_ids, seen["log_probs"],
                                          seen["sum_pi_squared"], is_weights=seen["is_weights"], **options)
        advantages_tolerance, returns_tolerance = otb_comparison_tolerance(
            seen["rewards"], batch.response_mask, batch.group_ids, seen["log_probs"], seen["sum_pi_squared"],
            is_weights=seen["is_weights"], epsilon=options["epsilon"], align=align, leave_one_out=leave_one_out,
            handle_zero_tail=options.get("handle_zero_tail", False), compute_dtype=compute,
            output_dtype=str(dtype).replace("torch.", ""))
        label = f"{variant} {layout} {dtype} mask {mask_dtype} {options}"
        for result in (native, eager):
            assert result.advantages.dtype == result.returns.dtype == result.baselines.dtype == dtype
            advantages_tolerance.assert_close(result.advantages.double().numpy(), expected.advantages, label)
            returns_tolerance.assert_close(result.returns.double().numpy(), expected.returns, label)
            advantages_tolerance.assert_close(result.baselines.double().numpy(), expected.baselines, label)
        (advantages_tolerance + advantages_tolerance).assert_close(
            native.advantages.double().numpy(), eager.advantages.double().numpy(), label + " native vs eager")


def _drop_in(name: str):
    """A drop-in with verl's signature: otb_torch's self-inclusive ones, otb_torch.verl's leave-one-out ones."""
    import otb_torch.verl
    return getattr(otb_torch, name, None) or getattr(otb_torch.verl, name)


@needs_native
@pytest.mark.bitexact
@pytest.mark.parametrize("function", ["compute_optimal_token_baseline_advantage",
                                      "compute_multi_turn_optimal_token_baseline_advantage",
                                      "compute_leave_one_out_token_baseline_advantage",
                                      "compute_multi_turn_leave_one_out_token_baseline_advantage"])
def test_results_do_not_depend_on_the_number_of_threads(monkeypatch, function):
    """A group is computed by one thread from start to end, so 1, 2 or 3 threads give bitwise the same outputs (with
    shares made small enough that this small batch really is split)."""
    monkeypatch.setattr(_native, "ELEMENTS_PER_SHARE", 64)
    used = []
    original = _native.shares
    monkeypatch.setattr(_native, "shares", lambda offsets, workers: used.append(original(offsets, workers)) or used[-1])
    batch = _batch(8, "scattered-unequal", "multi_turn" in function)
    inputs = [torch.as_tensor(np.asarray(a, dtype=np.float32)) for a in (batch.rewards, batch.response_mask)]
    inputs += [batch.group_ids] + [torch.as_tensor(np.asarray(a, dtype=np.float32))
                                   for a in (batch.log_probs, batch.sum_pi_squared, batch.is_weights)]
    threads = torch.get_num_threads()
    results = []
    try:
        for count in (1, 2, 3):
            torch.set_num_threads(count)
            results.append(_drop_in(function)(*inputs))
    finally:
        torch.set_num_threads(threads)
    assert [len(bounds) - 1 for bounds in used] == [1, 2, 3]
    for other in results[1:]:
        for got, expected in zip(other, results[0]):
            assert torch.equal(got, expected)


def _one_rank(batch, variant: str, dtype=torch.float32, shards: int = 1, seed: int = 0, **options):
    """The distributed kernels (``otb_dist_first``, ``otb_dist_final``) run as a rank holding the whole batch — no
    collective: its grid is the merged one. Its group statistics ([P, 4, G]) are its own (``shards`` = 1) or, for
    the self-inclusive final sweep to merge, those of the rows split at random (``seed``) over ``shards`` ranks, each
    rank's from its own first sweep. Returns (advantages, returns, baselines)."""
    _, align, leave_one_out = _VARIANTS[variant]
    tensors = [torch.as_tensor(np.asarray(a)).to(dtype) for a in (batch.rewards, batch.response_mask,
                                                                   batch.log_probs, batch.sum_pi_squared)]
    weights = None if batch.is_weights is None else torch.as_tensor(np.asarray(batch.is_weights)).to(dtype)
    ids = torch.as_tensor(otb_torch.segments_from_index(batch.group_ids).index)
    groups = int(ids.max()) + 1

    def plan(rows):
        return _native.local_groups(ids[rows], tensors[0].shape[1])

    def first_sweep(rows, rows_plan):
        return _native.distributed_first(
            *(value[rows] for value in tensors), None if weights is None else weights[rows], rows_plan,
            num_groups=groups, align=align, leave_one_out=leave_one_out, dtype=dtype, check=False, slacks=None)

    whole = plan(slice(None))
    first = first_sweep(slice(None), whole)
    statistics = first.stats.numpy()[None]
    if shards > 1:
        rng = np.random.default_rng(seed)
        owner = np.concatenate([np.arange(shards), rng.integers(0, shards, ids.shape[0] - shards)])
        rng.shuffle(owner)                                          # every rank holds at least one row
        members = [torch.as_tensor(np.flatnonzero(owner == rank)) for rank in range(shards)]
        statistics = np.stack([first_sweep(rows, plan(rows)).stats.numpy() for rows in members])
    advantages, baselines = _native.distributed_final(
        tensors[1], whole, first, None if leave_one_out else statistics,
        num_groups=groups, align=align, leave_one_out=leave_one_out,
        handle_zero_tail=options.get("handle_zero_tail", False), epsilon=options["epsilon"], dtype=dtype)
    return advantages, first.returns, baselines


@needs_native
@pytest.mark.bitexact
@pytest.mark.parametrize("variant", ["single_turn", "multi_turn"])
@pytest.mark.parametrize("seed", range(4))
def test_the_final_sweep_merges_group_statistics_from_any_split_of_the_rows(variant, seed):
    """otb_dist_final merges the ranks' [P, 4, G] group statistics itself (members, longest, count at the longest,
    second longest): given the statistics of the rows split over 2–4 ranks in any way — each rank's computed by its
    own first sweep, as on a real rank — it gives, bit for bit, what the one-process kernel does with the zero tail on
    and off (a member count or longest length taken from one rank instead of all, the count at the longest summed
    over ranks that do not reach it, or the second length chosen without regard to the longest: each fails it)."""
    function, align, _ = _VARIANTS[variant]
    batch = _batch(seed, "scattered-unequal", align == "valid_token")
    tensors = [torch.as_tensor(np.asarray(getattr(batch, name), dtype=np.float32)) for name in (
        "rewards", "response_mask", "log_probs", "sum_pi_squared", "is_weights")]
    for shards in (2, 3, 4):
        for options in _options(variant):
            got = _one_rank(batch, variant, torch.float32, shards=shards, seed=seed, **options)
            one = getattr(otb_torch, function)(tensors[0], tensors[1], batch.group_ids, tensors[2], tensors[3],
                                               is_weights=tensors[4], **options)
            for name, value, expected in zip(("advantages", "returns", "baselines"), got, one):
                assert torch.equal(value, expected), (variant, seed, shards, options, name)


@needs_native
@pytest.mark.bitexact
@pytest.mark.parametrize("variant", sorted(_VARIANTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_one_rank_distributed_kernels_equal_the_one_process_kernel(variant, dtype):
    """otb_torch.distributed's native kernels on a rank holding every row compute what the one-process kernel does,
    bit for bit: the same sweeps in the same order (members in batch order), group sums in a [G, planes, K] grid
    instead of scratch rows, the zero rules from the group statistics, and for leave-one-out each column's largest
    weight kept out of the sums (FN(otb_top) in _kernel.c: per group of the grid on a rank, in scratch in one
    process)."""
    function, align, _ = _VARIANTS[variant]
    batch = _batch(6, "scattered-unequal", align == "valid_token")
    tensor = lambda name: torch.as_tensor(np.asarray(getattr(batch, name))).to(dtype)  # noqa: E731
    for options in _options(variant):
        got = _one_rank(batch, variant, dtype, **options)
        one = getattr(otb_torch, function)(tensor("rewards"), tensor("response_mask"), batch.group_ids,
                                           tensor("log_probs"), tensor("sum_pi_squared"),
                                           is_weights=tensor("is_weights"), **options)
        for name, value, expected in zip(("advantages", "returns", "baselines"), got, one):
            assert torch.equal(value, expected), (variant, options, name)


def _build_variant(directory, replacements=(), *defines: str):
    """The kernel source with textual ``replacements`` (each must match once), built with the loader's first flag set
    at -O1 (quicker to build; the same code paths) plus ``defines``, and loaded: a test-only library."""
    import ctypes

    source = _native._SOURCE.read_text()
    for old, new in replacements:
        assert source.count(old) == 1, old
        source = source.replace(old, new)
    directory.mkdir()
    (directory / "_kernel.c").write_text(source)      # the file includes itself by this name
    flags = ["-O1" if flag == "-O3" else flag for flag in _native._variants()[0]] + list(defines)
    error = _native._compile(_native._compiler(), flags, directory / "kernel.so", source=directory / "_kernel.c")
    assert error is None, error
    return ctypes.CDLL(str(directory / "kernel.so"))


def _every_sweep(monkeypatch, library) -> list[torch.Tensor]:
    """Every entry point that prefetches — the one-process sweep of each variant and the distributed first sweep
    (with the final one after it in float32) — in each compute dtype, with a mask read in place of a narrower type
    and of the compute type, with and without IS weights, value checks on, with one and with several thread shares
    (whose first and last rows are the edges of the prefetching), on ``library``: all outputs, in order."""
    monkeypatch.setitem(_native._STATE, "library", library)
    monkeypatch.setattr(_native, "ELEMENTS_PER_SHARE", 64)
    threads, outputs = torch.get_num_threads(), []
    try:
        for count in (1, 3):
            torch.set_num_threads(count)
            for variant, (function, align, _) in sorted(_VARIANTS.items()):
                batch = _batch(11, "scattered-unequal", align == "valid_token")
                ids = torch.as_tensor(otb_torch.segments_from_index(batch.group_ids).index)
                plan = _native.local_groups(ids, np.asarray(batch.response_mask).shape[1])
                for dtype, mask_dtype in ((torch.float32, torch.bool), (torch.float64, torch.float64)):
                    tensors = [torch.as_tensor(np.asarray(getattr(batch, name))).to(dtype)
                               for name in ("rewards", "log_probs", "sum_pi_squared", "is_weights")]
                    mask = torch.as_tensor(np.asarray(batch.response_mask)).to(mask_dtype)
                    for weights in (tensors[3], None):
                        outputs += getattr(otb_torch, function)(tensors[0], mask, batch.group_ids, tensors[1],
                                                                tensors[2], is_weights=weights, epsilon=1e-8)
                        first = _native.distributed_first(
                            tensors[0], mask, tensors[1], tensors[2], weights, plan, num_groups=int(ids.max()) + 1,
                            align=align, leave_one_out=_VARIANTS[variant][2], dtype=dtype, check=True,
                            slacks=(1e-6, 1e-6))
                        outputs += [first.grid, first.returns]
                        if first.energy is not None:           # written on the valid spans only
                            outputs.append(torch.where(mask != 0, first.energy, 0))
                outputs += _one_rank(batch, variant, torch.float32, epsilon=1e-8)
    finally:
        torch.set_num_threads(threads)
    return outputs


@needs_native
def test_the_next_row_prefetched_is_the_row_computed_next(monkeypatch, tmp_path):
    """The kernel prefetches the next member row while it computes one (issue 25). A wrong address cannot fault nor
    change a value, so a build with OTB_PREFETCH_CHECK verifies it instead: after each row, the row the sweep computes
    next must be the one the cursor described — each array's base, its length in cache lines (the mask's in its own
    type), the output rows the sweep writes — with each line prefetched once. It does, for every sweep that
    prefetches, and the checked build computes bitwise what the shipped one does. Shown to fail (planted into the
    source): the current row prefetched instead of the next one, in the one-process and in the distributed sweep; the
    mask's lines counted in the compute type's size; leave-one-out's advantages row (where mₜWₜ waits) not prefetched;
    a line skipped in the round robin."""
    checked = _build_variant(tmp_path / "checked", (), "-DOTB_PREFETCH_CHECK")
    shipped = _native._load()[0]
    got = _every_sweep(monkeypatch, checked)
    assert checked.otb_prefetch_check_errors() == 0
    expected = _every_sweep(monkeypatch, shipped)
    assert len(got) == len(expected)
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    plants = {
        "one process, this row again": (
            "const int64_t next = p + 1 < offsets[last_group] ? (order ? order[p + 1] : p + 1) * width : -1;",
            "const int64_t next = p + 1 < offsets[last_group] ? (order ? order[p] : p) * width : -1;"),
        "distributed, this row again": (
            "const int64_t next = p + 1 < offsets[last_group] ? rows_in_order[p + 1] * width : -1;",
            "const int64_t next = p + 1 < offsets[last_group] ? rows_in_order[p] * width : -1;"),
        "the mask's lines in T's size": (
            "pf->lines[2] = otb_lines(width * (int64_t)sizeof(M));",
            "pf->lines[2] = otb_lines(width * (int64_t)sizeof(T));"),
        "leave-one-out's energies row not prefetched": (
            "FN(otb_prefetch_row)(&prefetch, next, width, m, lp, r, spp, rho, ret, leave_one_out ? adv : 0),",
            "FN(otb_prefetch_row)(&prefetch, next, width, m, lp, r, spp, rho, ret, 0),"),
        "a line skipped": (
            "            pf->array = 0;\n            ++pf->line;",
            "            pf->array = 0;\n            pf->line += 1 + (pf->line == 3);"),
    }
    for number, (name, replacement) in enumerate(plants.items()):
        planted = _build_variant(tmp_path / f"planted{number}", [replacement], "-DOTB_PREFETCH_CHECK")
        _every_sweep(monkeypatch, planted)
        assert planted.otb_prefetch_check_errors() > 0, name


@needs_native
@pytest.mark.bitexact
@pytest.mark.parametrize("variant", sorted(_VARIANTS))
def test_distributed_kernels_do_not_depend_on_the_number_of_threads(monkeypatch, variant):
    """The distributed kernels split a rank's local groups over threads: 1, 2 or 3 give bitwise the same results."""
    monkeypatch.setattr(_native, "ELEMENTS_PER_SHARE", 64)
    batch = _batch(9, "scattered-unequal", _VARIANTS[variant][1] == "valid_token")
    threads = torch.get_num_threads()
    results = []
    try:
        for count in (1, 2, 3):
            torch.set_num_threads(count)
            results.append(_one_rank(batch, variant, **_options(variant)[0]))
    finally:
        torch.set_num_threads(threads)
    for other in results[1:]:
        for got, expected in zip(other, results[0]):
            assert torch.equal(got, expected)


@needs_native
@pytest.mark.parametrize("kernel", ["native", "eager", "one rank"])
@pytest.mark.parametrize("align", ["position", "valid_token"])
@pytest.mark.parametrize("epsilon", [0.0, 1e-8])
def test_leave_one_out_has_no_baseline_where_the_other_members_energy_is_not_positive(kernel, align, epsilon):
    """Float32 inputs may make an energy negative (π² − Σπ² within the input slack): where the other members' realized
    energy D is negative, B = 0 exactly (the reference's rule, others_denominator), A = G, whatever ε — not N/ε (10⁶
    here with ε = 10⁻⁸: D clamped to 0, the rule until the verl audit of 2026-11-27), nor N/(D + ε) (the bare
    formula, unbounded where D + ε crosses 0)."""
    positions = 20
    mask = np.ones((2, positions), np.float32)
    pi = np.full((2, positions), 0.5, np.float32)
    spp = pi**2 + (1 - pi) ** 2 * 0.5
    pi[1, :12] = 0.99                                       # member 1: w = (1 − π)² − 0.02 < 0 on its first 12 tokens
    spp[1, :12] = pi[1, :12] ** 2 - 0.02
    rewards = np.zeros((2, positions), np.float32)
    rewards[:, -1] = [1.0, 0.5]
    arrays = dict(rewards=rewards, response_mask=mask, log_probs=np.log(pi), sum_pi_squared=spp.astype(np.float32))
    expected = otb.leave_one_out_token_baseline(arrays["rewards"], mask, [0, 0], arrays["log_probs"],
                                                arrays["sum_pi_squared"], align=align, epsilon=epsilon)
    assert np.all(expected.baselines[0, :12] == 0.0)       # the reference's rule, for the record
    tensors = [torch.as_tensor(value) for value in arrays.values()]
    if kernel == "one rank":
        batch = types.SimpleNamespace(**arrays, group_ids=np.array([0, 0]), is_weights=None)
        advantages, returns, baselines = _one_rank(batch, "leave_one_out" if align == "position" else
                                                   "leave_one_out_multi_turn", epsilon=epsilon)
    else:
        with _native.eager_only() if kernel == "eager" else contextlib.nullcontext():
            advantages, returns, baselines = otb_torch.leave_one_out_token_baseline(
                tensors[0], tensors[1], [0, 0], tensors[2], tensors[3], align=align, epsilon=epsilon)
    assert torch.all(baselines[0, :12] == 0.0)
    assert torch.equal(advantages[0, :12], returns[0, :12])


def _fold_exact(z: torch.Tensor, split: int):
    """Float64 running sums of the float32 logits z over two vocabulary chunks (columns < split, then the rest), the
    first rescaled to the overall maximum: what ``fused_fold`` computes, exactly up to its rounding."""
    z = z.double()
    top = z.amax(1, keepdim=True)
    e, d = torch.exp(z - top), z - top
    return top[:, 0], e.sum(1), (e * e).sum(1), (e * d).sum(1)


@needs_native
@pytest.mark.parametrize("width", [1, 7, 8, 17, 33, 300])
def test_fused_block_kernels_equal_their_formulas_for_any_split(width):
    """``otb_fused_fold_float32`` over two vocabulary chunks (the second rescales the first's sums) and
    ``otb_fused_cotangent_float32`` against float64, for widths that leave every tail length of the vector loops.
    Bound per row: naive summation's γ_n Σ|terms| (any order; n = width + 2 for the rescaling) plus each term's own
    error — the exponential's 2ε and the rounding of z − m (|z − m|·u relative) — all in float32's u."""
    generator = torch.Generator().manual_seed(width)
    rows = 37
    z = (torch.randn(rows, width, generator=generator) * 6).float()
    z[3] += 50.0                                      # a row whose maximum moves from chunk to chunk
    split = max(1, width // 3)
    peak, s1, s2, tilt = (torch.zeros(rows) for _ in range(4))
    _native.fused_fold(z[:, :split].contiguous(), peak, s1, s2, tilt, first=True)
    if split < width:
        _native.fused_fold(z[:, split:].contiguous(), peak, s1, s2, tilt, first=False)
    top, e1, e2, et = _fold_exact(z, split)
    u = 2.0**-24
    gamma = (width + 2) * u / (1 - (width + 2) * u)
    d = (z.double() - top[:, None]).abs()
    e = torch.exp(-d)
    own = e * (4 * u + d * u)                         # 2ε = 4u: the exponential; d·u: z − m rounded
    assert torch.equal(peak.double(), top)
    assert ((s1.double() - e1).abs() <= gamma * e1 + own.sum(1) + u * e1).all()
    assert ((s2.double() - e2).abs() <= gamma * e2 + (2 * e * own).sum(1) + u * e2).all()
    bound_t = gamma * (e * d).sum(1) + (own * d + e * d * u).sum(1) + u * (e * d).sum(1) + 1e-45
    assert ((tilt.double() - et).abs() <= bound_t).all()
    # the cotangent: with x = z − lse (float32-rounded, as the kernel forms it), z ← (c₀ + c₁·x)·e^{min(x, 0)}
    neg_lse = (-(top + torch.log(e1))).float()
    x = (z + neg_lse[:, None]).double()
    offset, slope = torch.randn(rows, generator=generator), torch.randn(rows, generator=generator)
    for with_slope in (True, False):
        got = z.clone()
        _native.fused_cotangent(got, neg_lse, offset, slope if with_slope else None)
        c = offset.double()[:, None] + (slope.double()[:, None] * x if with_slope else 0)
        exact = c * torch.exp(x.clamp(max=0))
        magnitude = (offset.double().abs()[:, None] + (slope.double().abs()[:, None] * x.abs() if with_slope else 0))
        assert ((got.double() - exact).abs() <= magnitude * torch.exp(x.clamp(max=0)) * 8 * u).all()


@needs_native
@pytest.mark.parametrize("width", [1, 7, 9, 15])
def test_fused_fold_pads_the_vector_tail_with_nothing_at_any_magnitude(width):
    """A row of equal logits c gives S₁ = S₂ = width and T = 0 exactly, also where c is so large that c − 1000 rounds
    to c in float32 (|c| ≥ 2³³): the lanes past the row's end must add e⁰ nowhere."""
    for value in (0.0, -7.5, 3e10, -3e10):
        z = torch.full((2, width), value)
        peak, s1, s2, tilt = torch.full((2,), -float("inf")), torch.zeros(2), torch.zeros(2), torch.zeros(2)
        _native.fused_fold(z, peak, s1, s2, tilt, first=True)
        assert torch.equal(peak, torch.full((2,), value))
        assert torch.equal(s1, torch.full((2,), float(width))) and torch.equal(s2, s1), (value, s1)
        assert torch.equal(tilt, torch.zeros(2))


@needs_native
@pytest.mark.bitexact
def test_fused_block_kernels_do_not_depend_on_the_number_of_threads(monkeypatch):
    """Rows are split over threads and each row is computed by one: 1, 2 or 3 threads give bitwise the same sums and
    cotangents, and a NaN in one row makes that row's sums NaN and no other's."""
    monkeypatch.setattr(_native, "ELEMENTS_PER_SHARE", 64)
    z = torch.randn(29, 70, generator=torch.Generator().manual_seed(3)) * 4
    z[11, 5] = float("nan")
    threads = torch.get_num_threads()
    results = []
    try:
        for count in (1, 2, 3):
            torch.set_num_threads(count)
            sums = [torch.full((29,), -float("inf"))] + [torch.zeros(29) for _ in range(3)]
            _native.fused_fold(z[:, :30].contiguous(), *sums, first=True)
            _native.fused_fold(z[:, 30:].contiguous(), *sums, first=False)
            cotangent = z.clone()
            _native.fused_cotangent(cotangent, torch.linspace(-3, 0, 29), torch.linspace(-1, 1, 29),
                                    torch.linspace(2, 0, 29))
            results.append(sums + [cotangent])
    finally:
        torch.set_num_threads(threads)
    for other in results[1:]:
        for got, expected in zip(other, results[0]):
            assert torch.equal(got.nan_to_num(7.0), expected.nan_to_num(7.0))
    for value in results[0][:4]:
        assert torch.isnan(value[11]) and torch.isfinite(torch.cat([value[:11], value[12:]])).all()


@needs_native
def test_the_fused_statistics_run_the_native_block_kernels_in_float32_only(monkeypatch):
    """float32 on CPU: the forward folds every block natively and the backward forms every cotangent natively;
    float64: the eager ops (the kernel is float32 only)."""
    calls = []
    for name in ("fused_fold", "fused_cotangent"):
        original = getattr(_native, name)
        monkeypatch.setattr(_native, name, lambda *a, _f=original, _n=name, **k: calls.append(_n) or _f(*a, **k))
    for dtype, expected in ((torch.float32, ["fused_fold"] * 6 + ["fused_cotangent"] * 6), (torch.float64, [])):
        calls.clear()
        hidden = torch.randn(5, 4, dtype=dtype, requires_grad=True)
        weight = torch.randn(11, 4, dtype=dtype, requires_grad=True)
        stats = otb_torch.fused_linear_token_statistics(hidden, weight, torch.tensor([0, 3, 10, 2, 2]), chunk_size=3,
                                                        vocab_chunk_size=4)
        (stats.log_probs.sum() + stats.entropy.sum()).backward()
        assert calls == expected


@needs_native
def test_shares_split_whole_groups():
    """The thread shares are whole groups covering every group once, for any sizes and thread counts."""
    rng = np.random.default_rng(2)
    for _ in range(50):
        sizes = rng.integers(1, 9, size=rng.integers(1, 40))
        offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        for workers in (1, 2, 3, 7):
            bounds = _native.shares(offsets, workers)
            assert bounds[0] == 0 and bounds[-1] == len(sizes)
            assert all(a < b for a, b in zip(bounds, bounds[1:]))
            assert len(bounds) - 1 <= workers


def _subprocess(code: str, timeout: float = 300, **environment: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, **environment)
    adapters = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "adapters")
    env["PYTHONPATH"] = adapters + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env,
                          timeout=timeout)


_FALLBACK = """
    import json, numpy as np, torch, otb_torch
    status = otb_torch.native_kernel_status()
    print("available", status.available)
    print("reason", status.reason)
    rewards = torch.tensor([[0.0, 1.0], [0.0, 0.0], [1.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 1.0], [1.0, 0.0]])
    log_probs = torch.log(torch.full((3, 2), 0.5))
    advantages, returns = otb_torch.compute_optimal_token_baseline_advantage(
        rewards, mask, np.array(["a", "a", "b"], dtype=object), log_probs, torch.full((3, 2), 0.5))
    print("advantages", json.dumps(advantages.tolist()))
"""


def _advantages(output: str) -> np.ndarray:
    line = next(line for line in output.splitlines() if line.startswith("advantages"))
    return np.array(json.loads(line.split(" ", 1)[1]))


_EXPECTED = otb.optimal_token_baseline(np.array([[0.0, 1.0], [0.0, 0.0], [1.0, 0.0]]),
                                       np.array([[1.0, 1.0], [1.0, 1.0], [1.0, 0.0]]),
                                       np.array(["a", "a", "b"], dtype=object), np.log(np.full((3, 2), 0.5)),
                                       np.full((3, 2), 0.5)).advantages


@pytest.mark.parametrize("environment, reason", [({"OTB_TORCH_NATIVE": "0"}, "disabled by OTB_TORCH_NATIVE=0"),
                                                 ({"CC": "false"}, "build failed")])
def test_without_the_kernel_the_eager_kernel_runs(tmp_path, environment, reason):
    """Disabled, or no working compiler (``CC=false`` into an empty cache): the status says so, nothing is cached,
    and the functions give the reference's results through the eager kernel."""
    result = _subprocess(_FALLBACK, OTB_TORCH_CACHE=str(tmp_path), **environment)
    assert result.returncode == 0, result.stderr
    assert "available False" in result.stdout and reason in result.stdout, result.stdout
    assert not list(tmp_path.glob("*.so"))
    np.testing.assert_allclose(_advantages(result.stdout), _EXPECTED, rtol=1e-6, atol=1e-7)


@needs_native
def test_an_empty_cache_is_built_into(tmp_path):
    """A fresh machine: the kernel is compiled into an empty ``OTB_TORCH_CACHE`` and used."""
    result = _subprocess(_FALLBACK, OTB_TORCH_CACHE=str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert "available True" in result.stdout, result.stdout
    assert len(list(tmp_path.glob("otb_kernel-*.so"))) == 1
    np.testing.assert_allclose(_advantages(result.stdout), _EXPECTED, rtol=1e-6, atol=1e-7)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork on this platform")
def test_a_forked_child_gets_fresh_kernel_threads():
    """After the parent used the kernel's thread pool, a forked child (a data-loader worker, say) starts its own pool
    instead of waiting forever for threads that were not forked. (torch's own OpenMP threads are not fork-safe either:
    the child uses one torch thread, as torch's data-loader workers do.) Bounded in time."""
    code = """
        import os, sys
        from otb_torch import _native
        assert _native._pool(2).submit(lambda: 1).result(timeout=30) == 1       # the parent's pool, threads started
        pid = os.fork()
        if pid == 0:
            import torch
            torch.set_num_threads(1)
            os._exit(0 if _native._pool(2).submit(lambda: 2).result(timeout=20) == 2 else 3)
        _, status = os.waitpid(pid, 0)
        sys.exit(os.waitstatus_to_exitcode(status))
    """
    result = _subprocess(code, timeout=120)
    assert result.returncode == 0, (result.returncode, result.stderr[-2000:])


@pytest.mark.parametrize("kernel", ["native", "eager"])
@pytest.mark.parametrize("segments", ["too many groups", "order not a permutation", "order too short"])
def test_inconsistent_segments_are_an_error_not_a_write_outside_the_batch(monkeypatch, kernel, segments):
    """Hand-built Segments that do not describe the batch raise a ValueError naming the argument, before any kernel
    runs (the native kernel would otherwise index rows that do not exist)."""
    if kernel == "eager":
        monkeypatch.setattr(_native, "usable", lambda *_: False)
    rows, positions = 4, 8
    made = {"too many groups": otb_torch.Segments(torch.tensor([0, 0, 1, 1]), 4, 2),
            "order not a permutation": otb_torch.Segments(torch.tensor([0, 1, 0, 1]), 2, None, torch.tensor(
                [0, 0, 1, 3]), (_core_run(2, 2, 0, -1),)),
            "order too short": otb_torch.Segments(torch.tensor([0, 1, 0, 1]), 2, None, torch.tensor([0, 2, 1]),
                                                  (_core_run(2, 2, 0, -1),))}[segments]
    inputs = (torch.zeros(rows, positions), torch.ones(rows, positions), made, torch.full((rows, positions), -0.5),
              torch.full((rows, positions), 0.5))
    with pytest.raises(ValueError, match="^index: Segments inconsistent with the batch"):
        otb_torch.compute_optimal_token_baseline_advantage(*inputs)


def _core_run(size: int, count: int, start: int, first_row: int):
    from otb_torch._core import Run
    return Run(size, count, start, first_row)


needs_memory_calls = pytest.mark.skipif(_native._memory_calls() is None,
                                        reason="populating needs madvise and mincore (Linux on x86-64 or ARM64)")


def _fresh_mapping(pages: int):
    """A tensor on a fresh private anonymous mapping (what the allocator gives a large tensor: no page mapped yet),
    and the mapping that owns its memory."""
    import mmap

    mapping = mmap.mmap(-1, pages * _native._PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mapping, "madvise") and hasattr(mmap, "MADV_NOHUGEPAGE"):
        mapping.madvise(mmap.MADV_NOHUGEPAGE)         # one fault per base page, whatever the huge-page settings
    return torch.frombuffer(mapping, dtype=torch.float32), mapping


@needs_memory_calls
def test_populating_a_fresh_output_changes_no_value_and_saves_its_page_faults():
    """Populating maps a fresh tensor's pages without changing a value (unwritten pages read 0, a written page keeps
    its values); where the kernel has MADV_POPULATE_WRITE (Linux ≥ 5.14), writing the tensor afterwards takes
    (almost) no page fault, where writing an unpopulated twin takes one per page."""
    import resource

    madvise, _ = _native._memory_calls()
    probe, probe_mapping = _fresh_mapping(1)
    supported = madvise(probe.data_ptr(), _native._PAGE, _native._MADV_POPULATE_WRITE) == 0
    pages, per_page = 256, _native._PAGE // 4
    tensor, mapping = _fresh_mapping(pages)
    twin, twin_mapping = _fresh_mapping(pages)
    tensor[5 * per_page:6 * per_page] = torch.arange(per_page, dtype=torch.float32)   # page 5 mapped, with values
    _native.populate([tensor, None])
    expected = torch.zeros(pages * per_page)
    expected[5 * per_page:6 * per_page] = torch.arange(per_page, dtype=torch.float32)
    assert torch.equal(tensor, expected)

    def faults_writing(values: torch.Tensor) -> int:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        values.fill_(1.0)
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

    if supported:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)                      # no thread starting up inside the counted window
        try:
            faults_writing(torch.empty(per_page))     # warm-up of the fill itself
            assert faults_writing(tensor) < pages // 8 < faults_writing(twin)
        finally:
            torch.set_num_threads(threads)
    del tensor, twin, probe
    mapping.close(), twin_mapping.close(), probe_mapping.close()


@needs_memory_calls
@pytest.mark.parametrize("offset", [0, 3, 1021])
def test_populating_in_shares_maps_every_whole_page_once_and_skips_mapped_memory(monkeypatch, offset):
    """The shares' ranges are page-aligned, inside the tensor, disjoint, and together every whole page of it; a tensor
    without a whole page gets no call; a share whose first page is mapped (reused memory) is not walked."""
    _, mincore = _native._memory_calls()
    calls = []
    monkeypatch.setitem(_native._STATE, "memory calls",
                        (lambda start, length, advice: calls.append((start, length, advice)) or 0, mincore))
    base, mapping = _fresh_mapping(64)
    per_page = _native._PAGE // 4
    tensor = base[offset:offset + 60 * per_page - 5]
    for shares in (1, 2, 3, 7):
        calls.clear()
        for share in range(shares):
            _native.populate([tensor], share, shares)
        page = _native._PAGE
        first = -(-tensor.data_ptr() // page) * page
        last = (tensor.data_ptr() + tensor.numel() * 4) // page * page
        ranges = sorted((start, start + length) for start, length, advice in calls)
        assert all(advice == _native._MADV_POPULATE_WRITE for _, _, advice in calls)
        assert all(start % page == 0 and stop % page == 0 for start, stop in ranges)
        assert ranges[0][0] == first and ranges[-1][1] == last
        assert all(stop == start for (_, stop), (start, _) in zip(ranges, ranges[1:]))
    calls.clear()
    _native.populate([base[:0], base[offset:offset + 10]], 0, 1)      # no whole page: nothing to map
    assert calls == []
    page = _native._PAGE
    second = (-(-tensor.data_ptr() // page) + (tensor.data_ptr() + tensor.numel() * 4) // page) // 2 * page
    tensor[(second - tensor.data_ptr()) // 4] = 1.0       # the first page of share 1 of 2 is mapped now
    _native.populate([tensor], 0, 2)
    _native.populate([tensor], 1, 2)
    assert [start for start, _, _ in calls] == [-(-tensor.data_ptr() // page) * page]     # share 0 only
    calls.clear()
    tensor.fill_(1.0)                                     # every page mapped now: nothing to populate
    _native.populate([tensor], 0, 1)
    assert calls == []
    del tensor, base
    mapping.close()
