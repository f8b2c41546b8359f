"""otb_torch specifics: verl drop-in compatibility, errors, dtypes and devices, no autograd, no mutation, no host
synchronisation on the hot path, torch.compile, and (with a GPU) CUDA and CUDA graphs."""

from __future__ import annotations

import contextlib
import functools
import inspect

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
otb_torch = pytest.importorskip("otb_torch")

import otb_spec as otb  # noqa: E402
from otb_spec.examples import example_batch  # noqa: E402
from otb_spec.tolerances import otb_comparison_tolerance  # noqa: E402

from accelerators import requires_cuda  # noqa: E402


def _verl_batch(dtype=torch.float32, device="cpu"):
    batch = example_batch()
    tensors = {name: torch.as_tensor(np.asarray(getattr(batch, name)), dtype=dtype, device=device)
               for name in ("rewards", "response_mask", "log_probs", "sum_pi_squared")}
    return batch, tensors


def _call(function, tensors, index, **options):
    return function(tensors["rewards"], tensors["response_mask"], index, tensors["log_probs"],
                    tensors["sum_pi_squared"], **options)


# ----------------------------------------------------------------------------------------------------------------------
# verl compatibility


@pytest.mark.parametrize("name", ["compute_optimal_token_baseline_advantage",
                                  "compute_multi_turn_optimal_token_baseline_advantage"])
def test_drop_in_signature_matches_verl(name):
    parameters = inspect.signature(getattr(otb_torch, name)).parameters
    expected = [("token_level_rewards", inspect.Parameter.empty), ("response_mask", inspect.Parameter.empty),
                ("index", inspect.Parameter.empty), ("old_log_probs", inspect.Parameter.empty),
                ("sum_pi_squared", inspect.Parameter.empty), ("rollout_is_weights", None),
                ("handle_zero_tail", True), ("epsilon", 1e-8)]
    assert [(p.name, p.default) for p in parameters.values()][:8] == expected
    assert list(parameters.values())[8].kind is inspect.Parameter.VAR_KEYWORD
    assert inspect.signature(otb_torch.calculate_sum_pi_squared_from_logits).parameters["logits"]


@pytest.mark.parametrize("name, reference", [
    ("compute_optimal_token_baseline_advantage", otb.optimal_token_baseline),
    ("compute_multi_turn_optimal_token_baseline_advantage", otb.multi_turn_optimal_token_baseline)])
