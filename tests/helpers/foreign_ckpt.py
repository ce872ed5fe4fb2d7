"""Write a checkpoint the way a user's own tool writes it, for the foreign-format tests.

Run under torchrun (2 CPU ranks, gloo). Trains a tiny Llama for a few steps and saves
with the tool named by --tool, exactly through that tool's own API:

- `accelerate-ds`: `Accelerator(deepspeed_plugin=...)` + `accelerator.save_state(OUT)`
- `trainer-ds`:    the HF Trainer with `deepspeed=` (its `OUT/checkpoint-N/`)
- `trainer`:       the HF Trainer in one process without DeepSpeed (run it with python,
  not torchrun): `checkpoint-N/` with `model.safetensors` and `optimizer.pt`
- `fsdp2`:         a plain FSDP2 script saving the same state twice:
  `dcp.save({"model": ..., "optim": ...}, OUT/dcp)`, and accelerate's sharded FSDP
  layout in `OUT/accelerate-fsdp` (`pytorch_model_fsdp_0/` holding {"model": ...},
  `optimizer_0/` holding {"optimizer": ...}, as `accelerate.utils.save_fsdp_model` and
  `save_fsdp_optimizer` write them; accelerate's own FSDP plugin needs a GPU).

    torchrun --nproc-per-node 2 tests/helpers/foreign_ckpt.py --tool trainer-ds \
        --zero-stage 3 --out DIR
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist

VOCAB = 256


def tiny_model():  # type: ignore[no-untyped-def]
    # train_run.TINY_LLAMA's shape, so the built-in loop can resume a conversion of it.
    from consolidate_util import tiny_llama

    return tiny_llama(
        seed=0, vocab_size=VOCAB, intermediate_size=64, num_key_value_heads=4,
        max_position_embeddings=64,
    ).train()  # fmt: skip


def batch(step: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, VOCAB, (2, 16), generator=g)


def accelerate_deepspeed(args: argparse.Namespace) -> None:
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin

    plugin = DeepSpeedPlugin(zero_stage=args.zero_stage, gradient_accumulation_steps=1)
    plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = 2
    plugin.deepspeed_config["train_batch_size"] = 4
    accelerator = Accelerator(deepspeed_plugin=plugin, mixed_precision=args.precision)
    model = tiny_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    for step in range(args.steps):
        x = batch(step, dist.get_rank())
        loss = model(input_ids=x, labels=x).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    accelerator.save_state(args.out)
    accelerator.wait_for_everyone()


def trainer(args: argparse.Namespace) -> None:
    from transformers import Trainer, TrainingArguments

    class Tokens(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 64

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            x = torch.randint(0, VOCAB, (16,), generator=torch.Generator().manual_seed(i))
            return {"input_ids": x, "labels": x}

    ds_config = {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "zero_optimization": {"stage": args.zero_stage},
    }
    if args.tool == "trainer":  # one process, no DeepSpeed: model.safetensors + optimizer.pt
        ds_config = None
    training = TrainingArguments(
        output_dir=args.out,
        per_device_train_batch_size=2,
        max_steps=args.steps,
        save_steps=args.steps // 2,
        logging_steps=1,
        deepspeed=ds_config,
        report_to=[],
        dataloader_num_workers=0,
        seed=0,
        disable_tqdm=True,
    )
    trainer = Trainer(model=tiny_model(), args=training, train_dataset=Tokens())
    # --resume: the Trainer's own resume (its DeepSpeed loader, trainer state, scheduler
    # and RNG files); the losses it logs go to OUT/log.json.
    trainer.train(resume_from_checkpoint=args.resume)
    if args.resume and (not dist.is_initialized() or dist.get_rank() == 0):
        losses = {e["step"]: e["loss"] for e in trainer.state.log_history if "loss" in e}
        (Path(args.out) / "log.json").write_text(json.dumps(losses))


def fsdp2_tiny_model():  # type: ignore[no-untyped-def]
    """This rank in the gloo group; the tiny model under FSDP2 (each layer, then the
    whole), and its AdamW."""
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo")
    model = tiny_model()
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def fsdp2(args: argparse.Namespace) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, optimizer = fsdp2_tiny_model()
    rank = dist.get_rank()
    for step in range(args.steps):
        x = batch(step, rank)
        model(input_ids=x, labels=x).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    # The same trained state in both layouts, so one run serves both tests.
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=os.path.join(args.out, "dcp"))
    accelerate = os.path.join(args.out, "accelerate-fsdp")
    dcp.save({"model": model_sd}, checkpoint_id=os.path.join(accelerate, "pytorch_model_fsdp_0"))
    dcp.save({"optimizer": optim_sd}, checkpoint_id=os.path.join(accelerate, "optimizer_0"))
    accelerate_full_state_dict(model, optimizer, os.path.join(args.out, "accelerate-fsdp-full"))
    dist.barrier()
    dist.destroy_process_group()


def accelerate_full_state_dict(model, optimizer, out: str) -> None:  # type: ignore[no-untyped-def]
    """accelerate's default FSDP layout (`state_dict_type: FULL_STATE_DICT`), written by
    accelerate's own `save_fsdp_model` / `save_fsdp_optimizer`: rank 0 torch.saves the
    full model to `pytorch_model_fsdp.bin` and the full optimizer to `optimizer.bin`.
    The accelerator they are given is a stand-in with what they read of it (its FSDP
    plugin needs a GPU to be prepared)."""
    from types import SimpleNamespace

    from accelerate import PartialState
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.fsdp_utils import save_fsdp_model, save_fsdp_optimizer

    PartialState()  # accelerate's logging asks it which process this is
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type="FULL_STATE_DICT")
    accelerator = SimpleNamespace(
        num_processes=dist.get_world_size(), process_index=dist.get_rank()
    )
    save_fsdp_model(plugin, accelerator, model, out)
    save_fsdp_optimizer(plugin, accelerator, optimizer, model, out)


def no_shm_comm() -> None:
    """DeepSpeed's CPU accelerator would build (30-60 s) and use its shared-memory
    collectives; gloo is what the rest of the suite uses (as the DeepSpeed backend does)."""
    from shardctl.train.backends.deepspeed import extensions_dir, import_deepspeed

    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(extensions_dir()))
    import_deepspeed()
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tool", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--zero-stage", type=int, default=2)
    parser.add_argument("--precision", default="no", choices=["no", "bf16"])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--resume", default=None)
    args = parser.parse_args()
    if args.tool == "accelerate-ds":
        no_shm_comm()
        accelerate_deepspeed(args)
    elif args.tool == "trainer-ds":
        no_shm_comm()
        trainer(args)
    elif args.tool == "trainer":
        trainer(args)
    else:
        fsdp2(args)


if __name__ == "__main__":
    from shardctl.train.leave import leave

    main()
    leave(0)  # not the interpreter's teardown of gloo: see shardctl.train.leave
