"""Resume a converted checkpoint the way the user's own tool loads it, and train on.

Run under torchrun (2 CPU ranks, gloo). Writes the losses of the steps trained after the
load to --losses (rank 0), for comparison with the uninterrupted run's:

- `accelerate-ds`: `Accelerator(deepspeed_plugin=...)`, `accelerator.load_state(CKPT)`.
- `accelerate-fsdp-layout`: a plain FSDP2 model loaded exactly as accelerate's
  `load_fsdp_model` / `load_fsdp_optimizer` load a sharded FSDP2 save (DCP into
  `{"model": get_model_state_dict}` from `pytorch_model_fsdp_0/`, into
  `{"optimizer": get_optimizer_state_dict}` from `optimizer_0/`, then set them);
  accelerate's own FSDP plugin needs a GPU.
- `uninterrupted`: accelerate + DeepSpeed from scratch, saving at --save-at into
  --ckpt and training on: the reference losses.

The batches and the model are those of foreign_ckpt.py (same seeds, same steps).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
from foreign_ckpt import batch, fsdp2_tiny_model, no_shm_comm, tiny_model


def _accelerator(zero_stage: int):  # type: ignore[no-untyped-def]
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin

    plugin = DeepSpeedPlugin(zero_stage=zero_stage, gradient_accumulation_steps=1)
    plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = 2
    plugin.deepspeed_config["train_batch_size"] = 4
    return Accelerator(deepspeed_plugin=plugin, mixed_precision="no")


def _train(model, optimizer, backward, first: int, last: int, rank: int) -> dict[int, float]:  # type: ignore[no-untyped-def]
    losses: dict[int, float] = {}
    for step in range(first, last):
        x = batch(step, rank)
        loss = model(input_ids=x, labels=x).loss
        backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses[step] = mean.item() / dist.get_world_size()
    return losses


def accelerate_ds(args: argparse.Namespace) -> dict[int, float]:
    accelerator = _accelerator(args.zero_stage)
    model = tiny_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    rank = dist.get_rank()  # accelerate on CPU numbers every process 0
    if args.mode == "uninterrupted":
        _train(model, optimizer, accelerator.backward, 0, args.save_at, rank)
        accelerator.save_state(args.ckpt)
        accelerator.wait_for_everyone()
    else:
        accelerator.load_state(args.ckpt)
    return _train(model, optimizer, accelerator.backward, args.save_at, args.steps, rank)


def accelerate_fsdp_layout(args: argparse.Namespace) -> dict[int, float]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    model, optimizer = fsdp2_tiny_model()
    state = {"model": get_model_state_dict(model)}
    dcp.load(state, checkpoint_id=os.path.join(args.ckpt, "pytorch_model_fsdp_0"))
    set_model_state_dict(model, state["model"])
    optim = {"optimizer": get_optimizer_state_dict(model, optimizer)}
    dcp.load(optim, checkpoint_id=os.path.join(args.ckpt, "optimizer_0"))
    set_optimizer_state_dict(model, optimizer, optim["optimizer"])
    return _train(
        model, optimizer, lambda loss: loss.backward(), args.save_at, args.steps, dist.get_rank()
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", required=True)
    parser.add_argument("--ckpt", required=True)
    parser.add_argument("--losses", required=True)
    parser.add_argument("--zero-stage", type=int, default=2)
    parser.add_argument("--save-at", type=int, default=4)
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    if args.mode == "accelerate-fsdp-layout":
        losses = accelerate_fsdp_layout(args)
    else:
        no_shm_comm()
        losses = accelerate_ds(args)
    if dist.get_rank() == 0:
        Path(args.losses).write_text(json.dumps(losses))
    dist.barrier()


if __name__ == "__main__":
    from shardctl.train.leave import leave

    main()
    leave(0)  # not the interpreter's teardown of gloo: see shardctl.train.leave
