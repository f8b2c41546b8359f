"""Cost of otb_torch.distributed on this machine (gloo on loopback), against one process doing the whole batch.

    python benchmarks/bench_distributed.py [--processes 2 4] [--prompts 64 --samples 8 --positions 1024]
                                           [--rows 1024 --vocab 32768] [--repeat 5]

For P processes (spawned, gloo over 127.0.0.1, one torch thread each) it prints the median over ``--repeat`` calls
(after one warm-up) of:

* data-parallel OTB: ``distributed_token_baseline`` on each rank's rows of a prompts × samples batch whose rows were
  shuffled over the ranks (verl's balance_batch layout), self-inclusive and leave-one-out, and the same with the
  rows also cut in P column blocks (context parallel, rows not split);
* vocab-parallel Σπ² and the fused (log π, entropy, Σπ²): each rank holds V/P of the vocabulary;
* the bytes each rank sends in the collectives (from the shapes: the formulas of docs/distributed.md);

and, for comparison, one process (one thread) computing the whole batch with ``otb_torch.optimal_token_baseline`` /
``sum_pi_squared``. On a 2-core machine P = 4 oversubscribes the cores: read those rows as a functional check.
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing
import os
import socket
import statistics
import time


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _batch(prompts: int, samples: int, positions: int, seed: int = 0):
    import numpy as np

    rng = np.random.default_rng(seed)
    rows = prompts * samples
    lengths = rng.integers(positions // 8, positions + 1, rows)
    mask = (np.arange(positions)[None, :] < lengths[:, None]).astype(np.float32)
    log_probs = np.log(rng.uniform(0.05, 1.0, (rows, positions))).astype(np.float32)
    spp = np.clip(np.exp(2 * log_probs) + rng.uniform(0, 0.3, (rows, positions)), 0, 1).astype(np.float32)
    rewards = np.zeros((rows, positions), np.float32)
    rewards[np.arange(rows), lengths - 1] = rng.integers(0, 2, rows)
    ids = np.repeat(np.arange(prompts), samples)
    order = rng.permutation(rows)                        # balance_batch: a prompt's samples scattered over ranks
    return [a[order] for a in (rewards, mask, log_probs, spp)] + [ids[order]]


def _timed(function, repeat: int) -> float:
    function()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _worker(rank: int, size: int, port: int, args: argparse.Namespace, out: object) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import numpy as np
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    from otb_torch import distributed as otb_dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size,
                            timeout=datetime.timedelta(seconds=120))
    rewards, mask, log_probs, spp, ids = _batch(args.prompts, args.samples, args.positions)
    mine = np.array_split(np.arange(rewards.shape[0]), size)[rank]
    local = [torch.from_numpy(np.ascontiguousarray(a[mine])) for a in (rewards, mask, log_probs, spp)]
    local_ids = torch.from_numpy(ids[mine])
    columns = np.array_split(np.arange(rewards.shape[1]), size)[rank]
    cut = [torch.from_numpy(np.ascontiguousarray(a[:, columns])) for a in (rewards, mask, log_probs, spp)]
    logits = torch.from_numpy(np.random.default_rng(1).normal(0, 3, (args.rows, args.vocab)).astype(np.float32))
    shard = logits[:, rank * (args.vocab // size):(rank + 1) * (args.vocab // size)].contiguous()
    token_ids = torch.from_numpy(np.random.default_rng(2).integers(0, args.vocab, args.rows))
    G = args.prompts
    timings = {
        "OTB data parallel": _timed(lambda: otb_dist.distributed_token_baseline(
            *local[:2], local_ids, *local[2:], num_groups=G), args.repeat),
        "OTB data parallel, leave-one-out": _timed(lambda: otb_dist.distributed_token_baseline(
            *local[:2], local_ids, *local[2:], num_groups=G, leave_one_out=True), args.repeat),
        "OTB context parallel": _timed(lambda: otb_dist.distributed_token_baseline(
            *cut[:2], torch.from_numpy(ids), *cut[2:], num_groups=G, context_group=dist.group.WORLD), args.repeat),
        "Σπ² vocab parallel": _timed(lambda: otb_dist.vocab_parallel_sum_pi_squared(shard), args.repeat),
        "log π, entropy, Σπ² vocab parallel": _timed(
            lambda: otb_dist.vocab_parallel_token_statistics(shard, token_ids), args.repeat),
    }
    gathered = [None] * size
    dist.all_gather_object(gathered, timings)
    if rank == 0:
        out.put({name: max(t[name] for t in gathered) for name in timings})
    dist.destroy_process_group()


def _single(args: argparse.Namespace) -> dict:
    import numpy as np
    import torch

    import otb_torch

    torch.set_num_threads(1)
    rewards, mask, log_probs, spp, ids = (torch.from_numpy(a) for a in _batch(args.prompts, args.samples,
                                                                              args.positions))
    logits = torch.from_numpy(np.random.default_rng(1).normal(0, 3, (args.rows, args.vocab)).astype(np.float32))
    token_ids = torch.from_numpy(np.random.default_rng(2).integers(0, args.vocab, args.rows))
    return {
        "OTB data parallel": _timed(lambda: otb_torch.optimal_token_baseline(rewards, mask, ids, log_probs, spp),
                                    args.repeat),
        "OTB data parallel, leave-one-out": _timed(lambda: otb_torch.leave_one_out_token_baseline(
            rewards, mask, ids, log_probs, spp), args.repeat),
        "OTB context parallel": _timed(lambda: otb_torch.optimal_token_baseline(rewards, mask, ids, log_probs, spp),
                                       args.repeat),
        "Σπ² vocab parallel": _timed(lambda: otb_torch.sum_pi_squared(logits), args.repeat),
        "log π, entropy, Σπ² vocab parallel": _timed(
            lambda: otb_torch.token_statistics_from_logits(logits, token_ids), args.repeat),
    }


def _bytes_sent(name: str, size: int, args: argparse.Namespace) -> int:
    """Bytes one rank sends, ring algorithms: all-reduce 2(P−1)/P·S, all-gather (P−1)/P·S (S: the result's size)."""
    reduce, gather = 2 * (size - 1) / size, (size - 1) / size
    G, K, B = args.prompts, args.positions, args.prompts * args.samples
    handshake = gather * size * 8 * 19                   # 19 integers per rank (fixed size)
    if name == "OTB data parallel":
        return int(handshake + gather * size * 4 * G * 8 + reduce * 2 * G * K * 4)
    if name == "OTB data parallel, leave-one-out":
        return int(handshake + reduce * 3 * G * K * 4)
    if name == "OTB context parallel":
        return int(handshake + gather * size * 3 * B * 8 + gather * size * 4 * G * 8 + reduce * 2 * G * K * 4)
    rows = args.rows
    parts = 2 if name == "Σπ² vocab parallel" else 4
    return int(gather * size * 8 * 19 + reduce * (rows + 2) * 4 + reduce * parts * rows * 4)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--positions", type=int, default=1024)
    parser.add_argument("--rows", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    import torch

    print(f"# gloo on loopback, {os.cpu_count()} CPUs, torch {torch.__version__}; batch {args.prompts} prompts × "
          f"{args.samples} samples × {args.positions} positions (rows shuffled); logits {args.rows} × {args.vocab}; "
          f"median of {args.repeat}")
    single = _single(args)
    context = multiprocessing.get_context("spawn")
    results = {}
    for size in args.processes:
        queue = context.Queue()
        port = _free_port()
        workers = [context.Process(target=_worker, args=(rank, size, port, args, queue)) for rank in range(size)]
        for worker in workers:
            worker.start()
        results[size] = queue.get(timeout=600)
        for worker in workers:
            worker.join(timeout=60)
    header = f"{'':38s} {'1 process':>11s}" + "".join(f" {f'P = {p}':>11s} {'sent/rank':>11s}" for p in results)
    print(header)
    for name in single:
        row = f"{name:38s} {single[name] * 1e3:9.1f}ms"
        for size, timing in results.items():
            row += f" {timing[name] * 1e3:9.1f}ms {_bytes_sent(name, size, args) / 2**20:8.2f}MiB"
        print(row)


if __name__ == "__main__":
    main()
