"""OTB with verl 0.9.1's fused kernels: ``otb_torch.verl.install(sum_pi_squared=True)`` makes
``calculate_sum_pi_squared=True`` work with ``use_fused_kernels=True`` on verl's torch fused backend.

Everything runs verl's own code on a tiny, randomly initialised Qwen2 built from a transformers config (no download):
verl's ``patch_forward_with_backends`` (models/transformers/monkey_patch.py:234) installs its fused model forward
(dense_common.py ``forward_with_torch_backend``), whose ``FusedLinearForPPO`` the port replaces; verl's
``FSDPEngineWithLMHead.forward_step`` (workers/engine/fsdp/transformer_impl.py:1549) runs ``prepare_model_inputs``, the
model and ``prepare_model_outputs`` on a micro-batch made by verl's ``left_right_2_no_padding`` as
``RayPPOTrainer._compute_old_log_prob`` makes it (ray_trainer.py:1290–1322). A whole training step then runs verl's
``FSDPEngine.infer_batch`` and ``train_batch`` (``forward_backward_batch``, ``ppo_loss``, ``optimizer_step``), with
fused kernels and without. Only verl's device helpers (the engine's two and dynamic batching's) are pointed at the CPU
(verl asks CUDA for the device id); the engine object is built without FSDP wrapping, which these methods do not need,
with a plain SGD optimizer, and a one-rank gloo group stands for the data-parallel group. The worker layer around the
engine, FSDP2 and two ranks: ``test_verls_actor_worker_on_fsdp2_trains_on_the_ports_advantages``.

Comparisons use the derived bounds (otb_spec.tolerances): verl's path and the port are two implementations, so they
differ by at most the sum of their bounds; the port's Σπ² is judged against the reference on the gathered logits.
"""

from __future__ import annotations

import functools
import math
import os
import sys
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
otb_torch = pytest.importorskip("otb_torch")

import otb_spec as otb  # noqa: E402
import otb_torch.verl as otb_verl  # noqa: E402
from otb_spec.tolerances import (  # noqa: E402
    hidden_gradient_tolerance,
    hidden_statistics_tolerance,
    otb_comparison_tolerance,
    output_rounding,
)

VOCAB, PROMPT, RESPONSE = 300, 6, 9


@pytest.fixture(scope="module")
def verl():
    try:
        import transformers
        from tensordict import TensorDict

        from verl.models.transformers.monkey_patch import patch_forward_with_backends
        from verl.protocol import DataProto
        from verl.trainer.config import AlgoConfig
        from verl.trainer.ppo.ray_trainer import compute_advantage
        from verl.utils import tensordict_utils
        from verl.utils.experimental import torch_functional as experimental
        from verl.workers.engine.fsdp import transformer_impl
        from verl.workers.utils.padding import left_right_2_no_padding, no_padding_2_padding
    except ImportError as exc:
        pytest.skip(f"verl 0.9.1 is not importable here ({exc}); install the 'verl' test extra (README test command)")
    from types import SimpleNamespace
    return SimpleNamespace(transformers=transformers, TensorDict=TensorDict,
                           patch_forward_with_backends=patch_forward_with_backends, DataProto=DataProto,
                           AlgoConfig=AlgoConfig, compute_advantage=compute_advantage, tu=tensordict_utils,
                           experimental=experimental, transformer_impl=transformer_impl,
                           left_right_2_no_padding=left_right_2_no_padding, no_padding_2_padding=no_padding_2_padding)


@pytest.fixture(autouse=True)
def _nothing_installed_after_a_test():
    yield
    otb_verl.uninstall()


@pytest.fixture
def model(verl, request):
    """A tiny random Qwen2 with verl's fused forward (torch backend) — or, parametrized indirectly with "unfused",
    transformers' own forward returning the logits; the class's own forward is restored after."""
    config = verl.transformers.Qwen2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)
    torch.manual_seed(0)
    network = verl.transformers.Qwen2ForCausalLM(config).float()
    model_class = type(network)
    own_forward = model_class.__dict__["forward"]
    if getattr(request, "param", "fused") == "fused":
        verl.patch_forward_with_backends(network, use_fused_kernels=True, fused_kernels_backend="torch")
    yield network
    model_class.forward = own_forward


def _hidden_of(network, **inputs) -> dict:
    """Run ``network`` with a hook keeping the last hidden state (with its gradient) and the lm_head weight."""
    kept = {}

    def keep(module, args, output):
        output[0].retain_grad()
        kept["hidden"] = output[0]

    handle = network.model.register_forward_hook(keep)
    try:
        output = network(**inputs)
    finally:
        handle.remove()
    return {"output": output, "hidden": kept["hidden"]}


def _sequences(seed: int, response_lengths=None, tool_spans=None):
    """Left-padded prompts and right-padded responses, as verl's rollout returns them (4 rows, the responses' lengths
    drawn; or a row per entry of ``response_lengths``). ``tool_spans``: per row None or (start, stop), response
    positions that hold tool output — tokens the model reads (``response_attention`` 1) but is not trained on
    (``response_mask`` 0), as verl's multi-turn rollouts mark them."""
    rng = np.random.default_rng(seed)
    rows = 4 if response_lengths is None else len(response_lengths)
    prompt_lengths, response_lengths = (rng.integers(2, PROMPT + 1, rows),
                                        rng.integers(1, RESPONSE + 1, rows) if response_lengths is None
                                        else np.asarray(response_lengths))
    prompts = np.zeros((rows, PROMPT), np.int64)
    responses = np.zeros((rows, RESPONSE), np.int64)
    prompt_mask, response_attention = np.zeros_like(prompts), np.zeros_like(responses)
    for row in range(rows):
        prompts[row, PROMPT - prompt_lengths[row]:] = rng.integers(1, VOCAB, prompt_lengths[row])
        prompt_mask[row, PROMPT - prompt_lengths[row]:] = 1
        responses[row, :response_lengths[row]] = rng.integers(1, VOCAB, response_lengths[row])
        response_attention[row, :response_lengths[row]] = 1
    response_mask = response_attention.copy()
    for row, span in enumerate(tool_spans or []):
        if span is not None:
            response_mask[row, span[0]:span[1]] = 0
    return {name: torch.from_numpy(value) for name, value in
            dict(prompts=prompts, responses=responses, prompt_mask=prompt_mask, response_mask=response_mask,
                 response_attention=response_attention).items()}


