"""No source file of shardctl's own code grows past MAX_LINES: a file that big holds
more than one job and is split by moving code, one job a module (issue 32, item 7)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The packages whose modules are held to the bound.
CHECKED = ("orchestrator", "train")
MAX_LINES = 900


def _line_count(path: Path) -> int:
    with path.open("rb") as f:
        return sum(1 for _ in f)


def oversized(root: Path, packages: tuple[str, ...] = CHECKED) -> list[str]:
    """`path: N lines` for each `.py` file under `packages` of `root` longer than
    MAX_LINES, longest first."""
    sizes = [
        (_line_count(path), path.relative_to(root).as_posix())
        for package in packages
        for path in (root / package).rglob("*.py")
    ]
    return [f"{name}: {n} lines" for n, name in sorted(sizes, reverse=True) if n > MAX_LINES]


def test_no_source_file_is_over_the_bound() -> None:
    too_long = oversized(ROOT)
    assert not too_long, (
        f"over {MAX_LINES} lines (split by moving code into modules with one job each): "
        + "; ".join(too_long)
    )


def test_the_check_names_a_long_file_and_its_length(tmp_path: Path) -> None:
    # The check itself, on files written here: one at the bound, one past it.
    package = tmp_path / "orchestrator" / "sub"
    package.mkdir(parents=True)
    (package / "at_bound.py").write_text("x = 1\n" * MAX_LINES)
    (package / "past_bound.py").write_text("x = 1\n" * (MAX_LINES + 1))
    (tmp_path / "orchestrator" / "notes.txt").write_text("x\n" * 2000)
    assert oversized(tmp_path) == ["orchestrator/sub/past_bound.py: 901 lines"]
