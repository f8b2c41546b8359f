"""The torch port's adapter for the conformance suite (``otb_spec.adapters``): conversion + dispatch."""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from typing import Any, Iterator

import numpy as np
import torch

import otb_torch
from otb_torch import _native
from otb_torch._otb import blocks_as_on_accelerators

__all__ = ["TorchAdapter", "make_adapter"]

_DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
           "int64": torch.int64, "int32": torch.int32, "bool": torch.bool}


def _one_rank_group() -> None:
    """Make sure torch.distributed has a default process group of this process alone (gloo, an in-memory store).

    The group stays for the rest of the process (creating and destroying one per call costs ~12 ms); the suites run
    after the shared adapter suite in one pytest process (verl, TRL, accelerate) pass with it in place."""
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    if dist.get_world_size() != 1:
        raise RuntimeError("torch-cpu-distributed: the default process group has more than one rank; this adapter "
                           "runs otb_torch.distributed on a group of one process")


class TorchAdapter:
    """Runs ``otb_torch`` on ``device``; ``compiled=True`` uses its ``torch.compile``d kernels (``compile=True``),
    ``eager=True`` the eager kernels where the native CPU kernel would run (``otb_torch.native_kernel_status``);
    ``distributed=True`` runs the OTB estimators through ``otb_torch.distributed.distributed_token_baseline`` on a
    process group of this process alone — a rank's whole code path (its plan, grid, group statistics, collectives,
    value checks), with every group's members on that rank (tests/test_torch_distributed.py splits batches over
    several processes); ``accelerator_blocks=True`` runs the eager kernels with the batch cut into blocks as on an
    accelerator (``otb_torch._otb.blocks_as_on_accelerators``): the CUDA code path, on the CPU."""

    def __init__(self, device: str = "cpu", compiled: bool = False, eager: bool = False, distributed: bool = False,
                 accelerator_blocks: bool = False):
        self.device = str(torch.device(device))
        self.compiled = bool(compiled)
        self.accelerator_blocks = bool(accelerator_blocks)
        self.eager = bool(eager) or self.accelerator_blocks
        self.distributed = bool(distributed)
        self.name = (f"torch-{torch.device(device).type}" + ("-compiled" if compiled else "")
                     + ("-eager" if eager else "") + ("-distributed" if distributed else "")
                     + ("-accelerator-blocks" if accelerator_blocks else ""))
        self._otb = otb_torch.optimal_token_baseline
        self._multi = otb_torch.multi_turn_optimal_token_baseline
        self._loo = otb_torch.leave_one_out_token_baseline
        if self.distributed:
            _one_rank_group()
            self._otb = self._split(align="position", leave_one_out=False)
            self._multi = self._split(align="valid_token", leave_one_out=False)
            self._loo = self._split(align=None, leave_one_out=True)

    @staticmethod
    def _split(*, align: str | None, leave_one_out: bool):
        """An estimator with otb_torch's signature that calls ``distributed_token_baseline``."""
        from otb_torch.distributed import distributed_token_baseline

        def estimator(rewards, response_mask, segments, log_probs, sum_pi_squared, *, is_weights=None,
                      handle_zero_tail=True, epsilon=1e-8, compile=False, **options):
            assert not compile
            return distributed_token_baseline(
                rewards, response_mask, segments.index, log_probs, sum_pi_squared, num_groups=segments.num_groups,
                is_weights=is_weights, align=options.get("align", align), leave_one_out=leave_one_out,
                handle_zero_tail=None if leave_one_out else handle_zero_tail, epsilon=epsilon)

        return estimator

    @contextmanager
    def _kernel(self) -> Iterator[None]:
        with _native.eager_only() if self.eager else nullcontext():
            with blocks_as_on_accelerators() if self.accelerator_blocks else nullcontext():
                yield

    def asarray(self, array: Any, dtype: str) -> torch.Tensor:
        return torch.as_tensor(np.asarray(array)).to(device=self.device, dtype=_DTYPES[dtype])

    def to_numpy(self, array: torch.Tensor) -> np.ndarray:
        array = array.detach().cpu()
        return (array.float() if array.dtype in (torch.bfloat16, torch.float16) else array).numpy()

    def segments(self, group_ids: Any) -> otb_torch.Segments:
        return otb_torch.segments_from_index(group_ids, self.device)

    def compute_dtype(self, input_dtype: str) -> str:
        return "float64" if input_dtype == "float64" else "float32"

    def optimal_token_baseline(self, rewards, response_mask, segments, log_probs, sum_pi_squared, *,
                               is_weights=None, handle_zero_tail=True, epsilon=1e-8):
        with self._kernel():
            result = self._otb(rewards, response_mask, segments, log_probs, sum_pi_squared, is_weights=is_weights,
                               handle_zero_tail=handle_zero_tail, epsilon=epsilon, compile=self.compiled)
        return result.advantages, result.returns

    def multi_turn_optimal_token_baseline(self, rewards, response_mask, segments, log_probs, sum_pi_squared, *,
                                          is_weights=None, handle_zero_tail=True, epsilon=1e-8):
        with self._kernel():
            result = self._multi(rewards, response_mask, segments, log_probs, sum_pi_squared,
                                 is_weights=is_weights, handle_zero_tail=handle_zero_tail, epsilon=epsilon, compile=self.compiled)
        return result.advantages, result.returns

    def leave_one_out_token_baseline(self, rewards, response_mask, segments, log_probs, sum_pi_squared, *,
                                     is_weights=None, align="position", epsilon=1e-8):
        with self._kernel():
            result = self._loo(rewards, response_mask, segments, log_probs, sum_pi_squared, is_weights=is_weights,
                               align=align, epsilon=epsilon, compile=self.compiled)
        return result.advantages, result.returns

    def sum_pi_squared(self, logits: torch.Tensor) -> torch.Tensor:
        return otb_torch.sum_pi_squared(logits)

    def token_statistics_from_logits(self, logits: torch.Tensor, token_ids: torch.Tensor):
        return tuple(otb_torch.token_statistics_from_logits(logits, token_ids))


def make_adapter(device: str = "cpu", compiled: bool = False, eager: bool = False,
                 distributed: bool = False, accelerator_blocks: bool = False) -> TorchAdapter:
    return TorchAdapter(device=device, compiled=compiled, eager=eager, distributed=distributed,
                        accelerator_blocks=accelerator_blocks)
