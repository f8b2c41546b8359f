"""A pool of real torch.distributed processes (gloo on loopback) for the distributed tests, bounded in time.

Four processes are spawned once per test module and kept; each test sends every rank a task (a function of
``otb_torch.distributed`` and its per-rank arguments as NumPy arrays) and collects every rank's result or exception.
Process groups, created once at start-up in every process (``new_group`` is collective):

* ``"world"``   — all four ranks; ``group=None``, no context split (data parallel over 4 ranks);
* ``"three"``   — ranks 0–2 as ``group`` (data parallel over 3 ranks; rank 3 sits out);
* ``"two"``     — ranks 0–1 as ``group`` (ranks 2–3 sit out);
* ``"last two"`` — ranks 2–3 as ``group`` (ranks 0–1 sit out: a group's ranks 0–1 are not the global ones);
* ``"context"`` — all four ranks as one context group (rows cut along T in four pieces);
* ``"context two"`` — ranks 0–1 as ``group`` and as its context group (rows cut in two pieces; ranks 2–3 sit out);
* ``"mesh"``    — a 2 × 2 mesh: context pairs {0, 1} and {2, 3}, the batch split over the pairs (rank = 2·d + c);
* ``"mesh-broken"`` — the mesh, but rank 1 forgets its context group (every rank must raise).

The task ``"native_kernel_status"`` answers whether a rank has otb_torch's native kernel. A task's arguments may hold
``_eager=True``: that rank then runs under ``otb_torch._native.eager_only()`` (the eager
kernels, as without a C compiler); otherwise otb_torch's native CPU kernel runs where it is built. ``_float32_exact_below=N``
lowers, for that call, the bound below which the native path's float32 all-reduce carries the group statistics
(``otb_torch.distributed._FLOAT32_EXACT_BELOW``, 2²⁴): N = 1 takes the all-gather that batches of 2²⁴ rows or
positions need. ``_count_reduced=True`` makes the rank answer ``(result, values, widths)``: ``values`` the number of
values the call passed to ``otb_torch.distributed._all_reduce`` (every SUM and MAX of the module goes through it, but
leave-one-out's grid over two ranks: its ``_exchange``, counted too),
``widths`` the list of the column counts of the grids the native kernel's calls allocated, in order
(``otb_torch._native._grid``; empty on the eager path).

A task that does not answer within ``timeout`` seconds fails the test and the pool is restarted; collectives inside
the processes time out after ``COLLECTIVE_TIMEOUT`` seconds (the process groups' timeout), so nothing can hang.
"""

from __future__ import annotations

import contextlib
import datetime
import multiprocessing
import os
import queue
import socket
import traceback
from typing import Any

import numpy as np

WORLD_SIZE = 4
COLLECTIVE_TIMEOUT = 30.0
LAYOUTS = ("world", "three", "two", "last two", "context", "context two", "mesh", "mesh-broken")


