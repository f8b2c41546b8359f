"""The native CPU kernel of otb_torch (``_kernel.c``): built on first use, loaded with ctypes.

Eager PyTorch needs ~17 passes over each block (two scans, an exp, a dozen elementwise ops and reductions); the
kernel does a group in one sweep per member plus one for the advantages, reading the inputs in place in any row
order (no gather, no scatter), so its cost is close to the memory floor. It serves self-inclusive OTB (with its zero
rules) and leave-one-out OTB, aligned by position or by valid token (:func:`grouped`), and the per-rank compute of
``otb_torch.distributed`` (:func:`distributed_first`, :func:`distributed_offsets`, :func:`distributed_final`). The
math is the eager kernels' (:mod:`otb_torch._core`), which is the reference's; the equivalence suites run both.

Build: the C compiler Python was built with (``$CC`` overrides), ``-O3 -ffp-contract=off`` (plus ``-mavx2`` where
torch reports AVX2 on this CPU), into ``$OTB_TORCH_CACHE`` (default ``$XDG_CACHE_HOME/otb-spec`` or
``~/.cache/otb-spec``; else ``<tmp>/otb-spec-<uid>``; only a directory that is ours and writable by no one else) under
a name that hashes the source, the compiler, the flags and the platform; a few seconds, once per machine. Without a
compiler, or with ``OTB_TORCH_NATIVE=0`` (read once per process), the eager kernel runs instead:
:func:`native_kernel_status` says which and why.
"""

from __future__ import annotations

import ctypes
import hashlib
import mmap
import os
import platform
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor, wait
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ContextManager, Iterator, NamedTuple, Sequence

import numpy as np
import torch

from otb_spec.tolerances import DOMINANT_SHARE

__all__ = ["NativeKernelStatus", "native_kernel_status"]

