"""OTB and Σπ² across processes with torch.distributed: vocab-, data- and context-parallel, any backend.

The port of :mod:`otb_spec.distributed` (the data- and context-parallel protocol) and of the vocab-shard rule
(:func:`otb_spec.combine_vocab_shards`); every function equals the single-process reference on the whole batch
within :mod:`otb_spec.tolerances` (tests/test_torch_distributed.py runs them on gloo with 2–4 processes).

* :func:`vocab_parallel_token_statistics` / :func:`vocab_parallel_sum_pi_squared` — logits sharded over the
  vocabulary: one MAX all-reduce of the row maxima M, then one SUM all-reduce of the stacked partials
  (S₁ = Σe^{z−M}, S₂ = Σe^{2(z−M)}, Σe^{z−M}(z−M), z_y − M), computed through fixed row-chunk buffers, so the extra
  memory is O(rows), not O(shard).
* :func:`distributed_token_baseline` — a batch whose prompt groups are split over the ranks of ``group`` (data
  parallel) and, optionally, whose rows are cut along T over the ranks of ``context_group`` (context parallel): every
  rank gets the advantages, returns and baselines one process would compute for its rows — self-inclusive
  (single- and multi-turn, zero tail included) or leave-one-out, with rollout IS weights.
* :func:`context_parallel_returns_and_energy` — Gₜ and Wₜ of row pieces cut along T.
* :func:`global_group_ids` — dense global group ids from per-rank ids of any kind (verl's uid strings).

Bad input raises on every rank instead of hanging: every rank validates its inputs, then the first collective (a
fixed-size all-gather) carries each rank's function, verdict, context group and layout, so a rank with bad values, or
shapes, options (``check_values`` included), context groups or ids that disagree with the others', makes every rank
raise: disagreements a ``ValueError`` naming the argument and each rank's value; bad input on one rank the reference's
own error there, and one of the same type naming that rank on the others. On CPU, ``distributed_token_baseline`` runs
otb_torch's native kernel (:mod:`otb_torch._native`): its first sweep runs while the handshake travels, with the value
checks inside it, and the values' verdict, the group statistics and the grid travel in one SUM all-reduce (two
collectives per call; three with a context group — two where the context group is every rank of ``group`` and
``align="position"``: each rank then holds every row, and its grid cells are complete, so the verdict rides with the row
totals and nothing is summed; one in a group of one rank). Leave-one-out adds, where the grid is summed over more than
two ranks (or on the eager path), an all-gather of each rank's count of dominant cells and, where there are any, one of
the cells and a SUM all-reduce of their others' sums (:func:`_sums_without_dominant`). A SUM over two ranks of CPU
tensors is one exchange between them (``isend`` + ``irecv`` of the whole tensor, then an add: :func:`_all_reduce`)
instead of gloo's ring of two rounds. Collectives wait at most ``timeout`` seconds when given (else the process group's
timeout). Tested on gloo; on NCCL one rank only, on a GPU (docs/distributed.md).
"""

from __future__ import annotations

import datetime
import math
import struct
from typing import Any, Callable, NamedTuple

import numpy as np
import torch
import torch.distributed as dist

from otb_spec import _validation as reference_checks
from otb_spec.tolerances import DOMINANT_SHARE
from otb_torch import _checks as check
from otb_torch import _native
from otb_torch._logits import (
    TokenStatistics,
    _check_maxima,
    _chunk_rows,
    _compute_dtype,
    _logits,
    _out_dtype,
    _row_dot,
)
from otb_torch._core import leave_one_out_energy, others_denominator, realized_energy, reward_to_go, token_energy
from otb_torch._otb import AdvantageResult, _check_finite_outputs, _narrower

__all__ = [
    "vocab_parallel_sum_pi_squared",
    "vocab_parallel_token_statistics",
    "ContextScan",
    "context_parallel_returns_and_energy",
    "distributed_token_baseline",
    "global_group_ids",
]

_ALIGNMENTS = reference_checks.ALIGNMENTS                # the handshake sends an index into it
_MAGIC = 0x07B5


# ----------------------------------------------------------------------------------------------------------------------
# Collectives with a time bound


def _wait(work: Any, timeout: float | None) -> None:
    """Wait for ``work``; with a ``timeout``, a collective that fails or does not finish within it raises an error of
    the backend's type (a RuntimeError) naming the bound — gloo's own says only "Operation timed out!" — with the
    backend's error chained. Without one, the process group's timeout and the backend's error."""
    if timeout is None:
        work.wait()
        return
    try:
        finished = work.wait(timeout=datetime.timedelta(seconds=timeout))
    except RuntimeError as exc:
        message = (f"otb_torch.distributed: a collective failed or did not finish within timeout={timeout} s "
                   f"({type(exc).__name__}: {exc}); a rank may not have called, and the process group is unusable now")
        try:
            named = type(exc)(message)          # the backend's type (DistBackendError), for the caller's except
        except Exception:
            named = RuntimeError(message)
        raise named from exc
    if not finished:
        raise RuntimeError(f"otb_torch.distributed: a collective did not finish within timeout={timeout} s")


def _all_reduce(tensor: torch.Tensor, op: Any, group: Any, timeout: float | None) -> torch.Tensor:
    """``tensor`` ← ``op`` (SUM, MAX) of it over the ranks of ``group``, in place, the same bits on every rank.

    A SUM over two ranks with CPU tensors: each rank sends its tensor to the other and adds what it receives — one
    exchange of the whole tensor, where gloo's ring all-reduce makes two rounds of half of it each (the same bytes,
    twice the latency). The same bits on both ranks: a + b = b + a in IEEE arithmetic. (Not for MAX: which of −0 and
    +0 ``torch.maximum`` returns depends on the operands' order, so the ranks could differ in the sign of a zero.)
    The choice depends only on the group's size, ``op`` and the device, which every rank of a working group shares.
    Extra memory: a copy of ``tensor`` for what arrives (and one to send, were ``tensor`` not contiguous). As with
    any collective, a timeout leaves the group unusable (the other half of the exchange stays posted). Otherwise
    ``torch.distributed.all_reduce``."""
    if not _pairwise(tensor, op, group):
        _wait(dist.all_reduce(tensor, op=op, group=group, async_op=True), timeout)
        return tensor
    return tensor.add_(_exchange(tensor, group, timeout))


def _pairwise(tensor: torch.Tensor, op: Any, group: Any) -> bool:
    """Whether :func:`_all_reduce` sums ``tensor`` by one exchange (a SUM over two ranks, CPU tensors)."""
    return tensor.device.type == "cpu" and op == dist.ReduceOp.SUM and dist.get_world_size(group) == 2


def _exchange(tensor: torch.Tensor, group: Any, timeout: float | None) -> torch.Tensor:
    """Over a group of two ranks: sends ``tensor`` to the other rank and returns the other's (a new tensor)."""
    peer = dist.get_global_rank(group if group is not None else dist.group.WORLD, 1 - dist.get_rank(group))
    mine = tensor.contiguous()
    received = torch.empty_like(mine)
    outgoing = dist.isend(mine, peer, group=group, tag=_MAGIC)
    incoming = dist.irecv(received, peer, group=group, tag=_MAGIC)
    _wait(incoming, timeout)
    _wait(outgoing, timeout)
    return received


def _all_gather_name() -> str:
    """The name of torch.distributed's all-gather into one tensor: ``all_gather_single`` where torch has it (2.13 does,
    and deprecates the older name), else ``all_gather_into_tensor``, the same collective (2.11, on the lent GPU
    machine, has only that)."""
    return "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"


def _all_gather_single(output: torch.Tensor, local: torch.Tensor, group: Any) -> Any:
    """Starts the all-gather of ``local`` into the concatenated ``output`` and returns its work handle. The collective
    (:func:`_all_gather_name`) is looked up at each call, so that a wrapper set on ``torch.distributed`` is seen."""
    return getattr(dist, _all_gather_name())(output, local, group=group, async_op=True)


def _all_gather(tensor: torch.Tensor, group: Any, timeout: float | None) -> torch.Tensor:
    """[...] on every rank → [P, ...] in the group's rank order."""
    size = dist.get_world_size(group)
    flat = tensor.contiguous().reshape(-1)
    out = torch.empty(size * flat.numel(), dtype=tensor.dtype, device=tensor.device)     # concatenated, as gloo wants
    _wait(_all_gather_single(out, flat, group), timeout)
    return out.reshape((size,) + tuple(tensor.shape))


