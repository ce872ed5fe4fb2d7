"""Hostile and absurd input: every case is one clean message, exit 2, no traceback.

Upper bounds on every count, duplicate YAML keys, values too long to print, control
characters, wrong types at any depth, files that are not specs, and NO_COLOR.
"""

from __future__ import annotations

import copy
import os
import pty
import select
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner
from shardctl.orchestrator import spec as spec_module
from shardctl.orchestrator.cli import cli
from shardctl.orchestrator.errors import SpecError
from shardctl.orchestrator.spec import load_spec, parse_spec

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "tiny-llama.yaml"
BASE: dict[str, Any] = yaml.safe_load(EXAMPLE.read_text())
HUGE = 10**30


def changed(dotted: str, value: Any) -> dict[str, Any]:
    data = copy.deepcopy(BASE)
    *parents, last = dotted.split(".")
    node = data
    for part in parents:
        node = node.setdefault(part, {})
    node[last] = value
    return data


def message_of(data: Any) -> str:
    with pytest.raises(SpecError) as exc:
        parse_spec(data, "job.yaml")
    assert exc.value.exit_code == 2
    return str(exc.value)


# ------------------------------------------------------------------------- bounds

BOUNDS = [
    ("resources.nodes", 100_000),
    ("resources.procs_per_node", 1024),
    ("resources.cpus_per_proc", 1024),
    ("train.steps", 99_999_999),
    ("train.micro_batch_size", 65_536),
    ("train.seq_len", 16_777_216),
    ("train.grad_accum", 65_536),
    ("train.log_every", 99_999_999),
    ("train.seed", 2**63 - 1),
    ("checkpoint.every_steps", 99_999_999),
    ("checkpoint.keep", 1000),
    ("slurm.max_requeues", 1000),
    ("slurm.signal_delay_s", 65535),
    ("k8s.backoff_limit", 1000),
    ("k8s.ttl_seconds_after_finished", 366 * 86400),
    ("k8s.active_deadline_seconds", 366 * 86400),
    ("k8s.run_as_user", 2**31 - 1),
    ("local.master_port", 65535),
]


@pytest.mark.parametrize(("field", "most"), BOUNDS, ids=[b[0] for b in BOUNDS])
def test_counts_have_upper_bounds_named_in_the_message(field: str, most: int) -> None:
    message = message_of(changed(field, HUGE))
    assert f"{field}: {HUGE} is more than {most}, the most shardctl accepts" in message


@pytest.mark.parametrize(("field", "most"), BOUNDS, ids=[b[0] for b in BOUNDS])
def test_the_bound_itself_is_accepted_by_the_field(field: str, most: int) -> None:
    # Only the field's own bound: cross-field checks (every_steps <= steps) may refuse.
    data = changed(field, most)
    try:
        parse_spec(data)
    except SpecError as exc:
        assert "the most shardctl accepts" not in str(exc), str(exc)


def test_elastic_and_tolerations_are_bounded() -> None:
    message = message_of(changed("k8s.elastic", {"min_nodes": 1, "max_nodes": HUGE}))
    assert "k8s.elastic.max_nodes: 1000000000000000000000000000000 is more than 100000" in message
    message = message_of(changed("k8s.tolerations", [{"key": "a", "tolerationSeconds": HUGE}]))
    assert "k8s.tolerations[0].tolerationSeconds" in message and "more than 31622400" in message


@pytest.mark.parametrize(
    ("field", "value", "expected"),
    [
        ("train.lr", 1e30, "train.lr: 1e+30 is more than 10.0"),
        ("train.weight_decay", 1e30, "train.weight_decay: 1e+30 is more than 10.0"),
        ("train.clip", 1e30, "train.clip: 1e+30 is more than 1000000.0"),
        ("train.lr", float("nan"), "train.lr: Input should be a finite number (got nan)"),
        ("slurm.time", "99999-00:00:00", "more than 366 days"),
        ("k8s.cpu", "0", "k8s.cpu: '0' is zero"),
        ("k8s.cpu", "999999", "at most 4096 cores"),
        ("k8s.cpu", "2Gi", "not a Kubernetes CPU quantity"),
    ],
)
def test_floats_and_text_amounts_are_bounded(field: str, value: Any, expected: str) -> None:
    assert expected in message_of(changed(field, value))


