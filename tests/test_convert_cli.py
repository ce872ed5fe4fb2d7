"""`shardctl convert` through its command line: output, files it refuses to replace, bad
input, standard input and how an error names the input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner
from helpers.convert_configs import (
    FSDP_CONFIGS,
    ROOT,
    TINY,
    deepspeed,
    deepspeed_plugin_config,
    fsdp,
    launch_env,
    load_with_accelerate,
    settings,
    write_yaml,
)
from shardctl.orchestrator.cli import cli
from shardctl.orchestrator.convert import convert_data, convert_file
from shardctl.orchestrator.errors import ConfigError, ShardctlError, SpecError, UsageError
from shardctl.orchestrator.spec import parse_spec

# ------------------------------------------------------------------- the CLI


def test_cli_text_mode_config_on_stdout_notes_on_stderr(tmp_path: Path):
    src = write_yaml(tmp_path / "f.yaml", FSDP_CONFIGS["v1-full-shard-everything"])
    res = CliRunner().invoke(cli, ["convert", str(src), "--to", "deepspeed"])
    assert res.exit_code == 0, res.stderr
    out = write_yaml(tmp_path / "ds.yaml", yaml.safe_load(res.stdout))
    assert load_with_accelerate(out).deepspeed_config["zero_stage"] == 3
    assert "note: [precision]" in res.stderr
    assert "fsdp_config.fsdp_backward_prefetch" in res.stderr


def test_cli_json_output_and_files(tmp_path: Path):
    src = write_yaml(tmp_path / "f.yaml", FSDP_CONFIGS["v1-full-shard-offload"])
    out, ds_json = tmp_path / "out" / "ds.yaml", tmp_path / "out" / "ds.json"
    res = CliRunner().invoke(
        cli,
        [
            "convert",
            str(src),
            "--to",
            "deepspeed",
            "--out",
            str(out),
            "--ds-json",
            str(ds_json),
            "--output",
            "json",
        ],
    )
    assert res.exit_code == 0, res.stderr
    doc = json.loads(res.stdout)
    assert doc["written"] == [str(ds_json), str(out)]
    assert doc["deepspeed_config"] == json.loads(ds_json.read_text())
    assert any(n["kind"] == "precision" for n in doc["notes"])
    env = launch_env(out)
    assert env["ACCELERATE_DEEPSPEED_CONFIG_FILE"] == str(ds_json)
    ds = deepspeed_plugin_config(env, tmp_path)
    assert ds["zero_optimization"]["offload_param"] == {"device": "cpu"}
    assert ds["bf16"] == {"enabled": True}


def test_written_deepspeed_json_passes_deepspeeds_own_zero_config(tmp_path: Path):
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    result = convert_data(
        fsdp(
            {
                "fsdp_sharding_strategy": "HYBRID_SHARD",
                "fsdp_offload_params": True,
                "fsdp_state_dict_type": "FULL_STATE_DICT",
            },
            num_machines=2,
            num_processes=4,
        ),
        "deepspeed",
        deepspeed_json_path="ds.json",
    )
    assert result.deepspeed_json is not None
    zero = DeepSpeedZeroConfig(**result.deepspeed_json["zero_optimization"])
    assert zero.stage == 3 and zero.zero_hpz_partition_size == 2
    assert zero.offload_param is not None and zero.offload_param.device == "cpu"
    assert zero.gather_16bit_weights_on_model_save is True

    # The whole file through DeepSpeed's config class, with the 'auto' values filled
    # in the way accelerate fills them before deepspeed.initialize (one process here).
    from deepspeed.runtime.config import DeepSpeedConfig

    filled = {
        **result.deepspeed_json,
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 2,
        "train_batch_size": 8,
        "gradient_clipping": 1.0,
    }
    ds = DeepSpeedConfig(filled)
    assert ds.zero_optimization_stage == 3
    assert ds.bfloat16_config.enabled is True
    assert ds.zero_config.zero_hpz_partition_size == 2


def test_cli_refuses_to_overwrite_its_input(tmp_path: Path):
    src = write_yaml(tmp_path / "f.yaml", FSDP_CONFIGS["v2-reshard-false"])
    res = CliRunner().invoke(cli, ["convert", str(src), "--to", "deepspeed", "--out", str(src)])
    assert res.exit_code == 2
    assert "refusing to overwrite" in res.stderr


@pytest.mark.parametrize(
    ("options", "named"),
    [
        (["--world-size", "2"], "--world-size is for"),
        (["--world-size", "2", "--ds-writer", "direct"], "--world-size, --ds-writer are for"),
    ],
)
def test_checkpoint_options_on_a_config_file_are_refused(
    tmp_path: Path, options: list[str], named: str
):
    src = write_yaml(tmp_path / "f.yaml", FSDP_CONFIGS["v2-reshard-false"])
    res = CliRunner().invoke(cli, ["convert", str(src), "--to", "deepspeed", *options])
    assert res.exit_code == 2
    message = " ".join(res.stderr.split())
    assert f"{named} converting a checkpoint folder; {src} is not a folder" in message, message


@pytest.mark.parametrize("option", ["--out", "--ds-json"])
def test_cli_refuses_to_replace_an_existing_file_without_force(tmp_path: Path, option: str):
    src = write_yaml(tmp_path / "f.yaml", FSDP_CONFIGS["v1-full-shard-offload"])
    out, ds_json = tmp_path / "ds.yaml", tmp_path / "ds.json"
    taken = out if option == "--out" else ds_json
    taken.write_text("mine\n")
    args = ["convert", str(src), "--to", "deepspeed", "--out", str(out), "--ds-json", str(ds_json)]
    res = CliRunner().invoke(cli, args)
    assert res.exit_code == 2
    assert f"{option} {taken} already exists" in res.stderr and "--force" in res.stderr
    # Nothing was written: neither the file in the way nor the other one.
    assert taken.read_text() == "mine\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["f.yaml", taken.name])

    res = CliRunner().invoke(cli, [*args, "--force"])
    assert res.exit_code == 0, res.stderr
    assert load_with_accelerate(out).deepspeed_config["deepspeed_config_file"] == str(ds_json)
    assert json.loads(ds_json.read_text())["zero_optimization"]["stage"] == 3


def test_a_failed_forced_write_keeps_the_old_file(tmp_path: Path):
    import resource
    import signal

    src = write_yaml(tmp_path / "f.yaml", FSDP_CONFIGS["v1-full-shard-offload"])
    out = tmp_path / "ds.yaml"
    out.write_text("mine\n")

    def limit_writes() -> None:  # the kernel fails any write past 8 bytes (EFBIG)
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (8, 8))

    proc = subprocess.run(
        [sys.executable, "-m", "shardctl.orchestrator.cli", "convert", str(src), "--to",
         "deepspeed", "--out", str(out), "--force"],
        capture_output=True, text=True, timeout=120, preexec_fn=limit_writes,
        env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"},
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr
    assert f"cannot write {str(out)!r}" in proc.stderr and "Traceback" not in proc.stderr
    assert out.read_text() == "mine\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds.yaml", "f.yaml"]


def test_cli_refuses_the_same_file_for_out_and_ds_json(tmp_path: Path):
    src = write_yaml(tmp_path / "f.yaml", FSDP_CONFIGS["v1-full-shard-offload"])
    same = tmp_path / "both"
    res = CliRunner().invoke(
        cli, ["convert", str(src), "--to", "deepspeed", "--out", str(same), "--ds-json", str(same)]
    )
    assert res.exit_code == 2
    assert "--out and --ds-json are both" in res.stderr
    assert not same.exists()


def test_force_is_refused_for_a_checkpoint_folder(tmp_path: Path):
    res = CliRunner().invoke(
        cli, ["convert", str(tmp_path), "--to", "fsdp", "--out", str(tmp_path / "x"), "--force"]
    )
    assert res.exit_code == 2
    assert "never replaces anything" in res.stderr


# ------------------------------------------------------------------- bad input

BAD = [
    ("not: [valid", "not valid YAML at line 1"),
    ("- a\n- b\n", "top level must be a mapping"),
    ("foo: 1\n", "neither an accelerate config"),
    ("distributed_type: MULTI_GPU\n", "'MULTI_GPU' is neither backend"),
    (
        "distributed_type: FSDP\nfsdp_config:\n  fsdp_sharding_strategy: QUARTER_SHARD\n",
        "fsdp_config.fsdp_sharding_strategy 'QUARTER_SHARD' is not an FSDP sharding strategy; "
        "accepted: FULL_SHARD (1)",
    ),
    (
        "distributed_type: FSDP\nfsdp_config:\n  fsdp_sharding_strategy: 7\n",
        "fsdp_config.fsdp_sharding_strategy 7 is not an FSDP sharding strategy",
    ),
    (
        "distributed_type: DEEPSPEED\ndeepspeed_config:\n  zero_stage: 5\n",
        "deepspeed_config.zero_stage 5 is not valid; accepted: 0, 1, 2, 3",
    ),
    (
        "distributed_type: FSDP\nfsdp_config:\n  fsdp_ofload_params: true\n",
        "unknown key 'fsdp_ofload_params' in fsdp_config; did you mean 'fsdp_offload_params'?",
    ),
    (
        "distributed_type: FSDP\nfsdp_config:\n  fsdp_offload_params: maybe\n",
        "fsdp_config.fsdp_offload_params 'maybe' is not a boolean; accepted: true, false",
    ),
    (
        "distributed_type: FSDP\nfsdp_config:\n  fsdp_version: 2\n"
        "  fsdp_sharding_strategy: NO_SHARD\n",
        "is an FSDP1 key; with fsdp_version 2 accepted: fsdp_reshard_after_forward",
    ),
    (
        "distributed_type: FSDP\nfsdp_config:\n  fsdp_version: 3\n",
        "fsdp_config.fsdp_version 3 is not valid; accepted: 1, 2",
    ),
    (
        "distributed_type: FSDP\nfsdp_config:\n  fsdp_sharding_strategy: FULL_SHARD\n"
        "  fsdp_reshard_after_forward: SHARD_GRAD_OP\n",
        "disagree",
    ),
    (
        "distributed_type: DEEPSPEED\ndeepspeed_config:\n  offload_param_device: gpu\n",
        "deepspeed_config.offload_param_device 'gpu' is not valid; accepted: none, cpu, nvme",
    ),
    (
        "distributed_type: DEEPSPEED\ndeepspeed_config:\n  deepspeed_config_file: nope.json\n",
        "deepspeed_config.deepspeed_config_file 'nope.json' does not exist",
    ),
    (
        "distributed_type: DEEPSPEED\ndeepspeed_config:\n  deepspeed_config_file: x.json\n"
        "  zero_stage: 3\n",
        "accelerate refuses that pair",
    ),
    (
        "distributed_type: DEEPSPEED\nmixed_precision: bf16\ndeepspeed_config:\n"
        "  deepspeed_config_file: x.json\n",
        "deepspeed_config_file and mixed_precision 'bf16' (top level)",
    ),
    (
        "distributed_type: DEEPSPEED\ndeepspeed_config:\n  gradient_clipping: lots\n",
        "deepspeed_config.gradient_clipping 'lots' is not valid; accepted: 'auto' or a positive",
    ),
    (
        "compute_environment: AMAZON_SAGEMAKER\ndistributed_type: FSDP\n",
        "compute_environment 'AMAZON_SAGEMAKER' is not supported",
    ),
    (
        "distributed_type: FSDP\nnum_procesess: 2\n",
        "unknown key 'num_procesess' in the accelerate config; did you mean 'num_processes'?",
    ),
    (
        "name: BAD_NAME\ntrain: {steps: 1, model: {llama: {}}, data: {builtin: python-stdlib}}\n",
        "name: 'BAD_NAME' cannot be a Slurm job",
    ),
]


@pytest.mark.parametrize(("text", "message"), BAD, ids=[m[:40] for _, m in BAD])
def test_bad_input_names_key_value_and_accepted(tmp_path: Path, text: str, message: str):
    src = tmp_path / "bad.yaml"
    src.write_text(text, encoding="utf-8")
    with pytest.raises(ShardctlError) as exc:
        convert_file(src, "deepspeed" if "FSDP" in text else "fsdp")
    assert message in str(exc.value)
    assert exc.value.exit_code == 2
    # Each error says what the input is: only a job spec is an "invalid job spec".
    if text.startswith("name:"):
        assert isinstance(exc.value, SpecError)
        return
    assert "invalid job spec" not in str(exc.value)
    if text.startswith(("distributed_type", "compute_environment")):
        assert isinstance(exc.value, ConfigError)
        assert f"{src}: invalid accelerate config: " in str(exc.value)
    else:
        assert "invalid accelerate config or job spec: " in str(exc.value)


def test_missing_file_and_no_traceback_through_the_real_cli(tmp_path: Path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "shardctl.orchestrator.cli",
            "convert",
            str(tmp_path / "missing.yaml"),
            "--to",
            "fsdp",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "does not exist" in proc.stderr
    assert "Traceback" not in proc.stderr
    bad = tmp_path / "bad.yaml"
    bad.write_text("distributed_type: DEEPSPEED\ndeepspeed_config:\n  zero_stage: 5\n")
    proc = subprocess.run(
        [sys.executable, "-m", "shardctl.orchestrator.cli", "convert", str(bad), "--to", "fsdp"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "zero_stage 5" in proc.stderr and "accepted: 0, 1, 2, 3" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_deepspeed_job_spec_to_fsdp(tmp_path: Path):
    result = convert_file(ROOT / "examples" / "deepspeed-zero3.yaml", "fsdp")
    cfg = result.accelerate_config
    assert cfg["distributed_type"] == "FSDP"
    assert cfg["fsdp_config"]["fsdp_version"] == 2
    assert cfg["fsdp_config"]["fsdp_reshard_after_forward"] is True
    assert cfg["num_processes"] == 2 and cfg["mixed_precision"] == "bf16"
    assert result.spec_strategy is not None
    assert result.spec_strategy["backend"] == "fsdp"
    assert result.spec_strategy["sharding"] == "full_shard"
    env = launch_env(write_yaml(tmp_path / "f.yaml", cfg))
    assert env["FSDP_VERSION"] == "2" and env["FSDP_RESHARD_AFTER_FORWARD"] == "true"


EXAMPLE_VARIANTS = {
    "fsdp-full-shard": ("tiny-llama.yaml", {}),
    "fsdp-shard-grad-op": ("tiny-llama.yaml", {"sharding": "shard_grad_op"}),
    "fsdp-no-shard": ("tiny-llama.yaml", {"sharding": "no_shard"}),
    "fsdp-hybrid-offload": ("slurm-2node.yaml", {"sharding": "hybrid_shard", "offload": "params"}),
    "deepspeed-zero3": ("deepspeed-zero3.yaml", {}),
    "deepspeed-zero2-offload": ("deepspeed-zero3.yaml", {"zero_stage": 2, "offload": "optimizer"}),
}


@pytest.mark.parametrize("variant", sorted(EXAMPLE_VARIANTS))
def test_the_accelerate_config_shardctl_renders_converts_consistently(tmp_path: Path, variant):
    """`shardctl render` (launcher accelerate) → convert: the spec's own choices come back."""
    from shardctl.orchestrator.clusters import render_artifacts

    example, strategy = EXAMPLE_VARIANTS[variant]
    data = yaml.safe_load((ROOT / "examples" / example).read_text())
    data["launcher"] = "accelerate"
    data["strategy"].update(strategy)
    if "offload" in strategy:
        data["resources"]["device"] = "cuda"
    spec = parse_spec(data)
    files = render_artifacts(spec, "local")
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    rendered = tmp_path / "accelerate_config.yaml"
    load_with_accelerate(rendered)

    other = "deepspeed" if spec.strategy.backend == "fsdp" else "fsdp"
    from_file = convert_file(rendered, other)  # type: ignore[arg-type]
    from_spec = convert_data(data, other)  # type: ignore[arg-type]
    keep = ("sharding", "zero_stage", "offload", "mixed_precision")
    assert {k: settings(from_file.accelerate_config)[k] for k in keep} == {
        k: settings(from_spec.accelerate_config)[k] for k in keep
    }
    stage = settings(from_file.accelerate_config)["zero_stage"]
    assert stage == spec.strategy.zero_stage