def _timeout(timeout: Any) -> float | None:
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0 or math.isinf(timeout):
        raise ValueError(f"timeout: expected a positive number of seconds or None, got {timeout!r}")
    return float(timeout)


def _float_bits(value: float) -> int:
    return struct.unpack("<q", struct.pack("<d", float(value)))[0]


def _fingerprint(values: torch.Tensor) -> int:
    """An int64 fingerprint of integer ids, equal on ranks holding equal ids (a weighted sum that wraps around)."""
    ids = values.to(torch.int64).cpu().numpy().astype(np.uint64)
    weights = (np.arange(ids.size, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)) | np.uint64(1)
    with np.errstate(over="ignore"):
        total = int(np.sum((ids + np.uint64(1)) * weights, dtype=np.uint64))
    return struct.unpack("<q", struct.pack("<Q", total))[0]


_FIELDS = 12                                           # every handshake has the same size, whatever the function
_HEADER = 7                                            # magic, function, failed, rank, context group (3)
_FUNCTIONS = {"vocab_parallel_token_statistics": 1, "context_parallel_returns_and_energy": 2,
              "distributed_token_baseline": 3}
_FAILURES = {ValueError: 1, TypeError: 2}              # a rank's rejection, by the type of its error
_FAILURE_TYPES = {code: kind for kind, code in _FAILURES.items()}


def _flag_field(value: Any) -> int:
    """A boolean option as a handshake field: 0 or 1 (−1: not a bool, which that rank's own check rejects)."""
    return int(value) if isinstance(value, bool) else -1


def _shown_flag(field: int) -> Any:
    return bool(field) if field >= 0 else "not a bool"


_DTYPE_CODES = {torch.float64: 1, torch.float32: 2, torch.bfloat16: 3, torch.float16: 4}
_DTYPE_NAMES = {code: str(dtype).removeprefix("torch.") for dtype, code in _DTYPE_CODES.items()}


def _dtypes_field(results: torch.dtype, sums: torch.dtype) -> int:
    """The dtype of a call's results and of its sums as one handshake field (0: not a known floating dtype)."""
    return 8 * _DTYPE_CODES.get(results, 0) + _DTYPE_CODES.get(sums, 0)


def _shown_dtypes(field: int) -> str:
    return (f"{_DTYPE_NAMES.get(field // 8, 'another dtype')} results, sums in "
            f"{_DTYPE_NAMES.get(field % 8, 'another dtype')}")


_DTYPES_DIFFER = ("the dtypes (results come in the rewards' dtype, sums in float64 where an input is float64: ranks "
                  "of one call must agree)")


def _shown_float(field: int) -> float:
    return struct.unpack("<d", struct.pack("<q", field))[0]


def _context_key(context_group: Any) -> list[int]:
    """[first global rank, size, this rank's index] of ``context_group``; [−1, 0, −1] for None; index −1 when this
    rank is not a member."""
    if context_group is None:
        return [-1, 0, -1]
    try:
        members = dist.get_process_group_ranks(context_group)
        index = dist.get_rank(context_group)
    except (RuntimeError, ValueError):                 # not a member: the group object is a placeholder
        return [-2, 0, -1]
    return [members[0], len(members), index]


def _handshake_device(value: Any, group: Any) -> torch.device:
    """Where the handshake tensor must live: the inputs' device, or (inputs unusable) the backend's device."""
    if isinstance(value, torch.Tensor):
        return value.device
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend and "gloo" not in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class _Verdicts:
    """The handshake: a fixed-size row per rank (function, verdict, context group, up to 12 fields) all-gathered over
    ``group``, then checked identically on every rank — so every rank raises the same error, or none does.

    With ``wait=False`` the all-gather is only started (the native path computes meanwhile); :meth:`finish` waits
    for it and checks."""

    def __init__(self, what: str, fields: list[int], failure: BaseException | None, group: Any,
                 timeout: float | None, device: torch.device, context_group: Any = None, *, wait: bool = True):
        assert len(fields) <= _FIELDS
        local = torch.tensor([_MAGIC, _FUNCTIONS[what], _FAILURES.get(type(failure), 1) if failure is not None else 0,
                              dist.get_rank()]
                             + _context_key(context_group) + fields + [0] * (_FIELDS - len(fields)),
                             dtype=torch.int64, device=device)
        self._gathered = torch.empty(dist.get_world_size(group) * local.numel(), dtype=torch.int64, device=device)
        self._work = _all_gather_single(self._gathered, local, group)
        self._failure, self._timeout, self.what = failure, timeout, what
        self.table: list[list[int]] = []
        if wait:
            self.finish()

    def finish(self) -> "_Verdicts":
        """Wait for the all-gather; raise on every rank if any rank failed or the ranks disagree."""
        _wait(self._work, self._timeout)
        self.table = self._gathered.reshape(-1, _HEADER + _FIELDS).cpu().tolist()
        what = self.what
        if self._failure is not None:
            raise self._failure
        if any(row[0] != _MAGIC or row[1] != _FUNCTIONS[what] for row in self.table):
            raise ValueError(f"{what}: the ranks of the process group are not all calling the same function")
        failed = [row for row in self.table if row[2]]
        if failed:                          # the type of the first offending rank's error (its reference's)
            raise _FAILURE_TYPES.get(failed[0][2], ValueError)(
                f"{what}: rank {failed[0][3]} rejected its inputs (its own error names the argument); nothing was "
                "computed on any rank")
        return self

    def column(self, k: int) -> list[int]:
        return [row[_HEADER + k] for row in self.table]

    def require_equal(self, k: int, name: str, ranks: list[int] | None = None,
                      shown_as: Callable[[int], Any] = lambda value: value) -> None:
        """Raise (every rank alike) unless field ``k`` is the same on every rank (of ``ranks``); the message shows
        each rank's value through ``shown_as`` (the option as the caller passed it)."""
        rows = self.table if ranks is None else [row for row in self.table if row[3] in ranks]
        values = {row[_HEADER + k] for row in rows}
        if len(values) > 1:
            shown = ", ".join(f"rank {row[3]}: {shown_as(row[_HEADER + k])!r}" for row in rows)
            raise ValueError(f"{name}: differs between ranks ({shown}); it must be the same on every rank"
                             + ("" if ranks is None else " of a context group"))

    def context_groups(self) -> list[list[int]]:
        """The context groups as lists of global ranks in column order (a rank without one is a group of its own),
        after checking that the ranks agree about them."""
        clusters: dict[int, list[list[int]]] = {}
        for row in self.table:
            first, size, index = row[4:7]
            if first == -2 or (first >= 0 and index < 0):
                raise ValueError(f"context_group: rank {row[3]} passed a context group it does not belong to")
            clusters.setdefault(first if first >= 0 else -1 - row[3], []).append(row)
        groups = []
        for key, rows in sorted(clusters.items()):
            if key < 0:
                groups.append([rows[0][3]])
                continue
            sizes = {row[5] for row in rows}
            ordered = sorted(rows, key=lambda row: row[6])
            if (len(sizes) != 1 or [row[6] for row in ordered] != list(range(len(rows)))
                    or rows[0][5] != len(rows) or ordered[0][3] != key):
                raise ValueError("context_group: the ranks disagree about their context groups (every rank of a "
                                 "context group must pass that group, and all of its ranks must belong to group); "
                                 f"ranks {sorted(row[3] for row in rows)} claim the group starting at rank {key}")
            groups.append([row[3] for row in ordered])
        return groups


# ----------------------------------------------------------------------------------------------------------------------
# Vocab parallel


def _require_tiling(starts: list[int], widths: list[int], ranks: list[int]) -> None:
    """Explicit ``vocab_start`` offsets must tile [0, ΣV_k) — every token id on exactly one rank — or log π(y) and the
    id check would read the wrong rank's logits; the same table on every rank, so every rank raises alike."""
    vocab, expected, previous = sum(widths), 0, None
    for start, width, rank in sorted(zip(starts, widths, ranks)):
        if width == 0:
            continue
        if start > expected:
            raise ValueError(f"vocab_start: token ids [{expected}, {start}) lie on no rank's shard (rank {rank} starts "
                             f"at {start}); the shards must tile [0, {vocab})")
        if start < expected:
            raise ValueError(f"vocab_start: rank {rank}'s shard [{start}, {start + width}) overlaps rank {previous}'s, "
                             f"which ends at {expected}; the shards must tile [0, {vocab})")
        expected, previous = start + width, rank