# ----------------------------------------------------------------------------------------------------------------------
# the fused forward: the same log π and entropy (values and gradients), and Σπ² from the same pass


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_fused_forward_equals_verls_and_returns_sum_pi_squared(verl, model, temperature):
    """verl's patched forward with verl's FusedLinearForPPO, then with the port's: log π and entropy agree, and so
    do the gradients at the fused boundary (the final hidden states and lm_head.weight), within the sum of the two
    implementations' bounds; Σπ² from the fused pass equals the reference on the gathered logits."""
    rng = np.random.default_rng(1)
    ids = torch.from_numpy(rng.integers(0, VOCAB, (3, 11)))
    inputs = dict(input_ids=ids, attention_mask=torch.ones_like(ids), position_ids=torch.arange(11).expand(3, 11),
                  temperature=temperature, return_dict=True, use_cache=False)
    g_lp, g_h = rng.normal(size=(3, 11)), rng.normal(size=(3, 11))
    runs = {}
    for who in ("verl", "port"):
        model.zero_grad()
        with otb_verl.install(sum_pi_squared=True) if who == "port" else _nothing():
            run = _hidden_of(model, **inputs)
        output = run["output"]
        assert output.log_probs.dtype == torch.float32 and output.entropy.dtype == torch.float32
        (output.log_probs * torch.from_numpy(g_lp).float() + output.entropy * torch.from_numpy(g_h).float()).sum() \
            .backward()
        runs[who] = dict(log_probs=output.log_probs.detach().double().numpy(),
                         entropy=output.entropy.detach().double().numpy(),
                         hidden_grad=run["hidden"].grad.double().numpy(),
                         weight_grad=model.lm_head.weight.grad.double().numpy(),
                         hidden=run["hidden"].detach().double().numpy(),
                         sum_pi_squared=getattr(output, "sum_pi_squared", None))
    assert runs["verl"]["sum_pi_squared"] is None
    np.testing.assert_array_equal(runs["verl"]["hidden"], runs["port"]["hidden"])
    hidden, weight = runs["port"]["hidden"], model.lm_head.weight.detach().double().numpy()
    labels = torch.roll(ids, -1, -1).numpy()                  # verl's rolled labels (dense_common.py)
    one = hidden_statistics_tolerance(hidden, weight, labels, temperature=temperature, dtype=np.float32)
    rounding = output_rounding(np.float32)
    for name in ("log_probs", "entropy"):
        (getattr(one, name) + getattr(one, name) + rounding).assert_close(
            runs["port"][name], runs["verl"][name], f"{name}: port vs verl's FusedLinearForPPO")
    bound_h, bound_w = hidden_gradient_tolerance(hidden, weight, labels, g_lp, g_h, temperature=temperature,
                                                 dtype=np.float32)
    (bound_h + bound_h + rounding).assert_close(runs["port"]["hidden_grad"], runs["verl"]["hidden_grad"],
                                                "∂ final hidden states: port vs verl")
    (bound_w + bound_w + rounding).assert_close(runs["port"]["weight_grad"], runs["verl"]["weight_grad"],
                                                "∂ lm_head.weight: port vs verl")
    reference = otb.token_statistics_from_hidden(hidden, weight, labels, temperature=temperature)
    spp = runs["port"]["sum_pi_squared"]
    assert spp.shape == ids.shape and not spp.requires_grad
    bound = one.sum_pi_squared + hidden_statistics_tolerance(hidden, weight, labels, temperature=temperature,
                                                             dtype=np.float64).sum_pi_squared + rounding
    bound.assert_close(spp.numpy(), reference.sum_pi_squared, "Σπ² from the fused pass vs the reference")


def test_the_fused_route_names_verls_arguments_in_its_errors(verl):
    """Bad input to the port's FusedLinearForPPO gets the port's error, naming the argument as verl's forward calls it
    (hidden_states, vocab_weights, input_ids), not as otb_torch's function does (hidden, weight, token_ids)."""
    hidden, weight, ids = torch.randn(2, 5, 8), torch.randn(30, 8), torch.randint(0, 30, (2, 5))
    with otb_verl.install(sum_pi_squared=True):
        fused = verl.experimental.FusedLinearForPPO()
        assert type(fused).__qualname__.startswith("otb_torch.verl.")
        with pytest.raises(ValueError, match=r"^hidden_states: contains NaN"):
            fused(hidden.index_put((torch.tensor(1), torch.tensor(2), torch.tensor(3)), torch.tensor(math.nan)),
                  weight, ids)
        with pytest.raises(ValueError, match=r"^vocab_weights: expected shape \[V, 8\] \(H = hidden_states"):
            fused(hidden, weight[:, :7], ids)
        with pytest.raises(ValueError, match=r"^input_ids: expected shape \(2, 5\) \(hidden_states without the "
                                             r"hidden axis\)"):
            fused(hidden, weight, ids[:, :4])
        with pytest.raises(ValueError, match=r"^input_ids: must lie in \[0, 30\)"):
            fused(hidden, weight, ids + 30)
        with pytest.raises(ValueError, match=r"^temperature: "):
            fused(hidden, weight, ids, temperature=-1.0)


def test_a_sharded_weight_outside_an_fsdp2_head_is_refused_by_name(verl, one_rank_world):
    """The port's FusedLinearForPPO handed a DTensor weight that is not the weight of the running model's FSDP2
    lm_head (a shard of another layout, or called outside a model forward) raises a ValueError naming
    vocab_weights — not torch's "mixed torch.Tensor and DTensor" from inside the kernel."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    hidden, weight, ids = torch.randn(2, 5, 8), torch.randn(30, 8), torch.randint(0, 30, (2, 5))
    sharded = distribute_tensor(weight, init_device_mesh("cpu", (1,)), [Shard(0)])
    with otb_verl.install(sum_pi_squared=True):
        with pytest.raises(ValueError, match=r"^vocab_weights: a sharded DTensor that is not the weight of an FSDP2 "
                                             r"lm_head"):
            verl.experimental.FusedLinearForPPO()(hidden, sharded, ids)


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc_info):
        return False


def test_install_finds_models_patched_before_it_and_uninstall_restores_verls_forward(verl):
    """install() after verl patched a model class: that class is found; before: verl's monkey patch picks the
    wrapped forward up from its module. uninstall() gives every class verl's own function back."""
    config = verl.transformers.Qwen2Config(vocab_size=50, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                                           num_attention_heads=2, num_key_value_heads=1)
    network = verl.transformers.Qwen2ForCausalLM(config)
    model_class = type(network)
    own_forward = model_class.__dict__["forward"]
    dense_common = __import__("verl.models.transformers.dense_common", fromlist=["x"])
    verls_forward = dense_common.forward_with_torch_backend
    try:
        verl.patch_forward_with_backends(network, use_fused_kernels=True, fused_kernels_backend="torch")
        assert model_class.forward is verls_forward
        installation = otb_verl.install(sum_pi_squared=True)
        assert model_class.forward.__wrapped__ is verls_forward
        assert f"{model_class.__module__}.{model_class.__qualname__}.forward" in installation.places
        assert verl.experimental.FusedLinearForPPO.__name__ == "FusedLinearForPPOWithSumPiSquared"
        otb_verl.uninstall()
        assert model_class.forward is verls_forward
        assert verl.experimental.FusedLinearForPPO.__module__ == "verl.utils.experimental.torch_functional"
        model_class.forward = own_forward
        with otb_verl.install(sum_pi_squared=True):
            verl.patch_forward_with_backends(network, use_fused_kernels=True, fused_kernels_backend="torch")
            assert model_class.forward.__wrapped__ is verls_forward
        assert model_class.forward is verls_forward
        assert dense_common.forward_with_torch_backend is verls_forward
    finally:
        model_class.forward = own_forward


# ----------------------------------------------------------------------------------------------------------------------
# the FSDP engine: verl's refusal lifted where the port supplies Σπ², and the trainer's advantage step


@pytest.fixture
def engine(verl, model, monkeypatch):
    """verl's FSDPEngineWithLMHead around the tiny model, with the attributes forward_step, infer_batch and
    train_batch read that its __init__ would set (no FSDP wrap; entropy uncompiled)."""
    from verl.utils import torch_functional as verl_functional
    from verl.workers.config import FSDPEngineConfig

    monkeypatch.setattr(verl.transformer_impl, "get_device_id", lambda: "cpu")
    monkeypatch.setattr(verl.transformer_impl, "get_device_name", lambda: "cpu")
    instance = object.__new__(verl.transformer_impl.FSDPEngineWithLMHead)
    instance.module, instance.use_ulysses_sp, instance.ulysses_sequence_parallel_size = model, False, 1
    instance.pad_to_length, instance._autocast_dtype = False, torch.float32
    instance.compute_entropy_from_logits = verl_functional.entropy_from_logits
    instance.engine_config, instance.scaler, instance._qat_enabled = FSDPEngineConfig(strategy="fsdp"), None, False
    instance.ulysses_device_mesh = None
    return instance


def _micro_batch(verl, sequences, *, remove_padding: bool, temperature: float):
    """The micro-batch of RayPPOTrainer._compute_old_log_prob (ray_trainer.py:1290–1304) for these sequences."""
    input_ids = torch.cat([sequences["prompts"], sequences["responses"]], 1)
    attention_mask = torch.cat([sequences["prompt_mask"], sequences["response_mask"]], 1)
    data = verl.TensorDict({"prompts": sequences["prompts"], "responses": sequences["responses"],
                            "input_ids": input_ids, "attention_mask": attention_mask,
                            "position_ids": (attention_mask.cumsum(1) - 1).clamp(min=0),
                            "response_mask": sequences["response_mask"]}, batch_size=[input_ids.shape[0]])
    data = verl.left_right_2_no_padding(data)
    verl.tu.assign_non_tensor(data, calculate_entropy=True, calculate_sum_pi_squared=True, compute_loss=False,
                              use_remove_padding=remove_padding, use_fused_kernels=True, temperature=temperature)
    return data


