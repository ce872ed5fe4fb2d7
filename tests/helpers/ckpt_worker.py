"""A tiny training loop that exercises CheckpointManager under torchrun.

    torchrun --standalone --nproc-per-node 2 tests/helpers/ckpt_worker.py \
        --dir CKPT --steps 12 --every 4 [--async] [--backend deepspeed --zero 2] \
        [--stop-after 6] [--resume auto|never|PATH] [--out result.json]

It trains a small MLP with dropout (so the RNG matters) on per-rank random data
drawn from a generator whose state is part of the trainer state, and writes
`--out`: the final weights' sha256 (full state dict gathered on rank 0), the
step it resumed from and the last loss.
"""

from __future__ import annotations

import argparse
import hashlib
import json

import torch
import torch.distributed as dist
from shardctl.orchestrator.spec import parse_spec
from shardctl.train.backends.deepspeed import DeepSpeedStateIO
from shardctl.train.backends.fsdp import DcpStateIO, ModelState, OptimizerState
from shardctl.train.checkpoint import (
    CheckpointManager,
    capture_rng,
    reseed_rng,
    restore_rng,
)
from torch import nn


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(torch.relu(self.fc(x)))


class Net(nn.Module):
    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


class Trainer:
    """Per-rank state: step, scheduler, data generator, RNG."""

    def __init__(self, seed: int, rank: int, world: int, scheduler) -> None:
        self.seed, self.rank, self.world = seed, rank, world
        self.step = 0
        self.scheduler = scheduler
        self.gen = torch.Generator().manual_seed(seed * 100 + rank)

    def state_dict(self):
        return {
            "step": self.step,
            "scheduler": self.scheduler.state_dict() if self.scheduler else None,
            "gen": self.gen.get_state(),
            "rng": capture_rng(),
        }

    def load_state_dict(self, sd):
        self.step = sd["step"]
        if self.scheduler is not None:
            self.scheduler.load_state_dict(sd["scheduler"])
        self.gen.set_state(sd["gen"])
        restore_rng(sd["rng"])

    def reshard(self, old_world: int, new_world: int) -> None:
        self.world = new_world
        self.gen = torch.Generator().manual_seed(self.seed * 100 + self.rank + 7919 * self.step)
        reseed_rng(self.seed, self.step, self.rank)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--every", type=int, default=4)
    ap.add_argument("--keep", type=int, default=2)
    ap.add_argument("--async", dest="async_", action="store_true")
    ap.add_argument("--backend", default="fsdp")
    ap.add_argument("--zero", type=int, default=3)
    ap.add_argument("--width", type=int, default=32)
    ap.add_argument("--depth", type=int, default=3)
    ap.add_argument("--stop-after", type=int, default=0)
    ap.add_argument("--resume", default="auto")
    ap.add_argument("--out", default="")
    ap.add_argument("--step-sleep", type=float, default=0.0)
    args = ap.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(1234)
    spec = parse_spec(
        {
            "name": "ckpt-test",
            "resources": {"procs_per_node": world},
            "strategy": {"backend": args.backend, "zero_stage": args.zero, "precision": "fp32"},
            "train": {
                "model": {"factory": "tests.helpers.ckpt_worker:Net"},
                "data": {"builtin": "python-stdlib"},
                "steps": args.steps,
            },
            "checkpoint": {
                "dir": args.dir,
                "every_steps": args.every,
                "keep": args.keep,
                "async": args.async_,
                "resume": args.resume,
            },
        }
    )
    model = Net(args.width, args.depth)
    engine = None
    if args.backend == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for layer in model.layers:
            fully_shard(layer)
        fully_shard(model)
        optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda s: 1.0 / (1 + 0.1 * s))
        train_model = model
    else:
        from shardctl.train.backends.deepspeed import import_deepspeed

        import_deepspeed()  # without the mlflow its autotuner imports (~3.5 s)
        import deepspeed

        optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda s: 1.0 / (1 + 0.1 * s))
        config = {
            "train_micro_batch_size_per_gpu": 16,
            "gradient_accumulation_steps": 1,
            "zero_optimization": {"stage": args.zero},
            "steps_per_print": 10**9,
        }
        engine, optim, _, sched = deepspeed.initialize(
            model=model, optimizer=optim, lr_scheduler=sched, config=config
        )
        train_model = engine
    trainer = Trainer(1234, rank, world, sched if engine is None else None)
    if engine is None:
        states = {"model": ModelState(model), "optim": OptimizerState(model, optim)}
        state_io: object = DcpStateIO(states, spec.strategy)
    else:
        state_io = DeepSpeedStateIO(engine, spec.strategy)
    mgr = CheckpointManager(
        spec.checkpoint,
        state_io,
        rank=rank,
        world_size=world,
        model_meta={"source": "factory", "dtype": "fp32"},
    )
    resumed = mgr.restore(trainer)
    trainer.step = resumed or 0
    restored_hash = weights_hash(model, engine, args.zero)
    loss_val = None
    losses: list[float] = []
    while trainer.step < args.steps:
        x = torch.randn(16, args.width, generator=trainer.gen)
        y = x[:, :4].sum(dim=1, keepdim=True)
        loss = ((train_model(x) - y) ** 2).mean()
        if engine is None:
            loss.backward()
            optim.step()
            sched.step()
            optim.zero_grad()
        else:
            engine.backward(loss)
            engine.step()
        loss_val = loss.item()
        losses.append(loss_val)
        trainer.step += 1
        if args.step_sleep:
            import time

            time.sleep(args.step_sleep)
        if trainer.step % args.every == 0 and trainer.step < args.steps:
            mgr.save(trainer.step, trainer)
        if args.stop_after and trainer.step == args.stop_after:
            mgr.close()
            stop_hash = weights_hash(model, engine, args.zero)
            if rank == 0 and args.out:
                with open(args.out, "w") as f:
                    json.dump({"sha256": stop_hash, "step": trainer.step, "losses": losses}, f)
            dist.barrier()
            dist.destroy_process_group()
            return 0
    mgr.save(trainer.step, trainer, final=True)
    mgr.close()

    final_hash = weights_hash(model, engine, args.zero)
    if rank == 0 and args.out:
        with open(args.out, "w") as f:
            json.dump(
                {
                    "sha256": final_hash,
                    "restored_sha256": restored_hash,
                    "resumed": resumed,
                    "loss": loss_val,
                    "losses": losses,
                    "world_size": world,
                },
                f,
            )
    dist.barrier()
    dist.destroy_process_group()
    return 0


def weights_hash(model: nn.Module, engine, zero: int) -> str:
    """sha256 of the full (unsharded) fp32 weights; a collective."""
    if engine is None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        full = get_model_state_dict(
            model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
    else:
        if zero == 3:
            from deepspeed.runtime.zero.partition_parameters import GatheredParameters

            with GatheredParameters(list(engine.module.parameters()), modifier_rank=None):
                full = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
        else:
            full = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    h = hashlib.sha256()
    for k in sorted(full):
        h.update(k.encode())
        h.update(full[k].float().contiguous().numpy().tobytes())
    return h.hexdigest()


if __name__ == "__main__":
    from shardctl.train.leave import leave

    leave(main())  # not the interpreter's teardown of gloo: see shardctl.train.leave