@torch.no_grad()
def vocab_parallel_token_statistics(logits_shard: Any, token_ids: Any = None, *, group: Any = None,
                                    vocab_start: int | None = None, chunk_size: int | None = None,
                                    check_values: bool = True, timeout: float | None = None,
                                    _entropy: bool = True) -> TokenStatistics:
    """log π(y), entropy and Σπ² of logits sharded over the vocabulary, in one pass over the shard.

    Rank k holds the logits of vocabulary slice [v_k, v_k + V_k) (consecutive in rank order unless ``vocab_start``
    says otherwise). With the global row maximum M (one MAX all-reduce) and, per shard, a = e^{z − M}:

        S₁ = Σa,   S₂ = Σa²,   U = Σa·(z − M),   c = z_y − M on the rank owning y (0 elsewhere)

    are stacked and SUM all-reduced once; then Σπ² = S₂/S₁², H = log S₁ − U/S₁ (non-negative terms) and
    log π(y) = c − log S₁. Equal to :func:`otb_spec.token_statistics_from_logits` on the gathered logits within
    :func:`otb_spec.tolerances.sum_pi_squared_tolerance`.

    Args:
      logits_shard: [..., V_k] this rank's logits (same leading shape and dtype on every rank).
      token_ids: optional [...] global token ids y (the same on every rank) for log π(y).
      group: the vocab-parallel (tensor-parallel) process group; None: the default group.
      vocab_start: v_k, this shard's first global token id; None: the sum of the lower ranks' V_k. Given, on every
        rank, the shards must tile [0, ΣV_k): a gap or an overlap raises ValueError on every rank.
      chunk_size: rows per chunk buffer (default: about 2²⁰ logits; on CUDA 2²³, at least 64 rows — see
        otb_torch._logits._chunk_rows).
      check_values: reject NaN/+inf logits, rows that are −inf on every rank, and ids outside [0, V) — on every rank.
      timeout: seconds each collective may take (None: the process group's timeout).

    Returns:
      :class:`otb_torch.TokenStatistics` (log π(y) None without ids), each [...] in the logits' dtype.

    Collectives: one all-gather of 19 integers per rank (shapes, dtype, vocab offsets), one MAX all-reduce of
    rows + 2 values, one SUM all-reduce of 2–4 values per row.
    """
    failure, z, ids, waits = None, None, None, None
    lead: tuple[int, ...] = ()
    try:
        waits = timeout = _timeout(timeout)
        check_values = check.flag("check_values", check_values)
        z = _logits("logits_shard", logits_shard)
        lead = tuple(z.shape[:-1])
        if token_ids is not None:
            ids = check.tensor("token_ids", token_ids)
            if ids.is_floating_point() or ids.dtype == torch.bool:
                raise TypeError(f"token_ids: expected integer token ids, got dtype {ids.dtype}")
            if tuple(ids.shape) != lead:
                raise ValueError(f"token_ids: expected shape {lead} (logits without the vocabulary axis), got "
                                 f"{tuple(ids.shape)}")
        if vocab_start is not None and (isinstance(vocab_start, bool) or not isinstance(vocab_start, int)
                                        or vocab_start < 0):
            raise ValueError(f"vocab_start: expected a non-negative integer or None, got {vocab_start!r}")
        _chunk_rows(1, chunk_size)
    except (TypeError, ValueError) as exc:
        failure = exc
    rows = int(np.prod(lead)) if z is not None else 0
    width = int(z.shape[-1]) if z is not None else 0
    dtype_code = _dtypes_field(_out_dtype(z), _compute_dtype(z)) if z is not None else 0
    verdicts = _Verdicts("vocab_parallel_token_statistics",
                         [len(lead), rows, hash(lead) & 0x7FFFFFFF, width, ids is not None, dtype_code,
                          -1 if vocab_start is None else vocab_start, _flag_field(check_values)], failure, group,
                         waits, _handshake_device(z if z is not None else logits_shard, group))
    verdicts.require_equal(0, "logits_shard (number of leading dimensions)")
    verdicts.require_equal(1, "logits_shard (number of positions)")
    verdicts.require_equal(2, "logits_shard (leading shape)")
    verdicts.require_equal(4, "token_ids (given on some ranks only)", shown_as=bool)
    verdicts.require_equal(5, "logits_shard (dtypes: ranks of one call must agree)", shown_as=_shown_dtypes)
    verdicts.require_equal(7, "check_values", shown_as=_shown_flag)
    widths, starts = verdicts.column(3), verdicts.column(6)
    if len(set(start < 0 for start in starts)) > 1:
        raise ValueError("vocab_start: given on some ranks only")
    if starts[0] >= 0:
        _require_tiling(starts, widths, [row[3] for row in verdicts.table])
    position = dist.get_rank(group)
    begin = sum(widths[:position]) if vocab_start is None else vocab_start
    vocab = sum(widths)
    assert z is not None

    dtype, device = _compute_dtype(z), z.device
    flat = z.reshape(-1, width)
    maxima = flat.amax(-1).to(dtype)
    ids_flat = None if ids is None else ids.reshape(-1).to(device=device, dtype=torch.int64)
    # the value checks ride in the MAX all-reduce as two extra entries: (rank + 1) where this rank found bad logits or
    # ids, else 0 — decided on the device, read once after the reduction
    no_flag = torch.zeros((), dtype=torch.bool, device=device)
    bad_values = (torch.isnan(maxima) | (maxima == math.inf)).any() if check_values else no_flag
    bad_ids = ((ids_flat < 0) | (ids_flat >= vocab)).any() if check_values and ids_flat is not None else no_flag
    stacked = torch.cat([torch.nan_to_num(maxima, nan=-math.inf, posinf=-math.inf, neginf=-math.inf),
                         torch.stack([bad_values, bad_ids]).to(dtype) * float(dist.get_rank() + 1)])
    _all_reduce(stacked, dist.ReduceOp.MAX, group, timeout)
    overall = stacked[:rows]
    excluded = (overall == -math.inf).any() if check_values and rows else no_flag
    flags = torch.cat([stacked[rows:], excluded.to(dtype)[None]]).cpu().tolist()    # the one host synchronisation
    if flags[0] or flags[1]:
        which = int(flags[0] or flags[1]) - 1
        if which == dist.get_rank():
            if flags[0]:
                _check_maxima("logits_shard", z, maxima, allow_excluded_rows=True)
            host = check._host(ids_flat)
            first = int(np.flatnonzero((host < 0) | (host >= vocab))[0])
            raise ValueError(f"token_ids: must lie in [0, {vocab}) (the whole vocabulary), found {int(host[first])} "
                             f"at flat index {first}")
        argument = "logits_shard (NaN or +inf)" if flags[0] else "token_ids (outside the vocabulary)"
        raise ValueError(f"{argument}: rejected on rank {which}; nothing was computed on any rank")
    if flags[2]:
        first = int(torch.nonzero(overall == -math.inf)[0, 0])
        raise ValueError(f"logits_shard: every logit is -inf on every rank at flat position {first}; the softmax is "
                         "undefined there")
    shift = torch.where(torch.isinf(overall), torch.zeros_like(overall), overall)

    # rows of partials: S₁, S₂, then U (entropy) unless only Σπ² is wanted, then c with ids
    parts = 2 + int(_entropy) + int(ids is not None)
    partials = torch.zeros((parts, rows), dtype=dtype, device=device)
    step = _chunk_rows(width, chunk_size, device)
    shifted = torch.empty((min(step, max(rows, 1)), width), dtype=dtype, device=device)
    exps = torch.empty_like(shifted)
    for start in range(0, rows, step):
        block = flat[start:start + step]
        count = block.shape[0]
        d, a = shifted[:count], exps[:count]
        torch.sub(block, shift[start:start + count, None], out=d)
        torch.exp(d, out=a)
        partials[0, start:start + count] = a.sum(-1)
        partials[1, start:start + count] = _row_dot(a, a)
        if _entropy:
            d.nan_to_num_(nan=0.0, neginf=0.0)      # −inf logits: a = 0, no contribution to Σ a·(z − M)
            partials[2, start:start + count] = _row_dot(a, d)
        if ids is not None:
            local = ids_flat[start:start + count] - begin
            owned = (local >= 0) & (local < width)
            chosen = block.gather(1, local.clamp(0, width - 1)[:, None])[:, 0].to(dtype)
            partials[-1, start:start + count] = torch.where(owned, chosen - shift[start:start + count],
                                                           torch.zeros_like(chosen))
    _all_reduce(partials, dist.ReduceOp.SUM, group, timeout)
    total, squares = partials[0], partials[1]
    log_total = torch.log(total)
    out = _out_dtype(z)
    spp = (squares / torch.square(total)).reshape(lead).to(out)
    entropy = (log_total - partials[2] / total).reshape(lead).to(out) if _entropy else None
    log_probs = None
    if ids is not None:              # an id outside [0, V) (check_values=False) is on no shard: NaN, not −log S₁
        inside = (ids_flat >= 0) & (ids_flat < vocab)
        log_probs = torch.where(inside, partials[-1] - log_total, math.nan).reshape(lead).to(out)
    return TokenStatistics(log_probs, entropy, spp)