def _assert_pass_statistics(hidden, weight, labels, sum_pi_squared, log_probs, where: str, *, temperature=1.0,
                            rounding=None):
    """Σπ² and log π of a fused pass on ``hidden`` [N, H] and ``weight`` [V, H] (what computed them) against the
    reference's, within the pass's float32 bound plus the reference's float64 one (plus ``rounding``: the outputs'
    rounding to their dtype)."""
    statistics = otb.token_statistics_from_hidden(hidden, weight, labels, temperature=temperature)
    ours, exact = (hidden_statistics_tolerance(hidden, weight, labels, temperature=temperature, dtype=dtype)
                   for dtype in (np.float32, np.float64))
    for name, computed in (("sum_pi_squared", sum_pi_squared), ("log_probs", log_probs)):
        bound = getattr(ours, name) + getattr(exact, name)
        (bound if rounding is None else bound + rounding).assert_close(
            computed, getattr(statistics, name), f"{'Σπ²' if name == 'sum_pi_squared' else 'log π'} {where}")


def _gradient_bounds(hidden, weight, labels, g_lp, g_h, *, temperature, output_dtype):
    """Bounds (hidden, weight) on a float32 vector-Jacobian product of (log π, H) against the float64 reference's,
    plus rounding the gradients to ``output_dtype``."""
    return tuple(sum(pair, output_rounding(output_dtype)) for pair in zip(
        *(hidden_gradient_tolerance(hidden, weight, labels, g_lp, g_h, temperature=temperature, dtype=dtype)
          for dtype in (np.float32, np.float64))))


def _reference_response_statistics(model, sequences, temperature: float):
    """The reference's log π and Σπ² of each response token, from the final hidden states and lm_head (float64)."""
    input_ids = torch.cat([sequences["prompts"], sequences["responses"]], 1)
    attention_mask = torch.cat([sequences["prompt_mask"], sequences["response_mask"]], 1)
    with torch.no_grad():
        hidden = model.model(input_ids=input_ids, attention_mask=attention_mask,
                             position_ids=(attention_mask.cumsum(1) - 1).clamp(min=0)).last_hidden_state
    # the token at response position t is predicted by the hidden state one position earlier
    predicting = hidden[:, PROMPT - 1:PROMPT - 1 + RESPONSE].double().numpy()
    weight = model.lm_head.weight.detach().double().numpy()
    labels = sequences["responses"].numpy()
    return predicting, weight, labels, otb.token_statistics_from_hidden(predicting, weight, labels,
                                                                        temperature=temperature)


@pytest.mark.parametrize("remove_padding", [True, False], ids=["remove padding", "padded"])
def test_fsdp_engine_returns_sum_pi_squared_from_the_fused_pass(verl, engine, model, remove_padding):
    sequences = _sequences(seed=2)
    with pytest.raises(NotImplementedError, match="fused kernels do not materialize"):        # verl's own refusal
        engine.forward_step(_micro_batch(verl, sequences, remove_padding=remove_padding, temperature=0.9),
                            loss_function=None, forward_only=True)
    with otb_verl.install(sum_pi_squared=True):
        micro_batch = _micro_batch(verl, sequences, remove_padding=remove_padding, temperature=0.9)
        with torch.no_grad():
            _, result = engine.forward_step(micro_batch, loss_function=None, forward_only=True)
    outputs = result["model_output"]
    assert set(outputs) == {"log_probs", "entropy", "sum_pi_squared"}
    assert outputs["sum_pi_squared"].is_nested
    spp = verl.no_padding_2_padding(outputs["sum_pi_squared"], micro_batch).numpy()       # ray_trainer.py:1316
    log_probs = verl.no_padding_2_padding(outputs["log_probs"], micro_batch).numpy()
    hidden, weight, labels, reference = _reference_response_statistics(model, sequences, 0.9)
    valid = sequences["response_mask"].numpy() > 0
    ours = hidden_statistics_tolerance(hidden[valid], weight, labels[valid], temperature=0.9, dtype=np.float32)
    exact = hidden_statistics_tolerance(hidden[valid], weight, labels[valid], temperature=0.9, dtype=np.float64)
    rounding = output_rounding(np.float32)
    (ours.sum_pi_squared + exact.sum_pi_squared + rounding).assert_close(
        spp[valid], reference.sum_pi_squared[valid], "engine's Σπ² vs the reference")
    (ours.log_probs + exact.log_probs + rounding).assert_close(
        log_probs[valid], reference.log_probs[valid], "engine's log π vs the reference")


def test_the_refusal_stays_where_the_forward_gave_no_sum_pi_squared(verl, engine):
    """A fused forward without Σπ² (verl's Liger or Triton backends): the installed engine still refuses, and the
    message says what to do."""
    sequences = _sequences(seed=3)
    micro_batch = _micro_batch(verl, sequences, remove_padding=True, temperature=1.0)
    with otb_verl.install(sum_pi_squared=True):
        model_inputs, output_args = engine.prepare_model_inputs(micro_batch)
        output = type("FusedOutputWithoutSumPiSquared", (), {"log_probs": None, "entropy": None})()
        with pytest.raises(NotImplementedError, match="impl_backend=torch.*install\\(sum_pi_squared=True\\)"):
            engine.prepare_model_outputs(output, output_args, micro_batch, None)


def test_otb_advantages_from_the_fused_pass(verl, engine, model):
    """The whole step OTB needs, with fused kernels: the engine's old log π and Σπ² (no_padding_2_padding, as the
    trainer does), then verl's own compute_advantage (routed to the port) — equal to the reference's OTB on those
    token statistics, within the derived bounds (the statistics themselves: the test above)."""
    sequences = _sequences(seed=4)
    rows = sequences["responses"].shape[0]
    with otb_verl.install(sum_pi_squared=True):
        micro_batch = _micro_batch(verl, sequences, remove_padding=True, temperature=1.0)
        with torch.no_grad():
            _, result = engine.forward_step(micro_batch, loss_function=None, forward_only=True)
        outputs = result["model_output"]
        old_log_probs = verl.no_padding_2_padding(outputs["log_probs"], micro_batch).float()
        sum_pi_squared = verl.no_padding_2_padding(outputs["sum_pi_squared"], micro_batch).float()
        mask = sequences["response_mask"].float()
        lengths = mask.sum(-1).long()
        rewards = torch.zeros_like(mask)
        rewards[torch.arange(rows), lengths - 1] = torch.tensor([1.0, 0.0, 1.0, 1.0])
        uids = np.array(["a", "b", "a", "b"], dtype=object)
        data = verl.DataProto.from_single_dict({"token_level_rewards": rewards, "response_mask": mask,
                                                "old_log_probs": old_log_probs * mask,
                                                "sum_pi_squared": sum_pi_squared * mask, "uid": uids})
        data = verl.compute_advantage(data, adv_estimator="optimal_token_baseline", gamma=1.0, lam=1.0, num_repeat=2,
                                      config=verl.AlgoConfig(adv_estimator="optimal_token_baseline"))
    inputs = (rewards.numpy(), mask.numpy(), uids, (old_log_probs * mask).numpy(), (sum_pi_squared * mask).numpy())
    expected = otb.optimal_token_baseline(*inputs)
    bound, _ = otb_comparison_tolerance(*inputs)
    bound.assert_close(data.batch["advantages"].numpy(), expected.advantages, "OTB advantages from the fused pass")


# ----------------------------------------------------------------------------------------------------------------------
# a training step: verl's actor update on the port's advantages, with fused kernels


