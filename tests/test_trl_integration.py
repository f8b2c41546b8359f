"""otb_torch.trl inside TRL 1.16: real GRPO training steps of a tiny model on CPU with per-token OTB advantages.

Each run builds a tiny randomly initialised Llama and a character tokenizer in-process (tests/trl_tiny.py; no
download), trains a few real steps with ``OTBGRPOTrainer`` — TRL's own ``train()`` loop, generation, reward
functions, shuffle and split of the generation batch, ``_compute_loss``, backward and optimizer step — and records
the advantages that ``_compute_loss`` receives. The test then rebuilds the OTB inputs from TRL's own tensors and the
reward functions, independently of the trainer (rewards recomputed from the completion ids and placed at the last
token of completion mask × tool mask, prompt groups from the prompt text, TRL's importance-sampling ratio), and
checks the advantages against the NumPy reference ``otb_spec`` within ``otb_comparison_tolerance``. log π and Σπ²
are checked against a float64 computation from the full logits of the same policy.

What runs where (TRL 1.16.0 line numbers, grpo_trainer.py):

* plain runs: TRL's ``transformers`` generation (``_generate_single_turn``, :1763); log π and Σπ² from the loss's
  forward (TRL's defaults), from the trainer's own no-grad forward (``gradient_accumulation_steps=2``), or from TRL's
  old-log-prob forward (``num_iterations=2``, :2642–2657) — the three paths of docs/trl.md;
* tool holes: TRL's ``rollout_func`` hook (:2200–2217) with ``env_mask`` → TRL's ``tool_mask`` (:2270–2272), padded
  and multiplied into the loss mask by TRL (:2479–2497, :3027). TRL's ``_tool_call_loop`` (:1945) itself is not run:
  a random tiny model emits no parseable tool calls;
* IS weights: TRL's vLLM importance-sampling code (:2642–2707, ratio in the loss :3146–3147) with the rollout's
  sampler log-probs in place of vLLM's: ``use_vllm`` is switched on after construction and vLLM's weight sync is a
  no-op (trl_tiny.use_rollout_importance_sampling). vLLM's engine is not run (it needs a GPU);
* two processes: ``accelerate launch`` (torchrun, gloo on CPU) of tests/trl_tiny.py, groups straddling the processes.
"""

from __future__ import annotations

import inspect
import math
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")
trl = pytest.importorskip("trl", reason="trl is not installed (the 'trl' extra: pip install \"otb-spec[trl]\")")
if not trl.__version__.startswith("1.16."):
    pytest.skip(f"otb_torch.trl targets trl 1.16.x, found {trl.__version__}", allow_module_level=True)

import otb_spec  # noqa: E402
import otb_torch  # noqa: E402
import otb_torch.trl as otb_trl  # noqa: E402
import trl_tiny  # noqa: E402
from distributed_pool import free_port, run_rank_processes  # noqa: E402
from trl.trainer import utils as trl_utils  # noqa: E402
from otb_spec.tolerances import (  # noqa: E402
    hidden_comparison_tolerances,
    otb_comparison_tolerance,
    otb_tolerance,
    output_rounding,
    port_tolerance,
)

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS_DIR)
FLOAT32 = np.float32


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """The tiny model's matrices are too small for two threads to help; on a busy machine they contend (the linear
    layers ran ~10× slower with two). Restored after the module."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ----------------------------------------------------------------------------------------------------------------------
# the independent reference


def _rows_of_generation(run, index: int) -> dict[str, np.ndarray]:
    """The inputs ``_compute_loss`` received for one generation, put back in generation order (TRL shuffles and splits
    the batch; trl_tiny labels each row). A row seen in several loss calls (num_iterations > 1) must carry the same
    advantages each time."""
    generation = run.generations[index]
    rows, width = generation["batch"].advantages.shape
    fields: dict[str, np.ndarray] = {}
    seen = np.zeros(rows, dtype=int)
    for inputs in run.loss_inputs:
        for j in np.nonzero(inputs["otb_generation"].numpy() == index)[0]:
            row = int(inputs["otb_row"][j]) - generation["offset"]
            for name in ("advantages", "completion_ids", "completion_mask", "tool_mask", "prompt_ids", "prompt_mask",
                         "importance_sampling_ratio", "old_per_token_logps"):
                if name not in inputs:
                    continue
                value = inputs[name][j].numpy()
                store = fields.setdefault(name, np.zeros((rows,) + value.shape, dtype=value.dtype))
                if seen[row]:
                    np.testing.assert_array_equal(store[row], value, err_msg=f"{name} of row {row} changed between "
                                                                             "loss calls")
                store[row] = value
            seen[row] += 1
    assert seen.min() >= 1, "every row of the generation reaches the loss"
    assert fields["advantages"].shape == (rows, width)
    return fields


def _independent_inputs(fields: dict[str, np.ndarray]) -> dict[str, np.ndarray | None]:
    """Rewards, mask, groups and IS weights rebuilt from TRL's tensors and the reward functions alone."""
    completion_mask = fields["completion_mask"]
    mask = completion_mask * fields["tool_mask"] if "tool_mask" in fields else completion_mask.copy()
    rows, width = mask.shape
    rewards = np.zeros((rows, width))
    unscored = 0
    for row in range(rows):
        reward = trl_tiny.sequence_reward(fields["completion_ids"][row][completion_mask[row] == 1].tolist())
        valid = np.nonzero(mask[row])[0]
        if reward is None:
            mask[row] = 0
            unscored += 1
        elif valid.size:
            rewards[row, valid[-1]] = reward
    prompts = [tuple(ids[m == 1]) for ids, m in zip(fields["prompt_ids"], fields["prompt_mask"])]
    numbering: dict[tuple, int] = {}
    groups = np.array([numbering.setdefault(prompt, len(numbering)) for prompt in prompts])
    ratio = fields.get("importance_sampling_ratio")
    weights = None if ratio is None else np.broadcast_to(ratio, (rows, width)).astype(np.float64)
    return {"rewards": rewards, "mask": mask.astype(np.float64), "groups": groups, "is_weights": weights,
            "unscored": unscored}


