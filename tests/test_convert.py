"""`shardctl convert`: FSDP ⇄ DeepSpeed accelerate configs, checked with accelerate itself.

Every written config is loaded with accelerate's own loader and pushed through the
same code `accelerate launch` runs (config → launch args → the env vars its FSDP /
DeepSpeed plugins read), so a key name we got wrong fails here.
"""

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
from shardctl.orchestrator.cli import cli
from shardctl.orchestrator.convert import convert_data, convert_file, read_plan
from shardctl.orchestrator.errors import ConfigError, ShardctlError, SpecError, UsageError
from shardctl.orchestrator.spec import parse_spec

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "examples" / "tiny-llama.yaml"

BASE = {
    "compute_environment": "LOCAL_MACHINE",
    "debug": False,
    "machine_rank": 0,
    "main_training_function": "main",
    "num_machines": 1,
    "num_processes": 8,
    "rdzv_backend": "static",
    "same_network": True,
    "use_cpu": False,
}


def fsdp(fsdp_config: dict[str, Any], **top: Any) -> dict[str, Any]:
    return {
        **BASE,
        "distributed_type": "FSDP",
        "mixed_precision": "bf16",
        **top,
        "fsdp_config": fsdp_config,
    }


def deepspeed(ds_config: dict[str, Any], **top: Any) -> dict[str, Any]:
    return {**BASE, "distributed_type": "DEEPSPEED", **top, "deepspeed_config": ds_config}


FSDP_CONFIGS = {
    "v1-full-shard-everything": fsdp(
        {
            "fsdp_version": 1,
            "fsdp_sharding_strategy": "FULL_SHARD",
            "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            "fsdp_transformer_layer_cls_to_wrap": "LlamaDecoderLayer",
            "fsdp_backward_prefetch": "BACKWARD_PRE",
            "fsdp_forward_prefetch": False,
            "fsdp_use_orig_params": True,
            "fsdp_cpu_ram_efficient_loading": True,
            "fsdp_sync_module_states": True,
            "fsdp_offload_params": False,
            "fsdp_state_dict_type": "SHARDED_STATE_DICT",
            "fsdp_activation_checkpointing": True,
        }
    ),
    "v1-shard-grad-op-full-state": fsdp(
        {
            "fsdp_version": 1,
            "fsdp_reshard_after_forward": "SHARD_GRAD_OP",
            "fsdp_state_dict_type": "FULL_STATE_DICT",
            "fsdp_cpu_ram_efficient_loading": False,
        },
        mixed_precision="fp16",
    ),
    "v1-no-shard-numeric": fsdp({"fsdp_sharding_strategy": 3}, mixed_precision="no"),
    "v1-full-shard-offload": fsdp(
        {
            "fsdp_version": 1,
            "fsdp_sharding_strategy": "1",
            "fsdp_offload_params": "true",
            "fsdp_state_dict_type": "FULL_STATE_DICT",
        }
    ),
    "v2-reshard-true-offload": fsdp(
        {
            "fsdp_version": 2,
            "fsdp_reshard_after_forward": True,
            "fsdp_offload_params": True,
            "fsdp_cpu_ram_efficient_loading": True,
            "fsdp_state_dict_type": "SHARDED_STATE_DICT",
        }
    ),
    "v2-reshard-false": fsdp(
        {"version": 2, "reshard_after_forward": False, "state_dict_type": "FULL_STATE_DICT"}
    ),
    # As older `accelerate config` wrote it (the accelerate 0.x docs' example).
    "v1-old-accelerate-style": {
        "compute_environment": "LOCAL_MACHINE",
        "deepspeed_config": {},
        "distributed_type": "FSDP",
        "downcast_bf16": "no",
        "fsdp_config": {
            "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            "fsdp_backward_prefetch_policy": "BACKWARD_PRE",
            "fsdp_offload_params": False,
            "fsdp_sharding_strategy": 2,
            "fsdp_state_dict_type": "FULL_STATE_DICT",
            "fsdp_transformer_layer_cls_to_wrap": "GPT2Block",
        },
        "machine_rank": 0,
        "main_training_function": "main",
        "megatron_lm_config": {},
        "mixed_precision": "no",
        "num_machines": 1,
        "num_processes": 2,
        "rdzv_backend": "static",
        "same_network": True,
        "use_cpu": False,
    },
    # FSDP2's NO_SHARD: a mesh that only replicates (what shardctl render writes).
    "v2-no-shard-mesh": fsdp(
        {"fsdp_version": 2, "fsdp_reshard_after_forward": False},
        parallelism_config={
            "parallelism_config_dp_replicate_size": 8,
            "parallelism_config_dp_shard_size": 1,
        },
    ),
}

