"""FSDP ⇄ DeepSpeed: translate an accelerate config (or a job spec) to the other backend.

The mapping follows Accelerate's concept guide "FSDP vs DeepSpeed":

    sharding strategy          ⇄ ZeRO stage       FULL_SHARD↔3  SHARD_GRAD_OP↔2  NO_SHARD↔0
                                                  HYBRID_SHARD↔3 (+ ZeRO++ hpZ in a DeepSpeed JSON)
    fsdp_offload_params        ⇄ offload_param_device / offload_optimizer_device = cpu
    fsdp_cpu_ram_efficient_loading ⇄ zero3_init_flag   (FSDP1 also needs sync_module_states)
    fsdp_state_dict_type FULL  ⇄ zero3_save_16bit_model true (SHARDED ⇄ false)
    mixed_precision, gradient accumulation and clipping are carried over.

Everything without a twin (prefetch, wrap policy, use_orig_params, DeepSpeed-only
JSON keys ...) is reported by name in `Conversion.notes`, never dropped silently,
and so is the precision difference: FSDP keeps parameters in the dtype they were
loaded in unless mixed precision upcasts them; DeepSpeed always keeps fp32 masters.

The conversion goes through one backend-neutral `Plan`, so FSDP → DeepSpeed → FSDP
gives back every setting that has a twin. Pure functions: no torch, no accelerate.
"""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from ..errors import SpecError
from ..yamlio import read_yaml_file

Target = Literal["fsdp", "deepspeed"]
NoteKind = Literal["mapped", "not-mapped", "changed", "precision"]

FSDP_STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2")
STRATEGY_TO_ZERO = {
    "FULL_SHARD": 3,
    "SHARD_GRAD_OP": 2,
    "NO_SHARD": 0,
    "HYBRID_SHARD": 3,
    "HYBRID_SHARD_ZERO2": 2,
}
ZERO_TO_STRATEGY = {3: "FULL_SHARD", 2: "SHARD_GRAD_OP", 1: "SHARD_GRAD_OP", 0: "NO_SHARD"}
STATE_DICT_TYPES = ("FULL_STATE_DICT", "SHARDED_STATE_DICT", "LOCAL_STATE_DICT")
MIXED_PRECISION = ("no", "fp16", "bf16", "fp8")
OFFLOAD_DEVICES = ("none", "cpu", "nvme")
WRAP_POLICIES = ("TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP", "NO_WRAP")
PREFETCH = ("BACKWARD_PRE", "BACKWARD_POST", "NO_PREFETCH")

# Top-level keys of accelerate 1.15's ClusterConfig (commands/config/config_args.py).
ACCELERATE_TOP_KEYS = frozenset(
    {
        "compute_environment",
        "distributed_type",
        "mixed_precision",
        "use_cpu",
        "debug",
        "num_processes",
        "machine_rank",
        "num_machines",
        "gpu_ids",
        "main_process_ip",
        "main_process_port",
        "rdzv_backend",
        "same_network",
        "main_training_function",
        "enable_cpu_affinity",
        "fp8_config",
        "deepspeed_config",
        "fsdp_config",
        "parallelism_config",
        "megatron_lm_config",
        "mpirun_config",
        "downcast_bf16",
        "tpu_name",
        "tpu_zone",
        "tpu_use_cluster",
        "tpu_use_sudo",
        "command_file",
        "commands",
        "tpu_vm",
        "tpu_env",
        "dynamo_config",
        "dynamo_backend",
        "fp16",
    }
)
# Keys `accelerate launch` accepts inside fsdp_config (its --fsdp_* arguments).
FSDP_KEYS = frozenset(
    {
        "fsdp_version",
        "fsdp_sharding_strategy",
        "fsdp_reshard_after_forward",
        "fsdp_offload_params",
        "fsdp_min_num_params",
        "fsdp_auto_wrap_policy",
        "fsdp_transformer_layer_cls_to_wrap",
        "fsdp_backward_prefetch",
        "fsdp_backward_prefetch_policy",
        "fsdp_state_dict_type",
        "fsdp_forward_prefetch",
        "fsdp_use_orig_params",
        "fsdp_cpu_ram_efficient_loading",
        "fsdp_sync_module_states",
        "fsdp_activation_checkpointing",
        "fsdp_activation_checkpointing_offload",
        "fsdp_ignored_modules",
    }
)
# Keys `accelerate launch` accepts inside deepspeed_config (its DeepSpeed arguments).
DEEPSPEED_KEYS = frozenset(
    {
        "deepspeed_config_file",
        "zero_stage",
        "offload_optimizer_device",
        "offload_param_device",
        "offload_optimizer_nvme_path",
        "offload_param_nvme_path",
        "gradient_accumulation_steps",
        "gradient_clipping",
        "zero3_init_flag",
        "zero3_save_16bit_model",
        "deepspeed_moe_layer_cls_names",
        "deepspeed_multinode_launcher",
        "deepspeed_hostfile",
        "deepspeed_exclusion_filter",
        "deepspeed_inclusion_filter",
    }
)
# Inline deepspeed_config keys that accelerate refuses next to a deepspeed_config_file.
_DS_KEYS_FILE_OWNS = (
    "zero_stage",
    "offload_optimizer_device",
    "offload_param_device",
    "offload_param_nvme_path",
    "offload_optimizer_nvme_path",
    "gradient_accumulation_steps",
    "gradient_clipping",
    "zero3_save_16bit_model",
)
# DeepSpeed JSON keys the converter reads; every other one is reported as DeepSpeed-only.
_DS_JSON_READ = {
    "zero_optimization.stage",
    "zero_optimization.offload_param.device",
    "zero_optimization.offload_optimizer.device",
    "zero_optimization.stage3_gather_16bit_weights_on_model_save",
    "zero_optimization.zero_hpz_partition_size",
    "gradient_accumulation_steps",
    "gradient_clipping",
    "bf16.enabled",
    "fp16.enabled",
}

PRECISION_NOTE = (
    "precision differs between the backends: FSDP keeps parameters and runs the optimizer "
    "in the dtype the model was loaded in unless mixed precision upcasts them, while "
    "DeepSpeed always creates fp32 master weights and steps the optimizer in fp32. A model "
    "loaded in bf16 therefore trains in pure bf16 under FSDP with mixed_precision 'no', but "
    "with fp32 masters (more memory, different numerics) under DeepSpeed. To train the same "
    "way on both: load the model in fp32 (torch_dtype=torch.float32) and use mixed_precision "
    "bf16 (shardctl: strategy.precision bf16-mixed)."
)


