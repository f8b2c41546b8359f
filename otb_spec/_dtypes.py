"""Facts about floating dtypes that every tolerance starts from: ε, the smallest normal number, the input range slack.

A leaf module (it imports nothing from otb_spec), so that argument checking (``otb_spec._validation``) and the error
bounds (``otb_spec.tolerances``, where these numbers are documented and re-exported) can both use it without an import
cycle.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__: list[str] = []  # private module: the public names are re-exported by otb_spec.tolerances

EPSILON_BY_NAME = {
    "float64": 2.0**-52,
    "float32": 2.0**-23,
    "float16": 2.0**-10,
    "bfloat16": 2.0**-7,
    "float8_e4m3fn": 2.0**-3,
    "float8_e4m3fnuz": 2.0**-3,
    "float8_e5m2": 2.0**-2,
    "float8_e5m2fnuz": 2.0**-2,
}

# Smallest positive normal number: below it results may be subnormal or flushed to zero (compiled and GPU kernels often
# flush), so every operation can add an absolute error up to this much (the "η" term of the floating-point model).
SMALLEST_NORMAL_BY_NAME = {
    "float64": 2.0**-1022,
    "float32": 2.0**-126,
    "bfloat16": 2.0**-126,
    "float16": 2.0**-14,
}

# Slack for the range checks of inputs (log π ≤ 0, 0 ≤ Σπ² ≤ 1, Σπ² ≥ π²). It admits the rounding of a producer
# evaluating exp(lse(2z) − 2·lse(z)) in that precision at |z| ≤ 1e4 (float32: ulp(2e4) ≈ 2e-3 in each log-sum-exp),
# and still rejects swapped or mis-scaled arguments (π passed as log π, entropy passed as Σπ²), which are off by O(1).
RANGE_SLACK_BY_NAME = {
    "float64": 1e-9,
    "float32": 1e-2,
    "float16": 1e-2,
    "bfloat16": 3e-2,
}


def dtype_name(dtype: Any) -> str:
    """"float32" for np.float32, np.dtype("float32"), "float32", "torch.float32", torch.float32, jnp.float32, …"""
    if isinstance(dtype, str):
        return dtype.rsplit(".", 1)[-1]
    name = getattr(dtype, "name", None)  # np.dtype, or a torch/jax dtype exposing .name? (torch does not)
    if isinstance(name, str) and not isinstance(dtype, type):
        return name
    try:
        return np.dtype(dtype).name
    except TypeError:
        text = str(dtype)  # e.g. "torch.float32"
        return text.rsplit(".", 1)[-1]


def machine_epsilon(dtype: Any) -> float:
    """Machine epsilon ε (gap between 1 and the next representable number) of a floating dtype.

    Integer and boolean dtypes are exact inputs; they are computed in float64, so float64's ε is returned.

    >>> machine_epsilon(np.float32) == 2.0**-23
    True
    """
    name = dtype_name(dtype)
    if name in EPSILON_BY_NAME:
        return EPSILON_BY_NAME[name]
    if name.startswith(("int", "uint", "bool")):
        return EPSILON_BY_NAME["float64"]
    raise ValueError(f"dtype: no machine epsilon known for {name!r}")


def smallest_normal(dtype: Any) -> float:
    """The smallest positive normal number of a floating dtype (float64's for integer and unknown dtypes)."""
    return SMALLEST_NORMAL_BY_NAME.get(dtype_name(dtype), SMALLEST_NORMAL_BY_NAME["float64"])


def input_range_slack(dtype: Any) -> float:
    """How far outside its mathematical range an input of this dtype may be before it is rejected.

    ============  =======
    dtype         slack
    ============  =======
    float64       1e-9
    float32       1e-2
    float16       1e-2
    bfloat16      3e-2
    int, bool     0
    ============  =======
    """
    name = dtype_name(dtype)
    if name in RANGE_SLACK_BY_NAME:
        return RANGE_SLACK_BY_NAME[name]
    if name.startswith(("int", "uint", "bool")):
        return 0.0
    if name in EPSILON_BY_NAME:  # float8 formats: a quarter of the unit interval is all they resolve
        return 0.25
    raise ValueError(f"dtype: no input range slack known for {name!r}")
