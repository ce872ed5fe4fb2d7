"""examples/fsdp2_script.py with every step at least PACE_S seconds long.

    python paced_script.py [the example's arguments]

A test that lands several faults on one running job (a crash, a hang, a preemption)
needs the job to still be stepping when the last one lands. On a few ranks a step of
the example takes milliseconds on a fast host, so the job could finish first; a short
sleep in each step bounds how many steps a stretch of the test uses, on any host. The
sleep sits in `Checkpointer.step_done`, which every rank calls once per step, so the
example itself runs unchanged.
"""

from __future__ import annotations

import os
import runpy
import sys
import time
from pathlib import Path

from shardctl.train import api

PACE_S = float(os.environ.get("SHARDCTL_TEST_STEP_PACE_S", "0.1"))
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "fsdp2_script.py"

_step_done = api.Checkpointer.step_done


def _paced_step_done(self: api.Checkpointer, step: int) -> bool:
    time.sleep(PACE_S)
    return _step_done(self, step)


api.Checkpointer.step_done = _paced_step_done  # type: ignore[method-assign]
sys.argv[0] = str(EXAMPLE)
runpy.run_path(str(EXAMPLE), run_name="__main__")
