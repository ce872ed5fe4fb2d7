"""First contact with the spec layer (issue 35): files that are not specs, YAML 1.1's
surprises, pydantic's internals kept from the user, and the checks `validate` shares
with `submit`. Every case is one clean line, exit 2, no traceback."""

from __future__ import annotations

import copy
import os
import resource
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner
from shardctl.orchestrator.cli import cli
from shardctl.orchestrator.errors import SpecError
from shardctl.orchestrator.yamlio import MAX_ALIAS_NODES, parse_yaml_text, read_yaml_file

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "tiny-llama.yaml"
BASE: dict[str, Any] = yaml.safe_load(EXAMPLE.read_text())
SHARDCTL = [sys.executable, "-m", "shardctl.orchestrator.cli"]


def changed(dotted: str, value: Any, base: dict[str, Any] | None = None) -> dict[str, Any]:
    data = copy.deepcopy(base if base is not None else BASE)
    *parents, last = dotted.split(".")
    node = data
    for part in parents:
        node = node.setdefault(part, {})
    node[last] = value
    return data


def validate(tmp_path: Path, text: str, *args: str) -> tuple[int, str]:
    path = tmp_path / "job.yaml"
    path.write_text(text)
    res = CliRunner().invoke(cli, ["validate", str(path), *args])
    assert "Traceback" not in res.output + res.stderr
    return res.exit_code, res.stderr


# ------------------------------------------------- item 1: alias bombs, FIFOs, devices


def billion_laughs(levels: int = 9) -> str:
    """A YAML of about 1 KB whose aliases nest nine deep: 9**9 strings once written out."""
    lines = ["name: bomb", "train: {steps: 1}", 'a0: &a0 ["lol","lol","lol","lol","lol"]']
    for i in range(1, levels):
        lines.append(f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]")
    return "\n".join(lines) + "\n"


