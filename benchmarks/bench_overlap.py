"""Two ranks summing the grid whole after the first sweep, or in chunks while it runs: an interleaved A/B.

    python benchmarks/bench_overlap.py [--sizes 64x8x2048] [--chunks 1,2,3,4] [--repeat 41] [--rounds 3]

``otb_torch.distributed.distributed_token_baseline`` over two gloo processes on loopback (one torch thread each, rows
shuffled over the ranks as verl's balance_batch leaves them; the batch of ``bench_distributed.py``), the native CPU
kernel. Over two ranks with rows of the same width it runs its first sweep in ``_OVERLAP_CHUNKS`` phases, cut at the
same global group ids on both ranks, and sends each phase's chunk of the grid while the next phase runs; with 1 it
sends the whole buffer once the sweep is done (the path before issue 25's overlap, and the one every other layout
takes). The results are the same bits either way (tests/test_torch_distributed.py).

Each call is preceded by a barrier; the settings take turns call by call (``--repeat`` calls of each, after a warm-up
of each), so that a drift of the host's load reaches all of them alike, and the whole comparison runs ``--rounds``
times with fresh processes. Per setting: the median whole call (the larger of the two ranks' medians) and its ratio to
one process doing the whole batch (the one-process native kernel, one thread, timed in the parent before each round,
median of ``--repeat``) — issue 25's target for a rank's whole call is ≤ 1.
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_distributed import (  # noqa: E402
    _OTB_CASES,
    _batch,
    _collect,
    _data_parallel_options,
    _free_port,
    _one_process,
    _rank_rows,
)

_CASES = tuple(case for case in _OTB_CASES if case != "context parallel")     # context parallel sums no grid


def _worker(rank: int, port: int, args: argparse.Namespace, out: object) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    from otb_torch import distributed as otb_dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=120))
    found = {}
    for prompts, samples, positions in args.sizes:
        for case in _CASES:
            batch = _batch(prompts, samples, positions, holes=case.startswith("multi-turn"))
            *local, ids = _rank_rows(batch, 2, rank)
            options = _data_parallel_options(case)

            def call(chunks: int) -> None:
                otb_dist._OVERLAP_CHUNKS = chunks
                otb_dist.distributed_token_baseline(local[0], local[1], ids, local[2], local[3], num_groups=prompts,
                                                    **options)

            times = {chunks: [] for chunks in args.chunks}
            for chunks in args.chunks:                                              # warm-up
                dist.barrier()
                call(chunks)
            for _ in range(args.repeat):
                for chunks in args.chunks:
                    dist.barrier()
                    start = time.perf_counter()
                    call(chunks)
                    times[chunks].append(time.perf_counter() - start)
            found[(prompts, samples, positions, case)] = {chunks: statistics.median(values)
                                                          for chunks, values in times.items()}
    out.put((rank, found))
    dist.destroy_process_group()


def _one_process_times(args: argparse.Namespace) -> dict:
    import torch

    torch.set_num_threads(1)
    found = {}
    for prompts, samples, positions in args.sizes:
        for case in _CASES:
            *tensors, ids = [torch.from_numpy(a) if a.dtype.kind == "f" else a
                             for a in _batch(prompts, samples, positions, holes=case.startswith("multi-turn"))]
            function = _one_process(case)
            function(tensors[0], tensors[1], ids, tensors[2], tensors[3])
            walls = []
            for _ in range(args.repeat):
                start = time.perf_counter()
                function(tensors[0], tensors[1], ids, tensors[2], tensors[3])
                walls.append(time.perf_counter() - start)
            found[(prompts, samples, positions, case)] = statistics.median(walls)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="64x8x2048", help="comma-separated PROMPTSxSAMPLESxPOSITIONS")
    parser.add_argument("--chunks", default="1,2,3,4", help="comma-separated chunk counts to alternate")
    parser.add_argument("--repeat", type=int, default=41)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    args.sizes = [tuple(int(x) for x in size.split("x")) for size in args.sizes.split(",")]
    args.chunks = [int(value) for value in args.chunks.split(",")]
    import torch

    print(f"# gloo on loopback, 2 processes, one torch thread each, torch {torch.__version__}, {os.cpu_count()} CPUs; "
          f"settings alternated call by call, median of {args.repeat} calls each, {args.rounds} rounds; load average "
          f"{os.getloadavg()[0]:.2f} at start\n")
    print("| round | batch | case | one process | " + " | ".join(f"{chunks} chunk{'s' if chunks > 1 else ''}"
                                                                  for chunks in args.chunks) + " |")
    print("|---|---|---|---|" + "---|" * len(args.chunks))
    context = multiprocessing.get_context("spawn")
    for round_ in range(1, args.rounds + 1):
        single = _one_process_times(args)
        queue = context.Queue()
        port = _free_port()
        workers = [context.Process(target=_worker, daemon=True, args=(rank, port, args, queue)) for rank in range(2)]
        for worker in workers:
            worker.start()
        parts = dict(_collect(workers, queue, 2, timeout=1200))
        for key, one in single.items():
            cells = []
            for chunks in args.chunks:
                slowest = max(parts[rank][key][chunks] for rank in (0, 1))
                cells.append(f"{slowest * 1e3:.2f} ms ({slowest / one:.2f}×)")
            prompts, samples, positions, case = key
            print(f"| {round_} | {prompts}×{samples}×{positions} | {case} | {one * 1e3:.2f} ms | "
                  + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