def test_drop_ins_return_verl_pair_and_ignore_extra_keywords(name, reference):
    batch, tensors = _verl_batch(torch.float64)
    advantages, returns = _call(getattr(otb_torch, name), tensors, np.asarray(batch.group_ids), config={"any": 1})
    expected = reference(batch.rewards, batch.response_mask, batch.group_ids, batch.log_probs, batch.sum_pi_squared)
    np.testing.assert_allclose(advantages.numpy(), expected.advantages, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(returns.numpy(), expected.returns, rtol=1e-12, atol=1e-12)


def test_sum_pi_squared_drop_in():
    logits = torch.randn(3, 5, 17, dtype=torch.float64)
    np.testing.assert_allclose(otb_torch.calculate_sum_pi_squared_from_logits(logits).numpy(),
                               otb.sum_pi_squared(logits.numpy()), rtol=1e-13)


# ----------------------------------------------------------------------------------------------------------------------
# errors


def test_errors_name_verl_arguments():
    batch, tensors = _verl_batch()
    index = np.asarray(batch.group_ids)
    bad_mask = tensors["response_mask"].clone()
    bad_mask[0, 0] = 2.0
    with pytest.raises(ValueError, match=r"response_mask: values must be exactly 0 or 1"):
        otb_torch.compute_optimal_token_baseline_advantage(tensors["rewards"], bad_mask, index, tensors["log_probs"],
                                                           tensors["sum_pi_squared"])
    nan_rewards = tensors["rewards"].clone()
    nan_rewards[1, 2] = float("nan")
    with pytest.raises(ValueError, match=r"token_level_rewards: contains NaN or ±inf \(first at index \(1, 2\)"):
        otb_torch.compute_optimal_token_baseline_advantage(nan_rewards, tensors["response_mask"], index,
                                                           tensors["log_probs"], tensors["sum_pi_squared"])
    with pytest.raises(ValueError, match=r"old_log_probs: must be ≤ 0 at valid positions"):
        otb_torch.compute_optimal_token_baseline_advantage(tensors["rewards"], tensors["response_mask"], index,
                                                           torch.exp(tensors["log_probs"]), tensors["sum_pi_squared"])
    with pytest.raises(ValueError, match=r"rollout_is_weights: must be ≥ 0"):
        otb_torch.compute_optimal_token_baseline_advantage(tensors["rewards"], tensors["response_mask"], index,
                                                           tensors["log_probs"], tensors["sum_pi_squared"],
                                                           rollout_is_weights=-torch.ones_like(tensors["rewards"]))
    with pytest.raises(ValueError, match=r"old_log_probs: expected shape \(6, 8\) \(the shape of token_level_rewards\)"):
        otb_torch.compute_optimal_token_baseline_advantage(tensors["rewards"], tensors["response_mask"], index,
                                                           tensors["log_probs"][:, :4], tensors["sum_pi_squared"])
    with pytest.raises(ValueError, match=r"index: expected 6 ids \(one per trajectory\), got 5"):
        otb_torch.compute_optimal_token_baseline_advantage(tensors["rewards"], tensors["response_mask"], index[:5],
                                                           tensors["log_probs"], tensors["sum_pi_squared"])
    with pytest.raises(TypeError, match="token_level_rewards: expected real numbers"):
        otb_torch.compute_optimal_token_baseline_advantage(tensors["rewards"].to(torch.complex64),
                                                           tensors["response_mask"], index, tensors["log_probs"],
                                                           tensors["sum_pi_squared"])
    with pytest.raises(ValueError, match="epsilon: must be ≥ 0"):
        otb_torch.compute_optimal_token_baseline_advantage(tensors["rewards"], tensors["response_mask"], index,
                                                           tensors["log_probs"], tensors["sum_pi_squared"],
                                                           epsilon=-1.0)


@pytest.mark.parametrize("ids, message", [
    (torch.zeros(6, 1, dtype=torch.long), r"expected a 1-D array of B ids, got shape \(6, 1\)"),
    (np.array([0.0, np.nan, 1.0, 1.0, 2.0, 2.0]), "contains NaN"),
    (np.array(["a", "b"] * 2 + ["c"]), r"expected 6 ids \(one per trajectory\), got 5"),
])
@pytest.mark.parametrize("function", ["optimal_token_baseline", "leave_one_out_token_baseline"])
def test_errors_name_group_ids_where_the_function_calls_it_so(ids, message, function):
    """otb_torch's own functions take ``group_ids`` (verl's drop-ins ``index``): a bad one is named so, whatever the
    kind of id (a tensor, floats, strings — each takes its own path to the groups)."""
    _, tensors = _verl_batch()
    with pytest.raises(ValueError, match="^group_ids: " + message):
        getattr(otb_torch, function)(tensors["rewards"], tensors["response_mask"], ids, tensors["log_probs"],
                                     tensors["sum_pi_squared"])


@pytest.mark.parametrize("kernel", ["native", "eager"])
@pytest.mark.parametrize("function", ["optimal_token_baseline", "multi_turn_optimal_token_baseline",
                                      "leave_one_out_token_baseline"])
def test_finite_rewards_whose_float32_sums_overflow_raise_naming_the_rewards(kernel, function):
    """Rewards of 10³⁷ over 64 positions: each return fits float32, the group sums Σᵢ GₜⁱWₜⁱ do not (W up to ~57).
    The call raises, naming the rewards — not ±inf/NaN advantages (as before: 196 of 256 elements inf, or NaN for
    leave-one-out); 10³⁵ still computes, finite, and equals the float64 reference."""
    from otb_torch import _native

    rows, positions = 4, 64
    mask, group_ids = torch.ones(rows, positions), torch.zeros(rows, dtype=torch.long)
    log_probs, sum_pi_squared = torch.full((rows, positions), -2.5), torch.full((rows, positions), 0.05)
    for scale in (1e35, 1e37):
        context = _native.eager_only() if kernel == "eager" else contextlib.nullcontext()
        rewards = torch.zeros(rows, positions)
        rewards[:, -1] = torch.tensor([1.0, 0.0, 0.5, 1.0]) * scale
        call = lambda: getattr(otb_torch, function)(rewards, mask, group_ids, log_probs,  # noqa: E731
                                                    sum_pi_squared)
        with context:
            if scale > 1e36:
                with pytest.raises(ValueError, match=r"^rewards: finite, but OTB's arithmetic overflows float32"):
                    call()
                continue
            result = call()
        arrays = [value.numpy() for value in (rewards, mask, group_ids, log_probs, sum_pi_squared)]
        expected = getattr(otb, function)(*arrays)
        leave_one_out = function.startswith("leave")
        advantage_tolerance, _ = otb_comparison_tolerance(
            *arrays, align="valid_token" if function.startswith("multi") else "position", leave_one_out=leave_one_out,
            handle_zero_tail=not leave_one_out, compute_dtype=np.float32)
        assert torch.isfinite(result.advantages).all()
        advantage_tolerance.assert_close(result.advantages.numpy(), expected.advantages, f"{function} at {scale:g}")


@pytest.mark.parametrize("kernel", ["native", "eager"])
def test_leave_one_out_raises_where_only_the_others_sum_overflows(kernel):
    """Returns of mixed signs [−2, 2, 2]·10³⁷: the group's sums N and D fit float32, N − G₀W₀ does not — the
    native kernel checks a leave-one-out row's advantages while the row is in cache (it returned −inf before)."""
    from otb_torch import _native

    rewards = torch.zeros(3, 16)
    rewards[:, -1] = torch.tensor([-2e37, 2e37, 2e37])
    context = _native.eager_only() if kernel == "eager" else contextlib.nullcontext()
    with context, pytest.raises(ValueError, match=r"^rewards: finite, but OTB's arithmetic overflows float32"):
        otb_torch.leave_one_out_token_baseline(rewards, torch.ones(3, 16), torch.zeros(3, dtype=torch.long),
                                               torch.full((3, 16), -2.5), torch.full((3, 16), 0.05))


@pytest.mark.parametrize("kernel", ["native", "eager"])
@pytest.mark.parametrize("function", ["optimal_token_baseline", "leave_one_out_token_baseline"])
def test_importance_weights_whose_squares_overflow_are_named(kernel, function):
    """ρ = 10²⁰ at one valid token in float32: ρ² = 10⁴⁰ leaves float32 and so does the realized energy — the error
    names is_weights (it named the rewards, which are 0 and 1); ρ = 10¹⁵ (2·T·ρ² within range) still computes."""
    from otb_torch import _native

    rewards = torch.zeros(4, 16)
    rewards[:, -1] = torch.tensor([1.0, 0.0, 1.0, 0.0])
    arguments = (rewards, torch.ones(4, 16), torch.zeros(4, dtype=torch.long), torch.full((4, 16), -2.5),
                 torch.full((4, 16), 0.05))
    for rho in (1e15, 1e20):
        weights = torch.ones(4, 16)
        weights[1, 3] = rho
        with _native.eager_only() if kernel == "eager" else contextlib.nullcontext():
            if rho < 1e16:
                assert torch.isfinite(getattr(otb_torch, function)(*arguments, is_weights=weights).advantages).all()
                continue
            with pytest.raises(ValueError, match=r"^is_weights: finite, but the realized energy .* float32's range "
                                                 r"\(ρ up to 1e\+20\)"):
                getattr(otb_torch, function)(*arguments, is_weights=weights)


@pytest.mark.parametrize("kernel", ["native", "eager"])
@pytest.mark.parametrize("function", ["optimal_token_baseline", "multi_turn_optimal_token_baseline",
                                      "leave_one_out_token_baseline"])
def test_float16_rewards_whose_results_leave_float16_raise_naming_them(kernel, function):
    """float16 rewards of 3·10⁴ at the last two positions: each fits float16 (±65504), the returns-to-go of 6·10⁴ +
    3·10⁴ do not — computed in float32, they became inf in the float16 outputs, silently (either kernel). The call
    raises, naming the rewards and the dtype; 2·10⁴ (returns up to 4·10⁴) computes, finite, as the reference."""
    from otb_torch import _native

    rows, positions = 4, 8
    arguments = (torch.ones(rows, positions), torch.zeros(rows, dtype=torch.long), torch.full((rows, positions), -1.0),
                 torch.full((rows, positions), 0.3))
    for scale in (2e4, 3e4):
        rewards = torch.zeros(rows, positions, dtype=torch.float16)
        rewards[:, -1] = torch.tensor([2.0, 2.0, 0.0, 1.0]) * scale
        rewards[:, -2] = scale
        with _native.eager_only() if kernel == "eager" else contextlib.nullcontext():
            if scale > 2.5e4:
                with pytest.raises(ValueError, match=r"^rewards: finite, but OTB's results leave float16's range "
                                                     r"\(±65504\)"):
                    getattr(otb_torch, function)(rewards, *arguments)
                continue
            result = getattr(otb_torch, function)(rewards, *arguments)
        assert result.returns.dtype == torch.float16 and all(torch.isfinite(value).all() for value in result[:2])
        expected = getattr(otb, function)(rewards.float().numpy(), *(value.numpy() for value in arguments))
        np.testing.assert_allclose(result.returns.float().numpy(), expected.returns, rtol=2**-10)


def test_returns_and_energy_helpers_raise_where_their_results_overflow():
    """otb_torch.returns_to_go and realized_energy_of returned ±inf silently: float16 rewards whose returns-to-go
    (9·10⁴) leave float16, float32 rewards of 2·10³⁸ whose sums leave float32, ρ = 10²⁰ (ρ² beyond float32), and
    float16 log_probs over 2¹⁷ positions (W up to ≈ 7.4·10⁴). Each now names its argument; check_values=False keeps
    the unchecked result."""
    mask = torch.ones(2, 4)
    half = torch.zeros(2, 4, dtype=torch.float16)
    half[:, -2:] = torch.tensor([3e4, 6e4], dtype=torch.float16)
    with pytest.raises(ValueError, match=r"^rewards: finite, but OTB's results leave float16's range"):
        otb_torch.returns_to_go(half, mask)
    assert torch.isinf(otb_torch.returns_to_go(half, mask, check_values=False)).any()
    with pytest.raises(ValueError, match=r"^rewards: finite, but their returns-to-go .* overflow float32"):
        otb_torch.returns_to_go(torch.full((2, 4), 2e38), mask)
    # finite returns up to 4·10³⁶ whose float32 sum over the batch (10³⁹) is not: no error
    assert torch.isfinite(otb_torch.returns_to_go(torch.full((100, 4), 1e36), torch.ones(100, 4))).all()
    statistics = (torch.full((2, 4), -1.0), torch.full((2, 4), 0.3), mask)
    with pytest.raises(ValueError, match=r"^is_weights: finite, but the realized energy .* float32's range"):
        otb_torch.realized_energy_of(*statistics, is_weights=torch.full((2, 4), 1e20))
    long = (torch.full((1, 2**17), -1.0, dtype=torch.float16), torch.full((1, 2**17), 0.3, dtype=torch.float16),
            torch.ones(1, 2**17))                                           # w ≈ 0.56: W reaches ≈ 7.4·10⁴
    with pytest.raises(ValueError, match=r"^log_probs: finite, but OTB's results leave float16's range .* pass "
                                         r"log_probs in float32$"):
        otb_torch.realized_energy_of(*long)
    assert torch.isfinite(otb_torch.realized_energy_of(*(value[:, :2**16] for value in long))).all()


def test_device_mismatch_is_reported():
    batch, tensors = _verl_batch()
    with pytest.raises(ValueError, match=r"old_log_probs: on meta but token_level_rewards is on cpu"):
        otb_torch.compute_optimal_token_baseline_advantage(
            tensors["rewards"], tensors["response_mask"], np.asarray(batch.group_ids),
            torch.empty_like(tensors["log_probs"], device="meta"), tensors["sum_pi_squared"])


def _reference_rejects(**named_arrays) -> bool:
    from otb_spec import _validation as reference_checks
    mask = named_arrays.get("mask")
    try:
        if mask is not None:
            reference_checks.mask_array("mask", mask, mask.shape, like="mask")
        if "log_probs" in named_arrays:
            reference_checks.token_statistics(named_arrays["log_probs"], named_arrays["sum_pi_squared"], mask,
                                              mask.shape, like="mask")
    except ValueError:
        return True
    return False


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64], ids=str)
def test_device_mask_flag_agrees_with_the_reference(dtype):
    """The device-side binary-mask rule (m − m·m = 0) flags exactly what the reference rejects, per value."""
    from otb_torch import _checks
    info = torch.finfo(dtype)
    candidates = [0.0, 1.0, -0.0, 0.5, 2.0, -1.0, 1.0 - info.eps / 2, 1.0 + info.eps, info.tiny, info.tiny * info.eps,
                  info.max, -info.max, float("nan"), float("inf"), -float("inf")]
    for value in candidates:
        mask = torch.tensor([[1.0, value, 0.0]], dtype=dtype)
        host = mask.float().numpy() if dtype == torch.bfloat16 else mask.numpy()
        assert bool(_checks.problems(mask=mask)) == _reference_rejects(mask=host), (dtype, value)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_device_token_statistic_flags_agree_with_the_reference(dtype):
    """Every (log π, Σπ², m) combination from values clearly inside or outside the reference's ranges is flagged on the
    device exactly when the reference rejects it (masked positions may hold anything finite)."""
    from otb_torch import _checks
    log_probs = [0.0, -0.7, -5.0, 0.05, 1.0]
    sums = [-0.5, 0.0, 0.2, 0.6, 1.0, 1.5]
    for lp in log_probs:
        for spp in sums:
            for valid in (0.0, 1.0):
                arrays = {name: np.array([[value, -0.1]], dtype=np.float64 if dtype == torch.float64 else np.float32)
                          for name, value in (("log_probs", lp), ("sum_pi_squared", spp), ("mask", valid))}
                arrays["sum_pi_squared"][0, 1] = 0.9
                arrays["mask"][0, 1] = 1.0
                tensors = {name: torch.from_numpy(array) for name, array in arrays.items()}
                assert bool(_checks.problems(**tensors)) == _reference_rejects(**arrays), (lp, spp, valid)


