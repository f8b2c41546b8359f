"""Σπ² from logits at fixed chunk sizes: where otb_torch's default chunk size comes from.

For each shape, the best of ``--repeats`` calls (after one warm-up) of ``otb_torch.sum_pi_squared(z, chunk_size=rows,
check_values=False)`` for rows in ``--rows``; on float32 logits also the eight-operation loop it replaced (for the
record of that change); and the plain formula exp(logsumexp(2z) − 2·logsumexp(z)) on the logits upcast to float32.
Extra memory is the allocator's peak above the inputs (CUDA only). Also the default chunk size, with the value checks.

    python benchmarks/sweep_logits_chunks.py --device cuda      # the figures in otb_torch/_logits.py (an H100)
    python benchmarks/sweep_logits_chunks.py --device cpu --shapes 256x32768
"""

from __future__ import annotations

import argparse
import time

import torch

import otb_torch
from otb_torch import _logits


def eight_operation_loop(z: torch.Tensor, step: int) -> torch.Tensor:
    """sum_pi_squared's chunk loop before 2026-11-26 (float32 logits): the ratio computed chunk by chunk."""
    rows = z.reshape(-1, z.shape[-1])
    n = rows.shape[0]
    out = torch.empty(n, device=z.device)
    maxima = torch.empty((n, 1), device=z.device)
    buffer = torch.empty((min(step, n), z.shape[-1]), device=z.device)
    for start in range(0, n, step):
        block = rows[start:start + step]
        count = block.shape[0]
        a, peak = buffer[:count], maxima[start:start + count]
        peak.copy_(block.amax(-1, keepdim=True))
        torch.sub(block, peak, out=a)
        a.exp_()
        total = a.sum(-1)
        torch.div(_logits._row_dot(a, a), total.square_(), out=out[start:start + count])
    return out


def plain(z: torch.Tensor) -> torch.Tensor:
    upcast = z.float()
    return torch.exp(torch.logsumexp(2 * upcast, -1) - 2 * torch.logsumexp(upcast, -1))


def timed(function, device: torch.device, repeats: int):
    """(best milliseconds, extra peak MiB or nan, result)."""
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    function()
    sync()
    if cuda:
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    best = float("inf")
    for _ in range(repeats):
        sync()
        began = time.perf_counter()
        result = function()
        sync()
        best = min(best, time.perf_counter() - began)
    extra = (torch.cuda.max_memory_allocated() - base) / 2**20 if cuda else float("nan")
    return best * 1e3, extra, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--shapes", default="1024x32768:float32,4096x32768:float32,4096x152064:bfloat16",
                        help="comma-separated TxV[:dtype]")
    parser.add_argument("--rows", default="8,32,64,128,256,512")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    device = torch.device(args.device)
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}")
    for shape in args.shapes.split(","):
        size, _, dtype_name = shape.partition(":")
        positions, vocab = (int(part) for part in size.split("x"))
        dtype = getattr(torch, dtype_name or "float32")
        z = (torch.randn(positions, vocab, device=device) * 4).to(dtype)
        mib = z.numel() * z.element_size() / 2**20
        ms, extra, reference = timed(lambda: plain(z), device, args.repeats)
        print(f"T={positions} V={vocab} {dtype} logits {mib:.0f} MiB: plain {ms:.2f} ms, extra {extra:.0f} MiB"
              if extra == extra else f"T={positions} V={vocab} {dtype} logits {mib:.0f} MiB: plain {ms:.2f} ms",
              flush=True)
        for rows in (int(part) for part in args.rows.split(",")):
            ms, extra, result = timed(lambda: otb_torch.sum_pi_squared(z, chunk_size=rows, check_values=False),
                                      device, args.repeats)
            error = ((result.float() - reference).abs() / reference).max().item()
            memory = f" extra {extra:.1f} MiB ({extra / mib:.3f}x)" if extra == extra else ""     # nan off CUDA
            line = f"  rows {rows:4d}: new {ms:.2f} ms{memory} rel.err {error:.1e}"
            if dtype == torch.float32:
                line += f" | old loop {timed(lambda: eight_operation_loop(z, rows), device, args.repeats)[0]:.2f} ms"
            print(line, flush=True)
        ms, extra, _ = timed(lambda: otb_torch.sum_pi_squared(z), device, args.repeats)
        print(f"  default (checks on): {ms:.2f} ms" + (f" extra {extra:.1f} MiB" if extra == extra else ""), flush=True)
        del z


if __name__ == "__main__":
    main()
