"""Make a real sharded checkpoint in the shardctl layout, for the consolidation tests.

Run under torchrun (gloo, CPU). Trains a tiny Llama for a few steps with FSDP2 (saved
with torch.distributed.checkpoint) or DeepSpeed ZeRO 1/2/3 (engine.save_checkpoint),
writes `manifest.json` as the checkpoint contract defines it, and saves the logits of
the trained model on a fixed batch (`reference.pt`, rank 0) so a test can compare the
consolidated model against the model whose state was saved.

    torchrun --nproc-per-node 2 tests/helpers/consolidate_make_ckpt.py \
        --backend fsdp --out RUN/checkpoints/step-00000003
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
import torch.distributed as dist


def tiny_config(tied: bool, hidden: int, layers: int, vocab: int):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab,  # odd on purpose: FSDP's dim-0 shards are uneven
        hidden_size=hidden,
        intermediate_size=hidden * 2 + 8,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
    )


def write_manifest(step_dir: Path, args, world: int, config) -> None:
    """The manifest through shardctl's own writer (`train/manifest.py`)."""
    from shardctl.train.backends.deepspeed import import_deepspeed

    import_deepspeed()  # without the mlflow its autotuner imports (~3.5 s)
    import deepspeed
    from shardctl.train import manifest as contract

    files = contract.describe_files(step_dir, contract.list_files(step_dir))
    manifest = {
        "format_version": 1,
        "step": args.steps,
        "world_size": world,
        "backend": args.backend,
        "sharding": "full_shard" if args.backend == "fsdp" else None,
        "zero_stage": args.zero_stage if args.backend == "deepspeed" else 3,
        "precision": "fp32" if args.precision == "fp32" else "bf16-mixed",
        "model": {"source": "llama", "dtype": "fp32", "hf_config": config.to_dict()},
        "versions": {
            "torch": torch.__version__,
            "shardctl": "0.1.0",
            "deepspeed": deepspeed.__version__ if args.backend == "deepspeed" else None,
        },
        "files": files,
    }
    contract.write_manifest(step_dir, manifest)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--backend", choices=["fsdp", "deepspeed"], required=True)
    p.add_argument("--zero-stage", type=int, default=3)
    p.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--tied", action="store_true")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=259)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--out", type=Path, required=True, help="the final step-NNNNNNNN dir")
    p.add_argument("--no-reference", action="store_true")
    p.add_argument("--sub-group-size", type=int, default=None, help="ZeRO-3 sub_group_size")
    p.add_argument(
        "--moments", type=Path, default=None, help="save DeepSpeed's full per-parameter Adam state"
    )
    args = p.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    from transformers import LlamaForCausalLM

    config = tiny_config(args.tied, args.hidden, args.layers, args.vocab)
    model = LlamaForCausalLM(config)
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, args.vocab, (2, 16), generator=gen) for _ in range(args.steps)]
    probe = torch.randint(0, args.vocab, (2, 16), generator=gen)

    tmp = args.out.with_name(args.out.name + ".tmp")
    if args.backend == "fsdp":
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import (
            get_model_state_dict,
            get_optimizer_state_dict,
        )
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mp = (
            MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            if args.precision == "bf16"
            else MixedPrecisionPolicy()
        )
        for layer in model.model.layers:
            fully_shard(layer, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for ids in batches:
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
        model.eval()
        with torch.no_grad():
            logits = model(input_ids=probe).logits.float()
        state = {
            "model": get_model_state_dict(model),
            "optim": get_optimizer_state_dict(model, opt),
        }
        dcp.save(state, checkpoint_id=str(tmp / "dcp"))
    else:
        from shardctl.train.backends.deepspeed import import_deepspeed

        import_deepspeed()  # without the mlflow its autotuner imports (~3.5 s)
        import deepspeed

        ds_config = {
            "train_micro_batch_size_per_gpu": 2,
            "gradient_accumulation_steps": 1,
            "zero_optimization": {"stage": args.zero_stage}
            | ({"sub_group_size": args.sub_group_size} if args.sub_group_size else {}),
            "bf16": {"enabled": args.precision == "bf16"},
            "zero_allow_untested_optimizer": True,
            "steps_per_print": 10**9,
        }
        # Two param groups (no weight decay on 1-d tensors), as most recipes have.
        named = list(model.named_parameters())
        groups = [
            {"params": [t for _, t in named if t.dim() > 1], "weight_decay": 0.1},
            {"params": [t for _, t in named if t.dim() <= 1], "weight_decay": 0.0},
        ]
        opt = torch.optim.AdamW(groups, lr=1e-2)
        engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=ds_config)
        for ids in batches:
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
        engine.eval()
        with torch.no_grad():
            logits = engine(input_ids=probe).logits.float()
        engine.save_checkpoint(save_dir=str(tmp), tag="deepspeed")
        if args.moments is not None:
            from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

            full = {  # collectives under ZeRO-3: every rank asks for every parameter
                name: {
                    "fp32": safe_get_full_fp32_param(param),
                    "exp_avg": safe_get_full_optimizer_state(param, "exp_avg"),
                    "exp_avg_sq": safe_get_full_optimizer_state(param, "exp_avg_sq"),
                }
                for name, param in engine.module.named_parameters()
            }
            if rank == 0:
                torch.save(full, args.moments)

    (tmp / "train_state").mkdir(parents=True, exist_ok=True)
    torch.save({"rank": rank}, tmp / "train_state" / f"rank-{rank:05d}.pt")
    dist.barrier()
    if rank == 0:
        write_manifest(tmp, args, world, config)
        os.replace(tmp, args.out)
        if not args.no_reference:
            torch.save({"input_ids": probe, "logits": logits}, args.out.parent / "reference.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    from shardctl.train.leave import leave

    leave(main())  # not the interpreter's teardown of gloo: see shardctl.train.leave
