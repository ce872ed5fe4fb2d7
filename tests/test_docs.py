"""The documentation: README.md is a short front page, the mkdocs site builds strictly,
its generated references cover every command and every spec field, and the source
points only at pages that exist."""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import click
import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
# The two fresh-machine commands: the README's first code block, byte for byte.
FRESH_MACHINE = (
    "bash scripts/run-example   # set up .venv and train the local example (2 CPU ranks, "
    "FSDP2), then consolidate\n"
    "bash scripts/test-all      # set up everything (as root: shellcheck, a 2-node Slurm, "
    "helm) and run all tests\n"
)


def _generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_reference", DOCS / "gen_reference.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _commands(group: click.Group, prefix: str = "shardctl") -> list[str]:
    """Every command and subcommand below `group`, as typed: `shardctl submit`, ..."""
    found = []
    for name, command in group.commands.items():
        if command.hidden:
            continue
        found.append(f"{prefix} {name}")
        if isinstance(command, click.Group):
            found += _commands(command, f"{prefix} {name}")
    return found


def test_the_readme_is_a_front_page_that_starts_with_the_two_commands() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    first_block = readme.split("```bash\n", 1)[1].split("```", 1)[0]
    assert first_block == FRESH_MACHINE
    # Nothing but the title and one paragraph comes before them.
    assert readme.index("```bash\n") < 500
    # CI runs exactly the README's test command.
    assert (ROOT / ".ci" / "run").read_text().rstrip().endswith("exec bash scripts/test-all")
    # Its links lead into the docs (mkdocs checks the site's own links, not the README's).
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", readme)
    assert any(link.startswith("docs/") for link in links)
    assert [link for link in links if not (ROOT / link).exists()] == []


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("mkdocs", reason="the docs extra: pip install -e '.[docs]'")
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "DISABLE_MKDOCS_2_WARNING": "true"}
    run = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    return out


def test_the_site_builds_strictly_and_documents_every_command(site: Path) -> None:
    from shardctl.orchestrator.cli import cli

    page = (site / "reference" / "cli" / "index.html").read_text()
    headings = set(re.findall(r'<h\d id="([^"]+)"', page))
    commands = _commands(cli)
    assert len(commands) >= 14
    missing = [c for c in commands if c.replace(" ", "-") not in headings]
    assert not missing, f"not in the CLI reference: {missing}"


def _nav_pages(entries: list[object]) -> list[str]:
    """Every page file the nav of mkdocs.yml names, in order (sections walked)."""
    pages: list[str] = []
    for entry in entries:
        value = next(iter(entry.values())) if isinstance(entry, dict) else entry
        if isinstance(value, list):
            pages += _nav_pages(value)
        else:
            pages.append(str(value))
    return pages


def _page_url(page: str) -> str:
    """Where mkdocs publishes `page` (use_directory_urls): `guides/faults.md` → `guides/faults/`."""
    stem = page.removesuffix(".md")
    return "" if stem == "index" else f"{stem.removesuffix('/index')}/"


# Pages the build writes itself (mkdocs-gen-files): no source under docs/.
GENERATED_PAGES = {"reference/spec.md"}