def test_bad_logits_are_rejected():
    with pytest.raises(ValueError, match="logits: contains NaN"):
        otb_torch.sum_pi_squared(torch.tensor([[0.0, float("nan")]]))
    with pytest.raises(ValueError, match=r"logits: every logit is -inf at position \(1,\)"):
        otb_torch.sum_pi_squared(torch.tensor([[0.0, 1.0], [-float("inf"), -float("inf")]]))
    with pytest.raises(ValueError, match=r"token_ids: must lie in \[0, 2\)"):
        otb_torch.token_statistics_from_logits(torch.zeros(2, 2), torch.tensor([0, 2]))
    with pytest.raises(ValueError, match="chunk_size: expected a positive integer"):
        otb_torch.sum_pi_squared(torch.zeros(2, 2), chunk_size=0)


# ----------------------------------------------------------------------------------------------------------------------
# dtypes, devices, autograd, mutation


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_outputs_take_the_rewards_dtype_and_device(dtype):
    batch, tensors = _verl_batch(dtype)
    advantages, returns = _call(otb_torch.compute_optimal_token_baseline_advantage, tensors,
                                np.asarray(batch.group_ids))
    assert advantages.dtype == dtype and returns.dtype == dtype
    assert advantages.device == tensors["rewards"].device
    assert otb_torch.sum_pi_squared(torch.as_tensor(batch.logits, dtype=dtype)).dtype == dtype