def vocab_parallel_sum_pi_squared(logits_shard: Any, *, group: Any = None, chunk_size: int | None = None,
                                  check_values: bool = True, timeout: float | None = None) -> torch.Tensor:
    """Σπ² [...] of logits sharded over the vocabulary (:func:`vocab_parallel_token_statistics` without ids).

    Replaces verl 0.9.1's ``vocab_parallel_sum_pi_squared`` (three all-reduces and two shard-sized temporaries) with
    one MAX and one SUM all-reduce (of 2 values per row) and chunk buffers. For the entropy as well, call
    :func:`vocab_parallel_token_statistics`: it rides in the same SUM.
    """
    return vocab_parallel_token_statistics(logits_shard, None, group=group, chunk_size=chunk_size,
                                           check_values=check_values, timeout=timeout,
                                           _entropy=False).sum_pi_squared


# ----------------------------------------------------------------------------------------------------------------------
# Data and context parallel OTB


class ContextScan(NamedTuple):
    """A context shard's whole-row scans, [B, T_c] (``returns``, ``energy``) and [B] int64 (the rest).

    Attributes:
      returns: Gₜ = Σ_{k≥t} mₖrₖ over the whole row.
      energy: Wₜ = Σ_{j≤t} mⱼρⱼ²wⱼ over the whole row.
      lengths: the rows' valid tokens in all shards.
      valid_before: valid tokens in the shards before this one.
      columns_before: positions in the shards before this one (a Python int).
    """

    returns: torch.Tensor
    energy: torch.Tensor
    lengths: torch.Tensor
    valid_before: torch.Tensor
    columns_before: int


class _Local(NamedTuple):
    rewards: torch.Tensor
    mask: torch.Tensor
    log_probs: torch.Tensor
    sum_pi_squared: torch.Tensor
    is_weights: torch.Tensor | None
    ids: torch.Tensor | None


def _check_values(local: _Local, exact: bool) -> None:
    """The reference's value rules on this rank's inputs (raises its error naming the argument): ``exact`` runs
    its validators on host copies directly, else after the device pre-check flags something."""
    check.check_values(True, rewards=("rewards", local.rewards), mask=("response_mask", local.mask),
                       log_probs=("log_probs", local.log_probs), sum_pi_squared=("sum_pi_squared", local.sum_pi_squared),
                       is_weights=None if local.is_weights is None else ("is_weights", local.is_weights), exact=exact)


def _exact(local: _Local) -> bool:
    """Integer token statistics have no input slack and π² may underflow: the reference's validators decide."""
    return not (local.log_probs.is_floating_point() and local.sum_pi_squared.is_floating_point())


def _validated(rewards: Any, response_mask: Any, log_probs: Any, sum_pi_squared: Any, is_weights: Any,
               group_ids: Any, num_groups: int | None, check_values: bool) -> _Local:
    """This rank's inputs with their metadata checked, and their values too when ``check_values`` (the native
    path passes False and checks the values inside its first sweep)."""
    rewards_t, mask_t, lp_t, spp_t, weights_t = check.token_batch(rewards, response_mask, log_probs, sum_pi_squared,
                                                                  is_weights)
    if check_values:
        local = _Local(rewards_t, mask_t, lp_t, spp_t, weights_t, None)
        _check_values(local, _exact(local))
    ids = None
    if num_groups is not None:
        if isinstance(num_groups, bool) or not isinstance(num_groups, (int, np.integer)) or num_groups < 1:
            raise ValueError(f"num_groups: expected a positive integer, got {num_groups!r}")
        num_groups = int(num_groups)
        ids = check.tensor("group_ids", group_ids)
        if ids.is_floating_point() or ids.dtype == torch.bool:
            raise TypeError(f"group_ids: expected global integer group ids in [0, num_groups), got dtype {ids.dtype} "
                            "(otb_torch.distributed.global_group_ids numbers ids of any kind)")
        if ids.dim() != 1 or ids.shape[0] != rewards_t.shape[0]:
            raise ValueError(f"group_ids: expected {rewards_t.shape[0]} ids (one per row), got shape "
                             f"{tuple(ids.shape)}")
        ids = ids.to(device=rewards_t.device, dtype=torch.int64)
        outside = (ids < 0) | (ids >= num_groups)
        if bool(outside.any()):
            first = int(torch.nonzero(outside)[0, 0])
            raise ValueError(f"group_ids: must lie in [0, {num_groups}) (num_groups), found {int(ids[first])} at "
                             f"index {first}")
    return _Local(rewards_t, mask_t, lp_t, spp_t, weights_t, ids)


def _scan(local: _Local, dtype: torch.dtype, context_group: Any, columns_before: int, timeout: float | None
          ) -> ContextScan:
    """The block's Gₜ and Wₜ (the port's own kernels), then, with a context group, the other blocks' totals added:
    the rewards of the later ones, the energy of the earlier ones."""
    m = local.mask.to(dtype)
    returns = reward_to_go(local.rewards.to(dtype), m)
    energy = realized_energy(token_energy(local.log_probs.to(dtype), local.sum_pi_squared.to(dtype), m), None,
                             None if local.is_weights is None else local.is_weights.to(dtype))
    valid = m.sum(-1)
    if context_group is None:
        return ContextScan(returns, energy, valid.to(torch.int64), torch.zeros_like(valid, dtype=torch.int64),
                           columns_before)
    totals = torch.stack([returns[:, 0], energy[:, -1], valid]).to(torch.float64)      # [3, B]; G₀ = the reward total
    gathered = _all_gather(totals, context_group, timeout)                               # [P_c, 3, B]
    me = dist.get_rank(context_group)
    returns.add_(gathered[me + 1:, 0].sum(0).to(dtype)[:, None])
    energy.add_(gathered[:me, 1].sum(0).to(dtype)[:, None])
    return ContextScan(returns, energy, gathered[:, 2].sum(0).to(torch.int64),
                       gathered[:me, 2].sum(0).to(torch.int64), columns_before)


def _layout(verdicts: _Verdicts, rows_field: int, width_field: int, ids_field: int | None
            ) -> tuple[int, int, list[list[int]]]:
    """Check that each context group's ranks hold the same rows (and ids); return (this rank's columns_before, K, the
    context groups), K the longest padded row over the ranks: the widest context group's total width."""
    me = dist.get_rank()
    widths = {row[3]: row[_HEADER + width_field] for row in verdicts.table}
    columns_before, width = 0, 1
    groups = verdicts.context_groups()
    for members in groups:
        if len(members) > 1:
            verdicts.require_equal(rows_field, "rewards (number of rows B)", members)
            if ids_field is not None:
                verdicts.require_equal(ids_field, "group_ids", members)
        width = max(width, sum(widths[rank] for rank in members))
        if me in members:
            columns_before = sum(widths[rank] for rank in members[:members.index(me)])
    return columns_before, width, groups


