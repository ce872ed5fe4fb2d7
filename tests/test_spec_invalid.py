"""Invalid job specs: each is rejected with a message naming the field and the bad value.

Every case starts from the tiny-llama example and breaks one thing. Cases run through
`parse_spec`; every third one (and the file-level ones) also through `shardctl
validate`, which must exit 2 with the message and no traceback.
"""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner
from shardctl.orchestrator.cli import cli
from shardctl.orchestrator.errors import SpecError
from shardctl.orchestrator.spec import load_spec, parse_spec

ROOT = Path(__file__).resolve().parent.parent
BASE: dict[str, Any] = yaml.safe_load((ROOT / "examples" / "tiny-llama.yaml").read_text())
DELETE = object()


def spec(**changes: Any) -> dict[str, Any]:
    """The example with `section__field=value` changes (DELETE removes the key)."""
    data = copy.deepcopy(BASE)
    for dotted, value in changes.items():
        *parents, last = dotted.split("__")
        node = data
        for part in parents:
            node = node.setdefault(part, {})
        if value is DELETE:
            node.pop(last, None)
        else:
            node[last] = value
    return data


CUDA = {"resources__device": "cuda"}
DS = {"strategy__backend": "deepspeed", "strategy__sharding": DELETE}

# (id, spec data, substrings the message must contain: field, value, what is accepted)
CASES: list[tuple[str, dict[str, Any], list[str]]] = [
    # unknown keys, with a close-match suggestion, at every depth
    ("unknown-top", spec(nmae="x"), ["unknown key 'nmae'", "did you mean 'name'"]),
    (
        "unknown-strategy",
        spec(strategy__shardng="full_shard"),
        ["'strategy.shardng'", "did you mean 'sharding'", "accepted:"],
    ),
    (
        "unknown-data",
        spec(train__data__bultin="python-stdlib"),
        ["'train.data.bultin'", "did you mean 'builtin'"],
    ),
    ("unknown-slurm", spec(slurm={"partiton": "gpu"}), ["'slurm.partiton'", "'partition'"]),
    (
        "unknown-k8s-toleration",
        spec(k8s={"tolerations": [{"efect": "NoSchedule"}]}),
        ["'k8s.tolerations[0].efect'", "did you mean 'effect'"],
    ),
    (
        "unknown-no-suggestion",
        spec(checkpoint__zzzzzz=1),
        ["'checkpoint.zzzzzz'", "accepted: async, consolidate_dtype"],
    ),
    # model shapes that only fail once the ranks start, caught up front
    (
        "llama-heads-not-dividing",
        spec(train__model__llama__num_attention_heads=3),
        ["llama.hidden_size (128)", "num_attention_heads (3)", "divisible"],
    ),
    (
        "llama-kv-heads-not-dividing",
        spec(train__model__llama__num_key_value_heads=3),
        ["num_attention_heads (4)", "num_key_value_heads (3)", "divisible"],
    ),
    (
        "zero-stage-bool",
        spec(strategy__zero_stage=True),
        ["strategy.zero_stage", "True", "0, 1, 2, 3"],
    ),
    # names: a Slurm job name and a DNS-1123 label
    ("name-uppercase", spec(name="Tiny"), ["name", "'Tiny'", "lower-case"]),
    ("name-underscore", spec(name="tiny_llama"), ["name", "'tiny_llama'", "lower-case"]),
    ("name-too-long", spec(name="a" * 51), ["name", "'" + "a" * 51 + "'", "1-50"]),
    ("name-leading-dash", spec(name="-tiny"), ["name", "'-tiny'", "starting and ending"]),
    ("name-trailing-dash", spec(name="tiny-"), ["name", "'tiny-'"]),
    ("name-unicode", spec(name="tiny-llamä"), ["name", "'tiny-llamä'"]),
    ("name-empty", spec(name=""), ["name", "''"]),
    ("name-not-string", spec(name=True), ["name", "valid string", "True"]),
    ("name-missing", spec(name=DELETE), ["name: required but missing"]),
    # sharding ⇄ zero_stage
    (
        "sharding-zero-disagree",
        spec(strategy__zero_stage=2),
        ["strategy.sharding 'full_shard'", "strategy.zero_stage 2", "disagree", "ZeRO stage 3"],
    ),
    (
        "zero1-with-fsdp",
        spec(strategy__sharding=DELETE, strategy__zero_stage=1),
        ["strategy.zero_stage 1", "no FSDP equivalent", "zero_stage 0, 2 or 3"],
    ),
    (
        "sharding-unknown",
        spec(strategy__sharding="quarter_shard"),
        ["strategy.sharding", "'quarter_shard'", "'full_shard', 'shard_grad_op'"],
    ),
    (
        "zero-stage-5",
        spec(**DS, strategy__zero_stage=5),
        ["strategy.zero_stage", "got 5", "0, 1, 2 or 3"],
    ),
    (
        "backend-unknown",
        spec(strategy__backend="megatron"),
        ["strategy.backend", "'megatron'", "'fsdp' or 'deepspeed'"],
    ),
    # offload
    (
        "offload-on-cpu",
        spec(strategy__offload="params"),
        ["strategy.offload 'params'", "resources.device is 'cpu'", "accepted on cpu: none"],
    ),
    (
        "offload-optimizer-fsdp",
        spec(**CUDA, strategy__offload="optimizer"),
        ["strategy.offload 'optimizer'", "FSDP", "accepted with fsdp: none, params"],
    ),
    (
        "offload-params-zero2",
        spec(**CUDA, **DS, strategy__zero_stage=2, strategy__offload="params"),
        ["strategy.offload 'params'", "ZeRO stage 3", "zero_stage 2", "offload optimizer"],
    ),
    (
        "offload-no-shard",
        spec(**CUDA, strategy__sharding="no_shard", strategy__offload="params"),
        ["strategy.offload 'params'", "'no_shard'", "accepted: full_shard"],
    ),
    (
        "offload-zero0",
        spec(**CUDA, **DS, strategy__zero_stage=0, strategy__offload="optimizer"),
        ["strategy.offload 'optimizer'", "zero_stage 0"],
    ),
    (
        "offload-unknown",
        spec(strategy__offload="disk"),
        ["strategy.offload", "'disk'", "'none', 'optimizer' or 'params'"],
    ),
    # precision
    (
        "bf16-pure-deepspeed",
        spec(**DS, strategy__precision="bf16-pure"),
        [
            "strategy.precision 'bf16-pure'",
            "deepspeed",
            "DeepSpeed always keeps fp32 master weights",
            "accepted: bf16-mixed",
        ],
    ),
    (
        "fp16-on-cpu",
        spec(strategy__precision="fp16-mixed"),
        ["strategy.precision 'fp16-mixed'", "resources.device 'cpu'", "accepted: bf16-mixed"],
    ),
    ("precision-unknown", spec(strategy__precision="fp8"), ["strategy.precision", "'fp8'"]),
    (
        "hybrid-one-node",
        spec(strategy__sharding="hybrid_shard"),
        ["strategy.sharding 'hybrid_shard'", "resources.nodes >= 2", "got 1", "full_shard"],
    ),
    ("wrap-empty", spec(strategy__wrap=[]), ["strategy.wrap", "empty list", "'auto' or class"]),
    ("wrap-bad-class", spec(strategy__wrap=["Llama Layer"]), ["strategy.wrap", "'Llama Layer'"]),
    # sizes
    ("nodes-zero", spec(resources__nodes=0), ["resources.nodes", "greater than 0", "got 0"]),
    (
        "procs-negative",
        spec(resources__procs_per_node=-2),
        ["resources.procs_per_node", "greater than 0", "got -2"],
    ),
    ("nodes-bool", spec(resources__nodes=True), ["resources.nodes", "valid integer", "True"]),
    ("nodes-float", spec(resources__nodes=2.5), ["resources.nodes", "2.5"]),
    ("steps-zero", spec(train__steps=0), ["train.steps", "greater than 0", "got 0"]),
    ("steps-string", spec(train__steps="many"), ["train.steps", "'many'"]),
    ("steps-missing", spec(train__steps=DELETE), ["train.steps: required but missing"]),
    ("batch-zero", spec(train__micro_batch_size=0), ["train.micro_batch_size", "got 0"]),
    ("seq-len-negative", spec(train__seq_len=-128), ["train.seq_len", "got -128"]),
    ("grad-accum-zero", spec(train__grad_accum=0), ["train.grad_accum", "got 0"]),
    ("lr-zero", spec(train__lr=0), ["train.lr", "greater than 0", "got 0"]),
    ("lr-negative", spec(train__lr=-1e-3), ["train.lr", "got -0.001"]),
    ("lr-infinite", spec(train__lr=float("inf")), ["train.lr", "finite number", "got inf"]),
    ("clip-negative", spec(train__clip=-1.0), ["train.clip", "got -1.0"]),
    (
        "warmup-over-steps",
        spec(train__warmup_steps=500),
        ["train.warmup_steps (500)", "train.steps (200)", "accepted: 0..200"],
    ),
    (
        "min-lr-ratio",
        spec(train__min_lr_ratio=2),
        ["train.min_lr_ratio: 2 is more than 1.0, the most shardctl accepts"],
    ),
    # checkpoints
    ("keep-one", spec(checkpoint__keep=1), ["checkpoint.keep", "greater than or equal to 2", "1"]),
    (
        "every-over-steps",
        spec(checkpoint__every_steps=500),
        ["checkpoint.every_steps (500)", "train.steps (200)", "accepted: 1..200"],
    ),
    ("resume-empty", spec(checkpoint__resume="  "), ["checkpoint.resume", "'auto', 'never'"]),
    (
        "async-not-bool",
        spec(checkpoint={"async": "sometimes"}),
        ["checkpoint.async", "'sometimes'"],
    ),
    # launcher/backend pairs
    (
        "launcher-deepspeed-fsdp",
        spec(launcher="deepspeed"),
        [
            "launcher 'deepspeed'",
            "strategy.backend 'fsdp'",
            "accepted launchers for fsdp: torchrun",
        ],
    ),
    ("launcher-unknown", spec(launcher="mpirun"), ["launcher", "'mpirun'", "'torchrun'"]),
    (
        "deepspeed-launcher-cpu-multinode",
        spec(**DS, launcher="deepspeed", resources__nodes=2),
        ["launcher 'deepspeed'", "use torchrun"],
    ),
    ("device-unknown", spec(resources__device="tpu"), ["resources.device", "'tpu'", "'cpu' or"]),
    ("memory-bad", spec(resources__memory="lots"), ["resources.memory", "'lots'", "'64G'"]),
    # env
    ("env-reserved-rank", spec(env={"RANK": "0"}), ["env", "RANK", "set by the launcher"]),
    ("env-reserved-master-addr", spec(env={"MASTER_ADDR": "x"}), ["MASTER_ADDR"]),
    ("env-bad-name", spec(env={"1BAD": "x"}), ["env", "'1BAD'", "environment variable name"]),
    ("env-name-with-dash", spec(env={"MY-VAR": "x"}), ["'MY-VAR'"]),
    ("env-null-value", spec(env={"FOO": None}), ["env.FOO", "valid string", "None"]),
    # slurm
    (
        "slurm-time-words",
        spec(slurm={"time": "soon"}),
        ["slurm.time", "'soon'", "H:M:S", "D-H:M:S"],
    ),
    ("slurm-time-zero", spec(slurm={"time": "00:00:00"}), ["slurm.time", "'00:00:00'"]),
    (
        "slurm-partition-space",
        spec(slurm={"partition": "gpu nodes"}),
        ["slurm.partition", "'gpu nodes'", "without spaces"],
    ),
    ("slurm-signal", spec(slurm={"signal": "KILL"}), ["slurm.signal", "'KILL'", "'USR2'"]),
    (
        "slurm-setup-newline",
        spec(slurm={"setup": ["module load a\nrm -rf /"]}),
        ["slurm.setup", "no newlines"],
    ),
    ("local-port-low", spec(local={"master_port": 80}), ["local.master_port", "got 80", "1024"]),
    # k8s
    (
        "k8s-namespace",
        spec(k8s={"namespace": "My_NS"}),
        ["k8s.namespace", "'My_NS'", "lower-case letters"],
    ),
    (
        "k8s-namespace-with-dot",
        spec(k8s={"namespace": "team.ml"}),
        ["k8s.namespace", "'team.ml'", "no '.'"],
    ),
    ("k8s-shm-quantity", spec(k8s={"shm_size": "lots"}), ["k8s.shm_size", "'lots'", "'64Gi'"]),
    ("k8s-cpu-quantity", spec(k8s={"cpu": "2 cores"}), ["k8s.cpu", "'2 cores'"]),
    (
        "k8s-restart-policy",
        spec(k8s={"restart_policy": "Sometimes"}),
        ["k8s.restart_policy", "'Sometimes'", "'OnFailure'"],
    ),
    (
        "k8s-elastic-order",
        spec(k8s={"elastic": {"min_nodes": 3, "max_nodes": 2}}),
        ["k8s.elastic.min_nodes (3) > max_nodes (2)"],
    ),
    (
        "k8s-elastic-range",
        spec(k8s={"elastic": {"min_nodes": 2, "max_nodes": 4}}),
        ["resources.nodes (1)", "k8s.elastic [2, 4]"],
    ),
    # model and data sources
    (
        "model-two-sources",
        spec(train__model__pretrained="/models/llama"),
        ["train.model", "exactly one of llama, pretrained, factory", "['llama', 'pretrained']"],
    ),
    (
        "model-no-source",
        spec(train__model={"dtype": "bf16"}),
        ["train.model", "exactly one", "got none"],
    ),
    (
        "model-bad-factory",
        spec(train__model={"factory": "not a factory"}),
        ["train.model.factory", "'not a factory'", "'package.module:function'"],
    ),
    (
        "model-factory-no-colon",
        spec(train__model={"factory": "pkg.module.fn"}),
        ["train.model.factory", "'pkg.module.fn'"],
    ),
    (
        "model-llama-negative",
        spec(train__model__llama__hidden_size=-1),
        ["llama.hidden_size", "positive integer", "-1"],
    ),
    ("data-no-source", spec(train__data={}), ["train.data", "exactly one", "got none"]),
    (
        "data-two-sources",
        spec(train__data={"builtin": "python-stdlib", "text": "a.txt"}),
        ["train.data", "exactly one"],
    ),
    (
        "data-bad-builtin",
        spec(train__data={"builtin": "wikipedia"}),
        ["train.data.builtin", "'wikipedia'", "'python-stdlib'"],
    ),
    # whole sections of the wrong shape
    ("strategy-a-list", spec(strategy=["fsdp"]), ["strategy", "valid dictionary"]),
    (
        "train-missing",
        spec(train=DELETE),
        ["give exactly one of train (the built-in loop) and entrypoint", "got neither"],
    ),
    ("train-and-entrypoint", spec(entrypoint={"script": "t.py"}), ["got both"]),
    (
        "entrypoint-neither",
        spec(train=DELETE, entrypoint={"args": ["x"]}),
        ["entrypoint: give exactly one of script, module (got none)"],
    ),
    (
        "entrypoint-both",
        spec(train=DELETE, entrypoint={"script": "t.py", "module": "m"}),
        ["got script and module"],
    ),
    (
        "entrypoint-module",
        spec(train=DELETE, entrypoint={"module": "my-pkg.train"}),
        ["entrypoint.module", "'my-pkg.train' is not a module name"],
    ),
    (
        "entrypoint-arg-number",
        spec(train=DELETE, entrypoint={"script": "t.py", "args": [0.001]}),
        ["entrypoint.args[0]", "0.001"],
    ),
    (
        "entrypoint-typo",
        spec(train=DELETE, entrypoint={"scirpt": "t.py"}),
        ["unknown key 'entrypoint.scirpt'", "did you mean 'script'?"],
    ),
    (
        "entrypoint-code-dir-module",
        spec(train=DELETE, entrypoint={"module": "m", "code_dir": "."}),
        ["code_dir goes with entrypoint.script"],
    ),
    # watchdog: hang detection
    (
        "watchdog-typo",
        spec(watchdog={"hang_timout_s": 60}),
        ["'watchdog.hang_timout_s'", "did you mean 'hang_timeout_s'"],
    ),
    ("watchdog-huge", spec(watchdog__hang_timeout_s=1e30), ["watchdog.hang_timeout_s", "1e+30"]),
    ("watchdog-short", spec(watchdog__hang_timeout_s=4), ["watchdog.hang_timeout_s", "4", "5"]),
    ("watchdog-text", spec(watchdog__hang_timeout_s="\t60"), ["watchdog.hang_timeout_s"]),
    (
        "watchdog-order",
        spec(watchdog={"hang_timeout_s": 600, "collective_timeout_s": 300}),
        ["collective_timeout_s 300 is not above hang_timeout_s 600", "e.g. 720"],
    ),
    ("watchdog-enabled", spec(watchdog__enabled="sometimes"), ["watchdog.enabled", "sometimes"]),
    (
        "watchdog-startup-typo",
        spec(watchdog={"startup_timout_s": 900}),
        ["'watchdog.startup_timout_s'", "did you mean 'startup_timeout_s'"],
    ),
    (
        "watchdog-startup-short",
        spec(watchdog__startup_timeout_s=4),
        ["watchdog.startup_timeout_s", "4", "5"],
    ),
    (
        "watchdog-startup-text",
        spec(watchdog__startup_timeout_s="15m"),
        ["startup_timeout_s", "15m"],
    ),
    (
        "watchdog-startup-below-hang",
        spec(watchdog={"hang_timeout_s": 600, "startup_timeout_s": 300}),
        ["startup_timeout_s 300 is below hang_timeout_s 600", "e.g. 900"],
    ),
    (
        "watchdog-collective-below-startup",
        spec(watchdog={"startup_timeout_s": 900, "collective_timeout_s": 600}),
        ["collective_timeout_s 600 is not above startup_timeout_s 900", "e.g. 1020"],
    ),
    ("watchdog-not-a-map", spec(watchdog=[1]), ["watchdog"]),
]

