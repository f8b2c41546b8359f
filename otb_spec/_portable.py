"""Bit-portable numbers: generated inputs that every IEEE-754 machine reproduces bit for bit.

The conformance cases and golden vectors are *inputs*; a port on another machine must be able to regenerate them
exactly. NumPy's transcendental functions (``exp``, ``log``, …) are not correctly rounded, and the last bit they return
depends on the code path NumPy dispatches to on each CPU (its AVX-512 float64 ``exp``/``log`` kernels differ from the
scalar libm ones), so inputs computed with them belong to the machine that computed them. This module builds inputs
with operations that IEEE 754 rounds correctly — +, −, ×, ÷, √, conversions, comparisons, ``floor``, ``frexp`` and
``ldexp`` — each a separate elementwise NumPy call (so no compiler can fuse two of them into a multiply-add, and no
reduction whose order could depend on the SIMD width), from the raw 64-bit output of the PCG64 bit generator, whose
stream NumPy keeps stable across versions.

* :class:`PortableRandom` — uniform, integer, normal (Irwin–Hall) draws and permutations from PCG64's raw bits;
* :func:`exp`, :func:`log` — argument reduction plus a fixed polynomial, accurate to a few units in the last place and
  identical on every machine (they are *not* the correctly rounded values, and need not be: what matters for inputs is
  that every machine gets the same numbers).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

__all__: list[str] = []  # private module: used by otb_spec.conformance and otb_spec.strategies

_LN2 = 0.6931471805599453                      # ln 2 rounded to float64
_LN2_HIGH = 0.693147180369123816490            # ln 2 to 32 bits: k·_LN2_HIGH is exact for |k| < 2²⁰
_LN2_LOW = 1.90821492927058770002e-10          # ln 2 − _LN2_HIGH
_INV_LN2 = 1.4426950408889634
_SQRT_HALF = 0.7071067811865476
_EXP_COEFFICIENTS = tuple(1.0 / math.factorial(n) for n in range(14))   # Taylor series of e^r, |r| ≤ ln2/2
_LOG_COEFFICIENTS = tuple(1.0 / (2 * j + 1) for j in range(12))         # atanh series: log f = 2s·Σ s²ʲ/(2j+1)


def exp(x: Any) -> np.ndarray:
    """e^x for float64 x with |x| < 700, within a few ulps, the same bits on every IEEE-754 machine.

    x = k·ln 2 + r with k = ⌊x/ln 2 + ½⌋ and |r| ≤ ln2/2 (r from the two-part ln 2, exact for |k| < 2²⁰); e^r from its
    Taylor polynomial of degree 13 (truncation < 4e-18 relative) by Horner's rule; e^x = 2ᵏ·e^r (exact scaling).

    >>> float(exp(0.0)), abs(float(exp(1.0)) - math.e) <= 2 * math.ulp(math.e)
    (1.0, True)
    """
    x = np.asarray(x, dtype=np.float64)
    if np.any(np.abs(x) >= 700.0):
        raise ValueError("x: |x| must be below 700 (portable exp covers the range of the generated inputs)")
    k = np.floor(np.add(np.multiply(x, _INV_LN2), 0.5))
    r = np.subtract(np.subtract(x, np.multiply(k, _LN2_HIGH)), np.multiply(k, _LN2_LOW))
    value = np.full(r.shape, _EXP_COEFFICIENTS[-1])
    for coefficient in reversed(_EXP_COEFFICIENTS[:-1]):
        value = np.add(np.multiply(value, r), coefficient)
    return np.ldexp(value, k.astype(np.int64))


def log(x: Any) -> np.ndarray:
    """ln x for finite float64 x > 0, within a few ulps, the same bits on every IEEE-754 machine.

    x = f·2ᵉ with f ∈ [√½, √2) (``frexp``, exact); s = (f − 1)/(f + 1), |s| ≤ 0.172; ln f = 2s·Σⱼ s²ʲ/(2j + 1) to
    j = 11 (truncation < 1e-19); ln x = e·ln 2 + ln f with the two-part ln 2.

    >>> float(log(1.0)), abs(float(log(2.0)) - math.log(2.0)) <= 2.0**-52
    (0.0, True)
    """
    x = np.asarray(x, dtype=np.float64)
    if not np.all(np.isfinite(x) & (x > 0)):
        raise ValueError("x: portable log needs finite positive numbers")
    fraction, exponent = np.frexp(x)                        # fraction ∈ [½, 1)
    low = fraction < _SQRT_HALF
    fraction = np.where(low, np.multiply(fraction, 2.0), fraction)   # exact: a power-of-two scaling
    exponent = np.where(low, exponent - 1, exponent).astype(np.float64)
    s = np.divide(np.subtract(fraction, 1.0), np.add(fraction, 1.0))
    s2 = np.multiply(s, s)
    series = np.full(s.shape, _LOG_COEFFICIENTS[-1])
    for coefficient in reversed(_LOG_COEFFICIENTS[:-1]):
        series = np.add(np.multiply(series, s2), coefficient)
    log_fraction = np.multiply(np.multiply(s, 2.0), series)
    return np.add(np.multiply(exponent, _LN2_HIGH), np.add(np.multiply(exponent, _LN2_LOW), log_fraction))


class PortableRandom:
    """Random draws built from PCG64's raw 64-bit outputs with exact or correctly rounded operations only.

    The same ``seed`` gives the same bits on every machine and NumPy version (PCG64's stream and ``SeedSequence`` are
    fixed; :meth:`numpy.random.Generator.uniform` and ``normal`` are compiled C whose arithmetic a compiler may fuse or
    whose ziggurat tail calls libm, so they are avoided).

    >>> PortableRandom(0).integers(0, 10, 5).tolist() == PortableRandom(0).integers(0, 10, 5).tolist()
    True
    """

    def __init__(self, seed: int):
        self._bits = np.random.PCG64(seed)

    def _raw(self, size: Any) -> np.ndarray:
        shape = (size,) if isinstance(size, (int, np.integer)) else tuple(size)
        count = int(np.prod(shape, dtype=np.int64))
        return self._bits.random_raw(count).reshape(shape)

    def random(self, size: Any) -> np.ndarray:
        """Uniform on [0, 1): the top 53 bits times 2⁻⁵³ (exact)."""
        return np.multiply((self._raw(size) >> np.uint64(11)).astype(np.float64), 2.0**-53)

    def uniform(self, low: float, high: float, size: Any) -> np.ndarray:
        """low + (high − low)·U, U uniform on [0, 1) — three correctly rounded operations."""
        return np.add(low, np.multiply(float(high) - float(low), self.random(size)))

    def integers(self, low: int, high: int, size: Any) -> np.ndarray:
        """Integers uniform on [low, high) (high − low < 2³¹): ⌊X·n / 2³²⌋ for the top 32 bits X — exact integer
        arithmetic (a bias below n/2³², irrelevant for test inputs)."""
        span = int(high) - int(low)
        if not 0 < span < 2**31:
            raise ValueError(f"high - low: expected 1 … 2**31 - 1, got {span}")
        top = self._raw(size) >> np.uint64(32)
        return (top * np.uint64(span) >> np.uint64(32)).astype(np.int64) + int(low)

    def normal(self, size: Any, *, scale: float = 1.0) -> np.ndarray:
        """Approximately normal draws with mean 0 and standard deviation ``scale``: the Irwin–Hall sum of 12 uniforms
        minus 6 (variance exactly 1, support [−6, 6]), summed left to right."""
        draws = self.random((12,) + ((size,) if isinstance(size, (int, np.integer)) else tuple(size)))
        total = draws[0]
        for term in draws[1:]:
            total = np.add(total, term)
        return np.multiply(np.subtract(total, 6.0), float(scale))

    def permutation(self, n: int) -> np.ndarray:
        """A uniformly random permutation of range(n): a stable argsort of raw 64-bit keys."""
        return np.argsort(self._raw(n), kind="stable")

    def choice(self, values: Any, size: Any) -> np.ndarray:
        """Draws with replacement from ``values`` (a 1-D sequence)."""
        values = np.asarray(values)
        return values[self.integers(0, len(values), size)]