def test_bounds_constants_match_the_tests() -> None:
    assert spec_module.MAX_NODES == 100_000
    assert spec_module.MAX_STEPS == 10**8 - 1  # step-NNNNNNNN: eight digits


# ---------------------------------------------------------------- duplicate keys

DUPLICATES = [
    ("top", "name: a\nname: b\n", "line 2", "'name'", "line 1"),
    ("nested", EXAMPLE.read_text() + "resources:\n  nodes: 4\n", None, "'resources'", None),
    (
        "deep",
        "train:\n  model:\n    llama:\n      hidden_size: 8\n      hidden_size: 16\n",
        "line 5",
        "'hidden_size'",
        "line 4",
    ),
    ("flow", "env: {A: '1', A: '2'}\n", "line 1", "'A'", "line 1"),
]


@pytest.mark.parametrize(
    ("case", "text", "at", "key", "first"), DUPLICATES, ids=[d[0] for d in DUPLICATES]
)
def test_duplicate_keys_are_refused_with_key_line_and_file(
    tmp_path: Path, case: str, text: str, at: str | None, key: str, first: str | None
) -> None:
    path = tmp_path / "job.yaml"
    path.write_text(text)
    with pytest.raises(SpecError) as exc:
        load_spec(path)
    message = str(exc.value)
    assert message.startswith(f"{path}: ")
    assert f"duplicate key {key}" in message
    for part in (at, first):
        if part:
            assert part in message


def test_merge_keys_still_override(tmp_path: Path) -> None:
    data = copy.deepcopy(BASE)
    text = yaml.safe_dump(data) + "x-defaults: &d {nodes: 1, procs_per_node: 2}\n"
    text = text.replace("resources:\n", "resources:\n  <<: *d\n", 1)
    path = tmp_path / "job.yaml"
    path.write_text(text.replace("x-defaults", "env").replace("{nodes", "{NODES", 1))
    # The anchor lives in env (a plain mapping); resources merges it and overrides both.
    with pytest.raises(SpecError) as exc:
        load_spec(path)
    assert "duplicate key" not in str(exc.value)


# ---------------------------------------------------------------- value echo


def test_a_huge_value_is_shown_once_and_cut() -> None:
    message = message_of(changed("name", "a" * 10_000_000))
    assert len(message) < 1000
    assert message.count("'aaa") == 1
    assert "… (10000000 characters)" in message
    assert "(got" not in message


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("name", "Tiny"),
        ("slurm.time", "soon"),
        ("k8s.namespace", "My_NS"),
        ("strategy.wrap", ["Llama Layer"]),
        ("resources.memory", "lots"),
        ("run_dir", "  "),
        ("checkpoint.resume", " "),
        ("train.model.factory", "not a factory"),
    ],
)
def test_each_bad_value_is_printed_once(field: str, value: Any) -> None:
    message = message_of(changed(field, value))
    shown = SpecError.show_value(value[0] if isinstance(value, list) else value)
    assert message.count(shown) == 1, message


def test_thousands_of_problems_are_cut_to_a_readable_report() -> None:
    data = copy.deepcopy(BASE)
    data.update({f"junk{i}": i for i in range(5000)})
    message = message_of(data)
    assert "(5000 problems)" in message
    assert "... and 4980 more" in message
    assert len(message.splitlines()) == SpecError.MAX_PROBLEMS + 2


# ------------------------------------------------- control characters, wrong types


