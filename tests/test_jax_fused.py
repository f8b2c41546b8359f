"""otb_jax.fused_linear_token_statistics: log π, entropy and Σπ² from hidden states and the LM head without the
logits — values and gradients (jax.vjp, jax.grad, τ included) equal to the reference within the derived bounds, under
the caller's jit and vmap, with no [N, V] array in the forward or the backward program.

Compilation dominates the cost: every property runs on one shape (N = 10 tokens as [2, 5], H = 8, V = 23) and a few
fixed chunkings — (3, 4) pads the tokens and clamps the last vocabulary chunk (23 = 5·4 + 3), (1, 1) is one token
by one column, (10, 23) one block, None the defaults — so each (chunking, dtype) pair compiles once.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

jax = pytest.importorskip("jax")
otb_jax = pytest.importorskip("otb_jax")
jnp = jax.numpy

import otb_spec as otb  # noqa: E402
from otb_spec import strategies as otb_st  # noqa: E402
from otb_spec.lm_head import lm_head_logits, logit_cotangent  # noqa: E402
from otb_spec.tolerances import hidden_comparison_tolerances, summation_tolerance  # noqa: E402
from accelerators import requires_jax_gpu  # noqa: E402

LEAD, HIDDEN, VOCAB = (2, 5), 8, 23
CASES = otb_st.lm_head_inputs(lead_shapes=[LEAD], min_hidden_size=HIDDEN, max_hidden_size=HIDDEN,
                              min_vocab_size=VOCAB, max_vocab_size=VOCAB)
CHUNKINGS = [(None, None), (3, 4), (1, 1), (10, 23)]
JNP = {"float32": jnp.float32, "float64": jnp.float64, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def _cotangents(case):
    """The case's cotangents on a grid of 1/64: exact in every dtype, so casting them to the outputs' dtype is exact."""
    return np.round(case.log_probs_cotangent * 64) / 64, np.round(case.entropy_cotangent * 64) / 64


def _run(case, dtype, chunking):
    """Statistics and the VJP of (log π, H) with the case's cotangents, through jax.vjp."""
    hidden, weight = jnp.asarray(case.hidden, JNP[dtype]), jnp.asarray(case.weight, JNP[dtype])
    ids = jnp.asarray(case.token_ids)

    def statistics(h, w):
        out = otb_jax.fused_linear_token_statistics(h, w, ids, temperature=case.temperature, chunk_size=chunking[0],
                                                    vocab_chunk_size=chunking[1])
        return out.log_probs, out.entropy, out.sum_pi_squared

    (log_probs, entropy, spp), pullback = jax.vjp(statistics, hidden, weight)
    g_lp, g_h = _cotangents(case)
    d_hidden, d_weight = pullback((jnp.asarray(g_lp, log_probs.dtype), jnp.asarray(g_h, entropy.dtype),
                                   jnp.ones_like(spp)))                   # Σπ²'s cotangent must change nothing
    return (log_probs, entropy, spp), (d_hidden, d_weight), (hidden, weight)


def _assert_matches_reference(case, dtype, outputs, gradients, inputs):
    exact_hidden, exact_weight = (np.asarray(x.astype(jnp.float32) if x.dtype == jnp.bfloat16 else x,
                                             dtype=np.float64) for x in inputs)     # the values the port was given
    g_lp, g_h = _cotangents(case)
    reference = otb.token_statistics_from_hidden(exact_hidden, exact_weight, case.token_ids,
                                                 temperature=case.temperature)
    expected = otb.token_statistics_vjp(exact_hidden, exact_weight, case.token_ids, g_lp, g_h,
                                        temperature=case.temperature)
    compute = "float64" if dtype == "float64" else "float32"
    # the port upcasts half precision before its matmuls: its working precision is float32's; the statistics come back
    # in the compute dtype, the gradients in the inputs' dtype
    options = dict(temperature=case.temperature, log_probs_cotangent=g_lp, entropy_cotangent=g_h, input_dtype=compute)
    statistics, _ = hidden_comparison_tolerances(exact_hidden, exact_weight, case.token_ids, output_dtype=compute,
                                                 **options)
    _, (bound_h, bound_w) = hidden_comparison_tolerances(exact_hidden, exact_weight, case.token_ids,
                                                         output_dtype=dtype, **options)
    for name, value in zip(("log_probs", "entropy", "sum_pi_squared"), outputs):
        assert value.dtype == JNP[compute] and value.shape == LEAD, name
        getattr(statistics, name).assert_close(np.asarray(value), getattr(reference, name), name)
    assert gradients[0].dtype == JNP[dtype] and gradients[1].dtype == JNP[dtype]
    bound_h.assert_close(np.asarray(gradients[0], dtype=np.float64), expected.hidden, "∂hidden vs the analytic VJP")
    bound_w.assert_close(np.asarray(gradients[1], dtype=np.float64), expected.weight, "∂weight vs the analytic VJP")


