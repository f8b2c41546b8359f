"""The whole GPU check in one command: equivalence tests and benchmarks on CUDA (torch) and GPU (JAX), recorded.

    python benchmarks/gpu_check.py [--out benchmarks/results]

Runs, on the machine's first GPU:
  1. python -m pytest -q -m gpu tests/                       — the GPU-only tests (sync-free hot path, CUDA graphs, …)
  2. OTB_ADAPTERS=torch-cuda,jax-gpu python -m pytest -q tests/test_adapters.py   — the shared equivalence suite
  3. python benchmarks/bench_torch.py --device cuda            — vs the loop pattern and a device-to-device copy
  4. python benchmarks/bench_jax.py --device gpu               — jit'd OTB and Σπ² at [4096, 152064] bf16 vs a copy
and writes benchmarks/results/gpu-check-<date>-<gpu>.md with the device, the versions, every command and its output.
Exit status: 0 when every step passed, 1 when a test failed, 2 when no GPU is visible (nothing was checked).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(command: list[str], environment: dict | None = None) -> tuple[int, str]:
    try:
        completed = subprocess.run(command, cwd=ROOT, capture_output=True, text=True,
                                   env={**os.environ, **(environment or {})})
    except FileNotFoundError as exc:
        return 127, str(exc)
    return completed.returncode, (completed.stdout + completed.stderr).strip()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"))
    args = parser.parse_args()
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
        ("GPU-only tests", [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "tests/"], None),
        ("equivalence suite on the GPU adapters", [sys.executable, "-m", "pytest", "-q", "tests/test_adapters.py"],
         {"OTB_ADAPTERS": "torch-cuda,jax-gpu"}),
        ("torch benchmark", [sys.executable, "benchmarks/bench_torch.py", "--device", "cuda"], None),
        ("JAX benchmark", [sys.executable, "benchmarks/bench_jax.py", "--device", "gpu"], None),
    ]
    failed = False
    sections = []
    for title, command, environment in steps:
        print(f"gpu_check: {title} …", flush=True)
        status, output = run(command, environment)
        failed |= status != 0
        prefix = " ".join(f"{k}={v}" for k, v in (environment or {}).items())
        sections.append(f"## {title} — {'passed' if status == 0 else f'FAILED (exit {status})'}\n\n"
                        f"```\n$ {prefix + ' ' if prefix else ''}{' '.join(command[1:] if command[0] == sys.executable else command)}\n"
                        f"{output[-6000:]}\n```\n")
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    slug = re.sub(r"[^A-Za-z0-9]+", "-", gpu_name).strip("-").lower()
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"gpu-check-{stamp}-{slug}.md")
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(f"# GPU check, {stamp}\n\nCommand: `python benchmarks/gpu_check.py`\n\n"
                     f"* device: {gpu_name} ({smi if code == 0 else 'nvidia-smi unavailable'})\n"
                     + "".join(f"* {name}: {value}\n" for name, value in versions.items()) + "\n"
                     + "\n".join(sections))
    print(f"gpu_check: wrote {os.path.relpath(path, ROOT)}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
