"""Cost of otb_torch.distributed on this machine (gloo on loopback), against one process doing the whole batch.

    python benchmarks/bench_distributed.py [--processes 2] [--sizes 64x8x2048] [--repeat 7]
                                           [--section all|otb|vocab] [--rows 1024 --vocab 32768] [--kernel auto|eager]

For P processes (spawned, gloo over 127.0.0.1, one torch thread each), each call preceded by a barrier, the median
over ``--repeat`` calls (after one warm-up) of:

* OTB with the batch's rows shuffled over the ranks (verl's balance_batch layout): ``distributed_token_baseline``
  self-inclusive and leave-one-out by position, self-inclusive by valid token on masks with tool-output holes, and
  self-inclusive with the rows cut in P column blocks instead (context parallel). Per rank: the whole call; the time
  spent in gloo (issuing the collectives and the two-rank exchange's sends and receives, and waiting for them, waits
  for a slower rank included); and the rank's local compute = call − gloo; and the CPU time of the rank's threads
  other than the caller's (one torch thread: the backend's, gloo's socket I/O loop and work queues). Each figure
  printed is the largest over the ranks (field by field: two columns may come from different ranks);
* the gloo floor: the native path's collectives (handshake, for context parallel the row totals, the one SUM
  all-reduce of the grid — not for context parallel, where every rank holds every row — and its group statistics
  and flags; for leave-one-out, the count of dominant cells and, where a rank has one, their cells and sums, as
  many as the call had — none over two ranks with the native kernel, whose exchange of the grid brings the other
  rank's sums — over two ranks the library's exchange of the buffer,
  ``otb_torch.distributed._all_reduce``, whose receive buffer and add this figure includes while a call counts them
  as local compute) timed alone, with nothing computed — what the call's communication costs at least on this
  machine, in wall time and in the CPU time of every rank's threads;
* the one-process kernel on each rank's own rows (context parallel: on its column piece, as a batch of its own),
  every rank computing at once with no collective inside the call: what a rank's local compute costs at least
  while the ranks share the machine's cores, caches and memory bandwidth (it separates the distributed path's own
  overhead from the slowdown of co-running processes); and the same with the handshake's all-gather (19 integers
  per rank) in flight, as a call overlaps it with its first sweep: what the transport's threads take from the
  compute on this machine's cores. Measured, not proved: at 256×8×4096 the first figure varies twofold between runs
  here (11–28 ms) and is at times above a call's local compute, at 64×8×2048 it was once in 39 case-runs; the
  verdicts below check it on each run. And the same with the call's own communication (the grid's exchange or
  all-reduce, context parallel the totals' all-gather) posted before the compute and waited for after it: as much
  overlap of the same bytes with the same compute as any schedule gets, the whole call's second floor;
* the bytes each rank sends (from the shapes: the formulas of docs/distributed.md) and each rank's extra peak memory
  (the high-water mark of its resident set during a call less the outputs, in a second run of the workers whose C
  allocator maps every block of 64 KiB or more afresh, so that no temporary hides in reused pages);
* the same batch in one process (one thread): ``otb_torch.optimal_token_baseline`` / ``leave_one_out_token_baseline``
  / ``multi_turn_optimal_token_baseline`` (the native CPU kernel), for the targets of issue 25: a rank's local compute
  ≤ 1.3 × (one process × the rank's share of the tokens), and a rank's whole call ≤ one process — where either is
  not met, whether this run's floor rules it out, against the one-process call's upper quartile (not only its
  median): for local compute, its rows in the one-process kernel with the ranks running at once, where it stays
  below the call's local compute in the same run; for the whole call, the CPU work the call needs at least — the
  CPU time of the one-process kernel on every rank's rows (or piece), the ranks at once, plus the collectives' CPU
  time on every rank — over the machine's cores, where the calls' own threads used no less CPU than that compute
  term (the gloo floor plus the rank's compute, one after the other, is printed beside it for scale: no floor, as a
  call overlaps its handshake with its first sweep); where that CPU-work floor is not reached, the rank's rows with
  the call's communication in flight (above), where it stays below the call's own time;
* what a call costs whatever the batch: each case on 2 rows × 16 positions in a gloo world of one process (no peer),
  against the one-process function — the per-call overhead of the distributed protocol (handshake, plan, grid,
  statistics), which at small batches is the difference between a rank's local compute and its share; and the
  same on rank 0's rows of each batch (context parallel: its column piece, in a context group of one; the whole
  call, its collectives local): the protocol's own cost at that size,
  apart from what sharing the machine with the other ranks and their communication adds;
* what running at once costs P processes on this machine, with no collective and no otb_torch.distributed: a loop
  on 16 KiB in L1 cache, a 32 MiB copy, and the one-process kernel on each rank's rows (rank 0 alone, then rank 0
  while all P run at once, barrier before each call) — where the loop scales and the other two do not, the ranks lose
  time to the caches and memory they share, not to the cores;
* with ``--section vocab``: vocab-parallel Σπ² and the fused (log π, entropy, Σπ²), each rank holding V/P of the
  vocabulary, against ``otb_torch.sum_pi_squared`` / ``token_statistics_from_logits`` in one process.

``--kernel eager`` runs otb_torch's eager kernels everywhere (OTB_TORCH_NATIVE=0). On a 2-core machine P > 2
oversubscribes the cores: read those rows as a functional check.
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing
import os
import socket
import statistics
import time

_OTB_CASES = ("self-inclusive", "leave-one-out", "multi-turn (valid token)", "context parallel")
_FIXED_MAPPING = {"MALLOC_MMAP_THRESHOLD_": str(65536), "MALLOC_TRIM_THRESHOLD_": str(65536)}


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _batch(prompts: int, samples: int, positions: int, holes: bool = False, seed: int = 0):
    """(rewards, mask, log π, Σπ², ids) float32, rows shuffled: right padding of random lengths T/8 … T, with
    ``holes`` two tool outputs masked out inside each response."""
    import numpy as np

    rng = np.random.default_rng(seed)
    rows = prompts * samples
    lengths = rng.integers(positions // 8, positions + 1, rows)
    mask = (np.arange(positions)[None, :] < lengths[:, None]).astype(np.float32)
    if holes:
        for row in range(rows):
            for _ in range(2):
                begin = rng.integers(0, max(1, lengths[row] - 1))
                mask[row, begin:begin + rng.integers(1, max(2, lengths[row] // 8))] = 0.0
            mask[row, lengths[row] - 1] = 1.0
    log_probs = np.log(rng.uniform(0.05, 1.0, (rows, positions))).astype(np.float32)
    spp = np.clip(np.exp(2 * log_probs) + rng.uniform(0, 0.3, (rows, positions)), 0, 1).astype(np.float32)
    rewards = np.zeros((rows, positions), np.float32)
    rewards[np.arange(rows), lengths - 1] = rng.integers(0, 2, rows)
    ids = np.repeat(np.arange(prompts), samples)
    order = rng.permutation(rows)                        # balance_batch: a prompt's samples scattered over ranks
    return [np.ascontiguousarray(a[order]) for a in (rewards, mask, log_probs, spp)] + [ids[order]]


def _rank_rows(batch: list, size: int, rank: int) -> list:
    """Rank ``rank`` of ``size``'s rows of a :func:`_batch` (rewards, mask, log π, Σπ², ids) as torch tensors: its
    contiguous share of the shuffled rows, as the benchmark splits them everywhere."""
    import numpy as np
    import torch

    mine = np.array_split(np.arange(batch[0].shape[0]), size)[rank]
    return [torch.from_numpy(np.ascontiguousarray(a[mine])) for a in batch]


def _rank_piece(batch: list, size: int, rank: int) -> list:
    """Rank ``rank`` of ``size``'s column piece of a :func:`_batch` (rewards, mask, log π, Σπ², ids) as torch tensors:
    every row, its contiguous share of the positions (context parallel); the ids whole."""
    import numpy as np
    import torch

    columns = np.array_split(np.arange(batch[0].shape[1]), size)[rank]
    return [torch.from_numpy(np.ascontiguousarray(a[:, columns])) for a in batch[:4]] + [torch.from_numpy(batch[4])]


def _peak() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM"))


def _reset_peak() -> int:
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")                  # the high-water mark restarts at the current resident set (Linux ≥ 4.0)
    return _peak()


def _worker(rank: int, size: int, port: int, args: argparse.Namespace, out: object, memory: bool = False) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import numpy as np
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    from otb_torch import distributed as otb_dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size,
                            timeout=datetime.timedelta(seconds=120))
    # every collective otb_torch.distributed makes goes through these: time spent in gloo, issue and wait
    spent = [0.0]

    def timed(function):
        def call(*positional, **keywords):
            start = time.perf_counter()
            try:
                return function(*positional, **keywords)
            finally:
                spent[0] += time.perf_counter() - start
        return call

    gather_name = otb_dist._all_gather_name()                 # the all-gather the library calls, on this torch
    for name in ("all_reduce", "isend", "irecv"):        # all-reduces: gloo's, or one exchange over two ranks
        setattr(dist, name, timed(getattr(dist, name)))
    setattr(dist, gather_name, timed(getattr(dist, gather_name)))
    otb_dist._wait = timed(otb_dist._wait)
    # leave-one-out's dominant members: on how many cells of this rank (the exchange for them: as many over all ranks)
    dominance = {"mine": 0}
    sums_without_dominant, tops_out = otb_dist._sums_without_dominant, otb_dist._native.distributed_tops_out

    def recorded(mine, contributions, **keywords):                # the eager path, and the native one over P > 2
        dominance["mine"] = int(mine.numel())
        return sums_without_dominant(mine, contributions, **keywords)

    def recorded_tops(*arguments):                                # the native kernel's count (over two ranks, alone)
        count, owned = tops_out(*arguments)
        dominance["mine"] = count
        return count, owned

    otb_dist._sums_without_dominant, otb_dist._native.distributed_tops_out = recorded, recorded_tops

    def measure(call) -> dict:
        call()                                                          # warm-up
        if memory:                  # every block ≥ 64 KiB is mapped afresh here: the high-water mark sees them all
            dist.barrier()
            base = _reset_peak()
            result = call()
            return {"extra": _peak() - base - sum(value.numel() * value.element_size() for value in result)}
        gloo, mains = [], []

        def counted():              # each call's time in gloo and its calling thread's CPU time, timed with it
            spent[0] = 0.0
            main_start = time.thread_time()
            call()
            mains.append(time.thread_time() - main_start)
            gloo.append(spent[0])

        totals, cpu = _samples(counted, args.repeat, warm_up=0, before=dist.barrier)
        threads = [process - main for process, main in zip(cpu, mains)]   # the backend's threads (gloo's I/O loop
        locals_ = [total - comm for total, comm in zip(totals, gloo)]      # and work queues), 1 torch thread
        return {"total": statistics.median(totals), "gloo": statistics.median(gloo),
                "local": statistics.median(locals_), "cpu": statistics.median(cpu),
                "threads": statistics.median(threads),
                "caller cpu": statistics.median(process - other for process, other in zip(cpu, threads))}

    records = {}
    for prompts, samples, positions in args.sizes:
        for case in _OTB_CASES:
            holes = case.startswith("multi-turn")
            rewards, mask, log_probs, spp, ids = _batch(prompts, samples, positions, holes=holes)
            if case == "context parallel":
                *local, local_ids = _rank_piece([rewards, mask, log_probs, spp, ids], size, rank)
                options = dict(context_group=dist.group.WORLD)
            else:
                *local, local_ids = _rank_rows([rewards, mask, log_probs, spp, ids], size, rank)
                options = _data_parallel_options(case)
            dominance["mine"] = 0
            record = measure(lambda: otb_dist.distributed_token_baseline(
                local[0], local[1], local_ids, local[2], local[3], num_groups=prompts, **options))
            record["dominant cells, one rank"] = dominance["mine"]
            if not memory:                  # the same collectives with nothing computed: what gloo costs at least
                handshake, table = torch.zeros(19, dtype=torch.int64), torch.empty(19 * size, dtype=torch.int64)
                buffer = torch.zeros(_grid_planes(case) * prompts * positions + size * 4 * prompts + size)
                totals = torch.zeros(3 * rewards.shape[0] + (args.kernel != "eager"), dtype=torch.float64)  # verdict
                gathered = torch.empty(totals.numel() * size, dtype=torch.float64)

                mine = dominance["mine"]

                def collectives():
                    getattr(dist, gather_name)(table, handshake)
                    if case == "context parallel":
                        getattr(dist, gather_name)(gathered, totals)
                    else:
                        otb_dist._all_reduce(buffer, dist.ReduceOp.SUM, None, None)
                    if case == "leave-one-out" and not (size == 2 and args.kernel != "eager"):  # (2: the exchange)
                        # the dominant members' count, then their cells and sums
                        counts = otb_dist._all_gather(torch.tensor([mine]), None, None)
                        if int(counts.max()):
                            otb_dist._all_gather(torch.zeros(int(counts.max()), dtype=torch.int64), None, None)
                            otb_dist._all_reduce(torch.zeros(int(counts.sum()), 2), dist.ReduceOp.SUM, None, None)
                    return ()

                alone = measure(collectives)
                record["floor"], record["floor cpu"] = alone["total"], alone["cpu"]
                one = _one_process(case)         # the one-process kernel on this rank's rows, every rank at once
                alone = measure(lambda: one(local[0], local[1], local_ids, local[2], local[3]))
                record["concurrent"], record["concurrent cpu"] = alone["total"], alone["cpu"]

                def in_flight():            # the same with the handshake's all-gather travelling meanwhile, as a call
                    work = getattr(dist, gather_name)(table, handshake, async_op=True)     # overlaps its first sweep
                    result = one(local[0], local[1], local_ids, local[2], local[3])
                    work.wait()
                    return result

                record["handshake in flight"] = measure(in_flight)["total"]

                def exchange_in_flight():   # the call's communication posted first, then the rank's rows computed:
                    # as much overlap as any schedule of the same work gets (the call itself must finish its first
                    # sweep before it can send its grid)
                    if case == "context parallel":
                        works = [getattr(dist, gather_name)(gathered, totals, async_op=True)]
                    elif size == 2 and args.kernel != "eager":                     # the library's exchange
                        works = [dist.isend(buffer, 1 - rank, tag=1), dist.irecv(received, 1 - rank, tag=1)]
                    else:
                        works = [dist.all_reduce(buffer, async_op=True)]
                    result = one(local[0], local[1], local_ids, local[2], local[3])
                    for work in works:
                        work.wait()
                    return result

                received = torch.empty_like(buffer)
                record["exchange in flight"] = measure(exchange_in_flight)["total"]
            record["share"] = local[0].numel() / rewards.size
            records[(prompts, samples, positions, case)] = record
    if args.section in ("all", "vocab"):
        logits = torch.from_numpy(np.random.default_rng(1).normal(0, 3, (args.rows, args.vocab)).astype(np.float32))
        shard = logits[:, rank * (args.vocab // size):(rank + 1) * (args.vocab // size)].contiguous()
        token_ids = torch.from_numpy(np.random.default_rng(2).integers(0, args.vocab, args.rows))
        records["Σπ² vocab parallel"] = measure(lambda: (otb_dist.vocab_parallel_sum_pi_squared(shard),))
        records["log π, entropy, Σπ² vocab parallel"] = measure(
            lambda: tuple(otb_dist.vocab_parallel_token_statistics(shard, token_ids)))
    gathered = [None] * size
    dist.all_gather_object(gathered, records)
    if rank == 0:
        slowest = {}
        for key in records:
            per_rank = [table[key] for table in gathered]
            slowest[key] = {name: max(record[name] for record in per_rank) for name in per_rank[0]}
            slowest[key]["share"] = max(record.get("share", 1.0 / size) for record in per_rank)
            for name in ("floor cpu", "concurrent cpu", "caller cpu"):     # CPU times: all ranks together
                if name in per_rank[0]:
                    slowest[key][name + ", all ranks"] = sum(record[name] for record in per_rank)
            if "dominant cells, one rank" in per_rank[0]:
                slowest[key]["dominant cells"] = sum(record["dominant cells, one rank"] for record in per_rank)
        out.put(slowest)
    dist.destroy_process_group()


def _collect(workers: list, queue: object, count: int, timeout: float) -> list:
    """``count`` results from ``queue``, which the started ``workers`` fill; raises RuntimeError as soon as a worker
    exits with an error before the results are in, or after ``timeout`` seconds — and stops every worker still running
    either way, so that a failed worker never leaves the others (or this process) waiting for ever."""
    import queue as queues

    results, deadline = [], time.monotonic() + timeout
    try:
        while len(results) < count:
            try:
                results.append(queue.get(timeout=1.0))
            except queues.Empty:
                failed = [(index, worker.exitcode) for index, worker in enumerate(workers)
                          if worker.exitcode not in (None, 0)]
                if failed:
                    raise RuntimeError(f"bench_distributed: worker (index, exit code) {failed} failed; its error "
                                       "is printed above") from None
                if time.monotonic() > deadline:
                    raise RuntimeError(f"bench_distributed: no result from the workers after {timeout:.0f} s") \
                        from None
        for worker in workers:
            worker.join(timeout=60)
        return results
    finally:
        for worker in workers:
            if worker.is_alive():
                worker.terminate()
                worker.join(timeout=10)


_SHARING_KINDS = ("a loop in L1 cache (16 KiB)", "a 32 MiB copy", "the one-process kernel on the rank's rows")


def _sharing_worker(rank: int, size: int, barrier: object, kind: str, batch: tuple, repeat: int, out: object) -> None:
    """One process's part of :func:`_sharing`: ``kind`` timed ``repeat`` times, each call after a barrier of the
    processes running; puts (rank, median wall, median CPU, median minor page faults) per call."""
    os.environ["OMP_NUM_THREADS"] = "1"
    import resource

    import numpy as np
    import torch

    import otb_torch

    torch.set_num_threads(1)
    if kind == _SHARING_KINDS[0]:
        values = np.random.default_rng(rank).random(2048)

        def call():
            for _ in range(400):
                np.sqrt(values, out=values)
                np.multiply(values, 1.0000001, out=values)
    elif kind == _SHARING_KINDS[1]:
        source = np.ones(8 << 20, np.float32)
        target = np.empty_like(source)

        def call():
            np.copyto(target, source)
            np.copyto(target, source)
    else:
        rewards, mask, log_probs, spp, ids = _rank_rows(_batch(*batch), size, rank)

        def call():
            otb_torch.optimal_token_baseline(rewards, mask, ids, log_probs, spp)
    faults = []

    def counted():              # the minor page faults of each call (two getrusage calls timed with it: ~1 µs)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        call()
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)

    walls, cpus = _samples(counted, repeat, warm_up=5, before=barrier.wait)
    out.put((rank, statistics.median(walls), statistics.median(cpus), statistics.median(faults[5:])))


def _sharing(args: argparse.Namespace, context: object) -> dict:
    """What running at once costs P processes on this machine, with no collective: for each kind of work — a loop on
    16 KiB in L1 cache (the cores alone), a 32 MiB copy (caches and memory), and the self-inclusive one-process kernel
    on rank 0's rows of the first ``--sizes`` batch, the others' rows in the others (the ranks' rows, as in the table
    of the ranks) — the median over ``max(--repeat, 40)`` calls of rank 0 with no other process, then of rank 0 while
    the P processes each do their own part at once (the same rows: the ratio is sharing, not the ranks' imbalance);
    barrier before each call, one thread each. Keys are (kind, P); values ((alone wall, cpu, faults), (at once wall,
    cpu, faults))."""
    repeat = max(args.repeat, 40)
    found = {}
    for size in args.processes:
        for kind in _SHARING_KINDS:
            if kind == _SHARING_KINDS[2] and not args.sizes:
                continue
            figures = []
            for processes in (1, size):
                barrier, queue = context.Barrier(processes, timeout=300), context.Queue()
                workers = [context.Process(target=_sharing_worker, daemon=True, args=(
                    rank, size, barrier, kind, args.sizes[0] if args.sizes else None, repeat, queue))
                    for rank in range(processes)]
                for worker in workers:
                    worker.start()
                parts = _collect(workers, queue, len(workers), timeout=600)
                figures.append(next(part[1:] for part in parts if part[0] == 0))
            found[(kind, size)] = tuple(figures)
    return found


def _data_parallel_options(case: str) -> dict:
    """``distributed_token_baseline``'s options for a data-parallel ``case``."""
    return dict(leave_one_out=case == "leave-one-out",
                align="valid_token" if case.startswith("multi-turn") else "position")


def _one_process(case: str):
    """The one-process otb_torch function (native kernel on CPU) that computes what ``case`` does."""
    import otb_torch

    return {"leave-one-out": otb_torch.leave_one_out_token_baseline,
            "multi-turn (valid token)": otb_torch.multi_turn_optimal_token_baseline}.get(
        case, otb_torch.optimal_token_baseline)


def _samples(call, repeat: int, warm_up: int = 1, before=None) -> tuple[list[float], list[float]]:
    """(wall times, CPU times of all the process's threads) of the same ``repeat`` calls of ``call``, after ``warm_up``
    untimed ones; ``before`` (a barrier's wait, say), when given, runs untimed before each timed call."""
    for _ in range(warm_up):
        call()
    walls, cpus = [], []
    for _ in range(repeat):
        if before is not None:
            before()
        cpu, start = time.process_time(), time.perf_counter()
        call()
        walls.append(time.perf_counter() - start)
        cpus.append(time.process_time() - cpu)
    return walls, cpus


def _median_seconds(call, repeat: int, warm_up: int = 1) -> float:
    """Median wall time of ``repeat`` calls of ``call`` after ``warm_up`` untimed ones."""
    return statistics.median(_samples(call, repeat, warm_up)[0])


def _single(args: argparse.Namespace) -> dict:
    """The whole batch in one process, one thread (median of ``--repeat`` after one warm-up call, five for OTB); for
    OTB also the upper quartile of the same calls' wall times (key + ("q75",)) and the median of their CPU times
    (key + ("cpu",))."""
    import numpy as np
    import torch

    import otb_torch

    torch.set_num_threads(1)
    timed = lambda call: _median_seconds(call, args.repeat)  # noqa: E731
    results = {}
    for prompts, samples, positions in args.sizes:
        for case in _OTB_CASES:
            holes = case.startswith("multi-turn")
            rewards, mask, log_probs, spp, ids = (
                torch.from_numpy(a) if isinstance(a, np.ndarray) and a.dtype != np.int64 else a
                for a in _batch(prompts, samples, positions, holes=holes))
            function = _one_process(case)
            # five untimed calls first: the first case's first calls after start-up run up to 2× slower while the
            # heap grows, which one warm-up call does not cover
            walls, cpus = _samples(lambda: function(rewards, mask, ids, log_probs, spp), args.repeat, warm_up=5)
            key = (prompts, samples, positions, case)
            results[key], results[key + ("cpu",)] = statistics.median(walls), statistics.median(cpus)
            results[key + ("q75",)] = statistics.quantiles(walls, n=4)[2] if len(walls) > 1 else walls[0]
    if args.section in ("all", "vocab"):
        logits = torch.from_numpy(np.random.default_rng(1).normal(0, 3, (args.rows, args.vocab)).astype(np.float32))
        token_ids = torch.from_numpy(np.random.default_rng(2).integers(0, args.vocab, args.rows))
        results["Σπ² vocab parallel"] = timed(lambda: otb_torch.sum_pi_squared(logits))
        results["log π, entropy, Σπ² vocab parallel"] = timed(
            lambda: otb_torch.token_statistics_from_logits(logits, token_ids))
    return results


def _fixed_costs(args: argparse.Namespace) -> dict:
    """What a call costs whatever the batch: each case on one group of 2 rows × 16 positions, in a gloo world of one
    process (the collectives stay local; no peer to wait for) against the one-process function on the same rows —
    median of max(--repeat, 200) calls, one thread."""
    import datetime as _datetime

    import numpy as np
    import torch
    import torch.distributed as dist

    import otb_torch
    from otb_torch import distributed as otb_dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1,
                            timeout=_datetime.timedelta(seconds=60))
    try:
        timed = lambda call: _median_seconds(call, max(args.repeat, 200), warm_up=10)  # noqa: E731
        costs = {}
        for case in _OTB_CASES:
            holes = case.startswith("multi-turn")
            rewards, mask, log_probs, spp, ids = (torch.from_numpy(np.asarray(a)) for a in _batch(1, 2, 16, holes))
            options = (dict(context_group=dist.group.WORLD) if case == "context parallel" else
                       _data_parallel_options(case))
            one = _one_process(case)
            costs[case] = (
                timed(lambda: otb_dist.distributed_token_baseline(rewards, mask, ids, log_probs, spp, num_groups=1,
                                                                  **options)),
                timed(lambda: one(rewards, mask, ids, log_probs, spp)))
        ranks = args.processes[0]
        for prompts, samples, positions in args.sizes:      # a rank's rows, no peer: the protocol's own cost
            for case in _OTB_CASES:
                holes = case.startswith("multi-turn")
                batch = _batch(prompts, samples, positions, holes=holes)
                if case == "context parallel":                 # rank 0's column piece, a context group of one
                    rewards, mask, log_probs, spp, ids = _rank_piece(batch, ranks, 0)
                    options = dict(context_group=dist.group.WORLD)
                else:
                    rewards, mask, log_probs, spp, ids = _rank_rows(batch, ranks, 0)
                    options = _data_parallel_options(case)
                one = _one_process(case)
                costs[(prompts, samples, positions, case)] = (
                    _median_seconds(lambda: otb_dist.distributed_token_baseline(
                        rewards, mask, ids, log_probs, spp, num_groups=prompts, **options), args.repeat),
                    _median_seconds(lambda: one(rewards, mask, ids, log_probs, spp), args.repeat))
        return costs
    finally:
        dist.destroy_process_group()