def free_port() -> int:
    """A TCP port on loopback that was free a moment ago (for a process group's rendezvous)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def run_rank_processes(commands: list[list[str]], directory: Any, environment: dict, timeout: float) -> list:
    """Run one process per command (a rank each) and wait at most ``timeout`` seconds for all of them; on timeout kill
    every one's process group and raise TimeoutError. Each writes its output to ``directory``/rank{i}.log — a file, not
    a pipe read one rank after the other, in which a rank could fill its pipe and block the others in a collective.
    Returns (return code, output) per rank."""
    import signal
    import subprocess
    import time

    logs = [os.path.join(str(directory), f"rank{rank}.log") for rank in range(len(commands))]
    processes = []
    for command, log in zip(commands, logs):
        with open(log, "w") as sink:
            processes.append(subprocess.Popen(command, env=environment, stdout=sink, stderr=subprocess.STDOUT,
                                              start_new_session=True))
    deadline = time.monotonic() + timeout
    try:
        for process in processes:
            process.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        for process in processes:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
        raise TimeoutError(f"{len(commands)} rank processes did not finish within {timeout:.0f} s") from None
    results = []
    for process, log in zip(processes, logs):
        with open(log) as source:
            results.append((process.returncode, source.read()))
    return results


def _worker(rank: int, port: int, inbox: Any, outbox: Any) -> None:  # pragma: no cover - runs in the children
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    import otb_torch.distributed as otb_dist
    from otb_torch import _native

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD_SIZE,
                            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT))
    three = dist.new_group([0, 1, 2])
    two = dist.new_group([0, 1])
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    layouts = {
        "world": (rank < 4, dict(group=None)),
        "three": (rank < 3, dict(group=three)),
        "two": (rank < 2, dict(group=two)),
        "last two": (rank >= 2, dict(group=pairs[1])),
        "context": (True, dict(group=None, context_group=dist.group.WORLD)),
        "context two": (rank < 2, dict(group=two, context_group=two)),
        "mesh": (True, dict(group=None, context_group=pairs[rank // 2])),
        "mesh-broken": (True, dict(group=None, context_group=None if rank == 1 else pairs[rank // 2])),
    }
    outbox.put((rank, "ready", None))
    while True:
        message = inbox.get()
        if message is None:
            break
        name, layout, arguments = message
        taking_part, groups = layouts[layout]
        if not taking_part or arguments is None:
            outbox.put((rank, "ok", None))
            continue
        try:
            function = (lambda **_: _native.native_kernel_status().available) if name == "native_kernel_status" else \
                getattr(otb_dist, name)
            arguments = dict(arguments)
            kernel = _native.eager_only() if arguments.pop("_eager", False) else contextlib.nullcontext()
            exact_below = arguments.pop("_float32_exact_below", otb_dist._FLOAT32_EXACT_BELOW)
            reduced, all_reduce, grids, make_grid = [0], otb_dist._all_reduce, [], _native._grid
            exchange, inside = otb_dist._exchange, [False]
            count_reduced = arguments.pop("_count_reduced", False)

            def counting(tensor, *rest, reduced=reduced, all_reduce=all_reduce, inside=inside):
                reduced[0] += tensor.numel()
                inside[0] = True
                try:
                    return all_reduce(tensor, *rest)
                finally:
                    inside[0] = False

            def exchanging(tensor, *rest, reduced=reduced, exchange=exchange, inside=inside):
                if not inside[0]:                  # a direct exchange (leave-one-out's grid over two ranks)
                    reduced[0] += tensor.numel()
                return exchange(tensor, *rest)

            def recording(num_groups, planes, columns, *rest, grids=grids, make_grid=make_grid):
                grids.append(columns)
                return make_grid(num_groups, planes, columns, *rest)
            call = {key: torch.from_numpy(value) if isinstance(value, np.ndarray) and value.dtype.kind in "biuf" else value
                    for key, value in arguments.items()}
            if name in ("vocab_parallel_token_statistics", "vocab_parallel_sum_pi_squared", "global_group_ids"):
                groups = {"group": groups.get("group")}
            elif name == "context_parallel_returns_and_energy":
                groups = {"context_group": groups.get("context_group", groups.get("group"))}
            saved, otb_dist._FLOAT32_EXACT_BELOW = otb_dist._FLOAT32_EXACT_BELOW, exact_below
            otb_dist._all_reduce, otb_dist._exchange, _native._grid = counting, exchanging, recording
            try:
                with kernel:
                    result = function(**call, **groups)
            finally:
                otb_dist._FLOAT32_EXACT_BELOW, otb_dist._all_reduce, _native._grid = saved, all_reduce, make_grid
                otb_dist._exchange = exchange
            outbox.put((rank, "ok", _to_numpy((result, reduced[0], grids) if count_reduced else result)))
        except Exception as exc:  # reported to the parent, which decides
            outbox.put((rank, "error", (type(exc).__name__, str(exc), traceback.format_exc())))
    dist.destroy_process_group()


def _to_numpy(value: Any) -> Any:
    import torch

    if isinstance(value, torch.Tensor):
        return value.detach().cpu().numpy()
    if isinstance(value, tuple):
        converted = [_to_numpy(item) for item in value]
        return type(value)(*converted) if hasattr(value, "_fields") else tuple(converted)
    return value


class Pool:
    """Four gloo processes; :meth:`run` sends one task to every rank and returns the ranks' outcomes in rank order:
    ``("ok", result)`` or ``("error", (type name, message, traceback))``."""

    def __init__(self, timeout: float = 120.0):
        self.timeout = timeout
        self._start()

    def _start(self) -> None:
        context = multiprocessing.get_context("spawn")
        port = free_port()
        self.inboxes = [context.Queue() for _ in range(WORLD_SIZE)]
        self.outbox = context.Queue()
        self.processes = [context.Process(target=_worker, args=(rank, port, self.inboxes[rank], self.outbox),
                                          daemon=True) for rank in range(WORLD_SIZE)]
        for process in self.processes:
            process.start()
        self._collect("start-up")

    def _collect(self, what: str) -> list[tuple[str, Any]]:
        outcomes: list[Any] = [None] * WORLD_SIZE
        for _ in range(WORLD_SIZE):
            try:
                rank, status, payload = self.outbox.get(timeout=self.timeout)
            except queue.Empty:
                self.restart()
                raise AssertionError(f"distributed pool: no answer within {self.timeout} s ({what}); a rank hung "
                                     "or died — the pool was restarted") from None
            outcomes[rank] = (status, payload)
        return outcomes

    def run(self, name: str, layout: str, arguments: list[dict | None]) -> list[tuple[str, Any]]:
        """Call ``otb_torch.distributed.<name>(**arguments[rank], <layout's groups>)`` on every rank."""
        assert layout in LAYOUTS and len(arguments) == WORLD_SIZE
        for rank, inbox in enumerate(self.inboxes):
            inbox.put((name, layout, arguments[rank]))
        outcomes = self._collect(f"{name} on layout {layout!r}")
        if any(status == "error" and payload[0] in ("RuntimeError", "DistBackendError") for status, payload in
               outcomes):
            self.restart()          # a failed collective leaves the process group unusable
        return outcomes

    def restart(self) -> None:
        self.close()
        self._start()

    def close(self) -> None:
        for inbox in self.inboxes:
            try:
                inbox.put(None)
            except Exception:
                pass
        for process in self.processes:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
                process.join(timeout=10)
