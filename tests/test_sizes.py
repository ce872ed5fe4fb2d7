"""MemorySize: one parse at the spec boundary, exact bytes, each cluster's own notation."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml
from shardctl.orchestrator.errors import SpecError
from shardctl.orchestrator.sizes import GIB, MIB, PIB, MemorySize, MemorySizeError
from shardctl.orchestrator.spec import parse_spec

ROOT = Path(__file__).resolve().parent.parent
BASE: dict[str, Any] = yaml.safe_load((ROOT / "examples" / "tiny-llama.yaml").read_text())


@pytest.mark.parametrize(
    ("text", "nbytes", "slurm", "k8s"),
    [
        # The renderers' outputs before MemorySize existed; the goldens depend on them.
        ("64G", 64 * GIB, "64G", "64Gi"),
        ("64Gi", 64 * GIB, "64G", "64Gi"),
        ("4096", 4096 * MIB, "4096", "4096Mi"),
        ("512M", 512 * MIB, "512M", "512Mi"),
        ("2T", 2 * 1024 * GIB, "2T", "2Ti"),
        ("8Gi", 8 * GIB, "8G", "8Gi"),
        ("1048576K", GIB, "1048576K", "1048576Ki"),
        # Fractions: Slurm takes whole numbers only, so the largest exact unit is used.
        ("1.5Gi", 1536 * MIB, "1536M", "1.5Gi"),
        ("1.5G", 1536 * MIB, "1536M", "1536Mi"),
        ("0.5T", 512 * GIB, "512G", "512Gi"),
        ("2.5M", 2560 * 1024, "2560K", "2560Ki"),
        ("1Pi", PIB, "1024T", "1Pi"),
    ],
)
def test_parse_and_render(text: str, nbytes: int, slurm: str, k8s: str) -> None:
    size = MemorySize(text)
    assert size.bytes == nbytes
    assert size.slurm() == slurm
    assert size.k8s() == k8s
    assert str(size) == text  # the user's own text, kept for job.yaml
    # The renderings mean the same amount when read back.
    assert MemorySize(slurm).bytes == nbytes
    assert MemorySize(k8s).bytes == nbytes


def test_slurm_rounds_up_to_a_whole_kib_never_down() -> None:
    exact = MemorySize("1.000244140625Gi")  # one GiB and 256 KiB
    assert exact.bytes == GIB + 256 * 1024
    assert exact.slurm() == "1048832K"
    odd = MemorySize("1.00000095367431640625Mi")  # one MiB and one byte
    assert odd.bytes == MIB + 1
    assert odd.slurm() == "1025K"  # Slurm counts KiB at best: one more, never one less
    assert odd.k8s() == "1.00000095367431640625Mi"  # already a Kubernetes quantity
    # Slurm's unit with a fraction: a plain Kubernetes quantity (bytes) is exact.
    assert MemorySize("1.00000095367431640625M").k8s() == str(MIB + 1)


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("500m", "thousandths of a byte"),
        ("1e9", "exponents are refused"),
        ("64k", "decimal suffixes"),
        ("2P", "decimal suffixes"),
        ("0", "is zero"),
        ("0Gi", "is zero"),
        ("512Ki", "less than 1Mi"),
        ("1.3Ki", "not a whole number of bytes"),
        ("2Pi", "more than 1Pi"),
        ("99999999999T", "more than 1Pi"),
        ("lots", "not a memory size"),
        ("", "not a memory size"),
        ("64 G", "not a memory size"),
        ("-1G", "not a memory size"),
        ("64GB", "not a memory size"),
    ],
)
def test_refused(text: str, why: str) -> None:
    with pytest.raises(MemorySizeError, match=why) as exc:
        MemorySize(text)
    assert repr(text) in str(exc.value)


def test_immutable_and_equal_by_text() -> None:
    size = MemorySize("64G")
    with pytest.raises(AttributeError):
        size.bytes = 1  # type: ignore[misc]
    assert size == "64G" and size == MemorySize("64G")
    # Equality is the text (what round-trips); amounts compare through .bytes.
    assert size != MemorySize("64Gi") and size.bytes == MemorySize("64Gi").bytes


def test_yaml_dump_is_the_plain_text() -> None:
    assert yaml.safe_dump({"m": MemorySize("1.5Gi")}) == "m: 1.5Gi\n"


def _with(**resources: Any) -> dict[str, Any]:
    data = copy.deepcopy(BASE)
    data["resources"].update(resources)
    return data


@pytest.mark.parametrize("given", ["64G", "1.5Gi", "4096", 4096, "512M"])
def test_spec_memory_round_trips_as_written(given: Any) -> None:
    spec = parse_spec(_with(memory=given))
    assert isinstance(spec.resources.memory, MemorySize)
    dumped = spec.to_yaml_dict()["resources"]["memory"]
    assert dumped == str(given) and type(dumped) is str
    again = parse_spec(yaml.safe_load(yaml.safe_dump(spec.to_yaml_dict(), sort_keys=False)))
    assert again == spec


def test_spec_shm_size_is_a_memory_size_with_a_default() -> None:
    spec = parse_spec(BASE)
    assert spec.k8s.shm_size.bytes == GIB
    assert spec.to_yaml_dict()["k8s"]["shm_size"] == "1Gi"


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ("500m", "resources.memory: '500m' is not a memory size: 'm' means thousandths"),
        ("1e9", "resources.memory: '1e9' is not a memory size: decimal suffixes"),
        ("0", "resources.memory: '0' is zero"),
        (True, "resources.memory: True is not a memory size"),
        (["64G"], "resources.memory: ['64G'] is not a memory size"),
        (1.5, "resources.memory: 1.5 is not a memory size"),
    ],
)
def test_spec_memory_errors_name_field_and_value_once(given: Any, expected: str) -> None:
    with pytest.raises(SpecError) as exc:
        parse_spec(_with(memory=given), "job.yaml")
    message = str(exc.value)
    assert expected in message
    assert "(got" not in message  # the value is shown once, in the sentence