HYBRID = {
    "v1": fsdp(
        {"fsdp_version": 1, "fsdp_sharding_strategy": "HYBRID_SHARD"},
        num_machines=2,
        num_processes=16,
    ),
    "v2": fsdp(
        {"fsdp_version": 2, "fsdp_reshard_after_forward": True},
        num_machines=2,
        num_processes=16,
        parallelism_config={
            "parallelism_config_dp_replicate_size": 2,
            "parallelism_config_dp_shard_size": 8,
        },
    ),
}


def write_yaml(path: Path, data: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(data), encoding="utf-8")
    return path


def launch_env(config_file: Path) -> dict[str, str]:
    """The env `accelerate launch --config_file F` gives the training processes."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_deepspeed_cmd_env, prepare_multi_gpu_env

    args = launch_command_parser().parse_args(["--config_file", str(config_file), "train.py"])
    args, defaults, mp_from_config = _validate_launch_command(args)
    if args.use_deepspeed:
        # What launch_command does before it calls deepspeed_launcher.
        fields = list(defaults.deepspeed_config) + (["mixed_precision"] if mp_from_config else [])
        args.deepspeed_fields_from_accelerate_config = ",".join(fields)
        _, env = prepare_deepspeed_cmd_env(args)
    else:
        assert args.use_fsdp
        env = prepare_multi_gpu_env(args)
    return {k: v for k, v in env.items() if k.startswith(("FSDP_", "ACCELERATE_"))}


def deepspeed_plugin_config(env: dict[str, str], cwd: Path) -> dict[str, Any]:
    """accelerate's DeepSpeedPlugin built from that env: the dict handed to DeepSpeed."""
    from accelerate.utils import DeepSpeedPlugin

    saved_env, saved_cwd = dict(os.environ), os.getcwd()
    try:
        os.environ.update(env)
        os.chdir(cwd)
        plugin = DeepSpeedPlugin()
        return {**plugin.deepspeed_config, "zero3_init": plugin.zero3_init_flag}
    finally:
        os.environ.clear()
        os.environ.update(saved_env)
        os.chdir(saved_cwd)


def load_with_accelerate(path: Path) -> Any:
    from accelerate.commands.config.config_args import load_config_from_file

    return load_config_from_file(str(path))


def settings(data: dict[str, Any]) -> dict[str, Any]:
    """The mappable settings of a config, as the converter reads them."""
    return read_plan(data).mappable()


# ------------------------------------------------------------------- round trips


@pytest.mark.parametrize("name", sorted(FSDP_CONFIGS))
def test_round_trip_fsdp_deepspeed_fsdp_keeps_every_mappable_setting(tmp_path: Path, name: str):
    original = FSDP_CONFIGS[name]
    src = write_yaml(tmp_path / "fsdp.yaml", original)
    version = int(
        original["fsdp_config"].get("fsdp_version", original["fsdp_config"].get("version", 1))
    )

    to_ds = convert_file(src, "deepspeed")
    ds_file = write_yaml(tmp_path / "ds.yaml", to_ds.accelerate_config)
    assert load_with_accelerate(ds_file).distributed_type.value == "DEEPSPEED"

    back = convert_file(ds_file, "fsdp", fsdp_version=version)
    back_file = write_yaml(tmp_path / "back.yaml", back.accelerate_config)
    loaded = load_with_accelerate(back_file)
    assert loaded.distributed_type.value == "FSDP"

    before, after = settings(original), settings(back.accelerate_config)
    assert after == before
    # The keys themselves come back under their own names, in the same style.
    mapped_keys = {"fsdp_offload_params", "fsdp_state_dict_type", "fsdp_cpu_ram_efficient_loading"}
    orig_cfg = {
        (k if k.startswith("fsdp") else f"fsdp_{k}"): v for k, v in original["fsdp_config"].items()
    }
    for key in mapped_keys & set(orig_cfg):
        assert str(loaded.fsdp_config[key]).lower() == str(orig_cfg[key]).lower(), key


