"""The memory tier on two nodes: each node's copy held in its partner node's memory too,
and a restart served by the partner's copy when a node's memory is gone.

The two nodes are two torchrun launches on this host (node ranks 0 and 1, one rank
each), each with its own memory folder (`<memory_dir>/node-<n>`): a node never reads
the other's folder, so a copy that serves a wiped node came over the wire.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.ckpt_run import ROOT, child_env, free_port, kill_group
from helpers.train_run import assert_bit_equal, final_weights, tiny_spec
from shardctl.orchestrator.rundir import CONTRACT_ENV
from shardctl.orchestrator.spec import load_spec
from shardctl.train.memory_partner import choose, partner_of, transfers, why_not
from shardctl.train.memory_tier import room_problem

TIMEOUT_S = 480  # a tiny two-node run takes seconds idle, minutes on a loaded host


@pytest.fixture(autouse=True)
def _no_contract_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in CONTRACT_ENV:
        monkeypatch.delenv(name, raising=False)


# ------------------------------------------------------- the plan, on paper


def _held(*copies: tuple[int, int]) -> tuple[dict, list]:
    """A node's inventory holding these (slice node, step) copies."""
    return {copy: {"path": "/x", "manifest": {"files": {}}} for copy in copies}, []


def test_the_trainer_state_folder_is_the_checkpoints_own() -> None:
    from shardctl.train import checkpoint, memory_partner

    assert memory_partner.TRAINER_DIR == checkpoint.TRAINER_DIR  # a torch-free mirror


def test_partner_is_the_next_node_and_the_last_wraps_to_node_0() -> None:
    assert [partner_of(n, 3) for n in range(3)] == [1, 2, 0]


def test_a_wiped_node_is_served_by_its_partner_and_the_newest_common_step_wins() -> None:
    # node 0 holds its own step 8 and node 1's step 8; node 1's memory is gone.
    tables = {0: _held((0, 8), (1, 8)), 1: _held()}
    step, plan = choose(tables, 2, newer_than=4)
    assert (step, plan) == (8, {0: 0, 1: 0})
    # node 1 gets both slices from node 0; node 0 lacks nothing.
    assert transfers(tables, plan, 8, 2) == [(0, 0, 1), (1, 0, 1)]


def test_own_copy_preferred_and_a_step_not_newer_than_durable_is_not_taken() -> None:
    tables = {0: _held((0, 8), (1, 8)), 1: _held((1, 8), (0, 8))}
    assert choose(tables, 2, newer_than=4) == (8, {0: 0, 1: 1})
    assert choose(tables, 2, newer_than=8) == (None, {})


def test_a_copy_in_flight_to_the_partner_leaves_the_step_both_nodes_hold() -> None:
    # Node 1 died while its step-8 copy was on its way: node 0 kept its own step 4
    # until the partner held step 8, and holds node 1's step 4.
    tables = {0: _held((0, 8), (0, 4), (1, 4)), 1: _held()}
    assert choose(tables, 2, newer_than=0) == (4, {0: 0, 1: 0})


def test_a_node_lost_with_its_partner_says_why() -> None:
    tables = {0: _held((0, 8)), 1: _held()}  # node 1's slice: nowhere
    assert choose(tables, 2, newer_than=4) == (None, {})
    assert why_not(tables, 2, 4, []) == (
        "node 1's memory copy of step 8 and its partner copy (on node 0) are both gone"
    )


def _a_copy(folder: Path, step: int, data: bytes = b"weights") -> Path:
    """A committed copy of `step` in `folder` (one file and its manifest)."""
    from shardctl.train.manifest import FORMAT_VERSION, describe_files, write_manifest

    path = folder / f"step-{step:08d}"
    (path / "dcp").mkdir(parents=True)
    (path / "dcp" / "__0_0.distcp").write_bytes(data)
    files = describe_files(path, ["dcp/__0_0.distcp"])
    write_manifest(path, {"format_version": FORMAT_VERSION, "step": step, "files": files})
    return path


