"""accelerate's and the HF Trainer's own FSDP checkpoints, written on a CUDA GPU by the
tools' own FSDP2 code (which does not run on CPU), taken through shardctl.

    PYTHONUNBUFFERED=1 python3 benchmarks/gpu_foreign_fsdp.py --out DIR [--ds-story DIR2]

One GPU, one rank (torchrun --nproc-per-node 1, NCCL), a tiny Llama (eager attention,
fp32: the same GPU gives the same losses run after run). Each check prints one line,
`PASS` or `FAIL`, and the script exits 1 if any failed:

1. accelerate, `FullyShardedDataParallelPlugin(fsdp_version=2)`, for each
   `state_dict_type` (SHARDED, and FULL: accelerate's default): 4 steps,
   `accelerator.save_state()`, 4 more steps (the reference losses). Then
   `shardctl checkpoints` (format, step, world size, complete), `shardctl consolidate`
   (equal to `accelerator.get_state_dict(model)` at the save), and for SHARDED
   `convert --to deepspeed` and back `--to fsdp`: `accelerator.load_state()` of the
   round trip trains on with the reference's losses.
2. The project's story on the real plugin (`--ds-story DIR2`: an accelerate + DeepSpeed
   ZeRO-2 checkpoint made on 2 CPU ranks by tests/helpers/foreign_resume.py
   `--mode uninterrupted`, with its reference losses `ref.json`): `convert --to fsdp`,
   then `accelerator.load_state()` under the FSDP2 plugin on the GPU, one rank fed both
   CPU ranks' batches: its losses are the CPU run's to float tolerance.
3. The Trainer, `fsdp="full_shard"` (FSDP2), for each `state_dict_type`: 6 steps, a
   checkpoint every 3. `shardctl checkpoints` of the output dir, `consolidate` of
   checkpoint-3, and for SHARDED `convert` to DeepSpeed and back, then
   `Trainer.train(resume_from_checkpoint=...)` logs the uninterrupted run's losses.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 256
SAVE_AT, STEPS = 4, 8
RESULTS: list[tuple[str, bool, str]] = []


# ------------------------------------------------------------------ inside the rank


def tiny_model():  # type: ignore[no-untyped-def]
    """tests/helpers/foreign_ckpt.py's shape (the DeepSpeed story's checkpoint loads
    into it), eager attention: no kernel whose backward differs run to run."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
        tie_word_embeddings=False, attn_implementation="eager",
    )  # fmt: skip
    return LlamaForCausalLM(config).train()


def batch(step: int):  # type: ignore[no-untyped-def]
    """Both of foreign_ckpt.py's two CPU ranks' batches of `step`, stacked: one rank's
    mean loss and gradient are then the two ranks' averaged ones."""
    import torch

    parts = []
    for rank in (0, 1):
        g = torch.Generator().manual_seed(1000 * step + rank)
        parts.append(torch.randint(0, VOCAB, (2, 16), generator=g))
    return torch.cat(parts)


def _accelerator(state_dict: str):  # type: ignore[no-untyped-def]
    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2,
        state_dict_type=f"{state_dict.upper()}_STATE_DICT",
        auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=["LlamaDecoderLayer"],
        reshard_after_forward=True,
    )
    return Accelerator(fsdp_plugin=plugin, mixed_precision="no")


def _train(accelerator, model, optimizer, first: int, last: int) -> dict[int, float]:  # type: ignore[no-untyped-def]
    losses = {}
    for step in range(first, last):
        x = batch(step).to(accelerator.device)
        loss = model(input_ids=x, labels=x).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses[step] = loss.item()
    return losses


def acc_worker(args: argparse.Namespace) -> None:
    import torch
    from safetensors.torch import save_file

    accelerator = _accelerator(args.state_dict)
    model = tiny_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    kind = type(model).__name__
    if args.resume:
        accelerator.load_state(args.resume)
        losses = _train(accelerator, model, optimizer, args.save_at, args.steps)
    else:
        _train(accelerator, model, optimizer, 0, args.save_at)
        accelerator.save_state(os.path.join(args.out, f"checkpoint_{args.save_at}"))
        full = accelerator.get_state_dict(model)
        if accelerator.is_main_process:
            weights = {k: v.detach().cpu().contiguous() for k, v in full.items()}
            save_file(weights, os.path.join(args.out, "full.safetensors"))
        losses = _train(accelerator, model, optimizer, args.save_at, args.steps)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        Path(args.losses).write_text(json.dumps({"losses": losses, "model_class": kind}))
    accelerator.end_training()


