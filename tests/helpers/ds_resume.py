"""Resume converted DeepSpeed checkpoints with DeepSpeed's own loader and train on.

Run under torchrun (gloo, CPU) with the world size the checkpoints were written for.
For every case of the JSON list CASES it can first write the reference checkpoint the
engine way (`ds_out.write_with_engine`, the converter's writer before the direct one:
`"reference": {"source": STEP_DIR, "out": DIR}`), then, for every checkpoint of the
case, build the real Llama of the source's manifest, start a ZeRO engine of the case's
stage and precision, `engine.load_checkpoint(...)`, train STEPS steps on fixed batches
and save (rank 0) the full fp32 masters as loaded, the losses, and the masters and
Adam moments after the steps:

    torchrun --nproc-per-node 2 tests/helpers/ds_resume.py CASES.json
    CASES.json: [{"stage": 3, "precision": "fp32", "sub_group_size": null,
                  "reference": {...} | null, "resume": [[CKPT_STEP_DIR, RESULT.pt], ...]}]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

STEPS = 2


def _config(stage: int, precision: str, sub_group_size: int | None) -> dict[str, Any]:
    from shardctl.train.portable.ds_out import deepspeed_config

    config = deepspeed_config(stage, precision)
    config["train_micro_batch_size_per_gpu"] = 2
    if sub_group_size is not None:
        config["zero_optimization"]["sub_group_size"] = sub_group_size
    return config


def _model(step_dir: Path) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    manifest = json.loads((step_dir / "manifest.json").read_text())
    torch.manual_seed(1234)  # not the source's initial weights: a no-op load shows
    return LlamaForCausalLM(LlamaConfig.from_dict(manifest["model"]["hf_config"]))


def _groups(model: Any, step_dir: Path) -> list[dict[str, Any]]:
    """The converted checkpoint's own param groups (names and hyperparameters)."""
    from shardctl.train.portable.state import read_state

    state = read_state(step_dir, json.loads((step_dir / "manifest.json").read_text()))
    named = dict(model.named_parameters())
    return [
        {**hyper, "params": [named[n] for n in names]}
        for hyper, names in zip(state.hyper, state.groups, strict=True)
    ]


def resume(case: dict[str, Any], step_dir: Path, result: Path) -> None:
    import deepspeed

    model = _model(step_dir)
    optimizer = torch.optim.AdamW(_groups(model, step_dir))
    engine, *_ = deepspeed.initialize(
        model=model,
        optimizer=optimizer,
        config=_config(case["stage"], case["precision"], case.get("sub_group_size")),
        dist_init_required=False,
    )
    path, _ = engine.load_checkpoint(str(step_dir), tag="deepspeed")
    assert path is not None, f"DeepSpeed loaded nothing from {step_dir}"
    # ZeRO 1/2 link Adam's state to the parameters at the first step: masters only here.
    loaded, step = _full_state(engine, moments=False), engine.global_steps
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(100 + dist.get_rank())
    losses = []
    for _ in range(STEPS):
        ids = torch.randint(0, vocab, (2, 16), generator=gen)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.detach().float().item())
    every = [torch.zeros(1) for _ in range(dist.get_world_size())]
    dist.all_gather(every, torch.tensor(losses[-1:]))
    state = _full_state(engine)
    if dist.get_rank() == 0:
        torch.save(
            {
                "loaded": loaded,
                "losses": losses,
                "last": [t.item() for t in every],
                "state": state,
                "step": step,
            },
            result,
        )
    dist.barrier()


def _full_state(engine: Any, moments: bool = True) -> dict[str, dict[str, Any]]:
    """Every parameter's full fp32 master and Adam moments (collectives under ZeRO-3:
    every rank asks for every parameter)."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    full = {}
    for name, param in engine.module.named_parameters():
        full[name] = {"fp32": safe_get_full_fp32_param(param).clone()}
        for kind in ("exp_avg", "exp_avg_sq") if moments else ():
            value = safe_get_full_optimizer_state(param, kind)
            full[name][kind] = None if value is None else value.clone()
    return full


def main(argv: list[str]) -> int:
    from shardctl.train.backends.deepspeed import _prepare_deepspeed
    from shardctl.train.portable.ds_out import write_with_engine

    cases = json.loads(Path(argv[0]).read_text())
    dist.init_process_group("gloo")
    _prepare_deepspeed("cpu")
    for case in cases:
        ref = case.get("reference")
        if ref:
            write_with_engine(
                Path(ref["source"]),
                Path(ref["out"]),
                case["stage"],
                case["precision"],
                sub_group_size=case.get("sub_group_size"),
            )
        for step_dir, result in case["resume"]:
            resume(case, Path(step_dir), Path(result))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    from shardctl.train.leave import leave

    leave(main(sys.argv[1:]))
