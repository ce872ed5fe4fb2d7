"""Reading YAML files with errors that name the file, line and column (no pydantic here:
`shardctl convert` uses it before it knows whether the file is a job spec).

Stricter than `yaml.safe_load` in one way: a key given twice in one mapping is an
error (PyYAML keeps the last one silently, so `nodes: 2` ... `nodes: 1` ran on one
node). Merge keys (`<<: *defaults`) still override what they merge in, as YAML says.

Two guards against files that are not job specs: only regular files are read (a FIFO
would block the read until some writer came, a device has no end), and aliases may
repeat at most `MAX_ALIAS_NODES` nodes in all (a 1 KB file of aliases of aliases,
"billion laughs", is a few thousand nodes as parsed and billions once walked).
"""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path
from typing import Any

import yaml
from yaml.constructor import ConstructorError

from .errors import SpecError

# A job spec or launcher config is a few kilobytes; reading stops here so that a wrong
# path (a disk image, /dev/zero) becomes a message instead of an exhausted memory.
MAX_FILE_BYTES = 16 * 1024 * 1024
MERGE_TAG = "tag:yaml.org,2002:merge"
INT_TAG = "tag:yaml.org,2002:int"
# The nodes that aliases may add in all, counted as if every alias were written out.
# A spec's `<<: *defaults` adds tens; this leaves room for large launcher configs.
MAX_ALIAS_NODES = 100_000


class Base60Int(int):
    """An integer YAML 1.1 read from a plain scalar with colons (`10:00:00` is the
    base-60 number 36000), with the text as written, so that a field meaning a time
    (`slurm.time`) takes the text and an error can say what YAML did."""

    text: str

    def __new__(cls, value: int, text: str) -> Base60Int:
        number = super().__new__(cls, value)
        number.text = text
        return number

    def __getnewargs__(self) -> tuple[int, str]:  # type: ignore[override]  # copy, pickle
        return int(self), self.text


def _construct_int(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> int:
    number = yaml.SafeLoader.construct_yaml_int(loader, node)
    return Base60Int(number, node.value) if ":" in node.value else number


class _UniqueKeys:
    """A loader's mixin that refuses a key given twice in the same mapping, at any depth,
    and a document whose aliases expand past `MAX_ALIAS_NODES` nodes."""

    def get_single_node(self) -> yaml.Node | None:
        node = super().get_single_node()  # type: ignore[misc]  # a mixin
        if node is not None:
            _refuse_alias_bomb(node)
        return node

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        if isinstance(node, yaml.MappingNode):
            first_line: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == MERGE_TAG:
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    seen = first_line.get(key)
                except TypeError:  # an unhashable key: SafeLoader says so below
                    continue
                line = key_node.start_mark.line + 1
                if seen is not None:
                    raise ConstructorError(
                        None,
                        None,
                        f"duplicate key {SpecError.show_value(key)} (first given at line "
                        f"{seen}); a mapping takes each key once, so one of the two would "
                        "be silently lost: keep one",
                        key_node.start_mark,
                    )
                first_line[key] = line
        return super().construct_mapping(node, deep=deep)  # type: ignore[misc]  # a mixin


class _UniqueKeyLoader(_UniqueKeys, yaml.SafeLoader):
    """`SafeLoader` (pure Python: its errors name line and column) without duplicate keys."""


_UniqueKeyLoader.add_constructor(INT_TAG, _construct_int)
# Written back as the number it is, wherever plain data from a spec is dumped.
for _dumper in (yaml.SafeDumper, getattr(yaml, "CSafeDumper", yaml.SafeDumper)):
    _dumper.add_representer(Base60Int, yaml.SafeDumper.represent_int)

# libyaml's parser where PyYAML was built with it: ~10× faster than the pure-Python one.
# For files shardctl wrote itself (a run dir's job.yaml, which `ls` reads once per job
# for its total steps), not for what users write: libyaml locates errors less well.
_WrittenLoader: type = (
    type("_WrittenLoader", (_UniqueKeys, yaml.CSafeLoader), {})
    if hasattr(yaml, "CSafeLoader")
    else _UniqueKeyLoader
)
_WrittenLoader.add_constructor(INT_TAG, _construct_int)


class AliasBombError(yaml.YAMLError):
    """A document whose aliases expand past `MAX_ALIAS_NODES` nodes."""


def _refuse_alias_bomb(root: yaml.Node) -> None:
    """Raise `AliasBombError` when the aliases of the document under `root` (a node
    reached twice in the composed graph is an alias) would add more than
    `MAX_ALIAS_NODES` nodes once written out, or when a value contains itself. Counted
    bottom-up, each node once, so the count costs no more than the parsed document."""
    expanded: dict[int, int] = {}  # id(node) -> nodes under it, aliases written out
    open_nodes: set[int] = set()  # started, children not all counted yet
    added = 0
    pending: list[tuple[yaml.Node, bool]] = [(root, False)]
    while pending:
        node, children_done = pending.pop()
        key = id(node)
        if children_done:
            open_nodes.discard(key)
            expanded[key] = 1 + sum(expanded[id(child)] for child in _children(node))
        elif key in expanded:  # reached again: an alias repeats its whole subtree
            added += expanded[key]
            if added > MAX_ALIAS_NODES:
                raise AliasBombError(_alias_bomb_line(node))
        elif key in open_nodes:
            line = node.start_mark.line + 1
            raise AliasBombError(
                f"the value at line {line} contains itself through an alias; accepted: "
                "aliases of values that do not hold the alias"
            )
        else:
            open_nodes.add(key)
            pending.append((node, True))
            pending.extend((child, False) for child in _children(node))


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.MappingNode):
        return [part for pair in node.value for part in pair]
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    return []