@settings(max_examples=25)
@given(case=CASES, chunking=st.sampled_from(CHUNKINGS), dtype=st.sampled_from(["float32", "float64"]))
def test_values_and_gradients_equal_the_reference(case, chunking, dtype):
    """Any of the chunkings (padded tokens, a clamped last vocabulary chunk, online rescaling across chunks), float32
    and float64 (with x64)."""
    with jax.enable_x64(dtype == "float64"):
        outputs, gradients, inputs = _run(case, dtype, chunking)
        _assert_matches_reference(case, dtype, outputs, gradients, inputs)


@settings(max_examples=15)
@given(case=CASES, dtype=st.sampled_from(["bfloat16", "float16"]))
def test_half_precision_inputs_are_accumulated_in_float32(case, dtype):
    """bf16/fp16 hidden states and weights: statistics in float32 within float32's bound (not the half precision's),
    gradients returned in the inputs' dtype."""
    outputs, gradients, inputs = _run(case, dtype, (3, 4))
    _assert_matches_reference(case, dtype, outputs, gradients, inputs)


def _loss(hidden, weight, ids, temperature, g_lp, g_h):
    out = otb_jax.fused_linear_token_statistics(hidden, weight, ids, temperature=temperature, chunk_size=3,
                                                vocab_chunk_size=4)
    return jnp.sum(g_lp * out.log_probs) + jnp.sum(g_h * out.entropy)


_STEP = jax.jit(jax.value_and_grad(_loss, argnums=(0, 1, 3)))     # one program, compiled once


@settings(max_examples=10)
@given(case=CASES)
def test_inside_a_callers_jit_with_a_traced_temperature(case):
    """jax.jit(jax.value_and_grad(loss)) over (hidden, weight, τ): τ traced, gradients for all three. ∂τ is checked
    against −Σₙ ∂zₙ·zₙ/τ from the reference's logit cotangent (float64, x64)."""
    with jax.enable_x64(True):
        g_lp, g_h = _cotangents(case)
        value, (d_hidden, d_weight, d_tau) = _STEP(jnp.asarray(case.hidden), jnp.asarray(case.weight),
                                                  jnp.asarray(case.token_ids), jnp.asarray(case.temperature),
                                                  jnp.asarray(g_lp), jnp.asarray(g_h))
        reference = otb.token_statistics_from_hidden(case.hidden, case.weight, case.token_ids,
                                                     temperature=case.temperature)
        expected = otb.token_statistics_vjp(case.hidden, case.weight, case.token_ids, g_lp, g_h,
                                            temperature=case.temperature)
        statistics, (bound_h, bound_w) = hidden_comparison_tolerances(
            case.hidden, case.weight, case.token_ids, temperature=case.temperature, log_probs_cotangent=g_lp,
            entropy_cotangent=g_h, input_dtype="float64")
        terms = np.concatenate([(g_lp * reference.log_probs).ravel(), (g_h * reference.entropy).ravel()])
        errors = np.concatenate([(np.abs(g_lp) * statistics.log_probs.atol).ravel(),
                                 (np.abs(g_h) * statistics.entropy.atol).ravel()])
        summation_tolerance(terms.size, np.abs(terms).sum() + errors.sum()).assert_close(
            float(value), terms.sum(), "loss")
        bound_h.assert_close(np.asarray(d_hidden), expected.hidden, "∂hidden")
        bound_w.assert_close(np.asarray(d_weight), expected.weight, "∂weight")
        logits = lm_head_logits(case.hidden, case.weight, temperature=case.temperature).reshape(-1, VOCAB)
        d_logits = logit_cotangent(logits, case.token_ids.ravel(), g_lp.ravel(), g_h.ravel())
        products = (d_logits * logits / case.temperature).ravel()
        # ∂τ = −Σ ∂z·z/τ: a sum of N·V products, each carrying the logit-cotangent and logit errors of the bounds
        magnitude = np.abs(products).sum() + (np.abs(bound_h.atol).sum() + np.abs(bound_w.atol).sum()) \
            * (np.abs(case.hidden).max() + np.abs(case.weight).max() + 1) / case.temperature
        summation_tolerance(products.size, magnitude).assert_close(float(d_tau), -products.sum(), "∂τ")


