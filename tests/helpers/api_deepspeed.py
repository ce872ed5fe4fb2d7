"""A one-rank DeepSpeed (ZeRO-1) user script on `shardctl.train.api` (for tests).

Trains a linear layer for --steps steps (data seeded by the step), checkpointing
through `api.deepspeed_state(engine)`, and writes the final weights to --out.
"""

from __future__ import annotations

import argparse

import torch
from shardctl.train import api
from shardctl.train.backends.deepspeed import _prepare_deepspeed


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=5)
    args = p.parse_args()

    ckpt = api.Checkpointer.from_env(directory=args.dir, every_steps=2)
    api.init_distributed("cpu")
    _prepare_deepspeed("cpu")  # no shared-memory op compiled on CPU
    import deepspeed

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": 1},
    }
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    start = ckpt.resume(api.deepspeed_state(engine))
    for step in range(start + 1, args.steps + 1):
        batch = torch.randn(2, 8, generator=torch.Generator().manual_seed(step))
        engine.backward(engine(batch).pow(2).mean())
        engine.step()
        ckpt.step_done(step)
    ckpt.finish(args.steps)
    torch.save(engine.module.state_dict(), args.out)


if __name__ == "__main__":
    from shardctl.train.leave import leave

    leave(main())  # not the interpreter's teardown of gloo: see shardctl.train.leave