class _DecoderCalls:
    """Every forward of the model's decoder inside the block: the token ids and position ids it read and its final
    hidden states (their gradient retained). ``response_states(sequences)`` finds each row of the batch among them by
    its valid tokens — in whatever micro-batch and order verl put it, packed or padded — and returns, per row, the
    hidden states that predict its response tokens (the state one position before each) with their gradients."""

    def __init__(self, model):
        self.model, self.calls, self.handles = model, [], []

    def __enter__(self):
        def read(module, args, kwargs):
            ids = kwargs["input_ids"] if "input_ids" in kwargs else args[0]     # verl's Qwen3-VL forward: positional
            self.calls.append({"input_ids": ids, "position_ids": kwargs.get("position_ids")})

        def keep(module, args, output):
            if output[0].requires_grad:
                output[0].retain_grad()
            self.calls[-1]["hidden"] = output[0]

        self.handles = [self.model.model.register_forward_pre_hook(read, with_kwargs=True),
                        self.model.model.register_forward_hook(keep)]
        return self

    def __exit__(self, *exc):
        for handle in self.handles:
            handle.remove()

    def _segments(self):
        """(call, batch index, first position, token ids) of every sequence the decoder read: a sequence's position
        ids start at 0 — packed, several per row; padded, one per row, its valid tokens first."""
        for number, call in enumerate(self.calls):
            ids, positions = call["input_ids"], call["position_ids"]
            for index in range(ids.shape[0]):
                starts = torch.nonzero(positions[index] == 0).flatten().tolist() + [ids.shape[1]]
                for begin, stop in zip(starts[:-1], starts[1:]):
                    yield number, index, begin, ids[index, begin:stop]

    def response_states(self, sequences) -> list[tuple[int, int, torch.Tensor]]:
        """Per row of ``sequences``: (call, batch index, positions) of the hidden states that predict its response
        tokens — those of ``response_mask``, not a tool span's."""
        prompt_mask, attention = sequences["prompt_mask"].bool(), sequences["response_attention"].bool()
        found = []
        for row in range(prompt_mask.shape[0]):
            tokens = torch.cat([sequences["prompts"][row][prompt_mask[row]],
                                sequences["responses"][row][attention[row]]])
            places = [(number, index, begin) for number, index, begin, ids in self._segments()
                      if len(ids) == len(tokens) and torch.equal(ids, tokens)]
            assert len(places) == 1, f"row {row} read {len(places)} times by the decoder"
            number, index, begin = places[0]
            trained = torch.nonzero(sequences["response_mask"][row][attention[row]]).flatten()
            found.append((number, index, begin + int(prompt_mask[row].sum()) - 1 + trained))
        return found

    def gather(self, places, gradient: bool = False) -> np.ndarray:
        """The hidden states (or their gradients) at ``places``, concatenated row after row: [N, H] float64."""
        return np.concatenate([(self.calls[number]["hidden"].grad if gradient else self.calls[number]["hidden"])
                               [index, at].detach().double().numpy() for number, index, at in places])

    def gradient_elsewhere(self, places) -> float:
        """The largest |gradient| of the hidden states outside ``places``."""
        largest = 0.0
        for number, call in enumerate(self.calls):
            outside = torch.ones(call["hidden"].shape[:-1], dtype=torch.bool)
            for place_number, index, at in places:
                if place_number == number:
                    outside[index, at] = False
            largest = max([largest, *call["hidden"].grad[outside].abs().flatten().tolist()])
        return largest


@pytest.fixture
def one_rank_world(tmp_path):
    """A gloo process group of one rank (verl's forward_backward_batch all-reduces the batch's token count over the
    data-parallel group); destroyed after the test. Reuses a default group of one that is already there."""
    if dist.is_initialized():
        if dist.get_world_size() != 1:
            pytest.skip("a process group of several ranks is already initialised in this process")
        yield
        return
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _expected_advantages(variant: str, align: str, inputs: tuple, rho):
    """The reference's advantages for the installed variant on (rewards, mask, ids, log π, Σπ²) with IS weights ρ, and
    the bound a float32 implementation of it is held to (``otb_comparison_tolerance``)."""
    if variant == "verl":
        function = otb.multi_turn_optimal_token_baseline if align == "valid_token" else otb.optimal_token_baseline
        return (function(*inputs, is_weights=rho).advantages,
                otb_comparison_tolerance(*inputs, is_weights=rho, align=align)[0])
    return (otb.leave_one_out_token_baseline(*inputs, is_weights=rho, align=align).advantages,
            otb_comparison_tolerance(*inputs, is_weights=rho, align=align, leave_one_out=True, handle_zero_tail=False,
                                     compute_dtype=np.float32)[0])


ENTROPY_COEFF = 2.0**-6     # a power of two, as is the step's token count: the loss's cotangents are exact in float32
LOGIT_SCALE = 32.0          # lm_head × 32 (exact): the random model's near-uniform π would make every token alike
LEARNING_RATE = 0.5         # plain SGD: the step is weight − 0.5·gradient, exactly


# model: verl's fused forward, or transformers' own (the logits materialised; Σπ² by the port's function swapped in
# with install(sum_pi_squared=True), or by verl's own formula). bf16: the model's parameters in bfloat16, as FSDP's
# mixed precision computes with them, in one micro-batch — several would accumulate lm_head.weight's gradient in
# bfloat16 here, where FSDP accumulates float32 gradients.
# multi-turn: verl's tir_optimal_token_baseline on responses with tool spans (read, not trained on).
# temperature: verl divides the logits by it (the fused kernel takes it as an argument). is_weights: rollout importance
# weights ρ (the estimator weighs the energy by ρ², the loss each token by ρ) — powers of two, so the cotangents stay
# exact.
_STEP_DEFAULTS = dict(port_sum_pi_squared=True, micro_batches="one", precision="float32", multi_turn=False,
                      temperature=1.0, is_weights=False)
_STEPS = {"fused, one micro-batch": dict(model="fused"),
          "fused, dynamic bsz, T=0.7": dict(model="fused", micro_batches="dynamic", temperature=0.7),
          "fused, one micro-batch in bf16": dict(model="fused", precision="bfloat16"),
          "fused, multi-turn with tool spans, dynamic bsz": dict(model="fused", multi_turn=True,
                                                                 micro_batches="dynamic"),
          "fused, rollout IS weights": dict(model="fused", is_weights=True),
          "unfused, the port's sum_pi_squared, T=0.7": dict(model="unfused", temperature=0.7),
          "unfused, verl's sum_pi_squared": dict(model="unfused", port_sum_pi_squared=False)}


@pytest.mark.parametrize("model, step", [(case["model"], {**_STEP_DEFAULTS, **case}) for case in _STEPS.values()],
                         ids=list(_STEPS), indirect=["model"])