def _grid_planes(case: str) -> int:
    """Planes of the grid a call sums over the ranks; context parallel (every rank holds every row, columns by
    position) sums none: each rank's cells are complete, each rank counts the group statistics, and the native
    kernel's value verdicts ride with the pieces' totals — its one blocking collective."""
    return 0 if case == "context parallel" else 3 if case == "leave-one-out" else 2


def _bytes_sent(key, size: int, args: argparse.Namespace, record: dict | None = None) -> int:
    """Bytes one rank sends, ring algorithms: all-reduce 2(P−1)/P·S, all-gather (P−1)/P·S (S: the result's size).
    The native path sends the group statistics ([P, 4, G]) and the value verdicts (P) in the grid's float32
    all-reduce; the eager path all-gathers the statistics as int64 (self-inclusive only) and checks values first.
    Context parallel (one context group of every rank) sums no grid and gathers no statistics. Leave-one-out adds
    each rank's count of dominant cells (all-gathered), and where there are any (``record``: the most on one rank,
    n over all ranks) the cells (all-gathered, padded to the most) and their sums (all-reduced, 2·n values)."""
    reduce, gather = 2 * (size - 1) / size, (size - 1) / size
    handshake = gather * size * 8 * 19                   # 19 integers per rank (fixed size)
    if isinstance(key, tuple):
        prompts, samples, positions, case = key
        G, K, B = prompts, positions, prompts * samples
        sent = handshake + reduce * _grid_planes(case) * G * K * 4
        if case == "context parallel":                   # the row pieces' totals (native: and the value verdict)
            sent += gather * size * (3 * B + (args.kernel != "eager")) * 8
        elif args.kernel != "eager":
            sent += reduce * (size * 4 * G + size) * 4   # the group statistics and verdicts, in the all-reduce
        if args.kernel == "eager" and case not in ("leave-one-out", "context parallel"):  # (whole rows: counted)
            sent += gather * size * 4 * G * 8            # the group statistics
        if case == "leave-one-out" and not (size == 2 and args.kernel != "eager"):   # two ranks: in the exchange
            sent += gather * size * 8
            if record and record["dominant cells"]:
                sent += gather * size * record["dominant cells, one rank"] * 8 + reduce * record["dominant cells"] * 8
        return int(sent)
    parts = 2 if key == "Σπ² vocab parallel" else 4
    return int(handshake + reduce * (args.rows + 2) * 4 + reduce * parts * args.rows * 4)


