"""`shardctl convert ACCELERATE_CONFIG`: every number convert reads from an accelerate
config is bounded, and a value out of bounds is one line naming the key, the value and
what is accepted (exit 2), never carried into the converted config."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner
from helpers.convert_configs import deepspeed, fsdp
from shardctl.orchestrator.cli import cli
from shardctl.orchestrator.convert import checks
from shardctl.orchestrator.spec import common

# As a user would type them in the YAML file (so `1e30` is YAML's string, `1.0e+30` a float).
ABSURD = ["1e30", "1.0e+30", "1000000000000000000000000000000", "-1", "2.5", "many",
          '"\\t"', '"8\\t"', ".nan", "true", "[1]"]  # fmt: skip

TOP = {
    "num_processes": "an integer 1..102400000",
    "num_machines": "an integer 1..100000",
    "machine_rank": "an integer 0..99999",
    "main_process_port": "an integer 1..65535",
}


def convert(tmp_path: Path, text: str, to: str = "deepspeed") -> tuple[int, str, str]:
    src = tmp_path / "acc.yaml"
    src.write_text(text, encoding="utf-8")
    res = CliRunner().invoke(cli, ["convert", str(src), "--to", to])
    return res.exit_code, res.stdout, res.stderr


def fsdp_text(**top: object) -> str:
    return yaml.safe_dump(fsdp({"fsdp_version": 2}, **top))


def with_line(text: str, key: str, raw: str) -> str:
    """`text` with the top-level `key` set to `raw`, written as is."""
    kept = [line for line in text.splitlines() if not line.startswith(f"{key}:")]
    return "\n".join([*kept, f"{key}: {raw}"]) + "\n"


def refused(code: int, out: str, err: str, where: str, accepted: str) -> None:
    assert code == 2, (code, out, err)
    assert out == ""
    (line,) = err.strip().splitlines()
    assert "Traceback" not in err
    assert f"invalid accelerate config: {where} " in line, line
    assert line.endswith(f"accepted: {accepted}"), line


@pytest.mark.parametrize("raw", ABSURD)
@pytest.mark.parametrize("key", sorted(TOP))
def test_top_level_numbers_out_of_range_are_one_line(tmp_path: Path, key: str, raw: str):
    refused(*convert(tmp_path, with_line(fsdp_text(), key, raw)), key, TOP[key])


@pytest.mark.parametrize(("key", "raw"), [("num_processes", "0"), ("num_machines", "0"),
                                          ("main_process_port", "0"),
                                          ("main_process_port", "65536")])  # fmt: skip
def test_zero_and_one_past_the_end(tmp_path: Path, key: str, raw: str):
    refused(*convert(tmp_path, with_line(fsdp_text(), key, raw)), key, TOP[key])


def test_machine_rank_must_be_one_of_the_machines(tmp_path: Path):
    text = fsdp_text(num_machines=2, num_processes=16, machine_rank=2)
    refused(*convert(tmp_path, text), "machine_rank", "0..1")


def test_the_bounds_themselves_are_accepted_and_carried(tmp_path: Path):
    text = fsdp_text(num_machines=100_000, machine_rank=99_999, main_process_port=65_535)
    code, out, err = convert(tmp_path, with_line(text, "num_processes", '"102400000"'))
    assert code == 0, err
    written = yaml.safe_load(out)
    assert written["num_processes"] == 102_400_000  # a quoted count is written as a number
    assert (written["num_machines"], written["machine_rank"]) == (100_000, 99_999)
    assert written["main_process_port"] == 65_535


def test_an_unset_port_stays_unset(tmp_path: Path):
    code, out, err = convert(tmp_path, fsdp_text(main_process_port=None))
    assert code == 0, err
    assert yaml.safe_load(out)["main_process_port"] is None


_STEPS = "'auto' or a positive whole number up to 65536"
_CLIP = "'auto' or a positive number up to 1000000"


@pytest.mark.parametrize(
    ("field", "good", "raw", "accepted"),
    [
        *(("gradient_accumulation_steps", "1", raw, _STEPS)
          for raw in ["0", "-1", "2.5", "many", "1.0e+30", '"8\\t"', ".nan"]),
        *(("gradient_clipping", "1.0", raw, _CLIP)
          for raw in ["-1", "1.0e+30", ".inf", ".nan", "many", "1e30"]),
    ],
)  # fmt: skip
def test_deepspeed_numbers_out_of_range(
    tmp_path: Path, field: str, good: str, raw: str, accepted: str
):
    text = yaml.safe_dump(deepspeed({"zero_stage": 2, field: yaml.safe_load(good)}))
    text = text.replace(f"{field}: {good}", f"{field}: {raw}")
    refused(*convert(tmp_path, text, "fsdp"), f"deepspeed_config.{field}", accepted)


def test_deepspeed_numbers_in_range_are_carried(tmp_path: Path):
    cfg = {"zero_stage": 2, "gradient_accumulation_steps": 65_536, "gradient_clipping": 0.5}
    code, _, err = convert(tmp_path, yaml.safe_dump(deepspeed(cfg)), "fsdp")
    assert code == 0, err
    # FSDP's config has no such keys: the note on stderr says the values read.
    assert "65536/0.5: an FSDP accelerate config has no such keys" in err


@pytest.mark.parametrize("raw", ["0", "-2", "2.5", "many", "1.0e+30"])
def test_parallelism_config_sizes(tmp_path: Path, raw: str):
    data = fsdp({"fsdp_version": 2})
    data["parallelism_config"] = {"parallelism_config_dp_shard_size": 2}
    text = yaml.safe_dump(data).replace("dp_shard_size: 2", f"dp_shard_size: {raw}")
    refused(
        *convert(tmp_path, text),
        "parallelism_config.parallelism_config_dp_shard_size",
        "an integer 1..102400000",
    )


def test_parallelism_config_must_be_a_mapping(tmp_path: Path):
    text = with_line(fsdp_text(), "parallelism_config", "4")
    refused(
        *convert(tmp_path, text),
        "parallelism_config",
        "a mapping of parallelism_config_*_size keys",
    )


@pytest.mark.parametrize("raw", ["1.0e+30", "-1", "2.5", '"\\t"', "99999999999999999999"])
def test_fsdp_min_num_params(tmp_path: Path, raw: str):
    text = yaml.safe_dump(fsdp({"fsdp_version": 1, "fsdp_min_num_params": 7}))
    text = text.replace("fsdp_min_num_params: 7", f"fsdp_min_num_params: {raw}")
    refused(
        *convert(tmp_path, text),
        "fsdp_config.fsdp_min_num_params",
        f"an integer 0..{2**63 - 1}",
    )


def test_the_bounds_are_the_job_specs():
    assert checks.MAX_NODES == common.MAX_NODES
    assert checks.MAX_PROCS_PER_NODE == common.MAX_PROCS_PER_NODE
    assert checks.MAX_BATCH == common.MAX_BATCH
    assert checks.MAX_CLIP == common.MAX_CLIP