def test_same_backend_is_refused():
    with pytest.raises(UsageError, match="already a fsdp accelerate config; accepted: --to deep"):
        convert_data(FSDP_CONFIGS["v2-reshard-false"], "fsdp")


def _fsdp_combo(
    version: int, strategy: str, offload: bool, ram: bool | None, sdt: str | None, mp: str
) -> dict[str, Any]:
    cfg: dict[str, Any] = {"fsdp_version": version, "fsdp_offload_params": offload}
    top: dict[str, Any] = {"mixed_precision": mp}
    if version == 1:
        cfg["fsdp_sharding_strategy"] = strategy
    else:
        cfg["fsdp_reshard_after_forward"] = strategy == "FULL_SHARD"
        if strategy == "NO_SHARD":
            top["parallelism_config"] = {
                "parallelism_config_dp_replicate_size": 8,
                "parallelism_config_dp_shard_size": 1,
            }
    if ram is not None:
        cfg["fsdp_cpu_ram_efficient_loading"] = ram
    if sdt is not None:
        cfg["fsdp_state_dict_type"] = sdt
    return fsdp(cfg, **top)


def test_round_trip_over_every_combination_loses_only_what_it_reports():
    """FSDP → DeepSpeed → FSDP for 324 configs: every setting with a twin comes back;
    the two that cannot (offload at NO_SHARD = ZeRO-0, RAM-efficient loading below
    ZeRO-3) are named in a note."""
    import itertools

    combos = itertools.product(
        (1, 2),
        ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"),
        (True, False),
        (True, False, None),
        ("FULL_STATE_DICT", "SHARDED_STATE_DICT", None),
        ("no", "bf16", "fp16"),
    )
    count = 0
    for version, strategy, offload, ram, sdt, mp in combos:
        original = _fsdp_combo(version, strategy, offload, ram, sdt, mp)
        to_ds = convert_data(original, "deepspeed")
        back = convert_data(to_ds.accelerate_config, "fsdp", fsdp_version=version)
        expected = settings(original)
        changed = " ".join(n.message for n in to_ds.notes if n.kind == "changed")
        if offload and strategy == "NO_SHARD":
            expected["offload"] = False
            assert "nothing is offloaded" in changed
        if ram and strategy != "FULL_SHARD":
            expected["ram_efficient_loading"] = False
            assert "only at ZeRO-3" in changed
        assert settings(back.accelerate_config) == expected, original
        count += 1
    assert count == 324


