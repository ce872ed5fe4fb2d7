"""`local:` the section of `--cluster local`."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from ...spec.common import ClusterSection


class LocalSection(ClusterSection):
    """Settings for `--cluster local` (torchrun on this host)."""

    master_port: Annotated[int, Field(ge=1024, le=65535)] = 29500
    """The rendezvous port on this host."""
