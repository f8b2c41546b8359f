"""How close correct Σπ² evaluations come to `sum_pi_squared_tolerance` (docs/tolerances.md, "Check").

For N deterministic rows (seed 0 … N−1: V ∈ {1, 2, 3, 7, 50, 64, 1024, 8192}, logits ordinary N(0, 4²), near ±1e4,
spread over ±1e4, nearly flat, or N(0, 30²)), every dtype (float16, bfloat16, float32, float64) and the four evaluations
of tests/test_tolerances.py, prints the largest |error| / allowed error seen, with the row that produced it. Values
below 1 mean the bound held everywhere.

    python benchmarks/sum_pi_squared_bound.py [N]          # default 600 rows (about a minute)
"""

from __future__ import annotations

import os
import sys

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))

from test_tolerances import _ALGORITHMS, _TORCH_DTYPES, _oracle  # noqa: E402

from otb_spec import _portable as portable  # noqa: E402
from otb_spec.conformance._cases import _round_to  # noqa: E402
from otb_spec.tolerances import output_rounding, sum_pi_squared_tolerance  # noqa: E402

_STYLES = {"ordinary": 4.0, "shifted": 5.0, "spread": 1.0, "flat": 0.3, "wide": 30.0}


def main(rows: int) -> None:
    worst: dict[tuple[str, str], tuple[float, int, str, int]] = {}
    for seed in range(rows):
        rng = portable.PortableRandom(seed)
        vocab = (1, 2, 3, 7, 50, 64, 1024, 8192)[seed % 8]
        style = list(_STYLES)[seed % len(_STYLES)]
        logits = rng.normal((2, vocab), scale=_STYLES[style])
        if style == "shifted":
            logits = logits + np.array([[1e4], [-1e4]])
        elif style == "spread":
            logits = rng.uniform(-1e4, 1e4, (2, vocab))
        for dtype, torch_dtype in _TORCH_DTYPES.items():
            given = _round_to(dtype, logits)
            exact = np.array([_oracle(row) for row in given.astype(np.float64)])
            tolerance = sum_pi_squared_tolerance(given, dtype=dtype) + output_rounding(dtype)
            allowed = tolerance.atol + np.asarray(tolerance.rtol) * np.abs(exact)
            accumulate = torch.float64 if dtype == "float64" else torch.float32
            for name, evaluate in _ALGORITHMS.items():
                z = torch.as_tensor(given).to(torch_dtype)
                got = evaluate(z, accumulate).to(torch_dtype).double().numpy()
                ratio = float(np.max(np.abs(got - exact) / allowed))
                if ratio > worst.get((dtype, name), (-1.0,))[0]:
                    worst[(dtype, name)] = (ratio, seed, style, vocab)
    print(f"largest |Σπ² − exact| / allowed over {rows} rows (sum_pi_squared_tolerance + output rounding)")
    print(f"{'dtype':<10} {'evaluation':<22} {'ratio':>7}  row (seed, style, V)")
    for (dtype, name), (ratio, seed, style, vocab) in sorted(worst.items()):
        print(f"{dtype:<10} {name:<22} {ratio:7.3f}  {seed}, {style}, {vocab}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 600)
