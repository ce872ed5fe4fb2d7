"""Issue 35, first contact round 4: nothing of the user's is lost, and no traceback.

`plot` replaces only its own PNG without `--force` and names a damaged metrics file's
line; `init --force` replaces regular files only and names a bad `--name`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from click.testing import CliRunner
from shardctl.orchestrator.cli import cli

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _run_with_metrics(tmp_path: Path) -> Path:
    run_dir = tmp_path / "run"
    (run_dir / "logs").mkdir(parents=True)
    rows = [{"step": s, "loss": 4.0 - 0.2 * s, "lr": 1e-3} for s in range(1, 4)]
    (run_dir / "logs" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run_dir


def test_plot_refuses_to_overwrite_a_users_file_without_force(tmp_path: Path) -> None:
    run_dir = _run_with_metrics(tmp_path)
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes\n")
    res = CliRunner().invoke(cli, ["plot", str(run_dir), "--out", str(notes)])
    assert res.exit_code == 2, res.output
    assert res.output.strip() == (
        f"error: --out {notes} already exists and is not a plot shardctl wrote; refusing "
        "to overwrite it (use --force to replace it, or give another --out)"
    )
    assert notes.read_text() == "my notes\n"
    # A user's own loss.png in the run dir is theirs too.
    (run_dir / "loss.png").write_bytes(PNG_SIGNATURE + b"someone else's picture")
    res = CliRunner().invoke(cli, ["plot", str(run_dir)])
    assert res.exit_code == 2 and "the default output" in res.output, res.output
    assert (run_dir / "loss.png").read_bytes().endswith(b"someone else's picture")
    # --force replaces it.
    res = CliRunner().invoke(cli, ["plot", str(run_dir), "--out", str(notes), "--force"])
    assert res.exit_code == 0, res.output
    assert notes.read_bytes().startswith(PNG_SIGNATURE)


def test_plot_replaces_its_own_plot_without_force(tmp_path: Path) -> None:
    run_dir = _run_with_metrics(tmp_path)
    for _ in range(2):  # re-plotting while a run goes on refreshes the curve
        res = CliRunner().invoke(cli, ["plot", str(run_dir)])
        assert res.exit_code == 0, res.output
        assert f"wrote {run_dir / 'loss.png'} (3 steps)" in res.output


def test_plot_refuses_a_fifo_or_a_folder_as_out(tmp_path: Path) -> None:
    run_dir = _run_with_metrics(tmp_path)
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    res = CliRunner().invoke(cli, ["plot", str(run_dir), "--out", str(fifo), "--force"])
    assert res.exit_code == 2, res.output
    assert "is not a regular file" in res.output
    assert fifo.is_fifo()


def test_plot_of_a_binary_metrics_file_names_the_file_and_line(tmp_path: Path) -> None:
    run_dir = _run_with_metrics(tmp_path)
    metrics = run_dir / "logs" / "metrics.jsonl"
    text_bytes = metrics.stat().st_size  # three good lines, then \x00 (valid), then \xff
    with metrics.open("ab") as f:
        f.write(b"\x00\xff\xfe\x80 binary\n")
    res = CliRunner().invoke(cli, ["plot", str(run_dir)])
    assert res.exit_code == 2, res.output
    assert res.output.strip() == (
        f"error: {metrics} line 4 is not UTF-8 text (byte {text_bytes + 1}); "
        "metrics.jsonl holds one JSON object per line, as the run writes it: was the file "
        "replaced or damaged?"
    )
    assert "Traceback" not in res.output and not (run_dir / "loss.png").exists()


# ------------------------------------------- consolidate_on_finish and a user's model/


def _finished_spec(run_dir: Path):  # type: ignore[no-untyped-def]
    from shardctl.orchestrator.spec import parse_spec

    return parse_spec(
        {
            "name": "fin",
            "train": {
                "model": {"llama": {"vocab_size": 256}},
                "data": {"builtin": "python-stdlib"},
                "steps": 1,
            },
            "checkpoint": {"every_steps": 1, "consolidate_on_finish": True},
            "run_dir": str(run_dir),
        }
    )


def test_the_run_leaves_a_model_folder_holding_a_users_files(tmp_path: Path) -> None:
    from shardctl.train.loop import _consolidate

    run_dir = tmp_path / "run"
    model = run_dir / "model"
    model.mkdir(parents=True)
    (model / "tokenizer.json").write_text("{}")  # the user's, beside a model of ours
    (model / "model.safetensors").write_bytes(b"weights of an earlier consolidation")
    (model / "notes").mkdir()
    # No checkpoint exists: a consolidation that started would fail on it.
    line = _consolidate(_finished_spec(run_dir), 1)
    ckpt = run_dir / "checkpoints" / "step-00000001"
    assert line == (
        f"fin: not consolidating: {model} holds files shardctl did not write (notes, "
        "tokenizer.json), left as they are; write the model elsewhere with: shardctl "
        f"consolidate {ckpt} --out NEW_FOLDER"
    )
    assert sorted(p.name for p in model.iterdir()) == [
        "model.safetensors",
        "notes",
        "tokenizer.json",
    ]
    assert (model / "tokenizer.json").read_text() == "{}"


def test_the_run_replaces_a_model_folder_a_consolidation_wrote(tmp_path: Path) -> None:
    from helpers.consolidate_util import make_dcp_step, tiny_llama
    from safetensors.numpy import load_file
    from shardctl.train.loop import _consolidate

    run_dir = tmp_path / "run"
    llama = tiny_llama()
    make_dcp_step(run_dir / "checkpoints", 1, llama.state_dict(), llama.config.to_dict())
    model = run_dir / "model"
    model.mkdir()
    for name in ("config.json", "model.safetensors", "model.safetensors.index.json"):
        (model / name).write_text("an earlier consolidation of this run")
    line = _consolidate(_finished_spec(run_dir), 1)
    assert line == f"fin: consolidated model written to {model}"
    weights = load_file(model / "model.safetensors")
    assert weights["model.embed_tokens.weight"].shape == (131, 32)


def test_consolidate_after_consolidate_on_finish_says_what_to_do(tmp_path: Path) -> None:
    from helpers.consolidate_util import make_dcp_step, tiny_llama
    from shardctl.train.consolidate import consolidate

    run_dir = tmp_path / "run"
    llama = tiny_llama()
    step = make_dcp_step(run_dir / "checkpoints", 1, llama.state_dict(), llama.config.to_dict())
    consolidate(step, run_dir / "model")  # as consolidate_on_finish does at the end
    res = CliRunner().invoke(cli, ["consolidate", str(run_dir), "--no-progress"])
    assert res.exit_code == 2, res.output
    assert res.output.strip() == (
        f"error: output {run_dir / 'model'} already holds a consolidated model (a run with "
        "checkpoint.consolidate_on_finish writes one at its end); pass --force to write it "
        "again from this checkpoint, or --out to write it elsewhere"
    )
    res = CliRunner().invoke(cli, ["consolidate", str(run_dir), "--no-progress", "--force"])
    assert res.exit_code == 0 and f"model: {run_dir / 'model'}" in res.output, res.output


# ------------------------------------------------------------------------------ init


def test_init_force_replaces_a_regular_file_only(tmp_path: Path) -> None:
    fifo = tmp_path / "job.yaml"
    os.mkfifo(fifo)
    res = CliRunner().invoke(cli, ["init", str(fifo), "--force"])
    assert res.exit_code == 2, res.output
    assert res.stderr.strip() == (
        f"error: {fifo} exists and is a FIFO; init writes a new job spec there only in "
        "place of a regular file (with --force): give another PATH"
    )
    assert fifo.is_fifo()
    target = tmp_path / "mine.yaml"
    target.write_text("my spec\n")
    link = tmp_path / "link.yaml"
    link.symlink_to(target)
    res = CliRunner().invoke(cli, ["init", str(link), "--force"])
    assert res.exit_code == 2 and "is a symbolic link" in res.stderr, res.output
    assert link.is_symlink() and target.read_text() == "my spec\n"
    res = CliRunner().invoke(cli, ["init", str(target), "--force"])
    assert res.exit_code == 0, res.output
    assert "name: mine" in target.read_text()


def test_init_name_with_a_tab_is_one_clear_line(tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    res = CliRunner().invoke(cli, ["init", str(path), "--name", "a\tb"])
    assert res.exit_code == 2, res.output
    assert res.stderr.strip() == (
        "error: --name 'a\\tb' cannot be a job name; accepted: 1-50 lower-case letters, "
        "digits and '-', starting and ending with a letter or digit"
    )
    assert not path.exists()


# ------------------------------------------------- one writer per consolidate/convert --out

# A consolidation that stops in the middle of its copy (its progress callback) until
# the test says go: the second writer meets it while its staging folder exists.
PAUSED_CONSOLIDATE = """
import sys, time
from pathlib import Path
from shardctl.train.consolidate import consolidate
step, out, ready, go = map(Path, sys.argv[1:5])
def pause(done, total):
    if not ready.exists():
        ready.write_text("staging")
        deadline = time.monotonic() + 120
        while not go.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
