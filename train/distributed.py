"""Who am I in the job: rank, world size and local rank from the launcher's env.

torchrun, `accelerate launch`, the `deepspeed` launcher and a Kubeflow PyTorchJob
all export RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT to every rank,
so reading those five is enough for all of them. A process started without a
launcher (plain `python -m shardctl.train`) is a world of one.

The backend follows the device: NCCL for CUDA, gloo for CPU.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from shardctl.orchestrator.errors import PermanentError, ShardctlError
from shardctl.orchestrator.rundir import ENV_COLLECTIVE_TIMEOUT

# Without shardctl's launch script (plain torchrun): torch's own default.
DEFAULT_COLLECTIVE_TIMEOUT_S = 1800


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: Any  # torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _int_env(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ShardctlError(
            f"environment variable {name}={raw!r} is not an integer; the launcher "
            "(torchrun, accelerate launch, deepspeed) sets it to this process's number"
        ) from None


def read_env() -> tuple[int, int, int, int]:
    """(rank, world_size, local_rank, local_world_size) as the launcher set them."""
    world = _int_env("WORLD_SIZE", 1)
    rank = _int_env("RANK", 0)
    local_rank = _int_env("LOCAL_RANK", rank)
    local_world = _int_env("LOCAL_WORLD_SIZE", world)
    if not 0 <= rank < world:
        raise ShardctlError(f"RANK={rank} is outside WORLD_SIZE={world}; accepted: 0..{world - 1}")
    return rank, world, local_rank, local_world


def init(device_kind: str, expected_world_size: int | None = None) -> DistEnv:
    """Join the process group (NCCL on CUDA, gloo on CPU) and return who we are.

    `expected_world_size` is the spec's nodes × procs_per_node; a launcher that
    started a different number of ranks is a configuration error worth stopping on
    rather than training with the wrong batch size.
    """
    import torch
    import torch.distributed as dist

    rank, world, local_rank, local_world = read_env()
    if expected_world_size is not None and world != expected_world_size:
        raise PermanentError(
            f"the launcher started WORLD_SIZE={world} ranks but the spec asks for "
            f"resources.nodes × resources.procs_per_node = {expected_world_size}"
        )
    if device_kind == "cuda":
        if not torch.cuda.is_available():
            raise PermanentError(
                "resources.device is 'cuda' but torch sees no CUDA device on this node; "
                "accepted here: device: cpu"
            )
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    # Even a world of one joins a group: FSDP2 and DeepSpeed both need one.
    if not dist.is_initialized():
        if world == 1 and "MASTER_PORT" not in os.environ:
            os.environ["MASTER_PORT"] = str(_free_port())
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        kwargs: dict[str, Any] = {
            "backend": backend,
            "rank": rank,
            "world_size": world,
            # The spec's watchdog.collective_timeout_s: a collective waiting longer
            # fails its rank instead of holding the allocation.
            "timeout": collective_timeout(),
        }
        if device.type == "cuda":
            kwargs["device_id"] = device
        dist.init_process_group(**kwargs)
    return DistEnv(rank, world, local_rank, local_world, device)


def collective_timeout() -> timedelta:
    """The process group's timeout: `$SHARDCTL_COLLECTIVE_TIMEOUT_S` (the spec's
    `watchdog.collective_timeout_s`, rendered into env.sh), else torch's 30 minutes."""
    seconds = _int_env(ENV_COLLECTIVE_TIMEOUT, DEFAULT_COLLECTIVE_TIMEOUT_S)
    if seconds <= 0:
        raise ShardctlError(
            f"environment variable {ENV_COLLECTIVE_TIMEOUT}={seconds} is not a positive "
            "number of seconds; it comes from the spec's watchdog.collective_timeout_s"
        )
    return timedelta(seconds=seconds)


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def is_initialized() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def barrier() -> None:
    import torch.distributed as dist

    if is_initialized():
        dist.barrier()


def destroy() -> None:
    import torch.distributed as dist

    if is_initialized():
        dist.destroy_process_group()
