"""A plain script with no signal handler and no resume code (what shardctl cannot help
with): every rank says it is ready (`ready-<rank>` holding its pid, in the folder
given), then waits for at most 120 s and ends with 0."""

import os
import sys
import time
from pathlib import Path

folder = Path(sys.argv[1])
rank = os.environ.get("RANK", "0")
(folder / f"ready-{rank}.tmp").write_text(str(os.getpid()))
(folder / f"ready-{rank}.tmp").rename(folder / f"ready-{rank}")  # whole when seen
deadline = time.monotonic() + 120
while time.monotonic() < deadline:
    time.sleep(0.1)
sys.exit(0)