def _cores() -> int:
    """The CPUs this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _whole_call_verdict(record: dict, one: float, one_q75: float, one_cpu: float) -> str:
    """"Never slower than one process": met or not, and where not, whether this run's measured floor rules it out —
    where it reaches the one-process call's upper quartile ``one_q75`` (not only its median: a floor within the
    one-process call's own spread rules nothing out). The floor is the CPU work the call needs at least: the CPU time
    the batch's compute takes split as the ranks split it (the one-process kernel on each rank's rows — for context
    parallel its piece — the ranks at once, summed over the ranks; where that was not measured, the one-process
    call's CPU time ``one_cpu``) plus the CPU time
    the collectives alone take on every rank (the backend's threads copy every byte through the loopback sockets),
    over the machine's cores — a floor as long as a rank computes its rows with no less CPU than the one-process
    kernel does on them (the distributed path does the same arithmetic and more), which each run checks: where the
    CPU time of the calls' own threads (the caller's, summed over the ranks: the compute and the protocol's Python,
    not the backend's) is below the compute term, no floor is claimed.

    A second floor, named apart ("bounded by the overlap"), where the first is not reached: the rank's rows in the
    one-process kernel, the ranks at once, with the call's communication — the grid's exchange or all-reduce (for
    context parallel the totals' all-gather), the same bytes — posted before the compute and waited for after it.
    That is as much overlap of communication with compute as any schedule of the same work gets (the call itself can
    send its grid only after its first sweep, and its final sweep needs the sum), so a call takes at least as long, as
    long as it computes no less than the one-process kernel on its rows and sends no less than the grid; measured,
    not proved, and claimed only where it stays below the call's own time in the same run.

    Also printed, for scale and not as a floor: the gloo floor plus the rank's rows in the one-process kernel with
    the ranks at once (where that was not measured, its share of the one-process time) — a call overlaps its
    handshake with its first sweep, and the two maxima over the ranks may come from different ranks, so a call can
    take less."""
    ratio = f"({record['total'] / one:.2f}×)"
    if record["total"] <= one:
        return f"met {ratio}"
    serial = record["floor"] + record.get("concurrent", record["share"] * one)
    scale = f"gloo floor + the rank's compute, one after the other = {serial * 1e3:.2f} ms (not a floor)"
    overlap = record.get("exchange in flight")
    overlapped = "" if overlap is None else (
        f"; its rows in the one-process kernel with the call's exchange in flight from the start (ranks at once) "
        f"take {overlap * 1e3:.2f} ms")
    if "floor cpu, all ranks" not in record:
        return f"NOT met {ratio}; {scale}{overlapped}"
    compute = record.get("concurrent cpu, all ranks", one_cpu)
    work = (compute + record["floor cpu, all ranks"]) / _cores()
    verdict = "bounded" if work >= one_q75 else "not bounded"
    if record["caller cpu, all ranks"] < compute:      # the floor's assumption, checked on this run's calls
        verdict = (f"no floor (the calls' own threads used {record['caller cpu, all ranks'] * 1e3:.2f} ms of CPU, "
                   "less than the compute term)")
    if verdict != "bounded" and overlap is not None and one_q75 <= overlap <= record["total"]:
        verdict = (f"bounded by the overlap ({overlapped[2:]} ≥ one process's upper quartile {one_q75 * 1e3:.2f} ms); "
                   f"by CPU work, {verdict}")
        overlapped = ""
    return (f"NOT met {ratio}; {verdict}: CPU work at least = (compute {compute * 1e3:.2f} ms + collectives "
            f"{record['floor cpu, all ranks'] * 1e3:.2f} ms, all ranks) / {_cores()} cores = {work * 1e3:.2f} ms "
            f"against one process's upper quartile {one_q75 * 1e3:.2f} ms; {scale}{overlapped}")


def _local_verdict(record: dict, one: float, one_q75: float) -> str:
    """"Local compute ≤ 1.3 × share × one process": met or not, and where not, whether this run's measured floor rules
    it out — the rank's rows in the one-process kernel with the ranks running at once (no protocol, no collective:
    what sharing the machine's cores, caches and memory bandwidth leaves of the one-process speed; a measured floor,
    not a proved one: see the module's docstring). "bounded" where that figure reaches the bound taken at the
    one-process call's upper quartile ``one_q75`` (not only its median) and stays below the rank's local compute in
    the same run (where it does not, the run itself contradicts it as a floor). For context parallel, its column
    piece as a batch of its own: the same tokens, rows and groups without the other pieces' offsets, which the
    distributed path adds on top. Where that floor stays below the bound, the same kernel with the handshake's
    all-gather in flight is tried as a second one, named apart ("bounded with the handshake"): the protocol checks
    every rank's options, shapes and verdict before any result (so that bad input raises on every rank instead of
    hanging) and overlaps that check with its first sweep, and what the transport's threads then take from the
    compute is communication's cost inside the local time."""
    bound = 1.3 * record["share"] * one
    ratio = f"({record['local'] / (record['share'] * one):.2f}×)"
    if record["local"] <= bound:
        return f"{bound * 1e3:.2f} ms: met {ratio}"
    if "concurrent" not in record:
        return f"{bound * 1e3:.2f} ms: NOT met {ratio}"
    alone = f"its rows in the one-process kernel, ranks at once, take {record['concurrent'] * 1e3:.2f} ms"
    if record["concurrent"] > record["local"]:
        return f"{bound * 1e3:.2f} ms: NOT met {ratio}; no floor: {alone}, more than the call's local compute"
    upper = 1.3 * record["share"] * one_q75
    if record["concurrent"] >= upper:
        return (f"{bound * 1e3:.2f} ms: NOT met {ratio}; bounded: {alone} ≥ the bound at the one-process call's upper "
                f"quartile, {upper * 1e3:.2f} ms")
    flight = record.get("handshake in flight")
    if flight is not None and upper <= flight <= record["local"]:
        return (f"{bound * 1e3:.2f} ms: NOT met {ratio}; bounded with the handshake: {alone}, with the handshake's "
                f"all-gather in flight {flight * 1e3:.2f} ms ≥ the bound at the one-process call's upper quartile, "
                f"{upper * 1e3:.2f} ms")
    return f"{bound * 1e3:.2f} ms: NOT met {ratio}; not bounded: {alone}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, nargs="+", default=[2])
    parser.add_argument("--sizes", default="64x8x2048", help="comma-separated PROMPTSxSAMPLESxPOSITIONS")
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--section", default="all", choices=["all", "otb", "vocab"])
    parser.add_argument("--rows", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--kernel", default="auto", choices=["auto", "eager"],
                        help="the native CPU kernel where it builds (auto), or the eager kernels (OTB_TORCH_NATIVE=0)")
    args = parser.parse_args()
    args.sizes = [tuple(int(x) for x in size.split("x")) for size in args.sizes.split(",")] \
        if args.section != "vocab" else []
    if args.kernel == "eager":
        os.environ["OTB_TORCH_NATIVE"] = "0"             # read once per process: the spawned workers inherit it
    import torch

    import otb_torch

    status = otb_torch.native_kernel_status()
    print(f"# gloo on loopback, {_cores()} CPUs for this process (of {os.cpu_count()}), torch {torch.__version__}, "
          "one thread per process; kernel: "
          + (f"native ({status.path})" if status.available else f"eager ({status.reason})")
          + f"; median of {args.repeat}; load average {os.getloadavg()[0]:.2f} at start")
    single = _single(args)
    fixed = _fixed_costs(args) if args.section in ("all", "otb") else {}
    context = multiprocessing.get_context("spawn")
    sharing = _sharing(args, context) if args.section in ("all", "otb") else {}
    results = {}
    for size in args.processes:
        for memory in (False, True):
            saved = {name: os.environ.get(name) for name in _FIXED_MAPPING}
            if memory:                  # the memory pass: spawned workers read these when their allocator starts
                os.environ.update(_FIXED_MAPPING)
            try:
                queue = context.Queue()
                port = _free_port()
                workers = [context.Process(target=_worker, daemon=True,
                                           args=(rank, size, port, args, queue, memory)) for rank in range(size)]
                for worker in workers:
                    worker.start()
                found = _collect(workers, queue, 1, timeout=1200)[0]
            finally:
                for name, value in saved.items():
                    if value is None:
                        os.environ.pop(name, None)
                    else:
                        os.environ[name] = value
            if memory:
                for key, record in found.items():
                    results[size][key]["extra"] = record["extra"]
            else:
                results[size] = found
    ms = lambda seconds: f"{seconds * 1e3:.2f} ms"  # noqa: E731
    if fixed:
        print("\n### What a call costs whatever the batch (1 group × 2 rows × 16 positions, a gloo world of one)\n")
        print("| case | distributed_token_baseline | the one-process function | difference |\n|---|---|---|---|")
        for case, (distributed, one) in fixed.items():
            if not isinstance(case, tuple):
                print(f"| {case} | {ms(distributed)} | {ms(one)} | {ms(distributed - one)} |")
        print(f"\n### A rank's rows without a peer (rank 0's rows of {args.processes[0]}; context parallel: its column "
              "piece, a context group of one; a gloo world of one)\n")
        print("| batch | case | distributed_token_baseline | the one-process function, same rows | ratio |\n"
              "|---|---|---|---|---|")
        for key, (distributed, one) in fixed.items():
            if isinstance(key, tuple):
                prompts, samples, positions, case = key
                print(f"| {prompts}×{samples}×{positions} | {case} | {ms(distributed)} | {ms(one)} | "
                      f"{distributed / one:.2f} |")
    if sharing:
        first = "×".join(str(n) for n in args.sizes[0])
        print(f"\n### What running at once costs P processes here, with no collective (each its own part; the kernel "
              f"on rank k's rows of {first}; median of {max(args.repeat, 40)} calls of rank 0, alone and with the "
              "others)\n")
        print("| P | work | rank 0 alone | rank 0, P at once | ratio | minor page faults per call, alone / at once |\n"
              "|---|---|---|---|---|---|")
        for (kind, size), (alone, together) in sharing.items():
            print(f"| {size} | {kind} | {ms(alone[0])} | {ms(together[0])} | {together[0] / alone[0]:.2f} | "
                  f"{alone[2]:.0f} / {together[2]:.0f} |")
    for size, slowest in results.items():
        print(f"\n### P = {size} ranks (medians; each column the largest over the ranks)\n")
        print("| batch | case | one process | rank's share | local compute | ≤ 1.3 × share × one process | "
              "its rows, one-process kernel, ranks at once | local ÷ that | gloo | gloo floor | backend threads' CPU | "
              "whole call | ≤ one process | sent/rank | extra peak memory/rank |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        for key, record in slowest.items():
            if not isinstance(key, tuple):
                continue
            prompts, samples, positions, case = key
            one = single[key]
            print(f"| {prompts}×{samples}×{positions} | {case} | {ms(one)} | {record['share']:.2f} | "
                  f"{ms(record['local'])} | {_local_verdict(record, one, single[key + ('q75',)])} | "
                  + (f"{ms(record['concurrent'])} | {record['local'] / record['concurrent']:.2f} | "
                     if "concurrent" in record else "— | — | ")
                  + f"{ms(record['gloo'])} | "
                  f"{ms(record['floor'])} | {ms(record['threads'])} | {ms(record['total'])} | "
                  f"{_whole_call_verdict(record, one, single[key + ('q75',)], single[key + ('cpu',)])} | "
                  f"{_bytes_sent(key, size, args, record) / 2**20:.2f} MiB | {record['extra'] / 2**20:.2f} MiB |")
        dominant = [(key, record) for key, record in slowest.items() if isinstance(key, tuple)
                    and key[3] == "leave-one-out"]
        for (prompts, samples, positions, _), record in dominant:
            print(f"\nLeave-one-out, {prompts}×{samples}×{positions}: {record['dominant cells']} dominant cells (a "
                  f"member's weight above ¾ of its cell's D) over the ranks, at most "
                  f"{record['dominant cells, one rank']} on one rank, of {prompts * positions} cells.")
        print("\nWhat communication in flight costs a rank's compute: its rows in the one-process kernel, ranks at "
              "once (as above), alone, with a 19-integer all-gather over the ranks started before it and waited for "
              "after it (a call overlaps its handshake with its first sweep so), and with the call's own exchange of "
              "the grid (context parallel: the totals' all-gather) so — as much overlap as any schedule gets, the "
              "whole call's second floor — beside the collectives alone:\n")
        print("| batch | case | ranks at once | with the all-gather in flight | difference | with the call's exchange "
              "in flight | gloo floor |\n|---|---|---|---|---|---|---|")
        for key, record in slowest.items():
            if isinstance(key, tuple) and "handshake in flight" in record:
                prompts, samples, positions, case = key
                print(f"| {prompts}×{samples}×{positions} | {case} | {ms(record['concurrent'])} | "
                      f"{ms(record['handshake in flight'])} | "
                      f"{ms(record['handshake in flight'] - record['concurrent'])} | "
                      f"{ms(record['exchange in flight'])} | {ms(record['floor'])} |")
        vocab = [key for key in slowest if not isinstance(key, tuple)]
        if vocab:
            print("\n| vocab parallel | one process | whole call | gloo | sent/rank | extra peak memory/rank |\n"
                  "|---|---|---|---|---|---|")
            for key in vocab:
                record = slowest[key]
                print(f"| {key} | {ms(single[key])} | {ms(record['total'])} | {ms(record['gloo'])} | "
                      f"{_bytes_sent(key, size, args) / 2**20:.2f} MiB | {record['extra'] / 2**20:.2f} MiB |")


if __name__ == "__main__":
    main()