def test_a_node_renumbered_by_the_rendezvous_finds_what_it_wrote_as_another_node(
    tmp_path: Path,
) -> None:
    """This host wrote as node 0 and is node 1 now: alone on its host it also reads
    `node-0/` (own copy: node 0's slice; partner copy: node 1's); sharing the host
    with another node (the local cluster) it reads only its own folder."""
    from shardctl.train.memory_partner import Layout, PartnerCopies

    _a_copy(tmp_path / "node-0" / "own", 8)
    _a_copy(tmp_path / "node-0" / "partner-of-node-1", 8)
    bad = _a_copy(tmp_path / "node-0" / "partner-of-node-1", 4)
    (bad / "dcp" / "__0_0.distcp").write_bytes(b"weighTs")  # one byte changed
    now_node_1 = PartnerCopies(None, None, tmp_path, Layout(rank=1, world_size=2, local_world=1))
    assert now_node_1.inventory(0) == ({}, [])
    found, refused = now_node_1.inventory(0, every_node=True)
    assert sorted(found) == [(0, 8), (1, 8)]
    assert found[1, 8]["path"] == str(tmp_path / "node-0" / "partner-of-node-1" / "step-00000008")
    assert len(refused) == 1 and "node 1's step-00000004 failed verification" in refused[0]
    assert "sha256" in refused[0]
    assert now_node_1.inventory(4, every_node=True)[1] == []  # not newer than durable: unread


def test_room_on_two_nodes_counts_the_share_and_the_partners_share(tmp_path: Path) -> None:
    free = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize
    problem = room_problem(tmp_path, free, nodes=2)  # 4 copies of half the free space
    assert problem is not None and "(4 copies of " in problem
    assert "share it holds for its peer node" in problem


def test_status_says_a_partner_restore_who_served_it_and_the_steps_lost(tmp_path: Path) -> None:
    """What `shardctl status` shows of a restore served by a partner's copy (the line the
    trainer appends to restores.jsonl), in words and in `-o json`."""
    from click.testing import CliRunner
    from shardctl.orchestrator.cli import cli
    from shardctl.orchestrator.clusters.base import JobRef
    from shardctl.orchestrator.clusters.records import remember

    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    (run / "local.exit").write_text("0\n")
    served = "node 1 served by node 0's partner copy"
    (run / "logs" / "restores.jsonl").write_text(
        json.dumps({"step": 8, "tier": "partner", "lost_steps": 3, "refused": None,
                    "served": served}) + "\n"
    )  # fmt: skip
    remember(JobRef("local", "9", "pair", str(run), {"attempt": 1}))
    res = CliRunner().invoke(cli, ["status", "pair"])
    assert res.exit_code == 0, res.output
    assert f"restored from partner at step 8 ({served}; 3 steps lost)" in res.output
    res = CliRunner().invoke(cli, ["status", "pair", "-o", "json"])
    restore = json.loads(res.stdout)["restore"]
    assert (restore["tier"], restore["step"], restore["lost_steps"]) == ("partner", 8, 3)
    assert restore["served"] == served


def test_more_than_one_node_is_accepted(tmp_path: Path) -> None:
    path = tiny_spec(
        tmp_path, "two", resources={"nodes": 2, "procs_per_node": 1},
        checkpoint={"every_steps": 4, "memory_every_steps": 2},
    )  # fmt: skip
    assert load_spec(path).checkpoint.memory_every_steps == 2


# ------------------------------------------------- two nodes on this host


def _node_argv(node: int, port: int, nproc: int, *command: str) -> list[str]:
    """torchrun of node `node` of two (`nproc` ranks each), meeting at 127.0.0.1:`port`."""
    return [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
        "--node-rank", str(node), "--nproc-per-node", str(nproc),
        "--master-addr", "127.0.0.1", "--master-port", str(port), *command,
    ]  # fmt: skip


def _start_nodes(
    command: list[str], env: dict[str, str] | None = None, nproc: int = 1
) -> list[subprocess.Popen]:
    """Both nodes of `command` (what torchrun runs), each in a session of its own."""
    port = free_port()
    return [
        subprocess.Popen(
            _node_argv(node, port, nproc, *command),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**child_env(), **(env or {})},
            cwd=ROOT,
            start_new_session=True,
        )
        for node in (0, 1)
    ]


def _loop(spec: Path) -> list[str]:
    return ["-m", "shardctl.train", str(spec)]


def _run_nodes(command: list[str], env: dict[str, str] | None = None, nproc: int = 1) -> str:
    """Both nodes to the end; their output (node 0's, then node 1's)."""
    procs = _start_nodes(command, env, nproc)
    outs = []
    try:
        for proc in procs:
            outs.append(proc.communicate(timeout=TIMEOUT_S)[0])
    finally:
        for proc in procs:
            kill_group(proc)
    text = "\n".join(outs)
    assert all(p.returncode == 0 for p in procs), text[-6000:]
    return text