def test_no_autograd_graph_and_inputs_untouched():
    batch, tensors = _verl_batch()
    leaves = {name: value.clone().requires_grad_(True) for name, value in tensors.items()
              if name != "response_mask"}
    before = {name: value.detach().clone() for name, value in leaves.items()}
    advantages, returns = otb_torch.compute_optimal_token_baseline_advantage(
        leaves["rewards"], tensors["response_mask"], np.asarray(batch.group_ids), leaves["log_probs"],
        leaves["sum_pi_squared"])
    assert not advantages.requires_grad and advantages.grad_fn is None and returns.grad_fn is None
    for name, value in leaves.items():
        assert torch.equal(value.detach(), before[name]), name
    logits = torch.as_tensor(batch.logits, dtype=torch.float32).requires_grad_(True)
    assert otb_torch.sum_pi_squared(logits).grad_fn is None


# ----------------------------------------------------------------------------------------------------------------------
# no host synchronisation on the hot path


_SYNCING = ("__bool__", "item", "tolist", "numpy", "nonzero", "cpu", "__int__", "__float__")


@contextlib.contextmanager
def no_host_synchronisation():
    """Make every Tensor method that copies data to the host raise while the block runs."""
    patch = pytest.MonkeyPatch()

    def forbidden(name):
        def method(self, *args, **kwargs):
            raise AssertionError(f"host synchronisation: Tensor.{name} called on the hot path")
        return method

    try:
        for name in _SYNCING:
            patch.setattr(torch.Tensor, name, forbidden(name))
        yield
    finally:
        patch.undo()


@pytest.mark.parametrize("function", ["optimal_token_baseline", "multi_turn_optimal_token_baseline",
                                      "leave_one_out_token_baseline"])