consolidate(step, out, progress=pause)
print("first consolidation published")
"""

# A process that holds the claim on an --out until its stdin closes.
HOLDER = """
import sys
from pathlib import Path
from shardctl.orchestrator.outclaim import output_claim
with output_claim(Path(sys.argv[1]), "shardctl convert"):
    Path(sys.argv[2]).write_text("holding")
    sys.stdin.read()
"""


def _wait_for(path: Path, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, f"{path} did not appear"
        time.sleep(0.05)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)


def test_a_second_consolidate_of_the_same_out_is_refused_naming_the_first(
    tmp_path: Path,
) -> None:
    from helpers.consolidate_util import make_dcp_step, tiny_llama

    llama = tiny_llama()
    step = make_dcp_step(tmp_path / "ck", 1, llama.state_dict(), llama.config.to_dict())
    out, ready, go = tmp_path / "o", tmp_path / "ready", tmp_path / "go"
    first = subprocess.Popen(
        [sys.executable, "-c", PAUSED_CONSOLIDATE, str(step), str(out), str(ready), str(go)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        _wait_for(ready, first)
        assert (tmp_path / "o.tmp").is_dir()
        res = CliRunner().invoke(cli, ["consolidate", str(step), "--out", str(out)])
        assert res.exit_code == 2, res.output
        assert res.stderr.startswith(
            f"error: {out} is being written by another `shardctl consolidate` (pid {first.pid} on "
        ), res.stderr
        assert "wait for it to end or give another --out" in res.stderr
        assert (tmp_path / "o.tmp").is_dir()  # the first one's staging folder is untouched
        go.write_text("go")
        output, _ = first.communicate(timeout=120)
        assert first.returncode == 0, output
        assert "first consolidation published" in output
    finally:
        _stop(first)
    assert (out / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck", "go", "o", "ready"]


def test_a_second_convert_is_refused_and_a_dead_writers_claim_is_taken_over(
    tmp_path: Path,
) -> None:
    source, out, ready = tmp_path / "source", tmp_path / "d", tmp_path / "ready"
    source.mkdir()
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(out), str(ready)], stdin=subprocess.PIPE, text=True
    )
    args = ["convert", str(source), "--to", "deepspeed", "--world-size", "1", "--out", str(out)]
    try:
        _wait_for(ready, holder)
        res = CliRunner().invoke(cli, args)
        assert res.exit_code == 2, res.output
        assert f"{out} is being written by another `shardctl convert` (pid {holder.pid} on " in (
            res.stderr
        )
        assert f"If that process is gone, delete {tmp_path / 'd.claim'}" in res.stderr
    finally:
        _stop(holder)  # killed: its claim stays behind, held by a dead pid
    assert (tmp_path / "d.claim").is_file()
    res = CliRunner().invoke(cli, args)
    # Taken over: the conversion goes on, to the source (which is not a checkpoint).
    assert res.exit_code != 0 and "being written" not in res.output, res.output
    assert str(source) in res.output
    assert not (tmp_path / "d.claim").exists() and not out.exists()