@dataclass(frozen=True)
class Note:
    """One line of the conversion report."""

    kind: NoteKind
    setting: str
    message: str

    def to_json(self) -> dict[str, str]:
        return {"kind": self.kind, "setting": self.setting, "message": self.message}

    def __str__(self) -> str:
        return f"[{self.kind}] {self.setting}: {self.message}"


@dataclass
class Plan:
    """Backend-neutral view of one distributed-training setup."""

    sharding: str = "FULL_SHARD"
    """FSDP strategy name; for DeepSpeed sources derived from the ZeRO stage."""
    zero_stage: int = 3
    offload_param: str = "none"
    offload_optimizer: str = "none"
    ram_efficient_loading: bool | None = None
    full_state_dict: bool | None = None
    """FULL_STATE_DICT / zero3_save_16bit_model true; None when the source did not say."""
    mixed_precision: str | None = None
    grad_accum: int | str | None = None
    grad_clip: float | str | None = None
    hpz_partition_size: int | None = None
    fsdp_version: int | None = None
    fsdp_extra: dict[str, Any] = field(default_factory=dict)
    """FSDP settings without a DeepSpeed twin, kept for a conversion back to FSDP."""
    top: dict[str, Any] = field(default_factory=dict)
    """Top-level accelerate keys that both backends share (num_processes ...)."""
    notes: list[Note] = field(default_factory=list)

    def note(self, kind: NoteKind, setting: str, message: str) -> None:
        self.notes.append(Note(kind, setting, message))

    def mappable(self) -> dict[str, Any]:
        """The settings that have a twin on both sides (what a round trip must keep)."""
        return {
            "sharding": self.sharding,
            "zero_stage": self.zero_stage,
            "offload": self.offload_param != "none" or self.offload_optimizer != "none",
            "ram_efficient_loading": self.ram_efficient_loading,
            "full_state_dict": self.full_state_dict,
            "mixed_precision": self.mixed_precision,
            "top": dict(self.top),
        }


@dataclass(frozen=True)
class Conversion:
    """The result: the target accelerate config, maybe a DeepSpeed JSON, and the report."""

    source: str
    """`accelerate-fsdp`, `accelerate-deepspeed` or `jobspec`."""
    target: Target
    accelerate_config: dict[str, Any]
    deepspeed_json: dict[str, Any] | None
    notes: tuple[Note, ...]
    spec_strategy: dict[str, Any] | None = None
    """For a job-spec source: the `strategy` section that selects the target backend."""

    def to_json(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "target": self.target,
            "accelerate_config": self.accelerate_config,
            "deepspeed_config": self.deepspeed_json,
            "spec_strategy": self.spec_strategy,
            "notes": [n.to_json() for n in self.notes],
        }


# ------------------------------------------------------------------- entry points


def convert_file(
    path: str | Path,
    to: Target,
    *,
    fsdp_version: int | None = None,
    deepspeed_json_path: str | None = None,
) -> Conversion:
    """Read an accelerate config or a job spec from `path` and convert it to `to`."""
    path = Path(path)
    data = read_yaml_file(path)
    return convert_data(
        data,
        to,
        source=str(path),
        base_dir=path.parent,
        fsdp_version=fsdp_version,
        deepspeed_json_path=deepspeed_json_path,
    )


def convert_data(
    data: Any,
    to: Target,
    *,
    source: str | None = None,
    base_dir: Path | None = None,
    fsdp_version: int | None = None,
    deepspeed_json_path: str | None = None,
) -> Conversion:
    """Convert already-parsed YAML data (accelerate config or job spec) to `to`."""
    if to not in ("fsdp", "deepspeed"):
        _fail(source, f"--to {to!r} is not a backend; accepted: fsdp, deepspeed")
    if fsdp_version not in (None, 1, 2):
        _fail(source, f"fsdp_version {fsdp_version!r} is not an FSDP version; accepted: 1, 2")
    kind = detect(data, source)
    if kind == f"accelerate-{to}":
        other = "fsdp" if to == "deepspeed" else "deepspeed"
        _fail(
            source, f"--to {to}: this is already a {to} accelerate config; accepted: --to {other}"
        )
    spec_strategy = None
    if kind == "jobspec":
        plan, spec_strategy = _plan_from_spec(data, to, source)
    elif kind == "accelerate-fsdp":
        plan = _plan_from_fsdp(data, source)
    else:
        plan = _plan_from_deepspeed(data, source, base_dir)
    if to == "deepspeed":
        config, ds_json = _to_deepspeed(plan, deepspeed_json_path)
    else:
        config, ds_json = _to_fsdp(plan, fsdp_version), None
    _precision_notes(plan, kind, to)
    return Conversion(kind, to, config, ds_json, tuple(plan.notes), spec_strategy)


def detect(data: Any, source: str | None = None) -> str:
    """Which kind of file `data` is: accelerate-fsdp, accelerate-deepspeed or jobspec."""
    if not isinstance(data, dict):
        _fail(
            source,
            f"the top level must be a mapping (an accelerate config or a shardctl job spec), "
            f"got {type(data).__name__}",
        )
    if "distributed_type" in data or "fsdp_config" in data or "deepspeed_config" in data:
        dist = str(data.get("distributed_type", "")).upper()
        if dist == "FSDP" or (not dist and "fsdp_config" in data):
            return "accelerate-fsdp"
        if dist == "DEEPSPEED" or (not dist and "deepspeed_config" in data):
            return "accelerate-deepspeed"
        _fail(
            source,
            f"distributed_type {data.get('distributed_type')!r} is neither backend; "
            "accepted: FSDP (with fsdp_config) or DEEPSPEED (with deepspeed_config)",
        )
    if "train" in data or "strategy" in data or "name" in data:
        return "jobspec"
    keys = ", ".join(sorted(map(str, data))) or "none"
    _fail(
        source,
        f"neither an accelerate config (no distributed_type) nor a shardctl job spec (no "
        f"name/train/strategy); top-level keys: {keys}",
    )
    raise AssertionError("unreachable")


