"""otb_torch against verl 0.9.1 itself, in the layouts trainers produce: figures, ratios and floors as a table.

    python benchmarks/bench_torch.py [--device cpu|cuda] [--sizes 64x8x1024,256x8x4096,512x16x8192] [--repeats 3]
                                     [--section all|otb|tir|sum-pi-squared|memory] [--allocator as-is|warm|both]
                                     [--threads 2,1] [--clock wall|cpu] [--against verl|loop] [--compile]
                                     [--kernel auto|eager]

Inputs are what a verl trainer hands the advantage function: float32 [B, T] tensors, ``index`` a NumPy object array of
string uids, right-padded masks of random lengths (T/8 … T), consistent token statistics (Σπ² = π² + (1 − π)²u), a 0/1
reward on the last valid token. Three layouts of the same groups:

* ``contiguous`` — each group's samples next to each other (what rollout produces);
* ``scattered`` — a random permutation of the rows: what ``trainer.balance_batch=True`` (verl's default) leaves;
* ``scattered, unequal`` — also unequal group sizes 1 … 2N−1 (dynamic sampling keeps a variable number per prompt).

Each row times, in the same process on the same inputs, in interleaved rounds (best of ``--repeats``, wall clock):
verl's own function (``compute_optimal_token_baseline_advantage`` / ``compute_multi_turn_…``; with ``--against loop``
or without verl installed, the loop transcriptions in benchmarks/loop_*.py), the otb_torch drop-in (value checks on,
``index`` as verl passes it), the hot path (precomputed ``Segments``, ``check_values=False``) and the memory floor
(read the four inputs, write the two outputs into freshly allocated tensors — no arithmetic; the same bytes in every
layout, so the floor is the same; on CPU the outputs' pages mapped in bulk first, as the native drop-ins map
theirs), and otb_torch.verl's leave-one-out drop-in (value checks on) and hot path, with their ratio to the
self-inclusive ones (issue 25: at most 1.2×). TIR-OTB rows use masks with tool-output holes.
The targets also print two parts of a drop-in call timed alone (CPU, native kernel): planning verl's uids into
groups, and the kernel's exponential over the valid spans — with the memory floor, what a call cannot avoid. Context
lines give the eager floor: the passes no eager-mode implementation avoids (two scans and one exp over the batch;
for TIR also the compaction: a scan of the mask, two scatters, one gather), on top of the memory floor. On CPU the
drop-ins run otb_torch's native kernel where it builds (the header says which kernel ran); ``--kernel eager`` times
the eager kernel instead.

Σπ² at [1, 4096, 32768] float32 (and [1, 1024, 32768], to show the extra memory does not grow with the batch): verl's
``calculate_sum_pi_squared_from_logits`` (or the plain formula) against the otb_torch drop-in, each in a fresh
subprocess: time, and extra peak memory beyond the logits (CPU: the peak resident set VmHWM, reset just before the
call through /proc/self/clear_refs; CUDA: ``torch.cuda.max_memory_allocated``).

Extra peak memory (``--section memory``, part of ``all`` on CPU): each advantage function at the first size, scattered,
in a fresh process whose allocator maps every block of 64 KiB or more afresh — the high-water mark of the resident set
during the call, less the inputs and outputs.

``--threads 2,1`` runs everything once per thread count (each in a fresh process; default: torch's own count).
``--clock cpu`` (with ``--threads 1``) times the calling thread's CPU time instead of the wall clock: on a machine
shared with other work it is inflated only through shared caches and memory, not by descheduling.

CPU allocator regimes (``--allocator``): ``as-is`` is glibc's default (every large temporary a fresh mmap whose pages
fault in on first touch) — the regime of the targets; ``warm`` tells glibc to keep freed memory (as a long-running
process whose heap has settled). Each runs in a fresh subprocess.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import resource
import subprocess
import sys
import time

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import otb_torch  # noqa: E402

try:
    from verl.trainer.ppo import core_algos as verl_algos
    from verl.utils import torch_functional as verl_functional
except ImportError:                                         # the 'verl' test extra is not installed
    verl_algos = verl_functional = None

LAYOUTS = ("contiguous", "scattered", "scattered, unequal")
TARGET_SIZE = (256, 8, 4096)


def batch(groups: int, group_size: int, positions: int, layout: str, device: str, *, holes: bool = False,
          seed: int = 0):
    """(rewards, mask, index, log_probs, sum_pi_squared) as a verl trainer passes them (see the module docstring)."""
    rng = np.random.default_rng(seed)
    if layout == "scattered, unequal":
        sizes = rng.integers(1, 2 * group_size, size=2 * groups)
        sizes = sizes[:int(np.searchsorted(np.cumsum(sizes), groups * group_size)) + 1]
    else:
        sizes = np.full(groups, group_size)
    rows = int(sizes.sum())
    uids = np.array([f"{seed:08x}-{group:04x}-4f1c-9a7e-uid" for group, size in enumerate(sizes) for _ in range(size)],
                    dtype=object)
    lengths = rng.integers(positions // 8, positions + 1, size=rows)
    mask = np.arange(positions)[None, :] < lengths[:, None]
    if holes:                                               # multi-turn: tool outputs masked out inside responses
        for row in range(rows):
            for _ in range(2):
                begin = rng.integers(0, max(1, lengths[row] - 1))
                mask[row, begin:begin + rng.integers(1, max(2, lengths[row] // 8))] = False
            mask[row, lengths[row] - 1] = True
    pi = rng.beta(5.0, 1.0, size=(rows, positions)).astype(np.float32)
    spp = pi**2 + (1 - pi) ** 2 * rng.uniform(0.01, 1.0, size=(rows, positions)).astype(np.float32)
    rewards = np.zeros((rows, positions), dtype=np.float32)
    rewards[np.arange(rows), lengths - 1] = rng.integers(0, 2, size=rows)
    order = rng.permutation(rows) if layout != "contiguous" else np.arange(rows)
    to = lambda a: torch.as_tensor(np.ascontiguousarray(a[order], dtype=np.float32), device=device)  # noqa: E731
    return to(rewards), to(mask), uids[order], to(np.log(pi)), to(spp)


CLOCKS = {"wall": time.perf_counter, "cpu": time.thread_time}
CLOCK = "wall"


def rounds(cases: dict, repeats: int, device: str) -> dict[str, float]:
    """Best time of each case over ``repeats`` interleaved rounds (after one warm-up call each), so that load changes
    on a shared machine hit every case alike: wall clock, or (``--clock cpu``, one thread) the calling thread's CPU
    time — which a loaded machine inflates only through the caches and memory it shares, not by descheduling.
    Also records, in ``FAULTS``, the minor page faults of each case's best call: a drop-in's fresh outputs fault in
    page by page unless the allocator hands it reused memory, which depends on the calls before it — hence each round
    after the first runs the cases in another (seeded) order. ``MODES`` gets each case's mean user-mode and
    kernel-mode CPU time per call over the rounds (process-wide ``getrusage``; a mean, because the kernel splits a
    thread's time between the two modes by sampling)."""
    clock = CLOCKS[CLOCK]

    def once(function) -> tuple[float, int, float, float]:
        if device == "cuda":
            torch.cuda.synchronize()
        before = resource.getrusage(resource.RUSAGE_SELF)
        start = clock()
        function()
        if device == "cuda":
            torch.cuda.synchronize()
        seconds, after = clock() - start, resource.getrusage(resource.RUSAGE_SELF)
        return (seconds, after.ru_minflt - before.ru_minflt, after.ru_utime - before.ru_utime,
                after.ru_stime - before.ru_stime)

    for function in cases.values():
        once(function)
    FAULTS.clear()
    MODES.clear()
    best = {name: float("inf") for name in cases}
    modes = {name: [0.0, 0.0] for name in cases}
    names = list(cases)
    for round_ in range(repeats):
        if round_:                  # each round in another order (seeded): no case always follows the same one
            random.Random(round_).shuffle(names)
        for name in names:
            seconds, faults, user, system = once(cases[name])
            modes[name][0] += user / repeats
            modes[name][1] += system / repeats
            if seconds < best[name]:
                best[name], FAULTS[name] = seconds, faults
    MODES.update({name: (user, system) for name, (user, system) in modes.items()})
    return best


FAULTS: dict[str, int] = {}     # the minor page faults (process-wide) of each case's best call in the last rounds()
MODES: dict[str, tuple[float, float]] = {}  # each case's mean (user, kernel) CPU seconds per call in the last rounds()


def competitor(multi_turn: bool, against: str):
    if against == "verl" and verl_algos is not None:
        name = "compute_multi_turn_optimal_token_baseline_advantage" if multi_turn else \
            "compute_optimal_token_baseline_advantage"
        return f"verl {_verl_version()} ({name})", getattr(verl_algos, name)
    if multi_turn:
        from loop_multi_turn_otb_torch import loop_multi_turn_optimal_token_baseline
        return "loop transcription (verl not installed)", loop_multi_turn_optimal_token_baseline
    from loop_otb_torch import loop_optimal_token_baseline
    return "loop transcription (verl not installed)", loop_optimal_token_baseline


def _verl_version() -> str:
    try:
        from importlib.metadata import version
        return version("verl")
    except Exception:  # noqa: BLE001
        return "?"


def eager_floor(rewards, mask, log_probs, multi_turn: bool, repeats: int, device: str) -> float:
    """The passes every eager implementation makes on top of the memory floor: the two scans (returns, energy) and
    the exp of log π; for TIR also the compaction (a scan of the mask, two scatters into the token grid, one gather
    back). Outputs go into preallocated buffers, so this adds no page faults to the floor's."""
    buffers = [torch.empty_like(rewards) for _ in range(3)]
    column = torch.empty(rewards.shape, dtype=torch.int64, device=rewards.device)
    grid = torch.zeros((rewards.shape[0], rewards.shape[1] + 1), dtype=rewards.dtype, device=rewards.device)
    if multi_turn:
        column.copy_(torch.cumsum(mask, -1).sub_(1.0 + rewards.shape[1]).mul_(mask).add_(rewards.shape[1]))

    def passes():
        torch.cumsum(rewards, -1, out=buffers[0])
        torch.cumsum(log_probs, -1, out=buffers[1])
        torch.exp(log_probs, out=buffers[2])
        if multi_turn:
            torch.cumsum(mask, -1, out=buffers[2])
            grid.scatter_(1, column, buffers[0])
            grid.scatter_(1, column, buffers[1])
            torch.gather(grid, 1, column, out=buffers[2])

    return rounds({"passes": passes}, repeats, device)["passes"]


def leave_one_out_drop_in(multi_turn: bool):
    """otb_torch.verl's leave-one-out OTB with verl's signature (what install(variant="leave_one_out") routes to)."""
    import otb_torch.verl
    return otb_torch.verl.compute_multi_turn_leave_one_out_token_baseline_advantage if multi_turn else \
        otb_torch.verl.compute_leave_one_out_token_baseline_advantage


def unavoidable_parts(rewards, mask, index, log_probs, device: str) -> dict:
    """Two parts of a drop-in call besides the memory floor, each timed alone (CPU, native kernel): ``planning`` —
    verl's uids turned into groups (``segments_from_index``), which a drop-in called with verl's ``index`` cannot
    skip — and ``exp`` — the kernel's own exponential over every row's valid span (first to last valid token), from
    one preallocated buffer into another (no page faults)."""
    from otb_torch import _native

    library = _native._load()[0] if device == "cpu" else None
    if library is None:
        return {}
    valid = mask.numpy() != 0
    any_valid = valid.any(axis=1)
    first = valid.argmax(axis=1)
    last = valid.shape[1] - 1 - valid[:, ::-1].argmax(axis=1)
    count = int(np.where(any_valid, last - first + 1, 0).sum())
    source = log_probs.flatten()[:count].clone()
    target = torch.empty_like(source)

    def exp() -> None:              # the closure keeps both buffers alive while the kernel writes
        library.otb_expf_array(_native._pointer(source), _native._pointer(target), _native.ctypes.c_int64(count))

    return {"planning": lambda: otb_torch.segments_from_index(index), "exp": exp}


def memory_floor(rewards, mask, log_probs, spp) -> tuple:
    """Read the four inputs and write two outputs into fresh tensors, no arithmetic; on CPU the outputs' pages are
    mapped in bulk first, as the native drop-ins map theirs (``otb_torch._native.populate``), so that the floor is
    not above what a drop-in pays."""
    first, second = torch.empty_like(rewards), torch.empty_like(log_probs)
    if rewards.device.type == "cpu":
        from otb_torch import _native

        shares = _native._workers(rewards.numel())      # the drop-ins' thread shares map their parts so
        _native._in_parallel(lambda share: _native.populate([first, second], share, shares) or 0, shares)
    return torch.add(rewards, mask, out=first), torch.add(log_probs, spp, out=second)


def bench_advantages(args, multi_turn: bool) -> list[dict]:
    label, against = competitor(multi_turn, args.against)
    drop_in = otb_torch.compute_multi_turn_optimal_token_baseline_advantage if multi_turn else \
        otb_torch.compute_optimal_token_baseline_advantage
    unbiased = leave_one_out_drop_in(multi_turn)
    title = "TIR-OTB (multi-turn; masks with tool-output holes)" if multi_turn else "OTB (single-turn)"
    print(f"\n### {title}, float32, {args.device}, {torch.get_num_threads()} threads — vs {label}\n")
    print("| size | layout | competitor | drop-in | vs competitor | hot path | vs competitor | memory floor | "
          "drop-in / floor | eager floor | leave-one-out drop-in | ÷ drop-in | leave-one-out hot path | ÷ hot path |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    records = []
    for groups, size, positions in args.sizes:
        for layout in LAYOUTS:
            rewards, mask, index, log_probs, spp = batch(groups, size, positions, layout, args.device,
                                                         holes=multi_turn)
            segments = otb_torch.segments_from_index(index, args.device)
            cases = {
                "competitor": lambda: against(rewards, mask, index, log_probs, spp),
                "drop-in": lambda: drop_in(rewards, mask, index, log_probs, spp),
                "hot path": lambda: drop_in(rewards, mask, segments, log_probs, spp, check_values=False),
                "floor": lambda: memory_floor(rewards, mask, log_probs, spp),
                "leave-one-out": lambda: unbiased(rewards, mask, index, log_probs, spp),
                "leave-one-out hot path": lambda: unbiased(rewards, mask, segments, log_probs, spp,
                                                           check_values=False),
            }
            cases.update(unavoidable_parts(rewards, mask, index, log_probs, args.device))
            if args.compile:
                cases["hot path, compile=True"] = lambda: drop_in(rewards, mask, segments, log_probs, spp,
                                                                  check_values=False, compile=True)
            best = rounds(cases, args.repeats, args.device)
            faults, modes = dict(FAULTS), dict(MODES)
            eager = best["floor"] + eager_floor(rewards, mask, log_probs, multi_turn, args.repeats, args.device)
            mine, theirs = drop_in(rewards, mask, index, log_probs, spp), against(rewards, mask, index, log_probs, spp)
            difference = max(float((a - b).abs().max()) for a, b in zip(mine, theirs))
            record = {"size": f"{groups}×{size}×{positions}", "layout": layout, "rows": rewards.shape[0],
                      "difference": difference, "eager floor": eager, "threads": torch.get_num_threads(),
                      "faults": faults, "modes": modes, **best}
            records.append(record)
            ms = lambda seconds: f"{seconds * 1e3:.{0 if seconds >= 0.0095 else 2}f} ms"  # noqa: E731
            print(f"| {record['size']} | {layout} | {ms(best['competitor'])} | {ms(best['drop-in'])} | "
                  f"{best['competitor'] / best['drop-in']:.1f}× | {ms(best['hot path'])} | "
                  f"{best['competitor'] / best['hot path']:.1f}× | {ms(best['floor'])} | "
                  f"{best['drop-in'] / best['floor']:.1f}× | {ms(eager)} | {ms(best['leave-one-out'])} | "
                  f"{best['leave-one-out'] / best['drop-in']:.2f} | {ms(best['leave-one-out hot path'])} | "
                  f"{best['leave-one-out hot path'] / best['hot path']:.2f} |", flush=True)
            if args.compile:
                print(f"|  | … hot path, compile=True | | {ms(best['hot path, compile=True'])} | "
                      f"{best['competitor'] / best['hot path, compile=True']:.1f}× | | | | | | | | | |")
            del rewards, mask, log_probs, spp, segments, cases
    print(f"\nmax |drop-in − competitor| over each row's outputs: "
          + ", ".join(f"{r['difference']:.1e}" for r in records)
          + " (verl computes in float32 too; docs/verl-differences.md lists where the semantics differ)")
    return records


_KERNEL_MEMORY_CHILD = r"""
import json, sys, torch
sys.path.insert(0, sys.argv[1])
import bench_torch, otb_torch
function_name, multi_turn = sys.argv[2], sys.argv[3] == "1"
groups, size, positions = (int(x) for x in sys.argv[4].split("x"))
rewards, mask, index, log_probs, spp = bench_torch.batch(groups, size, positions, "scattered", "cpu", holes=multi_turn)
segments = otb_torch.segments_from_index(index)
if function_name == "verl":
    function = bench_torch.competitor(multi_turn, "verl")[1]
elif function_name == "leave-one-out":
    function = bench_torch.leave_one_out_drop_in(multi_turn)
else:
    function = otb_torch.compute_multi_turn_optimal_token_baseline_advantage if multi_turn else \
        otb_torch.compute_optimal_token_baseline_advantage
function(rewards[:16], mask[:16], index[:16], log_probs[:16], spp[:16])   # one-time set-up (threads, the library)
def peak():
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM"))
with open("/proc/self/clear_refs", "w") as clear:
    clear.write("5")
base = peak()
outputs = function(rewards, mask, index, log_probs, spp)
extra = peak() - base - sum(value.numel() * value.element_size() for value in outputs)
print(json.dumps({"extra": extra, "input": rewards.numel() * rewards.element_size()}))
"""


def bench_kernel_memory(args) -> dict:
    """Extra peak memory of each advantage function at the first size, scattered: the resident set's high-water mark
    during the call less its value before and less the outputs, in a fresh process whose C allocator maps every
    block of 64 KiB or more afresh (so that every temporary shows in the resident set, none reuses freed pages)."""
    size = "x".join(map(str, args.sizes[0]))
    print(f"\n### Extra peak memory beyond inputs and outputs, {size.replace('x', '×')}, scattered, "
          f"{torch.get_num_threads()} threads\n")
    environment = dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(65536), MALLOC_TRIM_THRESHOLD_=str(65536))
    rows, results = [], {}
    for multi_turn in (False, True):
        for name, kernel in (("verl", "auto"), ("self-inclusive drop-in", "auto"), ("leave-one-out", "auto"),
                             ("leave-one-out", "eager")):
            if name == "verl" and verl_algos is None:
                continue
            child = dict(environment, **({"OTB_TORCH_NATIVE": "0"} if kernel == "eager" else {}))
            output = subprocess.run([sys.executable, "-c", _KERNEL_MEMORY_CHILD, HERE, name, str(int(multi_turn)),
                                     size], check=True, capture_output=True, text=True, env=child).stdout
            record = json.loads(output.strip().splitlines()[-1])
            label = f"{'TIR-OTB' if multi_turn else 'OTB'} {name}" + (" (eager kernel)" if kernel == "eager" else "")
            results[label] = record
            rows.append(f"| {label} | {record['extra'] / 2**20:.2f} MiB | {record['extra'] / record['input']:.3f}× |")
    unit = next(iter(results.values()))["input"] / 2**20 if results else 0
    print("| function | extra peak memory | ÷ one input array |\n|---|---|---|")
    print("\n".join(rows))
    print(f"\n(one input array: {unit:.1f} MiB; the native kernel's own buffers are 8·T values per thread and the B "
          "row lengths — its leave-one-out keeps m·W in the advantages' buffer until it overwrites it)")
    return results


_MEMORY_CHILD = r"""
import json, sys, time, torch
sys.path.insert(0, sys.argv[4])
import otb_torch
method, device, positions = sys.argv[1], sys.argv[2], int(sys.argv[3])
try:
    from verl.utils.torch_functional import calculate_sum_pi_squared_from_logits as verl_formula
except ImportError:
    verl_formula = lambda z: torch.exp(torch.logsumexp(2 * z, -1) - 2 * torch.logsumexp(z, -1))
torch.manual_seed(0)
logits = torch.empty(1, positions, 32768, dtype=torch.float32, device=device).normal_(0.0, 4.0)
function = verl_formula if method == "verl" else otb_torch.calculate_sum_pi_squared_from_logits
function(torch.zeros(1, 2, 64, device=device))  # one-time library set-up (thread pools, BLAS) is not the method's
def peak():
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM"))
if device == "cuda":
    torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats(); base = torch.cuda.memory_allocated()
    function(logits); torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
else:
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")              # the high-water mark restarts at the current resident set (Linux ≥ 4.0)
    base = peak()
    function(logits)
    extra = peak() - base
times = []
for _ in range(int(sys.argv[5])):
    if device == "cuda": torch.cuda.synchronize()
    start = time.perf_counter(); function(logits)
    if device == "cuda": torch.cuda.synchronize()
    times.append(time.perf_counter() - start)
print(json.dumps({"extra": extra, "size": logits.numel() * 4, "seconds": min(times)}))
"""


def bench_sum_pi_squared(args) -> dict:
    label = "verl calculate_sum_pi_squared_from_logits" if verl_functional is not None and args.against == "verl" \
        else "plain exp(lse(2z) − 2·lse(z))"
    print(f"\n### Σπ² from float32 logits [1, T, 32768], {args.device}, {torch.get_num_threads()} threads — "
          f"vs {label}\n")
    print("| T | logits | competitor: time | extra peak memory | otb_torch drop-in: time | extra peak memory | "
          "speed-up |")
    print("|---|---|---|---|---|---|---|")
    adapters = os.path.join(os.path.dirname(HERE), "adapters")
    results = {}
    for positions in (1024, 4096):
        row = {}
        for method in ("verl", "otb_torch"):
            output = subprocess.run([sys.executable, "-c", _MEMORY_CHILD, method, args.device, str(positions), adapters,
                                     str(args.repeats)], check=True, capture_output=True, text=True).stdout
            row[method] = json.loads(output.strip().splitlines()[-1])
        results[positions] = row
        size = row["verl"]["size"]
        cell = lambda r: (f"{r['seconds'] * 1e3:.0f} ms | {r['extra'] / 2**20:.1f} MiB "  # noqa: E731
                          f"({r['extra'] / size:.3f}×)")
        print(f"| {positions} | {size / 2**20:.0f} MiB | {cell(row['verl'])} | {cell(row['otb_torch'])} | "
              f"{row['verl']['seconds'] / row['otb_torch']['seconds']:.1f}× |", flush=True)
    return results


def _parts(record: dict) -> str:
    """The memory floor, the planning and the exponential, each timed alone, and their sum against the competitor."""
    if "exp" not in record:
        return ""
    parts = record["floor"] + record["planning"] + record["exp"]
    return (f"; memory floor {record['floor'] * 1e3:.1f} ms + planning the uids {record['planning'] * 1e3:.1f} ms "
            f"+ the exponential over the valid spans {record['exp'] * 1e3:.1f} ms (each timed alone) = "
            f"{parts * 1e3:.1f} ms, {record['competitor'] / parts:.1f}× faster than the competitor")


def _modes(record: dict) -> str:
    """One thread on CPU: where a drop-in call's time goes — user mode (the kernel's arithmetic and memory traffic,
    planning, Python) and kernel mode (mostly the page faults of its fresh outputs), beside the memory floor's — and
    how much user-mode time 10× leaves once the kernel-mode time is paid."""
    modes = record.get("modes", {})
    if record["threads"] != 1 or "drop-in" not in modes or "floor" not in modes:
        return ""
    (user, system), (floor_user, floor_system) = modes["drop-in"], modes["floor"]
    faults = record["faults"]
    budget = record["competitor"] / 10 - system
    left = (f"10× leaves {budget * 1e3:.1f} ms for its user-mode work, which takes {user * 1e3:.1f} ms "
            f"({user / budget:.2f}× that" if budget > 0 else
            f"10× is out of reach: the kernel-mode time alone exceeds a tenth of the competitor's "
            f"({user * 1e3:.1f} ms of user-mode work besides")
    return (f"; CPU time per call (means over the rounds): drop-in {user * 1e3:.1f} ms user + "
            f"{system * 1e3:.1f} ms kernel mode, memory floor {floor_user * 1e3:.1f} + {floor_system * 1e3:.1f} ms "
            f"({faults.get('drop-in', 0)} and {faults.get('floor', 0)} page faults in the best calls); after the "
            f"drop-in's kernel-mode time, {left}; the floor's own reading and writing: {floor_user * 1e3:.1f} ms)")


def verdict(otb: list[dict], tir: list[dict], spp: dict) -> None:
    """The targets at 256×8×4096 (glibc's default allocator), each met or not, with the floor that bounds it: issue
    12's (OTB, Σπ²) and issue 25's (leave-one-out ≤ 1.2× the self-inclusive kernel, TIR-OTB ≥ 10× verl)."""
    size = "×".join(map(str, TARGET_SIZE))
    print(f"\n### Targets at {size}, {torch.get_num_threads()} threads\n")
    for record in otb:
        if record["size"] != size:
            continue
        layout, best = record["layout"], record
        drop_in, hot = best["competitor"] / best["drop-in"], best["competitor"] / best["hot path"]
        bound = best["competitor"] / best["eager floor"]
        print(f"* OTB {layout}: drop-in {drop_in:.1f}× (target ≥ 3×: {'met' if drop_in >= 3 else 'NOT met'}), "
              f"{best['drop-in'] / best['floor']:.1f}× the memory floor (target ≤ 3×: "
              f"{'met' if best['drop-in'] <= 3 * best['floor'] else 'NOT met'}); hot path {hot:.1f}× (target ≥ 5×: "
              f"{'met' if hot >= 5 else 'NOT met'}); the eager floor alone is {bound:.1f}× faster than the competitor "
              f"and {best['eager floor'] / best['floor']:.1f}× the memory floor")
    for record in tir:
        if record["size"] != size:
            continue
        ratio = record["competitor"] / record["drop-in"]
        print(f"* TIR-OTB {record['layout']}: drop-in {ratio:.1f}× (target ≥ 10×: {'met' if ratio >= 10 else 'NOT met'}"
              f"); hot path {record['competitor'] / record['hot path']:.1f}×; the memory floor alone is "
              f"{record['competitor'] / record['floor']:.1f}× faster than the competitor (10× needs the drop-in within "
              f"{record['competitor'] / 10 / record['floor']:.2f}× the memory floor; it is "
              f"{record['drop-in'] / record['floor']:.2f}×), the eager floor "
              f"{record['competitor'] / record['eager floor']:.1f}×"
              + _parts(record) + _modes(record))
    for kind, records in (("OTB", otb), ("TIR-OTB", tir)):
        for record in records:
            if record["size"] != size:
                continue
            ratio, hot = record["leave-one-out"] / record["drop-in"], \
                record["leave-one-out hot path"] / record["hot path"]
            faults = record["faults"]
            print(f"* leave-one-out {kind} {record['layout']}: {ratio:.2f}× the self-inclusive drop-in, {hot:.2f}× its "
                  f"hot path (target ≤ 1.2×: {'met' if max(ratio, hot) <= 1.2 else 'NOT met'}); page faults in the "
                  f"best calls: leave-one-out {faults.get('leave-one-out', 0)} / self-inclusive "
                  f"{faults.get('drop-in', 0)} (drop-ins), {faults.get('leave-one-out hot path', 0)} / "
                  f"{faults.get('hot path', 0)} (hot paths) — each 4 KiB page that faults in costs the call time "
                  "that has nothing to do with the kernel")
    if 4096 in spp:
        row = spp[4096]
        ratio = row["verl"]["seconds"] / row["otb_torch"]["seconds"]
        share = row["otb_torch"]["extra"] / row["otb_torch"]["size"]
        growth = spp[4096]["otb_torch"]["extra"] - spp.get(1024, spp[4096])["otb_torch"]["extra"]
        print(f"* Σπ²: {ratio:.1f}× faster (target ≥ 2×: {'met' if ratio >= 2 else 'NOT met'}); extra peak "
              f"{row['otb_torch']['extra'] / 2**20:.1f} MiB = {share:.3f}× the logits (target ≤ 0.05×: "
              f"{'met' if share <= 0.05 else 'NOT met'}); from T = 1024 to 4096 it grows by {growth / 2**20:.2f} MiB "
              f"(the result itself is 12 KiB larger)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--sizes", default="64x8x1024,256x8x4096,512x16x8192",
                        help="comma-separated GROUPSxSIZExPOSITIONS")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--section", default="all", choices=["all", "otb", "tir", "sum-pi-squared", "memory"])
    parser.add_argument("--clock", default="wall", choices=["wall", "cpu"],
                        help="wall clock, or the calling thread's CPU time (CPU, one thread only: on a loaded machine)")
    parser.add_argument("--threads", default="",
                        help="CPU: comma-separated torch thread counts, each run in a fresh process (default: torch's)")
    parser.add_argument("--allocator", default="as-is", choices=["as-is", "warm", "both"],
                        help="CPU: glibc's defaults, a warm (reusing) heap, or both, each in a fresh process")
    parser.add_argument("--against", default="verl", choices=["verl", "loop"],
                        help="the competitor: verl's own functions (falls back to loop without verl), or the loops")
    parser.add_argument("--compile", action="store_true", help="also time the hot path with compile=True")
    parser.add_argument("--kernel", default="auto", choices=["auto", "eager"],
                        help="CPU: the native kernel where it builds (auto), or the eager kernel (OTB_TORCH_NATIVE=0)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.sizes = [tuple(int(x) for x in size.split("x")) for size in args.sizes.split(",")]
    if args.device == "cpu" and not args.child:
        for threads in [int(count) for count in args.threads.split(",") if count.strip()] or [None]:
            for regime in (("as-is", "warm") if args.allocator == "both" else (args.allocator,)):
                in_subprocess(regime, args.kernel, threads)
        return
    if os.environ.get("OTB_BENCH_THREADS"):
        torch.set_num_threads(int(os.environ["OTB_BENCH_THREADS"]))
    if args.clock == "cpu" and (args.device != "cpu" or torch.get_num_threads() != 1):
        parser.error("--clock cpu measures the calling thread: CPU with one thread only (--threads 1)")
    global CLOCK
    CLOCK = args.clock
    print(f"torch {torch.__version__}, python {platform.python_version()}, numpy {np.__version__}, "
          f"{torch.get_num_threads()} threads, {platform.machine()}, clock: {CLOCK}, load average "
          f"{os.getloadavg()[0]:.2f}"
          + (f", {torch.cuda.get_device_name()}" if args.device == "cuda" else "")
          + f"; allocator: {os.environ.get('OTB_BENCH_ALLOCATOR', 'as-is')}; competitor: "
          + ("verl " + _verl_version() if verl_algos is not None and args.against == "verl" else "loop transcription"))
    status = otb_torch.native_kernel_status()
    print("otb_torch kernel on CPU: " + (f"native ({status.path})" if status.available else
                                          f"eager ({status.reason})"))
    otb = bench_advantages(args, False) if args.section in ("all", "otb") else []
    tir = bench_advantages(args, True) if args.section in ("all", "tir") else []
    spp = bench_sum_pi_squared(args) if args.section in ("all", "sum-pi-squared") else {}
    if args.section in ("all", "memory") and args.device == "cpu":
        bench_kernel_memory(args)
    verdict(otb, tir, spp)


_WARM_HEAP = {"MALLOC_MMAP_THRESHOLD_": str(2**62), "MALLOC_TRIM_THRESHOLD_": str(2**62)}


def in_subprocess(regime: str, kernel: str, threads: int | None = None) -> None:
    """Run the benchmark in a fresh process whose C allocator runs as-is or with a warm heap (and, when given, with
    that many threads: OMP_NUM_THREADS and torch.set_num_threads)."""
    environment = {name: value for name, value in os.environ.items() if name not in _WARM_HEAP}
    if regime == "warm":
        environment.update(_WARM_HEAP)
    environment["OTB_BENCH_ALLOCATOR"] = regime
    if threads is not None:
        environment["OMP_NUM_THREADS"] = environment["OTB_BENCH_THREADS"] = str(threads)
    if kernel == "eager":
        environment["OTB_TORCH_NATIVE"] = "0"
    subprocess.run([sys.executable, os.path.abspath(__file__), "--child", *sys.argv[1:]], check=True, env=environment)


if __name__ == "__main__":
    main()