@torch.no_grad()
def context_parallel_returns_and_energy(rewards: Any, response_mask: Any, log_probs: Any, sum_pi_squared: Any, *,
                                        is_weights: Any = None, context_group: Any = None, check_values: bool = True,
                                        timeout: float | None = None) -> ContextScan:
    """Gₜ and Wₜ of rows cut along T over the ranks of ``context_group`` (rank c holds columns [t_c, t_{c+1}) of the
    same B rows, consecutive in rank order); the port of :func:`otb_spec.distributed.context_shard_returns_and_energy`.

    One all-gather of 19 integers (the handshake) and one all-gather of the [3, B] row totals (Σmr, Σmρ²w, Σm):
    P_c·3·B float64 values per rank, whatever T.
    """
    failure, local, waits = None, None, None
    try:
        waits = timeout = _timeout(timeout)
        check_values = check.flag("check_values", check_values)
        local = _validated(rewards, response_mask, log_probs, sum_pi_squared, is_weights, None, None, check_values)
    except (TypeError, ValueError) as exc:
        failure = exc
    shape = (0, 0) if local is None else tuple(local.rewards.shape)
    dtype = None if local is None else check.accumulation_dtype(local.rewards, local.log_probs,
                                                                 local.sum_pi_squared, local.is_weights)
    dtypes = 0 if local is None else _dtypes_field(check.output_dtype(local.rewards), dtype)
    verdicts = _Verdicts("context_parallel_returns_and_energy",
                         [shape[0], shape[1], local is not None and local.is_weights is not None,
                          _flag_field(check_values), dtypes], failure, context_group, waits,
                         _handshake_device(rewards, context_group), context_group)
    verdicts.require_equal(2, "is_weights (given on some ranks only)", shown_as=bool)
    verdicts.require_equal(3, "check_values", shown_as=_shown_flag)
    verdicts.require_equal(4, _DTYPES_DIFFER, shown_as=_shown_dtypes)
    columns_before, _, _ = _layout(verdicts, 0, 1, None)
    assert local is not None and dtype is not None
    scan = _scan(local, dtype, context_group, columns_before, timeout)
    out = check.output_dtype(local.rewards)
    return scan._replace(returns=scan.returns.to(out), energy=scan.energy.to(out))


@torch.no_grad()
def distributed_token_baseline(rewards: Any, response_mask: Any, group_ids: Any, log_probs: Any, sum_pi_squared: Any,
                               *, num_groups: int, is_weights: Any = None, align: str = "position",
                               leave_one_out: bool = False, handle_zero_tail: bool | None = None,
                               epsilon: float = 1e-8, group: Any = None, context_group: Any = None,
                               check_values: bool = True, timeout: float | None = None) -> AdvantageResult:
    """OTB for a batch split over ranks: this rank's rows get what one process would compute on the whole batch.

    Data parallel: the members of a prompt group may sit on any ranks of ``group`` (any order, unequal groups, a rank
    without valid tokens). Context parallel (optional): ranks of ``context_group`` (a subset of ``group``) hold
    consecutive column ranges of the same rows, in rank order. Every rank of ``group`` calls this function.

    Per rank (the protocol of :mod:`otb_spec.distributed`): the whole-row scans (:func:`context_parallel_returns_and_energy`),
    then its terms of N_gk = Σᵢ GᵢWᵢmᵢ, D_gk = Σᵢ Wᵢmᵢ (and V_gk = Σᵢ mᵢ for leave-one-out) on the [G, K] aligned grid,
    SUM all-reduced over ``group``; the self-inclusive rules need each group's members and top-two lengths, gathered
    as [4, G] integers (on CPU in the same all-reduce, each rank's in its own slot). Where every rank of ``group``
    holds every row (``context_group`` spans ``group``) and ``align="position"``, a rank's grid cells already hold
    every row's terms and it counts every row itself: neither is summed nor gathered. K = the longest padded row over
    the ranks (Σ of the context shards' widths). Leave-one-out: a member whose weight is more than ¾ of its cell's D
    takes the others' sums added directly instead of D − Wᵢ, which cancels in float32 where Wᵢ dwarfs them: an
    all-gather of each rank's count of such cells, and where there are any, an all-gather of the cells and a SUM
    all-reduce of their others' sums (2 values per cell; docs/distributed.md) — nothing more over two ranks with the
    native kernel, whose exchange of the grid brings the other rank's own sums. Extra memory per rank: the grid,
    G·(2 or 3)·K values (over two ranks on CPU a second one receives the peer's while they are exchanged, freed before
    the final sweep allocates the advantages and baselines: the peak grows only where the grid outweighs those two
    outputs) — G·(2 or 3)·T_c where a context group spans ``group``, by position: the piece's own columns, nothing
    exchanged — and a few rows of T per thread (on CPU; the eager path also materialises [B, T] temporaries);
    leave-one-out on CPU, each cell's top weight and term on the rank (G·2·T values, and a copy G·2·K wide where another
    rank's rows are longer) and, while the grid is summed, the rank's own N and D (G·2·K; over two ranks the received
    grid is kept until they are read).

    Args:
      rewards, response_mask, log_probs, sum_pi_squared, is_weights: this rank's [B, T_c] pieces, as
        :func:`otb_torch.optimal_token_baseline`.
      group_ids: [B] global integer group ids in [0, num_groups) (:func:`global_group_ids` numbers other ids).
      num_groups: G, the same on every rank.
      align: ``"position"`` (verl's single-turn OTB) or ``"valid_token"`` (multi-turn compaction).
      leave_one_out: the unbiased leave-one-out baseline.
      handle_zero_tail: verl's zero-tail rule (default: on for the self-inclusive baseline; not with leave-one-out).
      epsilon: ε ≥ 0.
      group: the process group over which the batch is split (None: the default group).
      context_group: the context-parallel group of this rank, or None.
      check_values, timeout: as :func:`vocab_parallel_token_statistics`.

    Returns:
      :class:`otb_torch.AdvantageResult` for this rank's rows and columns, in the rewards' dtype.
    """
    failure, local, native, dtype, waits = None, None, None, torch.float32, None
    options = [0, 0, 0, 0]
    try:
        waits = timeout = _timeout(timeout)
        reference_checks.alignment(align)
        leave_one_out = check.flag("leave_one_out", leave_one_out)
        handle_zero_tail = check.zero_tail(handle_zero_tail, leave_one_out)
        epsilon = check.epsilon(epsilon)
        check_values = check.flag("check_values", check_values)
        options = [_ALIGNMENTS.index(align), int(leave_one_out), int(handle_zero_tail), _float_bits(epsilon)]
        local = _validated(rewards, response_mask, log_probs, sum_pi_squared, is_weights, group_ids, num_groups,
                           False)
        dtype = check.accumulation_dtype(local.rewards, local.log_probs, local.sum_pi_squared, local.is_weights)
        native = _native.usable(local.rewards.device, dtype)      # CPU: the native kernel, value checks inside
        if check_values and not native:
            _check_values(local, _exact(local))
    except (TypeError, ValueError) as exc:
        failure, native = exc, False
    shape = (0, 0) if local is None else tuple(local.rewards.shape)
    # the ids' fingerprint is compared only among the ranks of a context group of several (_layout): without a
    # context group, 0 on every rank
    fingerprint = 0 if local is None or local.ids is None or context_group is None else _fingerprint(local.ids)
    groups = int(num_groups) if isinstance(num_groups, (int, np.integer)) and not isinstance(num_groups, bool) else -1
    verdicts = _Verdicts("distributed_token_baseline",
                         options + [groups, 0 if local is None else _dtypes_field(check.output_dtype(local.rewards),
                                                                                   dtype),
                                    int(local is not None and local.is_weights is not None),
                                    shape[0], shape[1], fingerprint, _flag_field(check_values), int(native)],
                         failure, group,
                         waits, _handshake_device(rewards, group), context_group, wait=not native)
    start = None
    if native:                            # the first sweep while the handshake travels; its verdict rides later
        assert local is not None
        start = _native_first_sweep(local, groups, dtype, align=align, leave_one_out=leave_one_out,
                                    check_values=check_values, context=context_group is not None,
                                    ranks=dist.get_world_size(group))
        verdicts.finish()
    shown = (lambda index: _ALIGNMENTS[index], _shown_flag, _shown_flag, _shown_float, int, _shown_dtypes, bool)
    for field, name in enumerate(("align", "leave_one_out", "handle_zero_tail", "epsilon", "num_groups",
                                  _DTYPES_DIFFER, "is_weights (given on some ranks only)")):
        verdicts.require_equal(field, name, shown_as=shown[field])
    verdicts.require_equal(10, "check_values", shown_as=_shown_flag)
    # the native and eager paths exchange different buffers and collectives: every rank must take the same one
    verdicts.require_equal(11, "the kernel (native where otb_torch builds its C kernel and OTB_TORCH_NATIVE allows "
                           "it, else eager)", shown_as=lambda value: "native" if value else "eager")
    columns_before, width, context_groups = _layout(verdicts, 7, 8, 9)
    assert local is not None and local.ids is not None
    # every rank of ``group`` holds every row (one context group of all of them, or a group of one): by position, the
    # grid's cells at this rank's columns then hold every row's terms already, and no other rank adds to them
    whole_rows = len(context_groups) == 1
    grid_is_complete = whole_rows and (align == "position" or len(verdicts.table) == 1)
    if start is not None:
        advantages, returns, baselines = _native_baseline(
            local, start, groups, width, columns_before, align=align, leave_one_out=leave_one_out,
            handle_zero_tail=handle_zero_tail, epsilon=epsilon, dtype=dtype, group=group,
            context_group=context_group, timeout=timeout, most_rows=max(verdicts.column(7)), whole_rows=whole_rows,
            grid_is_complete=grid_is_complete)
        _check_outputs((advantages, returns, baselines), check_values, local, width)
        return _in_output_dtype((advantages, returns, baselines), local, dtype, check_values)
    scan = _scan(local, dtype, context_group, columns_before, timeout)
    advantages, returns, baselines = _baseline(local, scan, groups, width, align=align,
                                               leave_one_out=leave_one_out, handle_zero_tail=handle_zero_tail,
                                               epsilon=epsilon, dtype=dtype, group=group,
                                               context_group=context_group, timeout=timeout,
                                               grid_is_complete=grid_is_complete)
    _check_outputs((advantages, returns, baselines), check_values, local, width)
    return _in_output_dtype((advantages, returns, baselines), local, dtype, check_values)


