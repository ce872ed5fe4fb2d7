"""How a rank of a user's script leaves (`shardctl.train.entry`, ending through
`shardctl.train.leave`): its threads are joined and its atexit hooks run, as Python's
own shutdown would, the run contract's markers are written, and the exit code is the
script's; then `os._exit`, without C++'s exit-time teardown."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = """
import atexit, sys, threading, time
from pathlib import Path
out = Path(sys.argv[1])

def late_writer():
    time.sleep(0.5)  # still running when the script's main code returns
    (out / "thread.txt").write_text("joined")

threading.Thread(target=late_writer).start()
atexit.register(lambda: (out / "atexit.txt").write_text("ran"))
print("script done", flush=True)
sys.exit(int(sys.argv[2]))
"""


@pytest.mark.parametrize(("code", "marker"), [(0, "DONE"), (3, "FAILED")])
def test_threads_and_atexit_hooks_finish_and_the_code_is_the_scripts(
    tmp_path: Path, code: int, marker: str
) -> None:
    script = tmp_path / "user.py"
    script.write_text(SCRIPT)
    run_dir = tmp_path / "run"
    env = {"SHARDCTL_RUN_DIR": str(run_dir), "RANK": "0", "PATH": "/usr/bin:/bin"}
    proc = subprocess.run(
        [sys.executable, "-m", "shardctl.train.entry", "script", str(script), str(tmp_path),
         str(code)],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert proc.returncode == code, proc.stderr
    assert proc.stdout == "script done\n"
    assert (tmp_path / "thread.txt").read_text() == "joined"
    assert (tmp_path / "atexit.txt").read_text() == "ran"
    recorded = json.loads((run_dir / marker).read_text())
    assert recorded["kind"] == ("done" if code == 0 else "failed")
