"""The whole GPU check in one command: equivalence tests and benchmarks on CUDA (torch) and GPU (JAX), recorded.

    python benchmarks/gpu_check.py [--out benchmarks/results] [--quick] [--compile] [--skip 3,4] [--step-timeout 1200]

Runs, on the machine's first GPU:
  1. python -m pytest -q -m gpu tests/ --ignore tests/test_adapters.py — the GPU-only tests (sync-free hot path,
     CUDA graphs, the fused LM-head statistics on CUDA and JAX-GPU, …)
  2. OTB_ADAPTERS=torch-cuda,jax-gpu python -m pytest -q tests/test_adapters.py   — the shared equivalence suite
  3. python benchmarks/bench_torch.py --device cuda            — vs the loop pattern and a device-to-device copy
     (with ``--compile``: also the hot path with compile=True)
  4. python benchmarks/bench_jax.py --device gpu               — jit'd OTB and Σπ² at [4096, 152064] bf16 vs a copy,
     and the fused LM-head statistics (bf16, N = H = 4096) against the logits materialised
  5., 6. python benchmarks/bench_fused.py --device cuda …      — the fused LM-head statistics, float32, then bf16
and writes benchmarks/results/gpu-check-<date>-<gpu>.md with the device, the versions, every command and its output
— rewritten after each step, so a run cut short (a lease that ends, a step past --step-timeout) keeps what it did.
On an H200 (2026-11-26) steps 2–4 took 2.6, 1.6 and 0.3 minutes (step 4 before it measured the fused statistics:
four more programs to compile, perhaps a minute more); the rest are estimates from that lease's partial runs — step 1
about 1 minute, steps 5 and 6 about 2 each — and ``--quick`` about 6 minutes in all, plus the machine's start and
the install. On an H100 (2026-11-26) ``--quick`` ran whole in 449 s, install included: steps 1–6 took 86, 137, 36, 38,
70 and 71 s. A second run the same day writes ``…-2.md`` (a resume with ``--skip``
keeps the first record).
Exit status: 0 when every step passed, 1 when a step failed or timed out, 2 when no GPU is visible (nothing was
checked).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import re
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(command: list[str], environment: dict | None = None, timeout: float | None = None) -> tuple[int, str]:
    """(exit status, stdout + stderr); status 124 with what it had printed when it ran past ``timeout`` seconds.

    The step runs in a session of its own, and a step past its time is stopped with every process it started (the
    benchmarks run each method in a subprocess): nothing of it runs on beside the next step."""
    try:
        process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                   env={**os.environ, **(environment or {})}, start_new_session=True)
    except FileNotFoundError as exc:
        return 127, str(exc)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        stdout, stderr = process.communicate()
        return 124, (stdout + stderr).strip() + f"\n[stopped after {timeout:.0f} s (--step-timeout)]"
    return process.returncode, (stdout + stderr).strip()


def _step_numbers(text: str) -> set[int]:
    try:
        numbers = {int(number) for number in text.split(",") if number.strip()}
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated step numbers 1–6, got {text!r}") from None
    if not numbers <= set(range(1, 7)):
        raise argparse.ArgumentTypeError(f"steps are numbered 1–6, got {sorted(numbers - set(range(1, 7)))}")
    return numbers


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"))
    parser.add_argument("--step-timeout", type=float, default=1200.0, help="seconds one step may run (default 1200)")
    parser.add_argument("--skip", type=_step_numbers, default=set(),
                        help="comma-separated step numbers (1–6) not to run")
    parser.add_argument("--quick", action="store_true",
                        help="benchmarks at one size each (256×8×4096; N = 4096, 2 repeats): about 6 minutes on an "
                             "H200 instead of 10, for a lease of 15 minutes of device time")
    parser.add_argument("--compile", action="store_true",
                        help="the torch benchmark also times the hot path with compile=True (torch.compile's fused "
                             "kernels: the drop-ins' launch-bound gap to the memory floor); adds its compile time")
    args = parser.parse_args()
    skipped = args.skip
    code, smi = run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"])
    try:
        import torch
        cuda = torch.cuda.is_available()
        gpu_name = torch.cuda.get_device_name() if cuda else None
    except ImportError:
        torch, cuda, gpu_name = None, False, None
    if not cuda:
        print("gpu_check: no CUDA device visible to torch; nothing was checked", file=sys.stderr)
        return 2
    versions = {"python": platform.python_version(), "torch": torch.__version__,
                "cuda (torch)": torch.version.cuda}
    try:
        import jax
        versions["jax"] = jax.__version__
    except ImportError:
        versions["jax"] = "not installed"
    steps = [
        ("GPU-only tests (the adapters suite is step 2)",
         [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "tests/", "--ignore", "tests/test_adapters.py"], None),
        ("equivalence suite on the GPU adapters", [sys.executable, "-m", "pytest", "-q", "tests/test_adapters.py"],
         {"OTB_ADAPTERS": "torch-cuda,jax-gpu"}),
        ("torch benchmark", [sys.executable, "benchmarks/bench_torch.py", "--device", "cuda",
                             *(["--sizes", "256x8x4096"] if args.quick else []),
                             *(["--compile"] if args.compile else [])], None),
        ("JAX benchmark", [sys.executable, "benchmarks/bench_jax.py", "--device", "gpu"], None),
        *((f"fused LM-head statistics, {dtype}",
           [sys.executable, "benchmarks/bench_fused.py", "--device", "cuda", "--dtype", dtype, "--vocab", "152064",
            "--hidden", "4096", *(["--tokens", "4096", "--repeats", "2"] if args.quick else ["--tokens", "4096,8192"])],
           None) for dtype in ("float32", "bfloat16")),
    ]
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    slug = re.sub(r"[^A-Za-z0-9]+", "-", gpu_name).strip("-").lower()
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"gpu-check-{stamp}-{slug}.md")
    attempt = 1
    while os.path.exists(path):             # a second run that day (a resume with --skip) keeps the first record
        attempt += 1
        path = os.path.join(args.out, f"gpu-check-{stamp}-{slug}-{attempt}.md")
    header = (f"# GPU check, {stamp}\n\nCommand: `{' '.join(['python benchmarks/gpu_check.py', *sys.argv[1:]])}`\n\n"
              f"* device: {gpu_name} ({smi if code == 0 else 'nvidia-smi unavailable'})\n"
              + "".join(f"* {name}: {value}\n" for name, value in versions.items()) + "\n")
    failed = False
    sections = []
    for number, (title, command, environment) in enumerate(steps, start=1):
        if number in skipped:
            continue
        print(f"gpu_check: {number}. {title} …", flush=True)
        shown = " ".join(command[1:] if command[0] == sys.executable else command)
        with open(path, "w", encoding="utf-8") as handle:       # a run cut off in this step still says it began it
            handle.write(header + "\n".join([*sections, f"## {number}. {title} — started, not finished\n\n"
                                                         f"```\n$ {shown}\n```\n"]))
        started = time.perf_counter()
        status, output = run(command, environment, args.step_timeout)
        failed |= status != 0
        prefix = " ".join(f"{k}={v}" for k, v in (environment or {}).items())
        verdict = "passed" if status == 0 else f"FAILED (exit {status})"
        print(f"gpu_check: {number}. {verdict} in {time.perf_counter() - started:.0f} s\n{output[-3000:]}", flush=True)
        sections.append(f"## {number}. {title} — {verdict}, {time.perf_counter() - started:.0f} s\n\n"
                        f"```\n$ {prefix + ' ' if prefix else ''}{shown}\n{output[-20000:]}\n```\n")
        with open(path, "w", encoding="utf-8") as handle:       # after every step: a cut-short run keeps its record
            handle.write(header + "\n".join(sections))
    print(f"gpu_check: wrote {os.path.relpath(path, ROOT)}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