_SOURCE = Path(__file__).with_name("_kernel.c")
_FLAGS = ("-O3", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math", "-fPIC", "-shared")
_COMPUTE = {torch.float32: "float32", torch.float64: "float64"}
_MASKS = {torch.bool: "bool", torch.uint8: "bool", torch.int32: "int32", torch.int64: "int64",
          torch.float32: "float32", torch.float64: "float64"}


@dataclass(frozen=True)
class NativeKernelStatus:
    """Whether ``otb_torch`` runs its native CPU kernel: ``available``, the shared library's ``path``, and the
    ``reason`` when it does not (disabled, no compiler, or the compiler's error)."""

    available: bool
    path: str | None
    reason: str


_LOCK = threading.Lock()
_STATE: dict[str, object] = {}


def _compiler() -> list[str] | None:
    command = os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc"
    words = shlex.split(command)
    if not words or shutil.which(words[0]) is None:
        words = ["cc"]
    return words if shutil.which(words[0]) is not None else None


def _cache_directory() -> Path:
    configured = os.environ.get("OTB_TORCH_CACHE")
    if configured:
        return Path(configured)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "otb-spec"


def _variants() -> list[tuple[str, ...]]:
    """Flag sets to try, best first: with AVX2 where torch found it on this CPU, then the architecture's baseline."""
    avx2 = platform.machine().lower() in ("x86_64", "amd64") and torch.backends.cpu.get_cpu_capability() in (
        "AVX2", "AVX512")
    return ([_FLAGS + ("-mavx2",)] if avx2 else []) + [_FLAGS]


def _private(directory: Path) -> bool:
    """True if ``directory`` exists (created 0700 if need be), is ours and no one else can write to it: a library
    found there is trusted and loaded, so a directory another user controls must not be used."""
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        info = directory.stat()
    except OSError:
        return False
    return info.st_uid == os.getuid() and not info.st_mode & 0o022


def _compile(compiler: list[str], flags: tuple[str, ...] | list[str], target: Path, source: Path = _SOURCE
             ) -> str | None:
    """Compile ``source`` (the kernel; tests pass variants of it) into ``target`` through a temporary file and an
    atomic rename (concurrent builds agree on the result); None on success, else the compiler's error."""
    handle, partial = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(handle)
    try:
        result = subprocess.run(compiler + list(flags) + [str(source), "-o", partial, "-lm"],
                                capture_output=True, text=True, timeout=300)
        if result.returncode != 0:
            return f"{' '.join(compiler + list(flags))}: {result.stderr.strip()[-2000:]}"
        os.replace(partial, target)
        return None
    finally:
        if os.path.exists(partial):
            os.unlink(partial)


def _build_and_load(compiler: list[str]) -> tuple[ctypes.CDLL, Path]:
    """The library for this source, compiler and CPU: loaded from the cache, or compiled into it (once more if a
    cached file does not load, e.g. a home directory shared with a machine of another C library)."""
    source = _SOURCE.read_bytes()
    version = subprocess.run(compiler + ["--version"], capture_output=True, text=True, timeout=60).stdout
    errors = []
    directories = [directory for directory in (_cache_directory(), Path(tempfile.gettempdir()) /
                                               f"otb-spec-{os.getuid()}") if _private(directory)]
    if not directories:
        raise RuntimeError(f"no private writable cache directory ({_cache_directory()}, or one in the temporary "
                           "directory); set OTB_TORCH_CACHE")
    for flags in _variants():
        key = hashlib.sha256(b"\0".join([source, version.encode(), " ".join(compiler + list(flags)).encode(),
                                         platform.machine().encode(), sys.platform.encode()])).hexdigest()[:20]
        for directory in directories:
            target = directory / f"otb_kernel-{key}.so"
            if target.exists():
                try:
                    return ctypes.CDLL(str(target)), target
                except OSError as exc:                       # built elsewhere, or damaged: build it again
                    errors.append(f"{target}: {exc}")
            try:
                error = _compile(compiler, flags, target)
            except (OSError, subprocess.SubprocessError) as exc:
                errors.append(f"{directory}: {exc}")
                continue                                     # this directory failed: try the next
            if error is not None:
                errors.append(error)
                break                                        # the compiler rejects these flags: try the next set
            try:
                return ctypes.CDLL(str(target)), target
            except OSError as exc:
                errors.append(f"{target}: {exc}")
    raise RuntimeError("; ".join(errors))


def _load() -> tuple[ctypes.CDLL | None, NativeKernelStatus]:
    with _LOCK:
        if "status" not in _STATE:
            library, status = None, None
            if os.environ.get("OTB_TORCH_NATIVE", "1").strip() == "0":
                status = NativeKernelStatus(False, None, "disabled by OTB_TORCH_NATIVE=0")
            elif sys.platform == "win32":
                status = NativeKernelStatus(False, None, "not built on Windows")
            else:
                compiler = _compiler()
                if compiler is None:
                    status = NativeKernelStatus(False, None, "no C compiler found ($CC, or cc on PATH)")
                else:
                    try:
                        library, path = _build_and_load(compiler)
                        status = NativeKernelStatus(True, str(path), "")
                    except Exception as exc:                 # any failure: the eager kernel runs
                        status = NativeKernelStatus(False, None, f"build failed: {exc}")
            _STATE["library"], _STATE["status"] = library, status
        return _STATE["library"], _STATE["status"]          # type: ignore[return-value]


def native_kernel_status() -> NativeKernelStatus:
    """Build or load the native kernel if not done yet, and say whether the OTB functions (and
    ``otb_torch.distributed``'s per-rank compute) use it on CPU (float32/float64 computation, eager mode)."""
    return _load()[1]


_CHOICE = threading.local()


@contextmanager
def choosing(name: str) -> Iterator[None]:
    """Within this block (in this thread), the kernel choice ``name`` is on (:func:`chosen`): ``"eager"``
    (:func:`eager_only`) or ``"accelerator_blocks"`` (``otb_torch._otb.blocks_as_on_accelerators``)."""
    previous = chosen(name)
    setattr(_CHOICE, name, True)
    try:
        yield
    finally:
        setattr(_CHOICE, name, previous)


def chosen(name: str) -> bool:
    """Whether the kernel choice ``name`` is on in this thread (:func:`choosing`)."""
    return getattr(_CHOICE, name, False)


def eager_only() -> ContextManager[None]:
    """Within this block (in this thread), the eager kernel runs even where the native one could: for the tests
    and the ``torch-cpu-eager`` adapter, which keep the fallback proven equal to the reference."""
    return choosing("eager")


def usable(device: torch.device, dtype: torch.dtype) -> bool:
    """True if the native kernel serves a CPU computation in ``dtype``."""
    return (device.type == "cpu" and dtype in _COMPUTE and not chosen("eager")
            and _load()[0] is not None)


_POOL: dict[int, ThreadPoolExecutor] = {}


def _after_fork_in_child() -> None:
    """A forked child has none of the parent's pool threads (a pool copied with it would wait for them forever) and
    may hold a copy of a lock taken at fork time: start both afresh."""
    global _LOCK
    _LOCK = threading.Lock()
    _POOL.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _pool(workers: int) -> ThreadPoolExecutor:
    with _LOCK:
        if workers not in _POOL:
            _POOL[workers] = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="otb-native")
        return _POOL[workers]


def _pointer(value: torch.Tensor | None) -> ctypes.c_void_p:
    return ctypes.c_void_p(None if value is None else value.data_ptr())