@pytest.mark.parametrize("version", sorted(HYBRID))
def test_hybrid_shard_round_trips_through_a_deepspeed_json_with_hpz(tmp_path: Path, version: str):
    original = HYBRID[version]
    src = write_yaml(tmp_path / "fsdp.yaml", original)
    result = convert_file(src, "deepspeed", deepspeed_json_path="ds.json")
    assert result.deepspeed_json is not None
    zero = result.deepspeed_json["zero_optimization"]
    assert zero["stage"] == 3
    assert zero["zero_hpz_partition_size"] == 8  # GPUs per node
    (tmp_path / "ds.json").write_text(json.dumps(result.deepspeed_json))
    ds_file = write_yaml(tmp_path / "ds.yaml", result.accelerate_config)
    load_with_accelerate(ds_file)

    back = convert_file(ds_file, "fsdp", fsdp_version=int(version[1]))
    if version == "v1":
        assert back.accelerate_config["fsdp_config"]["fsdp_sharding_strategy"] == "HYBRID_SHARD"
    else:
        assert back.accelerate_config["parallelism_config"] == original["parallelism_config"]
    assert settings(back.accelerate_config) == settings(original)
    load_with_accelerate(write_yaml(tmp_path / "back.yaml", back.accelerate_config))


def test_hybrid_shard_inline_says_what_is_lost(tmp_path: Path):
    result = convert_data(
        fsdp({"fsdp_sharding_strategy": "HYBRID_SHARD"}, num_machines=2, num_processes=16),
        "deepspeed",
    )
    assert result.accelerate_config["deepspeed_config"]["zero_stage"] == 3
    text = " ".join(str(n) for n in result.notes if n.setting == "HYBRID_SHARD")
    assert "hpZ" in text and "--ds-json" in text and "across all nodes" in text


# ------------------------------------------------------------------- the mapping


@pytest.mark.parametrize(
    ("strategy", "stage"),
    [("FULL_SHARD", 3), ("SHARD_GRAD_OP", 2), ("NO_SHARD", 0), ("HYBRID_SHARD", 3)],
)
def test_sharding_strategy_maps_to_zero_stage(tmp_path: Path, strategy: str, stage: int):
    src = write_yaml(tmp_path / "f.yaml", fsdp({"fsdp_sharding_strategy": strategy}))
    result = convert_file(src, "deepspeed")
    out = write_yaml(tmp_path / "ds.yaml", result.accelerate_config)
    env = launch_env(out)
    assert env["ACCELERATE_DEEPSPEED_ZERO_STAGE"] == str(stage)
    assert env["ACCELERATE_MIXED_PRECISION"] == "bf16"


@pytest.mark.parametrize(
    ("stage", "strategy"), [(3, "FULL_SHARD"), (2, "SHARD_GRAD_OP"), (0, "NO_SHARD")]
)
def test_zero_stage_maps_to_sharding_strategy_fsdp1_env(tmp_path: Path, stage: int, strategy: str):
    src = write_yaml(tmp_path / "d.yaml", deepspeed({"zero_stage": stage}))
    result = convert_file(src, "fsdp", fsdp_version=1)
    env = launch_env(write_yaml(tmp_path / "f.yaml", result.accelerate_config))
    assert env["FSDP_VERSION"] == "1"
    # FSDP1 in accelerate 1.15 takes the strategy from FSDP_SHARDING_STRATEGY.
    assert env["FSDP_SHARDING_STRATEGY"].upper() == strategy


def test_zero3_to_fsdp2_uses_reshard_after_forward(tmp_path: Path):
    src = write_yaml(tmp_path / "d.yaml", deepspeed({"zero_stage": 2}))
    result = convert_file(src, "fsdp")
    env = launch_env(write_yaml(tmp_path / "f.yaml", result.accelerate_config))
    assert env["FSDP_VERSION"] == "2"
    assert env["FSDP_RESHARD_AFTER_FORWARD"] == "false"  # SHARD_GRAD_OP


