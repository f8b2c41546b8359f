"""How large is the float32 forward error bound of OTB advantages (otb_tolerance) on trainer-like batches?

    python benchmarks/tolerance_scale.py

For groups of 8 with terminal rewards in {0, 1}, prints the median, 99th percentile and maximum of the per-element
bound at valid tokens, its maximum over the first 64 positions and over the rest (a long row's first tokens carry the
row's summation bound against a small realized energy, docs/tolerances.md item 2), and the share of valid tokens that
are checked (finite bound), for several lengths T.
"""

from __future__ import annotations

import argparse

import numpy as np

from bench_reference import make_batch
from otb_spec.tolerances import otb_tolerance


def main() -> None:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                            formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    print(f"{'T':>6s} {'median':>10s} {'p99':>10s} {'max':>10s} {'max t<64':>10s} {'max t≥64':>10s} {'checked':>8s}"
          "   float32 bound on |ΔA|, groups of 8")
    for positions in (64, 512, 4096):
        batch = make_batch(256, positions, 8)
        bound, _ = otb_tolerance(batch["rewards"], batch["response_mask"], batch["group_ids"], batch["log_probs"],
                                 batch["sum_pi_squared"], is_weights=batch["is_weights"], dtype=np.float32)
        atol = np.asarray(bound.atol)
        valid = batch["response_mask"] > 0
        finite = valid & np.isfinite(atol)
        values = atol[finite]
        early, late = (atol[:, span][finite[:, span]] for span in (slice(0, 64), slice(64, None)))
        late_max = f"{late.max():10.2e}" if late.size else f"{'—':>10s}"
        print(f"{positions:6d} {np.median(values):10.2e} {np.percentile(values, 99):10.2e} {values.max():10.2e} "
              f"{early.max():10.2e} {late_max} {finite.sum() / valid.sum():8.3f}")


if __name__ == "__main__":
    main()
