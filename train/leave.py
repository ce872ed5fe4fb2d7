"""How a rank's Python process ends: Python's own shutdown for Python code, then
`os._exit`, never C++'s exit-time destructors.

A finished rank can still hold native objects with threads of their own: a gloo
process group a script left up, a DeepSpeed engine's communication ops. Tearing them
down in the interpreter's final teardown aborted ranks that had finished their work
("terminate called without an active exception", SIGABRT, exit -6): about 1 run in 8
of a Hugging Face Trainer script on CPU, 2 in about 30 DeepSpeed conversions, and a
ZeRO-3 checkpoint maker in the test suite. The launcher reports that as a failed run.

So every process shardctl starts on a rank ends here: other non-daemon threads are
joined and `atexit` hooks run (a tracker's last sync, a logger's flush), the standard
streams are flushed, and then the process leaves with its code.

Torch-free and import-light.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading


def leave(code: int | None) -> None:
    """End this process with `code` (None is 0) after Python's shutdown of Python code."""
    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed pipe: nothing to say
            stream.flush()
    os._exit(0 if code is None else code)