def render_yaml(config: dict[str, Any]) -> str:
    return yaml.safe_dump(config, sort_keys=True, default_flow_style=False)


# ------------------------------------------------------------------- readers


def _plan_from_fsdp(data: dict[str, Any], source: str | None) -> Plan:
    plan = Plan()
    _read_top(plan, data, source, skip=("fsdp_config", "deepspeed_config"))
    raw = data.get("fsdp_config") or {}
    if not isinstance(raw, dict):
        _fail(source, f"fsdp_config must be a mapping, got {type(raw).__name__}")
    # `accelerate launch` accepts keys with or without the fsdp_ prefix.
    cfg = {(k if str(k).startswith("fsdp") else f"fsdp_{k}"): v for k, v in raw.items()}
    _check_keys(cfg, FSDP_KEYS, "fsdp_config", source)

    version = _int(cfg.get("fsdp_version", 1), "fsdp_config.fsdp_version", source, (1, 2))
    plan.fsdp_version = version
    plan.sharding = _fsdp_sharding(cfg, version, data, source)
    plan.zero_stage = STRATEGY_TO_ZERO[plan.sharding]
    if plan.sharding == "HYBRID_SHARD":
        nodes, procs = plan.top.get("num_machines"), plan.top.get("num_processes")
        if "_mesh_shard_size" in cfg:  # FSDP2: the shard dimension of the mesh
            plan.hpz_partition_size = cfg.pop("_mesh_shard_size")
        elif isinstance(nodes, int) and isinstance(procs, int) and nodes > 1 and procs % nodes == 0:
            plan.hpz_partition_size = procs // nodes
    cfg.pop("_mesh_shard_size", None)
    sharding_keys = [
        k for k in ("fsdp_sharding_strategy", "fsdp_reshard_after_forward") if k in cfg
    ]
    plan.note(
        "mapped",
        "fsdp_config." + ("/".join(sharding_keys) or "fsdp_sharding_strategy (default)"),
        f"{plan.sharding} → zero_stage {plan.zero_stage}",
    )
    plan.note(
        "not-mapped",
        "fsdp_config.fsdp_version",
        f"{version}: DeepSpeed has no such choice; to get the same key style back, convert "
        f"with --fsdp-version {version}",
    )

    if _bool(cfg.get("fsdp_offload_params", False), "fsdp_config.fsdp_offload_params", source):
        plan.offload_param = plan.offload_optimizer = "cpu"
    if "fsdp_cpu_ram_efficient_loading" in cfg:
        plan.ram_efficient_loading = _bool(
            cfg["fsdp_cpu_ram_efficient_loading"],
            "fsdp_config.fsdp_cpu_ram_efficient_loading",
            source,
        )
    if "fsdp_state_dict_type" in cfg:
        sdt = _choice(
            cfg["fsdp_state_dict_type"],
            "fsdp_config.fsdp_state_dict_type",
            source,
            STATE_DICT_TYPES,
        )
        plan.full_state_dict = sdt == "FULL_STATE_DICT"
        if sdt == "LOCAL_STATE_DICT":
            plan.note(
                "changed",
                "fsdp_config.fsdp_state_dict_type",
                "LOCAL_STATE_DICT has no DeepSpeed twin; treated as SHARDED_STATE_DICT "
                "(zero3_save_16bit_model false)",
            )

    # Settings without a DeepSpeed twin: validated, kept for the way back, reported.
    checks: dict[str, tuple[str, ...] | type] = {
        "fsdp_backward_prefetch": PREFETCH,
        "fsdp_backward_prefetch_policy": PREFETCH,
        "fsdp_auto_wrap_policy": WRAP_POLICIES,
        "fsdp_forward_prefetch": bool,
        "fsdp_use_orig_params": bool,
        "fsdp_sync_module_states": bool,
        "fsdp_activation_checkpointing": bool,
        "fsdp_activation_checkpointing_offload": bool,
        "fsdp_transformer_layer_cls_to_wrap": str,
        "fsdp_min_num_params": int,
        "fsdp_ignored_modules": str,
    }
    for key, kind in checks.items():
        if key not in cfg:
            continue
        where = f"fsdp_config.{key}"
        value = cfg[key]
        if kind is bool:
            value = _bool(value, where, source)
        elif kind is int:
            value = _int(value, where, source)
        elif isinstance(kind, tuple):
            value = _choice(value, where, source, kind)
        else:
            value = str(value)
        if key == "fsdp_backward_prefetch_policy":  # the pre-1.0 name
            plan.note("changed", where, "old key name, read as fsdp_backward_prefetch")
            key = "fsdp_backward_prefetch"
        plan.fsdp_extra[key] = value
        if key == "fsdp_sync_module_states":
            plan.note(
                "not-mapped",
                where,
                f"{value!r}: no DeepSpeed twin; with zero3_init_flag "
                "DeepSpeed partitions the weights as they are created",
            )
            continue
        plan.note("not-mapped", where, f"{value!r}: {_NO_TWIN_IN_DS[key]}")
    return plan


_NO_TWIN_IN_DS = {
    "fsdp_backward_prefetch": "no DeepSpeed twin; ZeRO-3 prefetches by itself "
    "(tune stage3_prefetch_bucket_size / stage3_max_reuse_distance in a DeepSpeed JSON)",
    "fsdp_forward_prefetch": "no DeepSpeed twin; ZeRO-3 prefetches by itself",
    "fsdp_auto_wrap_policy": "no DeepSpeed twin; DeepSpeed partitions parameters without "
    "wrapping units",
    "fsdp_transformer_layer_cls_to_wrap": "no DeepSpeed twin; DeepSpeed needs no wrap classes",
    "fsdp_min_num_params": "no DeepSpeed twin; DeepSpeed needs no wrap policy",
    "fsdp_use_orig_params": "no DeepSpeed twin; DeepSpeed always exposes the original parameters",
    "fsdp_activation_checkpointing": "no key in DeepSpeed's accelerate config; enable "
    "gradient checkpointing in the model instead (model.gradient_checkpointing_enable())",
    "fsdp_activation_checkpointing_offload": "no DeepSpeed twin in accelerate's config",
    "fsdp_ignored_modules": "no DeepSpeed twin; DeepSpeed partitions every parameter",
}


