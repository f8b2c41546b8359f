"""OTB's cost on top of plain GRPO per training step in TRL 1.16, on CPU (target: ≤ 5 % of the step).

    python benchmarks/bench_trl.py --threads 1           # 19.6 M-parameter Llama, V = 32000, 16 completions × 128
    python benchmarks/bench_trl.py --steps 4 --completion-length 64 --hidden 128 --layers 2

Runs ``trl.GRPOTrainer`` and ``otb_torch.trl.OTBGRPOTrainer`` (both variants) on the same randomly initialised Llama,
prompts and seeds, with ``learning_rate=0`` so that every trainer generates exactly the same completions (same weights,
same random stream) — the step times then differ only by what OTB adds. For each trainer it prints the median
wall time of a training step (TRL's own ``step_time`` metric: generation, rewards, the loss's forward and backward,
the optimizer step) over ``--steps`` steps after one warm-up step, and for OTB the median time spent in what it
adds, measured inside the step:

* ``statistics``: log π, Σπ² of the completions from the hidden states (the LM head once more, without gradient) —
  in TRL's default configuration (``gradient_accumulation_steps=1``: one micro-batch per generation, one iteration)
  those of the loss's own forward (``--paths loss``); with ``gradient_accumulation_steps=2`` those of one no-grad
  forward of the trainer's own (``--paths own``: ``forward`` includes the statistics);
* ``advantages``: OTB and the ``otb/…`` metrics.

Peak extra memory: the peak of torch's CPU allocations (the profiler's memory records) while the statistics of one
generation batch run, and while OTB runs on it, each alone after training; and the analytic bound of
``otb_torch.fused_linear_token_statistics`` (two block buffers of at most 2²² float32 values = 32 MiB on CPU, five
floats per token) plus the [B, T] outputs. It also times one LM-head pass, no gradient, over the step's completion
tokens: TRL's fused kernel, the same with log Σπ² requested, and otb_torch's.
"""

from __future__ import annotations

import argparse
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