assert len(CASES) >= 40
assert len({case_id for case_id, _, _ in CASES}) == len(CASES)


@pytest.mark.parametrize(("case_id", "data", "expected"), CASES, ids=[c[0] for c in CASES])
def test_invalid_spec_message_names_field_and_value(case_id: str, data: dict, expected: list[str]):
    with pytest.raises(SpecError) as exc:
        parse_spec(data, "job.yaml")
    message = str(exc.value)
    assert message.startswith("job.yaml: invalid job spec")
    for part in expected:
        assert part in message, f"{case_id}: {part!r} not in {message!r}"
    assert "Traceback" not in message
    assert exc.value.exit_code == 2


CLI_CASES = CASES[::3]


@pytest.mark.parametrize(("case_id", "data", "expected"), CLI_CASES, ids=[c[0] for c in CLI_CASES])
def test_invalid_spec_exits_2_through_shardctl_validate(
    tmp_path: Path, case_id: str, data: dict, expected: list[str]
):
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(data, allow_unicode=True), encoding="utf-8")
    result = CliRunner().invoke(cli, ["validate", str(path)])
    assert result.exit_code == 2, (result.output, result.exception)
    assert result.stdout == ""
    for part in expected:
        assert part in result.stderr, f"{case_id}: {part!r} not in {result.stderr!r}"
    assert "Traceback" not in result.stderr