def test_the_site_holds_every_page_of_the_nav(site: Path) -> None:
    """Each page mkdocs.yml's nav names has a source (or is generated), is built, and is
    linked from the site's navigation; every page under docs/ is in the nav."""
    import yaml

    nav = _nav_pages(yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"])
    assert len(nav) == len(set(nav)), f"a page twice in the nav: {nav}"
    sources = {str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md")}
    assert sorted(sources - set(nav)) == [], "pages under docs/ that the nav leaves out"
    assert sorted(set(nav) - sources) == sorted(GENERATED_PAGES), "nav pages with no source"
    home = (site / "index.html").read_text()
    nav_links = set(re.findall(r'<a href="([^"#]*)" class="md-nav__link', home))
    for page in nav:
        url = _page_url(page)
        assert (site / url / "index.html").is_file(), f"{page} was not built"
        assert (url or ".") in nav_links, f"{page} is not in the site's navigation"


def test_the_spec_reference_has_every_field_of_every_model() -> None:
    """Generated from the models: each field's key, and its docstring where it has one."""
    from pydantic import BaseModel
    from shardctl.orchestrator.spec.job import spec_model

    gen = _generator()
    text = gen.spec_reference()
    sections = dict(
        (block.split("\n", 1)[0], block) for block in text.split("\n## ")[1:]
    )  # fmt: skip
    seen: set[type[BaseModel]] = set()

    def check(model: type[BaseModel]) -> None:
        if model in seen:
            return
        seen.add(model)
        block = sections[model.__name__]
        docs = gen.field_docs(model)
        for name, info in model.model_fields.items():
            row = next(
                (ln for ln in block.splitlines() if ln.startswith(f"| `{info.alias or name}` |")),
                None,
            )
            assert row is not None, f"{model.__name__}.{name}"
            if name in docs:
                assert " ".join(docs[name].split())[:40] in row.replace("\\|", "|")
            nested: dict[str, type[BaseModel]] = {}
            gen._type_name(info.annotation, nested, [])
            for sub in nested.values():
                check(sub)

    check(spec_model())
    assert {"Resources", "Strategy", "Checkpoint", "SlurmSection", "K8sSection"} <= set(sections)
    # Bounds come from the models' constraints, not from a copy.
    assert "| `nodes` | integer | `1` | strict, > 0, ≤ 100,000 |" in text
    # A core field without a docstring would leave its meaning empty.
    core = [ln for ln in text.split("\n## ModelSource")[0].splitlines() if ln.startswith("| `")]
    assert all(not ln.rstrip().endswith("|  |") for ln in core), [
        ln for ln in core if ln.rstrip().endswith("|  |")
    ]


DOC_LINK = re.compile(r"docs/[\w./-]+\.md")


def test_every_docs_page_named_in_the_source_exists() -> None:
    """Messages, comments and docstrings that send the reader to a page (the HF example
    included) name one that exists."""
    sources = [
        p
        for folder in ("examples", "orchestrator", "train", "templates", "scripts", "helm")
        for p in (ROOT / folder).rglob("*")
        if p.is_file() and p.suffix in {".py", ".j2", ".yaml", ".tpl", ""}
    ]
    named = {
        (p.relative_to(ROOT), m) for p in sources for m in DOC_LINK.findall(p.read_text("utf-8"))
    }
    assert any(str(p) == "examples/hf_trainer_script.py" for p, _ in named)
    missing = [(str(p), m) for p, m in named if not (ROOT / m).is_file()]
    assert not missing
    # The README is a front page now: nothing sends a reader to one of its sections.
    stale = [
        str(p.relative_to(ROOT))
        for p in sources
        if "README" in p.read_text("utf-8").replace("benchmarks/README", "")
    ]
    assert not stale


# ------------------------------------------------- the commands the docs show, run

# A command on an example spec; one on an example's run dir (`shardctl checkpoints
# examples/runs/NAME`) needs a run that the test does not train.
SHOWN = re.compile(r"^(?:\$ )?(shardctl [a-z]+ \S*examples/\S+\.yaml(?:\s+[^#\s].*?)?)\s*(?:#.*)?$")


def shown_example_commands() -> list[list[str]]:
    """Every `shardctl VERB ... examples/....yaml ...` line of a code block in the docs."""
    found: dict[str, list[str]] = {}
    for page in sorted([ROOT / "README.md", *DOCS.rglob("*.md")]):
        for line in page.read_text().splitlines():
            match = SHOWN.match(line.strip())
            if match:
                found.setdefault(match.group(1), shlex.split(match.group(1))[1:])
    return list(found.values())


def cheap_form(args: list[str], out: Path) -> list[str]:
    """The command as a test may run it: nothing trains and no cluster is contacted.
    `submit` becomes its `--dry-run` (`--wait` dropped: nothing to wait for); `doctor`
    runs as shown on this machine (on a free port), and for a cluster becomes
    `render --cluster` (what it reads); an absolute `--out` moves into the test's
    folder."""
    verb, rest = args[0], list(args[1:])
    if "--out" in rest:
        i = rest.index("--out") + 1
        if rest[i].startswith("/"):
            rest[i] = str(out / Path(rest[i]).name)
    if verb == "submit":
        rest = [a for a in rest if a not in ("--wait", "--follow")]
        return ["submit", *rest, "--dry-run"] if "--dry-run" not in rest else ["submit", *rest]
    if verb == "doctor" and "--cluster" in rest and rest[rest.index("--cluster") + 1] != "local":
        cluster = rest[rest.index("--cluster") + 1]
        return ["render", rest[0], "--cluster", cluster, "--out", str(out / "doctor")]
    if verb == "doctor":
        # Its port check must not depend on another run holding the example's port.
        return [verb, *rest, "--set", f"local.master_port={_free_port()}"]
    return [verb, *rest]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_the_docs_show_commands_for_every_example_spec() -> None:
    shown = {a for args in shown_example_commands() for a in args if a.startswith("examples/")}
    specs = {
        f"examples/{p.relative_to(ROOT / 'examples')}" for p in (ROOT / "examples").rglob("*.yaml")
    }
    assert specs <= shown, f"no command in the docs for {sorted(specs - shown)}"


@pytest.mark.parametrize("args", shown_example_commands(), ids=" ".join)
def test_a_command_the_docs_show_runs(
    args: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from click.testing import CliRunner
    from shardctl.orchestrator.cli import cli

    assert args[0] in {"validate", "render", "submit", "doctor"}, args
    shutil.copytree(ROOT / "examples", tmp_path / "examples")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SHARDCTL_STATE_DIR", str(tmp_path / "state"))
    result = CliRunner().invoke(cli, cheap_form(args, tmp_path), catch_exceptions=False)
    assert result.exit_code == 0, result.output
