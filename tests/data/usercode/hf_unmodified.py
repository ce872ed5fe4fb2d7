"""A Hugging Face Trainer script as users write it, with nothing of shardctl: no
callback, no resume code (`trainer.train()` alone). A tiny GPT-2 built from its
config, the bytes of a few standard-library files as data, 2 CPU ranks on gloo.
Every rank prints `started at step N` when training begins (the Trainer's step).
`--hold-before-train DIR`: once the Trainer is built, every rank writes
`DIR/ready-<rank>` (its pid) and waits for `DIR/go` before `train()` (at most 120 s),
so that a test's signal lands while the script is still being set up."""

import argparse
import os
import sys
import time
from pathlib import Path

import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)


class Blocks(torch.utils.data.Dataset):
    def __init__(self, data: bytes, block: int) -> None:
        ids = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
        self.blocks = ids[: len(ids) // block * block].view(-1, block)

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.blocks[i], "labels": self.blocks[i]}


class SayWhereItStarts(TrainerCallback):
    """Not about resuming: it prints the step training began at, and paces the steps
    (`--pause` seconds each) so that a test's cancel lands before the last step."""

    def __init__(self, pause: float) -> None:
        self.pause = pause

    def on_train_begin(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            print(f"started at step {state.global_step}", flush=True)

    def on_step_end(self, args, state, control, **kwargs):
        time.sleep(self.pause)


def hold(folder: Path) -> None:
    rank = os.environ.get("RANK", "0")
    (folder / f"ready-{rank}.tmp").write_text(str(os.getpid()))
    (folder / f"ready-{rank}.tmp").rename(folder / f"ready-{rank}")  # whole when seen
    deadline = time.monotonic() + 120
    while not (folder / "go").exists() and time.monotonic() < deadline:
        time.sleep(0.05)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--output-dir", required=True)
    p.add_argument("--max-steps", type=int, default=40)
    p.add_argument("--save-steps", type=int, default=5)
    p.add_argument("--pause", type=float, default=0.0, help="seconds after each step")
    p.add_argument("--hold-before-train", type=Path, default=None)
    args = p.parse_args()
    files = sorted(Path(os.__file__).parent.glob("*.py"))[:20]
    data = Blocks(b"".join(f.read_bytes() for f in files)[: 1 << 19], 32)
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=256, n_positions=32, n_embd=32, n_layer=1, n_head=2,
        bos_token_id=None, eos_token_id=None,
    )  # fmt: skip
    training_args = TrainingArguments(
        output_dir=args.output_dir,
        max_steps=args.max_steps,
        per_device_train_batch_size=4,
        logging_steps=1,
        save_steps=args.save_steps,
        save_total_limit=2,
        report_to="none",
        disable_tqdm=True,
        use_cpu=True,
        ddp_find_unused_parameters=False,
    )
    trainer = Trainer(
        model=GPT2LMHeadModel(config), args=training_args, train_dataset=data,
        callbacks=[SayWhereItStarts(args.pause)],
    )  # fmt: skip
    if args.hold_before_train is not None:
        hold(args.hold_before_train)
    result = trainer.train()
    if trainer.is_world_process_zero():
        print(f"finished at step {result.global_step}", flush=True)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    sys.exit(0)


if __name__ == "__main__":
    main()
