"""A new user's first commands with wrong input: each answer is one line naming the
path or value and what is accepted, exit 2, no traceback, no user file touched."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner
from shardctl.orchestrator.cli import cli


def test_init_under_a_file_names_the_file_in_the_way(tmp_path: Path) -> None:
    spec = tmp_path / "job.yaml"
    spec.write_text("name: mine\n")
    res = CliRunner().invoke(cli, ["init", str(spec / "sub" / "new.yaml")])
    assert res.exit_code == 2, res.output
    [line] = res.output.strip().splitlines()
    assert f"{spec} is a file, not a folder" in line
    assert "Traceback" not in res.output
    assert spec.read_text() == "name: mine\n"


def _starter_spec(tmp_path: Path) -> Path:
    spec = tmp_path / "job.yaml"
    res = CliRunner().invoke(cli, ["init", str(spec)])
    assert res.exit_code == 0, res.output
    return spec


def test_a_spec_that_saved_nothing_yet_is_named_as_such(tmp_path: Path) -> None:
    spec = _starter_spec(tmp_path)
    for command in ("checkpoints", "consolidate"):
        res = CliRunner().invoke(cli, [command, str(spec)])
        assert res.exit_code == 1, res.output
        [line] = res.output.strip().splitlines()
        assert "checkpoint.dir" in line and "saved no checkpoint here yet" in line, line
        assert f"shardctl submit {spec}" in line
    assert not (tmp_path / "runs").exists()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_checkpoints_lists_what_a_spec_names_as_consolidate_does(tmp_path: Path) -> None:
    import json

    import torch
    import torch.distributed.checkpoint as dcp

    spec = _starter_spec(tmp_path)
    step = tmp_path / "runs" / "job" / "checkpoints" / "step-00000003"
    dcp.save({"model": {"w": torch.ones(2)}}, checkpoint_id=str(step))
    res = CliRunner().invoke(cli, ["checkpoints", "-o", "json", str(spec)])
    assert res.exit_code == 0, res.output
    [row] = json.loads(res.stdout)["checkpoints"]
    assert (row["step"], row["format"], row["status"]) == (3, "dcp", "complete")


def test_a_yaml_that_is_no_spec_is_refused_as_a_spec(tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    path.write_text("not a folder\n")
    res = CliRunner().invoke(cli, ["checkpoints", str(path)])
    assert res.exit_code == 2, res.output
    [line] = res.output.strip().splitlines()
    assert f"{path}: invalid job spec: the top level must be a mapping" in line
    assert path.read_text() == "not a folder\n"


@pytest.mark.parametrize(
    ("setting", "said"),
    [
        # YAML 1.1 reads 1e30 as a text and 1.0e+30 as a float: neither is a count.
        ("resources.cpus_per_proc=1e30", "(got '1e30'); accepted: a whole number from 1 to 1024"),
        ("resources.nodes=1.0e+30", "(got 1e+30); accepted: a whole number from 1 to 100000"),
        ("watchdog.hang_timeout_s=.inf", "(got inf); accepted: a whole number from 5 to"),
        ("train.warmup_steps=2.5", "(got 2.5); accepted: a whole number from 0 to"),
    ],
)
def test_a_count_that_is_no_whole_number_says_the_range(
    tmp_path: Path, setting: str, said: str
) -> None:
    spec = _starter_spec(tmp_path)
    res = CliRunner().invoke(cli, ["validate", str(spec), "--set", setting])
    assert res.exit_code == 2, res.output
    [line] = res.output.strip().splitlines()
    assert f"{setting.split('=')[0]}: Input should be a valid integer {said}" in line, line


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
@pytest.mark.parametrize(
    ("shape", "said"),
    [
        (["--world-size", "0"], "--world-size 0; accepted: 1 to 65536"),
        (["--world-size", "99999999999"], "--world-size 99999999999; accepted: 1 to 65536"),
        (["--world-size", "2", "--zero-stage", "7"], "--zero-stage 7; accepted: 1, 2 or 3"),
    ],
)
def test_another_tools_checkpoint_gets_the_same_shape_bounds(
    tmp_path: Path, shape: list[str], said: str
) -> None:
    """A plain DCP folder went past the bounds shardctl's own checkpoints get: a world
    size of 0 ended in ZeroDivisionError, ZeRO stage 7 was written."""
    import torch
    import torch.distributed.checkpoint as dcp

    ckpt = tmp_path / "ckpt"
    dcp.save({"model": {"w": torch.ones(4)}}, checkpoint_id=str(ckpt))
    out = tmp_path / "ds"
    res = CliRunner().invoke(cli, ["convert", str(ckpt), "--to", "deepspeed", *shape,
                                   "--out", str(out)])  # fmt: skip
    assert res.exit_code == 2, res.output
    assert res.output.strip() == f"error: {said}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_consolidate_reads_a_run_dir_whose_job_yaml_is_damaged(tmp_path: Path) -> None:
    """`checkpoints` lists such a run dir by its default layout; `consolidate` refused it."""
    import torch
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file

    run = tmp_path / "run"
    weight = torch.arange(4, dtype=torch.float32)
    dcp.save({"model": {"w": weight}}, checkpoint_id=str(run / "checkpoints" / "step-00000003"))
    (run / "job.yaml").write_bytes(b"name: [unclosed\n\x00\xff")
    res = CliRunner().invoke(cli, ["consolidate", str(run), "--out", str(tmp_path / "m"),
                                   "--no-progress"])  # fmt: skip
    assert res.exit_code == 0, res.output
    assert torch.equal(load_file(tmp_path / "m" / "model.safetensors")["w"], weight)
    assert (run / "job.yaml").read_bytes() == b"name: [unclosed\n\x00\xff"


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_consolidate_takes_a_dcp_step_folder_in_a_checkpoints_dir(tmp_path: Path) -> None:
    """`checkpoints` calls a torchtitan-style step-N/ of DCP files complete; `consolidate`
    of its checkpoints/ folder called it an interrupted shardctl save."""
    import torch
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file

    weight = torch.arange(6, dtype=torch.float32)
    dcp.save({"model": {"w": weight}}, checkpoint_id=str(tmp_path / "ck" / "step-00000005"))
    res = CliRunner().invoke(cli, ["consolidate", str(tmp_path / "ck"), "--out",
                                   str(tmp_path / "m"), "--no-progress"])  # fmt: skip
    assert res.exit_code == 0, res.output
    assert torch.equal(load_file(tmp_path / "m" / "model.safetensors")["w"], weight)


@pytest.mark.parametrize("command", ["validate", "submit"])
def test_a_missing_input_from_a_set_names_the_set(tmp_path: Path, command: str) -> None:
    """Every other refusal of a `--set` spec says `SPEC with --set ...`; the checks of
    what the ranks read named the file alone, whose field was fine."""
    spec = _starter_spec(tmp_path)
    taken = tmp_path / "notes.txt"
    taken.write_text("mine\n")
    setting = f"checkpoint.dir={taken}"
    args = [command, str(spec), "--set", setting] + (["--dry-run"] if command == "submit" else [])
    res = CliRunner().invoke(cli, args)
    assert res.exit_code == 2, res.output
    [line] = res.output.strip().splitlines()
    assert line.startswith(f"error: {spec} with --set {setting}: invalid job spec: "), line
    assert "(it is a file)" in line and taken.read_text() == "mine\n"


@pytest.mark.parametrize("given", ["runs/gone", "gone.yaml"])
def test_plot_of_a_path_that_is_not_there_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, given: str
) -> None:
    """Not "no submitted job named 'runs/gone'": no job can have that name."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SHARDCTL_STATE_DIR", str(tmp_path / "state"))
    res = CliRunner().invoke(cli, ["plot", given])
    assert res.exit_code == 2, res.output
    assert res.output.strip() == (
        f"error: {given!r} does not exist; accepted: a run directory, a job spec file or "
        "the name of a submitted job (shardctl ls)"
    )


