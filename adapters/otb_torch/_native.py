"""The native CPU kernel for self-inclusive OTB (``_kernel.c``): built on first use, loaded with ctypes.

Eager PyTorch needs ~17 passes over each block (two scans, an exp, a dozen elementwise ops and reductions); the
kernel does a group in one sweep per member plus one for the advantages, reading the inputs in place in any row
order (no gather, no scatter), so its cost is close to the memory floor. The math is the eager kernel's
(:func:`otb_torch._core.grouped_otb`), which is the reference's; the equivalence suite runs both.

Build: the C compiler Python was built with (``$CC`` overrides), ``-O3 -ffp-contract=off`` (plus ``-mavx2`` where
torch reports AVX2 on this CPU), into ``$OTB_TORCH_CACHE`` (default ``$XDG_CACHE_HOME/otb-spec`` or ``~/.cache/otb-spec``) under
a name that hashes the source, the compiler and the flags; about a second, once per machine. Without a compiler, or
with ``OTB_TORCH_NATIVE=0``, the eager kernel runs instead: :func:`native_kernel_status` says which and why.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

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


def _build(compiler: list[str]) -> Path:
    source = _SOURCE.read_bytes()
    version = subprocess.run(compiler + ["--version"], capture_output=True, text=True, timeout=60).stdout
    errors = []
    for flags in _variants():
        key = hashlib.sha256(b"\0".join([source, version.encode(), " ".join(compiler + list(flags)).encode(),
                                         platform.machine().encode(), sys.platform.encode()])).hexdigest()[:20]
        for directory in (_cache_directory(), Path(tempfile.gettempdir()) / f"otb-spec-{os.getuid()}"):
            target = directory / f"otb_kernel-{key}.so"
            if target.exists():
                return target
            try:
                directory.mkdir(parents=True, exist_ok=True)
                handle, partial = tempfile.mkstemp(suffix=".so", dir=directory)
                os.close(handle)
            except OSError as exc:
                errors.append(f"{directory}: {exc}")
                continue
            result = subprocess.run(compiler + list(flags) + [str(_SOURCE), "-o", partial, "-lm"],
                                    capture_output=True, text=True, timeout=300)
            if result.returncode == 0:
                os.replace(partial, target)                  # atomic: concurrent builds agree on the result
                return target
            os.unlink(partial)
            errors.append(f"{' '.join(compiler + list(flags))}: {result.stderr.strip()[-2000:]}")
            break
    raise RuntimeError("; ".join(errors) or "no writable cache directory")


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
                        path = _build(compiler)
                        library = ctypes.CDLL(str(path))
                        status = NativeKernelStatus(True, str(path), "")
                    except Exception as exc:                 # any failure: the eager kernel runs
                        status = NativeKernelStatus(False, None, f"build failed: {exc}")
            _STATE["library"], _STATE["status"] = library, status
        return _STATE["library"], _STATE["status"]          # type: ignore[return-value]


def native_kernel_status() -> NativeKernelStatus:
    """Build or load the native kernel if not done yet, and say whether the self-inclusive OTB functions use it on
    CPU (float32/float64 computation, eager mode)."""
    return _load()[1]


_CHOICE = threading.local()


@contextmanager
def eager_only():
    """Within this block (in this thread), the eager kernel runs even where the native one could: for the tests
    and the ``torch-cpu-eager`` adapter, which keep the fallback proven equal to the reference."""
    previous = getattr(_CHOICE, "eager", False)
    _CHOICE.eager = True
    try:
        yield
    finally:
        _CHOICE.eager = previous


def usable(device: torch.device, dtype: torch.dtype) -> bool:
    """True if the native kernel serves a CPU computation in ``dtype``."""
    return (device.type == "cpu" and dtype in _COMPUTE and not getattr(_CHOICE, "eager", False)
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


def shares(offsets: np.ndarray, workers: int) -> list[int]:
    """Group bounds 0 = b₀ < b₁ < … < b_k = G (k ≤ ``workers``) cutting the groups into whole-group shares of about
    equal numbers of rows; thread j computes groups b_j … b_{j+1} − 1."""
    groups, rows = offsets.shape[0] - 1, int(offsets[-1])
    cuts = np.searchsorted(offsets, np.linspace(0, rows, workers + 1)[1:-1], side="left")
    return [0] + sorted({int(cut) for cut in cuts} - {0, groups}) + [groups]


def self_inclusive(rewards: torch.Tensor, mask: torch.Tensor, log_probs: torch.Tensor, sum_pi_squared: torch.Tensor,
                   is_weights: torch.Tensor | None, order: torch.Tensor | None, offsets: np.ndarray, *, align: str,
                   handle_zero_tail: bool, epsilon: float, dtype: torch.dtype, need_baselines: bool, check: bool,
                   slacks: tuple[float, float] | None) -> tuple[list[torch.Tensor], bool]:
    """Self-inclusive OTB, zero rules included, over groups listed by (order, offsets): returns ([advantages,
    returns(, baselines)] in ``dtype``, whether the value checks flag something). Float inputs are converted to
    ``dtype`` when they are not in it; the mask is read as it is when its dtype has a kernel."""
    library = _load()[0]
    rows, width = rewards.shape
    floats = [None if value is None else value.to(dtype).contiguous()
              for value in (rewards, log_probs, sum_pi_squared, is_weights)]
    mask = mask.contiguous() if mask.dtype in _MASKS else mask.to(dtype).contiguous()
    outputs = [torch.empty((rows, width), dtype=dtype) for _ in range(3 if need_baselines else 2)]
    lengths = torch.empty(rows, dtype=dtype)
    order_c = None if order is None else order.to(torch.int64).contiguous()
    offsets_c = np.ascontiguousarray(offsets, dtype=np.int64)
    function = getattr(library, f"otb_{_COMPUTE[dtype]}_{_MASKS[mask.dtype]}")
    function.restype = ctypes.c_int
    bounds = shares(offsets_c, max(1, min(torch.get_num_threads(), rows * width // 65536 or 1)))
    scratch = torch.empty((len(bounds) - 1, 5 * width), dtype=dtype)
    slack_lp, slack_spp = slacks if slacks is not None else (0.0, 0.0)
    r, lp, spp, rho = floats
    arguments = [_pointer(r), _pointer(mask), _pointer(lp), _pointer(spp), _pointer(rho), ctypes.c_int64(width),
                 ctypes.c_void_p(None if order_c is None else order_c.data_ptr()),
                 offsets_c.ctypes.data_as(ctypes.c_void_p)]
    tail = [ctypes.c_int(int(align != "position")), ctypes.c_int(int(handle_zero_tail)), ctypes.c_double(epsilon),
            _pointer(outputs[0]), _pointer(outputs[1]), _pointer(outputs[2] if need_baselines else None),
            _pointer(lengths)]

    def work(share: int) -> int:
        return function(*arguments, ctypes.c_int64(bounds[share]), ctypes.c_int64(bounds[share + 1]), *tail,
                        _pointer(scratch[share]), ctypes.c_int(int(check)), ctypes.c_double(slack_lp),
                        ctypes.c_double(slack_spp))

    if len(bounds) == 2:
        flags = [work(0)]
    else:
        flags = list(_pool(len(bounds) - 1).map(work, range(len(bounds) - 1)))
    return outputs, any(flags)


def exp_float32(values: torch.Tensor) -> torch.Tensor:
    """The kernel's float32 exp(min(x, 0)), for the accuracy test."""
    library = _load()[0]
    if library is None:
        raise RuntimeError(native_kernel_status().reason)
    values = values.to(torch.float32).contiguous()
    out = torch.empty_like(values)
    library.otb_expf_array(_pointer(values), _pointer(out), ctypes.c_int64(values.numel()))
    return out