def _reference(inputs: dict, log_probs: np.ndarray, sum_pi_squared: np.ndarray, variant: str, align: str):
    common = dict(is_weights=inputs["is_weights"], epsilon=1e-8)
    args = (inputs["rewards"], inputs["mask"], inputs["groups"], log_probs, sum_pi_squared)
    if variant == "leave_one_out":
        return otb_spec.leave_one_out_token_baseline(*args, align=align, **common)
    function = otb_spec.optimal_token_baseline if align == "position" else otb_spec.multi_turn_optimal_token_baseline
    return function(*args, handle_zero_tail=True, **common)


def _check_run(run, variant: str, align: str) -> dict[str, int]:
    """Every generation of ``run``: advantages reaching the loss = the reference; log π, Σπ² = the policy's; metrics
    and the completions table consistent. Returns counts that tell what the run exercised."""
    exercised = {"generations": 0, "unscored": 0, "holes": 0, "is_not_one": 0, "rows": 0}
    for index, generation in enumerate(run.generations):
        batch = generation["batch"]
        order = np.argsort(batch.row_ids.numpy())              # OTB's rows → generation order
        np.testing.assert_array_equal(batch.row_ids.numpy()[order] - generation["offset"], np.arange(len(order)))
        fields = _rows_of_generation(run, index)
        inputs = _independent_inputs(fields)
        log_probs = batch.log_probs.double().numpy()[order]
        sum_pi_squared = batch.sum_pi_squared.double().numpy()[order]
        mask = inputs["mask"]
        valid = mask > 0
        # log π and Σπ² are the sampling policy's (full logits, float64) at every valid token
        independent_lp, independent_spp = generation["independent"]
        port = port_tolerance(FLOAT32)
        port.assert_close(log_probs[valid], independent_lp[valid], "log π vs the policy's full logits")
        port.assert_close(sum_pi_squared[valid], independent_spp[valid], "Σπ² vs the policy's full logits")
        # the advantages that reach the loss
        reference = _reference(inputs, log_probs, sum_pi_squared, variant, align)
        tolerance, _ = otb_comparison_tolerance(
            inputs["rewards"], mask, inputs["groups"], log_probs, sum_pi_squared, is_weights=inputs["is_weights"],
            align=align, leave_one_out=variant == "leave_one_out", handle_zero_tail=variant == "otb", epsilon=1e-8)
        assert tolerance.checked_fraction() > 0.9
        seen = fields["advantages"].astype(np.float64)
        tolerance.assert_close(seen, reference.advantages, f"advantages in _compute_loss, generation {index}")
        assert not seen[~valid].any(), "advantages are exactly 0 off the mask"
        if "old_per_token_logps" in fields:                     # TRL's old log-probs: OTB's log π is that very output
            port.assert_close(fields["old_per_token_logps"][valid], independent_lp[valid], "TRL's old log π")
            np.testing.assert_array_equal(log_probs[valid], fields["old_per_token_logps"][valid].astype(np.float64),
                                          err_msg="OTB's log π is TRL's old log π of the same forward")
        # metrics: mean realized energy W, advantage statistics, over valid trajectories and tokens
        metrics = generation["metrics"]
        per_token = otb_spec.token_energy(np.where(valid, log_probs, 0.0), np.where(valid, sum_pi_squared, 1.0))
        energy = otb_spec.realized_energy(per_token, mask, is_weights=inputs["is_weights"])[:, -1]
        scored = valid.any(axis=1)
        port.assert_close(metrics["otb/realized_energy/mean"], energy[scored].mean(), "otb/realized_energy/mean")
        power = otb_spec.proxy_total_power(reference.advantages, mask, log_probs, sum_pi_squared,
                                           is_weights=inputs["is_weights"])
        port.assert_close(metrics["otb/total_power"], power[scored].mean(), "otb/total_power")
        bound = float(np.max((tolerance.atol + tolerance.rtol * np.abs(reference.advantages))[valid]))
        assert abs(metrics["otb/advantages/mean"] - reference.advantages[valid].mean()) <= bound
        assert abs(metrics["otb/advantages/max"] - reference.advantages[valid].max()) <= bound
        assert abs(metrics["otb/baseline/min"] - reference.baselines[valid].min()) <= bound
        # the completions table shows Aₜ at each completion's first valid token (not GRPO's group-centred reward)
        first = np.where(scored, seen[np.arange(len(seen)), np.argmax(valid, axis=1)], 0.0)
        np.testing.assert_array_equal(np.array(generation["table"], dtype=np.float32), first.astype(np.float32))
        exercised["generations"] += 1
        exercised["rows"] += len(seen)
        exercised["unscored"] += inputs["unscored"]
        if "tool_mask" in fields:
            exercised["holes"] += int(((fields["completion_mask"] == 1) & (fields["tool_mask"] == 0)).sum())
        if inputs["is_weights"] is not None:
            exercised["is_not_one"] += int((np.abs(inputs["is_weights"][valid] - 1.0) > 1e-3).sum())
    return exercised


