"""A tiny TRL set-up for tests/test_trl_integration.py, and the worker of its two-process test.

Everything is built in-process, with no download: a character-level tokenizer (``tokenizers`` WordLevel), a randomly
initialised two-layer Llama from a ``transformers`` config, a dataset of distinct prompts, two reward functions of the
completion token ids (each sometimes returns None; where both do, the completion is left unscored), and a
``rollout_func`` — TRL's documented hook for custom generation (grpo_trainer.py:2200–2217) — that samples from the
policy itself at its own temperature, returns the sampler's log-probabilities as vLLM does, and splices a tool
response into every other completion with ``env_mask`` = 0 over it (TRL turns ``env_mask`` into its ``tool_mask``,
:2270–2272), as TRL's own tool loop marks tool output (:2146–2154).

``recording_trainer_class()`` returns a subclass of :class:`otb_torch.trl.OTBGRPOTrainer` that records, per
generation, the trainer's :class:`OTBBatch` and an independent float64 computation of log π and Σπ² from the full
logits of the same policy, and, per loss call, the inputs ``_compute_loss`` receives (rows labelled so they can be
matched after TRL's shuffle).

Top-level imports are standard library only: pytest collects this module (doctests) where trl may be missing.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

CHARACTERS = "abcdefghijklmnopqrstuvwxyz "
TOOL_TEXT = "<tool>"                     # one token: the tool response spliced into completions
PROMPTS = ("add", "be", "cat", "dog", "egg", "fig", "gum", "hat", "ink", "jam", "kit", "log", "map", "nut", "owl",
           "pig", "quiz", "rat", "sun", "toy", "urn", "van", "wig", "yak")
MAX_COMPLETION_LENGTH = 10
REWARD_WEIGHTS = (1.0, 0.5)


def tokenizer():
    """A character-level fast tokenizer with <pad>, <eos>, <bos> and the tool token; no download."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocabulary = {"<pad>": 0, "<eos>": 1, "<bos>": 2, TOOL_TEXT: 3}
    for character in CHARACTERS:
        vocabulary[character] = len(vocabulary)
    core = Tokenizer(models.WordLevel(vocab=vocabulary, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>")


def model(seed: int = 0, vocab_size: int = 4 + len(CHARACTERS)):
    """A randomly initialised two-layer Llama (≈ 30k parameters)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0,
                         eos_token_id=1, bos_token_id=2, tie_word_embeddings=False)
    return LlamaForCausalLM(config)


def dataset(count: int = len(PROMPTS)):
    from datasets import Dataset

    return Dataset.from_dict({"prompt": list(PROMPTS[:count])})


def count_reward(completion_ids: list[int]) -> float | None:
    """+1 per 'a', −0.5 per 'e', +0.05 per token; None when the first token id is even."""
    if not completion_ids or completion_ids[0] % 2 == 0:
        return None
    a, e = 4 + CHARACTERS.index("a"), 4 + CHARACTERS.index("e")
    return completion_ids.count(a) - 0.5 * completion_ids.count(e) + 0.05 * len(completion_ids)


def parity_reward(completion_ids: list[int]) -> float | None:
    """1 + 0.1 × length when the second token id is odd; None otherwise (and for a one-token completion)."""
    return 1.0 + 0.1 * len(completion_ids) if len(completion_ids) > 1 and completion_ids[1] % 2 else None


def reward_a(completion_ids: list[list[int]], **_: Any) -> list[float | None]:
    return [count_reward(list(ids)) for ids in completion_ids]


def reward_parity(completion_ids: list[list[int]], **_: Any) -> list[float | None]:
    return [parity_reward(list(ids)) for ids in completion_ids]


def sequence_reward(completion_ids: list[int]) -> float | None:
    """TRL's per-sequence reward: Σ_k w_k·f_k over the functions that scored it (nansum); None when none did."""
    values = [count_reward(completion_ids), parity_reward(completion_ids)]
    if all(value is None for value in values):
        return None
    return sum(weight * value for weight, value in zip(REWARD_WEIGHTS, values) if value is not None)


class ToolRollout:
    """TRL ``rollout_func``: sample each completion from the policy at ``temperature``, all rows at once token by token
    (full forward of the left-padded batch with its position ids, tiny model), return the sampler's log π of each
    sampled token (0.0 on tool tokens, as TRL's tool loop does), and in every other completion splice the tool
    response after 2–4 sampled tokens, with ``env_mask`` 0 over it."""

    def __init__(self, temperature: float, seed: int = 0) -> None:
        self.temperature = temperature
        self.seed = seed
        self.calls = 0

    def __call__(self, prompts: list[str], trainer: Any) -> dict[str, Any]:
        import torch

        tok = trainer.processing_class
        policy = trainer.accelerator.unwrap_model(trainer.model)
        seed = self.seed * 1000 + self.calls * 10 + trainer.accelerator.process_index
        generator = torch.Generator().manual_seed(seed)
        self.calls += 1
        tool_id = tok.convert_tokens_to_ids(TOOL_TEXT)
        prompt_ids = [list(ids) for ids in tok(text=prompts)["input_ids"]]
        rows = len(prompt_ids)
        completions: list[list[int]] = [[] for _ in range(rows)]
        logprobs: list[list[float]] = [[] for _ in range(rows)]
        env_masks: list[list[int]] = [[] for _ in range(rows)]
        splice_at = [2 + row % 3 if row % 2 == 0 else None for row in range(rows)]
        active = [True] * rows
        while any(active):
            for row in range(rows):                     # the tool response is spliced in, not sampled
                if active[row] and splice_at[row] is not None and len(completions[row]) == splice_at[row]:
                    completions[row].append(tool_id)
                    logprobs[row].append(0.0)
                    env_masks[row].append(0)
            sampling = [row for row in range(rows) if active[row]]
            sequences = [prompt_ids[row] + completions[row] for row in sampling]
            width = max(len(sequence) for sequence in sequences)
            input_ids = torch.tensor([[tok.pad_token_id] * (width - len(q)) + q for q in sequences])
            attention = torch.tensor([[0] * (width - len(q)) + [1] * len(q) for q in sequences])
            positions = (attention.cumsum(dim=1) - 1).clamp(min=0)
            with torch.no_grad():
                logits = policy(input_ids=input_ids, attention_mask=attention, position_ids=positions).logits
            log_p = torch.log_softmax(logits[:, -1].double() / self.temperature, dim=-1)
            tokens = torch.multinomial(log_p.exp(), 1, generator=generator)[:, 0]
            for index, row in enumerate(sampling):
                token = int(tokens[index])
                completions[row].append(token)
                logprobs[row].append(float(log_p[index, token]))
                env_masks[row].append(1)
                if token == tok.eos_token_id or len(completions[row]) >= MAX_COMPLETION_LENGTH:
                    active[row] = False
        return {"prompt_ids": prompt_ids, "completion_ids": completions, "logprobs": logprobs, "env_mask": env_masks}


class _NoWeightSync:
    """Stands in for TRL's vLLM engine, which the rollout replaces: nothing to synchronise."""

    def sync_weights(self) -> None:
        pass


def use_rollout_importance_sampling(trainer: Any) -> None:
    """Make TRL treat the rollout's log-probs as vLLM's: its own importance-sampling code then runs unchanged —
    ``old_per_token_logps`` forward, the ratio exp(old − sampling) truncated or masked per the config
    (grpo_trainer.py:2641–2708), ``output["importance_sampling_ratio"]`` and the ratio in the loss (:3146–3147). Only
    vLLM's engine itself (weight sync and generation) is replaced, by the rollout."""
    trainer.use_vllm = True
    trainer.vllm_generation = _NoWeightSync()
    trainer._last_loaded_step = -1


def recording_trainer_class():
    """A subclass of OTBGRPOTrainer that records what the tests compare (see the module docstring)."""
    import numpy as np
    import torch

    import otb_spec
    from otb_torch.trl import OTBGRPOTrainer

    class RecordingTrainer(OTBGRPOTrainer):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.generations: list[dict[str, Any]] = []
            self.loss_inputs: list[dict[str, Any]] = []
            self.generated = self.completed = 0

        def _entry(self, index: int) -> dict[str, Any]:
            while len(self.generations) <= index:
                self.generations.append({})
            return self.generations[index]

        def _generate_and_score_completions(self, inputs: Any) -> dict[str, Any]:
            policy = self.accelerator.unwrap_model(self.model)
            output = super()._generate_and_score_completions(inputs)
            rows = output["completion_ids"].shape[0]
            output["otb_row"] = torch.arange(rows) + self.accelerator.process_index * rows
            output["otb_generation"] = torch.full((rows,), self.generated)
            self._entry(self.generated).update({"independent": self._independent_statistics(output, policy),
                                                "offset": self.accelerator.process_index * rows})
            self.generated += 1
            return output

        def _otb_complete(self, rows: dict[str, Any], log_probs: Any, sum_pi_squared: Any) -> Any:
            advantages = super()._otb_complete(rows, log_probs, sum_pi_squared)
            batch = self.otb_batch
            self._entry(self.completed).update({
                "batch": batch._replace(**{name: getattr(batch, name).clone() for name in (
                    "rewards", "response_mask", "group_ids", "log_probs", "sum_pi_squared", "advantages", "returns",
                    "baselines", "row_ids")}),
                "metrics": {name: values[-1] for name, values in self._metrics["train"].items()
                            if name.startswith("otb/")},
                "table": list(self._logs["advantages"])[-batch.rewards.shape[0] * self.accelerator.num_processes:],
            })
            self.completed += 1
            return advantages

        @torch.no_grad()
        def _independent_statistics(self, output: dict[str, Any], policy: Any) -> tuple[np.ndarray, np.ndarray]:
            """log π(yₜ) and Σπ²ₜ in float64 from the full logits of the policy's own forward (no fused head)."""
            prompt_completion = torch.cat([output["prompt_ids"], output["completion_ids"]], dim=1)
            attention = torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1)
            k = output["completion_ids"].shape[1]
            logits = policy(input_ids=prompt_completion, attention_mask=attention).logits[:, -k - 1:-1]
            statistics = otb_spec.token_statistics_from_logits(
                logits.double().numpy() / self.temperature, output["completion_ids"].numpy())
            return statistics.log_probs, statistics.sum_pi_squared

        def _compute_loss(self, model: Any, inputs: dict[str, Any]) -> Any:
            loss = super()._compute_loss(model, inputs)         # OTB may fill inputs["advantages"] in there
            self.loss_inputs.append({name: (value.detach().clone() if isinstance(value, torch.Tensor) else value)
                                     for name, value in inputs.items()})
            self.loss_inputs[-1]["loss"] = float(loss.detach())
            return loss

    return RecordingTrainer


def config(output_dir: str, **overrides: Any):
    """GRPOConfig for the tiny runs: CPU, 2 prompts × 4 completions per process, no saving or reporting; float32
    (``bf16=False``: TRL defaults to bf16 autocast, which would put the policy's log π and Σπ² in bfloat16 tiles while
    the tests compare them with a float32 forward — the bf16 head is checked on its own, within its derived bounds)."""
    from trl import GRPOConfig

    options = dict(output_dir=output_dir, use_cpu=True, per_device_train_batch_size=8, num_generations=4,
                   max_completion_length=MAX_COMPLETION_LENGTH, max_steps=2, learning_rate=5e-3, logging_steps=1,
                   report_to=[], save_strategy="no", scale_rewards="none", temperature=0.7, seed=0,
                   reward_weights=list(REWARD_WEIGHTS), disable_tqdm=True, dataloader_num_workers=0, bf16=False)
    options.update(overrides)
    return GRPOConfig(**options)


def trainer(output_dir: str, *, variant: str, align: str, tools: bool = False, importance_sampling: str | None = None,
            config_overrides: dict | None = None):
    """A RecordingTrainer on the tiny set-up. ``tools``: completions from :class:`ToolRollout` (tool holes);
    ``importance_sampling``: a ``vllm_importance_sampling_mode`` — the rollout samples at temperature 1.0 while the
    trainer scores at 0.7, so TRL's ratio differs from 1 — implies ``tools``."""
    overrides = dict(config_overrides or {})
    if importance_sampling is not None:
        overrides.update(vllm_importance_sampling_correction=True, vllm_importance_sampling_mode=importance_sampling,
                         vllm_importance_sampling_clip_min=0.05, vllm_importance_sampling_clip_max=20.0)
    rollout = ToolRollout(temperature=1.0 if importance_sampling else 0.7) if (tools or importance_sampling) else None
    built = recording_trainer_class()(
        model=model(), reward_funcs=[reward_a, reward_parity], args=config(output_dir, **overrides),
        train_dataset=dataset(), processing_class=tokenizer(), rollout_func=rollout, variant=variant, align=align)
    if importance_sampling is not None:
        use_rollout_importance_sampling(built)
    return built


def _tensors(record: dict[str, Any]) -> dict[str, Any]:
    import torch

    return {name: value.numpy() for name, value in record.items() if isinstance(value, torch.Tensor)}


def worker(output_dir: str) -> None:  # pragma: no cover - runs in the processes started by the two-process test
    """Train two tiny OTB runs on this process (one per variant) and save what the test compares, per rank."""
    import numpy as np

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    for name, variant, align, tools in (("otb", "otb", "position", False),
                                        ("loo", "leave_one_out", "valid_token", True)):
        run = trainer(os.path.join(output_dir, name), variant=variant, align=align, tools=tools,
                      config_overrides=dict(per_device_train_batch_size=6, ddp_timeout=120))
        run.train()
        rank = run.accelerator.process_index
        arrays: dict[str, Any] = {"num_processes": np.array(run.accelerator.num_processes)}
        for index, generation in enumerate(run.generations):
            batch = generation["batch"]
            for field in ("rewards", "response_mask", "group_ids", "log_probs", "sum_pi_squared", "advantages",
                          "row_ids"):
                arrays[f"g{index}_{field}"] = getattr(batch, field).numpy()
            arrays[f"g{index}_offset"] = np.array(generation["offset"])
        for index, inputs in enumerate(run.loss_inputs):
            for field, value in _tensors(inputs).items():
                arrays[f"loss{index}_{field}"] = value
            arrays[f"loss{index}_loss"] = np.array(inputs["loss"])
        np.savez(os.path.join(output_dir, f"{name}_rank{rank}.npz"), **arrays)


def _leave_the_process_group() -> None:  # pragma: no cover - runs in the processes started by the two-process test
    """Tear the gloo group down before the interpreter exits: left to the interpreter's finalisation, its threads can
    still be running when their C++ objects are destroyed, and the process aborts ("terminate called without an
    active exception", SIGABRT) after the work is done — seen once in CI."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":  # pragma: no cover
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", required=True, help="output directory")
    worker(parser.parse_args().worker)
    _leave_the_process_group()
    sys.exit(0)