def test_an_alias_bomb_is_refused_quickly_and_in_little_memory(tmp_path: Path) -> None:
    path = tmp_path / "bomb.yaml"
    path.write_text(billion_laughs())
    assert path.stat().st_size < 1024

    def bounded() -> None:  # in the child, before exec: 1 GiB of address space
        resource.setrlimit(resource.RLIMIT_AS, (2**30, 2**30))

    res = subprocess.run(
        [*SHARDCTL, "validate", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        preexec_fn=bounded,
    )
    assert res.returncode == 2, res.stderr
    assert "Traceback" not in res.stderr and "MemoryError" not in res.stderr
    assert f"aliases (*name) repeat more than {MAX_ALIAS_NODES:,} values" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr


@pytest.mark.parametrize("written", [False, True])
def test_a_value_that_contains_itself_is_refused(written: bool) -> None:
    with pytest.raises(SpecError, match="contains itself through an alias"):
        parse_yaml_text("a: &a [1, *a]\n", "job.yaml", written=written)


def test_the_parser_for_written_files_bounds_aliases_too() -> None:
    with pytest.raises(SpecError, match="aliases \\(\\*name\\) repeat more than"):
        parse_yaml_text(billion_laughs(), "job.yaml", written=True)


def test_a_few_aliases_still_work() -> None:
    data = parse_yaml_text(
        "base: &base {steps: 3, lr: 0.1}\ntrain:\n  <<: *base\n  steps: 5\nalso: *base\n"
    )
    assert data["train"] == {"steps": 5, "lr": 0.1}
    assert data["also"] == {"steps": 3, "lr": 0.1}


def test_a_fifo_as_the_spec_is_refused_not_waited_on(tmp_path: Path) -> None:
    fifo = tmp_path / "job.yaml"
    os.mkfifo(fifo)
    res = subprocess.run(
        [*SHARDCTL, "validate", str(fifo)], capture_output=True, text=True, timeout=60
    )
    assert res.returncode == 2, res.stderr
    assert f"{str(fifo)!r} is a named pipe (FIFO), not a file; accepted: a YAML file" in (
        res.stderr
    )
    assert "Traceback" not in res.stderr


def test_a_device_and_a_folder_are_named_for_what_they_are(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="'/dev/null' is a character device, not a file"):
        read_yaml_file("/dev/null")
    with pytest.raises(SpecError, match="is a folder; accepted: a YAML file"):
        read_yaml_file(tmp_path)
    link = tmp_path / "link.yaml"
    link.symlink_to(EXAMPLE)
    assert read_yaml_file(link)["name"] == BASE["name"]


# ------------------------------------------------------------ item 2: YAML 1.1 surprises


def spec_of(extra: str, *args: str) -> Any:
    from shardctl.orchestrator.spec import parse_spec

    return parse_spec(parse_yaml_text(EXAMPLE.read_text() + extra + "\n", "job.yaml"))


def problem_of(extra: str) -> str:
    with pytest.raises(SpecError) as exc:
        spec_of(extra)
    assert exc.value.exit_code == 2
    return str(exc.value)


def test_an_unquoted_off_says_yaml_made_it_false_and_how_to_quote_it() -> None:
    msg = problem_of("logging: {wandb_mode: off}")
    assert "logging.wandb_mode: Input should be 'online' or 'offline'" in msg
    assert "YAML reads an unquoted off, no or n as the boolean false" in msg
    assert 'quote it, e.g. wandb_mode: "off"' in msg


def test_an_unquoted_yes_in_a_text_field_says_what_yaml_did() -> None:
    msg = problem_of("k8s: {image: yes}")
    assert "k8s.image:" in msg and "the boolean true" in msg and 'image: "on"' in msg


def test_a_number_field_gets_no_quoting_advice() -> None:
    data = changed("strategy.zero_stage", parse_yaml_text("1:00"), changed("train.seed", True))
    with pytest.raises(SpecError) as exc:
        spec_of_data(data)
    assert exc.value.problems == [
        "strategy.zero_stage: Input should be 0, 1, 2 or 3 (got 60)",
        "train.seed: Input should be a valid integer (got True); accepted: a whole number "
        "from 0 to 9223372036854775807",
    ]


def test_a_base60_number_in_a_text_field_shows_the_text_to_quote() -> None:
    msg = problem_of("slurm: {partition: 1:00}")
    assert "YAML reads an unquoted 1:00 as the base-60 number 60" in msg
    assert 'partition: "1:00"' in msg


@pytest.mark.parametrize(
    ("written", "meant"),
    [("10:00:00", "10:00:00"), ("1:30:00", "1:30:00"), ("90", "90"), ('"10:00:00"', "10:00:00")],
)
def test_slurm_time_is_the_time_written_not_yaml_s_base60_number(written: str, meant: str) -> None:
    from shardctl.orchestrator.clusters.slurm.section import slurm_time_minutes

    spec = spec_of(f"slurm: {{time: {written}}}")
    assert spec.slurm.time == meant
    minutes = {"10:00:00": 600, "1:30:00": 90, "90": 90}[meant]
    assert slurm_time_minutes(spec.slurm.time) == minutes


def test_slurm_time_given_with_set_is_the_time_written() -> None:
    from shardctl.orchestrator.spec import load_spec

    spec = load_spec(EXAMPLE, ["slurm.time=10:00:00"])
    assert spec.slurm.time == "10:00:00"


def test_an_env_value_with_colons_is_the_text_written() -> None:
    spec = spec_of("env: {WINDOW: 10:00, BATCH: 8}")
    assert spec.env == {"WINDOW": "10:00", "BATCH": "8"}


def test_an_sbatch_option_time_is_sent_as_written() -> None:
    spec = spec_of("slurm: {sbatch_options: {time-min: 10:00, begin: '10:30'}}")
    assert spec.slurm.sbatch_options == {"time-min": "10:00", "begin": "10:30"}


# ------------------------------------------- item 3: no pydantic internals reach the user

# How pydantic names union members and validators inside a location; none is a key.
INTERNALS = (
    "literal[", "union[", "function-", "list[", "dict[", "tagged-union", "is-instance",
    "instance of",
)  # fmt: skip


@pytest.mark.parametrize(
    ("dotted", "value"),
    [
        ("strategy.wrap", "everything"),
        ("strategy.wrap", {"x": 1}),
        ("strategy.wrap", [1]),
        ("strategy.wrap", [None]),
        ("strategy.wrap", True),
        ("strategy.wrap", 3.5),
        ("strategy.zero_stage", 7),
        ("strategy.precision", "bf15"),
        ("launcher", ["torchrun"]),
        ("logging.wandb_mode", False),
        ("logging.backends", "tensorboard"),
        ("checkpoint.consolidate_dtype", {"a": 1}),
        ("slurm.signal", 9),
        ("slurm.sbatch_options", {"exclude": [1]}),
        ("k8s.api", "mpijob"),
        ("k8s.tolerations", [{"key": "a", "operator": "Maybe"}]),
        ("k8s.code", True),
        ("k8s.restart_policy", None),
        ("resources", 5),
        ("k8s.affinity", ["zone-a"]),
    ],
)
def test_an_error_names_the_field_as_written_never_pydantic_s_tags(dotted: str, value: Any) -> None:
    with pytest.raises(SpecError) as exc:
        spec_of_data(changed(dotted, value))
    msg = str(exc.value)
    assert not [tag for tag in INTERNALS if tag in msg], msg
    assert dotted.split(".")[-1] in msg, msg


def spec_of_data(data: dict[str, Any]) -> Any:
    from shardctl.orchestrator.spec import parse_spec

    return parse_spec(data, "job.yaml")


def test_strategy_wrap_of_the_wrong_shape_is_one_line() -> None:
    with pytest.raises(SpecError) as exc:
        spec_of_data(changed("strategy.wrap", [1]))
    lines = exc.value.problems
    assert lines == [
        "strategy.wrap: 1 is an integer; accepted: 'auto' or a list of module class names, "
        "e.g. [LlamaDecoderLayer]"
    ]


def test_a_union_s_errors_are_one_line_at_the_place_the_user_wrote() -> None:
    from typing import Literal

    from pydantic import ValidationError
    from shardctl.orchestrator.spec.common import Section
    from shardctl.orchestrator.spec.explain import explain

    class Inner(Section):
        size: int

    class Outer(Section):
        choice: Literal["auto"] | list[int] | Inner = "auto"

    data = {"choice": "many"}
    with pytest.raises(ValidationError) as exc:
        Outer.model_validate(data)
    lines = explain(exc.value, data, Outer)
    assert len(lines) == 1, lines
    assert lines[0].startswith("choice: Input should be 'auto', or input should be a valid list")
    assert not [tag for tag in INTERNALS if tag in lines[0]], lines
    assert "Inner" not in lines[0], lines


# ----------------------------------- item 4: a time limit no longer than the signal delay


@pytest.mark.parametrize(
    ("slurm", "seconds", "delay"),
    [({"time": "2"}, 120, 120), ({"time": "5", "signal_delay_s": 600}, 300, 600)],
)
def test_a_time_limit_inside_the_signal_delay_is_refused_at_validate(
    tmp_path: Path, slurm: dict[str, Any], seconds: int, delay: int
) -> None:
    code, err = validate(tmp_path, yaml.safe_dump(changed("slurm", slurm)), "--cluster", "slurm")
    assert code == 2, err
    assert f"slurm.time {slurm['time']!r} ({seconds} s" in err
    assert f"is not longer than slurm.signal_delay_s ({delay})" in err
    assert "every attempt would requeue without training" in err


def test_a_time_limit_just_past_the_signal_delay_is_accepted() -> None:
    spec = spec_of_data(changed("slurm", {"time": "3", "signal_delay_s": 179}))
    assert (spec.slurm.time, spec.slurm.signal_delay_s) == ("3", 179)


# ------------------------------- item 5: validate and doctor apply submit's k8s checks

K8S_BAD = {
    "no-image": (changed("resources.nodes", 1), "k8s.image is required for --cluster k8s"),
    "two-nodes-no-volume": (
        changed("k8s", {"image": "registry.example/shardctl:1"}, changed("resources.nodes", 2)),
        "k8s.pvc is required for a 2-node job",
    ),
}


@pytest.fixture
def no_kubeconfig(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    missing = tmp_path / "kube" / "config"
    monkeypatch.setenv("KUBECONFIG", str(missing))
    monkeypatch.delenv("SHARDCTL_KUBECONFIG", raising=False)
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    return missing


@pytest.mark.parametrize("case", sorted(K8S_BAD))
@pytest.mark.parametrize("command", ["validate", "doctor", "submit"])
def test_validate_doctor_and_submit_refuse_the_same_k8s_spec(
    tmp_path: Path, no_kubeconfig: Path, case: str, command: str
) -> None:
    data, refusal = K8S_BAD[case]
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump({**data, "run_dir": str(tmp_path / "run")}))
    res = CliRunner().invoke(cli, [command, str(path), "--cluster", "k8s"])
    assert "Traceback" not in res.output + res.stderr
    if command == "doctor":  # a failing check, and doctor's exit code for one
        assert res.exit_code == 1, res.output
        assert f"FAIL  spec for k8s: {refusal}" in res.output
    else:
        assert res.exit_code == 2, res.output + res.stderr
        assert refusal in res.stderr


def test_doctor_says_submit_accepts_a_k8s_spec_it_accepts(
    tmp_path: Path, no_kubeconfig: Path
) -> None:
    data = changed("k8s", {"image": "registry.example/shardctl:1"})
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump({**data, "run_dir": str(tmp_path / "run")}))
    res = CliRunner().invoke(cli, ["doctor", str(path), "--cluster", "k8s"])
    assert "ok    spec for k8s: submit --cluster k8s accepts it" in res.output


