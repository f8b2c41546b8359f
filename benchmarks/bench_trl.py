"""OTB's cost on top of plain GRPO per training step in TRL 1.16, on CPU (target: ≤ 5 % of the step).

    python benchmarks/bench_trl.py --steps 8 --threads 1     # 19.6 M-parameter Llama, V = 32000, 16 completions × 128
    python benchmarks/bench_trl.py --steps 8 --threads 1 --head-repeats 0 --paths loss --trainers grpo &
    python benchmarks/bench_trl.py --steps 8 --threads 1 --head-repeats 0 --paths loss --trainers otb   # side by side
    python benchmarks/bench_trl.py --steps 4 --completion-length 64 --hidden 128 --layers 2

Runs ``trl.GRPOTrainer`` and ``otb_torch.trl.OTBGRPOTrainer`` (both variants) on the same randomly initialised Llama,
prompts and seeds, with ``learning_rate=0`` so that every trainer generates exactly the same completions (same weights,
same random stream) — the step times then differ only by what OTB adds. TRL's defaults otherwise (``bf16=True``:
accelerate's bf16 autocast, on CPU too). For each trainer it prints the median wall time of a training step (TRL's own
``step_time`` metric: generation, rewards, the loss's forward and backward, the optimizer step) over ``--steps`` steps
after one warm-up step, the median CPU time of the process per step (``time.process_time`` between TRL's per-step
logs: with one torch thread, what the step computed, less sensitive than wall time to other processes on the
machine), and the median time per step inside TRL's fused LM-head kernel (its forward passes, timed around
``ChunkedLogProbFunction.apply``). OTBGRPOTrainer reads log π and Σπ² off a forward TRL runs anyway, so what
it adds is:

* ``log Σπ²``: TRL's kernel accumulating Σ_v e^{2(z_v−m)} in its tiles beside log π and the entropy, on every pass of
  the policy's head — timed in isolation (below) for one pass over the step's tokens, which is what one generation
  batch costs per step (the loss forward; with ``--paths own`` the loss's two micro-batches);
* ``forward``: with ``--paths own`` (``gradient_accumulation_steps=2``: TRL runs no forward at the sampling weights
  over the whole batch before the loss needs its advantages) one no-grad call of TRL's fused forward, timed inside
  the step; none in TRL's default configuration (``--paths loss``: the loss's own forward gives log π and Σπ²);
* ``advantages``: OTB and the ``otb/…`` metrics, timed inside the step.

The isolated head pass: TRL's kernel over the tokens TRL scores in the step (on CPU every position of the shifted
sequence: B × (prompt + completion − 1)), no gradient (log Σπ² has none; the backward is unchanged), under the same
autocast, with outputs ("entropy",) — what GRPOTrainer asks for — and ("entropy", "log_sum_sq_probs"), alternating,
median of ``--head-repeats``. Peak extra memory: the peak of torch's CPU allocations (the profiler's memory records)
of that pass with and without log Σπ², and of OTB on the last batch, after training.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import tempfile
import time

__all__ = ["main"]


def _tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocabulary = {"<pad>": 0, "<eos>": 1, "<bos>": 2}
    vocabulary.update({f"w{index}": index for index in range(3, vocab_size)})
    core = Tokenizer(models.WordLevel(vocab=vocabulary, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>")


def _model(vocab_size: int, hidden: int, layers: int, seed: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=int(hidden * 2.75) // 8 * 8,
        num_hidden_layers=layers, num_attention_heads=max(1, hidden // 64), num_key_value_heads=max(1, hidden // 64),
        max_position_embeddings=1024, pad_token_id=0, eos_token_id=1, bos_token_id=2))


def _reward(completion_ids: list[list[int]], **_: object) -> list[float]:
    return [sum(1 for token in ids if token < 1000) / max(len(ids), 1) for ids in completion_ids]


def _peak_allocated(function) -> int:
    """Peak bytes allocated by torch on the CPU while ``function`` runs, above what was allocated before (the
    profiler's memory records, replayed in time order)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiler:
        function()
    records = sorted((event.start_ns(), event.nbytes()) for event in profiler.profiler.kineto_results.events()
                     if event.name() == "[memory]")
    level = peak = 0
    for _, change in records:
        level += change
        peak = max(peak, level)
    return peak


class _KernelClock:
    """Stands in for ``trl.trainer.utils._ChunkedLogProbFunction`` (TRL's fused head calls it through that module
    global) and adds the wall time of each forward pass to ``total``."""

    total = 0.0

    @classmethod
    def install(cls) -> None:
        from trl.trainer import utils as trl_utils
        from trl.kernels import ChunkedLogProbFunction

        kernel = ChunkedLogProbFunction

        class Timed:
            @staticmethod
            def apply(*args):
                start = time.perf_counter()
                result = kernel.apply(*args)
                cls.total += time.perf_counter() - start
                return result

        trl_utils._ChunkedLogProbFunction = Timed


def _instrumented(base):
    """``base`` (an OTBGRPOTrainer class) timing what OTB adds per generation batch, and the peak memory of OTB."""

    class Timed(base):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.added: dict[str, list[float]] = {"forward": [], "advantages": []}
            self._pending_forward = 0.0

        def _otb_forward(self, output):
            start = time.perf_counter()
            result = super()._otb_forward(output)
            self._pending_forward += time.perf_counter() - start
            return result

        def _otb_complete(self, *args, **kwargs):
            start = time.perf_counter()
            result = super()._otb_complete(*args, **kwargs)
            self.added["advantages"].append(time.perf_counter() - start)
            self.added["forward"].append(self._pending_forward)
            self._pending_forward = 0.0
            return result

        def peak_memory(self) -> int:
            """Peak extra bytes of OTB and its metrics on the last batch, measured alone after training."""
            import torch

            batch = self.otb_batch
            inputs = {"otb_rewards": batch.rewards, "otb_response_mask": batch.response_mask,
                      "otb_group_ids": batch.group_ids, "otb_row_ids": batch.row_ids}
            with torch.no_grad():
                return _peak_allocated(lambda: base._otb_complete(self, inputs, batch.log_probs,
                                                                  batch.sum_pi_squared))

    return Timed


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--prompt-length", type=int, default=16)
    parser.add_argument("--completion-length", type=int, default=128)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per trainer, after one warm-up step")
    parser.add_argument("--head-repeats", type=int, default=7,
                        help="isolated head passes of each kind (median; 0 skips them)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--trainers", nargs="+", choices=("grpo", "otb", "leave_one_out"),
                        default=["grpo", "otb", "leave_one_out"],
                        help="which trainers to run (e.g. one per process, run side by side on a shared machine)")
    parser.add_argument("--paths", nargs="+", choices=("loss", "own"), default=["loss", "own"],
                        help="where OTB takes log π and Σπ² (docs/trl.md): 'loss' — TRL's default config, the loss's "
                             "forward; 'own' — gradient_accumulation_steps=2, one no-grad forward of its own")
    options = parser.parse_args(argv)

    import torch
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from otb_torch.trl import OTBGRPOTrainer

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    if options.threads:
        torch.set_num_threads(options.threads)
    tokenizer = _tokenizer(options.vocab)
    words = [" ".join(f"w{3 + (17 * p + 5 * i) % (options.vocab - 3)}" for i in range(options.prompt_length))
             for p in range(64)]
    prompts = Dataset.from_dict({"prompt": words})
    rows = options.prompts * options.generations
    parameters = sum(p.numel() for p in _model(options.vocab, options.hidden, options.layers, 0).parameters())
    with tempfile.TemporaryDirectory() as scratch:
        bf16 = bool(GRPOConfig(output_dir=scratch, use_cpu=True).bf16)
    print(f"Llama {parameters / 1e6:.1f} M parameters (V = {options.vocab}, hidden {options.hidden}, "
          f"{options.layers} layers); {rows} completions per step ({options.prompts} prompts × {options.generations}) "
          f"of {options.completion_length} tokens after {options.prompt_length}-token prompts; torch threads "
          f"{torch.get_num_threads()}; {options.steps} timed steps after 1 warm-up; learning_rate 0; "
          f"{'bf16 autocast' if bf16 else 'float32'} (TRL's default)")

    head = _head_passes(options, rows, bf16) if options.head_repeats > 0 else {"extra": math.nan, "pass": math.nan,
                                                                              "peak_extra": math.nan}
    _KernelClock.install()
    configurations = {
        "loss": dict(per_device_train_batch_size=rows, gradient_accumulation_steps=1),
        "own": dict(per_device_train_batch_size=rows // 2, gradient_accumulation_steps=2),
    }
    for name in options.paths:
        results = {}
        trainers = [("grpo", "GRPOTrainer", GRPOTrainer, {}),
                    ("otb", "OTBGRPOTrainer otb", _instrumented(OTBGRPOTrainer), {"variant": "otb"})]
        if name == "loss":
            trainers.append(("leave_one_out", "OTBGRPOTrainer leave_one_out", _instrumented(OTBGRPOTrainer),
                             {"variant": "leave_one_out"}))
        for key, label, trainer_class, extra in trainers:
            if key not in options.trainers:
                continue
            results[label] = _run(trainer_class, extra, configurations[name], options, prompts, tokenizer)
        _report(name, configurations[name], results, head)


def _head_passes(options, rows: int, bf16: bool) -> dict[str, float]:
    """TRL's fused kernel over the tokens TRL's head scores in one step, no gradient, under the step's autocast: as
    GRPOTrainer asks for it (log π, entropy) and with log Σπ² too, alternating, median of ``--head-repeats``; the peak
    extra memory of each. Returns the medians and peaks."""
    import torch
    from trl.kernels import ChunkedLogProbFunction

    tokens = rows * (options.prompt_length + options.completion_length - 1)
    generator = torch.Generator().manual_seed(options.seed)
    hidden = torch.randn(tokens, options.hidden, generator=generator)
    weight = torch.randn(options.vocab, options.hidden, generator=generator) / options.hidden ** 0.5
    ids = torch.randint(0, options.vocab, (tokens,), generator=generator)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16)
    kinds = {"trl": ("entropy",), "otb": ("entropy", "log_sum_sq_probs")}

    def run(outputs):
        return ChunkedLogProbFunction.apply(hidden, weight, None, ids, 1.0, 32768, None, 1.0, outputs)

    times: dict[str, list[float]] = {kind: [] for kind in kinds}
    with torch.no_grad(), autocast:
        for outputs in kinds.values():
            run(outputs)
        for _ in range(options.head_repeats):
            for kind, outputs in kinds.items():
                start = time.perf_counter()
                run(outputs)
                times[kind].append(time.perf_counter() - start)
        peaks = {kind: _peak_allocated(lambda outputs=outputs: run(outputs)) for kind, outputs in kinds.items()}
    result = {kind: statistics.median(values) for kind, values in times.items()}
    extra = statistics.median(b - a for a, b in zip(times["trl"], times["otb"]))
    print(f"\none pass of TRL's fused LM head over the {tokens} tokens it scores per step (H = {options.hidden}, "
          f"V = {options.vocab}), no gradient, median of {options.head_repeats}: (log π, entropy) "
          f"{result['trl'] * 1e3:.0f} ms; with log Σπ² {result['otb'] * 1e3:.0f} ms; paired difference "
          f"{extra * 1e3:+.0f} ms ({100 * extra / result['trl']:+.1f} % of the pass). Peak extra memory of the pass: "
          f"{peaks['trl'] / 2**20:.1f} MiB, with log Σπ² {peaks['otb'] / 2**20:.1f} MiB")
    return {"extra": extra, "pass": result["trl"], "peak_extra": peaks["otb"] - peaks["trl"]}


def _run(trainer_class, extra: dict, configuration: dict, options, prompts, tokenizer):
    from transformers import TrainerCallback
    from transformers.trainer_callback import PrinterCallback, ProgressCallback
    from trl import GRPOConfig

    with tempfile.TemporaryDirectory() as scratch:
        config = GRPOConfig(
            output_dir=scratch, use_cpu=True, max_steps=options.steps + 1, seed=options.seed,
            num_generations=options.generations, max_completion_length=options.completion_length, learning_rate=0.0,
            scale_rewards="none", logging_steps=1, report_to=[], save_strategy="no", disable_tqdm=True,
            shuffle_dataset=False, **configuration)
        trainer = trainer_class(model=_model(options.vocab, options.hidden, options.layers, options.seed),
                                reward_funcs=_reward, args=config, train_dataset=prompts, processing_class=tokenizer,
                                **extra)
        trainer.remove_callback(PrinterCallback)
        trainer.remove_callback(ProgressCallback)
        steps: list[float] = []
        lengths: list[float] = []
        kernel: list[float] = []
        processor: list[float] = []

        class Record(TrainerCallback):
            def __init__(self) -> None:
                self.kernel_before = _KernelClock.total
                self.processor_before = time.process_time()

            def on_log(self, args, state, control, logs=None, **kwargs):   # noqa: ANN001 - TRL's signature
                if logs and "step_time" in logs:
                    steps.append(float(logs["step_time"]))
                    lengths.append(float(logs["completions/mean_length"]))
                    kernel.append(_KernelClock.total - self.kernel_before)
                    self.kernel_before = _KernelClock.total
                    processor.append(time.process_time() - self.processor_before)
                    self.processor_before = time.process_time()

        trainer.add_callback(Record())
        trainer.train()
    return trainer, steps[1:], lengths[1:], kernel[1:], processor[1:]


def _report(name: str, configuration: dict, results: dict, head: dict[str, float]) -> None:
    grpo = results.get("GRPOTrainer")      # absent with --trainers otb …: the ratios are then nan
    baseline, baseline_kernel, baseline_processor = (
        (statistics.median(grpo[index]) for index in (1, 3, 4)) if grpo else (math.nan,) * 3)
    title = {"loss": "log π, Σπ² from the loss's forward",
             "own": "log π, Σπ² from one no-grad forward of its own"}[name]
    print(f"\n{title}: gradient_accumulation_steps={configuration['gradient_accumulation_steps']}, "
          f"per_device_train_batch_size={configuration['per_device_train_batch_size']}")
    print(f"{'trainer':<30} {'step (median)':>14} {'vs GRPO':>9} {'CPU time':>11} {'vs GRPO':>9} {'head kernel':>12} "
          f"{'OTB inside the step':>21} {'share':>7}")
    for label, (trainer, steps, lengths, kernel, processor) in results.items():
        step, cpu = statistics.median(steps), statistics.median(processor)
        line = (f"{label:<30} {step * 1e3:11.0f} ms {100 * (step / baseline - 1):+8.1f}% {cpu * 1e3:8.0f} ms "
                f"{100 * (cpu / baseline_processor - 1):+8.1f}% {statistics.median(kernel) * 1e3:9.0f} ms")
        if hasattr(trainer, "added"):
            parts = {part: statistics.median(values[1:]) for part, values in trainer.added.items()}
            parts["log Σπ²"] = head["extra"]
            added = sum(parts.values())
            detail = " + ".join(f"{part} {value * 1e3:.0f}" for part, value in parts.items() if value)
            line += (f" {added * 1e3:15.0f} ms {100 * added / baseline:6.1f}%   ({detail} ms; head kernel vs GRPO "
                     f"{(statistics.median(kernel) - baseline_kernel) * 1e3:+.0f} ms); peak extra memory: log Σπ² "
                     f"{head['peak_extra'] / 2**20:.2f} MiB, advantages {trainer.peak_memory() / 2**20:.2f} MiB")
        print(line + f"   [mean completion length {statistics.mean(lengths):.0f}]")
        print(f"{'':<30} per step: wall {' '.join(f'{value:.2f}' for value in steps)} s; CPU "
              f"{' '.join(f'{value:.2f}' for value in processor)} s")


if __name__ == "__main__":
    main()
