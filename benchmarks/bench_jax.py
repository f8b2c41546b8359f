"""otb_jax speed, printed as figures and ratios.

    python benchmarks/bench_jax.py [--device cpu|gpu] [--groups 256] [--group-size 8] [--positions 4096] [--vocab N]
                                   [--section all|otb|sum-pi-squared|fused] [--tokens N] [--hidden H]

1. jit'd single-turn OTB at groups × group-size × positions (float32) against the NumPy reference (CPU), and on a GPU
   against a device-to-device copy of the same bytes (the physical limit).
2. jit'd Σπ² of [4096, vocab] bfloat16 logits (default vocab: 152064 on a GPU — the issue's size — and 32768 on CPU)
   against the reference (CPU) or a device-to-device copy (GPU).
3. the fused LM-head statistics (``otb_jax.fused_linear_token_statistics``: log π, entropy, Σπ² from hidden [N, H]
   and W [V, H], bf16 on a GPU and float32 on CPU; N = 4096, H = 4096 on a GPU, 512 and 256 on CPU) against the
   logits materialised in the same program (``h·Wᵀ`` in float32, then z_y − lse, lse − Σ π·z and
   exp(lse(2z) − 2·lse(z))), forward and forward + backward (``jax.grad`` of Σ g_lp·log π + g_H·H with respect to h
   and W, Σπ² returned beside it), with each compiled program's temporary memory (XLA's
   ``memory_analysis().temp_size_in_bytes``: the planned peak of the buffers live at once beyond the arguments,
   outputs and constants — a compile-time plan, not a measured peak; on a GPU it includes the matmul library's
   workspace) against the fp32 logits, and the largest difference between the two programs' outputs.
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
    parser.add_argument("--section", default="all", choices=["all", "otb", "sum-pi-squared", "fused"])
    parser.add_argument("--tokens", type=int, default=None, help="fused: N (default 4096 on a GPU, 512 on CPU)")
    parser.add_argument("--hidden", type=int, default=None, help="fused: H (default 4096 on a GPU, 256 on CPU)")
    args = parser.parse_args()
    device = jax.devices(args.device)[0]
    print(f"jax {jax.__version__}, python {platform.python_version()}, device {device.device_kind}")
    rng = np.random.default_rng(0)
    if args.section in ("all", "otb"):
        bench_otb(args, device, rng)
    vocab = args.vocab or (152064 if args.device == "gpu" else 32768)
    if args.section in ("all", "sum-pi-squared"):
        bench_sum_pi_squared(args, device, rng, vocab)
    if args.section in ("all", "fused"):
        bench_fused(args, device, rng, vocab)


def bench_otb(args: argparse.Namespace, device, rng: np.random.Generator) -> None:
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
        print(f"  otb_spec NumPy reference (float64) {reference * 1e3:9.2f} ms   "
              f"→ jit {_relative(reference, jit_time)}")
    else:
        moved = 6 * rows * args.positions
        source = jax.device_put(np.zeros(moved, np.float32), device)
        copy = timed(lambda: source + 0.0, args.repeats)
        print(f"  device-to-device copy of the same bytes {copy * 1e3:.2f} ms → OTB takes {jit_time / copy:.1f}× the "
              "copy")


def _relative(baseline: float, measured: float) -> str:
    """"is N× faster" or "is N× slower" than ``baseline`` — never a speed-up below 1."""
    return (f"is {baseline / measured:.1f}× faster" if measured <= baseline else
            f"is {measured / baseline:.1f}× slower")


def bench_sum_pi_squared(args: argparse.Namespace, device, rng: np.random.Generator, vocab: int) -> None:
    logits = jax.device_put(jnp.asarray(rng.normal(scale=3.0, size=(4096, vocab)), dtype=jnp.bfloat16), device)
    print(f"Σπ² of [4096, {vocab}] bfloat16 logits ({logits.size * 2 / 2**20:.0f} MiB)")
    spp_time = timed(lambda: otb_jax.sum_pi_squared(logits, check_values=False), args.repeats)
    print(f"  otb_jax (jit, float32 accumulation) {spp_time * 1e3:8.2f} ms")
    if args.device == "cpu":
        host = np.asarray(logits.astype(jnp.float32))
        reference = timed(lambda: otb.sum_pi_squared(host), 1)
        print(f"  otb_spec NumPy reference (float64)  {reference * 1e3:8.2f} ms   "
              f"→ jit {_relative(reference, spp_time)}")
    else:
        copy = timed(lambda: logits + jnp.bfloat16(0), args.repeats)
        print(f"  device-to-device copy of the logits {copy * 1e3:8.2f} ms → Σπ² takes {spp_time / copy:.1f}× the copy")


def _materialised(hidden, weight, ids):
    """The logits held: z = h·Wᵀ in float32, then the three statistics by their formulas."""
    logits = jax.lax.dot_general(hidden, weight, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    lse = jax.nn.logsumexp(logits, axis=-1)
    log_probs = jnp.take_along_axis(logits, ids[:, None], axis=-1)[:, 0] - lse
    entropy = lse - (jax.nn.softmax(logits, axis=-1) * logits).sum(-1)
    spp = jax.lax.stop_gradient(jnp.exp(jax.nn.logsumexp(2 * logits, axis=-1) - 2 * lse))
    return log_probs, entropy, spp


def _fused(hidden, weight, ids):
    out = otb_jax.fused_linear_token_statistics(hidden, weight, ids, check_values=False)
    return out.log_probs, out.entropy, out.sum_pi_squared


def bench_fused(args: argparse.Namespace, device, rng: np.random.Generator, vocab: int) -> None:
    gpu = args.device == "gpu"
    tokens, hidden_size = args.tokens or (4096 if gpu else 512), args.hidden or (4096 if gpu else 256)
    dtype = jnp.bfloat16 if gpu else jnp.float32

    def normal(shape, scale=1.0):
        return jax.device_put(jnp.asarray(scale * rng.standard_normal(shape, dtype=np.float32), dtype=dtype), device)

    hidden, weight = normal((tokens, hidden_size)), normal((vocab, hidden_size), 0.02)
    ids = jax.device_put(jnp.asarray(rng.integers(0, vocab, tokens)), device)
    g_lp = jax.device_put(jnp.asarray(rng.standard_normal(tokens, dtype=np.float32)), device)
    g_h = jax.device_put(jnp.asarray(0.01 * rng.standard_normal(tokens, dtype=np.float32)), device)
    logits_bytes = tokens * vocab * 4
    print(f"fused LM-head statistics, N = {tokens}, H = {hidden_size}, V = {vocab}, {jnp.dtype(dtype).name} "
          f"(fp32 logits: {logits_bytes / 2**20:.0f} MiB)")
    times, outputs = {}, {}
    for name, statistics in (("materialised logits", _materialised), ("otb_jax fused", _fused)):
        def loss(h, w, statistics=statistics):
            log_probs, entropy, spp = statistics(h, w, ids)
            return (log_probs * g_lp + entropy * g_h).sum(), spp          # Σπ² computed in both programs

        for mode, program in (("forward", jax.jit(statistics)),
                              ("forward + backward", jax.jit(jax.grad(loss, argnums=(0, 1), has_aux=True)))):
            arguments = (hidden, weight, ids) if mode == "forward" else (hidden, weight)
            compiled = program.lower(*arguments).compile()
            temporary = compiled.memory_analysis().temp_size_in_bytes
            seconds = timed(lambda: compiled(*arguments), args.repeats)
            times[(name, mode)] = seconds
            outputs[(name, mode)] = jax.tree_util.tree_leaves(compiled(*arguments))
            print(f"  {name:20s} {mode:18s} {seconds * 1e3:9.2f} ms   temporary memory "
                  f"{temporary / 2**20:8.1f} MiB = {temporary / logits_bytes:.3f}× the logits")
    for mode in ("forward", "forward + backward"):
        ratio = times[("otb_jax fused", mode)] / times[("materialised logits", mode)]
        difference = max(float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))
                         for a, b in zip(outputs[("otb_jax fused", mode)], outputs[("materialised logits", mode)]))
        print(f"  {mode}: fused takes {ratio:.2f}× the materialised program's time; "
              f"max |fused − materialised| over its outputs {difference:.1e}")

if __name__ == "__main__":
    main()
