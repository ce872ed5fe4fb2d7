"""A user script on `shardctl.train.api` that runs until it is stopped (for tests).

Every rank trains a small replicated (plain) model, sleeping a little per step so a
signal lands mid-run; after step 3 each rank touches `<out>/started-<rank>`. When
the library stops the run (`api.Preempted`), each rank records the step it stopped
at in `<out>/rank-<rank>.json` and lets the exception exit the process (code 42).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from shardctl.train import api


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=100_000)
    args = p.parse_args()
    out = Path(args.out)

    ckpt = api.Checkpointer.from_env(every_steps=1000)
    env = api.init_distributed("cpu")
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    start = ckpt.resume(api.model_state(model, optimizer))
    try:
        for step in range(start + 1, args.steps + 1):
            model(torch.randn(4, 8)).pow(2).mean().backward()
            # Replicated training: average the gradients like DDP would.
            for param in model.parameters():
                torch.distributed.all_reduce(param.grad)
                param.grad /= env.world_size
            optimizer.step()
            optimizer.zero_grad()
            if step == start + 3:
                (out / f"started-{env.rank}").touch()
            time.sleep(0.05)
            ckpt.step_done(step)
    except api.Preempted as stop:
        (out / f"rank-{env.rank}.json").write_text(json.dumps({"step": stop.step}))
        raise
    ckpt.finish(args.steps)


if __name__ == "__main__":
    from shardctl.train.leave import leave

    leave(main())  # not the interpreter's teardown of gloo: see shardctl.train.leave