@pytest.mark.parametrize(
    ("field", "value", "expected"),
    [
        ("run_dir", "runs/a\tb", "run_dir: 'runs/a\\tb' holds a control character"),
        ("run_dir", "runs/a\nb", "holds a control character"),
        ("run_dir", "/", "run_dir: '/' is the file system root"),
        ("run_dir", "r" * 5000, "longer than 4096 characters"),
        ("run_dir", ["a"], "run_dir: Input should be a valid string (got ['a'])"),
        ("checkpoint.dir", "runs/tiny-llama", "is the run directory itself (run_dir)"),
        ("checkpoint.dir", "runs/tiny-llama/logs/", "the run directory's logs/ folder"),
        ("checkpoint.dir", "a\x00b", "holds a NUL character"),
        ("checkpoint.resume", "x\ty", "checkpoint.resume: 'x\\ty' holds a control character"),
        ("env", {"A": "x\x00y"}, "env.A: 'x\\x00y' holds a NUL character"),
        ("env", {"A": "x" * 200_000}, "longer than 131072 characters"),
        ("env", {"A": ["x"]}, "env.A: Input should be a valid string (got ['x'])"),
        ("slurm.setup", ["echo a\x07"], "no newlines or other control characters"),
        ("slurm.srun_args", ["--x\n"], "an srun word holds no control characters"),
        ("k8s.tolerations", [{"key": ["x"]}], "k8s.tolerations[0].key: Input should be"),
        ("train.data", {"text": 5}, "train.data.text: Input should be a valid string (got 5)"),
        ("train.model", {"llama": {"rope_scaling": ["x"]}}, "rope_scaling: ['x'] is a list"),
    ],
)
def test_control_characters_and_wrong_types_at_any_depth(
    field: str, value: Any, expected: str
) -> None:
    assert expected in message_of(changed(field, value))


def test_checkpoint_dir_elsewhere_and_default_under_run_dir() -> None:
    spec = parse_spec(changed("run_dir", "/scratch/run1"))
    assert spec.checkpoint_dir == "/scratch/run1/checkpoints"
    data = changed("checkpoint.dir", "/fast/ckpt")
    assert parse_spec(data).checkpoint_dir == "/fast/ckpt"


def test_non_string_keys_are_named() -> None:
    data = copy.deepcopy(BASE)
    data["resources"][5] = 1
    assert "key 5 in resources is an integer" in message_of(data)


# ---------------------------------------------------------------- whole files, CLI


def _hostile_files(tmp: Path) -> dict[str, tuple[Path, str]]:
    files: dict[str, tuple[Path, str]] = {}

    def add(name: str, content: str | bytes, expected: str) -> None:
        path = tmp / f"{name}.yaml"
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content, encoding="utf-8")
        files[name] = (path, expected)

    text = EXAMPLE.read_text()
    add("empty", "", "the file is empty")
    add("binary", bytes(range(256)) * 8, "not UTF-8 text")
    add("tab-indent", text.replace("  nodes: 1", "\tnodes: 1"), "not valid YAML at line")
    add("tab-value", "name: a\tb\n", "not valid YAML")
    add("nodes-1e30", text.replace("nodes: 1", f"nodes: {HUGE}"), "is more than 100000")
    add("lr-1e30", text.replace("lr: 1.0e-3", "lr: 1.0e+30"), "is more than 10.0")
    add(
        "typo-three-deep",
        text.replace("hidden_size: 128", "hiden_size: 128"),
        "did you mean 'hidden_size'",
    )
    add("ten-mb-name", text.replace("name: tiny-llama", "name: " + "a" * 10_000_000), "…")
    add("duplicate", text + "steps: 3\nname: again\n", "duplicate key 'name'")
    add("deep-nesting", "a: " + "[" * 5000 + "]" * 5000 + "\n", "nested too deeply")
    add("string-list", text.replace("name: tiny-llama", "name: [a, b]"), "valid string")
    return files


def test_hostile_files_through_the_real_entry_point(tmp_path: Path) -> None:
    folder = tmp_path / "a-folder"
    folder.mkdir()
    for name, (path, expected) in _hostile_files(tmp_path).items():
        proc = subprocess.run(
            [sys.executable, "-m", "shardctl.orchestrator.cli", "validate", str(path)],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "NO_COLOR": ""},
        )
        assert proc.returncode == 2, (name, proc.stderr[-2000:])
        assert "Traceback" not in proc.stderr, (name, proc.stderr[-2000:])
        assert expected in proc.stderr, (name, proc.stderr[:2000])
        assert len(proc.stderr) < 5000, (name, len(proc.stderr))
        assert proc.stdout == ""