def test_hot_path_never_synchronises(function):
    """With precomputed segments and check_values=False nothing is copied to the host (CPU stand-in for CUDA's
    sync-debug mode, which test_cuda_matches_cpu_and_never_synchronises uses on a GPU)."""
    batch, tensors = _verl_batch()
    segments = otb_torch.segments_from_index(np.asarray(batch.group_ids))        # the one host step, done once
    weights = torch.ones_like(tensors["rewards"])
    with no_host_synchronisation():
        result = getattr(otb_torch, function)(tensors["rewards"], tensors["response_mask"], segments,
                                              tensors["log_probs"], tensors["sum_pi_squared"], is_weights=weights,
                                              check_values=False)
        otb_torch.sum_pi_squared(torch.as_tensor(batch.logits), check_values=False)
        otb_torch.token_statistics_from_logits(torch.as_tensor(batch.logits), torch.as_tensor(batch.token_ids),
                                               check_values=False)
    reference = getattr(otb, function)(batch.rewards, batch.response_mask, batch.group_ids, batch.log_probs,
                                       batch.sum_pi_squared, is_weights=np.ones_like(batch.rewards))
    np.testing.assert_allclose(result.advantages.numpy(), reference.advantages, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("function", ["optimal_token_baseline", "multi_turn_optimal_token_baseline",
                                      "leave_one_out_token_baseline", "compute_optimal_token_baseline_advantage"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
@pytest.mark.parametrize("with_weights", [False, True], ids=["no-weights", "weights"])
@pytest.mark.bitexact
def test_row_blocks_give_the_one_block_result(monkeypatch, function, dtype, with_weights):
    """On CPU, contiguous equal-size groups are processed in row blocks of whole groups (results written straight
    into the outputs, or copied when the output dtype differs from the compute dtype). With blocks forced small —
    2 groups per block, 5 groups, so the last block is shorter — every output is bitwise the one-block result."""
    rng = np.random.default_rng(11)
    groups, size, positions = 5, 3, 9
    rows = groups * size
    lengths = rng.integers(0, positions + 1, size=rows)
    mask = (np.arange(positions)[None, :] < lengths[:, None]).astype(np.float64)
    mask[rng.random((rows, positions)) < 0.2] = 0.0                                   # holes
    pi = rng.uniform(0.05, 1.0, size=(rows, positions))
    tensor = lambda array: torch.as_tensor(array).to(dtype)  # noqa: E731
    inputs = (tensor(rng.normal(size=(rows, positions))), tensor(mask), np.repeat(np.arange(groups), size),
              tensor(np.log(pi)), tensor(pi**2 + (1 - pi) ** 2 * rng.uniform(0, 1, size=(rows, positions))))
    options = {"check_values": False}
    if with_weights:
        weights = tensor(rng.uniform(0.5, 2.0, size=(rows, positions)))
        options["rollout_is_weights" if function.startswith("compute") else "is_weights"] = weights
    call = getattr(otb_torch, function)
    monkeypatch.setattr(otb_torch._native, "usable", lambda *_: False)       # the eager kernel's blocks
    one_block = call(*inputs, **options)
    monkeypatch.setattr(otb_torch._otb, "_BLOCK_ELEMENTS", 2 * size * positions)
    assert len(otb_torch._otb._blocks(otb_torch.segments_from_index(inputs[2]), rows, positions,
                                      torch.device("cpu"))) == 3
    blocked = call(*inputs, **options)
    for got, expected in zip(blocked, one_block):
        assert got.dtype == expected.dtype == dtype
        assert torch.equal(got, expected)


_FUNCTIONS = ["optimal_token_baseline", "multi_turn_optimal_token_baseline", "leave_one_out_token_baseline",
              "compute_optimal_token_baseline_advantage", "compute_multi_turn_optimal_token_baseline_advantage"]


def _realistic_inputs(function: str, layout: str, dtype: torch.dtype):
    """(positional inputs, keyword options) of a verl-like batch (tests/test_adapters.py) for ``function``."""
    from test_adapters import realistic_batch, unequal_sizes
    sizes = [3] * 7 if layout == "grouped-equal" else unequal_sizes(11, 12)
    batch = realistic_batch(11, sizes, 12, scattered=layout != "grouped-equal", holes="multi_turn" in function,
                            empty_rows=0 if layout == "grouped-equal" else 4, is_weights=True)
    tensor = lambda array: torch.as_tensor(array).to(dtype)  # noqa: E731
    inputs = (tensor(batch.rewards), tensor(batch.response_mask), batch.group_ids, tensor(batch.log_probs),
              tensor(batch.sum_pi_squared))
    weights = "rollout_is_weights" if function.startswith("compute") else "is_weights"
    return inputs, {weights: tensor(batch.is_weights)}


@pytest.mark.parametrize("function", _FUNCTIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
@pytest.mark.parametrize("layout", ["grouped-equal", "scattered-unequal"])
@pytest.mark.bitexact
def test_blocks_of_any_layout_give_the_one_block_result(monkeypatch, function, dtype, layout):
    """On CPU the plan's runs are cut into blocks of whole groups (slices of the batch, or gathered rows written back
    with index_copy_). With blocks forced to 1–2 groups — so runs span several blocks, the last one shorter, and
    singleton groups fill blocks of their own — every output is bitwise the result with the default blocks, which
    tests/test_adapters.py compares with the reference. Value checks on and off, with and without the zero tail."""
    inputs, options = _realistic_inputs(function, layout, dtype)
    monkeypatch.setattr(otb_torch._native, "usable", lambda *_: False)       # the eager kernel's blocks
    segments = otb_torch.segments_from_index(inputs[2])
    assert len(otb_torch._otb._blocks(segments, inputs[0].shape[0], 12, torch.device("cpu"))) == len(segments.runs)
    call = getattr(otb_torch, function)
    for extra in ({"check_values": False}, {"check_values": True, **(
            {} if function.startswith("leave") else {"handle_zero_tail": False})}):
        default = call(*inputs, **options, **extra)
        with monkeypatch.context() as patch:
            patch.setattr(otb_torch._otb, "_BLOCK_ELEMENTS", 2 * 3 * 12)
            blocks = otb_torch._otb._blocks(segments, inputs[0].shape[0], 12, torch.device("cpu"))
            assert len(blocks) > len(segments.runs) + 2
            assert any(isinstance(block.rows, slice) for block in blocks) == (layout == "grouped-equal")
            blocked = call(*inputs, **options, **extra)
        for got, expected in zip(blocked, default):
            assert got.dtype == expected.dtype == dtype
            assert torch.equal(got, expected), (function, extra)


def test_segments_plan_any_layout():
    """The plan lists rows group by group (groups by size, then first appearance; members in batch order) and marks
    the runs whose rows are a contiguous slice of the batch."""
    ids = np.array(["b", "a", "c", "b", "a", "b", "d", "d"], dtype=object)
    segments = otb_torch.segments_from_index(ids)
    assert segments.num_groups == 4 and segments.group_size is None
    assert segments.index.tolist() == [0, 1, 2, 0, 1, 0, 3, 3]
    assert segments.order.tolist() == [2, 1, 4, 6, 7, 0, 3, 5]         # c | a a d d | b b b
    assert [tuple(run) for run in segments.runs] == [(1, 1, 0, 2), (2, 2, 1, -1), (3, 1, 5, -1)]
    grouped = otb_torch.segments_from_index(np.repeat(["x", "y", "z"], [2, 2, 3]))
    assert [tuple(run) for run in grouped.runs] == [(2, 2, 0, 0), (3, 1, 4, 4)]
    equal = otb_torch.segments_from_index(np.repeat([5, 3, 9], 4))
    assert equal.group_size == 4 and [tuple(run) for run in equal.runs] == [(4, 3, 0, 0)]


@pytest.mark.parametrize("function", _FUNCTIONS[:3])
def test_segments_without_a_plan_use_segment_sums(function):
    """Segments built by hand (no plan, no group size) take the general path, with the same results."""
    inputs, options = _realistic_inputs(function, "scattered-unequal", torch.float64)
    planned = otb_torch.segments_from_index(inputs[2])
    by_hand = otb_torch.Segments(planned.index, planned.num_groups)
    call = getattr(otb_torch, function)
    for got, expected in zip(call(*inputs[:2], by_hand, *inputs[3:], **options),
                             call(*inputs[:2], planned, *inputs[3:], **options)):
        np.testing.assert_allclose(got.numpy(), expected.numpy(), rtol=1e-12, atol=1e-12)


def _top_level_ops(call) -> int:
    """How many top-level aten ops one call issues (each at least one kernel launch on a GPU)."""
    from torch.profiler import ProfilerActivity, profile

    call()
    with profile(activities=[ProfilerActivity.CPU]) as trace:
        call()
    return sum(1 for event in trace.events() if event.name.startswith("aten::") and event.cpu_parent is None)


@pytest.mark.parametrize("function", _FUNCTIONS[:3])
def test_accelerator_blocks_launch_as_many_kernels_whatever_the_group_sizes(monkeypatch, function):
    """On an accelerator a plan with groups of several sizes runs as one block in the plan's order, its group sums
    over consecutive rows: a call issues the same number of ops for 2 distinct group sizes as for 8 (the eager
    kernels on the CPU, blocked as on an accelerator). One block per size — the blocking before, kept here as the
    control that shows the count can fail to stay flat — issues more ops with every size."""
    from test_adapters import realistic_batch

    monkeypatch.setattr(otb_torch._native, "usable", lambda *_: False)
    call = getattr(otb_torch, function)
    counts = {}
    for distinct in (2, 8):
        sizes = [1 + group % distinct for group in range(16)]
        batch = realistic_batch(5, sizes, 10, holes="multi_turn" in function)
        tensors = [torch.as_tensor(np.asarray(getattr(batch, name)), dtype=torch.float32)
                   for name in ("rewards", "response_mask", "log_probs", "sum_pi_squared")]
        segments = otb_torch.segments_from_index(batch.group_ids)
        assert len(segments.runs) == distinct

        def once():
            return call(tensors[0], tensors[1], segments, tensors[2], tensors[3], check_values=False)

        with otb_torch._otb.blocks_as_on_accelerators():
            counts["one block", distinct] = _top_level_ops(once)
        with monkeypatch.context() as patch:                  # one block per run of equal sizes, none cut smaller
            patch.setattr(otb_torch._otb, "_BLOCK_ELEMENTS", 2**62)
            counts["one block per size", distinct] = _top_level_ops(once)
    assert counts["one block", 2] == counts["one block", 8], counts
    assert counts["one block per size", 8] > counts["one block per size", 2] + 5 * 6, counts


@pytest.mark.parametrize("function", _FUNCTIONS)
@pytest.mark.parametrize("plan", ["planned", "by hand, no sizes", "by hand, wrong sizes",
                                  "rows already in the plan's order", "cut into blocks",
                                  "cut into blocks, rows in the plan's order"])
def test_accelerator_blocks_give_the_eager_result(monkeypatch, function, plan):
    """The block of consecutive-row group sums (float64) gives the cache-blocked eager kernel's results within
    rounding — for the plan segments_from_index makes (its group sizes on the device), a plan built by hand (sizes
    made from its runs; wrong sizes given with it ignored), a batch whose rows are already in the plan's order (a
    slice: nothing gathered), and with the block's size bounded so that the plan is cut at group boundaries into
    blocks of ≤ 20 rows (a group of more rows alone in its block). The group sums are the consecutive-row ones."""
    inputs, options = _realistic_inputs(function, "scattered-unequal", torch.float64)
    monkeypatch.setattr(otb_torch._native, "usable", lambda *_: False)
    call = getattr(otb_torch, function)
    segments = otb_torch.segments_from_index(inputs[2])
    if plan.endswith("rows in the plan's order") or plan == "rows already in the plan's order":
        order = segments.order
        inputs = tuple(value[order] if isinstance(value, torch.Tensor) else np.asarray(value)[order.numpy()]
                       for value in inputs)
        options = {name: value[order] for name, value in options.items()}
        segments = otb_torch.segments_from_index(inputs[2])
        assert all(run.first_row == run.start for run in segments.runs) and len(segments.runs) > 1
    expected = call(*inputs[:2], segments, *inputs[3:], **options)
    if plan.startswith("by hand"):
        wrong = segments.sizes.flip(0) if plan.endswith("wrong sizes") else None
        segments = otb_torch.Segments(segments.index, segments.num_groups, None, segments.order, segments.runs,
                                      sizes=wrong)
    reductions = []
    consecutive_reduce = otb_torch._core.consecutive_reduce
    monkeypatch.setattr(otb_torch._core, "consecutive_reduce",
                        lambda *args: reductions.append(args[2]) or consecutive_reduce(*args))
    rows, positions = inputs[0].shape
    if plan.startswith("cut"):
        monkeypatch.setattr(otb_torch._otb, "_ACCELERATOR_BLOCK_ELEMENTS", 20 * positions)
    with otb_torch._otb.blocks_as_on_accelerators():
        blocks = otb_torch._otb._blocks(segments, rows, positions, torch.device("cpu"))
        assert all(block.sizes is not None for block in blocks)
        assert (len(blocks) > 2) if plan.startswith("cut") else (len(blocks) == 1)
        assert [block.begin for block in blocks] == [0] + [block.end for block in blocks[:-1]]
        assert blocks[-1].end == rows
        assert all(int(block.sizes.sum()) == block.end - block.begin for block in blocks)
        assert not plan.startswith("cut") or all(block.end - block.begin <= 20 or len(block.sizes) == 1
                                                  for block in blocks)
        assert all(isinstance(block.rows, slice) == plan.endswith("plan's order") for block in blocks)
        got = call(*inputs[:2], segments, *inputs[3:], **options)
    assert reductions.count("sum") >= 2 * len(blocks)                      # N and D of every block, at least
    for a, b in zip(got, expected):
        if b is not None:
            np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-12, atol=1e-12)


def test_plan_sizes_travel_with_the_segments():
    """segments_from_index records the groups' sizes in the plan's order (for consecutive-row sums) and
    Segments.to carries them; the integer reductions over consecutive rows are exact, and on the CPU a float sum is
    bitwise the sum of the group's rows added in order."""
    from otb_torch._core import consecutive_reduce

    segments = otb_torch.segments_from_index(np.array(["b", "a", "c", "b", "a", "b", "d", "d"], dtype=object))
    assert segments.sizes.tolist() == [1, 2, 2, 3]                        # c | a a d d | b b b
    assert segments.to("cpu").sizes.tolist() == [1, 2, 2, 3]
    values = torch.tensor([2**52, 1, 2**40, 3, 5, 7, 11, 13], dtype=torch.int64)
    assert consecutive_reduce(values, segments.sizes, "sum").tolist() == [2**52, 1 + 2**40, 3 + 5, 7 + 11 + 13]
    assert consecutive_reduce(values, segments.sizes, "max").tolist() == [2**52, 2**40, 5, 13]
    floats = torch.from_numpy(np.random.default_rng(3).normal(0, 1, (8, 33)).astype(np.float32)) * torch.logspace(
        -6, 6, 33)                                                            # cancellations where the order shows
    sums, row = consecutive_reduce(floats, segments.sizes, "sum"), 0
    for group, size in enumerate(segments.sizes.tolist()):             # on the CPU: each group's rows in order
        in_order = floats[row].clone()
        for member in range(row + 1, row + size):
            in_order += floats[member]
        assert torch.equal(sums[group], in_order)
        row += size


_CORRUPTIONS = [("token_level_rewards", 0, float("nan")), ("token_level_rewards", 0, float("inf")),
                ("old_log_probs", 3, float("nan")), ("old_log_probs", 3, -float("inf")), ("old_log_probs", 3, 0.5),
                ("sum_pi_squared", 2, float("inf")), ("sum_pi_squared", 2, 1.5), ("sum_pi_squared", 2, -0.5),
                ("sum_pi_squared", 2, 1e-6), ("rollout_is_weights", 4, -0.5), ("rollout_is_weights", 4, float("nan")),
                ("response_mask", 1, 0.5), ("response_mask", 1, 2.0), ("response_mask", 1, float("nan"))]


# the drop-in whose value checks run; both name the arguments as verl does
_CHECKED = {"self-inclusive": "compute_optimal_token_baseline_advantage",
            "leave-one-out": "compute_multi_turn_leave_one_out_token_baseline_advantage"}


@pytest.mark.parametrize("name, index, value", _CORRUPTIONS, ids=lambda x: str(x))
@pytest.mark.parametrize("where", ["valid", "masked"])
@pytest.mark.parametrize("kernel", ["native", "eager"])
@pytest.mark.parametrize("variant", sorted(_CHECKED))
@pytest.mark.parametrize("group", ["shared", "alone"])
def test_fused_value_checks_raise_exactly_what_the_reference_rejects(monkeypatch, name, index, value, where, kernel,
                                                                     variant, group):
    """The value checks evaluated inside the kernels (the native kernel's flags; grouped_otb's reductions; for
    leave-one-out the eager kernel's device pre-check) reject a corrupted value exactly when the reference does — at
    a valid or a masked position of a scattered batch whose other values there are benign (r = 0, log π = 0, Σπ² = 1,
    ρ = 1), so no other rule can fire in its place — naming the argument; in a row of a group of several, and in a
    row alone in its group (the native kernel tests π² ≤ Σπ² in the energy loop, which a group of one skips)."""
    from otb_spec import _validation as reference_checks
    import otb_torch.verl
    if kernel == "eager":
        monkeypatch.setattr(otb_torch._native, "usable", lambda *_: False)
    elif not otb_torch.native_kernel_status().available:
        pytest.skip(f"native kernel not available: {otb_torch.native_kernel_status().reason}")
    function = _CHECKED[variant]
    drop_in = getattr(otb_torch, function, None) or getattr(otb_torch.verl, function)
    inputs, options = _realistic_inputs("compute_optimal_token_baseline_advantage", "scattered-unequal",
                                        torch.float32)
    named = dict(zip(("token_level_rewards", "response_mask", "index", "old_log_probs", "sum_pi_squared"), inputs))
    named.update(options)
    mask = named["response_mask"].numpy()
    rows, cols = np.nonzero(mask > 0) if where == "valid" else np.nonzero(mask == 0)
    row, col = rows[index], cols[index]
    if group == "alone":                                            # a fresh id: the row is a group of its own
        ids = np.asarray(named["index"]).astype(object)
        fresh = "alone"
        while fresh in set(ids.tolist()):
            fresh += "+"
        ids[row] = fresh
        named["index"] = ids
    for key, benign in (("token_level_rewards", 0.0), ("old_log_probs", 0.0), ("sum_pi_squared", 1.0),
                        ("rollout_is_weights", 1.0)):                     # only the corrupted rule can fire
        named[key] = named[key].clone()
        named[key][row, col] = benign
    named[name] = named[name].clone()
    named[name][row, col] = value
    host = {key: value.numpy() for key, value in named.items() if key != "index"}
    try:
        reference_checks.raise_value_error(lambda array: array, rewards=("token_level_rewards", host[
            "token_level_rewards"]), mask=("response_mask", host["response_mask"]), log_probs=(
            "old_log_probs", host["old_log_probs"]), sum_pi_squared=("sum_pi_squared", host["sum_pi_squared"]),
            is_weights=("rollout_is_weights", host["rollout_is_weights"]))
    except ValueError as error:
        expected = str(error)
    before = {key: value.clone() for key, value in named.items() if key != "index"}
    if "please report" in expected:                                 # the reference accepts this input
        drop_in(**named)
    else:
        with pytest.raises(ValueError) as raised:
            drop_in(**named)
        assert str(raised.value) == expected
        assert str(raised.value).startswith(name)
    for key, value in before.items():
        assert torch.allclose(value, named[key], rtol=0.0, atol=0.0, equal_nan=True), key      # inputs untouched


def test_segments_from_any_kind_of_index():
    ids = np.array(["b", "a", "b"], dtype=object)
    from_numpy = otb_torch.segments_from_index(ids)
    from_list = otb_torch.segments_from_index(["b", "a", "b"])
    from_tensor = otb_torch.segments_from_index(torch.tensor([7, 3, 7]))
    for segments in (from_numpy, from_list, from_tensor):
        assert segments.num_groups == 2
        assert segments.index[0] == segments.index[2] != segments.index[1]
    assert otb_torch.segments_from_index(from_numpy) is from_numpy


@given(labels=st.lists(st.integers(0, 6), min_size=1, max_size=40), kind=st.sampled_from(["object", "unicode", "bytes",
                                                                                      "mixed objects"]))
def test_segments_of_string_ids_are_the_references_partition_numbered_by_first_appearance(labels, kind):
    """verl's uids (an object array of str) are planned from one dict pass, other ids through the reference's
    sort-based group_segments: either way the groups are the reference's partition, numbered in order of first
    appearance."""
    names = [f"uid-{label:02d}" for label in labels]
    ids = {"object": np.array(names, dtype=object), "unicode": np.array(names), "bytes": np.array(names, dtype="S"),
           "mixed objects": np.array([name if label % 2 else label for name, label in zip(names, labels)],
                                     dtype=object)}[kind]
    segments = otb_torch.segments_from_index(ids)
    reference = otb.group_segments(np.array(labels)).index
    got = segments.index.numpy()
    assert all((got[i] == got[j]) == (reference[i] == reference[j]) for i in range(len(labels))
               for j in range(len(labels)))
    _, first = np.unique(got, return_index=True)
    assert segments.num_groups == len(first) and list(np.argsort(first, kind="stable")) == list(range(len(first)))


def test_sum_pi_squared_is_chunk_invariant_and_matches_the_plain_formula():
    logits = torch.randn(37, 101, dtype=torch.float32) * 5
    plain = torch.exp(torch.logsumexp(2 * logits.double(), -1) - 2 * torch.logsumexp(logits.double(), -1))
    for chunk in (None, 1, 5, 37, 100):
        np.testing.assert_allclose(otb_torch.sum_pi_squared(logits, chunk_size=chunk).numpy(), plain.numpy(),
                                   rtol=4e-6)


def test_the_default_logits_chunks_are_larger_on_cuda():
    """4 MiB of float32 per chunk buffer on the CPU (at least one row); 32 MiB on CUDA, at least 64 rows (launch-bound
    there: measured on an H100, see otb_torch._logits); an explicit chunk_size wins on either."""
    from otb_torch._logits import _chunk_rows
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert _chunk_rows(32768, None, cpu) == 32 and _chunk_rows(10**7, None, cpu) == 1
    assert _chunk_rows(32768, None, cuda) == 256 and _chunk_rows(152064, None, cuda) == 64
    assert _chunk_rows(32768, 3, cuda) == 3


# ----------------------------------------------------------------------------------------------------------------------
# torch.compile


@pytest.mark.parametrize("function", ["compute_optimal_token_baseline_advantage",
                                      "compute_multi_turn_optimal_token_baseline_advantage"])
def test_runs_under_torch_compile(function):
    """The drop-ins compile (dynamic shapes, no graph breaks in the core) and agree with eager mode."""
    compiled = torch.compile(getattr(otb_torch, function), dynamic=True)
    for seed in (0, 1):
        batch, tensors = _verl_batch()
        if seed:
            tensors = {name: value[:4, :6] for name, value in tensors.items()}
            ids = np.asarray(batch.group_ids)[:4]
        else:
            ids = np.asarray(batch.group_ids)
        segments = otb_torch.segments_from_index(ids)
        eager = _call(getattr(otb_torch, function), tensors, segments)
        fast = _call(compiled, tensors, segments, check_values=False)
        for a, b in zip(eager, fast):
            np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("function", ["optimal_token_baseline", "leave_one_out_token_baseline"])
def test_accelerator_blocks_run_under_a_callers_torch_compile(function):
    """A caller's torch.compile traces the blocks of consecutive groups (the plan's cuts on the host, the sums over
    consecutive rows) as on CUDA, and agrees with eager mode."""
    inputs, options = _realistic_inputs(function, "scattered-unequal", torch.float32)
    segments = otb_torch.segments_from_index(inputs[2])
    eager = getattr(otb_torch, function)(*inputs[:2], segments, *inputs[3:], **options)
    compiled = torch.compile(getattr(otb_torch, function), dynamic=True)
    with otb_torch._otb.blocks_as_on_accelerators():
        fast = compiled(*inputs[:2], segments, *inputs[3:], **options, check_values=False)
    for a, b in zip(eager, fast):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------------------------------------------------
# CUDA (skipped cleanly without a GPU)


@pytest.mark.gpu
@requires_cuda
def test_cuda_matches_cpu_and_never_synchronises():
    batch, tensors = _verl_batch(device="cuda")
    segments = otb_torch.segments_from_index(np.asarray(batch.group_ids), "cuda")
    torch.cuda.set_sync_debug_mode("error")
    try:
        result = otb_torch.optimal_token_baseline(tensors["rewards"], tensors["response_mask"], segments,
                                                  tensors["log_probs"], tensors["sum_pi_squared"],
                                                  check_values=False)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    cpu = otb_torch.optimal_token_baseline(*(_verl_batch()[1][n] for n in ("rewards", "response_mask")),
                                           np.asarray(batch.group_ids), _verl_batch()[1]["log_probs"],
                                           _verl_batch()[1]["sum_pi_squared"])
    np.testing.assert_allclose(result.advantages.cpu().numpy(), cpu.advantages.numpy(), rtol=1e-5, atol=1e-5)
    assert result.advantages.device.type == "cuda"


# each torch function's reference and the options of its error bound (otb_spec.tolerances.otb_comparison_tolerance)
_REFERENCES = {
    "optimal_token_baseline": (otb.optimal_token_baseline, {}),
    "compute_optimal_token_baseline_advantage": (otb.optimal_token_baseline, {}),
    "multi_turn_optimal_token_baseline": (otb.multi_turn_optimal_token_baseline, dict(align="valid_token")),
    "compute_multi_turn_optimal_token_baseline_advantage": (otb.multi_turn_optimal_token_baseline,
                                                            dict(align="valid_token")),
    "leave_one_out_token_baseline": (otb.leave_one_out_token_baseline,
                                     dict(leave_one_out=True, handle_zero_tail=False)),
}


@functools.cache
def _many_unequal_groups(holes: bool) -> otb.RolloutBatch:
    from test_adapters import realistic_batch, unequal_sizes

    return realistic_batch(21, unequal_sizes(21, 400, largest=64), 512, holes=holes, is_weights=True)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("function", _FUNCTIONS)
def test_cuda_unequal_groups_run_as_one_deterministic_block_without_synchronising(function):
    """Scattered groups of 1 … 64 members on CUDA (400 groups, 512 positions): one block, group sums over
    consecutive rows (torch.segment_reduce) — no host synchronisation on the hot path, the same bits on three calls
    (where index_add_'s atomics would add in varying order), and the float64 reference within the float32 error
    bound (the shared suite's)."""
    batch = _many_unequal_groups("multi_turn" in function)
    inputs = [torch.as_tensor(np.asarray(getattr(batch, name)), dtype=torch.float32)
              for name in ("rewards", "response_mask", "log_probs", "sum_pi_squared", "is_weights")]
    weights = "rollout_is_weights" if function.startswith("compute") else "is_weights"
    call = getattr(otb_torch, function)
    segments = otb_torch.segments_from_index(batch.group_ids, "cuda")
    blocks = otb_torch._otb._blocks(segments, *inputs[0].shape, inputs[0].cuda().device)
    assert len(blocks) == 1 and blocks[0].sizes is not None and len(segments.runs) > 30
    on_gpu = [value.cuda() for value in inputs]

    def once():
        return call(*on_gpu[:2], segments, *on_gpu[2:4], **{weights: on_gpu[4]}, check_values=False)

    once()                                                            # warm-up: first-use allocations
    torch.cuda.set_sync_debug_mode("error")
    try:
        results = [once() for _ in range(3)]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for values in zip(*results):
        assert values[0] is None or all(torch.equal(values[0], other) for other in values[1:])
    reference, options = _REFERENCES[function]
    seen = [value.numpy() for value in inputs]          # float32: the reference applies that precision's slack
    expected = reference(*seen[:2], batch.group_ids, *seen[2:4], is_weights=seen[4])
    tolerances = otb_comparison_tolerance(*seen[:2], batch.group_ids, *seen[2:4], is_weights=seen[4],
                                          compute_dtype=np.float32, output_dtype=np.float32, **options)
    for tolerance, got, want in zip(tolerances, results[0][:2], (expected.advantages, expected.returns)):
        tolerance.assert_close(got.cpu().numpy(), want, f"{function} on CUDA")


@pytest.mark.gpu
@requires_cuda
def test_cuda_graph_capture_and_replay():
    batch, tensors = _verl_batch(device="cuda")
    segments = otb_torch.segments_from_index(np.asarray(batch.group_ids), "cuda")

    def step():
        return otb_torch.optimal_token_baseline(tensors["rewards"], tensors["response_mask"], segments,
                                                tensors["log_probs"], tensors["sum_pi_squared"],
                                                check_values=False).advantages

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()                                   # warm-up outside the graph
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    tensors["rewards"].mul_(2.0)
    graph.replay()
    torch.cuda.synchronize()
    np.testing.assert_allclose(captured.cpu().numpy(), step().cpu().numpy(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kernel", ["native", "eager"])
@pytest.mark.parametrize("case", ["float64 mask 1 + 1e-12", "float64 mask 1e-300", "integer statistics, π² underflows"])
def test_value_checks_see_what_the_compute_dtype_rounds_away(monkeypatch, kernel, case):
    """Inputs the reference rejects but which a float32 computation cannot see: a float64 mask value that rounds to
    1 or 0 in float32, and integer log π / Σπ² (no input slack) where π² = exp(−120) underflows against Σπ² = 0."""
    if kernel == "eager":
        monkeypatch.setattr(otb_torch._native, "usable", lambda *_: False)
    rows, positions = 4, 6
    rewards = torch.zeros(rows, positions)
    mask = torch.ones(rows, positions, dtype=torch.float64)
    log_probs, sum_pi_squared = torch.full((rows, positions), -0.5), torch.full((rows, positions), 0.5)
    if case.startswith("float64 mask"):
        mask[2, 3] = 1.0 + 1e-12 if "1e-12" in case else 1e-300
        expected = "response_mask"
    else:
        log_probs = torch.full((rows, positions), -60, dtype=torch.int64)
        sum_pi_squared = torch.zeros(rows, positions, dtype=torch.int64)
        expected = "sum_pi_squared"
    with pytest.raises(ValueError, match=f"^{expected}"):
        otb_torch.compute_optimal_token_baseline_advantage(rewards, mask, np.repeat(["a", "b"], 2), log_probs,
                                                           sum_pi_squared)
