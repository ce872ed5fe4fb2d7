"""Recovery: from a fault to the first step of the restarted ranks, phase by phase.

    python benchmarks/recovery.py --cluster local --faults crash,hang,preempt --rounds 2 --markdown
    python benchmarks/recovery.py --cluster slurm --faults crash,hang,preempt --rounds 2 --markdown
    python benchmarks/recovery.py --from-json local.out slurm-1.out slurm-2.out   # one table
    python benchmarks/recovery.py --cluster slurm --nodes 32 --faults crash,preempt --rounds 1 \
        --hang-timeout 60 --markdown     # at scale (scripts/slurm-dev-cluster up --nodes 32)

One real run of the tests' tiny Llama (tests/helpers/train_run.py's TINY_LLAMA: FSDP2
full_shard, bf16-mixed, gloo; a metrics line every step, a checkpoint every 10 steps,
`watchdog.hang_timeout_s` 15, `restart.max_in_allocation` enough for every fault):
2 CPU ranks under `shardctl submit` here (`--cluster local`), or `--nodes` (default 2)
nodes × 1 rank on the Slurm dev cluster (`--cluster slurm`, `scripts/slurm-dev-cluster
up --nodes N`). Once the run
has a complete checkpoint newer than its last resume and is a few steps past it (and
not about to save), each fault of `--faults` is injected in turn, `--rounds` times:

- crash:   SIGKILL to rank 1 (on Slurm: the rank of node N/2, node 1 of 2);
- hang:    SIGSTOP to the same rank (the node's watchdog ends the ranks after the hang
           timeout);
- preempt: SIGUSR2 to every rank here; `scancel --signal=USR2 JOB` on Slurm. The ranks
           save and exit 42. On Slurm node 0 requeues the job; here the supervisor
           stops (a preemption gives the allocation back) and this script runs
           `shardctl submit` again as soon as the supervisor is gone, as a user would.

Nothing is added to the product: every mark is read from what the run writes anyway,
the processes' start times in /proc, and the heartbeat files' creation (birth) times.
The marks, in order (epoch seconds; each phase runs from the mark before it):

    fault           just before the signal (or scancel) is sent
    detect          crash: the launcher's first reaction (torchrun's elastic agent's
                    first log line after the fault, e.g. "Sending process N closing
                    signal SIGTERM"; else its exit); hang: the HUNG marker's `time`;
                    preempt: the PREEMPTED marker's mtime (the ranks agreed, saved and
                    said so)
    tear down       the last rank of the faulted attempt gone (polled every 20 ms)
    launcher exit   the last watchdog/launcher process of that attempt gone (every node)
    judge + claim   the new attempt token's claim: CURRENT_ATTEMPT's mtime (written by
                    the supervisor after its verdict; by `submit` after a local
                    preemption; by node 0's task in the requeued allocation on Slurm)
    start ranks     the newest of the new ranks' process start times (/proc, 10 ms)
    imports + rdzv  the process group is up: the birth time of each new rank's heartbeat
                    file, created by its first heartbeat right after
                    `init_process_group` (interpreter, imports, spec, rendezvous)
    build           the restore began (the ranks' `restore` heartbeat): model, FSDP,
                    optimizer, data (transformers is imported here)
    load            restored (the `step` heartbeat the loop writes after the restore, else
                    restore began + the ranks' own "verified and loaded in X s")
    first step      the `time` of step resumed+1 in logs/metrics.jsonl

A mark earlier than the one before it (a rank that died of its lost peer before the
launcher reacted) gives that phase 0 s; a mark not seen (a heartbeat overwritten
before the 20 ms poll read it) lumps its phase into the next one. Sub-marks (the
verdict's time in attempts.jsonl, the new watchdog's and torchrun's start, ...) are
in the JSON. For scale, `--imports` (default on) also times the ranks' imports alone:
two fresh interpreters at once importing what a rank imports before its process group
(`shardctl.train.loop`, `torch.distributed`), then transformers' Llama.

Prints JSON (every mark of every round), and with --markdown the table for
benchmarks/README.md (medians over rounds; each phase's median, so the phases need not
add up to the median total); `--from-json` prints that table for saved outputs, the
rounds of runs on the same cluster together. Every process is cleaned up by its pid,
a Slurm job by its id. The work folder (a temporary one unless --work) is removed
unless --keep.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from shardctl.orchestrator.outcome import newest_checkpoint
from shardctl.orchestrator.proctree import alive
from shardctl.train.heartbeat import BEAT_PREFIX, read_beats

# The tests' tiny Llama (tests/helpers/train_run.py, TINY_LLAMA).
TINY_LLAMA = {
    "vocab_size": 256,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "max_position_embeddings": 64,
}
EVERY = 10  # checkpoint.every_steps
FAULTS = ("crash", "hang", "preempt")
TICK_S = 0.02  # old processes, markers, heartbeats, logs
SCAN_S = 0.2  # the /proc walk for new processes
READY_TIMEOUT_S = 900.0
RECOVER_TIMEOUT_S = 900.0
SLURM_ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
               "BOOT_FAIL", "DEADLINE", "PREEMPTED")  # fmt: skip
SHARDCTL = [sys.executable, "-m", "shardctl.orchestrator.cli"]
RESUMED = re.compile(r"resumed at step (\d+) \(checkpoint verified and loaded in ([0-9.]+) s\)")
# torchrun's elastic agent logs like glog:
# "W1126 11:07:04.589000 9434 torch/distributed/elastic/multiprocessing/api.py:1028] ..."
AGENT_LINE = re.compile(
    r"^[IWEF](\d\d)(\d\d) (\d\d):(\d\d):(\d\d)\.(\d+) +\d+ torch/distributed/elastic/", re.M
)
PHASES = (
    ("detect", "detect"),
    ("tear_down", "tear down"),
    ("launcher_exit", "launcher exit"),
    ("claim", "judge + claim"),
    ("ranks_started", "start ranks"),
    ("group_up", "imports + rendezvous"),
    ("restore_began", "build"),
    ("restored", "load"),
    ("first_step", "first step"),
)


# ------------------------------------------------------------------ /proc


def _boot_epoch() -> float:
    """The epoch of boot, to turn /proc start ticks (CLOCK_BOOTTIME) into epoch seconds."""
    return time.time() - time.clock_gettime(time.CLOCK_BOOTTIME)


BOOT = _boot_epoch()
HZ = os.sysconf("SC_CLK_TCK")


def _stat(pid: int) -> list[str] | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rfind(")") + 2 :].split()


@dataclass(frozen=True)
class RunProc:
    """A process of the run: a rank, a node's watchdog or a launcher (torchrun)."""

    pid: int
    ticks: str
    role: str  # rank | watchdog | launcher
    start: float  # epoch, from /proc (10 ms)
    rank: int | None = None
    node: int | None = None
    heartbeat_dir: str | None = None

    @property
    def key(self) -> tuple[int, str]:
        return self.pid, self.ticks