def test_every_deepspeed_key_is_mapped_or_reported():
    cfg = {
        "zero_stage": 3,
        "offload_optimizer_device": "nvme",
        "offload_param_device": "nvme",
        "offload_optimizer_nvme_path": "/nvme",
        "offload_param_nvme_path": "/nvme",
        "gradient_accumulation_steps": 4,
        "gradient_clipping": 1.0,
        "zero3_init_flag": False,
        "zero3_save_16bit_model": True,
        "deepspeed_moe_layer_cls_names": "MixtralSparseMoeBlock",
        "deepspeed_multinode_launcher": "standard",
        "deepspeed_hostfile": "/etc/hosts",
        "deepspeed_exclusion_filter": "a",
        "deepspeed_inclusion_filter": "b",
    }
    result = convert_data(deepspeed(cfg, mixed_precision="bf16"), "fsdp")
    text = " ".join(str(n) for n in result.notes)
    for key in cfg:
        assert key in text, key


# ------------------------------------------------------------------- stdin


def test_stdin_gives_the_same_bytes_as_the_file(tmp_path: Path):
    """`cat acc.yaml | shardctl convert - --to deepspeed`: the kind comes from the content."""
    for data, to in (
        (FSDP_CONFIGS["v1-full-shard-everything"], "deepspeed"),
        (deepspeed({"zero_stage": 2}), "fsdp"),
        (yaml.safe_load(TINY.read_text()), "deepspeed"),
    ):
        src = write_yaml(tmp_path / "in.yaml", data)
        from_file = CliRunner().invoke(cli, ["convert", str(src), "--to", to])
        piped = CliRunner().invoke(cli, ["convert", "-", "--to", to], input=src.read_text())
        assert piped.exit_code == 0, piped.stderr
        assert piped.stdout == from_file.stdout
        assert piped.stderr == from_file.stderr