DIGITS = sys.get_int_max_str_digits() + 700  # past Python's int-from-text limit


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("9" * DIGITS, f"train.steps: an integer of {DIGITS} digits (line "),
        ("-" + "9" * DIGITS, f"train.steps: an integer of {DIGITS} digits (line "),
        ("0x" + "f" * DIGITS, "train.steps: an integer of about"),
    ],
    ids=["decimal", "negative", "hex"],
)
def test_an_integer_too_long_for_python_names_the_field(
    tmp_path: Path, value: str, expected: str
) -> None:
    path = tmp_path / "job.yaml"
    text = EXAMPLE.read_text()
    assert "\n  steps: 200\n" in text
    path.write_text(text.replace("\n  steps: 200\n", f"\n  steps: {value}\n"))
    res = CliRunner().invoke(cli, ["validate", str(path)])
    assert res.exit_code == 2, res.stderr
    assert expected in res.stderr
    assert len(res.stderr) < 1000


def test_an_integer_too_long_for_python_in_set_names_the_option() -> None:
    res = CliRunner().invoke(
        cli, ["validate", str(EXAMPLE), "--set", f"train.steps={'9' * DIGITS}"]
    )
    assert res.exit_code == 2, res.stderr
    assert f"--set train.steps: invalid job spec: an integer of {DIGITS} digits" in res.stderr
    assert f"at most {sys.get_int_max_str_digits()} digits" in res.stderr


def test_a_folder_and_dev_zero_are_clean_errors(tmp_path: Path) -> None:
    from shardctl.orchestrator.yamlio import read_yaml_file

    with pytest.raises(SpecError, match="is a folder"):
        read_yaml_file(tmp_path)
    with pytest.raises(SpecError, match="is a character device, not a file"):
        read_yaml_file("/dev/zero")


# ---------------------------------------------------------------- NO_COLOR

RED = "\x1b[31m"


def _bad_spec(tmp_path: Path) -> Path:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(changed("name", "Bad")))
    return path


@pytest.mark.parametrize(("no_color", "coloured"), [(None, True), ("1", False), ("", True)])
def test_no_color_is_honoured(tmp_path: Path, no_color: str | None, coloured: bool) -> None:
    env = {"NO_COLOR": no_color}
    # color=True: the runner behaves like a terminal, where click would colour.
    result = CliRunner().invoke(cli, ["validate", str(_bad_spec(tmp_path))], env=env, color=True)
    assert result.exit_code == 2
    assert (RED in result.stderr) is coloured
    assert "name: 'Bad' cannot be" in result.stderr


def _stderr_on_a_tty(path: Path, no_color: str | None) -> str:
    """Run the CLI with stderr on a pseudo-terminal and return what it wrote there."""
    env = {k: v for k, v in os.environ.items() if k != "NO_COLOR"}
    if no_color is not None:
        env["NO_COLOR"] = no_color
    leader, follower = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "shardctl.orchestrator.cli", "validate", str(path)],
        stdout=subprocess.DEVNULL,
        stderr=follower,
        env=env,
    )
    os.close(follower)
    out = b""
    while True:
        ready, _, _ = select.select([leader], [], [], 60)
        if not ready:
            break
        try:
            chunk = os.read(leader, 4096)
        except OSError:  # the pty closes when the process exits
            break
        if not chunk:
            break
        out += chunk
    assert proc.wait(timeout=60) == 2
    os.close(leader)
    return out.decode()


def test_terminal_gets_colour_unless_no_color(tmp_path: Path) -> None:
    path = _bad_spec(tmp_path)
    assert RED in _stderr_on_a_tty(path, None)
    assert "\x1b[" not in _stderr_on_a_tty(path, "1")


def test_no_colour_when_stderr_is_not_a_terminal(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "NO_COLOR"}
    proc = subprocess.run(
        [sys.executable, "-m", "shardctl.orchestrator.cli", "validate", str(_bad_spec(tmp_path))],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "\x1b[" not in proc.stderr
    assert "cannot be a Slurm job" in proc.stderr