def _alias_bomb_line(node: yaml.Node) -> str:
    line = node.start_mark.line + 1
    return (
        f"aliases (*name) repeat more than {MAX_ALIAS_NODES:,} values once written out "
        f"(reached at the anchor of line {line}); accepted: aliases that repeat fewer "
        "values (a job spec or config is never that large)"
    )


def read_yaml_file(path: str | Path, *, written: bool = False) -> Any:
    """Read a YAML file; unreadable files, YAML syntax errors and duplicate keys become
    `SpecError`s that name the file and, for the latter two, the line and column.
    `written`: a file shardctl wrote itself (a run dir's job.yaml), read with libyaml's
    parser where it is installed."""
    path = Path(path)
    where = str(path)
    try:
        raw = _read_regular_file(path, MAX_FILE_BYTES + 1)
    except FileNotFoundError:
        raise SpecError([f"file {where!r} does not exist"], where) from None
    except IsADirectoryError:
        raise SpecError([f"{where!r} is a folder; accepted: a YAML file"], where) from None
    except _NotRegularFile as exc:
        raise SpecError(
            [f"{where!r} is {exc.kind}, not a file; accepted: a YAML file"], where
        ) from None
    except OSError as exc:
        raise SpecError([f"cannot read {where!r}: {exc.strerror or exc}"], where) from None
    if len(raw) > MAX_FILE_BYTES:
        raise SpecError(
            [f"{where!r} is larger than {MAX_FILE_BYTES // 2**20} MiB; not a job spec or config"],
            where,
        )
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SpecError(
            [f"cannot read {where!r}: not UTF-8 text (byte {exc.start}); is it a binary file?"],
            where,
        ) from None
    return parse_yaml_text(text, where, written=written)


class _NotRegularFile(OSError):
    def __init__(self, kind: str) -> None:
        super().__init__(kind)
        self.kind = kind


# What a path that is not a regular file is, for the one line that refuses it.
_FILE_KINDS = (
    (stat.S_ISFIFO, "a named pipe (FIFO)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def _read_regular_file(path: Path, limit: int) -> bytes:
    """At most `limit` bytes of `path`, refused (`_NotRegularFile`,
    `IsADirectoryError`) unless it is a regular file (a link to one counts). Opened
    without blocking and checked on the open descriptor: opening a FIFO for reading
    waits for a writer, and a device never ends."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise IsADirectoryError(str(path))
        if not stat.S_ISREG(mode):
            kind = next((name for test, name in _FILE_KINDS if test(mode)), "not a file")
            raise _NotRegularFile(kind)
        os.set_blocking(fd, True)
        with os.fdopen(fd, "rb") as f:
            fd = -1  # the file object closes it
            return f.read(limit)
    finally:
        if fd >= 0:
            os.close(fd)


def parse_yaml_text(text: str, source: str | None = None, *, written: bool = False) -> Any:
    """Parse YAML text like `read_yaml_file` (duplicate keys refused, errors located)."""
    try:
        # Both are SafeLoader's constructor: plain data only.
        return yaml.load(text, Loader=_WrittenLoader if written else _UniqueKeyLoader)
    except AliasBombError as exc:
        raise SpecError([str(exc)], source) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise SpecError([f"not valid YAML{at}: {problem}"], source) from None
    except RecursionError:
        # PyYAML builds nested collections recursively; thousands of levels exhaust it.
        raise SpecError(["nested too deeply to be a job spec or config"], source) from None
    except ValueError as exc:
        # Python refuses to turn a decimal of more than sys.get_int_max_str_digits()
        # digits into an int (a guard against quadratic time); say where that number is.
        raise SpecError([_too_many_digits(text) or str(exc)], source) from None


def _too_many_digits(text: str) -> str | None:
    """The first integer in `text` too long for Python to read, as a problem line."""
    limit = sys.get_int_max_str_digits()
    try:
        root = yaml.compose(text, Loader=_UniqueKeyLoader)
    except (yaml.YAMLError, RecursionError):
        return None
    pending: list[tuple[str, yaml.Node]] = [("", root)] if root is not None else []
    while pending:
        where, node = pending.pop(0)
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                name = key.value if isinstance(key, yaml.ScalarNode) else "?"
                pending.append((f"{where}.{name}" if where else str(name), value))
        elif isinstance(node, yaml.SequenceNode):
            pending.extend((f"{where}[{i}]", item) for i, item in enumerate(node.value))
        elif node.tag == INT_TAG:
            digits = sum(ch.isdigit() for ch in node.value)
            if digits > limit:
                field = f"{where}: " if where else ""
                return (
                    f"{field}an integer of {digits} digits (line {node.start_mark.line + 1}); "
                    f"accepted: at most {limit} digits"
                )
    return None