@pytest.mark.parametrize("variant", ["verl", "leave_one_out"])
@pytest.mark.parametrize("remove_padding", [True, False], ids=["remove padding", "padded"])
def test_a_training_step_of_verls_actor_on_the_ports_advantages(verl, engine, model, one_rank_world, monkeypatch,
                                                                variant, remove_padding, step):
    """One step as verl's legacy trainer takes it with the port installed, in verl's own code: old log π and Σπ² as
    ``RayPPOTrainer._compute_old_log_prob`` gets them (``to_tensordict``, ``left_right_2_no_padding``; the worker's
    ``compute_log_prob`` is ``FSDPEngine.infer_batch``), verl's ``compute_advantage`` routed to the port, and the actor
    update as ``_update_actor`` sends the batch (ray_trainer.py:1333–1368) to ``FSDPEngine.train_batch`` — zero_grad,
    ``forward_backward_batch`` over the micro-batches (one, or verl's dynamic batching by token count, which reorders
    the rows and restores their order), ``forward_step`` with verl's ``ppo_loss`` (vanilla clipped loss, token-mean, an
    entropy bonus), ``optimizer_step``. Single-turn (``optimal_token_baseline``) or multi-turn
    (``tir_optimal_token_baseline``, tool spans inside the responses: read by the model, masked out of the loss and
    compacted away by the valid-token alignment). With or without rollout importance weights ρ (verl's rollout
    correction: ρ² in the energy, ρ on each token's loss). The policy is peaked (lm_head × 32: Σπ² from 0.06 to 0.997),
    in float32 or with bfloat16 parameters; the forward is verl's fused one (the port's kernel) or transformers' own,
    whose logits verl's engine turns into log π, entropy and Σπ² (the port's function with
    ``install(sum_pi_squared=True)``, else verl's formula). Checked:

    * Σπ² and old log π of every response token, back in the batch's row order, equal the reference's on the final
      hidden states and lm_head that computed them, within ``hidden_statistics_tolerance``;
    * the advantages the loss received equal the reference's OTB (self-inclusive or leave-one-out) on those
      statistics, within ``otb_comparison_tolerance``;
    * on policy the update's log π equal the old ones bit for bit (ratio 1, nothing clipped), so the gradient that
      reaches the fused boundary is the vector-Jacobian product of Σₜ (−ρₜAₜ/N)·log πₜ − (c/N)·Hₜ over the N response
      tokens: the final hidden states' and lm_head.weight's gradients equal the reference's
      ``token_statistics_vjp`` within ``hidden_gradient_tolerance`` (N, c and ρ are powers of two, so the cotangents
      are exact), and are exactly 0 at the positions that predict no response token; the same VJP with each row
      given the next row's advantages is outside those bounds (the check can fail). From bfloat16 parameters the port
      computes in float32, so the float32 bounds apply, plus rounding the gradients to bfloat16;
    * the optimizer stepped with that gradient.
    """
    from verl.utils import seqlen_balancing
    from verl.workers.config import FSDPActorConfig, FSDPOptimizerConfig
    from verl.workers.utils.losses import ppo_loss

    monkeypatch.setattr(seqlen_balancing, "get_device_name", lambda: "cpu")    # as the engine's, in the fixture
    multi_turn, micro_batches, precision, temperature = (step[key] for key in ("multi_turn", "micro_batches",
                                                                               "precision", "temperature"))
    # 6 rows in two groups of 3 (with two, leave-one-out's baseline would be the other's return: no statistics in it)
    if multi_turn:          # N = 32 trained response tokens: 36 read, 4 of them tool output
        sequences = _sequences(seed=6, response_lengths=[7, 6, 6, 6, 6, 5],
                               tool_spans=[(2, 4), None, (3, 4), None, (1, 2), None])
    else:                   # N = 32 response tokens
        sequences = _sequences(seed=6, response_lengths=[6, 5, 6, 5, 5, 5])
    mask = sequences["response_mask"].float()
    rows, tokens = mask.shape[0], int(mask.sum())
    assert tokens == 32
    input_ids = torch.cat([sequences["prompts"], sequences["responses"]], 1)
    attention_mask = torch.cat([sequences["prompt_mask"], sequences["response_attention"]], 1)
    uids = np.array(["a", "b"] * 3, dtype=object)
    rewards = torch.zeros_like(mask)
    rewards[torch.arange(rows), sequences["response_attention"].sum(1) - 1] = torch.tensor([1.0, 0, 0, 1, 1, 0])
    estimator, align = (("tir_optimal_token_baseline", "valid_token") if multi_turn
                        else ("optimal_token_baseline", "position"))
    # what the worker's train_batch / infer_batch add from the engine config (engine_workers.py:351–362, 404–414);
    # dynamic batching: at most 20 tokens per micro-batch (a row has 7–13), several micro-batches, the rows reordered
    fused = step["model"] == "fused"
    batching = dict(use_remove_padding=remove_padding, use_dynamic_bsz=micro_batches == "dynamic",
                    max_token_len_per_gpu=20, micro_batch_size_per_gpu=rows, use_fused_kernels=fused,
                    temperature=temperature)
    with torch.no_grad():                # a peaked policy, as a trained one: logits spread over about ±10, not ±0.3
        model.lm_head.weight.mul_(LOGIT_SCALE)
    if precision == "bfloat16":
        model.to(torch.bfloat16)
        engine._autocast_dtype = torch.bfloat16
    engine.optimizer_config = FSDPOptimizerConfig(lr=LEARNING_RATE, clip_grad=1e30)   # no clipping: its factor is 1
    engine.optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
    data = verl.DataProto.from_single_dict({
        "prompts": sequences["prompts"], "responses": sequences["responses"], "input_ids": input_ids,
        "attention_mask": attention_mask, "position_ids": (attention_mask.cumsum(1) - 1).clamp(min=0),
        "response_mask": mask, "token_level_rewards": rewards, "uid": uids})
    if step["is_weights"]:        # ρ ∈ {½, 1, 2} on the trained tokens (the rollout correction's, already truncated)
        weights = 2.0 ** torch.from_numpy(np.random.default_rng(7).integers(-1, 2, mask.shape)).float()
        data.batch["rollout_is_weights"] = weights * mask
    with otb_verl.install(variant, sum_pi_squared=step["port_sum_pi_squared"]):
        rollout = verl.left_right_2_no_padding(data.to_tensordict())            # RayPPOTrainer._compute_old_log_prob
        verl.tu.assign_non_tensor(rollout, calculate_entropy=True, calculate_sum_pi_squared=True, compute_loss=False,
                                  **batching)
        with _DecoderCalls(model) as first_pass:
            result = engine.infer_batch(rollout)
        old_log_probs = verl.no_padding_2_padding(result["model_output"]["log_probs"], rollout).float()
        sum_pi_squared = verl.no_padding_2_padding(result["model_output"]["sum_pi_squared"], rollout).float()
        data.batch["old_log_probs"], data.batch["sum_pi_squared"] = old_log_probs, sum_pi_squared
        data = verl.compute_advantage(data, adv_estimator=estimator, gamma=1.0, lam=1.0, num_repeat=3,
                                      config=verl.AlgoConfig(adv_estimator=estimator))
        advantages = data.batch["advantages"]

        batch = verl.left_right_2_no_padding(data.to_tensordict())                 # RayPPOTrainer._update_actor
        verl.tu.assign_non_tensor(batch, calculate_entropy=True, global_batch_size=rows, compute_loss=True,
                                  return_model_output=True, **batching)
        actor = FSDPActorConfig(strategy="fsdp", rollout_n=3, ppo_mini_batch_size=2, ppo_micro_batch_size_per_gpu=rows,
                                entropy_coeff=ENTROPY_COEFF, use_kl_loss=False)
        weight_before = model.lm_head.weight.detach().clone()
        with _DecoderCalls(model) as update:
            output = engine.train_batch(batch, loss_function=functools.partial(ppo_loss, config=actor))
    rollout_places = first_pass.response_states(sequences)
    assert all(call["hidden"].dtype == getattr(torch, precision) for call in first_pass.calls + update.calls)
    if micro_batches == "dynamic":                 # the rows ran in other micro-batches than their order says
        calls = [number for number, _, _ in rollout_places]
        assert len(first_pass.calls) >= 2 and calls != sorted(calls)

    # the statistics the advantages came from, row by row, against the reference on the hidden states behind them
    weight, valid = weight_before.double().numpy(), mask.numpy() > 0             # row-major: the order of ``places``
    labels = sequences["responses"].numpy()[valid]
    # the port computes from bf16 hidden states and weights in float32 (each product exact there), so it is held to
    # the float32 bounds, plus rounding its gradients to the parameters' dtype on output
    _assert_pass_statistics(first_pass.gather(rollout_places), weight, labels, sum_pi_squared.numpy()[valid],
                            old_log_probs.numpy()[valid], "of the fused pass", temperature=temperature,
                            rounding=output_rounding(np.float32))

    inputs = (rewards.numpy(), mask.numpy(), uids, old_log_probs.numpy(), sum_pi_squared.numpy())
    rho = data.batch["rollout_is_weights"].double().numpy() if step["is_weights"] else None
    expected, bound = _expected_advantages(variant, align, inputs, rho)
    bound.assert_close(advantages.numpy(), expected, f"{variant} advantages the actor update received")

    # on policy: the update's forward gives the old log π again, bit for bit (ratio exactly 1)
    new_log_probs = verl.no_padding_2_padding(output["model_output"]["log_probs"], batch).float()
    torch.testing.assert_close(new_log_probs[mask > 0], old_log_probs[mask > 0], rtol=0, atol=0)

    # the gradient at the fused boundary against the reference's VJP
    places = update.response_states(sequences)
    hidden_rows = update.gather(places)
    assert update.gradient_elsewhere(places) == 0, "a gradient at positions that predict no response token"
    per_token = np.ones(mask.shape) if rho is None else rho           # the loss weighs each token's term by ρ
    g_lp = -(advantages.double().numpy() * per_token)[valid] / tokens
    g_h = np.full(tokens, -ENTROPY_COEFF / tokens)
    reference = otb.token_statistics_vjp(hidden_rows, weight, labels, g_lp, g_h, temperature=temperature)
    bound_h, bound_w = _gradient_bounds(hidden_rows, weight, labels, g_lp, g_h, temperature=temperature,
                                        output_dtype=precision)
    computed_h = update.gather(places, gradient=True)
    computed_w = model.lm_head.weight.grad.double().numpy()
    bound_h.assert_close(computed_h, reference.hidden, "∂ final hidden states in verl's training step")
    bound_w.assert_close(computed_w, reference.weight, "∂ lm_head.weight in verl's training step")
    # the check can fail: the same VJP with each row given the next row's advantages is rejected
    misrouted = -(np.roll(advantages.double().numpy(), -1, axis=0) * per_token)[valid] / tokens
    wrong = otb.token_statistics_vjp(hidden_rows, weight, labels, misrouted, g_h, temperature=temperature)
    assert not bound_h.holds(computed_h, wrong.hidden) and not bound_w.holds(computed_w, wrong.weight)

    # the optimizer stepped with that gradient (SGD, no clipping)
    stepped = weight_before - LEARNING_RATE * model.lm_head.weight.grad
    torch.testing.assert_close(model.lm_head.weight.detach(), stepped, rtol=0, atol=0)
    assert math.isfinite(output["metrics"]["grad_norm"])