def _hold_then_kill(spec: Path, step: int, hold: Path, ready: list[Path], nproc: int = 1) -> None:
    """Run both nodes (`nproc` ranks each) until every rank is held at `step` and
    `ready` exist; then SIGKILL node 1's ranks and both launchers with every rank below
    them."""
    hold.mkdir()
    procs = _start_nodes(_loop(spec), {"SHARDCTL_HOLD_AT_STEP": f"{step}:{hold}"}, nproc)
    try:
        deadline = time.monotonic() + TIMEOUT_S
        wanted = [*(hold / f"held-{rank}" for rank in range(2 * nproc)), *ready]
        while not all(p.exists() for p in wanted):
            ended = [p for p in procs if p.poll() is not None]
            assert not ended, f"a node ended first: {ended[0].communicate()[0][-4000:]}"
            assert time.monotonic() < deadline, f"not held at step {step} in {TIMEOUT_S} s"
            time.sleep(0.1)
        import psutil

        node1_ranks = psutil.Process(procs[1].pid).children(recursive=True)
        for child in node1_ranks:
            if "shardctl.train" in child.cmdline():
                os.kill(child.pid, signal.SIGKILL)
    finally:
        for proc in procs:
            kill_group(proc)
            proc.communicate(timeout=60)


def _restores(run_dir: Path) -> list[dict]:
    path = run_dir / "logs" / "restores.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def _as_one_checkpoint(copies: list[Path], out: Path) -> None:
    """The nodes' own copies of one step merged into one folder, as a durable
    checkpoint holds it: every node's files, one manifest listing them all."""
    files: dict = {}
    for copy in copies:
        shutil.copytree(copy, out, dirs_exist_ok=True, ignore=shutil.ignore_patterns("manifest*"))
        files.update(json.loads((copy / "manifest.json").read_text())["files"])
    manifest = json.loads((copies[0] / "manifest.json").read_text())
    manifest.pop("node"), manifest.pop("nodes")
    (out / "manifest.json").write_text(json.dumps({**manifest, "files": files}))


def _bytes(copy: Path) -> int:
    """The bytes of a copy's files, as its manifest lists them."""
    files = json.loads((copy / "manifest.json").read_text())["files"]
    return sum(f["size"] for f in files.values())


def _two_node_spec(tmp_path: Path, name: str, **checkpoint: object) -> Path:
    return tiny_spec(
        tmp_path, name, resources={"nodes": 2, "procs_per_node": 1},
        train={"steps": 10, "log_every": 1}, checkpoint=checkpoint,
    )  # fmt: skip


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_a_wiped_node_resumes_from_its_partners_copy_bit_identical_to_disk(
    tmp_path: Path,
) -> None:
    """Copy at step 4 (K=4, durable every 8); held at step 7, node 1's memory folder
    removed and its rank killed: the restart resumes at step 4, node 1 served by node
    0's partner copy, and ends bit-identical to a two-node run restored from the same
    step on disk."""
    tier = tmp_path / "tier"
    spec = _two_node_spec(tmp_path, "mem", every_steps=8, memory_every_steps=4,
                          memory_dir=str(tier))  # fmt: skip
    step4 = "step-00000004"
    ready = [tier / "node-0" / "partner-of-node-1" / step4 / "manifest.json",
             tier / "node-1" / "partner-of-node-0" / step4 / "manifest.json"]  # fmt: skip
    _hold_then_kill(spec, 7, tmp_path / "hold", ready)
    disk = tmp_path / "disk" / "checkpoints"
    _as_one_checkpoint([tier / f"node-{n}" / "own" / step4 for n in (0, 1)], disk / step4)
    slice_bytes = [_bytes(tier / f"node-{n}" / "own" / step4) for n in (0, 1)]
    shutil.rmtree(tier / "node-1")  # node 1's memory is gone

    out = _run_nodes(_loop(spec))
    assert "resumed at step 4 (from partner: node 1 served by node 0's partner copy" in out
    last = _restores(tmp_path / "mem")[-1]
    assert (last["tier"], last["step"]) == ("partner", 4)
    assert last["lost_steps"] < 4  # steps 5 and 6 logged, then lost: fewer than K
    assert last["served"] == "node 1 served by node 0's partner copy"
    # Node 1 got its own slice back and, of node 0's, only what every rank loads whole
    # (DCP's metadata and the values written once): not node 0's shards.
    assert slice_bytes[1] < last["received_bytes"] < sum(slice_bytes)
    assert not tier.exists()  # finished: the final durable step is newer, memory freed

    reference = _two_node_spec(tmp_path, "disk", every_steps=8, dir=str(disk))
    assert "resumed at step 4 (from durable: checkpoint verified" in _run_nodes(_loop(reference))
    from_memory = final_weights(tmp_path / "mem" / "checkpoints" / "step-00000010", tmp_path / "a")
    from_disk = final_weights(disk / "step-00000010", tmp_path / "b")
    assert_bit_equal(from_memory, from_disk)


