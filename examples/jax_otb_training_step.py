"""A policy-gradient training step in pure JAX with OTB advantages computed inside the same ``jax.jit``.

    python examples/jax_otb_training_step.py                 # a few steps of OTB, then of leave-one-out OTB

The policy is a bigram language model over a small vocabulary: the logits of token t are zₜ = W[yₜ₋₁] + b, with y₋₁
the prompt token. Each step

1. samples G prompts × N responses (``rollout``, jitted: a ``lax.scan`` that stops a row at its first EOS, so rows
   have different lengths and are right-padded), rewards 1 at the last token of a response that contains the prompt's
   target token;
2. maps the prompts' string uids to segment ids once on the host (``otb_jax.segment_ids``) and fixes the static segment
   count to the batch size B, so the step compiles once for every batch of the same shape;
3. runs ``train_step`` (one ``jax.jit``): logits → log π(y) and Σπ² (``otb_jax.token_statistics_from_logits``) →
   advantages Aₜ = (Gₜ − Bₜ)·mₜ (``otb_jax.optimal_token_baseline`` or ``leave_one_out_token_baseline``) →
   the token-mean policy-gradient loss L(θ) = −Σ mₜ·Aₜ·log π_θ(yₜ) / Σ mₜ → ``jax.grad`` → an SGD update.

The advantages are computed from the logits without gradient (``stop_gradient``): Bₜ is a baseline, not a function
the loss differentiates. tests/test_jax_training_step.py checks the advantages inside the step against the NumPy
reference.
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

import otb_jax

__all__ = ["VOCAB", "EOS", "Batch", "StepOutput", "init_params", "rollout", "make_batch", "train_step", "train",
           "main"]

VOCAB = 16
EOS = 0


class Batch(NamedTuple):
    """One batch of B = G·N responses of T tokens; ``group_ids`` stays on the host (strings), the rest are arrays."""

    prompts: jax.Array           # [B] int32, the token each response continues
    tokens: jax.Array            # [B, T] int32, sampled tokens (anything after EOS is padding)
    response_mask: jax.Array     # [B, T] float32, 1 up to and including the first EOS
    rewards: jax.Array           # [B, T] float32, the score at the last valid token
    segment_ids: jax.Array       # [B] int32, from otb_jax.segment_ids(group_ids)
    group_ids: np.ndarray        # [B] object, the prompts' uids


class StepOutput(NamedTuple):
    """What ``train_step`` computed: the loss, and the inputs and outputs of the OTB call inside it."""

    loss: jax.Array              # []
    log_probs: jax.Array         # [B, T] log π(yₜ)
    sum_pi_squared: jax.Array    # [B, T] Σπ²ₜ
    advantages: jax.Array        # [B, T]
    logits: jax.Array            # [B, T, V]


def init_params(key: jax.Array) -> dict[str, jax.Array]:
    """W [V, V] small random, b [V] with a bias towards EOS (responses of ~6 tokens on average)."""
    return {"w": 0.3 * jax.random.normal(key, (VOCAB, VOCAB), dtype=jnp.float32),
            "b": jnp.zeros(VOCAB, dtype=jnp.float32).at[EOS].set(1.0)}


def _logits(params: dict[str, jax.Array], prompts: jax.Array, tokens: jax.Array) -> jax.Array:
    previous = jnp.concatenate([prompts[:, None], tokens[:, :-1]], axis=1)
    return params["w"][previous] + params["b"]


@partial(jax.jit, static_argnames=("length",))
def rollout(params: dict[str, jax.Array], key: jax.Array, prompts: jax.Array, length: int
            ) -> tuple[jax.Array, jax.Array]:
    """Sample ``length`` tokens per prompt; returns (tokens [B, T] int32, response_mask [B, T] float32)."""

    def step(carry, step_key):
        previous, finished = carry
        token = jax.random.categorical(step_key, params["w"][previous] + params["b"]).astype(jnp.int32)
        return (token, finished | (token == EOS)), (token, ~finished)

    start = (prompts, jnp.zeros(prompts.shape, dtype=bool))
    _, (tokens, valid) = jax.lax.scan(step, start, jax.random.split(key, length))
    return tokens.T, valid.T.astype(jnp.float32)


def _targets(prompts: np.ndarray) -> np.ndarray:
    return 1 + (3 * prompts) % (VOCAB - 1)          # never EOS


def make_batch(params: dict[str, jax.Array], key: jax.Array, *, prompts: int = 8, responses: int = 6,
               length: int = 24) -> Batch:
    """G = ``prompts`` prompts × N = ``responses`` responses, shuffled (groups are not contiguous, as after verl's
    balance_batch), with string uids as group ids."""
    prompt_key, order_key, sample_key = jax.random.split(key, 3)
    prompt_tokens = np.asarray(jax.random.randint(prompt_key, (prompts,), 1, VOCAB), dtype=np.int32)
    uids = np.array([f"prompt-{i}-{token}" for i, token in enumerate(prompt_tokens)], dtype=object)
    order = np.asarray(jax.random.permutation(order_key, prompts * responses))
    row_prompts = np.repeat(prompt_tokens, responses)[order]
    group_ids = np.repeat(uids, responses)[order]
    tokens, mask = rollout(params, sample_key, jnp.asarray(row_prompts), length)
    tokens_host, mask_host = np.asarray(tokens), np.asarray(mask)
    solved = ((tokens_host == _targets(row_prompts)[:, None]) & (mask_host > 0)).any(axis=1)
    last = mask_host.sum(axis=1).astype(int) - 1
    rewards = np.zeros(mask_host.shape, dtype=np.float32)
    rewards[np.arange(len(last)), last] = solved
    segment_ids, _ = otb_jax.segment_ids(group_ids)
    return Batch(jnp.asarray(row_prompts), tokens, mask, jnp.asarray(rewards), jnp.asarray(segment_ids), group_ids)


@partial(jax.jit, static_argnames=("num_segments", "leave_one_out"))
def train_step(params: dict[str, jax.Array], prompts: jax.Array, tokens: jax.Array, response_mask: jax.Array,
               rewards: jax.Array, segment_ids: jax.Array, learning_rate: float | jax.Array, *, num_segments: int,
               leave_one_out: bool = False) -> tuple[dict[str, jax.Array], StepOutput]:
    """One jitted step: token statistics and OTB advantages from the current logits, the policy-gradient loss, its
    gradient and an SGD update θ ← θ − η∇L. ``num_segments`` (static) bounds the segment ids (e.g. B)."""
    logits = _logits(params, prompts, tokens)
    statistics = otb_jax.token_statistics_from_logits(jax.lax.stop_gradient(logits), tokens)
    estimator = otb_jax.leave_one_out_token_baseline if leave_one_out else otb_jax.optimal_token_baseline
    result = estimator(rewards, response_mask, segment_ids, num_segments, statistics.log_probs,
                       statistics.sum_pi_squared)
    advantages = jax.lax.stop_gradient(result.advantages)

    def loss_of(parameters: dict[str, jax.Array]) -> jax.Array:
        log_softmax = jax.nn.log_softmax(_logits(parameters, prompts, tokens), axis=-1)
        log_probs = jnp.take_along_axis(log_softmax, tokens[..., None], axis=-1)[..., 0]
        return -jnp.sum(response_mask * advantages * log_probs) / jnp.maximum(jnp.sum(response_mask), 1.0)

    loss, gradients = jax.value_and_grad(loss_of)(params)
    updated = jax.tree_util.tree_map(lambda value, gradient: value - learning_rate * gradient, params, gradients)
    return updated, StepOutput(loss, statistics.log_probs, statistics.sum_pi_squared, advantages, logits)


def train(steps: int = 3, *, seed: int = 0, leave_one_out: bool = False, learning_rate: float = 1.0
          ) -> list[tuple[Batch, StepOutput]]:
    """Run ``steps`` steps from fresh parameters; returns each step's batch and output (for inspection and tests)."""
    key = jax.random.PRNGKey(seed)
    key, init_key = jax.random.split(key)
    params = init_params(init_key)
    history = []
    for _ in range(steps):
        key, batch_key = jax.random.split(key)
        batch = make_batch(params, batch_key)
        params, output = train_step(params, batch.prompts, batch.tokens, batch.response_mask, batch.rewards,
                                    batch.segment_ids, learning_rate, num_segments=int(batch.prompts.shape[0]),
                                    leave_one_out=leave_one_out)
        history.append((batch, output))
    return history


def main() -> None:
    for leave_one_out in (False, True):
        name = "leave-one-out OTB" if leave_one_out else "OTB"
        for step, (batch, output) in enumerate(train(5, leave_one_out=leave_one_out)):
            print(f"{name:17s} step {step}: loss {float(output.loss):+.4f}, mean reward "
                  f"{float(batch.rewards.sum(axis=1).mean()):.3f}, mean length "
                  f"{float(batch.response_mask.sum(axis=1).mean()):.1f}")


if __name__ == "__main__":
    main()