RUNS = {
    # name: (variant, align, tools, importance-sampling mode, config overrides, where log π and Σπ² come from)
    "otb-position": ("otb", "position", False, None, {}, "loss forward"),
    "otb-position-tools-accumulation": ("otb", "position", True, None,
                                        dict(gradient_accumulation_steps=2, per_device_train_batch_size=4),
                                        "own forward"),
    "loo-position-two-iterations": ("leave_one_out", "position", False, None, dict(num_iterations=2),
                                    "TRL's old-log-prob forward"),
    "otb-valid-token-tools-token-is": ("otb", "valid_token", True, "token_truncate", {},
                                       "TRL's old-log-prob forward"),
    "loo-valid-token-tools-sequence-is": ("leave_one_out", "valid_token", True, "sequence_mask", {},
                                          "TRL's old-log-prob forward"),
}


@pytest.mark.parametrize("name", list(RUNS))
def test_training_steps_send_the_reference_advantages_to_the_loss(name, tmp_path, monkeypatch):
    variant, align, tools, sampling, overrides, source = RUNS[name]
    run = trl_tiny.trainer(str(tmp_path), variant=variant, align=align, tools=tools, importance_sampling=sampling,
                           config_overrides=overrides)
    forwards = {"own forward": 0}
    own_forward = run._otb_forward

    def counted(output):
        forwards["own forward"] += 1
        return own_forward(output)

    monkeypatch.setattr(run, "_otb_forward", counted)
    head_passes = []                                 # every pass of TRL's fused LM head: the outputs it was asked for
    kernel = trl_utils._ChunkedLogProbFunction

    class CountedKernel:
        @staticmethod
        def apply(*args):
            head_passes.append(args[-1])
            return kernel.apply(*args)

    monkeypatch.setattr(trl_utils, "_ChunkedLogProbFunction", CountedKernel)
    guarded = []                                     # the FSDP2 head guard ran after the backbone in forwards with grad
    own_guard = otb_trl._unsharded_head_needed
    monkeypatch.setattr(otb_trl, "_unsharded_head_needed", lambda policy: guarded.append(policy) or own_guard(policy))
    before = [p.detach().clone() for p in run.model.parameters()]
    run.train()
    assert run.state.global_step == 2
    assert guarded and all(policy is run.model for policy in guarded)
    assert any(not torch.equal(a, b) for a, b in zip(before, run.model.parameters())), "the optimizer stepped"
    assert all(torch.isfinite(p).all() for p in run.model.parameters())
    assert all(math.isfinite(inputs["loss"]) for inputs in run.loss_inputs), "the loss used OTB's advantages"
    exercised = _check_run(run, variant, align)
    assert exercised["generations"] == (1 if overrides.get("num_iterations") == 2 else 2)
    assert exercised["unscored"] > 0, "some completions were left unscored by every reward function"
    old = source == "TRL's old-log-prob forward"
    assert all(("old_per_token_logps" in inputs) == old for inputs in run.loss_inputs)
    assert forwards["own forward"] == (exercised["generations"] if source == "own forward" else 0)
    # no LM-head pass besides TRL's own (one per loss call, plus its old-log-prob forward in chunks of the per-device
    # batch) and, only where TRL runs none at the sampling weights, the trainer's own forward in the same chunks
    chunks = -(-exercised["rows"] // exercised["generations"] // run.args.per_device_train_batch_size)
    extra = exercised["generations"] * chunks if source != "loss forward" else 0
    assert len(head_passes) == len(run.loss_inputs) + extra
    assert all(outputs == ("log_probs", "entropy", "log_sum_sq_probs") for outputs in head_passes)
    if tools:
        assert exercised["holes"] > 0, "tool holes reached the loss mask"
    if sampling is not None:
        assert exercised["is_not_one"] > 0, "TRL's importance-sampling ratio differs from 1"
        assert all("importance_sampling_ratio" in inputs for inputs in run.loss_inputs)


def test_evaluation_computes_otb_on_the_evaluation_batch(tmp_path):
    """``trainer.evaluate()``: TRL's prediction_step generates and scores the batch and computes the loss in one go
    (grpo_trainer.py:1547–1550, :3294–3300); the advantages come from that loss's forward, with the eval metrics."""
    trainer = otb_trl.OTBGRPOTrainer(
        model=trl_tiny.model(), reward_funcs=[trl_tiny.reward_a, trl_tiny.reward_parity],
        args=trl_tiny.config(str(tmp_path), per_device_eval_batch_size=8), train_dataset=trl_tiny.dataset(),
        processing_class=trl_tiny.tokenizer(), variant="leave_one_out")
    metrics = trainer.evaluate(eval_dataset=trl_tiny.dataset(4))
    assert math.isfinite(metrics["eval_loss"]) and math.isfinite(metrics["eval_otb/advantages/mean"])
    batch = trainer.otb_batch
    arrays = [getattr(batch, name).double().numpy() for name in ("rewards", "response_mask", "group_ids", "log_probs",
                                                                 "sum_pi_squared")]
    reference = otb_spec.leave_one_out_token_baseline(*arrays)
    tolerance, _ = otb_comparison_tolerance(*arrays, leave_one_out=True)
    tolerance.assert_close(batch.advantages.double().numpy(), reference.advantages, "evaluation advantages")


# ----------------------------------------------------------------------------------------------------------------------
# two processes


@pytest.mark.distributed
def test_two_processes_give_the_single_process_advantages(tmp_path):
    """``accelerate launch`` of two gloo processes (tests/trl_tiny.py --worker), 6 rows each, groups of 4 (group 1
    straddles the processes): the advantages each process's loss receives equal what one process computes on the
    whole batch — otb_torch's single-process function and the NumPy reference — for both variants."""
    environment = dict(os.environ, OMP_NUM_THREADS="1", TRL_EXPERIMENTAL_SILENCE="1",
                       PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "adapters"), TESTS_DIR,
                                                   os.environ.get("PYTHONPATH", "")]))
    command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
               "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
               "--main_process_port", str(free_port()), os.path.join(TESTS_DIR, "trl_tiny.py"),
               "--worker", str(tmp_path)]
    started = time.monotonic()
    launcher = subprocess.Popen(command, env=environment, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
    try:
        stdout, stderr = launcher.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(launcher.pid, signal.SIGKILL)            # the launcher and the two ranks it started
        stdout, stderr = launcher.communicate()
        pytest.fail(f"the two processes did not finish within 300 s:\n{stderr[-6000:]}")
    assert launcher.returncode == 0, f"the two processes failed after {time.monotonic() - started:.0f} s:\n" \
                                     f"{stdout[-3000:]}\n{stderr[-6000:]}"
    for name, variant, align in (("otb", "otb", "position"), ("loo", "leave_one_out", "valid_token")):
        ranks = [dict(np.load(tmp_path / f"{name}_rank{rank}.npz")) for rank in range(2)]
        assert all(int(rank["num_processes"]) == 2 for rank in ranks)
        generations = sorted({key.split("_")[0] for key in ranks[0] if key.startswith("g")})
        assert len(generations) == 2
        for generation in generations:
            index = int(generation[1:])
            _check_two_process_generation(ranks, index, variant, align)


@pytest.mark.distributed
def test_trls_fused_head_leaves_the_gradient_of_an_fsdp2_head_unit_unreduced(tmp_path):
    """A defect of TRL 1.16, which OTBGRPOTrainer refuses (docs/trl.md, *FSDP2*): TRL's fused LM head gathers an FSDP2
    head's weight with ``full_tensor()``, whose gradient no rank reduces. Two gloo ranks (tests/trl_fsdp2_head.py): with
    the head in the root unit, its gradient is the whole batch's; with the head in a unit of its own, each rank's
    shard holds P × its own rows' gradient instead — while a decoder layer's gradient is the whole batch's in both.
    A head that shares a unit with the final norm and stays whole after the forward (accelerate 1.15's own layout: the
    norm's forward gathers the unit before TRL reads the head) is reduced like the root unit's. OTBGRPOTrainer's guard
    (a hook after the backbone's forward, as the trainer runs it) refuses the second model only.
    Distances are max|Δ| against float64 gradients of the same model; float32 rounding is about 1e-7 of the head
    gradient's scale (about 0.1), so a factor of 1000 between the two distances tells the hypotheses apart with room
    on both sides (measured: 3e-8 against 0.11)."""
    pytest.importorskip("torch.distributed.fsdp", reason="FSDP2 is not available in this torch")
    environment = dict(os.environ, OMP_NUM_THREADS="1")
    script, port = os.path.join(TESTS_DIR, "trl_fsdp2_head.py"), str(free_port())
    try:
        results = run_rank_processes([[sys.executable, script, str(rank), "2", port] for rank in range(2)], tmp_path,
                                     environment, timeout=180)
    except TimeoutError as exc:
        pytest.fail(str(exc))
    pattern = re.compile(r"rank (\d): (root unit|own unit|final norm's unit): head gradient max\|Δ\| to the reduced "
                         r"(\S+), to the unreduced (\S+); layer gradient max\|Δ\| to the reduced (\S+) of max (\S+)")
    for rank, (code, output) in enumerate(results):
        assert code == 0, f"rank {rank} failed:\n{output[-6000:]}"
        found = {match[2]: [float(value) for value in match.groups()[2:]] for match in pattern.finditer(output)}
        assert set(found) == {"root unit", "own unit", "final norm's unit"}, output[-3000:]
        guard = dict(re.findall(r"rank \d: (root unit|own unit|final norm's unit): OTBGRPOTrainer (.+)", output))
        assert guard == {"root unit": "not refused", "own unit": "refused", "final norm's unit": "not refused"}, \
            output[-3000:]
        for placement, (to_reduced, to_unreduced, layer, scale) in found.items():
            assert layer * 1000 < scale, f"rank {rank}, {placement}: the layer's gradient is not the batch's"
            if placement != "own unit":
                assert to_reduced * 1000 < to_unreduced, f"rank {rank}: a head in the {placement} is not reduced"
            else:
                assert to_unreduced * 1000 < to_reduced, (f"rank {rank}: TRL's head in a unit of its own is "
                                                          "reduced now: update docs/trl.md (FSDP2)")


def _check_two_process_generation(ranks: list[dict], index: int, variant: str, align: str) -> None:
    pieces = []
    for rank in ranks:
        prefix = f"g{index}_"
        batch = {key[len(prefix):]: value for key, value in rank.items() if key.startswith(prefix)}
        order = np.argsort(batch["row_ids"])                    # OTB's rows → generation order
        batch = {key: (value[order] if np.ndim(value) else value) for key, value in batch.items()}
        np.testing.assert_array_equal(batch["row_ids"] - int(batch["offset"]), np.arange(len(order)))
        seen = np.full(batch["advantages"].shape, np.nan)
        loss_calls = sorted({key.split("_")[0] for key in rank if key.startswith("loss")})
        prompts = [None] * len(seen)
        for call in loss_calls:
            selected = rank[f"{call}_otb_generation"] == index
            for j in np.nonzero(selected)[0]:
                row = int(rank[f"{call}_otb_row"][j]) - int(batch["offset"])
                seen[row] = rank[f"{call}_advantages"][j]
                ids, mask = rank[f"{call}_prompt_ids"][j], rank[f"{call}_prompt_mask"][j]
                prompts[row] = tuple(ids[mask == 1])
        assert not np.isnan(seen).any()
        pieces.append((batch, seen, prompts))
    width = max(piece[0]["advantages"].shape[1] for piece in pieces)

    def stacked(field: str, fill: float = 0.0) -> np.ndarray:
        return np.concatenate([np.pad(piece[0][field].astype(np.float64),
                                      ((0, 0), (0, width - piece[0][field].shape[1])), constant_values=fill)
                               for piece in pieces])

    rewards, mask = stacked("rewards"), stacked("response_mask")
    log_probs, sum_pi_squared = stacked("log_probs"), stacked("sum_pi_squared")
    seen = np.concatenate([np.pad(piece[1], ((0, 0), (0, width - piece[1].shape[1]))) for piece in pieces])
    prompts = [prompt for piece in pieces for prompt in piece[2]]
    numbering: dict[tuple, int] = {}
    groups = np.array([numbering.setdefault(prompt, len(numbering)) for prompt in prompts])
    np.testing.assert_array_equal(groups, np.concatenate([piece[0]["group_ids"] for piece in pieces]))
    straddling = {int(g) for g in pieces[0][0]["group_ids"]} & {int(g) for g in pieces[1][0]["group_ids"]}
    assert straddling, "a prompt group is split between the two processes"
    leave_one_out = variant == "leave_one_out"
    inputs = {"rewards": rewards, "mask": mask, "groups": groups, "is_weights": None}
    reference = _reference(inputs, log_probs, sum_pi_squared, variant, align)
    options = dict(align=align, leave_one_out=leave_one_out, handle_zero_tail=not leave_one_out, epsilon=1e-8)
    to_reference, _ = otb_comparison_tolerance(rewards, mask, groups, log_probs, sum_pi_squared, **options)
    to_reference.assert_close(seen, reference.advantages, f"{variant}: two processes vs the reference")
    # what one process computes for the same batch (otb_torch, float32): two float32 implementations' bounds
    if leave_one_out:
        single = otb_torch.leave_one_out_token_baseline(*map(_float32, (rewards, mask)), groups,
                                                        *map(_float32, (log_probs, sum_pi_squared)), align=align)
    else:
        function = (otb_torch.optimal_token_baseline if align == "position"
                    else otb_torch.multi_turn_optimal_token_baseline)
        single = function(*map(_float32, (rewards, mask)), groups, *map(_float32, (log_probs, sum_pi_squared)))
    one_float32, _ = otb_tolerance(rewards, mask, groups, log_probs, sum_pi_squared, dtype=FLOAT32, **options)
    (one_float32 + one_float32 + output_rounding(FLOAT32)).assert_close(
        seen, single.advantages.double().numpy(), f"{variant}: two processes vs one process")


def _float32(array: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(array, dtype=np.float32))


# ----------------------------------------------------------------------------------------------------------------------
# log π and Σπ² from TRL's fused LM head


def _fused_layers(policy) -> list[dict]:
    """The TRL fused forwards installed on ``policy``, outermost first (each as the variables its closure holds)."""
    layers = []
    closure = otb_trl._trl_fused_forward_closure(vars(policy).get("forward"))
    while closure is not None:
        layers.append(closure)
        closure = otb_trl._trl_fused_forward_closure(closure["original_forward"])
    return layers


def _completion_batch(vocab_size: int, seed: int) -> dict[str, torch.Tensor]:
    """A generation output as TRL builds it: left-padded prompts, right-padded completions (one of them empty)."""
    generator = torch.Generator().manual_seed(seed)
    rows, prompt_width, completion_width = 6, 5, 7
    prompt_ids = torch.randint(4, vocab_size, (rows, prompt_width), generator=generator)
    prompt_mask = (torch.arange(prompt_width) >= torch.tensor([0, 1, 2, 0, 3, 1])[:, None]).long()
    completion_ids = torch.randint(4, vocab_size, (rows, completion_width), generator=generator)
    completion_mask = (torch.arange(completion_width) < torch.tensor([7, 3, 5, 0, 6, 1])[:, None]).long()
    return {"prompt_ids": prompt_ids.masked_fill(prompt_mask == 0, 0), "prompt_mask": prompt_mask,
            "completion_ids": completion_ids.masked_fill(completion_mask == 0, 0), "completion_mask": completion_mask}


def test_the_policy_head_is_trls_with_log_sum_sq_probs_installed_once(tmp_path):
    """After construction the policy's forward is TRL's fused head (``add_fused_lm_head``) with TRL's temperature, TRL's
    fp32 setting and TRL's outputs plus ``log_sum_sq_probs``, wrapping the model's own forward once — also when the
    same model is given to a second trainer. Its log π and entropy are bit for bit those of the head GRPOTrainer
    installs (``outputs=("log_probs", "entropy")``), and its plain forward (generation) is the model's."""
    from trl.trainer.utils import add_fused_lm_head

    policy = trl_tiny.model(vocab_size=257)
    as_trl_installs = trl_tiny.model(vocab_size=257)
    add_fused_lm_head(as_trl_installs, temperature=0.7, outputs=("log_probs", "entropy"))
    for _ in range(2):
        otb_trl.OTBGRPOTrainer(model=policy, reward_funcs=[trl_tiny.reward_a, trl_tiny.reward_parity],
                               args=trl_tiny.config(str(tmp_path)),
                               train_dataset=trl_tiny.dataset(), processing_class=trl_tiny.tokenizer())
        layers = _fused_layers(policy)
        assert len(layers) == 1, "the policy is wrapped by one fused head"
        assert layers[0]["outputs"] == ("log_probs", "entropy", "log_sum_sq_probs")
        assert (layers[0]["temperature"], layers[0]["cast_lm_head_to_fp32"]) == (0.7, False)
        assert layers[0]["original_forward"].__func__ is type(policy).forward
    batch = _completion_batch(257, seed=5)
    input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    attention_mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    with torch.no_grad():
        ours = policy(input_ids=input_ids, attention_mask=attention_mask, labels=labels, fused_lm_head=True)
        trls = as_trl_installs(input_ids=input_ids, attention_mask=attention_mask, labels=labels, fused_lm_head=True)
        plain = policy(input_ids=input_ids, attention_mask=attention_mask).logits
        plain_trl = as_trl_installs(input_ids=input_ids, attention_mask=attention_mask).logits
    assert trls.log_sum_sq_probs is None and ours.log_sum_sq_probs is not None
    torch.testing.assert_close(ours.log_probs, trls.log_probs, rtol=0, atol=0)
    torch.testing.assert_close(ours.entropy, trls.entropy, rtol=0, atol=0)
    torch.testing.assert_close(plain, plain_trl, rtol=0, atol=0)


PRECISIONS = {
    # name: (GRPOConfig.bf16 — TRL's default, accelerate's bf16 autocast around TRL's forward —, cast_lm_head_to_fp32,
    #        PEFT, the dtype TRL's kernel forms its logit tiles in)
    "float32": (False, False, False, "float32"),
    "bfloat16": (True, False, False, "bfloat16"),
    "bfloat16-fp32-head": (True, True, False, "float32"),
    "float32-peft": (False, False, True, "float32"),
}


@pytest.mark.parametrize("name", list(PRECISIONS))
def test_log_pi_and_sum_pi_squared_from_trls_head_within_the_derived_bounds(name, tmp_path):
    """The trainer's forward (TRL's chunked helper, TRL's fused head) gives log π(yₜ) and Σπ²ₜ of each completion token
    within the derived bounds of the float64 computation from the full logits z = h·Wᵀ/τ of the same hidden states
    (``hidden_comparison_tolerances``: the matmul's error propagated through each statistic, plus, for Σπ²,
    ``sum_pi_squared_tolerance`` in the working dtype of TRL's tiles — bfloat16 under the trainer's bf16 autocast,
    float32 with ``cast_lm_head_to_fp32`` or without mixed precision); exactly 0 off the completion mask. With PEFT
    (LoRA), through the base model's head, as TRL patches it."""
    bf16, fp32_head, peft, working = PRECISIONS[name]
    extra = {}
    if peft:
        peft_module = pytest.importorskip("peft", reason="peft is not installed")
        extra["peft_config"] = peft_module.LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"],
                                                      init_lora_weights=False)
    model = trl_tiny.model(vocab_size=257)
    with torch.no_grad():                   # logits of std ≈ 1.3 at τ = 0.7 rather than the initialisation's ≈ 0.16:
        model.lm_head.weight.mul_(8.0)      # a distribution far from uniform, Σπ² well above 1/V
    trainer = otb_trl.OTBGRPOTrainer(
        model=model, reward_funcs=[trl_tiny.reward_a, trl_tiny.reward_parity],
        args=trl_tiny.config(str(tmp_path), bf16=bf16, cast_lm_head_to_fp32=fp32_head),
        train_dataset=trl_tiny.dataset(), processing_class=trl_tiny.tokenizer(), **extra)
    policy = trainer.model.get_base_model() if peft else trainer.model
    hidden_states = []
    hook = policy.model.register_forward_hook(
        lambda module, args, output: hidden_states.append(output.last_hidden_state.detach().float()))
    batch = _completion_batch(257, seed=6)
    try:
        log_probs, sum_pi_squared = trainer._otb_forward(batch)
    finally:
        hook.remove()
    assert len(hidden_states) == 1, "one forward of the policy's backbone"
    k = batch["completion_ids"].shape[1]
    valid = batch["completion_mask"].numpy() == 1
    hidden = hidden_states[0][:, -k - 1:-1].numpy()[valid]
    weight = policy.lm_head.weight.detach().float().numpy()
    targets = batch["completion_ids"].numpy()[valid]
    reference = otb_spec.token_statistics_from_hidden(hidden.astype(np.float64), weight.astype(np.float64), targets,
                                                      temperature=0.7)
    bounds, _ = hidden_comparison_tolerances(hidden, weight, targets, temperature=0.7, input_dtype=working)
    bounds.log_probs.assert_close(log_probs.numpy()[valid], reference.log_probs, f"log π ({name})")
    bounds.sum_pi_squared.assert_close(sum_pi_squared.numpy()[valid], reference.sum_pi_squared, f"Σπ² ({name})")
    assert not log_probs.numpy()[~valid].any() and not sum_pi_squared.numpy()[~valid].any()