def test_vmap_over_an_extra_batch_axis():
    """A batch of three [2, 5, H] hidden states and ids with one shared LM head: vmap gives each member's own
    statistics and gradients."""
    rng = np.random.default_rng(0)
    hidden = jnp.asarray(rng.normal(size=(3,) + LEAD + (HIDDEN,)), jnp.float32)
    weight = jnp.asarray(rng.normal(size=(VOCAB, HIDDEN)) * 2, jnp.float32)
    ids = jnp.asarray(rng.integers(0, VOCAB, (3,) + LEAD))
    ones = jnp.ones(LEAD, jnp.float32)
    grads = jax.vmap(jax.grad(_loss, argnums=(0, 1)), in_axes=(0, None, 0, None, None, None))(
        hidden, weight, ids, 0.5, ones, ones)
    for member in range(3):
        alone = jax.grad(_loss, argnums=(0, 1))(hidden[member], weight, ids[member], 0.5, ones, ones)
        np.testing.assert_allclose(np.asarray(grads[0][member]), np.asarray(alone[0]), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(np.asarray(grads[1][member]), np.asarray(alone[1]), rtol=1e-5, atol=1e-6)
        direct = otb.token_statistics_vjp(np.asarray(hidden[member], np.float64), np.asarray(weight, np.float64),
                                          np.asarray(ids[member]), np.ones(LEAD), np.ones(LEAD), temperature=0.5)
        np.testing.assert_allclose(np.asarray(alone[0]), direct.hidden, rtol=1e-4, atol=1e-4)


def _largest_intermediate(closed_jaxpr) -> tuple[int, tuple[int, ...]]:
    """The largest array (size, shape) any equation of the program or of its sub-programs produces."""
    try:
        from jax.extend.core import subjaxprs
    except ImportError:                     # older JAX (0.8.0, the oldest otb_jax is tested on) has it here
        from jax.core import subjaxprs

    largest = (0, ())

    def visit(jaxpr):
        nonlocal largest
        for equation in jaxpr.eqns:
            for var in equation.outvars:
                shape = tuple(getattr(var.aval, "shape", ()))
                size = int(np.prod(shape, dtype=np.int64))
                largest = max(largest, (size, shape))
        for inner in subjaxprs(jaxpr):
            visit(inner)

    visit(closed_jaxpr.jaxpr)
    return largest


def test_no_array_of_the_logits_size_exists_forward_or_backward():
    """N = 64 tokens, V = 96, H = 8, blocks of 8 × 16: no intermediate of the traced value-and-gradient program
    reaches N·V/4 (the largest are the [V, H] weight gradient and the [N, H] hidden states)."""
    n, vocab, width = 64, 96, 8
    hidden, weight = jnp.zeros((n, width)), jnp.zeros((vocab, width))
    ids = jnp.zeros((n,), jnp.int32)

    def loss(h, w):
        out = otb_jax.fused_linear_token_statistics(h, w, ids, chunk_size=8, vocab_chunk_size=16)
        return jnp.sum(out.log_probs) + jnp.sum(out.entropy)

    size, shape = _largest_intermediate(jax.make_jaxpr(jax.value_and_grad(loss, argnums=(0, 1)))(hidden, weight))
    assert size < n * vocab // 4, f"an intermediate of shape {shape} exists"
    assert size >= vocab * width                      # the program was walked: the weight gradient is in it


def test_sum_pi_squared_carries_no_gradient_and_only_asked_gradients_flow():
    rng = np.random.default_rng(1)
    hidden = jnp.asarray(rng.normal(size=(4, 3)), jnp.float32)
    weight = jnp.asarray(rng.normal(size=(9, 3)), jnp.float32)
    ids = jnp.asarray([0, 3, 8, 2])
    spp_grad = jax.grad(lambda h: jnp.sum(otb_jax.fused_linear_token_statistics(h, weight, ids).sum_pi_squared))(
        hidden)
    assert not np.any(np.asarray(spp_grad))
    only_log_probs = jax.grad(lambda h: jnp.sum(otb_jax.fused_linear_token_statistics(h, weight, ids).log_probs))(
        hidden)
    expected = otb.token_statistics_vjp(np.asarray(hidden, np.float64), np.asarray(weight, np.float64),
                                        np.asarray(ids), np.ones(4), None)
    np.testing.assert_allclose(np.asarray(only_log_probs), expected.hidden, rtol=1e-5, atol=1e-5)


def test_empty_batch():
    out = otb_jax.fused_linear_token_statistics(jnp.zeros((0, 4)), jnp.ones((6, 4)), jnp.zeros((0,), jnp.int32))
    assert out.log_probs.shape == (0,) and out.entropy.shape == (0,)
    grad = jax.grad(lambda h: jnp.sum(otb_jax.fused_linear_token_statistics(h, jnp.ones((6, 4)),
                                                                             jnp.zeros((0,), jnp.int32)).entropy))(
        jnp.zeros((0, 4)))
    assert grad.shape == (0, 4)


def _arguments(**change):
    arguments = dict(hidden=jnp.ones((2, 4)), weight=jnp.ones((6, 4)), token_ids=jnp.asarray([0, 5]))
    options = {key: change.pop(key) for key in ("temperature", "chunk_size", "vocab_chunk_size") if key in change}
    arguments.update(change)
    return arguments, options


@pytest.mark.parametrize("change, error, match", [
    (dict(weight=jnp.ones((5, 3))), ValueError, r"weight: expected shape \[V, 4\]"),
    (dict(weight=jnp.ones(5)), ValueError, r"weight: expected shape \[V, H\]"),
    (dict(hidden=jnp.ones(())), ValueError, r"hidden: expected shape \[\.\.\., H\]"),
    (dict(token_ids=jnp.zeros(3, jnp.int32)), ValueError, r"token_ids: expected shape \(2,\) \(hidden without"),
    (dict(token_ids=jnp.asarray([0, 6])), ValueError, r"token_ids: must lie in \[0, 6\)"),
    (dict(token_ids=jnp.asarray([-1, 0])), ValueError, r"token_ids: must lie in \[0, 6\)"),
    (dict(token_ids=jnp.asarray([0.0, 1.0])), TypeError, "token_ids: expected integer token ids"),
    (dict(hidden=jnp.asarray([[0.0, jnp.nan, 0.0, 0.0]] * 2)), ValueError, r"hidden: contains NaN or ±inf"),
    (dict(weight=jnp.full((6, 4), jnp.inf)), ValueError, r"weight: contains NaN or ±inf"),
    (dict(weight=jnp.ones((4096, 4)).at[3000, 2].set(jnp.nan)), ValueError,        # a head large enough for XLA to
     r"weight: contains NaN or ±inf \(first at index \(3000, 2\)"),                # vectorise its reduction
    (dict(hidden=jnp.ones((2, 4), jnp.bfloat16).at[1, 3].set(-jnp.inf)), ValueError,
     r"hidden: contains NaN or ±inf \(first at index \(1, 3\)"),
    (dict(temperature=0.0), ValueError, "temperature: must be > 0"),
    (dict(temperature=-2.0), ValueError, "temperature: must be > 0"),
    (dict(temperature=jnp.asarray(float("inf"))), ValueError, "temperature: must be finite"),
    (dict(temperature=True), TypeError, "temperature: expected a real number, got a bool"),
    (dict(temperature=jnp.ones(2)), ValueError, "temperature: expected a scalar"),
    (dict(chunk_size=0), ValueError, "chunk_size: expected a positive integer"),
    (dict(vocab_chunk_size=2.5), ValueError, "vocab_chunk_size: expected a positive integer"),
    (dict(temperature=1e-40), ValueError, "temperature: τ = 1e-40 is too small for float32 logits"),
    (dict(temperature=jnp.asarray(1e-45)), ValueError, "temperature: τ = .* is too small for float32 logits"),
    (dict(temperature=5e-39), ValueError, "temperature: τ = 5e-39 is too small for float32 logits"),   # subnormal
    (dict(token_ids=np.array([2**32 + 1, 3])), ValueError, r"token_ids: 4294967297 at index \(0,\) does not fit"),
    (dict(hidden=jnp.full((2, 4), 1e38)), ValueError, "hidden: with weight and temperature, the logits h·Wᵀ/τ over"),
])
def test_bad_input_raises_naming_the_argument(change, error, match):
    arguments, options = _arguments(**change)
    with pytest.raises(error, match=match):
        otb_jax.fused_linear_token_statistics(arguments["hidden"], arguments["weight"], arguments["token_ids"],
                                              **options)


def test_inside_a_trace_values_are_unknown_and_an_id_outside_the_vocabulary_gives_nan():
    """The documented behaviour under the caller's jit: no value check (values are unknown while tracing); an id
    outside [0, V) gives log π = NaN rather than a finite wrong number; the entropy does not depend on it."""
    hidden, weight = jnp.ones((2, 4)), jnp.ones((6, 4))

    @jax.jit
    def statistics(ids):
        return otb_jax.fused_linear_token_statistics(hidden, weight, ids)

    out = statistics(jnp.asarray([1, 6]))
    assert np.isnan(float(out.log_probs[1])) and np.isfinite(float(out.log_probs[0]))
    np.testing.assert_allclose(np.asarray(out.entropy), np.log(6.0), rtol=1e-6)


@pytest.mark.parametrize("dtype, vocab, token", [(jnp.uint8, 300, 200), (jnp.int16, 40_000, 30_000),
                                                  (jnp.uint16, 300, 299)])
def test_narrow_integer_token_ids_are_read_as_their_values(dtype, vocab, token):
    """Comparing ids with V in their own dtype would wrap V (300 is 44 in uint8): valid ids rejected when checked,
    NaN when not; both functions, checked and under jit."""
    rng = np.random.default_rng(5)
    hidden = jnp.asarray(rng.normal(size=(3, 4)), jnp.float32)
    weight = jnp.asarray(rng.normal(size=(vocab, 4)), jnp.float32)
    wide = jnp.asarray([1, 2, token], jnp.int32)
    expected = otb_jax.fused_linear_token_statistics(hidden, weight, wide).log_probs
    narrow = wide.astype(dtype)
    for got in (otb_jax.fused_linear_token_statistics(hidden, weight, narrow).log_probs,
                jax.jit(lambda ids: otb_jax.fused_linear_token_statistics(hidden, weight, ids).log_probs)(narrow)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(expected))
    logits = hidden @ weight.T
    from_logits = otb_jax.token_statistics_from_logits(logits, wide).log_probs
    for got in (otb_jax.token_statistics_from_logits(logits, narrow).log_probs,
                jax.jit(lambda ids: otb_jax.token_statistics_from_logits(logits, ids).log_probs)(narrow)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(from_logits))


def test_overflowing_logits_are_nan_without_the_value_check():
    """The documented value where the check is off (or inside a trace): NaN statistics, not a finite number."""
    out = otb_jax.fused_linear_token_statistics(jnp.full((2, 4), 1e38), jnp.ones((6, 4)), jnp.asarray([0, 5]),
                                                check_values=False)
    assert np.isnan(np.asarray(out.entropy)).all() and np.isnan(np.asarray(out.log_probs)).all()


@pytest.mark.parametrize("chunk_size", [None, 512, 2048])
def test_a_row_chunk_keeps_the_block_within_its_budget(chunk_size):
    """chunk_size alone sets the rows of a block; the columns follow the budget (as otb_torch sizes them) instead of
    staying V: XLA's planned temporaries at N = 2048, V = 32 768, H = 64 stay a few blocks of 16 MiB, far below the
    256 MiB of the float32 logits (chunk_size = 2048 with V columns planned 512 MiB)."""
    n, vocab, width = 2048, 32_768, 64
    compiled = jax.jit(lambda h, w, ids: otb_jax.fused_linear_token_statistics(h, w, ids, chunk_size=chunk_size)
                       ).lower(jax.ShapeDtypeStruct((n, width), jnp.float32),
                               jax.ShapeDtypeStruct((vocab, width), jnp.float32),
                               jax.ShapeDtypeStruct((n,), jnp.int32)).compile()
    analysis = compiled.memory_analysis()
    if analysis is None:
        pytest.skip("this backend reports no memory analysis")
    block = 2**22 * 4
    assert analysis.temp_size_in_bytes <= 4 * block, analysis.temp_size_in_bytes / 2**20


# ----------------------------------------------------------------------------------------------------------------------
# GPU (skipped cleanly without one). The port sets no matmul precision of its own: it follows the caller's
# jax_default_matmul_precision, as the model's own logits matmul would. On recent NVIDIA GPUs JAX's default lets
# float32 matmuls run in TF32 (10-bit mantissa), which float32's bounds do not cover; with "float32" precision they do.


@pytest.mark.gpu
@requires_jax_gpu
@settings(max_examples=15, deadline=None)
@given(case=CASES, chunking=st.sampled_from(CHUNKINGS), dtype=st.sampled_from(["float32", "bfloat16"]))
def test_gpu_values_and_gradients_equal_the_reference(case, chunking, dtype):
    with jax.default_device(jax.devices("gpu")[0]), jax.default_matmul_precision("float32"):
        outputs, gradients, inputs = _run(case, dtype, chunking)
    assert all(value.devices() == {jax.devices("gpu")[0]} for value in (*outputs, *gradients))
    _assert_matches_reference(case, dtype, outputs, gradients, inputs)
