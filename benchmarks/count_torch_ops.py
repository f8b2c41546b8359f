"""How many torch ops one eager call issues, per layout: the launch count behind the CUDA times of unequal groups.

    python benchmarks/count_torch_ops.py [--sizes 64x8x1024,256x8x4096] [--memory]

On CUDA the drop-in runs the eager kernel; on the CPU the same kernel cuts the plan's runs of equal-size groups into
cache-sized blocks. This script runs the CPU's eager kernel (``OTB_TORCH_NATIVE=0``) blocked two ways on the
benchmark's batches (benchmarks/bench_torch.py) and counts the top-level ``aten::`` ops of one call of
``otb_torch.optimal_token_baseline`` and ``leave_one_out_token_baseline`` (hot path: planned segments, no value
checks) with ``torch.profiler``; each op is at least one kernel launch on a GPU:

* *one block per size* — each run of equal-size groups one block: how CUDA ran a plan until groups of several sizes
  became one block (every op once per distinct size);
* *as on an accelerator* — ``otb_torch._otb.blocks_as_on_accelerators``, what CUDA runs now: one block per run where
  the groups have one size, and one block of all rows in the plan's order, group sums over consecutive rows
  (``torch.segment_reduce``), where they have several.

``--memory`` adds what each blocking costs in memory at the last size: the extra peak beyond inputs and outputs, in
input arrays ([B, T] float32), of one call in a fresh process whose allocator maps every block of 64 KiB or more
afresh (the resident set's high-water mark, reset through /proc/self/clear_refs just before the call; Linux).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

os.environ["OTB_TORCH_NATIVE"] = "0"
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

import otb_torch  # noqa: E402
from bench_torch import batch  # noqa: E402


def _ops(call) -> int:
    call()
    with profile(activities=[ProfilerActivity.CPU]) as trace:
        call()
    return sum(1 for event in trace.events() if event.name.startswith("aten::") and event.cpu_parent is None)


_MEMORY_CHILD = r"""
import json, sys
from contextlib import nullcontext
sys.path.insert(0, sys.argv[1])
import torch, otb_torch
from bench_torch import batch
from bench_distributed import _peak, _reset_peak
blocking, layout, name, size = sys.argv[2:6]
groups, group_size, positions = (int(value) for value in size.split("x"))
rewards, mask, index, log_probs, spp = batch(groups, group_size, positions, layout, "cpu")
segments = otb_torch.segments_from_index(index, "cpu")
function = getattr(otb_torch, name)
if blocking == "one block per size":
    otb_torch._otb._BLOCK_ELEMENTS = 2**62
with otb_torch._otb.blocks_as_on_accelerators() if blocking == "as on an accelerator" else nullcontext():
    function(rewards[:16], mask[:16], otb_torch.segments_from_index(index[:16], "cpu"), log_probs[:16], spp[:16])
    base = _reset_peak()                  # the resident set's high-water mark, restarted here (bench_distributed)
    outputs = function(rewards, mask, segments, log_probs, spp, check_values=False)
    extra = _peak() - base - sum(value.numel() * value.element_size() for value in outputs if value is not None)
print(json.dumps(extra / (rewards.numel() * 4)))
"""


def _memory(size: str) -> None:
    """Extra peak memory of each blocking, in input arrays, each call in a fresh process (see the module's doc)."""
    environment = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="65536",
                       OTB_TORCH_NATIVE="0", OMP_NUM_THREADS="1")
    here = os.path.dirname(os.path.abspath(__file__))
    print(f"\n### Extra peak memory beyond inputs and outputs, {size.replace('x', '×')}, in input arrays\n")
    print("| layout | function | one block per size | as on an accelerator |\n|---|---|---|---|")
    for layout in ("scattered", "scattered, unequal"):
        for name in ("optimal_token_baseline", "leave_one_out_token_baseline"):
            cells = []
            for blocking in ("one block per size", "as on an accelerator"):
                output = subprocess.run([sys.executable, "-c", _MEMORY_CHILD, here, blocking, layout, name, size],
                                        check=True, capture_output=True, text=True, env=environment).stdout
                cells.append(f"{json.loads(output.strip().splitlines()[-1]):.2f}")
            print(f"| {layout} | {name} | {cells[0]} | {cells[1]} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="64x8x1024,256x8x4096", help="comma-separated GROUPSxSIZExPOSITIONS")
    parser.add_argument("--memory", action="store_true", help="also each blocking's extra peak memory (last size)")
    args = parser.parse_args()
    print("| size | layout | distinct group sizes | function | one block per size | as on an accelerator |\n"
          "|---|---|---|---|---|---|")
    for size in args.sizes.split(","):
        groups, group_size, positions = (int(value) for value in size.split("x"))
        for layout in ("contiguous", "scattered", "scattered, unequal"):
            rewards, mask, index, log_probs, spp = batch(groups, group_size, positions, layout, "cpu")
            segments = otb_torch.segments_from_index(index, "cpu")
            runs = len(segments.runs) if segments.runs else 1
            for name in ("optimal_token_baseline", "leave_one_out_token_baseline"):
                function = getattr(otb_torch, name)

                def call():
                    return function(rewards, mask, segments, log_probs, spp, check_values=False)

                default = otb_torch._otb._BLOCK_ELEMENTS
                otb_torch._otb._BLOCK_ELEMENTS = 2**62      # one block per run, none cut to the cache's size
                try:
                    per_size = _ops(call)
                finally:
                    otb_torch._otb._BLOCK_ELEMENTS = default
                with otb_torch._otb.blocks_as_on_accelerators():
                    accelerator = _ops(call)
                print(f"| {size} | {layout} | {runs} | {name} | {per_size} | {accelerator} |", flush=True)
    if args.memory:
        _memory(args.sizes.split(",")[-1])


if __name__ == "__main__":
    main()
