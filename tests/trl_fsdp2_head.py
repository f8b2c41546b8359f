"""TRL 1.16's fused LM head on FSDP2: is lm_head's gradient reduced over the ranks? A rank of a gloo world on the CPU.

Run by tests/test_trl_integration.py::test_trls_fused_head_leaves_the_gradient_of_an_fsdp2_head_unit_unreduced as
two processes::

    python tests/trl_fsdp2_head.py RANK WORLD PORT

TRL's ``add_fused_lm_head`` (trl/trainer/utils.py:1548) makes ``model(..., fused_lm_head=True)`` — the call GRPO's
``_get_per_token_logps_and_entropies`` makes (grpo_trainer.py:1498), and so ``OTBGRPOTrainer`` — project the hidden
states through the head in tiles. Where the head's weight is an FSDP2 DTensor it takes ``weight.full_tensor()``
(utils.py:1633–1639), whose gradient no rank reduces over the others. A tiny random Qwen2 (untied head) in float32 is
wrapped with ``fully_shard`` per decoder layer and at the root, the head in the root unit, in a unit of its own (as
accelerate's size-based wrap gives a large head), or in one with the final norm and ``reshard_after_forward=False``
(accelerate 1.15's own layout, ``accelerate/utils/fsdp_utils.py:857–879``: the norm's forward gathers the unit, so TRL
reads a whole weight); each rank runs its rows, loss −Σ log π / N × P (its share of the batch mean, × P for FSDP2's
average), backward. Against float64 gradients of the same model — the whole batch's (what data parallelism should give)
and the unreduced one (each rank's shard of the head P × its own rows' gradient) — each rank prints, per placement, the
head gradient's distance to both, and a decoder layer's distance to the whole batch's (FSDP2 reduces the layers'
gradients: the harness's scaling is right), and whether ``OTBGRPOTrainer``'s guard
(``otb_torch.trl._unreduced_head_guard`` around the forward, as the trainer runs it) refuses the model.
"""

from __future__ import annotations

import datetime
import os
import sys

import torch
import torch.distributed as dist

ROWS, LENGTH, VOCAB = 4, 12, 300


def main(rank: int, world: int, port: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    import transformers
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from trl.trainer.utils import add_fused_lm_head

    import otb_torch.trl as otb_trl

    config = transformers.Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    state = transformers.Qwen2ForCausalLM(config).float().state_dict()
    ids = torch.randint(0, VOCAB, (ROWS, LENGTH), generator=torch.Generator().manual_seed(1))
    tokens = ROWS * (LENGTH - 1)                 # labels shifted by one: every position but the last is scored

    def gradients(rows, scale, dtype):
        """The head's and the first layer's up-projection gradients of −Σ log π(rows) / N × scale (no FSDP)."""
        model = transformers.Qwen2ForCausalLM(config).to(dtype)
        model.load_state_dict(state)
        add_fused_lm_head(model, temperature=1.0)
        output = model(input_ids=rows, labels=rows, fused_lm_head=True)
        (-output.log_probs.sum() / tokens * scale).backward()
        return model.lm_head.weight.grad, model.model.layers[0].mlp.up_proj.weight.grad

    whole = gradients(ids, 1.0, torch.float64)
    per_rank = [gradients(part, float(world), torch.float64) for part in ids.chunk(world)]
    shard = VOCAB // world                       # FSDP2 shards the head's rows evenly here (300 = 2 × 150)
    unreduced_head = torch.cat([per_rank[r][0][r * shard:(r + 1) * shard] for r in range(world)])

    mesh = init_device_mesh("cpu", (world,))
    for placement in ("root unit", "own unit", "final norm's unit"):
        model = transformers.Qwen2ForCausalLM(config).float()
        model.load_state_dict(state)
        add_fused_lm_head(model, temperature=1.0)
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        if placement == "own unit":
            fully_shard(model.lm_head, mesh=mesh)
        elif placement == "final norm's unit":       # accelerate 1.15's layout (accelerate/utils/fsdp_utils.py:870–879)
            fully_shard([model.model.norm, model.lm_head], mesh=mesh, reshard_after_forward=False)
        fully_shard(model, mesh=mesh)
        mine = ids.chunk(world)[rank]
        try:                                         # the forward as OTBGRPOTrainer makes it, with its guard
            with otb_trl._unreduced_head_guard(model):
                output = model(input_ids=mine, labels=mine, fused_lm_head=True)
            refused = "not refused"
        except ValueError as exc:
            refused = "refused" if str(exc).startswith("model: its LM head's weight is still sharded") else repr(exc)
            output = model(input_ids=mine, labels=mine, fused_lm_head=True)      # as GRPOTrainer makes it
        print(f"rank {rank}: {placement}: OTBGRPOTrainer {refused}", flush=True)
        (-output.log_probs.sum() / tokens * world).backward()
        head = model.lm_head.weight.grad.full_tensor().double()
        layer = model.model.layers[0].mlp.up_proj.weight.grad.full_tensor().double()
        print(f"rank {rank}: {placement}: head gradient max|Δ| to the reduced "
              f"{(head - whole[0]).abs().max().item():.3e}, to the unreduced "
              f"{(head - unreduced_head).abs().max().item():.3e}; layer gradient max|Δ| to the reduced "
              f"{(layer - whole[1]).abs().max().item():.3e} of max {whole[1].abs().max().item():.3e}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