# --------------------------------------------- item 6: a missing kubeconfig is "missing"


@pytest.mark.parametrize("variable", ["KUBECONFIG", "SHARDCTL_KUBECONFIG"])
def test_a_missing_kubeconfig_says_missing_where_it_looked_and_what_to_do(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, variable: str
) -> None:
    pytest.importorskip("kubernetes")
    missing = tmp_path / "kube" / "config"
    for name in ("KUBECONFIG", "SHARDCTL_KUBECONFIG", "KUBERNETES_SERVICE_HOST"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(variable, str(missing))
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(changed("k8s", {"image": "registry.example/shardctl:1"})))
    res = CliRunner().invoke(cli, ["submit", str(path), "--cluster", "k8s"])
    assert res.exit_code == 1, res.output
    [line] = res.stderr.splitlines()
    assert "invalid" not in line.lower(), line
    assert "no kubeconfig: shardctl looks for it in SHARDCTL_KUBECONFIG, else KUBECONFIG" in line
    assert f"here {variable}={missing}, and {missing} does not exist" in line
    assert "Point KUBECONFIG (or SHARDCTL_KUBECONFIG) at your cluster's kubeconfig" in line


def test_no_kubeconfig_at_all_names_the_default_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("kubernetes")
    from shardctl.orchestrator.clusters.k8s import load_api_client
    from shardctl.orchestrator.errors import ClusterError

    for name in ("KUBECONFIG", "SHARDCTL_KUBECONFIG", "KUBERNETES_SERVICE_HOST"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    with pytest.raises(ClusterError) as exc:
        load_api_client()
    assert "~/.kube/config, the default, does not exist and neither" in str(exc.value)


# ----------------------------------------------- item 7: an env.PATH that finds nothing


@pytest.mark.parametrize(
    ("path", "says"),
    [
        ("", "holds no absolute folder"),
        (":", "holds no absolute folder"),
        ("bin:.venv/bin", "holds no absolute folder"),
        ("/opt/tools/bin:$PATH", "names a variable, but env values are taken literally"),
    ],
)
@pytest.mark.parametrize("cluster", ["local", "slurm", "k8s"])
def test_a_path_that_cannot_find_the_launcher_is_refused_at_validate(
    tmp_path: Path, path: str, says: str, cluster: str
) -> None:
    data = changed("env", {"PATH": path}, changed("k8s", {"image": "registry.example/s:1"}))
    code, err = validate(tmp_path, yaml.safe_dump(data), "--cluster", cluster)
    assert code == 2, err
    assert f"env.PATH {path!r} {says}" in err
    assert "or no env.PATH (the nodes' own)" in err


def test_on_this_machine_env_path_must_hold_the_launcher(tmp_path: Path) -> None:
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    code, err = validate(tmp_path, yaml.safe_dump(changed("env", {"PATH": str(empty)})))
    assert code == 2, err
    # The path itself may be cut in the message (a long pytest tmp path): not matched.
    assert "env.PATH " in err and " has no 'torchrun' (here it is " in err, err
    # The folder the local cluster finds it in is accepted.
    venv_bin = os.path.dirname(sys.executable)
    good = changed("env", {"PATH": f"{venv_bin}:/usr/bin:/bin"})
    code, err = validate(tmp_path, yaml.safe_dump(good))
    assert code == 0, err