# ---------------------------------------------------------------- file-level problems

FILE_CASES = [
    ("yaml-syntax", "name: tiny\nresources:\n  nodes: [1\n", ["not valid YAML at line 4"]),
    ("yaml-tab-indent", "name: tiny\nresources:\n\tnodes: 1\n", ["not valid YAML at line 3"]),
    ("top-level-list", "- name: tiny\n", ["top level must be a mapping", "got list"]),
    ("top-level-scalar", "just words\n", ["top level must be a mapping", "got str"]),
    ("empty-file", "", ["top level must be a mapping", "the file is empty"]),
    ("comments-only", "# nothing here\n", ["the file is empty"]),
    (
        "several-problems",
        "name: BAD\ntrain:\n  steps: 0\n  model: {llama: {}}\n  data: {builtin: python-stdlib}\n",
        ["2 problems", "name: 'BAD'", "train.steps"],
    ),
]


@pytest.mark.parametrize(
    ("case_id", "text", "expected"), FILE_CASES, ids=[c[0] for c in FILE_CASES]
)
def test_bad_files_are_rejected_by_load_spec(
    tmp_path: Path, case_id: str, text: str, expected: list[str]
):
    path = tmp_path / "job.yaml"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(SpecError) as exc:
        load_spec(path)
    for part in expected:
        assert part in str(exc.value), f"{case_id}: {part!r} not in {exc.value}"


