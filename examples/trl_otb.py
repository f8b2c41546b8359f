"""A few GRPO steps with per-token OTB advantages in TRL 1.16, on CPU, with nothing to download.

    python examples/trl_otb.py                                  # 8 steps of verl's OTB
    python examples/trl_otb.py --variant leave_one_out --steps 4

Needs the README's main install plus the ``trl`` extra (``pip install ".[all,trl]"``). A randomly initialised
two-layer Llama over a character vocabulary learns to write the letter "a" (reward: the fraction of a's in the
completion, 0 for an empty one); ``otb_torch.trl.OTBGRPOTrainer`` replaces ``trl.GRPOTrainer`` — same arguments, plus
``variant``, ``align``, ``epsilon`` and ``handle_zero_tail``. Each step prints TRL's reward and the ``otb/…``
metrics the trainer logs: the advantages that reached the loss (mean, std, min, max over the valid tokens), the mean
baseline and the mean realized energy W.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

__all__ = ["tokenizer", "policy", "a_fraction", "main"]

LETTERS = "abcdefghijklmnopqrstuvwxyz "


def tokenizer():
    """A character-level fast tokenizer (<pad>, <eos>, <bos>, 26 letters and the space), built in-process."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocabulary = {"<pad>": 0, "<eos>": 1, "<bos>": 2}
    vocabulary.update({letter: 3 + index for index, letter in enumerate(LETTERS)})
    core = Tokenizer(models.WordLevel(vocab=vocabulary, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>")


def policy(vocab_size: int, seed: int):
    """A randomly initialised Llama: 2 layers, hidden size 64 (≈ 0.1 M parameters)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, eos_token_id=1, bos_token_id=2))


def a_fraction(completions: list[str], **_: object) -> list[float]:
    """The reward: the fraction of a's in each completion (0 for an empty one)."""
    return [text.count("a") / len(text) if text else 0.0 for text in completions]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--variant", choices=("otb", "leave_one_out"), default="otb")
    parser.add_argument("--align", choices=("position", "valid_token"), default="position")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-dir", default=None, help="TRL's output_dir (default: a temporary directory)")
    options = parser.parse_args(argv)

    from datasets import Dataset
    from transformers import TrainerCallback
    from transformers.trainer_callback import PrinterCallback, ProgressCallback
    from trl import GRPOConfig

    from otb_torch.trl import OTBGRPOTrainer

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    characters = tokenizer()
    prompts = Dataset.from_dict({"prompt": [word for word in ("cat", "bat", "map", "sad", "tan", "ham", "jam", "van",
                                                              "dog", "pig", "sun", "fig", "red", "ink", "owl", "yes")]})

    class PrintStep(TrainerCallback):
        def __init__(self) -> None:
            self.started = time.perf_counter()

        def on_log(self, args, state, control, logs=None, **kwargs):   # noqa: ANN001 - TRL's callback signature
            if not logs or "reward" not in logs:
                return
            print(f"step {state.global_step:3d}  reward {logs['reward']:.3f} ± {logs['reward_std']:.3f}  "
                  f"advantage mean {logs['otb/advantages/mean']:+.4f} std {logs['otb/advantages/std']:.4f} "
                  f"[{logs['otb/advantages/min']:+.3f}, {logs['otb/advantages/max']:+.3f}]  "
                  f"baseline {logs['otb/baseline/mean']:.3f}  W {logs['otb/realized_energy/mean']:.2f}  "
                  f"({time.perf_counter() - self.started:.1f} s)", flush=True)

    with tempfile.TemporaryDirectory() as scratch:
        config = GRPOConfig(
            output_dir=options.output_dir or scratch, use_cpu=True, max_steps=options.steps, seed=options.seed,
            per_device_train_batch_size=16, num_generations=8, max_completion_length=12, temperature=1.0,
            learning_rate=3e-3, scale_rewards="none", logging_steps=1, report_to=[], save_strategy="no",
            disable_tqdm=True)
        trainer = OTBGRPOTrainer(model=policy(len(characters), options.seed), reward_funcs=a_fraction, args=config,
                                 train_dataset=prompts, processing_class=characters, variant=options.variant,
                                 align=options.align)
        trainer.remove_callback(PrinterCallback)
        trainer.remove_callback(ProgressCallback)
        trainer.add_callback(PrintStep())
        print(f"OTBGRPOTrainer(variant={options.variant!r}, align={options.align!r}): {options.steps} steps, "
              f"16 completions per step (2 prompts × 8), CPU")
        trainer.train()


if __name__ == "__main__":
    main()
