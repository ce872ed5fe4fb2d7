"""An example training script of examples/ with every step at least PACE seconds long.

    python paced_script.py PACE EXAMPLE [the example's arguments]
    python paced_script.py 0.1 fsdp2_script.py --steps 200

A test that lands a fault on a running job (a crash, a hang, a preemption, the time
limit's signal) needs the job to still be stepping when it lands. On a few ranks a
step of the examples takes milliseconds on a fast, quiet host, so the job could
finish first; a short sleep in each step bounds how many steps a stretch of the test
uses, on any host. The sleep sits in the hook shardctl already has in each step on
every rank (`Checkpointer.step_done` of the checkpoint library, the Trainer
callback's `on_step_end`), so the example itself runs unchanged.
"""

from __future__ import annotations

import runpy
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _paced(step: Callable[..., Any], pace_s: float) -> Callable[..., Any]:
    def paced(*args: Any, **kwargs: Any) -> Any:
        time.sleep(pace_s)
        return step(*args, **kwargs)

    return paced


def _pace_checkpoint_library(pace_s: float) -> None:
    from shardctl.train import api

    api.Checkpointer.step_done = _paced(api.Checkpointer.step_done, pace_s)  # type: ignore[method-assign]


def _pace_trainer_callback(pace_s: float) -> None:
    from shardctl.train import hf

    hf.PreemptionCallback.on_step_end = _paced(hf.PreemptionCallback.on_step_end, pace_s)  # type: ignore[method-assign]


# Each example and the per-step hook it calls on every rank.
HOOKS = {
    "fsdp2_script.py": _pace_checkpoint_library,
    "hf_trainer_script.py": _pace_trainer_callback,
}


def main() -> None:
    pace, name, *args = sys.argv[1:]
    HOOKS[name](float(pace))
    example = EXAMPLES / name
    sys.argv = [str(example), *args]
    runpy.run_path(str(example), run_name="__main__")


if __name__ == "__main__":
    main()