def _instrumented(base):
    """``base`` (an OTBGRPOTrainer class) timing what OTB adds per generation batch, and the peak resident memory of
    its statistics."""

    class Timed(base):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.added: dict[str, list[float]] = {"forward": [], "statistics": [], "advantages": []}
            self._pending = {"forward": 0.0, "statistics": 0.0}

        def _otb_head_statistics(self, core, hidden, targets):
            start = time.perf_counter()
            result = super()._otb_head_statistics(core, hidden, targets)
            self._pending["statistics"] += time.perf_counter() - start
            return result

        def peak_memory(self) -> tuple[int, int]:
            """Peak extra bytes of the statistics of one generation batch (B × T completion tokens, from hidden states
            of the step's shape) and of OTB on the last batch, each measured alone, after training."""
            import torch

            batch = self.otb_batch
            core, _ = self._otb_policy_modules()
            rows, positions = batch.rewards.shape
            hidden = torch.randn(rows, positions, core.config.hidden_size)
            targets = torch.randint(0, core.config.vocab_size, (rows, positions))
            inputs = {"otb_rewards": batch.rewards, "otb_response_mask": batch.response_mask,
                      "otb_group_ids": batch.group_ids, "otb_row_ids": batch.row_ids}
            with torch.no_grad():
                statistics_peak = _peak_allocated(lambda: self._otb_head_statistics(core, hidden, targets))
                otb_peak = _peak_allocated(lambda: base._otb_complete(self, inputs, batch.log_probs,
                                                                      batch.sum_pi_squared))
            return statistics_peak, otb_peak

        def _otb_forward(self, output):
            start = time.perf_counter()
            result = super()._otb_forward(output)
            self._pending["forward"] += time.perf_counter() - start
            return result

        def _otb_complete(self, *args, **kwargs):
            start = time.perf_counter()
            result = super()._otb_complete(*args, **kwargs)
            self.added["advantages"].append(time.perf_counter() - start)
            for part in ("forward", "statistics"):
                self.added[part].append(self._pending[part])
                self._pending[part] = 0.0
            return result

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
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--paths", nargs="+", choices=("loss", "own"), default=["loss", "own"],
                        help="where OTB takes log π and Σπ² (docs/trl.md): 'loss' — TRL's default config, the loss's "
                             "forward; 'own' — gradient_accumulation_steps=2, one no-grad forward of its own")
    options = parser.parse_args(argv)

    import torch
    from datasets import Dataset
    from trl import GRPOTrainer

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
    print(f"Llama {parameters / 1e6:.1f} M parameters (V = {options.vocab}, hidden {options.hidden}, "
          f"{options.layers} layers); {rows} completions per step ({options.prompts} prompts × {options.generations}) "
          f"of {options.completion_length} tokens after {options.prompt_length}-token prompts; torch threads "
          f"{torch.get_num_threads()}; {options.steps} timed steps after 1 warm-up; learning_rate 0")

    _head_passes(options, rows)
    configurations = {
        "loss": dict(per_device_train_batch_size=rows, gradient_accumulation_steps=1),
        "own": dict(per_device_train_batch_size=rows // 2, gradient_accumulation_steps=2),
    }
    for name in options.paths:
        results = {}
        trainers = [("GRPOTrainer", GRPOTrainer, {}), ("OTBGRPOTrainer otb", _instrumented(OTBGRPOTrainer),
                                                       {"variant": "otb"})]
        if name == "loss":
            trainers.append(("OTBGRPOTrainer leave_one_out", _instrumented(OTBGRPOTrainer),
                             {"variant": "leave_one_out"}))
        for label, trainer_class, extra in trainers:
            results[label] = _run(trainer_class, extra, configurations[name], options, prompts, tokenizer)
        _report(name, configurations[name], results, options, rows)


def _head_passes(options, rows: int) -> None:
    """One LM-head pass over the step's completion tokens, no gradient: TRL's fused kernel as GRPOTrainer runs it
    (log π, entropy), the same with log Σπ² requested too, and otb_torch.fused_linear_token_statistics (what
    OTBGRPOTrainer adds to the step in the loss-forward path). Median of 5 after one warm-up."""
    import torch
    from trl.kernels import ChunkedLogProbFunction

    import otb_torch

    tokens = rows * options.completion_length
    generator = torch.Generator().manual_seed(options.seed)
    hidden = torch.randn(tokens, options.hidden, generator=generator)
    weight = torch.randn(options.vocab, options.hidden, generator=generator) / options.hidden ** 0.5
    ids = torch.randint(0, options.vocab, (tokens,), generator=generator)

    def timed(function) -> float:
        with torch.no_grad():
            function()
            times = []
            for _ in range(5):
                start = time.perf_counter()
                function()
                times.append(time.perf_counter() - start)
        return statistics.median(times)

    trl_head = timed(lambda: ChunkedLogProbFunction.apply(hidden, weight, None, ids, 1.0, 32768, None, 1.0,
                                                          ("entropy",)))
    trl_with_spp = timed(lambda: ChunkedLogProbFunction.apply(hidden, weight, None, ids, 1.0, 32768, None, 1.0,
                                                              ("entropy", "log_sum_sq_probs")))
    ours = timed(lambda: otb_torch.fused_linear_token_statistics(hidden, weight, ids))
    print(f"\none LM-head pass over {tokens} completion tokens (H = {options.hidden}, V = {options.vocab}), no "
          f"gradient: TRL's fused kernel (log π, entropy) {trl_head * 1e3:.0f} ms; with log Σπ² requested too "
          f"{trl_with_spp * 1e3:.0f} ms; otb_torch.fused_linear_token_statistics {ours * 1e3:.0f} ms")


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

        class Record(TrainerCallback):
            def on_log(self, args, state, control, logs=None, **kwargs):   # noqa: ANN001 - TRL's signature
                if logs and "step_time" in logs:
                    steps.append(float(logs["step_time"]))
                    lengths.append(float(logs["completions/mean_length"]))

        trainer.add_callback(Record())
        trainer.train()
    return trainer, steps[1:], lengths[1:]


def _report(name: str, configuration: dict, results: dict, options, rows: int) -> None:
    baseline = statistics.median(results["GRPOTrainer"][1])
    title = {"loss": "log π, Σπ² from the loss's forward", "own": "log π, Σπ² from one no-grad forward"}[name]
    print(f"\n{title}: gradient_accumulation_steps={configuration['gradient_accumulation_steps']}, "
          f"per_device_train_batch_size={configuration['per_device_train_batch_size']}")
    print(f"{'trainer':<30} {'step (median)':>14} {'vs GRPO':>9} {'OTB inside the step':>22} {'share':>7}")
    for label, (trainer, steps, lengths) in results.items():
        step = statistics.median(steps)
        line = f"{label:<30} {step * 1e3:11.0f} ms {100 * (step / baseline - 1):+8.1f}%"
        if hasattr(trainer, "added"):
            added_per_step = [max(f, s) + a for f, s, a in zip(*(trainer.added[part][1:] for part in (
                "forward", "statistics", "advantages")))]     # the statistics run inside the own forward, if any
            added = statistics.median(added_per_step)
            parts = {part: statistics.median(values[1:]) for part, values in trainer.added.items() if any(values)}
            detail = " + ".join(f"{part} {value * 1e3:.0f}" for part, value in parts.items())
            line += f" {added * 1e3:17.0f} ms {100 * added / baseline:6.1f}%   ({detail} ms)"
            statistics_peak, otb_peak = trainer.peak_memory()
            line += (f"; peak extra memory: statistics {statistics_peak / 2**20:.2f} MiB, "
                     f"advantages {otb_peak / 2**20:.2f} MiB")
        print(line + f"   [mean completion length {statistics.mean(lengths):.0f}]")
    tokens = rows * options.completion_length
    bound = (2 * min(2**22, tokens * options.vocab) + 5 * tokens) * 4
    print(f"analytic extra memory of the statistics: {bound / 2**20:.2f} MiB (otb_torch.fused_linear_token_statistics: "
          "two block buffers of at most 2²² float32 values, five floats per token)")


if __name__ == "__main__":
    main()
