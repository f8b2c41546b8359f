"""One PPO step of verl 0.9.1's actor worker on FSDP2 with OTB, as a rank of a gloo world on the CPU.

Run by tests/test_verl_fused.py::test_verls_actor_worker_on_fsdp2_trains_on_the_ports_advantages as two processes::

    python tests/verl_fsdp2_step.py RANK WORLD PORT WORKDIR LAYOUT

LAYOUT ``data``: the ranks are data-parallel (each gets its half of the rows), with gradient sync deferred to the last
micro-batch (``use_no_sync_for_gradient_accumulation``); ``sequence``: they form one Ulysses sequence-parallel group
(``ulysses_sequence_parallel_size=WORLD``: each computes a piece of every packed sequence, verl gathers the model's
outputs and scales their gradients back by the group's size), with the weights kept whole after a forward
(``reshard_after_forward=False``, so later passes see a plain head weight). verl's defaults are neither option.

Everything is verl's own code from its config down: ``ActorRolloutRefWorker(config.actor_rollout_ref, role="actor")``
from verl's ``ppo_trainer`` config composed by Hydra, ``init_model`` (the tiny random Qwen2 loaded from WORKDIR, verl's
monkey patches with fused kernels, FSDP2 ``fully_shard`` of each decoder layer, the embedding and the untied lm_head,
bfloat16 mixed precision: float32 master weights, bfloat16 compute, float32 gradient reduction), ``compute_log_prob``
and ``update_actor`` (``TrainingWorker.train_mini_batch``: the mini-batch iterator, four micro-batches with gradient
accumulation, gradient checkpointing, verl's ``ppo_loss``, gradient clipping, the optimizer and LR scheduler), on
the batch ``RayPPOTrainer._compute_old_log_prob`` and ``_update_actor`` build (ray_trainer.py:1290–1370), split over
the ranks as verl's dispatch splits it; ``compute_advantage`` runs on the gathered batch, as on verl's driver.

Only the device is stood in for: a ``cpu`` platform registered with verl's ``PlatformRegistry`` (verl knows CUDA,
NPU and ROCm), verl's FSDP engine looked up under ``cuda`` (the one it registers), and the process group initialised
here with gloo (verl's would ask for ``cpu:gloo,cpu:gloo``). trl 1.16, installed for the TRL tests, no longer has the
``AutoModelForCausalLMWithValueHead`` that verl's ``apply_monkey_patch`` imports whenever trl is importable
(monkey_patch.py:352–356), so verl is told trl is absent (docs/verl.md).

Each rank checks, and raises AssertionError otherwise (the test reads the exit codes and the last lines):

1. with ``otb_torch.verl.install(variant, sum_pi_squared=True)``, per case — self-inclusive, single-turn;
   leave-one-out, multi-turn with tool spans; self-inclusive through verl's Qwen3-VL fused forward, which hands the
   pass ``lm_head.weight.full_tensor()`` (a copy whose gradient no rank reduces; the port runs on the head instead);
   leave-one-out, multi-turn through verl's Qwen3.5 forward (the same copy, the hidden states cast to float32):
   - Σπ² and old log π of every response token of the rank's rows equal the reference's on the hidden states and the
     bfloat16 lm_head weight that computed them (``hidden_statistics_tolerance`` at float32, float32 output);
   - the advantages each micro-batch's loss received equal the reference's OTB on the gathered statistics
     (``otb_comparison_tolerance``), and every row of the rank reached the loss once;
   - on policy: the update's log π equal the old ones bit for bit (ratio 1), so the loss's cotangents are
     −Aₜ·P/N on log πₜ and −c·P/N on the entropy on each rank (token-mean over the N = 64 trained tokens of the
     global batch, P = 2 ranks — verl multiplies by the data-parallel size in its loss and by the sequence-parallel
     size in the gather's backward — c = 2⁻⁶: powers of two, exact);
   - the gradients at the final hidden states (bfloat16) equal the reference's vector-Jacobian product within
     ``hidden_gradient_tolerance`` + bfloat16 rounding, and so does lm_head.weight's, each rank's positions of each
     micro-batch rounded to bfloat16, summed over the micro-batches and averaged over the ranks by FSDP2 in
     float32 — the same products with each row given the next row's advantages are outside those bounds;
   - SGD stepped the sharded float32 weight by exactly −lr times that gradient;
   - the pass ran as the head's FSDP2 forward method, and ``uninstall()`` removed that method.
2. verl alone, without the port: its own fused pass fails on FSDP2's sharded lm_head weight (verl 0.9.1's Qwen2
   forward reads ``self.lm_head.weight`` outside the head's forward: a DTensor shard).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import sys
import time
import types

import numpy as np
import torch

GROUPS, SAMPLES = 4, 4          # with the prompt width, response width and vocabulary of tests/test_verl_fused.py
# trained response tokens per row: 64 in all (a power of two, so the loss's token-mean cotangents are exact)
TRAINED = [6, 3, 5, 2, 4, 7, 3, 4, 5, 2, 6, 3, 4, 5, 2, 3]
TOOL_ROWS = (0, 5, 10, 12)          # multi-turn: two tool tokens after the first trained token of these rows
LOGIT_SCALE, ENTROPY_COEFF, LEARNING_RATE, TEMPERATURE = 32.0, 2.0**-6, 0.5, 0.7


def _cpu_platform() -> None:
    """A ``cpu`` platform for verl's platform registry (its device module: torch.cpu, memory statistics 0)."""
    from verl.plugin.platform.platform_base import PlatformBase
    from verl.plugin.platform.platform_manager import PlatformRegistry

    device = types.ModuleType("verl_cpu_device")
    device.is_available, device.synchronize = (lambda: True), (lambda *args: None)
    device.current_device, device.device_count = (lambda: torch.device("cpu")), (lambda: 1)
    device.set_device = device.empty_cache = lambda *args: None
    device.manual_seed = device.manual_seed_all = torch.manual_seed
    device.get_rng_state, device.set_rng_state = torch.get_rng_state, torch.set_rng_state
    for name in ("max_memory_allocated", "max_memory_reserved", "memory_allocated", "memory_reserved",
                 "reset_peak_memory_stats"):
        setattr(device, name, lambda *args: 0)
    device.mem_get_info = lambda *args: (1 << 40, 1 << 40)
    device.get_device_name = lambda *args: "CPU"

    @PlatformRegistry.register(platform="cpu")
    class PlatformCPU(PlatformBase):
        device_name = property(lambda self: "cpu")
        vendor_name = property(lambda self: "cpu")
        device_module = property(lambda self: device)

        def is_available(self): return True
        def is_platform_available(self, use_smi_check=False): return True
        def current_device(self): return torch.device("cpu")
        def device_count(self): return 1
        def set_device(self, device_index): pass
        def synchronize(self, device_index=None): pass
        def manual_seed(self, seed): torch.manual_seed(seed)
        def manual_seed_all(self, seed): torch.manual_seed(seed)
        def set_allocator_settings(self, settings): pass
        def empty_cache(self): pass
        def get_device_capability(self, device_index=0): return None, None
        def communication_backend_name(self): return "gloo"
        def visible_devices_envvar(self): return "CPU_VISIBLE_DEVICES"
        def profiler_start(self): pass
        def profiler_stop(self): pass
        def ray_resource_name(self): return "CPU"
        def ray_noset_envvars(self): return []
        def is_ipc_supported(self): return False
        def cudart(self): return None

        @contextlib.contextmanager
        def nvtx_range(self, msg):
            yield