# ----------------------------------------------------------------------------------------------------------------------
# configuration and options


@pytest.fixture(scope="module")
def tiny_model():
    return trl_tiny.model()


BAD_CONFIGS = {
    "scale_rewards-group": (dict(scale_rewards="group"), "scale_rewards"),
    "scale_rewards-batch": (dict(scale_rewards="batch"), "scale_rewards"),
    "scale_rewards-True": (dict(scale_rewards=True), "scale_rewards"),
    "luspo": (dict(loss_type="luspo", importance_sampling_level="sequence"), "loss_type"),   # as LUSPO needs it
    "luspo-token": (dict(loss_type="luspo", importance_sampling_level="token"), "loss_type"),
    "vespo": (dict(loss_type="vespo"), "loss_type"),
    "sequence-level-ratio": (dict(importance_sampling_level="sequence", loss_type="grpo"), "importance_sampling_level"),
    "normalize_then_sum": (dict(multi_objective_aggregation="normalize_then_sum"), "multi_objective_aggregation"),
}


@pytest.mark.parametrize("name", list(BAD_CONFIGS))
def test_configurations_that_distort_per_token_advantages_are_rejected(name, tiny_model, tmp_path):
    overrides, argument = BAD_CONFIGS[name]
    config = trl_tiny.config(str(tmp_path), **overrides)
    with pytest.raises(ValueError, match=rf"^{argument}:"):
        otb_trl.OTBGRPOTrainer(model=tiny_model, reward_funcs=trl_tiny.reward_a, args=config,
                               train_dataset=trl_tiny.dataset(), processing_class=trl_tiny.tokenizer())


