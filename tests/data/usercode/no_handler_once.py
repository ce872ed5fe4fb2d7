"""A plain script with no signal handler and no resume code, for a preemption on Slurm:
its first run says each rank is ready (`ready-<rank>` holding its pid, in the folder
given) and waits up to 120 s; run again (after the requeue) it ends with 0 at once."""

import os
import sys
import time
from pathlib import Path

folder = Path(sys.argv[1])
rank = os.environ.get("RANK", "0")
ready = folder / f"ready-{rank}"
if ready.exists():  # the requeued run: nothing was saved, nothing to resume; done
    sys.exit(0)
(folder / f"ready-{rank}.tmp").write_text(str(os.getpid()))
(folder / f"ready-{rank}.tmp").rename(ready)  # whole when seen
deadline = time.monotonic() + 120
while time.monotonic() < deadline:
    time.sleep(0.1)
sys.exit(0)