def _batch(multi_turn: bool):
    """16 rows, 4 prompts × 4 samples scattered as balance_batch leaves them, rewards 0/1 at the last token."""
    rng = np.random.default_rng(5 + multi_turn)
    rows = GROUPS * SAMPLES
    trained = np.array(TRAINED)
    tool_spans = [(1, 3) if multi_turn and row in TOOL_ROWS else None for row in range(rows)]
    lengths = trained + np.array([0 if span is None else span[1] - span[0] for span in tool_spans])
    sequences = _sequences(int(rng.integers(1 << 30)), response_lengths=lengths, tool_spans=tool_spans)
    assert int(sequences["response_mask"].sum()) == 64
    uids = np.array([f"prompt-{group}" for group in range(GROUPS) for _ in range(SAMPLES)], dtype=object)
    uids = uids[rng.permutation(rows)]
    rewards = torch.zeros(rows, RESPONSE)
    rewards[torch.arange(rows), torch.from_numpy(lengths - 1)] = torch.from_numpy(
        rng.integers(0, 2, rows).astype(np.float32))
    return sequences, uids, rewards


def main(rank: int, world: int, port: int, workdir: str, layout: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    path = os.path.join(workdir, "model")
    if rank == 0:
        import transformers

        config = transformers.Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                          tie_word_embeddings=False)
        torch.manual_seed(0)
        network = transformers.Qwen2ForCausalLM(config)
        with torch.no_grad():       # a peaked policy, as a trained one (the random model's π is near uniform)
            network.lm_head.weight.mul_(LOGIT_SCALE)
        network.save_pretrained(path)
    dist.barrier()

    import hydra

    import verl.models.transformers.monkey_patch as verl_monkey_patch
    from verl.workers.engine_workers import ActorRolloutRefWorker

    verl_monkey_patch.is_trl_available = lambda: False
    overrides = [f"actor_rollout_ref.model.path={path}", "+actor_rollout_ref.model.load_tokenizer=False",
                 "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
                 "actor_rollout_ref.model.use_fused_kernels=True", "actor_rollout_ref.model.use_remove_padding=True",
                 "actor_rollout_ref.actor.strategy=fsdp2", "actor_rollout_ref.actor.calculate_sum_pi_squared=True",
                 f"actor_rollout_ref.actor.ulysses_sequence_parallel_size={world if layout == 'sequence' else 1}",
                 # data: gradient sync deferred to the last micro-batch; sequence: the weights kept whole after a
                 # forward (verl's defaults: neither)
                 f"actor_rollout_ref.actor.fsdp_config.use_no_sync_for_gradient_accumulation={layout == 'data'}",
                 f"actor_rollout_ref.actor.fsdp_config.reshard_after_forward={layout != 'sequence'}",
                 f"actor_rollout_ref.rollout.n={SAMPLES}", f"actor_rollout_ref.actor.ppo_mini_batch_size={GROUPS}",
                 "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
                 "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
                 "actor_rollout_ref.actor.shuffle=False", f"actor_rollout_ref.actor.entropy_coeff={ENTROPY_COEFF}",
                 "actor_rollout_ref.actor.use_kl_loss=False", "actor_rollout_ref.actor.optim.optimizer=SGD",
                 f"actor_rollout_ref.actor.optim.lr={LEARNING_RATE}", "actor_rollout_ref.actor.optim.weight_decay=0",
                 "actor_rollout_ref.actor.optim.clip_grad=1e30",
                 f"actor_rollout_ref.rollout.temperature={TEMPERATURE}"]
    with hydra.initialize_config_module(config_module="verl.trainer.config", version_base=None):
        config = hydra.compose(config_name="ppo_trainer", overrides=overrides)
    worker = ActorRolloutRefWorker(config.actor_rollout_ref, role="actor")
    worker.init_model()
    engine = worker.actor.engine
    from torch.distributed.fsdp import FSDPModule

    assert isinstance(engine.module, FSDPModule) and isinstance(engine.module.lm_head, FSDPModule)
    assert engine.module.lm_head.weight.dtype == torch.float32 and engine._autocast_dtype == torch.bfloat16
    assert engine.get_data_parallel_size() == (1 if layout == "sequence" else world)

    for variant, multi_turn, forward in (("verl", False, "dense"), ("leave_one_out", True, "dense"),
                                         ("verl", False, "qwen3_vl"), ("leave_one_out", True, "qwen3_5")):
        with _model_forward(forward):
            _step(worker, variant, multi_turn, world)
        print(f"rank {rank}: {layout} parallel, {variant} {'multi-turn' if multi_turn else 'single-turn'}, "
              f"{forward} forward checked", flush=True)
    _verl_alone_fails_on_the_sharded_head(worker)     # last: verl's failure leaves FSDP2 in the middle of a forward
    dist.barrier()
    dist.destroy_process_group()


