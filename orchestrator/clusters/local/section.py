"""`local:` the section of `--cluster local`."""

from __future__ import annotations

import os
import shutil
import sys
from typing import Annotated, Any

from pydantic import Field

from ...spec.common import ClusterSection, show


class LocalSection(ClusterSection):
    """Settings for `--cluster local` (torchrun on this host)."""

    master_port: Annotated[int, Field(ge=1024, le=65535)] = 29500
    """The rendezvous port on this host."""

    def run_problems(self, spec: Any) -> list[str]:
        """On this machine `env.PATH` replaces the PATH the launcher is looked up in
        (`launch.sh` exports it): the launcher must be in one of its folders, or every
        attempt ends "cannot start" and is tried again."""
        path = spec.env.get("PATH")
        launcher = spec.launcher  # the word launch.sh starts it by
        if path is None or shutil.which(launcher, path=path) is not None:
            return []
        # Where the launcher is without env.PATH: the local cluster puts this
        # interpreter's folder first (a virtual environment's bin).
        usual = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])
        here = shutil.which(launcher, path=usual)
        where = f" (here it is {here})" if here else ""
        return [
            f"env.PATH {show(path)} has no {launcher!r}{where}, and on --cluster local the "
            f"launcher is found through it; accepted: a PATH holding {launcher}'s folder, "
            "or no env.PATH"
        ]
