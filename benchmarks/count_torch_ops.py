"""How many torch ops one eager call issues, per layout: the launch count behind the CUDA times of unequal groups.

    python benchmarks/count_torch_ops.py [--sizes 64x8x1024,256x8x4096]

On CUDA the drop-in runs the eager kernel with one block per run of equal-size groups (the segments' plan); on the
CPU the same kernel cuts runs into cache-sized blocks. This script runs the CPU's eager kernel (``OTB_TORCH_NATIVE=0``)
with one block per run, as CUDA does, on the benchmark's batches (benchmarks/bench_torch.py), and counts the top-level
``aten::`` ops of one call of ``otb_torch.optimal_token_baseline`` (hot path: planned segments, no value checks) with
``torch.profiler``. Each op is at least one kernel launch on a GPU.
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ["OTB_TORCH_NATIVE"] = "0"
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

import otb_torch  # noqa: E402
from bench_torch import batch  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="64x8x1024,256x8x4096", help="comma-separated GROUPSxSIZExPOSITIONS")
    args = parser.parse_args()
    otb_torch._otb._BLOCK_ELEMENTS = 2**62          # one block per run of equal sizes, as on CUDA
    print("| size | layout | distinct group sizes | top-level torch ops per call |\n|---|---|---|---|")
    for size in args.sizes.split(","):
        groups, group_size, positions = (int(value) for value in size.split("x"))
        for layout in ("contiguous", "scattered", "scattered, unequal"):
            rewards, mask, index, log_probs, spp = batch(groups, group_size, positions, layout, "cpu")
            segments = otb_torch.segments_from_index(index, "cpu")
            otb_torch.optimal_token_baseline(rewards, mask, segments, log_probs, spp, check_values=False)
            with profile(activities=[ProfilerActivity.CPU]) as trace:
                otb_torch.optimal_token_baseline(rewards, mask, segments, log_probs, spp, check_values=False)
            ops = [event for event in trace.events() if event.name.startswith("aten::") and event.cpu_parent is None]
            runs = len(segments.runs) if segments.runs else 1
            print(f"| {size} | {layout} | {runs} | {len(ops)} |", flush=True)


if __name__ == "__main__":
    main()