@contextlib.contextmanager
def _model_forward(name: str):
    """The model's fused forward: verl's ``dense_common.forward_with_torch_backend`` (what verl patches into Qwen2),
    or verl's Qwen3-VL or Qwen3.5 one (``qwen3_vl`` / ``qwen3_5.forward_with_torch_backend``: ``self.model(input_ids,
    **kwargs)`` then the fused pass, which any decoder-only model runs), which hand the pass
    ``lm_head.weight.full_tensor()`` (Qwen3.5's with the hidden states cast to its float32); installed before the
    port, as verl's monkey patch installs it."""
    import importlib

    import transformers

    model_class = transformers.Qwen2ForCausalLM
    own = model_class.__dict__["forward"]
    if name != "dense":
        model_class.forward = importlib.import_module(f"verl.models.transformers.{name}").forward_with_torch_backend
    try:
        yield
    finally:
        model_class.forward = own


def _old_log_prob_batch(data, calculate_sum_pi_squared: bool):
    """The actor's input as ``RayPPOTrainer._compute_old_log_prob`` builds it (ray_trainer.py:1290–1304)."""
    batch = verl_padding.left_right_2_no_padding(data.to_tensordict())
    tu.assign_non_tensor(batch, calculate_entropy=True, calculate_sum_pi_squared=calculate_sum_pi_squared,
                         compute_loss=False)
    return batch


