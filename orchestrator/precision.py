"""`strategy.precision: auto` — which precision fits the hardware, decided once.

Torch-free. Two moments decide it:

- On the node, at a run's first start (`shardctl.train` calls `resolve_auto` with
  what torch reports): bf16-mixed where the device computes bf16 natively (CUDA
  compute capability >= 8.0; CPUs with AVX512-BF16 or AMX), fp16-mixed on older
  GPUs, fp32 otherwise. The result is printed and recorded in every checkpoint's
  manifest; a resumed run keeps it, so a run never changes precision midway.
- At render time (accelerate config, DeepSpeed JSON written before any node is
  known): `rendered_precision` — bf16-mixed for CUDA (what every GPU since Ampere
  computes natively), fp32 for CPU. The built-in loop rebuilds its DeepSpeed config
  from the resolved value on the node, so this only matters for users' own scripts
  that read the rendered files.
"""

from __future__ import annotations

from typing import Literal

ConcretePrecision = Literal["bf16-mixed", "bf16-pure", "fp16-mixed", "fp32"]
AUTO = "auto"

# CPU feature flags (as /proc/cpuinfo spells them) that mean bf16 matrix work runs
# natively rather than emulated through fp32 (4-5x slower on an AVX2-only EPYC).
NATIVE_BF16_CPU_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


def resolve_auto(
    device: str,
    *,
    cuda_capability: tuple[int, int] | None = None,
    cpu_flags: frozenset[str] | set[str] = frozenset(),
) -> ConcretePrecision:
    """The precision `auto` becomes on a device with these properties."""
    if device == "cuda":
        if cuda_capability is not None and cuda_capability >= (8, 0):
            return "bf16-mixed"
        return "fp16-mixed"
    if NATIVE_BF16_CPU_FLAGS & set(cpu_flags):
        return "bf16-mixed"
    return "fp32"


def explain_auto(
    device: str,
    *,
    cuda_capability: tuple[int, int] | None = None,
    cpu_flags: frozenset[str] | set[str] = frozenset(),
) -> tuple[ConcretePrecision, str]:
    """`resolve_auto`'s answer and why, in words for the run's log:
    ("fp32", "CPU without native bf16: no avx512_bf16/amx_bf16")."""
    precision = resolve_auto(device, cuda_capability=cuda_capability, cpu_flags=cpu_flags)
    wanted = "/".join(sorted(NATIVE_BF16_CPU_FLAGS, reverse=True))  # avx512 first
    if device == "cuda":
        if cuda_capability is None:
            why = "CUDA device of unknown compute capability: no native bf16 assumed"
        else:
            cc = f"{cuda_capability[0]}.{cuda_capability[1]}"
            native = "native bf16" if precision == "bf16-mixed" else "no native bf16 (needs 8.0)"
            why = f"CUDA compute capability {cc}: {native}"
    elif precision == "bf16-mixed":
        found = "/".join(sorted(NATIVE_BF16_CPU_FLAGS & set(cpu_flags)))
        why = f"CPU with native bf16: {found}"
    else:
        why = f"CPU without native bf16: no {wanted}"
    return precision, why


def is_concrete(precision: object) -> bool:
    """Whether `precision` is one a run can train in (what a manifest may record)."""
    return precision in ("bf16-mixed", "bf16-pure", "fp16-mixed", "fp32")


def cpu_flags_of_this_host(cpuinfo: str = "/proc/cpuinfo") -> frozenset[str]:
    """The feature flags of this host's first CPU (empty where /proc/cpuinfo is missing)."""
    try:
        with open(cpuinfo) as fh:
            for line in fh:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def rendered_precision(precision: str, device: str) -> ConcretePrecision:
    """What rendered launcher configs say for `precision` (see the module docstring)."""
    if precision != AUTO:
        return precision  # type: ignore[return-value]
    return "bf16-mixed" if device == "cuda" else "fp32"


def summary(precision: str, device: str, *, builtin_loop: bool, reads_rendered: bool) -> str:
    """What `validate` says the job trains in, as it will run.

    `builtin_loop`: shardctl's loop, which resolves `auto` on the node under every
    launcher; `reads_rendered`: a user's script is handed a rendered accelerate config
    or ds_config.json, whose `auto` is `rendered_precision`. A script handed neither
    (torchrun with FSDP) picks its own precision.
    """
    if precision != AUTO:
        return precision
    if builtin_loop:
        if device == "cuda":
            rule = "bf16-mixed on compute capability 8.0 or newer, else fp16-mixed"
        else:
            flags = "/".join(sorted(NATIVE_BF16_CPU_FLAGS, reverse=True))
            rule = f"bf16-mixed on a CPU with {flags}, else fp32"
        return f"precision auto (decided on the node: {rule})"
    if reads_rendered:
        rendered = rendered_precision(precision, device)
        return f"precision auto → {rendered} in the rendered launcher configs (device {device})"
    return "precision auto (your script trains in the precision it chooses)"
