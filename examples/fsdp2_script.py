"""A plain FSDP2 training script that checkpoints and stops through `shardctl.train.api`.

    torchrun --standalone --nproc-per-node 2 examples/fsdp2_script.py --steps 20

Under shardctl (`entrypoint: examples/fsdp2_script.py`, `args: [--steps, "200"]`) the
checkpoint folder, every_steps, keep and resume come from the run's environment.
SIGTERM or SIGUSR2 to any rank: every rank saves the same step and exits 42; the next
start continues from that step, bit for bit as if it had never stopped.
"""

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F
from shardctl.train import api
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        qkv = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int, seq_len: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(seq_len, dim) * 0.02)
        self.blocks = nn.ModuleList(Block(dim, heads=4) for _ in range(layers))
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids) + self.pos[: ids.size(1)]
        for block in self.blocks:
            x = block(x)
        # The loss, not the logits: FSDP2 warns about a root module returning a view.
        return F.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())


def batch_for(step: int, rank: int, args: argparse.Namespace) -> torch.Tensor:
    """Sequences a + b·t (mod vocab): a function of (seed, step, rank), so a resumed run
    sees the batches an uninterrupted one would, with no loader position to save."""
    g = torch.Generator().manual_seed(args.seed * 1_000_003 + step * 1009 + rank)
    a = torch.randint(0, args.vocab, (args.batch_size, 1), generator=g)
    b = torch.randint(1, 8, (args.batch_size, 1), generator=g)
    return (a + b * torch.arange(args.seq_len + 1)) % args.vocab


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=5)
    p.add_argument("--checkpoint-dir", help="default: shardctl's, else runs/fsdp2-script/...")
    p.add_argument("--every-steps", type=int, help="default: the job spec's, else 100")
    args = p.parse_args()

    # First, so that a preemption signal during start-up is caught, not fatal.
    ckpt = api.Checkpointer.from_env(
        directory=args.checkpoint_dir,
        default_directory="runs/fsdp2-script/checkpoints",
        every_steps=args.every_steps,
        seed=args.seed,
    )
    env = api.init_distributed()  # gloo on CPU, NCCL on CUDA
    torch.manual_seed(args.seed)  # the same initial weights on every rank, then shard
    model = TinyLM(args.vocab, args.dim, args.layers, args.seq_len).to(env.device)
    mesh = init_device_mesh(env.device.type, (env.world_size,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)

    start = ckpt.resume(api.model_state(model, optimizer))  # 0 on a fresh start
    for step in range(start + 1, args.steps + 1):
        batch = batch_for(step, env.rank, args).to(env.device)
        loss = model(batch[:, :-1], batch[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if env.rank == 0 and (step % args.log_every == 0 or step == args.steps):
            print(f"step {step} loss {loss.item():.4f}", flush=True)
        ckpt.step_done(step)  # periodic save; on a signal: save, PREEMPTED, exit 42
    ckpt.finish(max(start, args.steps))  # final checkpoint and DONE
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
