"""otb_torch speed and memory, printed as figures and ratios.

    python benchmarks/bench_torch.py [--device cpu|cuda] [--groups 256] [--group-size 8] [--positions 4096]
                                     [--repeats 5] [--allocator both|as-is|warm] [--section all|otb|sum-pi-squared]

1. OTB (single-turn, verl semantics) at groups × group-size × positions: the vectorized drop-in (with and without the
   value checks, and with precomputed segments) against the per-group loop pattern (benchmarks/loop_otb_torch.py).
   Target (issue 4): ≥ 20× faster than the loop. On CUDA also against a device-to-device copy of the same bytes (the
   physical limit: reading the inputs once and writing the outputs once).
   On CPU the section runs twice, in fresh subprocesses, because the result depends on the C allocator: "as-is" (glibc's
   defaults: every large temporary is a fresh mmap whose pages fault in on first touch) and "warm" (glibc told to keep
   and reuse freed memory: MALLOC_MMAP_THRESHOLD_/MALLOC_TRIM_THRESHOLD_, as in a long-running process that recycles its
   heap). Each regime prints the memory floor — the fastest any implementation returning fresh outputs can be — as an
   upper bound on the achievable ratio.
2. Σπ² at [1, 4096, 32768] float32 logits: the extra peak memory (beyond the logits) of the plain formula
   exp(logsumexp(2z) − 2·logsumexp(z)) and of otb_torch.sum_pi_squared, as a multiple of the logits' size (target
   ≤ 0.25×), and their times (target: no slower). CPU memory: the resident set of a fresh subprocess, sampled every
   0.5 ms during the call, minus its value once the logits exist; CUDA memory: torch.cuda.max_memory_allocated.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import otb_torch  # noqa: E402
from loop_otb_torch import loop_optimal_token_baseline  # noqa: E402


def batch(groups: int, group_size: int, positions: int, device: str, seed: int = 0):
    rng = np.random.default_rng(seed)
    rows = groups * group_size
    lengths = rng.integers(positions // 8, positions + 1, size=rows)
    mask = (np.arange(positions)[None, :] < lengths[:, None]).astype(np.float32)
    pi = rng.beta(5.0, 1.0, size=(rows, positions))
    spp = pi**2 + (1 - pi) ** 2 * rng.uniform(0.01, 1.0, size=(rows, positions))
    rewards = np.zeros((rows, positions), dtype=np.float32)
    rewards[np.arange(rows), lengths - 1] = rng.integers(0, 2, size=rows)
    ids = np.array([f"uid-{g}" for g in range(groups) for _ in range(group_size)], dtype=object)
    to = lambda a: torch.as_tensor(np.asarray(a, dtype=np.float32), device=device)  # noqa: E731
    return to(rewards), to(mask), ids, to(np.log(pi)), to(spp)


def timed(function, repeats: int, device: str) -> float:
    function()                                                    # warm-up
    if device == "cuda":
        torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def bench_otb(args) -> None:
    rewards, mask, ids, log_probs, spp = batch(args.groups, args.group_size, args.positions, args.device)
    segments = otb_torch.segments_from_index(ids, args.device)
    cases = {
        "loop (per-group pattern)": lambda: loop_optimal_token_baseline(rewards, mask, ids, log_probs, spp),
        "otb_torch drop-in": lambda: otb_torch.compute_optimal_token_baseline_advantage(
            rewards, mask, ids, log_probs, spp),
        "otb_torch, segments, no checks": lambda: otb_torch.compute_optimal_token_baseline_advantage(
            rewards, mask, segments, log_probs, spp, check_values=False),
        "otb_torch, segments, no checks, compile": lambda: otb_torch.compute_optimal_token_baseline_advantage(
            rewards, mask, segments, log_probs, spp, check_values=False, compile=True),
    }
    print(f"OTB single-turn, {args.groups} groups × {args.group_size} × {args.positions} tokens, float32, "
          f"{args.device}")
    times = {name: timed(function, args.repeats, args.device) for name, function in cases.items()}
    loop = times["loop (per-group pattern)"]
    for name, seconds in times.items():
        print(f"  {name:42s} {seconds * 1e3:9.2f} ms   {loop / seconds:6.1f}× vs loop")
    def loop_full_batch_work():
        """The loop's own batch-wide elementwise passes (no per-group work): what no rewrite of the loop removes."""
        returns = (rewards * mask).flip(dims=[-1]).cumsum(dim=-1).flip(dims=[-1])
        energy = ((1 - 2 * torch.exp(log_probs) + spp) * mask).cumsum(dim=-1)
        return (returns - energy) * mask

    n = rewards.numel()
    floor_in = torch.rand(4 * n, dtype=torch.float32, device=args.device)       # touched, initialised memory
    floor_out = torch.empty(2 * n, dtype=torch.float32, device=args.device)
    context = {
        "the loop's batch-wide passes alone": timed(loop_full_batch_work, args.repeats, args.device),
        "memory floor (read 4 inputs, write 2 outputs)": timed(
            lambda: torch.add(floor_in[:2 * n], floor_in[2 * n:], out=floor_out), args.repeats, args.device),
        "memory floor, outputs freshly allocated": timed(
            lambda: (torch.add(floor_in[:n], floor_in[n:2 * n]), torch.add(floor_in[2 * n:3 * n], floor_in[3 * n:])),
            args.repeats, args.device),
    }
    for name, seconds in context.items():
        print(f"  {name:42s} {seconds * 1e3:9.2f} ms   ({loop / seconds:4.1f}× vs loop: an upper bound)")
    if args.device == "cuda":
        moved = sum(t.numel() * t.element_size() for t in (rewards, mask, log_probs, spp)) + 2 * rewards.numel() * 4
        source = torch.empty(moved // 4, dtype=torch.float32, device="cuda")
        target = torch.empty_like(source)
        copy = timed(lambda: target.copy_(source), args.repeats, "cuda")
        best = min(times["otb_torch, segments, no checks"], times["otb_torch, segments, no checks, compile"])
        print(f"  device-to-device copy of the same {moved / 2**20:.0f} MiB: {copy * 1e3:.2f} ms; OTB takes "
              f"{best / copy:.1f}× the copy")


_MEMORY_CHILD = r"""
import json, os, sys, threading, time, torch
sys.path.insert(0, sys.argv[3])
import otb_torch
method, device = sys.argv[1], sys.argv[2]
torch.manual_seed(0)
logits = torch.empty(1, 4096, 32768, dtype=torch.float32, device=device).normal_(0.0, 4.0)
def plain():
    return torch.exp(torch.logsumexp(2 * logits, -1) - 2 * torch.logsumexp(logits, -1))
function = plain if method == "plain" else (lambda: otb_torch.sum_pi_squared(logits, check_values=False))
page = os.sysconf("SC_PAGE_SIZE")
def resident():
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * page
def measure():
    if device == "cuda":
        torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats(); base = torch.cuda.memory_allocated()
        function(); torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base
    base, peak, running = resident(), [0], [True]
    def sample():
        while running[0]:
            peak[0] = max(peak[0], resident()); time.sleep(0.0005)
    sampler = threading.Thread(target=sample); sampler.start()
    function()
    running[0] = False; sampler.join()
    return max(peak[0], resident()) - base
extra = measure()
times = []
for _ in range(3):
    start = time.perf_counter(); function()
    if device == "cuda": torch.cuda.synchronize()
    times.append(time.perf_counter() - start)
print(json.dumps({"extra": extra, "size": logits.numel() * 4, "seconds": sorted(times)[1]}))
"""


def bench_sum_pi_squared(args) -> None:
    print("Σπ² of [1, 4096, 32768] float32 logits (512 MiB), " + args.device)
    adapters = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "adapters")
    results = {}
    for method in ("plain", "otb_torch"):
        output = subprocess.run([sys.executable, "-c", _MEMORY_CHILD, method, args.device, adapters], check=True,
                                capture_output=True, text=True).stdout
        results[method] = json.loads(output.strip().splitlines()[-1])
    for method, result in results.items():
        print(f"  {method:10s} extra peak memory {result['extra'] / result['size']:5.2f}× the logits   time "
              f"{result['seconds'] * 1e3:8.1f} ms")
    print(f"  memory ratio {results['otb_torch']['extra'] / max(results['plain']['extra'], 1):.3f}; time ratio "
          f"{results['otb_torch']['seconds'] / results['plain']['seconds']:.2f} (≤ 1 means no slower)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--groups", type=int, default=256)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--positions", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--allocator", default="both", choices=["both", "as-is", "warm"],
                        help="CPU: run the OTB section with glibc's defaults, with a warm (reusing) heap, or both")
    parser.add_argument("--section", default="all", choices=["all", "otb", "sum-pi-squared"])
    args = parser.parse_args()
    if args.section != "otb":
        print(f"torch {torch.__version__}, python {platform.python_version()}, {torch.get_num_threads()} threads"
              + (f", {torch.cuda.get_device_name()}" if args.device == "cuda" else ""))
    if args.section in ("all", "otb"):
        if args.device == "cpu" and args.section == "all":
            for regime in (("as-is", "warm") if args.allocator == "both" else (args.allocator,)):
                otb_in_subprocess(args, regime)
        else:
            bench_otb(args)
    if args.section in ("all", "sum-pi-squared"):
        bench_sum_pi_squared(args)


_WARM_HEAP = {"MALLOC_MMAP_THRESHOLD_": str(2**62), "MALLOC_TRIM_THRESHOLD_": str(2**62)}


def otb_in_subprocess(args, regime: str) -> None:
    """The OTB section in a fresh process whose C allocator runs as-is or with a warm heap (see the docstring)."""
    environment = dict(os.environ)
    for name in _WARM_HEAP:
        environment.pop(name, None)
    if regime == "warm":
        environment.update(_WARM_HEAP)
    print(f"[allocator: {regime}]", flush=True)
    subprocess.run([sys.executable, os.path.abspath(__file__), "--section", "otb", "--device", args.device,
                    "--groups", str(args.groups), "--group-size", str(args.group_size),
                    "--positions", str(args.positions), "--repeats", str(args.repeats)], check=True, env=environment)


if __name__ == "__main__":
    main()
