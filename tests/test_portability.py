"""The generated inputs are bit-portable: no transcendental function, no compiled random distribution, no reduction.

The golden vectors promise their *inputs* bit for bit on every IEEE-754 machine (docs/vectors.md). NumPy's ``exp`` and
``log`` are not correctly rounded and their last bit depends on the SIMD code path NumPy dispatches to on each CPU, so
an input computed with them belongs to the machine that computed it (issue 18: one ulp of Σπ² differed between a CPU
with AVX-512 and one without). These tests replace every such function by one that raises while the cases are built,
so a generator that uses one fails here on any machine — not only on a machine whose CPU happens to differ.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import types

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from otb_spec import _portable as portable
from otb_spec.conformance import GENERATED_PROFILES, KINDS, generated_cases, golden_cases, special_cases

pytestmark = pytest.mark.bitexact

_TRANSCENDENTAL = ("exp", "exp2", "expm1", "log", "log2", "log10", "log1p", "power", "float_power", "sin", "cos",
                   "tan", "tanh", "sinh", "cosh", "arctan", "logaddexp", "logaddexp2", "cbrt")


class _Forbidden(AssertionError):
    pass


@contextlib.contextmanager
def transcendental_functions_forbidden(*, math_everywhere: bool = True):
    """NumPy's and math's transcendental functions, and NumPy's compiled random distributions, raise inside.

    ``math_everywhere=False`` guards ``math`` only as otb-spec's own modules see it (Hypothesis's engine uses
    ``math.log2`` for its own bookkeeping while it draws)."""
    saved = []

    def forbid(owner, name, label):
        if hasattr(owner, name):
            saved.append((owner, name, getattr(owner, name)))

            def raiser(*args, **kwargs):
                raise _Forbidden(f"{label}.{name} used while building inputs")
            setattr(owner, name, raiser)

    for name in _TRANSCENDENTAL:
        forbid(np, name, "numpy")
    forbid(np.random, "default_rng", "numpy.random")
    guarded_math = math if math_everywhere else types.SimpleNamespace(**vars(math))
    for name in _TRANSCENDENTAL + ("pow",):
        forbid(guarded_math, name, "math")
    if not math_everywhere:
        for module in list(sys.modules.values()):
            if getattr(module, "__name__", "").startswith("otb_spec") and getattr(module, "math", None) is math:
                saved.append((module, "math", math))
                module.math = guarded_math
    try:
        yield
    finally:
        for owner, name, value in reversed(saved):
            setattr(owner, name, value)


def _inputs(case):
    names = ("rewards", "response_mask", "log_probs", "sum_pi_squared", "is_weights", "logits", "hidden", "weight",
             "token_ids", "log_probs_cotangent", "entropy_cotangent")
    return {name: getattr(case, name) for name in names if getattr(case, name) is not None}


@pytest.mark.parametrize("kind", KINDS)
def test_golden_and_special_inputs_use_no_transcendental_function(kind):
    with transcendental_functions_forbidden():
        built = golden_cases(kind, ("float64", "float32", "bfloat16")) + special_cases(kind)
    again = golden_cases(kind, ("float64", "float32", "bfloat16")) + special_cases(kind)
    assert len(built) == len(again) > 0
    for first, second in zip(built, again):                  # same bits, built twice
        for name, value in _inputs(first).items():
            assert np.array_equal(value, getattr(second, name), equal_nan=True), (first.name, name)


def test_the_guard_catches_a_transcendental_input():
    """The check above can fail: the generator this issue replaced (log/exp of uniforms) is rejected."""
    with transcendental_functions_forbidden(), pytest.raises(_Forbidden):
        np.exp(np.log(np.random.default_rng(1).uniform(0.02, 0.98, 4)))


@pytest.mark.parametrize("kind,profile", [(kind, profile) for kind in KINDS for profile in GENERATED_PROFILES[kind]])
@settings(max_examples=15)
@given(data=st.data())
def test_generated_inputs_use_no_transcendental_function(kind, profile, data):
    strategy = generated_cases(kind, profile=profile)
    with transcendental_functions_forbidden(math_everywhere=False):
        case = data.draw(strategy)
    assert _inputs(case)


def test_portable_functions_are_accurate_and_exact_where_exact():
    x = portable.PortableRandom(0).uniform(-40.0, 5.0, 20000)
    reference = np.array([math.exp(v) for v in x])
    assert np.max(np.abs(portable.exp(x) - reference) / np.spacing(reference)) <= 4
    y = portable.PortableRandom(1).uniform(1e-9, 10.0, 20000)
    reference = np.array([math.log(v) for v in y])
    assert np.max(np.abs(portable.log(y) - reference) / np.spacing(np.abs(reference))) <= 4
    assert float(portable.exp(0.0)) == 1.0 and float(portable.log(1.0)) == 0.0
    assert float(portable.exp(portable.log(0.5))) == 0.5


def test_portable_random_draws_have_the_stated_distributions():
    rng = portable.PortableRandom(2)
    u = rng.random(200_000)
    assert u.min() >= 0.0 and u.max() < 1.0 and abs(u.mean() - 0.5) < 5 * math.sqrt(1 / 12 / u.size)
    z = rng.normal(200_000)
    assert abs(z.mean()) < 5 / math.sqrt(z.size) and abs(z.var() - 1.0) < 5 * math.sqrt(2.0 / z.size) * 1.1
    k = rng.integers(3, 7, 100_000)
    assert set(np.unique(k).tolist()) == {3, 4, 5, 6}
    assert sorted(rng.permutation(50).tolist()) == list(range(50))


def test_the_same_seed_gives_the_same_bits_the_same_way():
    """Pinned bits of a few draws: a change of algorithm (or of NumPy's PCG64 stream) shows here first."""
    rng = portable.PortableRandom(2026)
    assert rng.random(3).tolist() == [float.fromhex(h) for h in _PINNED_RANDOM]
    assert rng.integers(0, 1000, 4).tolist() == _PINNED_INTEGERS
    assert float(portable.log(3.0)).hex() == _PINNED_LOG3


_PINNED_RANDOM = ["0x1.6e756026d097cp-3", "0x1.47a2b2ce0d869p-1", "0x1.de7b9b95763fcp-2"]
_PINNED_INTEGERS = [370, 354, 790, 905]
_PINNED_LOG3 = "0x1.193ea7aad030bp+0"


def test_the_dispatch_limit_asked_for_is_in_force():
    """In .ci/run's second pass NPY_DISABLE_CPU_FEATURES names every SIMD target this CPU has beyond NumPy's baseline;
    make sure NumPy honoured it (otherwise that pass would prove nothing)."""
    disabled = os.environ.get("NPY_DISABLE_CPU_FEATURES", "").replace(",", " ").split()
    if not disabled:
        pytest.skip("NPY_DISABLE_CPU_FEATURES is not set (the default run)")
    try:
        from numpy._core._multiarray_umath import __cpu_features__
    except ImportError:                                              # NumPy < 2
        from numpy.core._multiarray_umath import __cpu_features__
    assert not [name for name in disabled if __cpu_features__.get(name)]
    if os.environ.get("OTB_TORCH_THREADS"):
        torch = pytest.importorskip("torch")
        assert torch.get_num_threads() == int(os.environ["OTB_TORCH_THREADS"])