def trainer_worker(args: argparse.Namespace) -> None:
    import torch
    from transformers import Trainer, TrainingArguments

    class Tokens(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 64

        def __getitem__(self, i: int) -> dict:
            x = torch.randint(0, VOCAB, (16,), generator=torch.Generator().manual_seed(i))
            return {"input_ids": x, "labels": x}

    training = TrainingArguments(
        output_dir=args.out, per_device_train_batch_size=2, max_steps=6, save_steps=3,
        logging_steps=1, report_to=[], dataloader_num_workers=0, seed=0, disable_tqdm=True,
        fsdp="full_shard",
        fsdp_config={"version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"],
                     "state_dict_type": f"{args.state_dict.upper()}_STATE_DICT"},
    )  # fmt: skip
    trainer = Trainer(model=tiny_model(), args=training, train_dataset=Tokens())
    trainer.train(resume_from_checkpoint=args.resume or None)
    if trainer.is_world_process_zero():
        log = {e["step"]: e["loss"] for e in trainer.state.log_history if "loss" in e}
        Path(args.losses).write_text(json.dumps({"losses": log}))


# ------------------------------------------------------------------ the driver


def check(name: str, ok: bool, detail: str = "") -> bool:
    RESULTS.append((name, ok, detail))
    print(f"{'PASS' if ok else 'FAIL'}  {name}{': ' + detail if detail else ''}", flush=True)
    return ok


def torchrun(*worker_args: str, timeout: int = 240) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
        "1", __file__, *worker_args,
    ]  # fmt: skip
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if res.returncode != 0:
        print(res.stdout[-3000:], res.stderr[-6000:], sep="\n", flush=True)
    return res


def shardctl(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "shardctl.orchestrator.cli", *args]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    print(f"$ shardctl {' '.join(args)}  → exit {res.returncode}", flush=True)
    if res.returncode != 0:
        print(res.stdout[-2000:], res.stderr[-3000:], sep="\n", flush=True)
    return res


def listed(path: Path) -> list[dict]:
    res = shardctl("checkpoints", "-o", "json", str(path))
    try:
        return json.loads(res.stdout)["checkpoints"]
    except (ValueError, KeyError):
        return []


def losses(path: Path) -> dict[int, float]:
    return {int(k): v for k, v in json.loads(path.read_text())["losses"].items()}


def same_weights(consolidated: Path, reference: Path) -> tuple[bool, str]:
    import torch
    from safetensors.torch import load_file

    got, want = load_file(consolidated), load_file(reference)
    if set(got) != set(want):
        return False, f"keys differ: only ours {sorted(set(got) - set(want))[:3]}, " \
                      f"only the reference {sorted(set(want) - set(got))[:3]}"  # fmt: skip
    bad = [k for k in want if not torch.equal(got[k].float(), want[k].float())]
    return not bad, f"{len(want)} tensors" + (f", differ: {bad[:3]}" if bad else ", bit for bit")


def accelerate_checks(out: Path, state_dict: str) -> None:
    root = out / f"accelerate-{state_dict}"
    root.mkdir(parents=True, exist_ok=True)
    ref_json = root / "ref.json"
    res = torchrun("--worker", "acc", "--state-dict", state_dict, "--out", str(root),
                   "--losses", str(ref_json))  # fmt: skip
    if not check(f"accelerate FSDP2 {state_dict}: train, save_state", res.returncode == 0):
        return
    meta = json.loads(ref_json.read_text())
    ckpt = root / f"checkpoint_{SAVE_AT}"
    files = sorted(p.name for p in ckpt.iterdir())
    print(f"  {meta['model_class']}; save_state wrote: {files}", flush=True)
    rows = listed(ckpt)
    row = rows[0] if rows else {}
    check(
          f"accelerate FSDP2 {state_dict}: `checkpoints` lists it",
          row.get("status") == "complete" and row.get("world_size") in (1, None),
          json.dumps({k: row.get(k) for k in ("format", "step", "world_size", "status")}),
    )  # fmt: skip
    res = shardctl("consolidate", str(ckpt), "--out", str(root / "model"), "--no-progress")
    if check(f"accelerate FSDP2 {state_dict}: `consolidate`", res.returncode == 0):
        ok, detail = same_weights(root / "model" / "model.safetensors", root / "full.safetensors")
        check(f"accelerate FSDP2 {state_dict}: consolidated = get_state_dict", ok, detail)
    if state_dict != "sharded":
        return
    # Round trip through shardctl's DeepSpeed writer, loaded by the real plugin.
    res = shardctl("convert", str(ckpt), "--to", "deepspeed", "--world-size", "1",
                   "--out", str(root / "ds"))  # fmt: skip
    res2 = shardctl("convert", str(root / "ds"), "--to", "fsdp", "--out", str(root / "back"))
    if not check("accelerate FSDP2: convert → deepspeed → fsdp",
                 res.returncode == 0 and res2.returncode == 0):  # fmt: skip
        return
    for name, folder in (("its own checkpoint", ckpt), ("the round trip", root / "back")):
        got_json = root / f"resumed-{folder.name}.json"
        res = torchrun("--worker", "acc", "--state-dict", state_dict, "--resume", str(folder),
                       "--losses", str(got_json))  # fmt: skip
        if check(f"accelerate FSDP2: load_state of {name}", res.returncode == 0):
            got, want = losses(got_json), losses(ref_json)
            check(f"accelerate FSDP2: {name} trains on with the reference's losses",
                  got == want, f"got {got}, want {want}")  # fmt: skip