class _NativeStart(NamedTuple):
    """What the native path computed while the handshake travelled: the rank's plan; its first sweep (data
    parallel: with the grid over its own width T; context parallel: with its row pieces' totals instead); and the
    reference's error if its values were rejected (sent to the other ranks in the grid's all-reduce — with the row
    totals where every rank holds every row; in a group of one raised at once)."""

    plan: _native.LocalGroups
    first: _native.FirstSweep
    failure: ValueError | None
    extra: int


def _extra(num_groups: int, ranks: int) -> int:
    """Values after the grid in the all-reduced buffer: each rank's [4, G] group statistics in its own slot (the SUM
    of slots only one rank fills is an all-gather), then one value-check flag per rank."""
    return ranks * 4 * num_groups + ranks


def _native_first_sweep(local: _Local, num_groups: int, dtype: torch.dtype, *, align: str, leave_one_out: bool,
                        check_values: bool, context: bool, ranks: int) -> _NativeStart:
    """The native kernel's work before any collective completes, value checks inside: without a context group the
    whole first sweep (returns, energies, the rank's grid of width T, group statistics), with one the row pieces'
    totals. A flag from the kernel (or integer token statistics) runs the reference's validators; their error is
    kept, not raised, so that this rank still takes part in the collectives that tell the others."""
    assert local.ids is not None
    slacks = (check.slack(local.log_probs), check.slack(local.sum_pi_squared)) if check_values else None
    plan = _native.local_groups(local.ids, local.rewards.shape[1])
    extra = _extra(num_groups, ranks)
    first = _native.distributed_first(local.rewards, local.mask, local.log_probs, local.sum_pi_squared,
                                      local.is_weights, plan, num_groups=num_groups, align=align,
                                      leave_one_out=leave_one_out, dtype=dtype, check=check_values, slacks=slacks,
                                      context=context, extra=extra)
    exact, failure = _exact(local), None
    if check_values and (exact or first.bad):
        try:
            _check_values(local, exact)
        except ValueError as exc:
            failure = exc
    return _NativeStart(plan, first, failure, extra)


_FLOAT32_EXACT_BELOW = 2**24     # integers below this are exact in float32: the statistics may ride in the grid


def _raise_rejected(flags: torch.Tensor, failure: ValueError | None, group: Any) -> None:
    """Raise on every rank if a rank of ``group`` rejected its values: ``flags`` [P] (nonzero where the rank of that
    index in ``group`` did), ``failure`` this rank's own error (the reference's, naming the argument)."""
    rejected = torch.nonzero(flags).flatten().tolist()
    if not rejected:
        return
    if failure is not None:
        raise failure
    members = list(range(dist.get_world_size())) if group is None else dist.get_process_group_ranks(group)
    raise ValueError(f"distributed_token_baseline: rank {members[rejected[0]]} rejected its inputs (its own error "
                     "names the argument); no result on any rank")