@pytest.mark.distributed
@pytest.mark.parametrize("layout", ["data", "sequence"], ids=["data parallel", "Ulysses sequence parallel"])
def test_verls_actor_worker_on_fsdp2_trains_on_the_ports_advantages(verl, tmp_path, layout):
    """verl's own actor worker, as its trainer builds and drives it, on FSDP2 over two gloo ranks with bfloat16 mixed
    precision and fused kernels — the ranks data-parallel (each its half of the rows; gradient sync deferred to the
    last micro-batch), or one Ulysses sequence-parallel group (each a piece of every packed sequence; the model's
    outputs gathered, the gradients scaled back by verl; the weights kept whole after a forward):
    ``ActorRolloutRefWorker(role="actor")`` from verl's Hydra config, ``init_model`` (``fully_shard`` of each decoder
    layer, the embedding and the untied lm_head), ``compute_log_prob`` and ``update_actor``
    (``TrainingWorker.train_mini_batch``: the mini-batch iterator, four micro-batches a rank with gradient
    accumulation, gradient checkpointing, ``ppo_loss``, clipping, SGD, the LR scheduler) on the batches
    ``RayPPOTrainer`` builds, split as verl dispatches them; ``compute_advantage`` on the gathered batch with the
    port's self-inclusive (single-turn) and leave-one-out (multi-turn, tool spans) estimators, and the same through
    verl's Qwen3-VL and Qwen3.5 fused forwards, which hand the pass ``lm_head.weight.full_tensor()``. Each rank
    (tests/verl_fsdp2_step.py, which says what it checks) finds, with the port: Σπ² and old log π equal to the
    reference's on the hidden states and the bfloat16 weight that computed them, the advantages every micro-batch's
    loss received equal to the reference's OTB, the final hidden states' gradients and lm_head.weight's (reduced over
    the ranks by FSDP2) equal to the reference's vector-Jacobian product within the derived bounds — and not with
    each row given the next row's advantages — and SGD's step; without it, verl's own fused pass failing on the
    sharded lm_head weight. It fails against a port that gathers the head's weight with ``full_tensor()`` instead of
    FSDP2's forward hooks, which leaves the weight's gradient unreduced over the ranks (the gradient check: 9584 of
    9600 elements data-parallel, 9578 sequence-parallel); against one that runs Qwen3-VL's pass on verl's float32
    copy (the statistics check, on the weight FSDP2 gathers: 29 of 34 tokens), and on that copy cast to bfloat16,
    whose statistics pass (the gradient check: 9573 of 9600 elements data-parallel, 9585 sequence-parallel); and
    against a Σπ² 1 % too large (34 of 34 tokens)."""
    pytest.importorskip("hydra", reason="hydra-core (verl's config system) is not installed")
    try:
        from torch.distributed.fsdp import FSDPModule, register_fsdp_forward_method  # noqa: F401
    except ImportError as exc:
        pytest.skip(f"FSDP2 is not available in this torch ({exc})")
    tests = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(tests)
    environment = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
        [root, os.path.join(root, "adapters"), tests, os.environ.get("PYTHONPATH", "")]))
    from distributed_pool import free_port, run_rank_processes

    step, port = os.path.join(tests, "verl_fsdp2_step.py"), str(free_port())
    try:
        results = run_rank_processes([[sys.executable, step, str(rank), "2", port, str(tmp_path), layout]
                                      for rank in range(2)], tmp_path, environment, timeout=300)
    except TimeoutError as exc:
        pytest.fail(f"verl's FSDP2 step: {exc}")
    for rank, (code, output) in enumerate(results):
        assert code == 0, f"rank {rank} failed:\n{output[-8000:]}"
        for case in ("verl single-turn, dense", "leave_one_out multi-turn, dense", "verl single-turn, qwen3_vl",
                     "leave_one_out multi-turn, qwen3_5"):
            assert f"rank {rank}: {layout} parallel, {case} forward checked" in output, output[-4000:]


# ----------------------------------------------------------------------------------------------------------------------
# verl's v1 trainer (trainer.use_v1=True, verl 0.9.1's default) with install(v1_trainer=True)


