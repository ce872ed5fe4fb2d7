"""One process that saves one checkpoint through a real CheckpointManager, pausing
just before the publish until told to go (tests/test_fence.py races two of them).

    python tests/helpers/fence_writer.py --ckpt DIR --step N --ready FILE --go FILE

Its attempt token and run dir come from the environment (SHARDCTL_ATTEMPT_TOKEN,
SHARDCTL_RUN_DIR), as a supervisor gives them to its ranks. Writes FILE `--ready`
once the step's files are staged, then waits (deadline-bounded) for `--go`. Exits 0
when the checkpoint was published, 3 when the storage refused it as stale.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch
from ckpt_spec import checkpoint_spec  # this folder: see ckpt_spec
from shardctl.orchestrator.fence import StaleAttemptError
from shardctl.train.backends.fsdp import DcpStateIO, ModelState, OptimizerState
from shardctl.train.checkpoint import CheckpointManager

WAIT_S = 300.0


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--ckpt", type=Path, required=True)
    p.add_argument("--step", type=int, required=True)
    p.add_argument("--ready", type=Path, required=True)
    p.add_argument("--go", type=Path, required=True)
    args = p.parse_args()
    spec = checkpoint_spec({"dir": str(args.ckpt)}, name="fence")
    model = torch.nn.Linear(4, 4)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    io = DcpStateIO(
        {"model": ModelState(model), "optim": OptimizerState(model, optim)}, spec.strategy
    )
    mgr = CheckpointManager(spec.checkpoint, io, rank=0, world_size=1)
    publish = mgr.storage.publish

    def publish_when_told(name: str, *, replace: bool = False) -> Path:
        args.ready.write_text("staged\n")
        deadline = time.monotonic() + WAIT_S
        while not args.go.exists():
            if time.monotonic() > deadline:
                raise SystemExit(f"no {args.go} within {WAIT_S} s")
            time.sleep(0.01)
        return publish(name, replace=replace)

    mgr.storage.publish = publish_when_told  # type: ignore[method-assign]
    trainer = SimpleNamespace(state_dict=lambda: {"step": args.step}, load_state_dict=None)
    try:
        mgr.save(args.step, trainer)  # type: ignore[arg-type]
        mgr.wait()
    except StaleAttemptError as exc:  # the storage's own refusal, raised on rank 0
        print(f"refused: {exc}", file=sys.stderr)
        return 3
    print("published", flush=True)
    return 0


if __name__ == "__main__":
    from shardctl.train.leave import leave

    leave(main())  # not the interpreter's teardown of gloo: see shardctl.train.leave
