"""The command line against the real dev Slurm cluster: `ls`, `logs -f` and `status
--watch` of a Slurm job, and `doctor`'s probe of the nodes.

They live here, beside the other Slurm files, because every test that needs the dev
cluster runs on one pytest worker, in turn (tests/conftest.py)."""

from __future__ import annotations

import copy
import json
import re
import subprocess
from pathlib import Path

import pytest
from helpers.ckpt_run import kill_group
from shardctl.orchestrator.clusters.slurm import SlurmCluster
from test_cli_jobs import _env, _finish, _start
from test_doctor import doctor
from test_k8s_render import BASE
from test_slurm_cluster import slurm_cluster  # noqa: F401  (the dev cluster fixture)


@pytest.mark.slurm
@pytest.mark.slow
@pytest.mark.usefixtures("slurm_cluster")
def test_ls_and_logs_follow_on_slurm(tmp_path: Path) -> None:
    from test_slurm_cluster import _spec, _submitted

    spec = _spec(
        "jobs-follow",
        train={"steps": 10},
        checkpoint={"every_steps": 10, "keep": 2, "consolidate_on_finish": False},
    )
    ref = _submitted(tmp_path, spec)
    env = _env()
    follow = _start(["logs", ref.name, "-f"], env, tmp_path)
    node1 = None
    try:
        try:
            rc, out, err = _finish(follow, 540)  # the job: 10 min at most (slurm.time)
        except AssertionError as exc:
            # What Slurm says of the job, and what the run wrote, for the next reader.
            shown = subprocess.run(
                ["scontrol", "show", "job", ref.job_id], capture_output=True, text=True
            )
            files = sorted(str(p) for p in Path(ref.run_dir).rglob("*"))[:60]
            raise AssertionError(f"{exc}\n{shown.stdout}{shown.stderr}\n{files}") from None
        assert rc == 0, err
        lines = out.splitlines()
        # Global rank 0 prints the steps; the c10d rendezvous, not the node number,
        # decides which node runs it (whichever joins first).
        step_10 = re.compile(r"\[node [01]/out\] step +10/10 ")
        assert any(step_10.match(x) for x in lines), out[-3000:]
        assert any(x.startswith("[node 0/") for x in lines), out[-3000:]
        assert any(x.startswith("[node 1/") for x in lines), out[-3000:]
        assert all(x.startswith(("[node 0/", "[node 1/")) for x in lines if x)
        node1 = _start(["logs", ref.name, "-f", "--node", "1"], env, tmp_path)
        rc, out, err = _finish(node1, 120)  # the job ended: prints and returns
        assert rc == 0 and out and all(x.startswith("[node 1/") for x in out.splitlines()), err
        res = _start(["logs", ref.name, "-f", "--node", "2"], env, tmp_path)
        rc, _, err = _finish(res, 60)
        assert rc == 2 and "has 2 node(s); accepted: 0..1" in err
        res = _start(["ls", "--cluster", "slurm", "-o", "json"], env, tmp_path)
        rc, out, err = _finish(res, 120)
        assert rc == 0, err
        (row,) = json.loads(out)["jobs"]
        assert (row["state"], row["stale"]) == ("SUCCEEDED", False)
        assert (row["progress"]["step"], row["progress"]["total"]) == (10, 10)
        watch = _start(["status", ref.name, "--watch"], env, tmp_path)
        rc, out, err = _finish(watch, 120)
        assert rc == 0 and "SUCCEEDED" in out, out + err
    finally:
        for proc in (follow, node1):
            if proc is not None and proc.poll() is None:
                kill_group(proc)
        if not SlurmCluster().status(ref).state.is_terminal:
            SlurmCluster().cancel(ref)


@pytest.mark.slurm
@pytest.mark.timeout(300)
def test_slurm_probe_catches_a_master_that_resolves_to_loopback(
    slurm_cluster: None,  # noqa: F811
    tmp_path: Path,
) -> None:
    data = copy.deepcopy(BASE)  # 2 nodes
    shared = Path(__file__).resolve().parent.parent / "runs" / "doctor-test"
    data["run_dir"] = str(shared)
    data["slurm"] = {"partition": "debug"}
    try:
        code, checks = doctor(data, tmp_path, "--cluster", "slurm")
    finally:
        import shutil

        shutil.rmtree(shared, ignore_errors=True)
    master = checks["master address"]
    # Both dev nodes are this host at 127.0.0.1: a real cluster would not rendezvous.
    assert master.status == "fail", checks
    assert "n1 (the first host) resolves to a loopback address" in master.detail
    assert "NodeAddr" in master.fix
    assert code == 1
    # The same folder on one host: every node saw every node's file.
    assert checks["checkpoint dir"].status == "ok", checks["checkpoint dir"]
    assert checks["master port"].status in ("ok", "fail")
    assert checks["node rank"].detail.endswith("$SLURM_NODEID")
