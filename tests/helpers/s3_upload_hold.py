"""`python tests/helpers/s3_upload_hold.py SPEC`: one rank of the built-in loop (as
`python -m shardctl.train SPEC`) whose uploads of one checkpoint are held part way, so a
test can kill its node mid-upload at a moment it knows.

`SHARDCTL_TEST_HOLD_UPLOAD=step-NNNNNNNN`: the first object of that step goes up; every
later upload of it waits until the file `SHARDCTL_TEST_HOLD_RELEASE` exists (bounded by
`HOLD_DEADLINE_S`, then it fails). Uploads of other steps are untouched.
"""

from __future__ import annotations

import os
import runpy
import threading
import time
from pathlib import Path
from typing import Any

from shardctl.orchestrator.s3.client import S3Client
from shardctl.orchestrator.s3.url import S3Url

HOLD_DEADLINE_S = 900.0
_held_step = os.environ["SHARDCTL_TEST_HOLD_UPLOAD"]
_release = Path(os.environ["SHARDCTL_TEST_HOLD_RELEASE"])
_sent = 0
_lock = threading.Lock()
_put_file = S3Client.put_file


def _held_put_file(self: S3Client, path: Path, url: S3Url, progress: Any = None) -> None:
    global _sent
    if f"/{_held_step}/" in f"/{url.key}":
        with _lock:
            _sent += 1
            first = _sent == 1
        if not first:
            deadline = time.monotonic() + HOLD_DEADLINE_S
            while not _release.exists():
                if time.monotonic() > deadline:
                    raise TimeoutError(f"upload of {url} held and never released")
                time.sleep(0.1)
    _put_file(self, path, url, progress)


S3Client.put_file = _held_put_file  # type: ignore[method-assign]
runpy.run_module("shardctl.train", run_name="__main__", alter_sys=True)