def _data(sequences, uids, rewards):
    input_ids = torch.cat([sequences["prompts"], sequences["responses"]], 1)
    attention_mask = torch.cat([sequences["prompt_mask"], sequences["response_attention"]], 1)
    return DataProto.from_single_dict(
        {"prompts": sequences["prompts"], "responses": sequences["responses"], "input_ids": input_ids,
         "attention_mask": attention_mask, "position_ids": (attention_mask.cumsum(1) - 1).clamp(min=0),
         "response_mask": sequences["response_mask"].float(), "token_level_rewards": rewards,
         "row_index": torch.arange(len(uids)), "uid": uids},
        meta_info={"temperature": TEMPERATURE})


def _verl_alone_fails_on_the_sharded_head(worker) -> None:
    sequences, uids, rewards = _batch(multi_turn=False)
    batch = _old_log_prob_batch(_data(sequences, uids, rewards), calculate_sum_pi_squared=False)
    try:
        worker.compute_log_prob(_rank_part(batch, worker.actor.engine))
    except RuntimeError as exc:
        assert "DTensor" in str(exc), exc
    else:
        raise AssertionError("verl's own fused pass ran on FSDP2's sharded lm_head: the control no longer holds")


def _rank_part(batch, engine):
    """This rank's rows, as verl's dispatch splits a batch over the data-parallel ranks (consecutive chunks; the ranks
    of a sequence-parallel group get the same rows)."""
    return batch.chunk(engine.get_data_parallel_size())[engine.get_data_parallel_rank()]


def _whole_sequences(calls, engine):
    """``calls`` with each decoder call's sequence-parallel pieces put together (Ulysses gives each rank of the group
    a consecutive piece of the packed sequence; its final hidden states stay in pieces), and the range of positions
    of each call this rank computed. Without sequence parallelism: ``calls`` unchanged, every position its own."""
    mesh = engine.ulysses_device_mesh
    if mesh is None:
        calls.owned = [(0, call["hidden"].shape[1]) for call in calls.calls]
        return calls
    group = mesh["sp"].get_group()
    pieces = [None] * dist.get_world_size(group)
    dist.all_gather_object(pieces, [{"input_ids": call["input_ids"], "position_ids": call["position_ids"],
                                     "hidden": call["hidden"].detach(),
                                     "gradient": None if call["hidden"].grad is None else call["hidden"].grad}
                                    for call in calls.calls], group=group)
    whole = _DecoderCalls(None)
    whole.owned = []
    own = dist.get_rank(group)
    for number in range(len(calls.calls)):
        parts = [piece[number] for piece in pieces]
        merged = {name: torch.cat([part[name] for part in parts], 1) for name in ("input_ids", "position_ids")}
        merged["hidden"] = torch.cat([part["hidden"] for part in parts], 1)
        if parts[0]["gradient"] is not None:
            merged["hidden"].grad = torch.cat([part["gradient"] for part in parts], 1)
        whole.calls.append(merged)
        start = sum(part["hidden"].shape[1] for part in parts[:own])
        whole.owned.append((start, start + parts[own]["hidden"].shape[1]))
    return whole


