"""Precision of two float32 evaluations of Σπ² against the float64 reference, as the logit magnitude grows.

    python benchmarks/sum_pi_squared_precision.py [--rows 4096] [--vocab 512]

* "lse form": exp(lse(2z) − 2·lse(z)) with each log-sum-exp max-shifted, all in float32 — verl's formula;
* "ratio form": S₂/S₁² with a = exp(z − max z), S₁ = Σa, S₂ = Σa², all in float32 — the reference's formula.

Prints the maximum relative error of each over ``rows`` random rows whose logits are N(0, 3²) shifted by ±|z|.
"""

from __future__ import annotations

import argparse

import numpy as np

import otb_spec as otb


def lse_form(z: np.ndarray) -> np.ndarray:
    def lse(x: np.ndarray) -> np.ndarray:
        m = x.max(axis=-1, keepdims=True)
        return (m + np.log(np.exp(x - m).sum(axis=-1, keepdims=True, dtype=np.float32)))[..., 0]
    return np.exp(lse(2 * z) - 2 * lse(z))


def ratio_form(z: np.ndarray) -> np.ndarray:
    a = np.exp(z - z.max(axis=-1, keepdims=True))
    return (a * a).sum(axis=-1, dtype=np.float32) / np.square(a.sum(axis=-1, dtype=np.float32))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=512)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    print(f"{'|z| shift':>10s} {'lse form (verl)':>16s} {'ratio form':>11s}   max relative error in float32")
    for shift in (1.0, 30.0, 300.0, 1e4):
        z = (rng.normal(scale=3.0, size=(args.rows, args.vocab))
             + shift * rng.choice([-1.0, 1.0], size=(args.rows, 1))).astype(np.float32)
        reference = otb.sum_pi_squared(z)
        errors = [np.max(np.abs(form(z).astype(np.float64) - reference) / reference) for form in (lse_form, ratio_form)]
        print(f"{shift:10.0f} {errors[0]:16.2e} {errors[1]:11.2e}")


if __name__ == "__main__":
    main()