def group_offsets(runs, rows: int) -> np.ndarray:
    """[G + 1] int64: where each group starts in the plan's order (runs of equal-size groups, in order)."""
    starts = [run.start + run.size * np.arange(run.count, dtype=np.int64) for run in runs]
    return np.concatenate(starts + [np.array([rows], dtype=np.int64)])


ELEMENTS_PER_SHARE = 65536      # a batch gets min(torch threads, elements / this) shares: small ones stay on one thread


def plan_problem(order: torch.Tensor | None, offsets: np.ndarray, rows: int) -> str | None:
    """Why (order, offsets) cannot drive the kernel over ``rows`` rows — it would read or write outside the batch,
    or race — or None: offsets strictly increasing from 0 to ``rows``, ``order`` None or a permutation of the rows."""
    if offsets.shape[0] < 2 or offsets[0] != 0 or offsets[-1] != rows or np.any(np.diff(offsets) <= 0):
        return f"its groups cover {int(offsets[-1]) if offsets.shape[0] else 0} rows in {offsets.shape[0] - 1} " \
               f"groups, but the batch has {rows} rows"
    if order is not None:
        if order.dim() != 1 or order.shape[0] != rows:
            return f"its order lists {order.shape[0] if order.dim() == 1 else tuple(order.shape)} rows, " \
                   f"the batch has {rows}"
        if order.is_floating_point() or int(order.min()) < 0 or int(order.max()) >= rows or not bool(
                (torch.bincount(order.to(torch.int64), minlength=rows) == 1).all()):
            return "its order is not a permutation of the batch's rows"
    return None


def shares(offsets: np.ndarray, workers: int) -> list[int]:
    """Group bounds 0 = b₀ < b₁ < … < b_k = G (k ≤ ``workers``) cutting the groups into whole-group shares of about
    equal numbers of rows; thread j computes groups b_j … b_{j+1} − 1."""
    groups, rows = offsets.shape[0] - 1, int(offsets[-1])
    if workers <= 1:
        return [0, groups]
    cuts = np.searchsorted(offsets, np.linspace(0, rows, workers + 1)[1:-1], side="left")
    return [0] + sorted({int(cut) for cut in cuts} - {0, groups}) + [groups]


def _function(kind: str, dtype: torch.dtype, mask: torch.Tensor, result: Any = ctypes.c_int):
    """The entry point ``otb_<kind>_<compute type>_<mask type>`` of the library."""
    function = getattr(_load()[0], f"otb_{kind}_{_COMPUTE[dtype]}_{_MASKS[mask.dtype]}")
    function.restype = result
    return function


def _inputs(dtype: torch.dtype, mask: torch.Tensor, *floats: torch.Tensor | None
            ) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
    """The mask as it is when its dtype has a kernel (else in ``dtype``) and the float inputs in ``dtype``, all
    contiguous."""
    mask = mask.contiguous() if mask.dtype in _MASKS else mask.to(dtype).contiguous()
    return mask, [None if value is None else value.to(dtype).contiguous() for value in floats]


def _in_parallel(work: Callable[[int], int], count: int) -> list[int]:
    """work(0), …, work(count − 1): share 0 on the calling thread, the others on the pool. Returns their results
    after every share has returned, also on an error or interrupt (never free what a thread still writes to)."""
    if count == 1:
        return [work(0)]
    pool = _pool(count - 1)
    others = [pool.submit(work, share) for share in range(1, count)]
    try:
        return [work(0)] + [future.result() for future in others]
    finally:
        wait(others)


# madvise(MADV_POPULATE_WRITE) (Linux ≥ 5.14; the generic value, x86-64's and ARM64's): map a range's pages
# writable in one call. A kernel's fresh outputs otherwise fault in one 4 KiB page at a time, at first write — in the
# row order of the groups, between the arithmetic; in bulk the same pages cost less (a call's page faults were 30–34
# ms of a 60 ms single-threaded call at 256 × 8 × 4096, 21 ms populated: docs/performance.md). Only a hint: any
# failure (older kernel, another system) leaves the pages to fault in as before.
_MADV_POPULATE_WRITE = 23
_PAGE = mmap.PAGESIZE          # 4 KiB on x86-64; 4, 16 or 64 KiB on ARM64 kernels


def _memory_calls() -> tuple[Any, Any] | None:
    """libc's (madvise, mincore) where populating is known to work (Linux on x86-64 or ARM64), else None; looked up
    once."""
    if "memory calls" not in _STATE:
        calls = None
        if sys.platform.startswith("linux") and platform.machine() in ("x86_64", "aarch64"):
            try:
                libc = ctypes.CDLL(None, use_errno=True)
                madvise, mincore = libc.madvise, libc.mincore
                madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
                mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
                madvise.restype = mincore.restype = ctypes.c_int
                calls = (madvise, mincore)
            except (OSError, AttributeError):
                calls = None
        _STATE["memory calls"] = calls
    return _STATE["memory calls"]


