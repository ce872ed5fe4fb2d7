"""A Hugging Face Trainer script that shardctl can preempt and resume.

    torchrun --standalone --nproc-per-node 2 examples/hf_trainer_script.py --max-steps 20
    accelerate launch --multi_gpu --num_processes 2 examples/hf_trainer_script.py --max-steps 20

(`--multi_gpu` on a machine without GPUs starts 2 CPU ranks on gloo; `--cpu` alone
starts one process: see "Your own Hugging Face Trainer script" in
docs/guides/own-script.md.) Under shardctl (`entrypoint: examples/hf_trainer_script.py`,
`args: [--max-steps, "200"]`) the checkpoints go to `$SHARDCTL_CHECKPOINT_DIR`, else
`$SHARDCTL_RUN_DIR/checkpoints`; outside it give `--output-dir`. SIGTERM or SIGUSR2 to
any rank: every rank saves the same step and exits 42; the next start continues from
that step.

The model is a tiny GPT-2 built from its config (nothing is downloaded) and the data
are the bytes of a few Python standard-library files, one token per byte.
"""

import argparse
import os
import sys
from pathlib import Path

import torch
from shardctl.train.hf import PreemptionCallback, last_complete_checkpoint
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments


class ByteBlocks(torch.utils.data.Dataset):
    """Fixed-length blocks of bytes; GPT-2 shifts the labels itself."""

    def __init__(self, data: bytes, block: int) -> None:
        ids = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
        self.blocks = ids[: len(ids) // block * block].view(-1, block)

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.blocks[i], "labels": self.blocks[i]}


def stdlib_bytes(limit: int) -> bytes:
    # Sorted names: every rank and every restart reads the same corpus.
    files = sorted(Path(os.__file__).parent.glob("*.py"))
    out = bytearray()
    for f in files:
        out += f.read_bytes()
        if len(out) >= limit:
            break
    return bytes(out[:limit])


def default_output_dir() -> str | None:
    if os.environ.get("SHARDCTL_CHECKPOINT_DIR"):
        return os.environ["SHARDCTL_CHECKPOINT_DIR"]
    if os.environ.get("SHARDCTL_RUN_DIR"):
        return os.path.join(os.environ["SHARDCTL_RUN_DIR"], "checkpoints")
    return None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--output-dir", default=default_output_dir(), help="checkpoint-N folders")
    p.add_argument("--max-steps", type=int, default=20)
    p.add_argument("--save-steps", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=4, help="per rank")
    p.add_argument("--block", type=int, default=64, help="tokens per sequence")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if args.output_dir is None:
        p.error("--output-dir is required outside shardctl (no SHARDCTL_RUN_DIR)")

    config = GPT2Config(
        vocab_size=256, n_positions=args.block, n_embd=64, n_layer=2, n_head=4,
        bos_token_id=None, eos_token_id=None,  # GPT-2's 50256 is outside 256 bytes
    )  # fmt: skip
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    model = GPT2LMHeadModel(config)
    data = ByteBlocks(stdlib_bytes(1 << 20), args.block)

    training_args = TrainingArguments(
        output_dir=args.output_dir,
        max_steps=args.max_steps,
        per_device_train_batch_size=args.batch_size,
        learning_rate=args.lr,
        warmup_steps=min(10, args.max_steps // 10),
        logging_steps=1,
        save_steps=args.save_steps,
        save_total_limit=2,
        seed=args.seed,
        report_to="none",
        disable_tqdm=True,  # one printed line per logged step; bars garble rank logs
        dataloader_num_workers=0,
        # Without it accelerate runs each CPU rank as a lone process (it looks for
        # GPUs under torchrun); with it the ranks form one gloo group.
        use_cpu=not torch.cuda.is_available(),
        ddp_find_unused_parameters=False,  # GPT-2 uses every parameter every step
    )
    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=data,
        callbacks=[PreemptionCallback()],  # shardctl line 1: stop signals → save, exit 42
    )
    # shardctl line 2: resume from the newest checkpoint that was completely saved.
    resume = last_complete_checkpoint(args.output_dir)
    if trainer.is_world_process_zero():
        print(f"resuming from {resume}" if resume else "starting from scratch", flush=True)
    result = trainer.train(resume_from_checkpoint=resume)
    if trainer.is_world_process_zero():
        print(f"finished at step {result.global_step}", flush=True)
    trainer.save_model()  # the final model, beside the checkpoints
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()  # the Trainer leaves its group up
    sys.exit(0)


if __name__ == "__main__":
    main()
