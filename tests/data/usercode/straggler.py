"""A user's training loop on `shardctl.train.api` whose rank 1 is a straggler: after
each optimizer step it sleeps `--sleep` seconds (a slow host, a noisy neighbour)
before `step_done`. Logs the loss every `--log-every` steps through `log_metrics`.

    torchrun --nproc-per-node 2 straggler.py --steps 12 --log-every 2 --sleep 0.15
"""

import argparse
import time

import torch
import torch.distributed as dist
from shardctl.train import api
from torch import nn
from torch.nn.parallel import DistributedDataParallel


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--log-every", type=int, default=2)
    p.add_argument("--sleep", type=float, default=0.15)
    p.add_argument("--slow-rank", type=int, default=1)
    args = p.parse_args()

    ckpt = api.Checkpointer.from_env()
    env = api.init_distributed("cpu")
    torch.manual_seed(0)
    # DDP: the gradient all-reduce in backward makes the ranks wait for each other
    # inside the model's own collective, as real training does.
    model = DistributedDataParallel(nn.Linear(16, 16))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    start = ckpt.resume(api.model_state(model, optimizer))
    for step in range(start + 1, args.steps + 1):
        g = torch.Generator().manual_seed(step * 1009 + env.rank)
        loss = model(torch.randn(8, 16, generator=g)).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if env.rank == args.slow_rank:
            time.sleep(args.sleep)
        ckpt.step_done(step)
        if step % args.log_every == 0:
            api.log_metrics(step, loss=loss.item())
    ckpt.finish(args.steps)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