def test_stdin_finds_a_relative_deepspeed_json_from_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    (tmp_path / "ds.json").write_text(json.dumps({"zero_optimization": {"stage": 3}}))
    text = yaml.safe_dump(deepspeed({"deepspeed_config_file": "ds.json"}))
    monkeypatch.chdir(tmp_path)  # as `accelerate launch` resolves it
    res = CliRunner().invoke(cli, ["convert", "-", "--to", "fsdp"], input=text)
    assert res.exit_code == 0, res.stderr
    assert yaml.safe_load(res.stdout)["fsdp_config"]["fsdp_reshard_after_forward"] is True


@pytest.mark.parametrize("text", ["", "  \n\n"])
def test_stdin_empty_is_refused(text: str):
    res = CliRunner().invoke(cli, ["convert", "-", "--to", "fsdp"], input=text)
    assert res.exit_code == 2
    assert "stdin is empty" in res.stderr and "Traceback" not in res.stderr


def test_stdin_that_is_a_terminal_is_refused_not_waited_on(tmp_path: Path):
    """A real pseudo-terminal on stdin: the command must refuse at once, not block."""
    import pty

    leader, follower = pty.openpty()
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "shardctl.orchestrator.cli", "convert", "-", "--to", "fsdp"],
            stdin=follower,
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        os.close(follower)
        os.close(leader)
    assert proc.returncode == 2
    assert "stdin is a terminal" in proc.stderr and "cat accelerate.yaml |" in proc.stderr


