"""Write a `PortableState` as a DeepSpeed ZeRO checkpoint for N ranks, through DeepSpeed.

The engine way: N CPU processes (gloo) each build a stand-in module — the checkpoint's
parameters by name and shape (a tied weight one Parameter under both names), no
forward — and the optimizer param groups of the source, start a ZeRO engine of the
requested stage, load the state into it (`engine_in.load_into_engine`) and call
`engine.save_checkpoint`. A run of the real model with the same stage and world size
then loads the files with DeepSpeed's own `load_checkpoint`. The ranks together hold
the whole fp32 state, so `convert` writes the same files directly (`zero_out.py`) and
comes here only for `--ds-writer engine` or a DeepSpeed version the direct writer
was not checked against; the tests use this as the direct writer's reference.

    python -m shardctl.train.portable.ds_out SOURCE_STEP_DIR OUT_DIR STAGE PRECISION [SUB_GROUP]
        (with RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set; `run_ranks` does that)
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from ...orchestrator.errors import CheckpointError
from .state import PortableState, materialize, read_state

TAG = "deepspeed"  # the sub-folder the DeepSpeed backend reads (backends/deepspeed.py)
RANK_TIMEOUT_S = 900.0


def stand_in_module(state: PortableState) -> tuple[Any, list[dict[str, Any]]]:
    """A module holding the checkpoint's parameters (zeros) and buffers under their
    names, and the optimizer param groups over them in the source's order."""
    import torch

    root = torch.nn.Module()

    def owner(name: str) -> tuple[torch.nn.Module, str]:
        module = root
        *path, leaf = name.split(".")
        for part in path:
            child = getattr(module, part, None) if part in module._modules else None
            if child is None:
                child = torch.nn.Module()
                module.add_module(part, child)
            module = child
        return module, leaf

    params: dict[str, torch.nn.Parameter] = {}
    for name in state.names:
        module, leaf = owner(name)
        src = state.master[name]
        params[name] = torch.nn.Parameter(torch.zeros(src.shape, dtype=torch.float32))
        module.register_parameter(leaf, params[name])
    for alias, name in state.shared.items():  # tied: one Parameter under two names
        module, leaf = owner(alias)
        module.register_parameter(leaf, params[name])
    for name, src in state.buffers.items():
        module, leaf = owner(name)
        module.register_buffer(leaf, materialize(src))
    groups = [
        {**hyper, "params": [params[n] for n in names]}
        for hyper, names in zip(state.hyper, state.groups, strict=True)
    ]
    return root, groups


PRECISIONS = ("fp32", "bf16-mixed")


def deepspeed_config(stage: int, precision: str) -> dict[str, Any]:
    """What shapes the files: the ZeRO stage and the precision (a bf16 engine names its
    optimizer files `bf16_zero_pp_rank_*` and keeps bf16 module weights; the run that
    resumes looks for exactly those), the rest as the DeepSpeed backend renders."""
    zero: dict[str, Any] = {"stage": stage}
    if stage == 3:
        zero["stage3_gather_16bit_weights_on_model_save"] = False
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "zero_optimization": zero,
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }
    if precision == "bf16-mixed":
        config["bf16"] = {"enabled": True}
    return config


def rank_main(
    source: Path, out_dir: Path, stage: int, precision: str, sub_group_size: int | None
) -> None:
    """One rank of the writer (a collective over WORLD_SIZE processes)."""
    import torch.distributed as dist

    from ..backends.deepspeed import _prepare_deepspeed

    dist.init_process_group("gloo")
    _prepare_deepspeed("cpu")
    write_with_engine(source, out_dir, stage, precision, sub_group_size=sub_group_size)
    dist.barrier()
    dist.destroy_process_group()


def write_with_engine(
    source: Path, out_dir: Path, stage: int, precision: str, *, sub_group_size: int | None = None
) -> None:
    """Every rank: an engine over the stand-in module loads the state of `source` and
    saves it to `out_dir` (the process group is up; `sub_group_size`: ZeRO-3's, when
    not DeepSpeed's default)."""
    import deepspeed
    import torch

    from ..manifest import read_manifest
    from .engine_in import load_into_engine

    manifest = read_manifest(source)
    state = read_state(source, manifest)
    module, groups = stand_in_module(state)
    optimizer = torch.optim.AdamW(groups)
    config = deepspeed_config(stage, precision)
    if sub_group_size is not None:
        config["zero_optimization"]["sub_group_size"] = sub_group_size
    engine, _, _, _ = deepspeed.initialize(
        model=module, optimizer=optimizer, config=config, dist_init_required=False
    )
    load_into_engine(engine, state)
    # The engine's optimizer-step counter, as the source run's engine would have it.
    engine.global_steps = int(manifest["step"])
    engine.save_checkpoint(save_dir=str(out_dir), tag=TAG)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_ranks(
    source: Path,
    out_dir: Path,
    stage: int,
    world_size: int,
    precision: str,
    sub_group_size: int | None = None,
) -> None:
    """Start `world_size` writer processes on this machine and wait for all of them."""
    if precision not in PRECISIONS:
        raise CheckpointError(
            f"a DeepSpeed checkpoint for precision {precision!r} cannot be written here; "
            f"accepted: {', '.join(PRECISIONS)} (fp16's loss scaler has no FSDP twin)"
        )
    port = str(_free_port())
    env = dict(os.environ)
    env.update(
        {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port,
            "WORLD_SIZE": str(world_size),
            "OMP_NUM_THREADS": "1",
            "DS_ACCELERATOR": "cpu",
            "PYTHONWARNINGS": "ignore",
        }
    )
    argv = [sys.executable, "-m", __name__, str(source), str(out_dir), str(stage), precision]
    argv += [str(sub_group_size)] if sub_group_size is not None else []
    procs = []
    for rank in range(world_size):
        rank_env = {**env, "RANK": str(rank), "LOCAL_RANK": str(rank)}
        procs.append(
            subprocess.Popen(
                argv,
                env=rank_env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
                start_new_session=True,
            )
        )
    deadline = time.monotonic() + RANK_TIMEOUT_S
    errors: list[str] = []
    try:
        for rank, proc in enumerate(procs):
            left = max(deadline - time.monotonic(), 1.0)
            try:
                _, err = proc.communicate(timeout=left)
            except subprocess.TimeoutExpired:
                errors.append(f"rank {rank}: no result after {RANK_TIMEOUT_S:.0f} s")
                break
            if proc.returncode != 0:
                errors.append(f"rank {rank} exited {proc.returncode}: {_last_error(err)}")
                break
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
                proc.wait()
    if errors:
        raise CheckpointError("writing the DeepSpeed checkpoint failed: " + "; ".join(errors))


def _last_error(stderr: str) -> str:
    lines = [ln for ln in stderr.strip().splitlines() if ln.strip()]
    marked = [ln for ln in lines if "Error" in ln or "error:" in ln]
    return (marked or lines or ["(no output)"])[-1].strip()


def main(argv: list[str]) -> int:
    source, out_dir, stage, precision = Path(argv[0]), Path(argv[1]), int(argv[2]), argv[3]
    sub_group_size = int(argv[4]) if len(argv) > 4 else None
    try:
        rank_main(source, out_dir, stage, precision, sub_group_size)
    except CheckpointError as exc:
        print(f"CheckpointError: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    from shardctl.train.leave import leave

    # After the barrier every rank's files are written (DeepSpeed's save is
    # synchronous); the interpreter's teardown of the engine could still abort a rank.
    leave(main(sys.argv[1:]))