BAD_OPTIONS = {
    "variant": (dict(variant="verl"), "variant"),
    "variant-type": (dict(variant=None), "variant"),
    "align": (dict(align="token"), "align"),
    "epsilon-negative": (dict(epsilon=-1e-8), "epsilon"),
    "epsilon-nan": (dict(epsilon=float("nan")), "epsilon"),
    "epsilon-inf": (dict(epsilon=float("inf")), "epsilon"),
    "epsilon-text": (dict(epsilon="1e-8"), "epsilon"),
    "handle_zero_tail-text": (dict(handle_zero_tail="yes"), "handle_zero_tail"),
    "handle_zero_tail-loo": (dict(variant="leave_one_out", handle_zero_tail=True), "handle_zero_tail"),
    "unknown": (dict(varient="otb"), "varient"),
    "args-type": (dict(args={"scale_rewards": "none"}), "args"),
}


@pytest.mark.parametrize("name", list(BAD_OPTIONS))
def test_invalid_options_raise_value_errors_naming_the_argument(name, tiny_model, tmp_path):
    options, argument = BAD_OPTIONS[name]
    options = {"args": trl_tiny.config(str(tmp_path)), **options}
    with pytest.raises(ValueError, match=rf"^{argument}:"):
        otb_trl.OTBGRPOTrainer(model=tiny_model, reward_funcs=trl_tiny.reward_a, train_dataset=trl_tiny.dataset(),
                               processing_class=trl_tiny.tokenizer(), **options)