def _role(argv: list[bytes]) -> str | None:
    if len(argv) > 1 and argv[1].endswith(b"torchrun"):
        return "launcher"
    module = next((argv[i + 1] for i, w in enumerate(argv[:-1]) if w == b"-m"), b"")
    return {
        b"shardctl.train": "rank",
        b"shardctl.train.watchdog": "watchdog",
        b"torch.distributed.run": "launcher",
    }.get(module)


def scan(run_dir: Path) -> list[RunProc]:
    """Every live process of `run_dir` (its environment says SHARDCTL_RUN_DIR): ranks
    (a rank's own forked children left out), watchdogs, launchers."""
    want = os.path.realpath(run_dir)
    found: dict[int, tuple[RunProc, int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        pid = int(entry)
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            role = _role(argv)
            if role is None:
                continue
            raw = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            continue
        env = dict(w.decode(errors="replace").partition("=")[::2] for w in raw.split(b"\0") if w)
        if os.path.realpath(env.get("SHARDCTL_RUN_DIR", "/nonexistent")) != want:
            continue
        if role == "rank" and "RANK" not in env:
            continue
        fields = _stat(pid)
        if fields is None or len(fields) < 20 or fields[0] == "Z":
            continue
        node = env.get("SLURM_NODEID", env.get("SHARDCTL_NODE_RANK"))
        p = RunProc(
            pid, fields[19], role, BOOT + int(fields[19]) / HZ,
            rank=int(env["RANK"]) if role == "rank" else None,
            node=int(node) if node and node.isdigit() else None,
            heartbeat_dir=env.get("SHARDCTL_HEARTBEAT_DIR") or None,
        )  # fmt: skip
        found[pid] = (p, int(fields[1]))
    ranks = {pid for pid, (p, _parent) in found.items() if p.role == "rank"}
    return [p for p, parent in found.values() if not (p.role == "rank" and parent in ranks)]


class _Timespec(ctypes.Structure):
    _fields_ = (("sec", ctypes.c_int64), ("nsec", ctypes.c_uint32), ("pad", ctypes.c_int32))


class _Statx(ctypes.Structure):
    _fields_ = (
        ("mask", ctypes.c_uint32), ("blksize", ctypes.c_uint32), ("attributes", ctypes.c_uint64),
        ("nlink", ctypes.c_uint32), ("uid", ctypes.c_uint32), ("gid", ctypes.c_uint32),
        ("mode", ctypes.c_uint16), ("spare0", ctypes.c_uint16), ("ino", ctypes.c_uint64),
        ("size", ctypes.c_uint64), ("blocks", ctypes.c_uint64),
        ("attributes_mask", ctypes.c_uint64), ("atime", _Timespec), ("btime", _Timespec),
        ("ctime", _Timespec), ("mtime", _Timespec), ("spare", ctypes.c_uint64 * 14),
    )  # fmt: skip


_LIBC = ctypes.CDLL(None, use_errno=True)
STATX_BTIME = 0x800
AT_FDCWD = -100


def birth_time(path: Path) -> float | None:
    """When `path` was created (statx's btime), or None where the file system keeps none."""
    buf = _Statx()
    statx = getattr(_LIBC, "statx", None)
    if statx is None or statx(AT_FDCWD, os.fsencode(path), 0, STATX_BTIME, ctypes.byref(buf)):
        return None
    if not buf.mask & STATX_BTIME or buf.btime.sec == 0:
        return None
    return buf.btime.sec + buf.btime.nsec / 1e9


# ------------------------------------------------------------------ files


class Tail:
    """A file read as it grows (read again from the start if it shrank)."""

    def __init__(self, path: Path, at_end: bool = True) -> None:
        self.path = path
        self.offset = self._size() if at_end else 0

    def _size(self) -> int:
        try:
            return self.path.stat().st_size
        except OSError:
            return 0

    def new(self) -> str:
        size = self._size()
        if size < self.offset:
            self.offset = 0
        if size == self.offset:
            return ""
        with contextlib.suppress(OSError), self.path.open("rb") as f:
            f.seek(self.offset)
            data = f.read(size - self.offset)
            cut = data.rfind(b"\n") + 1  # whole lines only
            self.offset += cut
            return data[:cut].decode(errors="replace")
        return ""


def metrics_steps(text: str) -> list[tuple[int, float]]:
    out = []
    for line in text.splitlines():
        with contextlib.suppress(ValueError):
            entry = json.loads(line)
            if isinstance(entry, dict) and "step" in entry and "time" in entry:
                out.append((int(entry["step"]), float(entry["time"])))
    return out


def _mtime(path: Path) -> float | None:
    try:
        return path.stat().st_mtime
    except OSError:
        return None


def _json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def agent_times(text: str) -> list[float]:
    """The times of torchrun's elastic agent's log lines (local time, this year)."""
    year = time.localtime().tm_year
    out = []
    for m in AGENT_LINE.finditer(text):
        mon, day, hh, mm, ss, frac = m.groups()
        base = time.mktime((year, int(mon), int(day), int(hh), int(mm), int(ss), 0, 0, -1))
        out.append(base + float(f"0.{frac}"))
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ------------------------------------------------------------------ clusters


class Run:
    """One run of the tiny model on a cluster: its spec, submission, logs and faults."""

    cluster = ""
    world = 2

    def __init__(self, work: Path, args: argparse.Namespace) -> None:
        self.work = work
        self.args = args
        self.name = f"recovery-{self.cluster}-{os.getpid()}"
        self.run_dir = work / self.name
        self.ckpt_dir = self.run_dir / "checkpoints"
        self.spec_path = work / f"{self.name}.yaml"
        self.env = dict(os.environ, SHARDCTL_STATE_DIR=str(work / "state"))
        self.env.setdefault("OMP_NUM_THREADS", "1")
        self.ref: dict[str, Any] = {}
        self.stopped: list[RunProc] = []  # SIGSTOPped ranks, continued at cleanup

    def spec(self) -> dict[str, Any]:
        rounds = self.args.rounds * len(self.args.faults)
        return {
            "name": self.name,
            "run_dir": str(self.run_dir),
            "launcher": "torchrun",
            "strategy": {"backend": "fsdp", "sharding": "full_shard", "precision": "bf16-mixed"},
            "train": {
                "model": {"llama": dict(TINY_LLAMA)},
                "data": {"builtin": "python-stdlib"},
                "steps": 1_000_000,  # never reached: the run is cancelled at the end
                "micro_batch_size": 2,
                "seq_len": 32,
                "grad_accum": 2,
                "lr": 1e-3,
                "warmup_steps": 1,
                "seed": 7,
                "log_every": 1,
            },
            "checkpoint": {
                "every_steps": EVERY,
                "keep": 2,
                "dir": str(self.ckpt_dir),
                "consolidate_on_finish": False,
            },
            "watchdog": {"hang_timeout_s": self.args.hang_timeout},
            "restart": {"max_in_allocation": rounds + 1},
        }

    def submit(self) -> None:
        self.spec_path.write_text(yaml.safe_dump(self.spec(), sort_keys=False))
        proc = subprocess.run(
            [*SHARDCTL, "submit", str(self.spec_path), *self.submit_args(), "-o", "json"],
            cwd=self.work, env=self.env, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        if proc.returncode != 0:
            raise RuntimeError(f"submit failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
        self.ref = json.loads(proc.stdout)

    def submit_args(self) -> list[str]:
        return []

    # what each cluster says differently
    def out_logs(self) -> list[Path]:
        raise NotImplementedError

    def err_logs(self) -> list[Path]:
        raise NotImplementedError

    def victim(self, ranks: list[RunProc]) -> RunProc:
        raise NotImplementedError

    def preempt(self, ranks: list[RunProc]) -> None:
        raise NotImplementedError

    def poll_after_preempt(self, marks: dict[str, Any]) -> None:
        """Called every tick after a preemption (local: submit again once it ended)."""

    def running(self) -> bool:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def cleanup(self) -> None:
        """Stop the job, then end by pid whatever of the run is still alive."""
        for p in self.stopped:
            if alive(p.pid, p.ticks):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGCONT)
        with contextlib.suppress(Exception):
            self.stop()
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and scan(self.run_dir):
            time.sleep(0.5)
        for p in scan(self.run_dir):
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGKILL)


class LocalRun(Run):
    cluster = "local"

    def spec(self) -> dict[str, Any]:
        return {
            **super().spec(),
            "resources": {"nodes": 1, "procs_per_node": 2, "device": "cpu"},
            "local": {"master_port": free_port()},
        }

    def out_logs(self) -> list[Path]:
        return [self.run_dir / "logs" / "launcher.out"]

    def err_logs(self) -> list[Path]:
        return [self.run_dir / "logs" / "launcher.err"]

    def victim(self, ranks: list[RunProc]) -> RunProc:
        return next(p for p in ranks if p.rank == 1)

    def preempt(self, ranks: list[RunProc]) -> None:
        for p in ranks:
            os.kill(p.pid, signal.SIGUSR2)

    def _supervisor(self) -> tuple[int, str | None] | None:
        try:
            words = (self.run_dir / "local.pid").read_text().split()
            return int(words[0]), (words[1] if len(words) > 1 else None)
        except (OSError, ValueError, IndexError):
            return None

    def poll_after_preempt(self, marks: dict[str, Any]) -> None:
        if "resubmitted" in marks:
            return
        sup = self._supervisor()
        if sup is not None and alive(*sup):
            return
        marks["supervisor_gone"] = time.time()
        marks["resubmitted"] = time.time()
        self.submit()  # a preemption stops a local run: submit again resumes it

    def running(self) -> bool:
        sup = self._supervisor()
        return sup is not None and alive(*sup)

    def stop(self) -> None:
        subprocess.run(
            [*SHARDCTL, "cancel", self.name], cwd=self.work, env=self.env,
            capture_output=True, timeout=120, check=False,
        )  # fmt: skip


class SlurmRun(Run):
    cluster = "slurm"

    def __init__(self, work: Path, args: argparse.Namespace) -> None:
        super().__init__(work, args)
        self.world = args.nodes

    def spec(self) -> dict[str, Any]:
        return {
            **super().spec(),
            "resources": {"nodes": self.args.nodes, "procs_per_node": 1, "device": "cpu"},
            "slurm": {
                "time": "01:00:00",
                "master_port": free_port(),
                "max_requeues": self.args.rounds + 2,
            },
        }

    def submit_args(self) -> list[str]:
        return ["--cluster", "slurm"]

    @property
    def job(self) -> str:
        return str(self.ref["job_id"])

    def _logs(self, kind: str) -> list[Path]:
        folder = Path(self.ref["extra"]["folder"])
        return [folder / f"{self.job}_{node}_log.{kind}" for node in range(self.args.nodes)]

    def out_logs(self) -> list[Path]:
        return self._logs("out")

    def err_logs(self) -> list[Path]:
        return self._logs("err")

    def victim(self, ranks: list[RunProc]) -> RunProc:
        return next(p for p in ranks if p.node == self.args.nodes // 2)

    def preempt(self, ranks: list[RunProc]) -> None:
        subprocess.run(["scancel", "--signal=USR2", self.job], check=True, timeout=60)

    def running(self) -> bool:
        proc = subprocess.run(
            ["squeue", "-h", "-j", self.job, "-o", "%T"], capture_output=True, text=True,
            timeout=60, check=False,
        )  # fmt: skip
        state = proc.stdout.strip()
        return bool(state) and state not in SLURM_ENDED

    def stop(self) -> None:
        if self.ref:
            subprocess.run(["scancel", self.job], timeout=60, check=False)


# ------------------------------------------------------------------ one fault


@dataclass
class Watch:
    """What happened after a fault, read every tick until the restarted ranks' first step."""

    run: Run
    fault: str
    t_fault: float
    old: list[RunProc]
    token_before: str | None
    outs: list[Tail]
    errs: list[Tail]
    metrics: Tail
    gone: dict[tuple[int, str], float] = field(default_factory=dict)
    new: dict[tuple[int, str], RunProc] = field(default_factory=dict)
    markers: dict[str, dict[str, Any]] = field(default_factory=dict)
    claim: tuple[float, str] | None = None
    beats: dict[tuple[int, str, int], float] = field(default_factory=dict)  # (rank, phase, step)
    births: dict[int, float] = field(default_factory=dict)  # rank → its heartbeat's birth
    hb_dirs: set[str] = field(default_factory=set)
    resumed: tuple[int, float] | None = None  # (step, the ranks' own load seconds)
    steps: list[tuple[int, float]] = field(default_factory=list)
    agent: list[float] = field(default_factory=list)
    marks: dict[str, Any] = field(default_factory=dict)
    last_scan: float = 0.0

    def tick(self) -> None:
        now = time.time()
        for p in self.old:
            if p.key not in self.gone and not alive(p.pid, p.ticks):
                self.gone[p.key] = now
        for name in ("HUNG", "PREEMPTED", "FAILED"):
            path = self.run.run_dir / name
            mtime = _mtime(path)
            if name not in self.markers and mtime is not None and mtime >= self.t_fault - 0.5:
                self.markers[name] = {**(_json(path) or {}), "mtime": mtime}
        if self.claim is None:
            path = self.run.run_dir / "CURRENT_ATTEMPT"
            token = (_json(path) or {}).get("token")
            mtime = _mtime(path)
            if token and token != self.token_before and mtime is not None:
                self.claim = (mtime, str(token))
        if now - self.last_scan >= SCAN_S:
            self.last_scan = now
            self._scan()
        for folder in self.hb_dirs:
            for b in read_beats(folder):
                self.beats.setdefault((b.rank, b.phase, b.step), b.time)
                if b.rank not in self.births:
                    born = birth_time(Path(folder) / f"{BEAT_PREFIX}{b.rank}")
                    if born is not None:
                        self.births[b.rank] = born
        for tail in self.errs:
            self.agent += [t for t in agent_times(tail.new()) if t >= self.t_fault - 0.05]
        for tail in self.outs:
            for m in RESUMED.finditer(tail.new()):
                self.resumed = (int(m.group(1)), float(m.group(2)))
        self.steps += [(s, t) for s, t in metrics_steps(self.metrics.new()) if t > self.t_fault]
        if self.fault == "preempt":
            self.run.poll_after_preempt(self.marks)

    def _scan(self) -> None:
        olds = {p.key for p in self.old}
        for p in scan(self.run.run_dir):
            if p.key in olds or p.key in self.new or p.start < self.t_fault - 0.05:
                continue
            self.new[p.key] = p
            if p.heartbeat_dir:
                self.hb_dirs.add(p.heartbeat_dir)

    def _all_gone(self, procs: list[RunProc]) -> float | None:
        """When the last of `procs` was seen gone (None: one was never seen gone)."""
        known = [self.gone[p.key] for p in procs if p.key in self.gone]
        return max(known) if procs and len(known) == len(procs) else None

    def first_step(self) -> float | None:
        if self.resumed is None:
            return None
        return next((t for s, t in self.steps if s == self.resumed[0] + 1), None)

    def result(self) -> dict[str, Any]:
        """The marks, the phases between them, and what else was seen."""
        step = self.resumed[0] if self.resumed else None
        new_ranks = [p for p in self.new.values() if p.role == "rank"]
        rank_nos = sorted({p.rank for p in new_ranks if p.rank is not None})
        old_ranks = [p for p in self.old if p.role == "rank"]
        old_launch = [p for p in self.old if p.role != "rank"]

        def latest(values: Iterable[float | None]) -> float | None:
            got = [v for v in values if v is not None]
            return max(got) if len(got) == len(rank_nos) and got else None

        if self.fault == "crash":
            # torchrun's first log line after the fault, else its exit.
            exits = [
                self.gone[p.key] for p in old_launch if p.role == "launcher" and p.key in self.gone
            ]
            detect = min([*self.agent, *exits], default=None)
        elif self.fault == "hang":
            hung = self.markers.get("HUNG", {})
            detect = hung.get("time", hung.get("mtime"))
        else:
            detect = self.markers.get("PREEMPTED", {}).get("mtime")
        restore_began = latest(self.beats.get((r, "restore", -1)) for r in rank_nos)
        restored = latest(
            self.beats.get((r, "step", step if step is not None else -2)) for r in rank_nos
        )
        if restored is None and restore_began is not None and self.resumed is not None:
            restored = restore_began + self.resumed[1]
        raw = {
            "fault": self.t_fault,
            "detect": detect,
            "tear_down": self._all_gone(old_ranks),
            "launcher_exit": self._all_gone(old_launch),
            "claim": self.claim[0] if self.claim else None,
            "ranks_started": max((p.start for p in new_ranks), default=None),
            "group_up": latest(self.births.get(r) for r in rank_nos),
            "restore_began": restore_began,
            "restored": restored,
            "first_step": self.first_step(),
        }
        phases: dict[str, float | None] = {}
        prev = raw["fault"]
        for key, _label in PHASES:
            mark = raw[key]
            if mark is None:
                phases[key] = None  # lumped into the next phase
                continue
            mark = max(mark, prev)
            phases[key] = round(mark - prev, 3)
            prev = mark
        starts = {
            role: sorted(
                round(p.start - self.t_fault, 3) for p in self.new.values() if p.role == role
            )
            for role in ("watchdog", "launcher", "rank")
        }
        attempts = [
            e for e in _jsonl(self.run.run_dir / "attempts.jsonl")
            if (e.get("end") or 0) > self.t_fault
        ]  # fmt: skip
        sub = {
            "agent_first_line": round(min(self.agent) - self.t_fault, 3) if self.agent else None,
            "verdict": round(attempts[0]["end"] - self.t_fault, 3) if attempts else None,
            "verdict_summary": attempts[0].get("summary") if attempts else None,
            "new_process_starts": starts,
            "old_processes_gone": {
                f"{p.role}{'' if p.rank is None else p.rank}@node{p.node}": (
                    round(self.gone[p.key] - self.t_fault, 3) if p.key in self.gone else None
                )
                for p in self.old
            },
            **{k: round(v - self.t_fault, 3) for k, v in self.marks.items()},
        }
        return {
            "fault": self.fault,
            "resumed_at": step,
            "ranks_load_s": self.resumed[1] if self.resumed else None,
            "claimed": self.claim[1] if self.claim else None,
            "marks": {
                k: (round(v - self.t_fault, 3) if v is not None else None) for k, v in raw.items()
            },
            "phases": phases,
            "total": round(raw["first_step"] - self.t_fault, 3) if raw["first_step"] else None,
            "sub_marks": sub,
        }


def _jsonl(path: Path) -> list[dict[str, Any]]:
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        with contextlib.suppress(ValueError):
            entry = json.loads(line)
            if isinstance(entry, dict):
                out.append(entry)
    return out


def _until(what: str, check: Callable[[], Any], timeout: float, run: Run) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        time.sleep(TICK_S)
    raise RuntimeError(f"{run.cluster}: timed out after {timeout:.0f} s waiting for {what}")


def ready(run: Run, after: int | None) -> list[RunProc]:
    """Wait until the run has a complete checkpoint newer than step `after` (its last
    resume), is at least 2 steps past it and not about to save; its ranks then."""
    metrics = Tail(run.run_dir / "logs" / "metrics.jsonl", at_end=False)
    last = [0]
    looked = [time.monotonic()]

    def check() -> list[RunProc] | None:
        time.sleep(0.05)
        for s, _t in metrics_steps(metrics.new()):
            last[0] = s
        if time.monotonic() - looked[0] > 5.0:  # squeue is not free: every 5 s
            looked[0] = time.monotonic()
            if not run.running():
                raise RuntimeError(f"{run.cluster}: the job ended before the fault")
        newest = newest_checkpoint(run.ckpt_dir)
        if newest is None or (after is not None and newest[0] <= after):
            return None
        if last[0] < newest[0] + 2 or not 2 <= last[0] % EVERY <= EVERY - 3:
            return None
        ranks = [p for p in scan(run.run_dir) if p.role == "rank"]
        return ranks if len(ranks) == run.world else None

    return _until("a checkpoint and a steady run", check, READY_TIMEOUT_S, run)


def one_fault(run: Run, fault: str, after: int | None) -> dict[str, Any]:
    ranks = ready(run, after)
    old = scan(run.run_dir)
    token = (_json(run.run_dir / "CURRENT_ATTEMPT") or {}).get("token")
    load_before = os.getloadavg()
    watch = Watch(
        run, fault, 0.0, old, token,
        outs=[Tail(p) for p in run.out_logs()], errs=[Tail(p) for p in run.err_logs()],
        metrics=Tail(run.run_dir / "logs" / "metrics.jsonl"),
    )  # fmt: skip
    last_step = max((s for s, _ in metrics_steps(Tail(watch.metrics.path, False).new())), default=0)
    victim = run.victim(ranks)
    watch.t_fault = time.time()
    if fault == "crash":
        os.kill(victim.pid, signal.SIGKILL)
    elif fault == "hang":
        os.kill(victim.pid, signal.SIGSTOP)
        run.stopped.append(victim)
    else:
        run.preempt(ranks)

    def recovered() -> bool:
        watch.tick()
        return watch.first_step() is not None

    timeout = RECOVER_TIMEOUT_S + (run.args.hang_timeout if fault == "hang" else 0)
    _until(f"the first step after the {fault}", recovered, timeout, run)
    time.sleep(0.3)  # a last look: heartbeats and /proc of the new ranks
    watch.last_scan = 0.0
    watch.tick()
    out = watch.result()
    out["last_step_before"] = last_step
    out["victim"] = {"pid": victim.pid, "rank": victim.rank, "node": victim.node}
    out["load_avg"] = [round(x, 2) for x in (*load_before, *os.getloadavg())]
    return out


# ------------------------------------------------------------------ at scale


def start_marks(run: Run, t_submit: float) -> dict[str, Any]:
    """From `submit` to every rank stepping (the first step in metrics.jsonl: a step is
    collectives of every rank) and to the first complete checkpoint."""
    metrics = Tail(run.run_dir / "logs" / "metrics.jsonl", at_end=False)
    seen: dict[str, float] = {}

    def check() -> bool:
        time.sleep(0.05)
        if "first_step" not in seen:
            steps = metrics_steps(metrics.new())
            if steps:
                seen["first_step"] = steps[0][1]
        if "first_checkpoint" not in seen:
            newest = newest_checkpoint(run.ckpt_dir)
            if newest is not None:
                seen["first_checkpoint"] = newest[1]
        return len(seen) == 2

    _until("the first step and checkpoint", check, READY_TIMEOUT_S, run)
    return {k: round(v - t_submit, 3) for k, v in seen.items()}


def save_times(ckpt_dir: Path) -> dict[int, float]:
    """`save_s` (state written, every rank's share hashed, published) of each complete
    checkpoint now in `ckpt_dir`, by step."""
    out: dict[int, float] = {}
    for manifest in ckpt_dir.glob("step-*/manifest.json"):
        data = _json(manifest) or {}
        if isinstance(data.get("save_s"), int | float) and isinstance(data.get("step"), int):
            out[data["step"]] = float(data["save_s"])
    return out


def watchdog_cpu(run: Run) -> dict[str, Any]:
    """The node watchdogs' CPU use so far: each one's user+system seconds over its
    lifetime (the cost of watching: heartbeat reads and /proc walks every poll)."""
    shares = []
    now = time.time()
    for p in scan(run.run_dir):
        fields = _stat(p.pid) if p.role == "watchdog" else None
        if fields is None or now - p.start < 1.0:
            continue
        cpu = (int(fields[11]) + int(fields[12])) / HZ
        shares.append(cpu / (now - p.start))
    return {
        "watchdogs": len(shares),
        "cpu_percent_each": round(100 * statistics.mean(shares), 3) if shares else None,
        "cpu_percent_max": round(100 * max(shares), 3) if shares else None,
    }


def scale_table(files: list[Path]) -> str:
    """One row per node count of saved `--cluster slurm` reports (`--scale-table`)."""
    rows = []
    for path in files:
        report, _end = json.JSONDecoder().raw_decode(path.read_text())
        by_fault = {r["fault"]: r for r in report["results"]}
        crash, preempt = by_fault.get("crash"), by_fault.get("preempt")
        saves = list(report.get("save_s", {}).values())
        dog = report.get("watchdog_cpu", {})
        saved = preempt["phases"]["detect"] if preempt else None
        rows.append(
            (
                report.get("nodes", 2),
                [
                    report.get("start", {}).get("first_step"),
                    report.get("start", {}).get("first_checkpoint"),
                    statistics.median(saves) if saves else None,
                    crash["total"] if crash else None,
                    saved,
                    (preempt["total"] - saved) if preempt and preempt["total"] and saved else None,
                    dog.get("cpu_percent_each"),
                ],
            )
        )
    head = (
        "| nodes × 1 rank | submit → every rank stepping | submit → first checkpoint | "
        "checkpoint save (median) | crash → every rank stepping again (in place) | "
        "USR2 → every rank saved | saved → requeued, every rank stepping again | "
        "watchdog CPU % (each) |"
    )
    lines = [head, "|---:|" + "---:|" * 7]
    for nodes, cells in sorted(rows, key=lambda r: r[0]):
        shown = [_fmt(c) if i < 6 else ("—" if c is None else f"{c:.2f}")
                 for i, c in enumerate(cells)]  # fmt: skip
        lines.append(f"| {nodes} | " + " | ".join(shown) + " |")
    return "\n".join(lines)


# ------------------------------------------------------------------ imports alone


IMPORTS = (
    "import time; t = time.perf_counter(); "
    "import shardctl.orchestrator.spec, shardctl.train.loop, torch.distributed; "
    "a = time.perf_counter() - t; t = time.perf_counter(); "
    "from transformers import LlamaForCausalLM; "
    "print(a, time.perf_counter() - t)"
)


def imports_alone(repeats: int) -> dict[str, Any]:
    """Two fresh interpreters at once (as two ranks start), `repeats` times: the wall
    seconds of the imports a rank makes before its process group, and of transformers'
    Llama after them (the slower of the two processes each time)."""
    before, llama, wall = [], [], []
    for _ in range(repeats):
        t0 = time.time()
        procs = [
            subprocess.Popen([sys.executable, "-c", IMPORTS], stdout=subprocess.PIPE, text=True)
            for _ in range(2)
        ]
        outs = [p.communicate(timeout=600)[0].split() for p in procs]
        wall.append(time.time() - t0)
        before.append(max(float(o[0]) for o in outs))
        llama.append(max(float(o[1]) for o in outs))
    return {
        "before_group_s": round(statistics.median(before), 2),
        "transformers_llama_s": round(statistics.median(llama), 2),
        "process_wall_s": round(statistics.median(wall), 2),
        "repeats": repeats,
    }


# ------------------------------------------------------------------ report


def _fmt(v: float | None) -> str:
    return "—" if v is None else f"{v:.1f}"


def markdown(cluster: str, results: list[dict[str, Any]], hang_timeout: float) -> str:
    head = (
        "| cluster | fault | rounds | " + " | ".join(label for _k, label in PHASES)
        + " | total s (each round) | goal s | held |"
    )  # fmt: skip
    lines = [head, "|" + "---|" * 3 + "---:|" * (len(PHASES) + 2) + "---|"]
    for fault in FAULTS:
        rows = [r for r in results if r["fault"] == fault]
        if not rows:
            continue
        cells = []
        for key, _label in PHASES:
            values = [r["phases"][key] for r in rows if r["phases"][key] is not None]
            cells.append(_fmt(statistics.median(values)) if values else "—")
        totals = [r["total"] for r in rows if r["total"] is not None]
        total = (
            f"{statistics.median(totals):.1f} ({', '.join(f'{t:.1f}' for t in totals)})"
            if totals else "—"
        )  # fmt: skip
        goal = {"crash": 30.0, "hang": hang_timeout + 30.0}.get(fault)
        held = "—" if goal is None else ("yes" if totals and max(totals) <= goal else "no")
        lines.append(
            f"| {cluster} | {fault} | {len(rows)} | " + " | ".join(cells)
            + f" | {total} | {_fmt(goal)} | {held} |"
        )  # fmt: skip
    return "\n".join(lines)


def table_of(files: list[Path]) -> str:
    """The table of saved reports (this script's stdout; a table after the JSON is
    ignored), the rounds of reports of the same cluster and hang timeout together."""
    groups: dict[tuple[str, float], list[dict[str, Any]]] = {}
    for path in files:
        report, _end = json.JSONDecoder().raw_decode(path.read_text())
        key = (report["cluster"], report["hang_timeout_s"])
        groups.setdefault(key, []).extend(report["results"])
    tables = [markdown(cluster, rows, hang) for (cluster, hang), rows in groups.items()]
    return "\n".join(t if i == 0 else t.split("\n", 2)[2] for i, t in enumerate(tables))


def host() -> dict[str, Any]:
    model = ""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
            if line.startswith("Model name:"):
                model = line.split(":", 1)[1].strip()
    return {"cpu": model, "cores": os.cpu_count(), "load_avg": os.getloadavg()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cluster", choices=("local", "slurm"), default="local")
    p.add_argument("--faults", default=",".join(FAULTS), help="comma-separated: crash,hang,preempt")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--hang-timeout", type=int, default=15, help="watchdog.hang_timeout_s")
    p.add_argument("--nodes", type=int, default=2, help="Slurm: nodes × 1 rank (1 to 64)")
    p.add_argument("--imports", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--markdown", action="store_true")
    p.add_argument("--work", type=Path, default=None, help="default: a temporary folder")
    p.add_argument("--keep", action="store_true", help="keep the work folder")
    p.add_argument(
        "--from-json", nargs="+", type=Path, default=None, metavar="FILE",
        help="run nothing: print the table of earlier runs' output (their rounds together)",
    )  # fmt: skip
    p.add_argument(
        "--scale-table", nargs="+", type=Path, default=None, metavar="FILE",
        help="run nothing: one row per node count of earlier `--cluster slurm` runs' output",
    )  # fmt: skip
    args = p.parse_args()
    if args.from_json:
        print(table_of(args.from_json))
        return
    if args.scale_table:
        print(scale_table(args.scale_table))
        return
    if not 1 <= args.nodes <= 64 or (args.cluster == "local" and args.nodes != 2):
        p.error(f"--nodes: {args.nodes}; 1 to 64, and only with --cluster slurm")
    args.faults = [f.strip() for f in args.faults.split(",") if f.strip()]
    bad = [f for f in args.faults if f not in FAULTS]
    if bad or args.rounds < 1:
        p.error(f"--faults: {bad} not in {FAULTS}" if bad else "--rounds must be ≥ 1")
    work = args.work or Path(tempfile.mkdtemp(prefix="shardctl-recovery-"))
    work.mkdir(parents=True, exist_ok=True)
    run: Run = (LocalRun if args.cluster == "local" else SlurmRun)(work, args)
    report: dict[str, Any] = {
        "cluster": args.cluster, "nodes": args.nodes if args.cluster == "slurm" else 1,
        "host_before": host(), "work": str(work),
    }  # fmt: skip
    if args.imports:
        report["imports_alone"] = imports_alone(3)
    results: list[dict[str, Any]] = []
    try:
        t_submit = time.time()
        run.submit()
        report["job"] = run.ref.get("job_id")
        report["start"] = start_marks(run, t_submit)
        print(f"{args.cluster} start: {json.dumps(report['start'])}", file=sys.stderr, flush=True)
        saves: dict[int, float] = {}
        after: int | None = None
        for rnd in range(args.rounds):
            for fault in args.faults:
                ready(run, after)
                saves.update(save_times(run.ckpt_dir))
                if "watchdog_cpu" not in report:
                    report["watchdog_cpu"] = watchdog_cpu(run)
                res = one_fault(run, fault, after)
                res["round"] = rnd
                results.append(res)
                after = res["resumed_at"]
                print(
                    f"{args.cluster} {fault} round {rnd}: {res['total']} s "
                    f"{json.dumps(res['phases'])}",
                    file=sys.stderr, flush=True,
                )  # fmt: skip
    finally:
        run.cleanup()
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    report["save_s"] = {str(k): v for k, v in sorted(saves.items())}
    report["host_after"] = host()
    report["hang_timeout_s"] = args.hang_timeout
    report["results"] = results
    print(json.dumps(report, indent=2))
    if args.markdown:
        print(markdown(args.cluster, results, args.hang_timeout))


if __name__ == "__main__":
    main()