def test_offload_ram_efficient_loading_and_state_dict(tmp_path: Path):
    src = write_yaml(
        tmp_path / "f.yaml",
        fsdp(
            {
                "fsdp_sharding_strategy": "FULL_SHARD",
                "fsdp_offload_params": True,
                "fsdp_cpu_ram_efficient_loading": True,
                "fsdp_sync_module_states": True,
                "fsdp_state_dict_type": "FULL_STATE_DICT",
            }
        ),
    )
    result = convert_file(src, "deepspeed")
    out = write_yaml(tmp_path / "ds.yaml", result.accelerate_config)
    env = launch_env(out)
    assert env["ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE"] == "cpu"
    assert env["ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE"] == "cpu"
    assert env["ACCELERATE_DEEPSPEED_ZERO3_INIT"] == "true"
    assert env["ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL"] == "true"
    ds = deepspeed_plugin_config(env, tmp_path)
    assert ds["zero_optimization"]["stage"] == 3
    assert ds["zero_optimization"]["offload_param"]["device"] == "cpu"
    assert ds["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] is True
    assert ds["zero3_init"] is True


def test_deepspeed_to_fsdp_forces_sync_module_states_and_says_so(tmp_path: Path):
    src = write_yaml(
        tmp_path / "d.yaml",
        deepspeed(
            {
                "zero_stage": 3,
                "zero3_init_flag": True,
                "offload_param_device": "cpu",
                "offload_optimizer_device": "cpu",
                "zero3_save_16bit_model": False,
                "gradient_accumulation_steps": 4,
                "gradient_clipping": 1.0,
            },
            mixed_precision="bf16",
        ),
    )
    result = convert_file(src, "fsdp", fsdp_version=1)
    env = launch_env(write_yaml(tmp_path / "f.yaml", result.accelerate_config))
    assert env["FSDP_CPU_RAM_EFFICIENT_LOADING"] == "true"
    assert env["FSDP_SYNC_MODULE_STATES"] == "true"
    assert env["FSDP_OFFLOAD_PARAMS"] == "true"
    assert env["FSDP_STATE_DICT_TYPE"] == "SHARDED_STATE_DICT"
    notes = {n.setting: n.message for n in result.notes}
    assert "forced to true" in notes["fsdp_sync_module_states"]
    # Gradient accumulation and clipping have no FSDP key: carried into the report.
    ga = notes["gradient_accumulation_steps/gradient_clipping"]
    assert "4/1.0" in ga and "Accelerator(gradient_accumulation_steps" in ga


def test_gradient_accumulation_and_clipping_carried_from_a_job_spec(tmp_path: Path):
    data = yaml.safe_load(TINY.read_text())
    data["train"]["grad_accum"] = 4
    data["train"]["clip"] = 0.5
    data["strategy"]["precision"] = "bf16-mixed"  # the example says auto (fp32 on cpu)
    result = convert_data(data, "deepspeed")
    ds = result.accelerate_config["deepspeed_config"]
    assert ds["gradient_accumulation_steps"] == 4
    assert ds["gradient_clipping"] == 0.5
    assert ds["zero_stage"] == 3
    assert result.accelerate_config["num_processes"] == 2
    assert result.accelerate_config["mixed_precision"] == "bf16"
    assert result.spec_strategy == {
        "backend": "deepspeed",
        "zero_stage": 3,
        "offload": "none",
        "precision": "bf16-mixed",
        "activation_checkpointing": False,
    }
    out = write_yaml(tmp_path / "ds.yaml", result.accelerate_config)
    env = launch_env(out)
    assert env["ACCELERATE_GRADIENT_ACCUMULATION_STEPS"] == "4"
    assert env["ACCELERATE_GRADIENT_CLIPPING"] == "0.5"


def test_job_spec_bf16_pure_to_deepspeed_is_changed_with_a_reason():
    data = yaml.safe_load(TINY.read_text())
    data["strategy"]["precision"] = "bf16-pure"
    result = convert_data(data, "deepspeed")
    assert result.spec_strategy is not None
    assert result.spec_strategy["precision"] == "bf16-mixed"
    changed = [n for n in result.notes if n.setting == "strategy.precision" and n.kind == "changed"]
    assert changed and "fp32 master weights" in changed[0].message


def test_unmapped_fsdp_settings_are_reported_by_name():
    cfg = FSDP_CONFIGS["v1-full-shard-everything"]
    result = convert_data(cfg, "deepspeed")
    reported = {n.setting for n in result.notes if n.kind == "not-mapped"}
    for key in (
        "fsdp_backward_prefetch",
        "fsdp_forward_prefetch",
        "fsdp_auto_wrap_policy",
        "fsdp_transformer_layer_cls_to_wrap",
        "fsdp_use_orig_params",
        "fsdp_activation_checkpointing",
    ):
        assert f"fsdp_config.{key}" in reported, key
    # Every input key is either mapped or named in the report.
    text = " ".join(str(n) for n in result.notes)
    for key in cfg["fsdp_config"]:
        assert key in text, key


def test_deepspeed_json_only_keys_are_reported(tmp_path: Path):
    (tmp_path / "ds.json").write_text(
        json.dumps(
            {
                "train_micro_batch_size_per_gpu": "auto",
                "bf16": {"enabled": True},
                "gradient_accumulation_steps": 8,
                "zero_optimization": {
                    "stage": 1,
                    "overlap_comm": True,
                    "reduce_bucket_size": 5e8,
                    "offload_optimizer": {"device": "nvme", "nvme_path": "/nvme"},
                },
                "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
            }
        )
    )
    src = write_yaml(
        tmp_path / "acc.yaml",
        deepspeed({"deepspeed_config_file": "ds.json", "deepspeed_multinode_launcher": "standard"}),
    )
    result = convert_file(src, "fsdp")
    cfg = result.accelerate_config
    assert cfg["mixed_precision"] == "bf16"
    assert cfg["fsdp_config"]["fsdp_reshard_after_forward"] is False  # ZeRO-1 → SHARD_GRAD_OP
    assert cfg["fsdp_config"]["fsdp_offload_params"] is True
    reported = {n.setting for n in result.notes}
    for key in (
        "zero_optimization.overlap_comm",
        "zero_optimization.reduce_bucket_size",
        "zero_optimization.offload_optimizer.nvme_path",
        "optimizer.type",
        "optimizer.params.lr",
        "deepspeed_config.deepspeed_multinode_launcher",
        "train_micro_batch_size_per_gpu",
    ):
        assert key in reported, key
    # Every leaf of the JSON is either read or named in the report.
    text = " ".join(str(n) for n in result.notes)
    ds_json = json.loads((tmp_path / "ds.json").read_text())
    for leaf in ("bf16", "gradient_accumulation_steps", "zero_optimization", "optimizer"):
        assert leaf in text or leaf in json.dumps(cfg), leaf
    assert ds_json["gradient_accumulation_steps"] == 8
    assert "8/None" in text  # accumulation carried into the report
    changed = " ".join(n.message for n in result.notes if n.kind == "changed")
    assert "optimizer-state sharding only" in changed and "NVMe" in changed
    load_with_accelerate(write_yaml(tmp_path / "f.yaml", cfg))


def test_precision_difference_is_stated_both_ways():
    to_ds = convert_data(
        fsdp({"fsdp_sharding_strategy": "FULL_SHARD"}, mixed_precision="no"), "deepspeed"
    )
    to_fsdp = convert_data(deepspeed({"zero_stage": 3}), "fsdp")
    for result in (to_ds, to_fsdp):
        text = " ".join(n.message for n in result.notes if n.kind == "precision")
        assert "fp32 master weights" in text
        assert "dtype the model was loaded in" in text
        assert "load the model in fp32" in text and "bf16-mixed" in text
    assert any("different training run" in n.message for n in to_ds.notes)


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


# ------------------------------------------------------------------- one mapping, one place


def test_accelerate_strategy_names_agree_with_the_specs_table():
    from shardctl.orchestrator.convert.mapping import STRATEGY_TO_ZERO, strategy_of_zero
    from shardctl.orchestrator.spec import SHARDING_TO_ZERO, ZERO_TO_SHARDING

    for sharding, stage in SHARDING_TO_ZERO.items():
        assert STRATEGY_TO_ZERO[sharding.upper()] == stage, sharding
    for stage, sharding in ZERO_TO_SHARDING.items():
        if sharding is not None:
            assert strategy_of_zero(stage, None) == sharding.upper()


# Written out, not computed by the functions the converter calls: accelerate's
# mixed_precision for each spec precision (bf16-pure is not mixed: the model itself is
# bf16, so accelerate casts nothing), and each example's processes, machines,
# accumulation and clipping (a spec without `train.clip` clips at 1.0).
ACCELERATE_PRECISION = {
    ("bf16-mixed", "cpu"): "bf16",
    ("bf16-mixed", "cuda"): "bf16",
    ("fp32", "cpu"): "no",
    ("fp32", "cuda"): "no",
    ("bf16-pure", "cpu"): "no",
    ("bf16-pure", "cuda"): "no",
    ("fp16-mixed", "cuda"): "fp16",
    ("auto", "cpu"): "no",  # auto renders as fp32 where bf16 is not native
    ("auto", "cuda"): "bf16",
}
EXAMPLE_SHAPE = {  # processes, machines, grad accumulation, clipping
    "tiny-llama": (2, 1, 1, 1.0),
    "deepspeed-zero3": (2, 1, 2, 1.0),
    "slurm-2node": (4, 2, 1, 1.0),
}


@pytest.mark.parametrize("example", sorted(EXAMPLE_SHAPE))
@pytest.mark.parametrize("precision", ["bf16-mixed", "fp32", "bf16-pure", "fp16-mixed", "auto"])
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_a_job_spec_converts_to_what_accelerate_reads_back(
    tmp_path: Path, example: str, precision: str, device: str
):
    """Precision, processes, ZeRO stage, accumulation, clipping: each written config is
    read back by accelerate's own loader and launch code, against written-out values."""
    data = yaml.safe_load((ROOT / "examples" / f"{example}.yaml").read_text())
    data["strategy"]["precision"] = precision
    data["resources"]["device"] = device
    invalid = (precision == "fp16-mixed" and device == "cpu") or (
        precision == "bf16-pure" and example == "deepspeed-zero3"
    )
    if invalid:  # fp16 on cpu; bf16-pure with DeepSpeed (it keeps fp32 master weights)
        with pytest.raises(SpecError):
            parse_spec(data)
        return
    mixed = ACCELERATE_PRECISION[(precision, device)]
    processes, machines, accum, clip = EXAMPLE_SHAPE[example]
    for to in ("fsdp", "deepspeed"):
        path = write_yaml(tmp_path / f"{to}.yaml", convert_data(data, to).accelerate_config)
        loaded = load_with_accelerate(path)
        assert (loaded.mixed_precision, loaded.num_processes, loaded.num_machines) == (
            mixed,
            processes,
            machines,
        )
        env = launch_env(path)
        if to == "deepspeed":
            assert env["ACCELERATE_DEEPSPEED_ZERO_STAGE"] == "3"  # full_shard is ZeRO-3
            assert env["ACCELERATE_GRADIENT_ACCUMULATION_STEPS"] == str(accum)
            assert float(env["ACCELERATE_GRADIENT_CLIPPING"]) == clip
            assert env["ACCELERATE_MIXED_PRECISION"] == mixed
        else:
            assert env["FSDP_VERSION"] == "2"
            assert env["ACCELERATE_MIXED_PRECISION"] == mixed


@pytest.mark.parametrize(("device", "expected"), [("cuda", "bf16"), ("cpu", "no")])
def test_precision_auto_converts_as_it_renders_and_says_so(device: str, expected: str):
    data = yaml.safe_load(TINY.read_text())
    data["strategy"]["precision"] = "auto"
    data["resources"]["device"] = device
    result = convert_data(data, "deepspeed")
    assert result.accelerate_config["mixed_precision"] == expected
    notes = [n.message for n in result.notes if n.setting == "strategy.precision"]
    rendered_as = "bf16-mixed" if device == "cuda" else "fp32"
    assert any(f"auto rendered as {rendered_as}" in m for m in notes), notes
    assert result.spec_strategy is not None and result.spec_strategy["precision"] == "auto"


def test_converting_an_accelerate_config_imports_no_pydantic(tmp_path: Path):
    """Only a job spec needs the spec model; accelerate input stays cheap."""
    src = write_yaml(tmp_path / "f.yaml", FSDP_CONFIGS["v2-reshard-false"])
    code = (
        "import sys\n"
        "from shardctl.orchestrator.convert import convert_file\n"
        f"convert_file({str(src)!r}, 'deepspeed')\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('pydantic', 'torch', 'accelerate', 'deepspeed')))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert proc.stdout.strip() == "[]"