def populate(outputs: Sequence[torch.Tensor | None], share: int = 0, shares: int = 1) -> None:
    """Map part ``share`` of ``shares`` of the whole pages inside each contiguous CPU tensor of ``outputs`` (the
    parts: consecutive runs of equal page counts, together every whole page once) before a kernel writes it —
    unless the part's first page is mapped already (memory the allocator reused, where walking the pages would only
    cost time). A hint: no value changes; the partial pages at a tensor's ends are left to fault in."""
    calls = _memory_calls()
    if calls is None:
        return
    madvise, mincore = calls
    resident = ctypes.create_string_buffer(1)
    for tensor in outputs:
        if tensor is None or tensor.device.type != "cpu" or not tensor.is_contiguous():
            continue
        address = tensor.data_ptr()
        first, last = -(-address // _PAGE), (address + tensor.numel() * tensor.element_size()) // _PAGE
        start, stop = first + (last - first) * share // shares, first + (last - first) * (share + 1) // shares
        if stop > start and not (mincore(start * _PAGE, _PAGE, resident) == 0 and resident.raw[0] & 1):
            madvise(start * _PAGE, (stop - start) * _PAGE, _MADV_POPULATE_WRITE)


def _workers(elements: int) -> int:
    return max(1, min(torch.get_num_threads(), elements // ELEMENTS_PER_SHARE or 1))


def grouped(rewards: torch.Tensor, mask: torch.Tensor, log_probs: torch.Tensor, sum_pi_squared: torch.Tensor,
            is_weights: torch.Tensor | None, order: torch.Tensor | None, offsets: np.ndarray, *, align: str,
            leave_one_out: bool, handle_zero_tail: bool, epsilon: float, dtype: torch.dtype, need_baselines: bool,
            check: bool, slacks: tuple[float, float] | None) -> tuple[list[torch.Tensor], bool]:
    """OTB over groups listed by (order, offsets), self-inclusive with its zero rules or leave-one-out: returns
    ([advantages, returns(, baselines)] in ``dtype``, whether the value checks flag something). Float inputs are
    converted to ``dtype`` when they are not in it; the mask is read as it is when its dtype has a kernel.

    Extra memory besides the inputs and outputs: 8·T values of ``dtype`` per thread and B for the row lengths (the
    leave-one-out energies are kept in the advantages' buffer until they are overwritten)."""
    rows, width = rewards.shape
    mask, (r, lp, spp, rho) = _inputs(dtype, mask, rewards, log_probs, sum_pi_squared, is_weights)
    outputs = [torch.empty((rows, width), dtype=dtype) for _ in range(3 if need_baselines else 2)]
    lengths = torch.empty(rows, dtype=dtype)
    order_c = None if order is None else order.to(torch.int64).contiguous()
    offsets_c = np.ascontiguousarray(offsets, dtype=np.int64)
    function = _function("groups", dtype, mask)
    bounds = shares(offsets_c, _workers(rows * width))
    scratch = torch.empty((len(bounds) - 1, 8 * width), dtype=dtype)
    slack_lp, slack_spp = slacks if slacks is not None else (0.0, 0.0)
    head = [_pointer(r), _pointer(mask), _pointer(lp), _pointer(spp), _pointer(rho), ctypes.c_int64(width),
            _pointer(order_c), offsets_c.ctypes.data_as(ctypes.c_void_p)]
    tail = [ctypes.c_int(int(align != "position")), ctypes.c_int(int(leave_one_out)),
            ctypes.c_int(int(handle_zero_tail)), ctypes.c_double(epsilon), _pointer(outputs[0]), _pointer(outputs[1]),
            _pointer(outputs[2] if need_baselines else None), _pointer(lengths)]
    owners = (r, lp, spp, rho, mask, outputs, lengths, order_c, offsets_c, scratch)   # alive while C runs

    def work(share: int) -> int:
        assert owners
        populate(outputs, share, len(bounds) - 1)
        return function(*head, ctypes.c_int64(bounds[share]), ctypes.c_int64(bounds[share + 1]), *tail,
                        _pointer(scratch[share]), ctypes.c_int(int(check)), ctypes.c_double(slack_lp),
                        ctypes.c_double(slack_spp))

    return outputs, any(_in_parallel(work, len(bounds) - 1))


class LocalGroups(NamedTuple):
    """A rank's rows listed group by group (otb_torch.distributed): ``order`` [B] int64 (members in batch order),
    ``offsets`` [g + 1] where each local group starts in it, ``ids`` [g] int64 their global group ids, ``row_group``
    [B] int64 each row's local group; ``bounds``, the threads' shares of local groups (:func:`shares`), and
    ``rows_in_order`` [B] int64, each share's rows in batch order at its positions of the plan (the distributed
    kernels visit rows so)."""

    order: np.ndarray
    offsets: np.ndarray
    ids: np.ndarray
    row_group: np.ndarray
    bounds: list[int]
    rows_in_order: np.ndarray


def local_groups(group_ids: torch.Tensor, width: int) -> LocalGroups:
    """The local plan of a rank's rows (of ``width`` positions) from their global group ids (a stable sort on the
    host), with the threads' shares."""
    host = group_ids.cpu().numpy()
    rows = host.shape[0]
    order = np.argsort(host, kind="stable").astype(np.int64)
    ordered = host[order]
    offsets = np.concatenate(([0], np.flatnonzero(ordered[1:] != ordered[:-1]) + 1, [rows])).astype(np.int64)
    row_group = np.empty(rows, dtype=np.int64)
    row_group[order] = np.repeat(np.arange(offsets.shape[0] - 1, dtype=np.int64), offsets[1:] - offsets[:-1])
    bounds = shares(offsets, _workers(rows * width))
    in_order = np.arange(rows, dtype=np.int64) if len(bounds) == 2 else np.concatenate(
        [np.sort(order[offsets[a]:offsets[b]]) for a, b in zip(bounds, bounds[1:])]).astype(np.int64)
    return LocalGroups(order, offsets, np.ascontiguousarray(ordered[offsets[:-1]], dtype=np.int64), row_group,
                       bounds, in_order)


def _array(value: np.ndarray | torch.Tensor | None) -> ctypes.c_void_p:
    if value is None:
        return ctypes.c_void_p(None)
    if isinstance(value, np.ndarray):
        return ctypes.c_void_p(value.ctypes.data)
    return _pointer(value)


class FirstSweep(NamedTuple):
    """What a rank's first sweep leaves (:func:`distributed_first`, :func:`distributed_offsets`), in the compute
    dtype: ``buffer`` [G·planes·C + extra], whose first part is ``grid`` [G, planes, C] (N, D and, for leave-one-out,
    V of the rank's rows; C the rank's width T after the first sweep, all K columns or a spanning piece's own T_c
    after the offsets) and whose ``extra`` last values are zeros for the caller (None for a context piece until
    its offsets are added); ``returns`` [B, T]; ``energy`` [B, T] mₜWₜ on the valid spans, in what becomes the
    advantages (leave-one-out, and context pieces; else None); ``lengths`` [B] int64 valid counts; ``stats`` [4, G]
    int64 (members, longest, count at longest, second longest of the rank's rows); ``totals`` [3, B] float64 (a
    context piece's Σmr, Σw, Σm; else None); ``bad`` the value-check flag; ``tops`` [G, 2, C] (leave-one-out with a
    grid, else None): per column of each group, the rank's largest weight mₜWₜ and its GₜWₜmₜ (``_kernel.c``'s
    otb_top), which the grid's N and D leave out."""

    buffer: torch.Tensor | None
    grid: torch.Tensor | None
    returns: torch.Tensor
    energy: torch.Tensor | None
    lengths: torch.Tensor
    stats: torch.Tensor
    totals: torch.Tensor | None
    bad: bool
    tops: torch.Tensor | None = None


def _grid(num_groups: int, planes: int, columns: int, extra: int, dtype: torch.dtype
          ) -> tuple[torch.Tensor, torch.Tensor]:
    buffer = torch.zeros(num_groups * planes * columns + extra, dtype=dtype)
    return buffer, buffer.narrow(0, 0, num_groups * planes * columns).view(num_groups, planes, columns)


def _statistics(num_groups: int) -> torch.Tensor:
    """[4, G] int64 statistics of no row: 0 members, longest −1, 0 at the longest, second −1."""
    return torch.from_numpy(np.repeat(np.array([[0], [-1], [0], [-1]], dtype=np.int64), num_groups, axis=1))


def distributed_first(rewards: torch.Tensor, mask: torch.Tensor, log_probs: torch.Tensor,
                      sum_pi_squared: torch.Tensor, is_weights: torch.Tensor | None, plan: LocalGroups, *,
                      num_groups: int, align: str, leave_one_out: bool, dtype: torch.dtype, check: bool,
                      slacks: tuple[float, float] | None, context: bool = False, extra: int = 0) -> FirstSweep:
    """The first sweep of a rank's rows (``_kernel.c``: otb_dist_first): returns and energies; without ``context``
    the grid of the rank's terms over its own width T and the group statistics; with it (a context piece) the
    pieces' totals instead, the terms waiting for the other pieces' offsets (:func:`distributed_offsets`).
    Leave-one-out weighs by mₜ·max(Wₜ, 0) (for a context piece, after the offsets).

    Extra memory: the grid (G·planes·T values; leave-one-out, its tops: 2·G·T more) and 3·T values per thread; the
    energies live in what becomes the advantages' buffer."""
    rows, width = rewards.shape
    mask, (r, lp, spp, rho) = _inputs(dtype, mask, rewards, log_probs, sum_pi_squared, is_weights)
    planes = 3 if leave_one_out else 2
    buffer, grid = (None, None) if context else _grid(num_groups, planes, width, extra, dtype)
    tops = torch.zeros((num_groups, 2, width), dtype=dtype) if leave_one_out and not context else None
    returns = torch.empty((rows, width), dtype=dtype)
    energy = torch.empty((rows, width), dtype=dtype) if leave_one_out or context else None
    lengths = torch.empty(rows, dtype=torch.int64)
    stats = _statistics(num_groups)
    totals = torch.empty((3, rows), dtype=torch.float64) if context else None
    bounds, rows_in_order = plan.bounds, plan.rows_in_order
    scratch = torch.empty((len(bounds) - 1, 3 * width), dtype=dtype)
    slack_lp, slack_spp = slacks if slacks is not None else (0.0, 0.0)
    function = _function("dist_first", dtype, mask)
    head = [_pointer(r), _pointer(mask), _pointer(lp), _pointer(spp), _pointer(rho), ctypes.c_int64(width),
            _array(plan.order), _array(plan.offsets), _array(rows_in_order), _array(plan.row_group)]
    tail = [_array(plan.ids), _pointer(grid), ctypes.c_int64(width), ctypes.c_int(planes),
            ctypes.c_int(int(align != "position")), ctypes.c_int64(num_groups), _pointer(returns), _pointer(energy),
            _pointer(lengths), _pointer(stats), _pointer(totals), ctypes.c_int64(rows)]
    owners = (r, lp, spp, rho, mask, plan, rows_in_order, buffer, returns, energy, lengths, stats, totals, scratch,
              tops)

    def work(share: int) -> int:
        assert owners
        populate([returns, energy], share, len(bounds) - 1)
        return function(*head, ctypes.c_int64(bounds[share]), ctypes.c_int64(bounds[share + 1]), *tail,
                        _pointer(scratch[share]), ctypes.c_int(int(check)), ctypes.c_double(slack_lp),
                        ctypes.c_double(slack_spp), ctypes.c_int(int(leave_one_out and not context)),
                        _pointer(tops))

    bad = any(_in_parallel(work, len(bounds) - 1))
    return FirstSweep(buffer, grid, returns, energy, lengths, stats, totals, bad, tops)


def distributed_offsets(mask: torch.Tensor, plan: LocalGroups, first: FirstSweep, *, num_groups: int, columns: int,
                        align: str, leave_one_out: bool, dtype: torch.dtype, columns_before: int,
                        ret_offsets: np.ndarray, energy_offsets: np.ndarray, valid_before: np.ndarray,
                        total_lengths: np.ndarray, count_rows: bool, extra: int = 0, origin: int = 0) -> FirstSweep:
    """A context piece after the other pieces' totals (``_kernel.c``: otb_dist_offsets): its returns and energies
    offset in place (float64 [B] ``ret_offsets``, ``energy_offsets``), its terms in a grid of ``columns`` columns
    from global column ``origin`` (all K columns from 0; by position, a piece's own columns from ``columns_before``)
    at columns ``columns_before`` + t or ``valid_before`` + #valid before t, less ``origin``, and (``count_rows``)
    the group statistics from the rows' ``total_lengths``."""
    rows, width = first.returns.shape
    mask, _ = _inputs(dtype, mask)
    planes = 3 if leave_one_out else 2
    buffer, grid = _grid(num_groups, planes, columns, extra, dtype)
    tops = torch.zeros((num_groups, 2, columns), dtype=dtype) if leave_one_out else None
    stats = _statistics(num_groups)
    arrays = [np.ascontiguousarray(value, dtype=kind) for value, kind in (
        (ret_offsets, np.float64), (energy_offsets, np.float64), (valid_before, np.int64),
        (total_lengths, np.int64))]
    bounds, rows_in_order = plan.bounds, plan.rows_in_order
    scratch = torch.empty((len(bounds) - 1, width), dtype=dtype)
    function = _function("dist_offsets", dtype, mask, None)
    head = [_pointer(mask), ctypes.c_int64(width), _array(plan.order), _array(plan.offsets), _array(rows_in_order),
            _array(plan.row_group)]
    tail = [_array(plan.ids), _pointer(grid), ctypes.c_int64(columns), ctypes.c_int(planes),
            ctypes.c_int(int(align != "position")), *(_array(value) for value in arrays[:3]),
            ctypes.c_int64(columns_before), ctypes.c_int64(origin), _array(arrays[3]), ctypes.c_int(int(count_rows)),
            ctypes.c_int64(num_groups), _pointer(first.returns), _pointer(first.energy), _pointer(stats),
            ctypes.c_int(int(leave_one_out)), _pointer(tops)]
    owners = (mask, plan, rows_in_order, first, buffer, stats, arrays, scratch, tops)

    _run_in_shares(function, head, tail, bounds, scratch, owners)
    return first._replace(buffer=buffer, grid=grid, stats=stats, tops=tops)


def _run_in_shares(function: Any, head: list, tail: list, bounds: Any, scratch: torch.Tensor, owners: tuple,
                   fresh: tuple[torch.Tensor | None, ...] = ()) -> None:
    """Call a distributed kernel once per thread share, in parallel: ``function(*head, first, stop, *tail,
    scratch[share])`` for the rows ``bounds[share]:bounds[share + 1]`` of the rank's order; ``owners`` keeps alive the
    buffers the pointers in ``head`` and ``tail`` point into until every call has returned; each share populates
    its part of the ``fresh`` outputs first."""
    def work(share: int) -> int:
        assert owners
        populate(fresh, share, len(bounds) - 1)
        function(*head, ctypes.c_int64(bounds[share]), ctypes.c_int64(bounds[share + 1]), *tail,
                 _pointer(scratch[share]))
        return 0

    _in_parallel(work, len(bounds) - 1)


def distributed_final(mask: torch.Tensor, plan: LocalGroups, first: FirstSweep, statistics: np.ndarray | None, *,
                      num_groups: int, align: str, leave_one_out: bool, handle_zero_tail: bool, epsilon: float,
                      dtype: torch.dtype, columns_before: int = 0, valid_before: np.ndarray | None = None,
                      total_lengths: np.ndarray | None = None, origin: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, baselines) of a rank's rows from the all-reduced grid (``_kernel.c``: otb_dist_final), whose
    columns start at global column ``origin`` (as :func:`distributed_offsets`); ``statistics`` [P, 4, G] int64
    (NumPy): every rank's group statistics, merged in the kernel (self-inclusive only). The grid's N becomes the
    ratio in place. Leave-one-out with ``first.tops``: the grid's N and D leave out each cell's top member on this
    rank (FN(otb_top)), which takes them as they are."""
    rows, width = first.returns.shape
    mask, _ = _inputs(dtype, mask)
    advantages = first.energy if first.energy is not None else torch.empty((rows, width), dtype=dtype)
    baselines = torch.empty((rows, width), dtype=dtype)
    statistics_c = None if statistics is None else np.ascontiguousarray(statistics, dtype=np.int64)
    ranks = 0 if statistics_c is None else statistics_c.shape[0]
    lengths = first.lengths if total_lengths is None else total_lengths
    columns = first.grid.shape[2]
    bounds, rows_in_order = plan.bounds, plan.rows_in_order
    scratch = torch.empty((len(bounds) - 1, width), dtype=dtype)
    function = _function("dist_final", dtype, mask, None)
    head = [_pointer(mask), ctypes.c_int64(width), _array(plan.offsets), _array(rows_in_order),
            _array(plan.row_group)]
    tail = [_array(plan.ids), _pointer(first.grid), ctypes.c_int64(columns), ctypes.c_int(first.grid.shape[1]),
            ctypes.c_int(int(align != "position")), ctypes.c_int(int(leave_one_out)),
            ctypes.c_int(int(handle_zero_tail)), ctypes.c_double(epsilon), _array(statistics_c),
            ctypes.c_int64(ranks), ctypes.c_int64(num_groups), _array(lengths), _array(valid_before),
            ctypes.c_int64(columns_before), ctypes.c_int64(origin),
            _pointer(first.returns), _pointer(advantages), _pointer(baselines), _pointer(first.tops)]
    owners = (mask, plan, rows_in_order, first, statistics_c, lengths, valid_before, advantages, baselines, scratch)

    _run_in_shares(function, head, tail, bounds, scratch, owners,
                   fresh=(baselines, None if first.energy is not None else advantages))
    return advantages, baselines


def distributed_tops_in(grid: torch.Tensor, tops: torch.Tensor) -> torch.Tensor:
    """Leave-one-out, before the grid's SUM all-reduce (``_kernel.c``: otb_dist_tops_in): returns the rank's own N and D
    without its tops, [G, 2, K], and adds each cell's top (``tops`` [G, 2, K]: w, gw) back into ``grid`` [G, 3, K]
    in place. Extra memory: the returned 2·G·K values."""
    groups, planes, columns = grid.shape
    rest = torch.empty((groups, 2, columns), dtype=grid.dtype)
    function = _function("dist_tops_in", grid.dtype, rest, None)
    function(_pointer(grid), _pointer(tops), _pointer(rest), ctypes.c_int64(groups), ctypes.c_int(planes),
             ctypes.c_int64(columns))
    return rest


def distributed_tops_out(grid: torch.Tensor, tops: torch.Tensor, rest: torch.Tensor, peer: torch.Tensor | None
                         ) -> tuple[int, torch.Tensor | None]:
    """Leave-one-out, after the grid's SUM all-reduce (``_kernel.c``: otb_dist_tops_out): each cell's N and D in place
    become the sums without the rank's top member there, and where that member dominates (weight above
    :data:`otb_spec.tolerances.DOMINANT_SHARE` of the cell's D) the others' sums ``rest`` + ``peer`` (the other rank's
    [G, 3, K] sums over two ranks). Returns the count of such cells and, without ``peer``, their flags [G, K] (bool),
    those cells left for the caller to fill."""
    groups, planes, columns = grid.shape
    owned = None if peer is not None else torch.empty((groups, columns), dtype=torch.bool)
    function = _function("dist_tops_out", grid.dtype, rest, ctypes.c_int64)
    count = function(_pointer(grid), _pointer(tops), _pointer(rest), _pointer(peer), ctypes.c_int64(groups),
                     ctypes.c_int(planes), ctypes.c_int64(columns), ctypes.c_double(DOMINANT_SHARE), _pointer(owned))
    return int(count), owned


def fused_usable(device: torch.device, dtype: torch.dtype) -> bool:
    """True if the fused linear token statistics' elementwise work runs natively: CPU, float32 computation."""
    return dtype == torch.float32 and usable(device, dtype)


def _by_rows(name: str, block: torch.Tensor, per_row: list[torch.Tensor | None], *trailing: Any) -> None:
    """``name(block, begin, end, width, stride, *per_row, *trailing)`` of ``_kernel.c`` over about equal row ranges of
    a float32 block (rows contiguous), one per thread: rows are independent, so the split changes no bit."""
    function = getattr(_load()[0], name)
    function.restype = None
    pointers = [_pointer(value) for value in per_row]
    shape = (ctypes.c_int64(block.shape[1]), ctypes.c_int64(block.stride(0)))
    rows = block.shape[0]
    count = max(1, min(_workers(block.numel()), rows))
    bounds = [rows * share // count for share in range(count + 1)]

    def work(share: int) -> int:
        function(_pointer(block), ctypes.c_int64(bounds[share]), ctypes.c_int64(bounds[share + 1]), *shape,
                 *pointers, *trailing)
        return 0

    _in_parallel(work, count)


def fused_fold(block: torch.Tensor, peak: torch.Tensor, s1: torch.Tensor, s2: torch.Tensor, tilt: torch.Tensor, *,
               first: bool) -> None:
    """Fold a block of logits z [rows, width] (float32, rows contiguous) into each row's running maximum and sums
    S₁, S₂, T (contiguous float32 [rows], updated in place; ``first``: the block's columns are the first chunk of the
    vocabulary, nothing to rescale) — ``otb_fused_fold_float32``. z is only read."""
    _by_rows("otb_fused_fold_float32", block, [peak, s1, s2, tilt], ctypes.c_int(int(first)))


def fused_cotangent(block: torch.Tensor, shift: torch.Tensor, offset: torch.Tensor, slope: torch.Tensor | None
                    ) -> None:
    """With x = z + shift (per row: −lse, so that x = log π_v), z ← (offset + slope·x)·e^{min(x, 0)} row by row, in
    place (``slope`` None: offset·e^{min(x, 0)}), for a block z (float32, rows contiguous) and per-row float32
    ``shift``, ``offset``, ``slope`` (contiguous [rows]) — ``otb_fused_cotangent_float32``."""
    _by_rows("otb_fused_cotangent_float32", block, [shift, offset, slope])


def exp_float32(values: torch.Tensor) -> torch.Tensor:
    """The kernel's float32 exp(min(x, 0)), for the accuracy test."""
    library = _load()[0]
    if library is None:
        raise RuntimeError(native_kernel_status().reason)
    values = values.to(torch.float32).contiguous()
    out = torch.empty_like(values)
    library.otb_expf_array(_pointer(values), _pointer(out), ctypes.c_int64(values.numel()))
    return out