@pytest.mark.parametrize("bad", ["inf", "overflow", "overflow in OTB", "overflow past otb_torch"])
def test_an_infinite_reward_raises_naming_the_reward_function(bad, tmp_path, monkeypatch):
    """±inf from a reward function is refused where the rewards are computed, naming the function and the completion
    in TRL's generation batch; a weighted sum that overflows float32, naming the weights; finite rewards whose OTB
    sums Σ GᵢWᵢ overflow float32 (10³⁸ on every other completion), naming the rewards, before any metric is logged or
    any loss formed — by otb_torch's own check, and, were that check gone, by the trainer's on the advantages'
    gathered extremes. (NaN — a function's None — stays "not scored".)"""
    if bad == "overflow past otb_torch":
        import otb_torch._otb

        monkeypatch.setattr(otb_torch._otb, "_check_finite_outputs", lambda *arguments: None)

    def reward_huge(completion_ids, **_):
        return [math.inf if bad == "inf" and i == 3 else 3e38 if bad == "overflow" else
                1e38 * (i % 2) if bad.startswith("overflow ") else 0.0 for i, _ in enumerate(completion_ids)]

    trainer = otb_trl.OTBGRPOTrainer(model=trl_tiny.model(), reward_funcs=[trl_tiny.reward_a, reward_huge],
                                     args=trl_tiny.config(str(tmp_path), max_steps=1,
                                                          reward_weights=[1.0, 2.0 if bad == "overflow" else 1.0]),
                                     train_dataset=trl_tiny.dataset(), processing_class=trl_tiny.tokenizer())
    message = (r"^reward function 'reward_huge' returned inf \(in float32, TRL's reward dtype\) for completion 3 "
               r"of the generation batch" if bad == "inf"
               else r"^reward_weights: the weighted sum of the rewards of completion 0 of the generation batch "
                    r"overflows float32" if bad == "overflow"
               else r"^rewards: finite, but OTB's arithmetic overflows float32" if bad == "overflow in OTB"
               else r"^rewards: finite, but OTB's advantages came out ±inf or NaN")
    with pytest.raises(ValueError, match=message):
        trainer.train()