def _step(worker, variant: str, multi_turn: bool, world: int) -> None:
    sequences, uids, rewards = _batch(multi_turn)
    data = _data(sequences, uids, rewards)
    rows = len(uids)
    engine = worker.actor.engine
    mine = _rank_part(data.to_tensordict(), engine)["row_index"].numpy()          # this rank's rows
    own = {name: value[mine] for name, value in sequences.items()}
    module = engine.module
    estimator, align = (("tir_optimal_token_baseline", "valid_token") if multi_turn
                        else ("optimal_token_baseline", "position"))
    with otb_verl.install(variant, sum_pi_squared=True):
        # RayPPOTrainer._compute_old_log_prob: the actor's forward on this rank's rows, the outputs gathered
        batch = _old_log_prob_batch(data, calculate_sum_pi_squared=True)
        with _DecoderCalls(module) as first_pass:
            output = worker.compute_log_prob(_rank_part(batch, engine))
        weight = _whole(module.lm_head.weight).to(torch.bfloat16)                # FSDP2's all-gather for the pass
        registered = otb_verl._HEAD_METHOD in module.lm_head.__dict__            # the pass ran as the head's method
        whole = _whole_sequences(first_pass, engine)
        collected = None
        if output is not None:              # the rank that returns its group's outputs (the first of a Ulysses group)
            part = _rank_part(batch, engine)
            old_log_probs = verl_padding.no_padding_2_padding(output["log_probs"], part).float()
            sum_pi_squared = verl_padding.no_padding_2_padding(output["sum_pi_squared"], part).float()
            _check_statistics(whole, own, weight, old_log_probs, sum_pi_squared)
            collected = (mine, old_log_probs, sum_pi_squared)
        gathered = [None] * world
        dist.all_gather_object(gathered, collected)
        width = data.batch["responses"].shape[1]
        for name, column in (("old_log_probs", 1), ("sum_pi_squared", 2)):
            full = torch.full((rows, width), torch.nan)
            for piece in filter(None, gathered):
                full[piece[0], :piece[column].shape[1]] = piece[column]
            assert not full[:, :1].isnan().any(), "a row's statistics did not come back"
            data.batch[name] = full.nan_to_num(0.0)
        # verl's driver: compute_advantage with the port's estimator
        data = compute_advantage(data, adv_estimator=estimator, gamma=1.0, lam=1.0, num_repeat=SAMPLES,
                                 config=AlgoConfig(adv_estimator=estimator))
        advantages = data.batch["advantages"]
        mask = data.batch["response_mask"]
        inputs = tuple(np.asarray(value) for value in (rewards.numpy(), mask.numpy(), uids,
                                                       data.batch["old_log_probs"].numpy(),
                                                       data.batch["sum_pi_squared"].numpy()))
        expected, bound = _expected_advantages(variant, align, inputs, None)
        bound.assert_close(advantages.numpy(), expected, f"{variant} advantages of compute_advantage")

        # RayPPOTrainer._update_actor (ray_trainer.py:1327–1370), this rank's rows
        received = []

        def recording(loss_fn):
            def loss(*args, **kwargs):
                micro = kwargs.get("data", args[1] if len(args) > 1 else None)
                received.append(tuple(_dense(micro[name]) for name in ("row_index", "advantages", "response_mask")))
                return loss_fn(*args, **kwargs)
            return loss

        worker.actor.loss_fn = recording(worker.loss_fn)
        stepped = {}
        optimizer = worker.actor.engine.optimizer
        own_step = optimizer.step

        def step(*args, **kwargs):
            stepped["gradient"] = module.lm_head.weight.grad.full_tensor().clone()
            stepped["shard"] = module.lm_head.weight.detach().to_local().clone()
            stepped["shard_gradient"] = module.lm_head.weight.grad.to_local().clone()
            return own_step(*args, **kwargs)

        optimizer.step = step
        update = verl_padding.left_right_2_no_padding(data.to_tensordict())
        tu.assign_non_tensor(update, calculate_entropy=True, distillation_use_topk=False, distillation_only=False,
                             global_batch_size=GROUPS * SAMPLES, mini_batch_size=GROUPS * SAMPLES, epochs=1, seed=1,
                             dataloader_kwargs={"shuffle": False}, compute_loss=True, return_model_output=True)
        try:
            with _DecoderCalls(module) as update_pass:
                metrics = worker.update_actor(_rank_part(update, engine))
        finally:
            optimizer.step = own_step
            worker.actor.loss_fn = worker.loss_fn
    assert metrics is None or np.isfinite(tu.get(metrics, "metrics")["grad_norm"])
    assert registered, "the fused pass did not run as the FSDP2 head's forward method"
    assert otb_verl._HEAD_METHOD not in module.lm_head.__dict__, "uninstall() left the head's method"

    # the advantages each micro-batch's loss received: every row of this rank once, the reference's values
    seen = np.concatenate([index.numpy() for index, _, _ in received])
    assert sorted(seen.tolist()) == mine.tolist(), (seen, mine)
    for index, received_advantages, received_mask in received:
        index, columns = index.numpy(), received_advantages.shape[1]
        np.testing.assert_array_equal(received_mask.numpy(), mask.numpy()[index, :columns])
        _rows_of(bound, index, columns).assert_close(received_advantages.numpy(), expected[index, :columns],
                                                     "the advantages a micro-batch's loss received")

    # on policy: the update's forward is the first pass's, bit for bit (same micro-batches, same order)
    assert len(first_pass.calls) == len(update_pass.calls)
    for before, after in zip(first_pass.calls, update_pass.calls):
        assert torch.equal(before["hidden"].detach(), after["hidden"].detach())
    _check_gradients(_whole_sequences(update_pass, engine), own, weight, advantages.double().numpy()[mine],
                     mask.numpy()[mine] > 0, stepped, world)
    # SGD on the float32 shard: weight − lr·gradient, exactly (lr a power of two; no clipping, no weight decay)
    assert torch.equal(module.lm_head.weight.detach().to_local(),
                       stepped["shard"] - LEARNING_RATE * stepped["shard_gradient"])


