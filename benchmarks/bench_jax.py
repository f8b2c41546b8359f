"""otb_jax speed, printed as figures and ratios.

    python benchmarks/bench_jax.py [--device cpu|gpu] [--groups 256] [--group-size 8] [--positions 4096] [--vocab N]

1. jit'd single-turn OTB at groups × group-size × positions (float32) against the NumPy reference (CPU), and on a GPU
   against a device-to-device copy of the same bytes (the physical limit).
2. jit'd Σπ² of [4096, vocab] bfloat16 logits (default vocab: 152064 on a GPU — the issue's size — and 32768 on CPU)
   against the reference (CPU) or a device-to-device copy (GPU).
Compilation is excluded (one warm-up call); times are medians of --repeats runs.
"""

from __future__ import annotations

import argparse
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np

import otb_jax
import otb_spec as otb


def timed(function, repeats: int) -> float:
    jax.block_until_ready(function())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(function())
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "gpu"])
    parser.add_argument("--groups", type=int, default=256)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--positions", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    device = jax.devices(args.device)[0]
    print(f"jax {jax.__version__}, python {platform.python_version()}, device {device.device_kind}")
    rng = np.random.default_rng(0)
    rows = args.groups * args.group_size
    lengths = rng.integers(args.positions // 8, args.positions + 1, size=rows)
    mask = (np.arange(args.positions)[None, :] < lengths[:, None]).astype(np.float32)
    pi = rng.beta(5.0, 1.0, size=(rows, args.positions))
    spp = (pi**2 + (1 - pi) ** 2 * rng.uniform(0.01, 1.0, size=pi.shape)).astype(np.float32)
    log_probs = np.log(pi).astype(np.float32)
    rewards = np.zeros((rows, args.positions), dtype=np.float32)
    rewards[np.arange(rows), lengths - 1] = rng.integers(0, 2, size=rows)
    ids, count = otb_jax.segment_ids(np.repeat(np.arange(args.groups), args.group_size))
    on = {name: jax.device_put(value, device) for name, value in
          dict(rewards=rewards, mask=mask, log_probs=log_probs, spp=spp, ids=ids).items()}

    print(f"OTB single-turn, {args.groups} groups × {args.group_size} × {args.positions} tokens, float32")
    jit_time = timed(lambda: otb_jax.optimal_token_baseline(on["rewards"], on["mask"], on["ids"], count,
                                                            on["log_probs"], on["spp"],
                                                            check_values=False).advantages, args.repeats)
    print(f"  otb_jax (jit, no value checks)     {jit_time * 1e3:9.2f} ms")
    if args.device == "cpu":
        reference = timed(lambda: otb.optimal_token_baseline(rewards, mask, ids, log_probs, spp).advantages,
                          max(1, args.repeats // 2))
        print(f"  otb_spec NumPy reference (float64) {reference * 1e3:9.2f} ms   → jit is {reference / jit_time:.1f}× "
              "faster")
    else:
        moved = 6 * rows * args.positions
        source = jax.device_put(np.zeros(moved, np.float32), device)
        copy = timed(lambda: source + 0.0, args.repeats)
        print(f"  device-to-device copy of the same bytes {copy * 1e3:.2f} ms → OTB takes {jit_time / copy:.1f}× the "
              "copy")

    vocab = args.vocab or (152064 if args.device == "gpu" else 32768)
    logits = jax.device_put(jnp.asarray(rng.normal(scale=3.0, size=(4096, vocab)), dtype=jnp.bfloat16), device)
    print(f"Σπ² of [4096, {vocab}] bfloat16 logits ({logits.size * 2 / 2**20:.0f} MiB)")
    spp_time = timed(lambda: otb_jax.sum_pi_squared(logits, check_values=False), args.repeats)
    print(f"  otb_jax (jit, float32 accumulation) {spp_time * 1e3:8.2f} ms")
    if args.device == "cpu":
        host = np.asarray(logits.astype(jnp.float32))
        reference = timed(lambda: otb.sum_pi_squared(host), 1)
        print(f"  otb_spec NumPy reference (float64)  {reference * 1e3:8.2f} ms   → jit is {reference / spp_time:.1f}× "
              "faster")
    else:
        copy = timed(lambda: logits + jnp.bfloat16(0), args.repeats)
        print(f"  device-to-device copy of the logits {copy * 1e3:8.2f} ms → Σπ² takes {spp_time / copy:.1f}× the copy")


if __name__ == "__main__":
    main()