def test_stdin_errors_name_stdin_and_the_kind():
    bad = "distributed_type: DEEPSPEED\ndeepspeed_config:\n  zero_stage: 5\n"
    res = CliRunner().invoke(cli, ["convert", "-", "--to", "fsdp"], input=bad)
    assert res.exit_code == 2
    assert "error: <stdin>: invalid accelerate config: deepspeed_config.zero_stage 5" in (
        res.stderr
    )


# ------------------------------------------------------------------- what an error calls the input


def test_a_bad_deepspeed_json_is_named_as_such(tmp_path: Path):
    (tmp_path / "ds.json").write_text(json.dumps({"zero_optimization": {"stage": 7}}))
    src = write_yaml(tmp_path / "acc.yaml", deepspeed({"deepspeed_config_file": "ds.json"}))
    with pytest.raises(ConfigError) as exc:
        convert_file(src, "fsdp")
    assert str(exc.value) == (
        f"{tmp_path / 'ds.json'}: invalid DeepSpeed JSON config: "
        "zero_optimization.stage 7 is not valid; accepted: 0, 1, 2, 3"
    )
    assert exc.value.exit_code == 2
    (tmp_path / "ds.json").write_text("{not json")
    with pytest.raises(ConfigError) as exc:
        convert_file(src, "fsdp")
    assert "ds.json: invalid DeepSpeed JSON config: not readable JSON" in str(exc.value)


def test_an_accelerate_config_error_through_the_cli_says_accelerate_config(tmp_path: Path):
    src = tmp_path / "accelerate.yaml"
    src.write_text("distributed_type: FSDP\nfsdp_config:\n  fsdp_offload_params: maybe\n")
    res = CliRunner().invoke(cli, ["convert", str(src), "--to", "deepspeed"])
    assert res.exit_code == 2
    assert res.stderr.startswith(f"error: {src}: invalid accelerate config: ")
    assert "fsdp_config.fsdp_offload_params 'maybe' is not a boolean" in res.stderr