def test_missing_file_is_exit_2_and_names_the_path(tmp_path: Path):
    missing = tmp_path / "nope.yaml"
    result = CliRunner().invoke(cli, ["validate", str(missing)])
    assert result.exit_code == 2
    assert f"file '{missing}' does not exist" in result.stderr


def test_not_utf8_file_is_exit_2(tmp_path: Path):
    path = tmp_path / "job.yaml"
    path.write_bytes(b"name: \xff\xfe\n")
    result = CliRunner().invoke(cli, ["validate", str(path)])
    assert result.exit_code == 2
    assert "cannot read" in result.stderr


def test_real_process_exit_code_and_no_traceback(tmp_path: Path):
    """The installed entry point, in its own process: exit 2, one message, no traceback."""
    bad = tmp_path / "job.yaml"
    bad.write_text("name: tiny\nresources:\n  nodes: [1\n", encoding="utf-8")
    unknown = tmp_path / "unknown.yaml"
    unknown.write_text(yaml.safe_dump(spec(strategy__shardng="full_shard")), encoding="utf-8")
    for path, expected in ((bad, "not valid YAML at line 4"), (unknown, "did you mean 'sharding'")):
        proc = subprocess.run(
            [sys.executable, "-m", "shardctl.orchestrator.cli", "validate", str(path)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert proc.returncode == 2, proc.stderr
        assert expected in proc.stderr
        assert "Traceback" not in proc.stderr
        assert proc.stdout == ""