def test_convert_refuses_a_fifo_unopened_and_names_bytes_that_are_not_utf8(
    tmp_path: Path,
) -> None:
    """A FIFO as CONFIG waited for a writer for ever (validate refuses it already)."""
    import os
    import subprocess
    import sys

    fifo = tmp_path / "accelerate.yaml"
    os.mkfifo(fifo)
    res = subprocess.run(
        [sys.executable, "-m", "shardctl.orchestrator.cli", "convert", str(fifo), "--to",
         "deepspeed"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert res.returncode == 2, res.stderr
    assert res.stderr.strip() == (
        f"error: CONFIG {str(fifo)!r} is not a regular file; give an accelerate config, a job "
        "spec, a checkpoint folder, or - to read a config from stdin"
    )
    latin1 = tmp_path / "latin1.yaml"
    latin1.write_bytes(b"distributed_type: caf\xe9\n")
    res2 = CliRunner().invoke(cli, ["convert", str(latin1), "--to", "deepspeed"])
    assert res2.exit_code == 2
    assert res2.output.strip() == (
        f"error: cannot read CONFIG {str(latin1)!r}: not UTF-8 text (byte 21); is it a binary file?"
    )


@pytest.mark.parametrize("command", ["status", "logs", "cancel"])
def test_a_spec_given_as_job_names_the_job_it_holds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, command: str
) -> None:
    monkeypatch.setenv("SHARDCTL_STATE_DIR", str(tmp_path / "state"))
    spec = _starter_spec(tmp_path)
    res = CliRunner().invoke(cli, [command, str(spec)])
    assert res.exit_code == 1, res.output
    [line] = res.output.strip().splitlines()
    assert "JOB is a job's name or id, not its spec file (this one names job 'job')" in line


def test_a_kubeconfig_that_is_no_mapping_is_said_without_pythons_words(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """KUBECONFIG pointing at a text file said "'str' object does not support item
    assignment"."""
    pytest.importorskip("kubernetes")
    monkeypatch.setenv("SHARDCTL_STATE_DIR", str(tmp_path / "state"))
    spec = _starter_spec(tmp_path)
    words = tmp_path / "words.txt"
    words.write_text("just some words\n")
    monkeypatch.setenv("KUBECONFIG", str(words))
    monkeypatch.delenv("SHARDCTL_KUBECONFIG", raising=False)
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    res = CliRunner().invoke(
        cli, ["submit", str(spec), "--cluster", "k8s", "--set", "k8s.image=x/y:1"]
    )
    assert res.exit_code == 1, res.output
    [line] = res.output.strip().splitlines()
    assert f"no usable kubeconfig ({words}): not a kubeconfig (a mapping with clusters, " in line
    assert "object" not in line and "Traceback" not in res.output


def test_a_k8s_image_with_a_space_says_what_is_accepted(tmp_path: Path) -> None:
    spec = _starter_spec(tmp_path)
    res = CliRunner().invoke(cli, ["validate", str(spec), "--cluster", "k8s",
                                   "--set", "k8s.image=my image"])  # fmt: skip
    assert res.exit_code == 2, res.output
    [line] = res.output.strip().splitlines()
    assert "k8s.image: 'my image' is not an image reference; accepted: one word such as " in line


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
@pytest.mark.parametrize("out", ["run", ".", "run/checkpoints/step-00000003/x"])
def test_consolidate_never_replaces_what_it_reads(tmp_path: Path, out: str) -> None:
    """`consolidate RUN --out RUN --force` replaced the run dir (checkpoints, logs) with
    the model."""
    import torch
    import torch.distributed.checkpoint as dcp

    run = tmp_path / "run"
    dcp.save(
        {"model": {"w": torch.ones(3)}}, checkpoint_id=str(run / "checkpoints" / "step-00000003")
    )
    (run / "logs").mkdir()
    (run / "logs" / "mine.txt").write_text("keep\n")
    res = CliRunner().invoke(cli, ["consolidate", str(run), "--out", str(tmp_path / out),
                                   "--force", "--no-progress"])  # fmt: skip
    assert res.exit_code == 2, res.output
    [line] = res.output.strip().splitlines()
    assert "which is read; accepted: a folder outside it" in line, line
    assert (run / "logs" / "mine.txt").read_text() == "keep\n"
    assert (run / "checkpoints" / "step-00000003" / ".metadata").is_file()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_a_copied_run_dir_consolidates_its_own_checkpoints(tmp_path: Path) -> None:
    """Its job.yaml names the original run dir, absolute; while that one exists,
    `consolidate COPY` read the original's checkpoints (`checkpoints COPY` lists the
    copy's)."""
    import torch
    import torch.distributed.checkpoint as dcp
    import yaml
    from safetensors.torch import load_file
    from shardctl.orchestrator.spec import load_spec

    spec = _starter_spec(tmp_path)
    original, copy = tmp_path / "original", tmp_path / "copy"
    job = load_spec(spec, (f"run_dir={original}",))
    for run, value in ((original, 1.0), (copy, 2.0)):
        step = run / "checkpoints" / "step-00000003"
        dcp.save({"model": {"w": torch.full((2,), value)}}, checkpoint_id=str(step))
        (run / "job.yaml").write_text(yaml.safe_dump(job.to_yaml_dict()))
    res = CliRunner().invoke(cli, ["consolidate", str(copy), "--no-progress"])
    assert res.exit_code == 0, res.output
    got = load_file(copy / "model" / "model.safetensors")["w"]
    assert torch.equal(got, torch.full((2,), 2.0))
    assert not (original / "model").exists()


@pytest.mark.parametrize("command", [["ls"], ["status", "x"], ["logs", "x"]])
def test_a_state_dir_that_is_a_file_is_said(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, command: list[str]
) -> None:
    """`ls` said "no submitted jobs" (and status "known jobs: none")."""
    state = tmp_path / "state"
    state.write_text("mine\n")
    monkeypatch.setenv("SHARDCTL_STATE_DIR", str(state))
    res = CliRunner().invoke(cli, command)
    assert res.exit_code == 1, res.output
    assert res.output.strip() == (
        f"error: cannot read job records in the state dir {state}: {state} is a file, not a "
        "directory; set SHARDCTL_STATE_DIR to a directory"
    )
    assert state.read_text() == "mine\n"
