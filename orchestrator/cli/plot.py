"""`shardctl plot RUN`: the loss curve of a run as a PNG.

RUN is a run directory (the one holding `logs/metrics.jsonl`), a job spec file, or
the name of a submitted job. matplotlib is imported only here, with the Agg
backend (no display needed).
"""

from __future__ import annotations

import io
import struct
from pathlib import Path

import click

from ..durable import storage_error, write_bytes_atomic
from ..errors import ShardctlError, UsageError
from .common import handle_errors

# The PNG text chunk that marks a plot as shardctl's own: re-plotting replaces it
# without --force, while any other file at the output is the user's.
SOFTWARE = "shardctl plot"
_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_HEAD_BYTES = 64 * 1024  # the text chunk comes right after IHDR; never read a whole file


def resolve_run_dir(run: str) -> Path:
    """A run directory from a path, a spec file or a submitted job's name."""
    path = Path(run)
    if path.is_dir():
        return path
    if path.is_file():
        from ..spec import load_spec

        return Path(load_spec(path).run_dir)
    if "/" in run or path.suffix in (".yaml", ".yml"):  # no job's name or id: a path
        raise UsageError(
            f"{run!r} does not exist; accepted: a run directory, a job spec file or the "
            "name of a submitted job (shardctl ls)"
        )
    from ..clusters.records import recall

    return Path(recall(run).run_dir)


def written_by_plot(path: Path) -> bool:
    """Whether `path` is a PNG that `shardctl plot` wrote (its Software text chunk)."""
    try:
        with path.open("rb") as f:
            head = f.read(_HEAD_BYTES)
    except OSError:
        return False
    if not head.startswith(_PNG_SIGNATURE):
        return False
    at = len(_PNG_SIGNATURE)
    while at + 8 <= len(head):
        (length,) = struct.unpack(">I", head[at : at + 4])
        kind, data = head[at + 4 : at + 8], head[at + 8 : at + 8 + length]
        if kind == b"IDAT":  # text chunks that matter come before the image data
            return False
        if kind == b"tEXt" and data == b"Software\0" + SOFTWARE.encode():
            return True
        at += 12 + length
    return False


def check_out(out: Path, force: bool, option: str = "--out") -> None:
    """Refuse, before anything is drawn, to replace what is not a plot of ours."""
    if not (out.exists() or out.is_symlink()):
        return
    if out.is_dir():
        raise UsageError(f"{option} {out} is a folder; accepted: the path of a PNG file")
    if not out.is_file():
        raise UsageError(
            f"{option} {out} exists and is not a regular file (a device, FIFO, socket or "
            "broken link); accepted: the path of a PNG file"
        )
    if not force and not written_by_plot(out):
        raise UsageError(
            f"{option} {out} already exists and is not a plot shardctl wrote; refusing to "
            "overwrite it (use --force to replace it, or give another --out)"
        )


def _not_text(path: Path, exc: UnicodeDecodeError) -> str:
    """One line naming the first line of `path` that is not UTF-8 text."""
    line = bytes(exc.object[: exc.start]).count(b"\n") + 1
    return (
        f"{path} line {line} is not UTF-8 text (byte {exc.start}); metrics.jsonl holds "
        "one JSON object per line, as the run writes it: was the file replaced or damaged?"
    )


def plot_loss(run_dir: Path, out: Path) -> int:
    """Write the loss curve PNG; returns the number of steps plotted."""
    from shardctl.train.metrics import metrics_path, read_metrics

    if not metrics_path(run_dir).is_file():
        raise UsageError(
            f"no metrics in {run_dir}: {metrics_path(run_dir)} does not exist (has the run "
            "logged a step yet?)"
        )
    try:
        logged = read_metrics(run_dir)
    except UnicodeDecodeError as exc:
        raise UsageError(_not_text(metrics_path(run_dir), exc)) from None
    except OSError as exc:
        raise ShardctlError(f"cannot read {metrics_path(run_dir)}: {exc.strerror or exc}") from None
    rows = [r for r in logged if isinstance(r.get("loss"), int | float)]
    if not rows:
        raise UsageError(f"{metrics_path(run_dir)} holds no logged steps yet")
    try:
        import matplotlib
    except ImportError:
        from ..errors import MissingDependencyError

        raise MissingDependencyError("matplotlib", "train", "shardctl plot") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
    ax.plot(steps, [r["loss"] for r in rows], color="tab:blue", linewidth=1.2, label="loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(f"{run_dir.name}: training loss")
    ax.grid(True, alpha=0.3)
    lrs = [r.get("lr") for r in rows]
    if all(isinstance(v, int | float) for v in lrs):
        ax2 = ax.twinx()
        ax2.plot(steps, lrs, color="tab:orange", linewidth=0.8, alpha=0.7, label="lr")
        ax2.set_ylabel("learning rate")
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png", metadata={"Software": SOFTWARE})
    plt.close(fig)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        # Atomic: a full disk leaves the previous plot (or none), never a truncated PNG.
        write_bytes_atomic(out, png.getvalue(), durable=False)
    except OSError as exc:
        problem = storage_error(
            exc, out.parent, what=f"the plot {out}", needed=len(png.getvalue()),
            aftermath="any earlier plot there is unchanged",
        )  # fmt: skip
        raise problem or ShardctlError(f"cannot write {out}: {exc.strerror or exc}") from None
    return len(rows)


@click.command("plot")
@click.argument("run")
@click.option(
    "--out",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="PNG to write (default: RUN_DIR/loss.png).",
)
@click.option(
    "--force",
    is_flag=True,
    help="Replace --out even if it is not a plot shardctl wrote (one it wrote is always replaced).",
)
@handle_errors
def plot_cmd(run: str, out: Path | None, force: bool) -> None:
    """Plot the loss curve of RUN (run dir, spec file or job name) to a PNG."""
    run_dir = resolve_run_dir(run)
    target = out or run_dir / "loss.png"
    check_out(target, force, "--out" if out else "the default output")
    n = plot_loss(run_dir, target)
    click.echo(f"wrote {target} ({n} steps)")