def _native_baseline(local: _Local, start: _NativeStart, num_groups: int, width: int, columns_before: int, *,
                     align: str, leave_one_out: bool, handle_zero_tail: bool, epsilon: float, dtype: torch.dtype,
                     group: Any, context_group: Any, timeout: float | None, most_rows: int, whole_rows: bool,
                     grid_is_complete: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The native path after the handshake: (context parallel) the other pieces' totals and the first sweep with
    their offsets; one SUM all-reduce over ``group`` of the grid, the group statistics and the value-check flags
    (every rank raises if one rank's values were rejected) — leave-one-out: then the dominant members' others' sums
    (:func:`_leave_out_tops`); the final sweep. K = ``width``.

    ``whole_rows``: every rank of ``group`` holds every row (one context group of all of them, or a group of one);
    the value-check flags then ride with the pieces' totals, whose all-gather reaches every rank. ``grid_is_complete``
    (whole rows, by position, or a group of one): the cells a rank reads hold every row's terms already and every
    rank counts the group statistics of all rows, so no all-reduce follows — one blocking collective in all; a
    context piece's grid then holds its own T_c columns, not all K (K/T_c times less memory)."""
    first, pieces = start.first, {}
    if first.totals is not None:                                   # context parallel: offsets from the other pieces
        totals = first.totals.reshape(-1)
        if whole_rows:
            totals = torch.cat([totals, torch.tensor([float(start.failure is not None)], dtype=torch.float64)])
        gathered = _all_gather(totals, context_group, timeout)                      # [P_c, 3·B (+ 1)] float64
        if whole_rows:
            _raise_rejected(gathered[:, -1], start.failure, context_group)
            gathered = gathered[:, :-1]
        gathered = gathered.reshape(gathered.shape[0], 3, -1)                       # [P_c, 3, B]
        piece = dist.get_rank(context_group)
        own_columns = grid_is_complete and align == "position"         # the grid holds the piece's columns alone
        pieces = dict(columns_before=columns_before,
                      valid_before=gathered[:piece, 2].sum(0).to(torch.int64).numpy(),
                      total_lengths=gathered[:, 2].sum(0).to(torch.int64).numpy(),
                      origin=columns_before if own_columns else 0)
        first = _native.distributed_offsets(
            local.mask, start.plan, first, num_groups=num_groups, columns=local.mask.shape[1] if own_columns else width,
            align=align, leave_one_out=leave_one_out, dtype=dtype, ret_offsets=gathered[piece + 1:, 0].sum(0).numpy(),
            energy_offsets=gathered[:piece, 1].sum(0).numpy(), count_rows=piece == 0 or grid_is_complete,
            extra=0 if grid_is_complete else start.extra, **pieces)
    assert first.grid is not None and first.buffer is not None
    if grid_is_complete:
        if first.totals is None and start.failure is not None:    # a group of one: its own verdict
            raise start.failure
        gathered_statistics = None if leave_one_out else first.stats.numpy()[None]     # [1, 4, G]: every row
    else:
        first, gathered_statistics = _reduce_grid(first, start, num_groups, width, leave_one_out=leave_one_out,
                                                  dtype=dtype, group=group, timeout=timeout, most_rows=most_rows)
    advantages, baselines = _native.distributed_final(
        local.mask, start.plan, first, gathered_statistics, num_groups=num_groups, align=align,
        leave_one_out=leave_one_out, handle_zero_tail=handle_zero_tail, epsilon=epsilon, dtype=dtype, **pieces)
    return advantages, first.returns, baselines


def _reduce_grid(first: _native.FirstSweep, start: _NativeStart, num_groups: int, width: int, *, leave_one_out: bool,
                 dtype: torch.dtype, group: Any, timeout: float | None, most_rows: int
                 ) -> tuple[_native.FirstSweep, np.ndarray | None]:
    """The SUM all-reduce over ``group`` of the rank's grid (widened to K = ``width`` where another rank's rows are
    longer), with every rank's group statistics and value-check flag in its own slot after it; raises on every rank
    if one rank's values were rejected. Returns the sweep with the summed grid and, self-inclusive, the ranks'
    statistics [P, 4, G] int64 (merged in the kernel)."""
    ranks, me = dist.get_world_size(group), dist.get_rank(group)
    cells = first.grid.numel()
    if first.grid.shape[2] < width:                                # another rank's rows are longer: widen to K
        buffer = torch.zeros(num_groups * first.grid.shape[1] * width + start.extra, dtype=dtype)
        grid = buffer.narrow(0, 0, num_groups * first.grid.shape[1] * width).view(num_groups, -1, width)
        grid.narrow(2, 0, first.grid.shape[2]).copy_(first.grid)
        tops = None
        if first.tops is not None:
            tops = torch.zeros((num_groups, 2, width), dtype=dtype)
            tops.narrow(2, 0, first.tops.shape[2]).copy_(first.tops)
        first, cells = first._replace(buffer=buffer, grid=grid, tops=tops), grid.numel()
    # leave-one-out: the rank's whole sums go out, its own sums without its tops kept apart
    rest = None if first.tops is None else _native.distributed_tops_in(first.grid, first.tops)
    slots = first.buffer.narrow(0, cells, start.extra)
    statistics = slots.narrow(0, 0, ranks * 4 * num_groups).view(ranks, 4, num_groups)
    flags = slots.narrow(0, ranks * 4 * num_groups, ranks)
    # the statistics (members and counts ≤ a rank's rows, lengths ≤ K) are exact in the buffer's dtype below 2²⁴
    # in float32; every rank knows K and the ranks' row counts (the handshake), so all make the same choice
    exact = dtype == torch.float64 or max(width, most_rows) < _FLOAT32_EXACT_BELOW
    if exact:
        statistics[me] = first.stats.to(dtype)
    flags[me] = float(start.failure is not None)
    peer = None
    if leave_one_out and _pairwise(first.buffer, dist.ReduceOp.SUM, group):      # the peer's own sums, kept
        peer = _exchange(first.buffer, group, timeout)
        first.buffer.add_(peer)
    else:
        _all_reduce(first.buffer, dist.ReduceOp.SUM, group, timeout)
    _raise_rejected(flags, start.failure, group)
    if leave_one_out:
        assert first.tops is not None and rest is not None
        _leave_out_tops(first.grid, first.tops, rest, group=group, timeout=timeout,
                        peer=None if peer is None else peer.narrow(0, 0, cells).view(first.grid.shape))
        return first, None
    return first, statistics.numpy().astype(np.int64) if exact else _all_gather(first.stats, group, timeout).numpy()


# Leave-one-out's dominant members. A member whose weight is more than ¾ of its column's D (at most one per cell over
# all ranks: two would make D > 1.5·D even after rounding) must not take D − Wᵢ, which cancels in float32 to rounding
# noise where Wᵢ dwarfs the others' energy (a forced opening where one member sampled another token; proofs/N1 item 5).
# Its rank cannot tell the others' terms apart in the summed grid: one more exchange gives it their sums, added
# directly, at its dominant cells only.


def _sums_without_dominant(mine: torch.Tensor, contributions: Callable[[torch.Tensor], torch.Tensor], *, group: Any,
                           timeout: float | None, complete: bool) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The others' sums (Σ_{j≠i} GⱼWⱼmⱼ, Σ_{j≠i} Wⱼmⱼ) of every rank's dominant members. ``mine``: the sorted cells
    (g·K + c, int64) where a member of this rank dominates; ``contributions(cells)``: [n, 2] this rank's sums of N
    and D terms at ``cells`` (sorted) without its dominant members. Returns (cells, sums) over all ranks' dominant
    cells, sorted, or None where no rank has one. Collectives: an all-gather of each rank's count (P integers); where
    a rank has a dominant member, an all-gather of the cells (padded to the largest count) and a SUM all-reduce of
    the [n, 2] sums. None where ``complete`` (this rank holds every row's terms of its cells): its own sums."""
    if complete:
        return (mine, contributions(mine)) if mine.numel() else None
    counts = _all_gather(torch.tensor([mine.numel()], dtype=torch.int64, device=mine.device), group, timeout)
    most = int(counts.max())
    if most == 0:
        return None
    padded = torch.full((most,), -1, dtype=torch.int64, device=mine.device)
    padded[:mine.numel()] = mine
    cells = _all_gather(padded, group, timeout).reshape(-1)
    cells = torch.unique(cells[cells >= 0])                          # sorted; one dominant member per cell
    sums = contributions(cells)
    _all_reduce(sums, dist.ReduceOp.SUM, group, timeout)
    return cells, sums


def _leave_out_tops(grid: torch.Tensor, tops: torch.Tensor, rest: torch.Tensor, *, group: Any,
                    timeout: float | None, peer: torch.Tensor | None = None) -> None:
    """The native path's leave-one-out grid [G, 3, K] after its all-reduce: N and D of every cell, in place, become the
    sums without this rank's top member of the cell (``tops`` [G, 2, K]: its weight w and term gw, as the kernel's
    otb_top reads them) — N − gw, D − w (≥ D/4 where w ≤ ¾D), and where that member dominates (w > ¾D) the others'
    sums added directly (``rest`` [G, 2, K]: this rank's own sums without its tops): over two ranks, the other
    rank's sums ``peer`` [G, 3, K] (what the exchange brought) plus its own rest, with no collective
    (:func:`otb_torch._native.distributed_tops_out`, one pass); else :func:`_sums_without_dominant`."""
    _, owned = _native.distributed_tops_out(grid, tops, rest, peer)
    if owned is None:
        return
    columns = grid.shape[2]
    mine = owned.reshape(-1).nonzero().reshape(-1)

    def contributions(cells: torch.Tensor) -> torch.Tensor:
        g, c = cells // columns, cells % columns
        local = rest[g, :, c]                                                           # [n, 2]: N, D terms
        return torch.where(owned[g, c][:, None], local, local + tops[g, :, c].flip(-1))

    found = _sums_without_dominant(mine, contributions, group=group, timeout=timeout, complete=False)
    if found is not None and mine.numel():
        g, c = mine // columns, mine % columns
        others = found[1][torch.searchsorted(found[0], mine)]
        grid[g, 0, c] = others[:, 0]
        grid[g, 1, c] = others[:, 1]


def _baseline(local: _Local, scan: ContextScan, num_groups: int, width: int, *, align: str, leave_one_out: bool,
              handle_zero_tail: bool, epsilon: float, dtype: torch.dtype, group: Any, context_group: Any,
              timeout: float | None, grid_is_complete: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The eager path after the handshake (values checked before it): the grid, SUM all-reduced over ``group``, and
    (self-inclusive) the group statistics, all-gathered — neither where ``grid_is_complete`` (as
    :func:`_native_baseline`: each rank's cells hold every row's terms, and it counts every row); B and A."""
    m = local.mask.to(dtype)
    ids = local.ids
    assert ids is not None
    positions = local.mask.shape[1]
    if align == "position":
        columns = (scan.columns_before + torch.arange(positions, device=m.device)).expand(m.shape[0], -1)
    else:
        columns = (torch.cumsum(m, -1) - m).to(torch.int64) + scan.valid_before[:, None]
    columns = columns.clamp(max=width - 1)
    energy = leave_one_out_energy(scan.energy) if leave_one_out else scan.energy       # W⁺ = max(W, 0)
    weights = energy * m                                            # 0 at masked positions: they add nothing
    planes = [scan.returns * weights, weights] + ([m] if leave_one_out else [])
    if align == "position":                                         # whole rows of the grid: row-wise adds
        # a complete grid: this rank's columns alone (no other rank adds to them), else all K
        origin = scan.columns_before if grid_is_complete else 0
        grid = torch.zeros((len(planes), num_groups, positions if grid_is_complete else width), dtype=dtype,
                           device=m.device)
        window = slice(scan.columns_before - origin, scan.columns_before - origin + positions)
        grid[:, :, window].index_add_(1, ids, torch.stack(planes))
        if not grid_is_complete:
            _all_reduce(grid, dist.ReduceOp.SUM, group, timeout)
        picked = grid[:, :, window].index_select(1, ids)           # [planes, B, T_c]
    else:                                                           # each valid token to its (group, column) cell
        cells = (ids[:, None] * width + columns).reshape(-1)
        source = torch.stack(planes, dim=-1).reshape(cells.shape[0], len(planes))
        grid = torch.zeros((num_groups * width, len(planes)), dtype=dtype, device=m.device).index_add_(0, cells,
                                                                                                     source)
        if not grid_is_complete:
            _all_reduce(grid, dist.ReduceOp.SUM, group, timeout)
        picked = grid.index_select(0, cells).reshape(m.shape + (len(planes),)).movedim(-1, 0)
    numerator, denominator = picked[0], picked[1]
    if leave_one_out:
        others = picked[2] - m
        own = weights
        ratio_num = numerator - scan.returns * own
        ratio_den = denominator - own
        _dominant_others(ratio_num, ratio_den, own, scan.returns, denominator, ids[:, None] * width + columns,
                         group=group, timeout=timeout, complete=grid_is_complete)
        ratio_den = others_denominator(ratio_den, epsilon)
        forced = others <= 0
    else:
        ratio_num, ratio_den = numerator, denominator + epsilon
        stats = _group_lengths(scan.lengths, ids, num_groups, align, count_rows=grid_is_complete
                               or context_group is None or dist.get_rank(context_group) == 0)
        merged = _merge_lengths(stats[None] if grid_is_complete else _all_gather(stats, group, timeout))  # [4, G]
        members, longest, count_longest, second = merged
        forced = (members[ids] < 2)[:, None].expand(m.shape)
        if handle_zero_tail:
            unique = (count_longest[ids] == 1) & (scan.lengths == longest[ids])
            forced = forced | (unique[:, None] & (columns >= second[ids][:, None]))
    zero = ratio_den == 0
    baselines = (ratio_num / ratio_den.masked_fill(zero, 1.0)).masked_fill_(zero | forced, 0.0).mul_(m)
    advantages = (scan.returns - baselines).mul_(m)
    return advantages, scan.returns, baselines


def _dominant_others(numerator: torch.Tensor, denominator: torch.Tensor, weights: torch.Tensor,
                     returns: torch.Tensor, column_energy: torch.Tensor, cells: torch.Tensor, *, group: Any,
                     timeout: float | None, complete: bool) -> None:
    """The eager path's leave-one-out: where a member's weight is more than ¾ of its column's D (``column_energy``),
    its others' sums ``numerator`` and ``denominator`` [B, T_c] (D − Wᵢ there) become theirs added directly
    (:func:`_sums_without_dominant`), in place. ``cells`` [B, T_c]: each token's grid cell g·K + c."""
    dominant = weights > DOMINANT_SHARE * column_energy
    mine = torch.unique(cells[dominant])

    def contributions(wanted: torch.Tensor) -> torch.Tensor:
        flat = cells.reshape(-1)
        at = torch.searchsorted(wanted, flat).clamp_(max=max(wanted.numel() - 1, 0))
        hit = (wanted[at] == flat) & ~dominant.reshape(-1) & (weights.reshape(-1) != 0)
        terms = torch.stack([(returns * weights).reshape(-1)[hit], weights.reshape(-1)[hit]], dim=-1)
        return torch.zeros((wanted.numel(), 2), dtype=weights.dtype, device=weights.device).index_add_(
            0, at[hit], terms)

    found = _sums_without_dominant(mine, contributions, group=group, timeout=timeout, complete=complete)
    if found is None or not bool(dominant.any()):
        return
    wanted, sums = found
    at = torch.searchsorted(wanted, cells[dominant])
    numerator[dominant] = sums[at, 0]
    denominator[dominant] = sums[at, 1]


def _check_outputs(outputs: tuple[torch.Tensor, ...], check_values: bool, local: _Local | None = None,
                   width: int | None = None) -> None:
    """With ``check_values``: this rank's results in the compute dtype, where finite rewards whose group sums
    Σᵢ GₜⁱWₜⁱ (or, leave-one-out, Σ − GᵢWᵢ) left the dtype's range made them ±inf or NaN, raise, naming the rewards
    (or the importance weights where this rank's ρ² alone can overflow the energy of rows ``width`` K long — a
    context piece's rows are longer than the piece: the one-process check,
    :func:`otb_torch._otb._check_finite_outputs`). Only the ranks whose own results are not finite raise (no
    collective is spent on it: the others return theirs)."""
    if check_values:
        weights = None if local is None or local.is_weights is None else ("is_weights", local.is_weights)
        _check_finite_outputs(outputs, "rewards", outputs[0].dtype, weights, None if local is None else local.mask,
                              width)


def _in_output_dtype(outputs: tuple[torch.Tensor, ...], local: _Local, dtype: torch.dtype, check_values: bool
                     ) -> AdvantageResult:
    """The results in the rewards' dtype; with ``check_values``, where that dtype is narrower (float16) and a value
    left its range in the cast, raise naming it (this rank only, as :func:`_check_outputs`)."""
    out = check.output_dtype(local.rewards)
    result = AdvantageResult(*(value.to(out) for value in outputs))
    if check_values and _narrower(out, dtype):
        _check_finite_outputs(result, "rewards", dtype)
    return result


def _group_lengths(lengths: torch.Tensor, ids: torch.Tensor, num_groups: int, align: str, count_rows: bool
                   ) -> torch.Tensor:
    """[4, G] int64: members, longest, count at longest, second longest (−1: none) of this rank's rows (all zero /
    −1 where ``count_rows`` is False: a context shard other than the first counts nothing)."""
    device = lengths.device
    stats = torch.zeros((4, num_groups), dtype=torch.int64, device=device)
    stats[1:].fill_(-1)
    stats[2].fill_(0)
    if not count_rows:
        return stats
    members = lengths > 0 if align == "valid_token" else torch.ones_like(lengths, dtype=torch.bool)
    member_ids, member_lengths = ids[members], lengths[members]
    stats[0].index_add_(0, member_ids, torch.ones_like(member_ids))
    stats[1].scatter_reduce_(0, member_ids, member_lengths, reduce="amax", include_self=True)
    at_longest = member_lengths == stats[1][member_ids]
    stats[2].index_add_(0, member_ids[at_longest], torch.ones_like(member_ids[at_longest]))
    stats[3].scatter_reduce_(0, member_ids[~at_longest], member_lengths[~at_longest], reduce="amax",
                             include_self=True)
    return stats


def _merge_lengths(gathered: torch.Tensor) -> torch.Tensor:
    """[P, 4, G] → [4, G]: the rule of :func:`otb_spec.distributed.combine_group_lengths` (the eager path; the native
    final sweep merges per row: ``_kernel.c``, otb_zero_from)."""
    members, longest, count, second = (gathered[:, k] for k in range(4))
    overall = torch.amax(longest, 0)
    reaches = longest == overall
    merged_count = torch.where(reaches, count, torch.zeros_like(count)).sum(0)
    merged_second = torch.amax(torch.where(reaches, second, longest).clip(min=-1), 0)
    return torch.stack([members.sum(0), overall, merged_count, merged_second])


def global_group_ids(ids: Any, *, group: Any = None, device: Any = None) -> tuple[torch.Tensor, int]:
    """Dense global group ids for per-rank ids of any hashable kind (verl's uid strings): equal ids on any ranks get
    the same integer, numbered in order of first appearance over the ranks in rank order.

    Returns ([B] int64 tensor on ``device``, G). One ``all_gather_object`` of each rank's verdict and distinct ids
    (bounded by the process group's timeout); ids that cannot name a group (NaN, unhashable) raise on every rank.
    """
    failure, distinct, values = None, [], []
    try:
        values = ids.tolist() if hasattr(ids, "tolist") else list(ids)
        for position, value in enumerate(values):
            if isinstance(value, float) and value != value:
                raise ValueError(f"group_ids: NaN at index {position}, which never compares equal to itself and "
                                 "cannot name a group")
            hash(value)
        distinct = list(dict.fromkeys(values))
    except TypeError as exc:
        failure = TypeError(f"group_ids: every id must be hashable ({exc})")
    except ValueError as exc:
        failure = exc
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, (None if failure is None else (_FAILURES.get(type(failure), 1), str(failure)),
                                      distinct), group=group)
    if failure is not None:
        raise failure
    rejected = [rank for rank, (verdict, _) in enumerate(gathered) if verdict is not None]
    if rejected:                                 # the offending rank's type of error, as the handshakes do
        code, message = gathered[rejected[0]][0]
        raise _FAILURE_TYPES.get(code, ValueError)(f"global_group_ids: rank {rejected[0]} of the group rejected its "
                                                   f"ids ({message}); nothing was numbered")
    table: dict[Any, int] = {}
    for _, part in gathered:
        for value in part:
            table.setdefault(value, len(table))
    return torch.tensor([table[value] for value in values], dtype=torch.int64, device=device), len(table)