def _whole(weight) -> torch.Tensor:
    """A copy of the whole weight: gathered from its shards, or (kept whole after a forward) copied."""
    weight = weight.detach()
    return weight.full_tensor() if hasattr(weight, "full_tensor") else weight.clone()


def _dense(value: torch.Tensor) -> torch.Tensor:
    return (value.to_padded_tensor(0.0) if value.is_nested else value).detach().clone()


def _rows_of(bound, index, columns):
    """``bound`` (per element of [rows, T], or scalar) at rows ``index`` and the first ``columns`` columns."""
    def take(value):
        return value[index, :columns] if np.ndim(value) == 2 else value
    return Tolerance(rtol=take(bound.rtol), atol=take(bound.atol), reason=bound.reason)


def _check_statistics(calls, own, weight, old_log_probs, sum_pi_squared) -> None:
    valid = own["response_mask"].numpy() > 0
    _assert_pass_statistics(calls.gather(calls.response_states(own)), weight.double().numpy(),
                            own["responses"].numpy()[valid], sum_pi_squared.numpy()[valid],
                            old_log_probs.numpy()[valid], "of the actor's fused pass on FSDP2",
                            temperature=TEMPERATURE, rounding=output_rounding(np.float32))


def _check_gradients(calls, own, weight, advantages, valid, stepped, world) -> None:
    tokens = 64
    weight = weight.double().numpy()
    places = calls.response_states(own)
    assert calls.gradient_elsewhere(places) == 0, "a gradient at positions that predict no trained token"
    # per micro-batch (one decoder call each) and per rank (the positions it computed): the reference VJP and its
    # bounds, for the hidden states and the weight
    exact_weight = np.zeros_like(weight)
    allowed_weight = np.zeros_like(weight)
    misrouted_weight = np.zeros_like(weight)
    rolled = np.roll(advantages, -1, axis=0)
    for number, (start, stop) in enumerate(calls.owned):
        sub, labels, g_lp, g_wrong = [], [], [], []
        for row, (call, index, at) in enumerate(places):
            keep = ((at >= start) & (at < stop)).numpy()
            if call != number or not keep.any():
                continue
            sub.append((call, index, at[keep]))
            labels.append(own["responses"].numpy()[row][valid[row]][keep])
            g_lp.append(-advantages[row][valid[row]][keep] * world / tokens)
            g_wrong.append(-rolled[row][valid[row]][keep] * world / tokens)
        if not sub:
            continue
        hidden, labels, g_lp, g_wrong = calls.gather(sub), np.concatenate(labels), np.concatenate(g_lp), \
            np.concatenate(g_wrong)
        g_h = np.full(len(labels), -ENTROPY_COEFF * world / tokens)
        reference = otb.token_statistics_vjp(hidden, weight, labels, g_lp, g_h, temperature=TEMPERATURE)
        # bfloat16 gradients: the hidden states', and this micro-batch's of the weight
        bound_h, bound_w = _gradient_bounds(hidden, weight, labels, g_lp, g_h, temperature=TEMPERATURE,
                                            output_dtype=torch.bfloat16)
        bound_h.assert_close(calls.gather(sub, gradient=True), reference.hidden,
                             "∂ final hidden states in verl's FSDP2 step")
        exact_weight += reference.weight / world
        allowed_weight += (bound_w.atol + bound_w.rtol * np.abs(reference.weight)) / world
        misrouted_weight += otb.token_statistics_vjp(hidden, weight, labels, g_wrong, g_h,
                                                     temperature=TEMPERATURE).weight / world
    # the ranks' sums: the other rank's exact gradient and bounds
    gathered = [None] * world
    dist.all_gather_object(gathered, (exact_weight, allowed_weight, misrouted_weight))
    exact = sum(piece[0] for piece in gathered)
    misrouted = sum(piece[2] for piece in gathered)
    # float32 accumulation over at most 8 micro-batch terms per element: 8ε₃₂ relative to the sum of magnitudes
    allowed = sum(piece[1] for piece in gathered) + 8 * np.finfo(np.float32).eps * sum(
        np.abs(piece[0]) + piece[1] for piece in gathered)
    bound = Tolerance(rtol=0.0, atol=allowed, reason="per micro-batch bounds, summed over micro-batches and ranks")
    computed = stepped["gradient"].double().numpy()
    bound.assert_close(computed, exact, "∂ lm_head.weight of verl's FSDP2 step (reduced over the ranks)")
    assert not bound.holds(computed, misrouted), "the check cannot tell each row's advantages from the next row's"


if __name__ == "__main__":
    # before any verl module asks for the platform (several read the device name when imported)
    os.environ.update(VERL_PLATFORM="cpu", VERL_ENGINE_DEVICE="cuda", VERL_ENGINE_VENDOR="nvidia")
    _cpu_platform()
    sys.path[:0] = [os.path.dirname(os.path.abspath(__file__))]
    import torch.distributed as dist

    import otb_spec as otb
    import otb_torch.verl as otb_verl
    import verl.utils.tensordict_utils as tu
    import verl.workers.utils.padding as verl_padding
    from otb_spec.tolerances import Tolerance, output_rounding
    from test_verl_fused import (RESPONSE, VOCAB, _assert_pass_statistics, _DecoderCalls, _expected_advantages,
                                 _gradient_bounds, _sequences)
    from verl.protocol import DataProto
    from verl.trainer.config import AlgoConfig
    from verl.trainer.ppo.ray_trainer import compute_advantage

    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5])