def test_accepted_options_and_defaults(tiny_model, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)                       # args=None: TRL's default output_dir, relative to the cwd

    class OnCPU(otb_trl.GRPOConfig):                  # TRL's default config asks for bf16, which this CPU lacks
        def __init__(self, *args, **kwargs):
            super().__init__(*args, use_cpu=True, bf16=False, **kwargs)

    monkeypatch.setattr(otb_trl, "GRPOConfig", OnCPU)
    trainer = otb_trl.OTBGRPOTrainer(tiny_model, trl_tiny.reward_a, None, trl_tiny.dataset(),
                                     processing_class=trl_tiny.tokenizer(), variant="leave_one_out",
                                     align="valid_token", epsilon=0.0)
    assert trainer.args.scale_rewards == "none"
    assert (trainer.otb_variant, trainer.otb_align, trainer.otb_epsilon) == ("leave_one_out", "valid_token", 0.0)
    assert trainer.otb_handle_zero_tail is False                    # None: off for leave-one-out
    default = otb_trl.OTBGRPOTrainer(tiny_model, [trl_tiny.reward_a, trl_tiny.reward_parity],
                                     trl_tiny.config(str(tmp_path)), trl_tiny.dataset(),
                                     processing_class=trl_tiny.tokenizer())
    assert (default.otb_variant, default.otb_align, default.otb_handle_zero_tail) == ("otb", "position", True)
    parameters = list(inspect.signature(otb_trl.OTBGRPOTrainer).parameters)
    assert parameters[:3] == ["model", "reward_funcs", "args"] and parameters[-4:] == [
        "variant", "align", "epsilon", "handle_zero_tail"]