def _flip_a_byte(folder: Path) -> None:
    shard = max((p for p in folder.rglob("*") if p.is_file() and p.name != "manifest.json"),
                key=lambda p: p.stat().st_size)  # fmt: skip
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_node_memory_gone_and_no_good_partner_copy_falls_back_to_durable(tmp_path: Path) -> None:
    """Durable step 3, memory copies of step 4; node 1's memory removed and one byte of
    its partner copy on node 0 flipped: the restart resumes at step 3 from the durable
    tier and says why. (A partner copy refused is left out of the plan as one that is
    gone: `test_a_node_lost_with_its_partner_says_why` says it of a missing one.)"""
    tier = tmp_path / "tier"
    spec = tiny_spec(
        tmp_path, "fall", resources={"nodes": 2, "procs_per_node": 1}, train={"steps": 6},
        checkpoint={"every_steps": 3, "memory_every_steps": 2, "memory_dir": str(tier)},
    )  # fmt: skip
    held = tier / "node-0" / "partner-of-node-1" / "step-00000004"
    _hold_then_kill(spec, 5, tmp_path / "hold", [held / "manifest.json"])
    shutil.rmtree(tier / "node-1")
    _flip_a_byte(held)

    out = _run_nodes(_loop(spec))
    assert "resumed at step 3 (from durable: checkpoint verified" in out
    last = _restores(tmp_path / "fall")[-1]
    assert (last["tier"], last["step"]) == ("durable", 3)
    assert (
        "node 1's memory copy of step 4 and its partner copy (on node 0) are both gone"
        in (last["refused"])
    )
    assert "memory tier not used: node 1's memory copy of step 4" in out
    assert "node 0's copy of node 1's step-00000004 failed verification" in last["refused"]
    assert "sha256" in last["refused"]


# ------------------------------------------------ a user's script (Checkpointer)

SCRIPT = """
import json, sys
from pathlib import Path

import torch
import torch.distributed as dist
from shardctl.train import api

phase, tmp = sys.argv[1], Path(sys.argv[2])
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(1 if phase == "first" else 2)  # the second start must load, not match
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
conf = api.CheckpointConfig(
    dir=str(tmp / "ck"), every_steps=4, keep=2, memory_every_steps=3,
    memory_dir=str(tmp / "tier"),
)
ckpt = api.Checkpointer(conf, run_dir=tmp / "run", install_signals=False)
start = ckpt.resume(api.model_state(model, opt))
if phase == "first":
    torch.manual_seed(10 + rank)
    for step in range(start + 1, 7):
        model(torch.randn(3, 4)).pow(2).mean().backward()
        for p in model.parameters():  # the same update on every rank (no DDP here)
            dist.all_reduce(p.grad)
        opt.step()
        opt.zero_grad()
        ckpt.step_done(step)
ckpt.close()  # phase "first": the process "dies" after step 6 (disk: 4, memory: 6)
torch.save({k: v.clone() for k, v in model.state_dict().items()}, tmp / f"{phase}-{rank}.pt")
(tmp / f"{phase}-{rank}.json").write_text(json.dumps({"start": start}))
dist.destroy_process_group()
"""


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_checkpointer_on_two_nodes_node_1_gets_its_copy_from_the_partner(tmp_path: Path) -> None:
    """A user's script on two nodes of 2 ranks stops after step 6 (disk: step 4, memory:
    step 6); node 1 is then said to be new (a spare stands in:
    SHARDCTL_MEMORY_FRESH_NODES; its folder is not asked, though it is still there): the
    next start resumes at step 6 from node 0's partner copy, every rank bit-identical to
    where it stopped. (A wiped node's folder: the built-in loop's test above.)"""
    import torch

    nproc = 2
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    _run_nodes([str(script), "first", str(tmp_path)], nproc=nproc)
    tier = tmp_path / "tier"
    assert sorted(p.name for p in (tier / "node-0").iterdir()) == ["own", "partner-of-node-1"]
    assert [p.name for p in (tier / "node-0" / "partner-of-node-1").iterdir()] == ["step-00000006"]
    env = {"SHARDCTL_MEMORY_FRESH_NODES": "1"}
    out = _run_nodes([str(script), "second", str(tmp_path)], env, nproc)
    assert "resumed at step 6 (from partner: node 1 served by node 0's partner copy" in out
    for rank in range(2 * nproc):
        assert json.loads((tmp_path / f"second-{rank}.json").read_text())["start"] == 6
        before = torch.load(tmp_path / f"first-{rank}.pt")
        after = torch.load(tmp_path / f"second-{rank}.pt")
        assert before.keys() == after.keys()
        assert all(torch.equal(before[k], after[k]) for k in before), rank
    last = _restores(tmp_path / "run")[-1]
    assert (last["tier"], last["step"]) == ("partner", 6)