def _fsdp_sharding(cfg: dict[str, Any], version: int, data: dict[str, Any], src: str | None) -> str:
    if version == 2:
        raf = _bool(
            cfg.get("fsdp_reshard_after_forward", True),
            "fsdp_config.fsdp_reshard_after_forward",
            src,
        )
        if "fsdp_sharding_strategy" in cfg:
            _fail(
                src,
                f"fsdp_config.fsdp_sharding_strategy {cfg['fsdp_sharding_strategy']!r} is an "
                "FSDP1 key; with fsdp_version 2 accepted: fsdp_reshard_after_forward true|false",
            )
        pc = data.get("parallelism_config") or {}
        replicate = _int(
            pc.get("parallelism_config_dp_replicate_size", 1),
            "parallelism_config.parallelism_config_dp_replicate_size",
            src,
        )
        shard = _int(
            pc.get("parallelism_config_dp_shard_size", 2),
            "parallelism_config.parallelism_config_dp_shard_size",
            src,
        )
        if replicate > 1 and shard == 1:
            return "NO_SHARD"
        if replicate > 1:
            cfg["_mesh_shard_size"] = shard  # read back by _plan_from_fsdp
            return "HYBRID_SHARD" if raf else "HYBRID_SHARD_ZERO2"
        return "FULL_SHARD" if raf else "SHARD_GRAD_OP"
    # FSDP1: accelerate 1.15 reads fsdp_sharding_strategy first, then
    # fsdp_reshard_after_forward (which takes the strategy names in FSDP1).
    given = {
        k: _strategy(cfg[k], f"fsdp_config.{k}", src)
        for k in ("fsdp_sharding_strategy", "fsdp_reshard_after_forward")
        if k in cfg
    }
    if len(set(given.values())) > 1:
        _fail(
            src,
            "fsdp_config.fsdp_sharding_strategy "
            f"{given['fsdp_sharding_strategy']!r} and fsdp_config.fsdp_reshard_after_forward "
            f"{given['fsdp_reshard_after_forward']!r} disagree; give one strategy",
        )
    return next(iter(given.values()), "FULL_SHARD")


def _strategy(value: Any, where: str, source: str | None) -> str:
    # Older accelerate wrote the strategy as its 1-based number.
    if (isinstance(value, int) and not isinstance(value, bool)) or str(value).isdigit():
        n = int(value)
        if 1 <= n <= len(FSDP_STRATEGIES):
            return FSDP_STRATEGIES[n - 1]
    elif isinstance(value, str) and value.upper() in FSDP_STRATEGIES:
        return value.upper()
    accepted = ", ".join(f"{s} ({i})" for i, s in enumerate(FSDP_STRATEGIES, 1))
    _fail(source, f"{where} {value!r} is not an FSDP sharding strategy; accepted: {accepted}")
    raise AssertionError("unreachable")


def _plan_from_deepspeed(data: dict[str, Any], source: str | None, base_dir: Path | None) -> Plan:
    plan = Plan()
    _read_top(plan, data, source, skip=("fsdp_config", "deepspeed_config"))
    cfg = data.get("deepspeed_config") or {}
    if not isinstance(cfg, dict):
        _fail(source, f"deepspeed_config must be a mapping, got {type(cfg).__name__}")
    _check_keys(cfg, DEEPSPEED_KEYS, "deepspeed_config", source)

    if cfg.get("deepspeed_config_file"):
        clash = [k for k in _DS_KEYS_FILE_OWNS if k in cfg]
        if data.get("mixed_precision") is not None:
            clash.append(f"mixed_precision {data['mixed_precision']!r} (top level)")
        if clash:
            _fail(
                source,
                f"deepspeed_config has both deepspeed_config_file and {', '.join(clash)}; "
                "accelerate refuses that pair: put these settings in the DeepSpeed JSON",
            )
        _read_ds_json(plan, cfg["deepspeed_config_file"], source, base_dir)
    else:
        plan.zero_stage = _int(
            cfg.get("zero_stage", 2), "deepspeed_config.zero_stage", source, (0, 1, 2, 3)
        )
        plan.offload_optimizer = _choice(
            cfg.get("offload_optimizer_device", "none"),
            "deepspeed_config.offload_optimizer_device",
            source,
            OFFLOAD_DEVICES,
            upper=False,
        )
        plan.offload_param = _choice(
            cfg.get("offload_param_device", "none"),
            "deepspeed_config.offload_param_device",
            source,
            OFFLOAD_DEVICES,
            upper=False,
        )
        if "zero3_save_16bit_model" in cfg:
            plan.full_state_dict = _bool(
                cfg["zero3_save_16bit_model"], "deepspeed_config.zero3_save_16bit_model", source
            )
        plan.grad_accum = _auto_or(
            cfg.get("gradient_accumulation_steps"),
            "deepspeed_config.gradient_accumulation_steps",
            source,
            int,
        )
        plan.grad_clip = _auto_or(
            cfg.get("gradient_clipping"), "deepspeed_config.gradient_clipping", source, float
        )
    if "zero3_init_flag" in cfg:
        plan.ram_efficient_loading = _bool(
            cfg["zero3_init_flag"], "deepspeed_config.zero3_init_flag", source
        )
    for key in sorted(cfg):
        if key.startswith("deepspeed_") and key != "deepspeed_config_file":
            plan.note(
                "not-mapped",
                f"deepspeed_config.{key}",
                f"{cfg[key]!r}: DeepSpeed-only launcher setting, no FSDP twin",
            )
        if "nvme_path" in key:
            plan.note(
                "not-mapped",
                f"deepspeed_config.{key}",
                f"{cfg[key]!r}: FSDP cannot offload to NVMe",
            )

    if plan.zero_stage == 3 and (plan.hpz_partition_size or 1) > 1:
        plan.sharding = "HYBRID_SHARD"
    else:
        plan.sharding = ZERO_TO_STRATEGY[plan.zero_stage]
    plan.note("mapped", "zero_stage", f"{plan.zero_stage} → {plan.sharding}")
    return plan