def test_another_trl_release_is_refused(tiny_model, tmp_path, monkeypatch):
    monkeypatch.setattr(otb_trl.trl, "__version__", "1.17.0")
    with pytest.raises(RuntimeError, match=r"supports trl 1\.16\.x and found trl 1\.17\.0"):
        otb_trl.OTBGRPOTrainer(model=tiny_model, reward_funcs=trl_tiny.reward_a, args=trl_tiny.config(str(tmp_path)),
                               train_dataset=trl_tiny.dataset(), processing_class=trl_tiny.tokenizer())


def test_otb_torch_does_not_import_trl_and_the_missing_package_is_named():
    program = (
        "import sys\n"
        "import otb_torch\n"
        "assert 'trl' not in sys.modules, 'import otb_torch imported trl'\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'trl' or name.startswith('trl.'):\n"
        "            raise ModuleNotFoundError(\"No module named 'trl'\", name='trl')\n"
        "sys.meta_path.insert(0, Block())\n"
        "try:\n"
        "    import otb_torch.trl\n"
        "except ModuleNotFoundError as exc:\n"
        "    assert exc.name == 'trl' and 'otb-spec[trl]' in str(exc), str(exc)\n"
        "else:\n"
        "    raise AssertionError('otb_torch.trl imported without trl')\n")
    environment = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "adapters")]))
    done = subprocess.run([sys.executable, "-c", program], env=environment, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]


def test_the_trl_example_runs(capsys, tmp_path):
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    try:
        import trl_otb
    finally:
        sys.path.pop(0)
    trl_otb.main(["--steps", "2", "--output-dir", str(tmp_path)])
    printed = capsys.readouterr().out
    assert printed.count("step ") >= 2 and "advantage" in printed