def ds_story(out: Path, story: Path) -> None:
    src = story / "checkpoint_0"
    fsdp = out / "story-fsdp"
    res = shardctl("convert", str(src), "--to", "fsdp", "--out", str(fsdp))
    if not check("DeepSpeed (CPU, 2 ranks) → convert --to fsdp", res.returncode == 0):
        return
    got_json = out / "story.json"
    res = torchrun("--worker", "acc", "--state-dict", "sharded", "--resume", str(fsdp),
                   "--losses", str(got_json), "--steps", "6")  # fmt: skip
    if not check("DeepSpeed → FSDP: the real plugin's load_state on the GPU", res.returncode == 0):
        return
    got = losses(got_json)
    want = {int(k): v for k, v in json.loads((story / "ref.json").read_text()).items()}
    close = set(got) == set(want)
    close = close and all(abs(got[s] - want[s]) <= 1e-4 * abs(want[s]) for s in want)
    check("DeepSpeed → FSDP: the GPU run's losses are the CPU run's (rel 1e-4)", close,
          f"got {got}, want {want}")  # fmt: skip


def trainer_checks(out: Path, state_dict: str) -> None:
    root = out / f"trainer-{state_dict}"
    ref_json = out / f"trainer-{state_dict}.json"
    res = torchrun("--worker", "trainer", "--state-dict", state_dict, "--out", str(root),
                   "--losses", str(ref_json))  # fmt: skip
    if not check(f"Trainer FSDP2 {state_dict}: train 6 steps, save every 3", res.returncode == 0):
        return
    files = sorted(p.name for p in (root / "checkpoint-3").iterdir())
    print(f"  checkpoint-3 holds: {files}", flush=True)
    rows = listed(root)
    summary = [{k: r.get(k) for k in ("format", "step", "world_size", "status")} for r in rows]
    check(f"Trainer FSDP2 {state_dict}: `checkpoints` lists both",
          [r.get("step") for r in rows] == [6, 3] or [r.get("step") for r in rows] == [3, 6],
          json.dumps(summary))  # fmt: skip
    res = shardctl("consolidate", str(root / "checkpoint-3"), "--out", str(root / "model3"),
                   "--no-progress")  # fmt: skip
    check(f"Trainer FSDP2 {state_dict}: `consolidate` checkpoint-3", res.returncode == 0)
    if state_dict != "sharded":
        return
    res = shardctl("convert", str(root / "checkpoint-3"), "--to", "deepspeed", "--world-size",
                   "1", "--out", str(out / "trainer-ds" / "checkpoint-3"))  # fmt: skip
    res2 = shardctl("convert", str(out / "trainer-ds" / "checkpoint-3"), "--to", "fsdp",
                    "--out", str(out / "trainer-back" / "checkpoint-3"))  # fmt: skip
    if not check("Trainer FSDP2: convert → deepspeed → fsdp",
                 res.returncode == 0 and res2.returncode == 0):  # fmt: skip
        return
    got_json = out / "trainer-resumed.json"
    res = torchrun("--worker", "trainer", "--state-dict", state_dict,
                   "--out", str(out / "trainer-back"), "--losses", str(got_json),
                   "--resume", str(out / "trainer-back" / "checkpoint-3"))  # fmt: skip
    if check("Trainer FSDP2: resume_from_checkpoint of the round trip", res.returncode == 0):
        got, want = losses(got_json), losses(ref_json)
        check("Trainer FSDP2: the resumed run logs the uninterrupted run's losses",
              got == want, f"got {got}, want {want}")  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="", help="the folder the checks write into")
    ap.add_argument("--ds-story", default="")
    ap.add_argument("--worker", choices=["acc", "trainer"], default="")
    ap.add_argument("--state-dict", choices=["sharded", "full"], default="sharded")
    ap.add_argument("--resume", default="")
    ap.add_argument("--losses", default="")
    ap.add_argument("--save-at", type=int, default=SAVE_AT)
    ap.add_argument("--steps", type=int, default=STEPS)
    args = ap.parse_args()
    if args.worker == "acc":
        acc_worker(args)
        return 0
    if args.worker == "trainer":
        trainer_worker(args)
        return 0
    if not args.out:
        ap.error("--out is required: the folder the checks write into")
    import torch
    import transformers

    print(f"{torch.cuda.get_device_name()}; torch {torch.__version__}, transformers "
          f"{transformers.__version__}", flush=True)  # fmt: skip
    out = Path(args.out)
    for state_dict in ("sharded", "full"):
        accelerate_checks(out, state_dict)
    if args.ds_story:
        ds_story(out, Path(args.ds_story))
    for state_dict in ("sharded", "full"):
        trainer_checks(out, state_dict)
    failed = [name for name, ok, _ in RESULTS if not ok]
    print(f"{len(RESULTS) - len(failed)} of {len(RESULTS)} checks passed", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