@pytest.fixture(scope="module")
def transfer_queue(verl):
    """A local Ray with verl's TransferQueue (controller and one SimpleStorage unit), as verl's v1 trainer keeps its
    batch; shut down after the module."""
    ray = pytest.importorskip("ray")
    try:
        import transfer_queue as tq
        from omegaconf import OmegaConf

        import verl.trainer.ppo.v1.trainer_sync  # noqa: F401
    except ImportError as exc:
        pytest.skip(f"verl's v1 trainer is not importable here ({exc}); install the 'verl' test extra")
    if ray.is_initialized():
        pytest.skip("Ray is already initialised in this process")
    # logical CPUs for TransferQueue's two actors (each asks for one); they idle between calls
    ray.init(num_cpus=4, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    try:
        tq.init(OmegaConf.create({"backend": {"SimpleStorage": {"num_data_storage_units": 1}}}))
        yield tq
    finally:
        tq.close()
        ray.shutdown()


def _v1_rows(sequences, rewards, uids):
    """The rows as verl's v1 agent loop puts them in TransferQueue (agent_loop_tq.py:183–225): per row, unpadded,
    prompt and response ids, the sequence with its attention mask and position ids, the response mask (0 on tool
    output; ``loss_mask`` the same), the reward at the response's last token (``rm_scores``) and the rollout's own
    log π of each response token (``rollout_log_probs``, which verl's default config asks the rollout for: here
    log π of a sampler at another temperature, drawn); keys ``{uid}_{session}_{index}``."""
    rng = np.random.default_rng(11)
    keys, rows = [], []
    for row in range(len(uids)):
        prompt = sequences["prompts"][row][sequences["prompt_mask"][row].bool()]
        length = int(sequences["response_attention"][row].sum())
        response = sequences["responses"][row, :length]
        scores = torch.zeros(length)
        scores[-1] = rewards[row]
        keys.append(f"{uids[row]}_{row}_0")
        rows.append(dict(prompts=prompt, responses=response, input_ids=torch.cat([prompt, response]),
                         attention_mask=torch.ones(len(prompt) + length, dtype=torch.int64),
                         position_ids=torch.arange(len(prompt) + length),
                         response_mask=sequences["response_mask"][row, :length],
                         loss_mask=sequences["response_mask"][row, :length], rm_scores=scores, uid=uids[row],
                         rollout_log_probs=torch.from_numpy(-rng.uniform(0.0, 3.0, length)).float(),
                         num_turns=torch.tensor(2)))
    return keys, rows


_V1_TAGS = {"status": "success", "global_steps": 1, "min_global_steps": 1, "max_global_steps": 1}


def _v1_batch(verl, tq, keys, rows, partition: str):
    """The rows put in TransferQueue under ``partition``, and the batch (``KVBatchMeta``) the trainer is sent with —
    built as the trainer's ``step()`` builds one, from keys, tags and partition alone (trainer_base.py:560)."""
    from transfer_queue import KVBatchMeta

    tq.kv_batch_put(keys=keys, partition_id=partition, fields=verl.tu.list_of_dict_to_tensordict(rows),
                    tags=[dict(_V1_TAGS) for _ in keys])
    return KVBatchMeta(keys=keys, tags=[dict(_V1_TAGS) for _ in keys], partition_id=partition)


def _v1_trainer(verl, engine, estimator: str, fused: bool, calculate_sum_pi_squared: bool = True,
                rollout_is: str | None = None, bypass_mode: bool = False):
    """verl's v1 ``PPOTrainerSync`` (built without its Ray workers) on verl's own ``ppo_trainer`` config (Hydra, with
    the recipe's overrides), whose actor worker group's ``compute_log_prob`` is verl's TransferQueue bridge
    (``tqbridge``: the batch's fields read from TransferQueue, the extra_info as non-tensor data, the outputs written
    back) around what ``TrainingWorker.infer_batch`` does with the engine (engine_workers.py:398–441): its defaults,
    ``FSDPEngine.infer_batch``, the model outputs as a TensorDict."""
    from types import SimpleNamespace

    hydra = pytest.importorskip("hydra", reason="hydra-core (verl's config system) is not installed")

    from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync
    from verl.utils.transferqueue_utils import tqbridge

    @tqbridge()
    def compute_log_prob(data):
        defaults = dict(use_remove_padding=True, use_dynamic_bsz=False, max_token_len_per_gpu=64,
                        micro_batch_size_per_gpu=data.batch_size[0], use_fused_kernels=fused)
        for key, value in defaults.items():
            if key not in data.keys():
                verl.tu.assign_non_tensor(data, **{key: value})
        output = engine.infer_batch(data)
        return verl.tu.get_tensordict(tensor_dict=output["model_output"], non_tensor_dict={"metrics": {}})

    overrides = [f"algorithm.adv_estimator={estimator}", "actor_rollout_ref.rollout.n=3",
                 f"actor_rollout_ref.actor.calculate_sum_pi_squared={calculate_sum_pi_squared}",
                 f"algorithm.rollout_correction.rollout_is={rollout_is or 'null'}",
                 f"algorithm.rollout_correction.bypass_mode={bypass_mode}"]
    with hydra.initialize_config_module(config_module="verl.trainer.config", version_base=None):
        config = hydra.compose(config_name="ppo_trainer", overrides=overrides)
    assert config.trainer.use_v1 and config.actor_rollout_ref.rollout.calculate_log_probs      # verl's defaults
    trainer = object.__new__(PPOTrainerSync)
    trainer.config, trainer.use_critic = config, False
    # what __init__ builds and _compute_metrics reads: one GPU for the throughput figures, the MoE metrics off
    trainer.resource_pool_manager = SimpleNamespace(get_n_gpus=lambda: 1)
    trainer._rollout_moe_lb_metrics_accumulator = None
    trainer.actor_rollout_wg = SimpleNamespace(compute_log_prob=compute_log_prob)
    return trainer


def _padded(nested, width: int) -> torch.Tensor:
    padded = nested.to_padded_tensor(0.0)
    return torch.nn.functional.pad(padded, (0, width - padded.shape[1]))


@pytest.mark.parametrize("model", ["fused", "unfused"], indirect=True)
@pytest.mark.parametrize("variant", ["verl", "leave_one_out"])
@pytest.mark.parametrize("multi_turn", [False, True], ids=["single-turn", "multi-turn"])
@pytest.mark.parametrize("rollout_is", [None, "token"], ids=["no IS", "rollout IS"])
def test_verls_v1_trainer_computes_otb_with_v1_trainer_installed(verl, engine, model, one_rank_world, transfer_queue,
                                                                variant, multi_turn, rollout_is, request):
    """verl's v1 trainer, as ``_step_once`` runs it (trainer_base.py:585–600): ``_compute_old_log_prob`` (the actor's
    forward through verl's TransferQueue bridge, on verl's FSDP engine: the port's fused kernel, or transformers' logits
    with verl's own Σπ²) then ``_compute_advantage`` (verl's ``compute_advantage`` with the port's estimator), the batch
    in TransferQueue between them. With ``install(v1_trainer=True)`` the actor is asked for Σπ² and the advantage step
    reads it: the Σπ² and old log π stored for every response token equal the reference's on the hidden states that
    computed them (``hidden_statistics_tolerance``), the advantages stored equal the reference's OTB on them
    (``otb_comparison_tolerance``; and not with each row given the next row's), the flag does not stay in the batch's
    extra_info for the later stages, and ``_compute_metrics`` logs verl's ``variance_proxy/*`` metrics as verl's
    function gives them on those tensors (the legacy trainer's). Two groups of three, scattered as balance_batch leaves
    them; multi-turn with tool spans (``tir_optimal_token_baseline``); verl's default config (its rollout correction
    computing metrics only), or with token-level rollout importance weights (``rollout_is=token``: ρ from old log π −
    the rollout's, truncated at 2, stored by verl, ρ² in the energy)."""
    tq = transfer_queue
    fused = request.node.callspec.params["model"] == "fused"
    if multi_turn:
        sequences = _sequences(seed=6, response_lengths=[7, 6, 6, 6, 6, 5],
                               tool_spans=[(2, 4), None, (3, 4), None, (1, 2), None])
    else:
        sequences = _sequences(seed=6, response_lengths=[6, 5, 6, 5, 5, 5])
    with torch.no_grad():
        model.lm_head.weight.mul_(LOGIT_SCALE)
    rewards, uids = [1.0, 0.0, 0.0, 1.0, 1.0, 0.0], ["a", "b", "a", "b", "a", "b"]
    keys, rows = _v1_rows(sequences, rewards, uids)
    partition = f"train-{request.node.callspec.id}"
    sampled = _v1_batch(verl, tq, keys, rows, partition)
    estimator, align = (("tir_optimal_token_baseline", "valid_token") if multi_turn
                        else ("optimal_token_baseline", "position"))
    trainer = _v1_trainer(verl, engine, estimator, fused, rollout_is=rollout_is)
    with otb_verl.install(variant, sum_pi_squared=fused, v1_trainer=True):
        with _DecoderCalls(model) as first_pass:
            batch = trainer._compute_old_log_prob(sampled, metrics={})
        assert "calculate_sum_pi_squared" not in sampled.extra_info     # the batch the later stages are sent with
        batch = trainer._compute_advantage(batch, metrics={})
        metrics = {"actor/grad_norm": 0.5}
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message="otb_torch.verl")       # the metrics' inputs were all found
            # the batch as step() hands it on: keys, tags and partition alone, no fields listed (trainer_base.py:560)
            trainer._compute_metrics(sampled, metrics, {"step": 1.0}, global_steps=1, epoch=0)
    names = ["old_log_probs", "sum_pi_squared", "advantages"] + (["rollout_is_weights"] if rollout_is else [])
    stored = tq.kv_batch_get(keys=keys, partition_id=partition, select_fields=names)
    old_log_probs, sum_pi_squared, advantages, *weights = (_padded(stored[name], RESPONSE).double().numpy()
                                                           for name in names)
    rho = weights[0] if weights else None
    mask = sequences["response_mask"].double().numpy()
    valid = mask > 0

    weight = model.lm_head.weight.detach().double().numpy()
    _assert_pass_statistics(first_pass.gather(first_pass.response_states(sequences)), weight,
                            sequences["responses"].numpy()[valid], sum_pi_squared[valid], old_log_probs[valid],
                            "stored by the v1 trainer")

    reward_matrix = np.zeros_like(mask)
    reward_matrix[np.arange(len(rows)), sequences["response_attention"].numpy().sum(1) - 1] = rewards
    inputs = (reward_matrix, mask, np.array(uids, dtype=object), old_log_probs, sum_pi_squared)
    if rho is not None:           # ρ = exp(old − rollout log π) truncated at 2, as verl computed and stored it
        assert np.all(rho[valid] > 0) and np.all(rho[valid] <= 2) and np.any(np.abs(rho[valid] - 1) > 0.1)
    expected, bound = _expected_advantages(variant, align, inputs, rho)
    bound.assert_close(advantages, expected, f"{variant} advantages stored by the v1 trainer")
    assert not bound.holds(advantages, np.roll(expected, -1, axis=0))      # the check can fail

    # verl's variance_proxy metrics, as the legacy trainer logs them from its batch: verl's function on the stored
    # tensors (float32, padded as the v1 batch is) gives the logged values bit for bit
    from verl.trainer.ppo.metric_utils import compute_variance_proxy_metrics

    legacy = {name: stored[name].to_padded_tensor(0.0) for name in names}
    legacy["response_mask"] = tq.kv_batch_get(keys=keys, partition_id=partition,
                                              select_fields=["response_mask"])["response_mask"].to_padded_tensor(0)
    expected_metrics = compute_variance_proxy_metrics(verl.DataProto.from_dict(legacy), gradient_norm=0.5)
    assert expected_metrics and all(name.startswith("variance_proxy/") for name in expected_metrics)
    assert {name: metrics.get(name) for name in expected_metrics} == expected_metrics


