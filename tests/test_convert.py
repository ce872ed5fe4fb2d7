"""`shardctl convert`: FSDP ⇄ DeepSpeed accelerate configs, checked with accelerate itself.

Every written config is loaded with accelerate's own loader and pushed through the
same code `accelerate launch` runs (config → launch args → the env vars its FSDP /
DeepSpeed plugins read), so a key name we got wrong fails here.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from helpers.convert_configs import (
    FSDP_CONFIGS,
    HYBRID,
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
from shardctl.orchestrator.convert import convert_data, convert_file
from shardctl.orchestrator.errors import SpecError
from shardctl.orchestrator.spec import parse_spec

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