def _read_ds_json(plan: Plan, name: Any, source: str | None, base_dir: Path | None) -> None:
    path = Path(str(name))
    candidates = [path] if path.is_absolute() else [(base_dir or Path()) / path, path]
    found = next((p for p in candidates if p.is_file()), None)
    where = "deepspeed_config.deepspeed_config_file"
    if found is None:
        _fail(
            source,
            f"{where} {str(name)!r} does not exist (looked in: {', '.join(map(str, candidates))})",
        )
    assert found is not None
    try:
        ds = json.loads(found.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        _fail(source, f"{where} {str(name)!r} is not readable JSON: {exc}")
    if not isinstance(ds, dict):
        _fail(source, f"{where} {str(name)!r} must hold a JSON object")
    zero = ds.get("zero_optimization") or {}
    if not isinstance(zero, dict):
        _fail(source, f"{found}: zero_optimization must be an object")
    plan.zero_stage = _int(
        zero.get("stage", 0), f"{found}: zero_optimization.stage", source, (0, 1, 2, 3)
    )
    for attr, key in (
        ("offload_param", "offload_param"),
        ("offload_optimizer", "offload_optimizer"),
    ):
        device = (zero.get(key) or {}).get("device", "none")
        setattr(
            plan,
            attr,
            _choice(
                device,
                f"{found}: zero_optimization.{key}.device",
                source,
                OFFLOAD_DEVICES,
                upper=False,
            ),
        )
    if "stage3_gather_16bit_weights_on_model_save" in zero:
        plan.full_state_dict = _bool(
            zero["stage3_gather_16bit_weights_on_model_save"],
            f"{found}: stage3_gather_16bit_weights_on_model_save",
            source,
        )
    if "zero_hpz_partition_size" in zero:
        plan.hpz_partition_size = _int(
            zero["zero_hpz_partition_size"],
            f"{found}: zero_optimization.zero_hpz_partition_size",
            source,
        )
    plan.grad_accum = _auto_or(
        ds.get("gradient_accumulation_steps"), f"{found}: gradient_accumulation_steps", source, int
    )
    plan.grad_clip = _auto_or(
        ds.get("gradient_clipping"), f"{found}: gradient_clipping", source, float
    )
    bf16 = (ds.get("bf16") or {}).get("enabled")
    fp16 = (ds.get("fp16") or {}).get("enabled")
    if bf16 is True:
        plan.mixed_precision = "bf16"
    elif fp16 is True:
        plan.mixed_precision = "fp16"
    elif bf16 is False and fp16 in (False, None):
        plan.mixed_precision = "no"
    elif "auto" in (bf16, fp16):
        plan.note(
            "changed",
            "bf16/fp16.enabled",
            "'auto' in the DeepSpeed JSON: mixed "
            "precision comes from accelerate launch --mixed_precision; left unset",
        )
    for dotted in _leaf_keys(ds):
        if dotted in ("train_batch_size", "train_micro_batch_size_per_gpu"):
            plan.note(
                "not-mapped",
                dotted,
                f"{ds[dotted]!r}: an FSDP accelerate config has no "
                "batch size; the training script's dataloader sets it",
            )
        elif dotted not in _DS_JSON_READ:
            plan.note("not-mapped", dotted, "DeepSpeed-only setting, no FSDP twin")


def _leaf_keys(obj: dict[str, Any], prefix: str = "") -> list[str]:
    out: list[str] = []
    for key, value in obj.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.extend(_leaf_keys(value, dotted + "."))
        else:
            out.append(dotted)
    return out


def _plan_from_spec(
    data: dict[str, Any], to: Target, source: str | None
) -> tuple[Plan, dict[str, Any] | None]:
    from ..spec import parse_spec  # pydantic only; still no torch

    spec = parse_spec(data, source)
    s, r, t = spec.strategy, spec.resources, spec.train
    plan = Plan()
    plan.top = {
        "num_machines": r.nodes,
        "num_processes": spec.world_size,
        "use_cpu": r.device == "cpu",
        "compute_environment": "LOCAL_MACHINE",
        "machine_rank": 0,
        "rdzv_backend": "static",
        "same_network": True,
        "main_training_function": "main",
    }
    plan.zero_stage = int(s.zero_stage or 0)
    plan.sharding = (s.sharding or ZERO_TO_STRATEGY[plan.zero_stage]).upper()
    if s.offload == "params":
        plan.offload_param = plan.offload_optimizer = "cpu"
    elif s.offload == "optimizer":
        plan.offload_optimizer = "cpu"
    plan.mixed_precision = {
        "bf16-mixed": "bf16",
        "fp16-mixed": "fp16",
        "fp32": "no",
        "bf16-pure": "no",
    }[s.precision]
    if s.precision == "bf16-pure":
        plan.note(
            "precision",
            "strategy.precision",
            "'bf16-pure' has no accelerate mixed_precision value: it is mixed_precision 'no' "
            "with the model loaded in bf16 (FSDP only)",
        )
    if s.sharding == "hybrid_shard":
        plan.hpz_partition_size = r.procs_per_node
    plan.grad_accum = t.grad_accum
    plan.grad_clip = t.clip if t.clip > 0 else None
    plan.fsdp_version = 2  # shardctl trains with FSDP2
    plan.fsdp_extra["fsdp_auto_wrap_policy"] = "TRANSFORMER_BASED_WRAP"
    if isinstance(s.wrap, list):
        plan.fsdp_extra["fsdp_transformer_layer_cls_to_wrap"] = ",".join(s.wrap)
    if s.activation_checkpointing:
        plan.fsdp_extra["fsdp_activation_checkpointing"] = True
    plan.note(
        "mapped",
        "strategy",
        f"{s.backend} sharding {s.sharding} / zero_stage "
        f"{s.zero_stage} → {plan.sharding} / zero_stage {plan.zero_stage}",
    )
    if to == "deepspeed":
        for name, value in (
            ("strategy.wrap", s.wrap),
            ("strategy.backward_prefetch", s.backward_prefetch),
            ("strategy.forward_prefetch", s.forward_prefetch),
        ):
            plan.note("not-mapped", name, f"{value!r}: FSDP-only, no DeepSpeed twin")
        if s.activation_checkpointing:
            plan.note(
                "not-mapped",
                "strategy.activation_checkpointing",
                "no key in DeepSpeed's accelerate config; shardctl's own loop "
                "still checkpoints activations with either backend",
            )
    return plan, _spec_strategy(data, spec, to, plan)


def _spec_strategy(
    data: dict[str, Any], spec: Any, to: Target, plan: Plan
) -> dict[str, Any] | None:
    """The `strategy` section that runs the same job on the other backend, if valid."""
    from ..spec import parse_spec

    s = spec.strategy
    new: dict[str, Any] = {
        "backend": to,
        "offload": s.offload,
        "precision": s.precision,
        "activation_checkpointing": s.activation_checkpointing,
    }
    if to == "deepspeed":
        new["zero_stage"] = s.zero_stage
        if s.precision == "bf16-pure":
            new["precision"] = "bf16-mixed"
            plan.note(
                "changed",
                "strategy.precision",
                "'bf16-pure' cannot run on DeepSpeed "
                "(it always keeps fp32 master weights); the spec uses bf16-mixed",
            )
    else:
        if s.zero_stage == 1:
            new["sharding"] = "shard_grad_op"
            plan.note(
                "changed",
                "strategy.zero_stage",
                "1 (optimizer-state sharding only) "
                "has no FSDP mode; shard_grad_op also shards gradients",
            )
        else:
            new["sharding"] = s.sharding
        new.update(
            wrap=s.wrap, backward_prefetch=s.backward_prefetch, forward_prefetch=s.forward_prefetch
        )
    candidate = {**data, "strategy": new}
    if spec.launcher == "deepspeed" and to == "fsdp":
        candidate["launcher"] = "torchrun"
        plan.note("changed", "launcher", "'deepspeed' cannot start FSDP; the spec uses torchrun")
    try:
        parse_spec(candidate)
    except SpecError as exc:
        plan.note(
            "changed",
            "strategy",
            f"no valid {to} strategy for this spec: " + "; ".join(exc.problems),
        )
        return None
    return new


def _read_top(plan: Plan, data: dict[str, Any], source: str | None, skip: tuple[str, ...]) -> None:
    _check_keys(data, ACCELERATE_TOP_KEYS, "the accelerate config", source)
    env = data.get("compute_environment", "LOCAL_MACHINE")
    if env != "LOCAL_MACHINE":
        _fail(source, f"compute_environment {env!r} is not supported; accepted: LOCAL_MACHINE")
    if "mixed_precision" in data and data["mixed_precision"] is not None:
        plan.mixed_precision = _choice(
            data["mixed_precision"], "mixed_precision", source, MIXED_PRECISION, upper=False
        )
    for key, value in data.items():
        if key in skip or key in ("distributed_type", "mixed_precision"):
            continue
        if key == "parallelism_config" and value:
            extra = {
                k: v
                for k, v in value.items()
                if not k.endswith(("dp_replicate_size", "dp_shard_size"))
            }
            for k, v in extra.items():
                if v not in (1, None):
                    plan.note(
                        "not-mapped",
                        f"parallelism_config.{k}",
                        f"{v!r}: tensor/context parallelism has no ZeRO twin",
                    )
            continue
        plan.top[key] = value


# ------------------------------------------------------------------- writers


def _to_deepspeed(plan: Plan, json_path: str | None) -> tuple[dict[str, Any], dict | None]:
    stage = plan.zero_stage
    if plan.sharding == "HYBRID_SHARD":
        plan.note(
            "changed",
            "HYBRID_SHARD",
            "maps to ZeRO-3 with ZeRO++ hierarchical partitioning (hpZ: parameters sharded "
            "inside a node, replicated across nodes); accelerate's inline deepspeed_config "
            "cannot express hpZ"
            + (
                f", so the DeepSpeed JSON sets zero_hpz_partition_size {plan.hpz_partition_size}"
                if json_path and plan.hpz_partition_size
                else " — without a DeepSpeed JSON (--ds-json) with zero_hpz_partition_size = "
                "GPUs per node, ZeRO-3 shards across all nodes (more inter-node traffic); "
                "hpZ also keeps a secondary parameter copy per node, and ZeRO++'s other parts "
                "(qwZ, qgZ) are not enabled"
            ),
        )
    if plan.sharding == "HYBRID_SHARD_ZERO2":
        plan.note(
            "changed",
            "HYBRID_SHARD_ZERO2",
            "maps to ZeRO-2 across all ranks: DeepSpeed has no per-node replication for stage 2",
        )

    off_param, off_opt = plan.offload_param, plan.offload_optimizer
    fsdp_offload = plan.offload_param != "none" and plan.offload_optimizer != "none"
    if off_param != "none" and stage != 3:
        plan.note(
            "changed",
            "offload",
            f"DeepSpeed offloads parameters only at ZeRO-3 (here zero_stage {stage}); "
            + ("only the optimizer state goes to CPU" if stage else "nothing is offloaded"),
        )
        off_param = "none"
    if off_opt != "none" and stage == 0:
        off_opt = "none"
    plan.note(
        "mapped",
        "fsdp_offload_params",
        f"{str(fsdp_offload).lower()} → offload_param_device {off_param}, "
        f"offload_optimizer_device {off_opt}"
        + (" (FSDP's offload is all-or-nothing)" if fsdp_offload and stage == 3 else ""),
    )

    init = plan.ram_efficient_loading
    if init is not None:
        if init and stage != 3:
            plan.note(
                "changed",
                "fsdp_cpu_ram_efficient_loading",
                "true has a DeepSpeed twin "
                f"(zero3_init_flag) only at ZeRO-3; zero_stage {stage} loads the full "
                "model on every rank",
            )
            init = False
        else:
            plan.note("mapped", "fsdp_cpu_ram_efficient_loading", f"{init} → zero3_init_flag")

    ga = plan.grad_accum if plan.grad_accum is not None else "auto"
    clip = plan.grad_clip if plan.grad_clip is not None else "auto"
    if plan.grad_accum is None or plan.grad_clip is None:
        plan.note(
            "mapped",
            "gradient_accumulation_steps/gradient_clipping",
            "not in an FSDP accelerate config; set to 'auto' so DeepSpeed takes them "
            "from Accelerator(gradient_accumulation_steps=...) and clip_grad_norm_",
        )

    if plan.full_state_dict is not None:
        plan.note(
            "mapped",
            "fsdp_state_dict_type",
            f"{'FULL_STATE_DICT' if plan.full_state_dict else 'SHARDED_STATE_DICT'} → "
            f"zero3_save_16bit_model {str(plan.full_state_dict).lower()}"
            + (
                " (a 16-bit copy; FSDP's full state dict keeps the training dtype)"
                if plan.full_state_dict
                else ""
            )
            + (
                ""
                if stage == 3
                else f"; below ZeRO-3 (here {stage}) the saved model is whole anyway"
            ),
        )

    config: dict[str, Any] = {**plan.top, "distributed_type": "DEEPSPEED"}
    config.setdefault("compute_environment", "LOCAL_MACHINE")
    ds_json = None
    if json_path:
        zero: dict[str, Any] = {"stage": stage}
        if off_opt != "none":
            zero["offload_optimizer"] = {"device": off_opt}
        if off_param != "none":
            zero["offload_param"] = {"device": off_param}
        if plan.full_state_dict is not None:
            zero["stage3_gather_16bit_weights_on_model_save"] = plan.full_state_dict
        if plan.sharding == "HYBRID_SHARD" and plan.hpz_partition_size:
            zero["zero_hpz_partition_size"] = plan.hpz_partition_size
        ds_json = {
            "train_batch_size": "auto",
            "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": ga,
            "gradient_clipping": clip,
            "zero_optimization": zero,
        }
        mp = plan.mixed_precision
        if mp is not None:
            ds_json["bf16"] = {"enabled": mp in ("bf16", "fp8")}
            ds_json["fp16"] = {"enabled": mp == "fp16"}
        ds: dict[str, Any] = {"deepspeed_config_file": json_path}
        if init is not None:
            ds["zero3_init_flag"] = init
        # accelerate refuses mixed_precision next to a deepspeed_config_file: it is in the JSON.
        config.pop("mixed_precision", None)
    else:
        ds = {
            "zero_stage": stage,
            "offload_optimizer_device": off_opt,
            "offload_param_device": off_param,
            "gradient_accumulation_steps": ga,
            "gradient_clipping": clip,
        }
        if init is not None:
            ds["zero3_init_flag"] = init
        if plan.full_state_dict is not None:
            ds["zero3_save_16bit_model"] = plan.full_state_dict
        if plan.mixed_precision is not None:
            config["mixed_precision"] = plan.mixed_precision
    config["deepspeed_config"] = ds
    return config, ds_json


def _to_fsdp(plan: Plan, version: int | None) -> dict[str, Any]:
    sharding = plan.sharding
    if plan.zero_stage == 1:
        plan.note(
            "changed",
            "zero_stage",
            "1 (optimizer-state sharding only) has no FSDP "
            "mode; SHARD_GRAD_OP is the nearest (it also shards gradients)",
        )
    # FSDP2 has no strategy enum: NO_SHARD/HYBRID_SHARD are a replicate × shard mesh
    # in parallelism_config, which needs the process counts.
    mesh = _fsdp2_mesh(plan) if sharding not in ("FULL_SHARD", "SHARD_GRAD_OP") else None
    if version is None:
        version = plan.fsdp_version or 2
        if version == 2 and sharding not in ("FULL_SHARD", "SHARD_GRAD_OP") and mesh is None:
            version = 1
            plan.note(
                "changed",
                "fsdp_version",
                f"1: {sharding} in FSDP2 needs num_processes (and num_machines) to build the "
                "replicate × shard mesh; without them only the FSDP1 key style can say it",
            )
    if version == 2 and sharding not in ("FULL_SHARD", "SHARD_GRAD_OP") and mesh is None:
        raise SpecError(
            [
                f"fsdp_version 2 expresses sharding {sharding} as a parallelism_config mesh, "
                "which needs num_processes (and num_machines > 1 for HYBRID_SHARD) in the "
                "config; accepted: add them, or --fsdp-version 1"
            ]
        )

    cfg: dict[str, Any] = {"fsdp_version": version}
    if version == 1:
        # accelerate 1.15 reads fsdp_sharding_strategy for FSDP1 and documents
        # fsdp_reshard_after_forward as its successor: write both, equal.
        cfg["fsdp_sharding_strategy"] = sharding
        cfg["fsdp_reshard_after_forward"] = sharding
        mesh = None
    else:
        cfg["fsdp_reshard_after_forward"] = sharding in ("FULL_SHARD", "HYBRID_SHARD")
    if sharding == "HYBRID_SHARD":
        plan.note(
            "changed",
            "zero_hpz_partition_size",
            f"{plan.hpz_partition_size} → "
            "HYBRID_SHARD: FSDP shards within each node (the node size comes from the "
            "launch, not from the config)",
        )

    off = plan.offload_param != "none" or plan.offload_optimizer != "none"
    if plan.offload_param != plan.offload_optimizer:
        plan.note(
            "changed",
            "offload",
            f"offload_param_device {plan.offload_param!r} and "
            f"offload_optimizer_device {plan.offload_optimizer!r}: FSDP offloads all or "
            f"nothing, so fsdp_offload_params is {str(off).lower()} (parameters, gradients "
            "and the optimizer step all move to CPU)",
        )
    if "nvme" in (plan.offload_param, plan.offload_optimizer):
        plan.note("changed", "offload", "FSDP cannot offload to NVMe; it offloads to CPU")
    if off and sharding == "NO_SHARD":
        plan.note(
            "changed",
            "offload",
            "FSDP offloads only sharded parameters; NO_SHARD keeps everything on the device",
        )
        off = False
    cfg["fsdp_offload_params"] = off
    plan.note(
        "mapped",
        "offload_param_device/offload_optimizer_device",
        f"{plan.offload_param}/{plan.offload_optimizer} → fsdp_offload_params {str(off).lower()}",
    )

    if plan.ram_efficient_loading is not None:
        cfg["fsdp_cpu_ram_efficient_loading"] = plan.ram_efficient_loading
        plan.note(
            "mapped",
            "zero3_init_flag",
            f"{str(plan.ram_efficient_loading).lower()} → fsdp_cpu_ram_efficient_loading",
        )
        if plan.ram_efficient_loading:
            if version == 1:
                cfg["fsdp_sync_module_states"] = True
                plan.note(
                    "changed",
                    "fsdp_sync_module_states",
                    "forced to true: with "
                    "cpu-RAM-efficient loading only rank 0 loads the weights and "
                    "sync_module_states broadcasts them to the other ranks",
                )
            else:
                plan.note(
                    "mapped",
                    "fsdp_sync_module_states",
                    "not written: FSDP2 broadcasts rank 0's weights itself",
                )
    extra = dict(plan.fsdp_extra)
    if version == 1 and "fsdp_sync_module_states" in extra:
        cfg.setdefault("fsdp_sync_module_states", extra["fsdp_sync_module_states"])
    if plan.full_state_dict is not None:
        plan.note(
            "mapped",
            "zero3_save_16bit_model",
            f"{str(plan.full_state_dict).lower()} → fsdp_state_dict_type "
            + ("FULL_STATE_DICT" if plan.full_state_dict else "SHARDED_STATE_DICT"),
        )
        cfg["fsdp_state_dict_type"] = (
            "FULL_STATE_DICT" if plan.full_state_dict else "SHARDED_STATE_DICT"
        )
    if "fsdp_auto_wrap_policy" not in extra:
        plan.note(
            "changed",
            "fsdp_auto_wrap_policy",
            "TRANSFORMER_BASED_WRAP (FSDP needs a "
            "wrap policy, DeepSpeed none); accelerate finds the block classes of "
            "transformers models, else set fsdp_transformer_layer_cls_to_wrap",
        )
    cfg["fsdp_auto_wrap_policy"] = extra.pop("fsdp_auto_wrap_policy", "TRANSFORMER_BASED_WRAP")
    v1_only = (
        "fsdp_backward_prefetch",
        "fsdp_forward_prefetch",
        "fsdp_use_orig_params",
        "fsdp_sync_module_states",
    )
    for key, value in extra.items():
        if version == 2 and key in v1_only:
            plan.note("not-mapped", key, f"{value!r}: FSDP1-only setting, not written for FSDP2")
            continue
        if key == "fsdp_activation_checkpointing_offload" and version != 2:
            continue
        cfg.setdefault(key, value)

    if plan.grad_accum is not None or plan.grad_clip is not None:
        plan.note(
            "not-mapped",
            "gradient_accumulation_steps/gradient_clipping",
            f"{plan.grad_accum!r}/{plan.grad_clip!r}: an FSDP accelerate config has no "
            "such keys; pass Accelerator(gradient_accumulation_steps=...) and call "
            "accelerator.clip_grad_norm_(..., max_norm) in the training script",
        )
    config: dict[str, Any] = {**plan.top, "distributed_type": "FSDP", "fsdp_config": cfg}
    if mesh:
        config["parallelism_config"] = mesh
    config.setdefault("compute_environment", "LOCAL_MACHINE")
    if plan.mixed_precision is not None:
        config["mixed_precision"] = plan.mixed_precision
    return config


def _fsdp2_mesh(plan: Plan) -> dict[str, int] | None:
    """FSDP2's replicate × shard mesh for NO_SHARD / HYBRID_SHARD, if the counts are known."""
    procs, nodes = plan.top.get("num_processes"), plan.top.get("num_machines")
    if not isinstance(procs, int) or procs < 2:
        return None
    if plan.sharding == "NO_SHARD":
        replicate, shard = procs, 1
    else:
        shard = plan.hpz_partition_size or 0
        if not shard and isinstance(nodes, int) and nodes > 1 and procs % nodes == 0:
            shard = procs // nodes
        if shard < 2 or procs % shard or procs == shard:
            return None
        replicate = procs // shard
    return {
        "parallelism_config_dp_replicate_size": replicate,
        "parallelism_config_dp_shard_size": shard,
    }


def _precision_notes(plan: Plan, kind: str, to: Target) -> None:
    plan.note("precision", "mixed_precision", PRECISION_NOTE)
    mp = plan.mixed_precision
    if to == "deepspeed" and mp in (None, "no"):
        plan.note(
            "precision",
            "mixed_precision",
            f"{mp!r} under FSDP trains in the load dtype; "
            "under DeepSpeed the optimizer keeps fp32 masters — if the model is loaded in "
            "bf16 this is a different training run",
        )
    if to == "fsdp" and mp in (None, "no"):
        plan.note(
            "precision",
            "mixed_precision",
            f"{mp!r}: DeepSpeed trained with fp32 masters; "
            "under FSDP a model loaded in bf16 would now train in pure bf16 — load it in "
            "fp32 or set mixed_precision bf16",
        )


# ------------------------------------------------------------------- value checks


def _fail(source: str | None, problem: str) -> None:
    raise SpecError([problem], source)


def _check_keys(
    cfg: dict[str, Any], allowed: frozenset[str], where: str, source: str | None
) -> None:
    for key in cfg:
        if key not in allowed:
            hint = difflib.get_close_matches(str(key), allowed, n=1, cutoff=0.6)
            did_you_mean = f"; did you mean {hint[0]!r}?" if hint else ""
            _fail(
                source,
                f"unknown key {key!r} in {where}{did_you_mean} "
                f"(accepted: {', '.join(sorted(allowed))})",
            )


def _bool(value: Any, where: str, source: str | None) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("y", "yes", "t", "true", "on", "1"):
        return True
    if text in ("n", "no", "f", "false", "off", "0"):
        return False
    _fail(source, f"{where} {value!r} is not a boolean; accepted: true, false")
    raise AssertionError("unreachable")


def _int(
    value: Any, where: str, source: str | None, accepted: tuple[int, ...] | None = None
) -> int:
    ok = isinstance(value, int) and not isinstance(value, bool)
    if not ok and isinstance(value, str) and value.strip().isdigit():
        value, ok = int(value), True
    if (
        not ok
        or (accepted is not None and value not in accepted)
        or (accepted is None and value < 0)
    ):
        want = ", ".join(map(str, accepted)) if accepted else "a non-negative integer"
        _fail(source, f"{where} {value!r} is not valid; accepted: {want}")
    return int(value)


def _choice(
    value: Any, where: str, source: str | None, accepted: tuple[str, ...], upper: bool = True
) -> str:
    text = str(value)
    norm = text.upper() if upper else text.lower()
    if norm not in accepted:
        _fail(source, f"{where} {value!r} is not valid; accepted: {', '.join(accepted)}")
    return norm


def _auto_or(value: Any, where: str, source: str | None, kind: type) -> Any:
    if value is None or value == "auto":
        return value
    try:
        number = kind(value)
    except (TypeError, ValueError):
        number = None
    if number is None or isinstance(value, bool) or number < 0 or (kind is int and number < 1):
        _fail(source, f"{where} {value!r} is not valid; accepted: 'auto' or a positive number")
    return number