@pytest.mark.parametrize("model", ["unfused"], indirect=True)
def test_verls_v1_trainer_stops_at_its_own_assertion_without_v1_trainer(verl, engine, model, one_rank_world,
                                                                      transfer_queue):
    """What ``install(v1_trainer=True)`` changes: with the estimators routed but not the v1 trainer, verl's v1
    ``_compute_advantage`` stops at verl's assertion (ray_trainer.py:267) — the actor was never asked for Σπ² — and
    with the option but ``calculate_sum_pi_squared=False`` in the actor config it stops there too (the legacy
    trainer's rule), having asked the actor for nothing more; for another estimator the actor is not asked either,
    and with rollout correction's bypass mode (no actor forward) the advantage step says so; a metrics step that
    finds no Σπ² warns and logs verl's other metrics."""
    tq = transfer_queue
    sequences = _sequences(seed=6, response_lengths=[6, 5, 6, 5, 5, 5])
    keys, rows = _v1_rows(sequences, [1.0, 0.0, 0.0, 1.0, 1.0, 0.0], ["a", "b", "a", "b", "a", "b"])
    for number, options in enumerate([dict(), dict(v1_trainer=True)]):
        batch = _v1_batch(verl, tq, keys, rows, f"refused-{number}")
        trainer = _v1_trainer(verl, engine, "optimal_token_baseline", fused=False,
                              calculate_sum_pi_squared=not options)
        with otb_verl.install(**options):
            batch = trainer._compute_old_log_prob(batch, metrics={})
            assert "sum_pi_squared" not in batch.fields
            with pytest.raises(AssertionError, match="requires sum_pi_squared from actor"):
                trainer._compute_advantage(batch, metrics={})
    grpo, sampled = _v1_trainer(verl, engine, "grpo", fused=False), _v1_batch(verl, tq, keys, rows, "grpo")
    with otb_verl.install(v1_trainer=True):
        batch = grpo._compute_old_log_prob(sampled, metrics={})
        assert "sum_pi_squared" not in batch.fields
        bypass = _v1_trainer(verl, engine, "optimal_token_baseline", fused=False, bypass_mode=True)
        with pytest.raises(ValueError, match="bypass_mode=True: OTB needs Σπ² from the actor's forward"):
            bypass._compute_advantage(batch, metrics={})
        # the metrics step of an OTB trainer on a batch with no Σπ² stored: a warning, and verl's other metrics
        grpo._compute_advantage(batch, metrics={})
        otb_trainer, metrics = _v1_trainer(verl, engine, "optimal_token_baseline", fused=False), {}
        with pytest.warns(UserWarning, match="could not give verl's variance_proxy metrics"):
            otb_trainer._compute_metrics(sampled, metrics, {"step": 1.0}, global_steps=1, epoch=0)
        assert "training/global_step" in metrics and not any(name.startswith("variance_proxy/") for name in metrics)


def test_the_v1_route_is_installed_from_the_environment_and_uninstalled(verl, monkeypatch):
    """``OTB_VERL_V1_TRAINER=yes`` (the Ray worker setup hook's way) patches verl's v1 ``PPOTrainer`` methods and the
    advantage and variance-proxy functions its module imported by name; :func:`uninstall` puts verl's own objects back
    (``is``)."""
    try:
        from verl.trainer.ppo.v1 import trainer_base
        from verl.trainer.ppo.v1 import utils as v1_utils
    except ImportError as exc:
        pytest.skip(f"verl's v1 trainer is not importable here ({exc}); install the 'verl' test extra")
    trainer = trainer_base.PPOTrainer
    originals = {name: trainer.__dict__[name]
                 for name in ("_compute_old_log_prob", "_compute_advantage", "_compute_metrics")}
    function = trainer_base.compute_advantage_for_multi_trajectories
    proxy = trainer_base.compute_variance_proxy_metrics
    monkeypatch.setenv("OTB_VERL_V1_TRAINER", "yes")
    installation = otb_verl.install_from_environment()
    assert installation.options()["v1_trainer"] is True and not installation.unavailable
    for name, original in originals.items():
        assert trainer.__dict__[name] is not original and trainer.__dict__[name].__wrapped__ is original
        assert f"verl.trainer.ppo.v1.trainer_base.PPOTrainer.{name}" in installation.places
    for module in (trainer_base, v1_utils):
        assert module.compute_advantage_for_multi_trajectories.__wrapped__ is function
        assert f"{module.__name__}.compute_advantage_for_multi_trajectories" in installation.places
    assert trainer_base.compute_variance_proxy_metrics.__wrapped__ is proxy
    otb_verl.uninstall()
    assert all(trainer.__dict__[name] is original for name, original in originals.items())
    assert trainer_base.compute_advantage_for_multi_trajectories is function
    assert v1_utils.compute_advantage_for_multi_trajectories is function
    assert trainer_base.compute_variance_proxy_metrics is proxy
    # a Ray worker where verl's v1 trainer does not import: nothing patched there, the reason listed
    monkeypatch.setitem(sys.modules, "verl.trainer.ppo.v1.trainer_base", None)
    with otb_verl.install(v1_trainer=True) as elsewhere:
        assert elsewhere.unavailable == ["verl.trainer.ppo.v1.trainer_base.PPOTrainer: cannot be imported here "
                                         "(ModuleNotFoundError('import of verl.trainer.ppo.v1.trainer_base halted; "
                                         "None in sys.modules'))"]
        assert all(trainer.__dict__[name] is original for name, original in originals.items())
