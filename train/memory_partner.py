"""The memory tier on more than one node: each node's copy, and a copy of it held in
its partner node's memory.

A node's *slice* of a step is what its ranks wrote (the backend's files and their
trainer state; node 0's slice also holds the files rank 0 alone writes). Every K steps:

1. every rank writes its part of the state into its node's folder
   (`<memory_dir>/node-<n>/own/step-N.tmp`): no folder is shared between nodes;
2. the node's ranks hash their files (a share each), and the node's first rank
   (local rank 0) writes the slice's manifest and publishes `own/step-N`;
3. each rank sends its share of the slice's files, with their sha256, to the rank of
   the same local rank on the partner node (node n's partner is node (n + 1) mod
   nodes), over the tier's own gloo group; the receivers check every file's sha256 and
   the partner's first rank commits `partner-of-node-<n>/step-N` with the slice's
   manifest; only then does the node drop its previous own copy (a node lost while its
   copy is on the way is served at the step before). Steps 2 and 3 run behind
   training where the backend saves in the background (the next copy waits for them).

On a restart (`PartnerCopies.restore`) every node says what it holds, verified by
sha256 (its own slice, the slice it holds for the node before it); the ranks agree on
the newest step for which every slice has a verified copy somewhere, own copy
preferred; a slice a node lacks is sent to it by a node that holds it (a node whose
memory was wiped gets its own slice back from its partner), and each node loads the
step from one folder (`restore/step-N`: the copies it holds hard-linked, the rest
received). A rank also reads files other ranks wrote: with DCP at the same world size
only `.metadata` and the values written once for every rank (`dcp_shared_files`), so a
node gets just those of the other nodes' slices; otherwise (DeepSpeed's model states,
another world size) every file of every slice, a cost that grows with the job.

A node that comes back under another node rank (torchrun's c10d rendezvous numbers
nodes by arrival) still finds what it wrote: alone on its host it also reads the
`node-<m>/` folders it wrote under other numbers (a folder's number says which node's
slice its `own/` holds), and drops them once the restore is done. Nodes sharing a host
(the local cluster) read only their own folder. `fresh_nodes` (or
`SHARDCTL_MEMORY_FRESH_NODES=1,3`) says which node ranks are new (a spare standing in
for a lost node): their folders are not asked, the partner copies serve them.
"""

from __future__ import annotations

import hashlib
import logging
import os
import pickle
import re
import shutil
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..orchestrator.checkpoint_list import STEP_RE
from ..orchestrator.errors import CheckpointError
from .backends.base import Stateful, StateIO
from .manifest import (
    describe_files,
    list_files,
    read_manifest,
    share_of,
    step_dirname,
    verify,
    write_manifest,
)

log = logging.getLogger(__name__)

OWN = "own"
TRAINER_DIR = "train_state"  # `checkpoint.TRAINER_DIR` (that module imports torch)
RESTORE = "restore"
FRESH_NODES_ENV = "SHARDCTL_MEMORY_FRESH_NODES"
NODE_DIR_RE = re.compile(r"^node-(\d+)$")


def partner_of(node: int, nodes: int) -> int:
    """The node that holds `node`'s copy: the next one, the last node's is node 0."""
    return (node + 1) % nodes


def held_dir(node: int) -> str:
    """The folder, on node `node`'s partner, holding `node`'s slice."""
    return f"partner-of-node-{node}"


def node_dir(root: str | Path, node: int) -> Path:
    """This node's folder: two nodes on one host (the local cluster) never share one."""
    return Path(root) / f"node-{node}"


def fresh_nodes_from_env() -> set[int]:
    """`SHARDCTL_MEMORY_FRESH_NODES=1,3` → {1, 3}; an unreadable value is ignored."""
    text = os.environ.get(FRESH_NODES_ENV, "")
    try:
        return {int(word) for word in text.replace(",", " ").split()}
    except ValueError:
        log.warning("%s=%r is not a list of node ranks; ignored", FRESH_NODES_ENV, text)
        return set()


@dataclass(frozen=True)
class Layout:
    """Where a rank stands: torchrun numbers ranks node by node."""

    rank: int
    world_size: int
    local_world: int

    @property
    def node(self) -> int:
        return self.rank // self.local_world

    @property
    def local_rank(self) -> int:
        return self.rank % self.local_world

    @property
    def nodes(self) -> int:
        return self.world_size // self.local_world

    def rank_on(self, node: int, local_rank: int) -> int:
        return node * self.local_world + local_rank


@dataclass
class PartnerRestore:
    """What a restore across nodes found: the step (None: no step every slice holds),
    which node served each slice, and why a newer copy was not used."""

    step: int | None
    served_by: dict[int, int] = field(default_factory=dict)  # slice → node
    why_not: str | None = None
    received_bytes: int = 0  # what every node together received over the wire

    @property
    def tier(self) -> str:
        """`memory` when every node had its own slice, else `partner`."""
        own = all(holder == node for node, holder in self.served_by.items())
        return "memory" if own else "partner"

    def partner_words(self) -> str | None:
        """`node 1 served by node 0's partner copy` for each slice not from its own node."""
        parts = [
            f"node {node} served by node {holder}'s partner copy"
            for node, holder in sorted(self.served_by.items())
            if holder != node
        ]
        return "; ".join(parts) or None


# --------------------------------------------------------------- the wire (gloo)


def _send(obj: Any, dst: int, group: Any) -> None:
    import torch
    import torch.distributed as dist

    data = bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))
    dist.send(torch.tensor([len(data)], dtype=torch.int64), dst, group=group)
    dist.send(torch.frombuffer(data, dtype=torch.uint8), dst, group=group)


def _recv(src: int, group: Any) -> Any:
    import torch
    import torch.distributed as dist

    size = torch.zeros(1, dtype=torch.int64)
    dist.recv(size, src, group=group)
    data = torch.empty(int(size.item()), dtype=torch.uint8)
    dist.recv(data, src, group=group)
    return pickle.loads(data.numpy().tobytes())


def _exchange(obj: Any, dst: int, src: int, group: Any) -> Any:
    """Send `obj` to `dst` and receive one from `src` at once (no rank waits on a send
    its peer has not reached: both directions are posted before either is waited on)."""
    import torch
    import torch.distributed as dist

    data = bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))
    out_size, in_size = (
        torch.tensor([len(data)], dtype=torch.int64),
        torch.zeros(1, dtype=torch.int64),
    )
    for req in (dist.isend(out_size, dst, group=group), dist.irecv(in_size, src, group=group)):
        req.wait()
    inbox = torch.empty(int(in_size.item()), dtype=torch.uint8)
    reqs = [
        dist.isend(torch.frombuffer(data, dtype=torch.uint8), dst, group=group),
        dist.irecv(inbox, src, group=group),
    ]
    for req in reqs:
        req.wait()
    return pickle.loads(inbox.numpy().tobytes())


def _pack(folder: Path, manifest: dict[str, Any], rels: list[str]) -> dict[str, Any]:
    """The files `rels` of a committed copy with the sha256 its manifest gives them."""
    return {rel: ((folder / rel).read_bytes(), manifest["files"][rel]["sha256"]) for rel in rels}


def _unpack(files: dict[str, Any], into: Path, source: str) -> None:
    """Write received files under `into`, each checked against the sha256 it came with."""
    for rel, (data, sha) in files.items():
        if hashlib.sha256(data).hexdigest() != sha:
            raise CheckpointError(f"{rel} from {source}: sha256 mismatch on arrival")
        target = into / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)


# ------------------------------------------------------------------ a node's folder


def _committed(folder: Path) -> dict[str, Path]:
    """`{step-N name: path}` of the complete copies (manifest present) in `folder`."""
    if not folder.is_dir():
        return {}
    return {
        p.name: p
        for p in folder.iterdir()
        if STEP_RE.match(p.name) and not p.name.endswith(".tmp") and (p / "manifest.json").exists()
    }


def _publish(tmp: Path, final: Path, *, drop_older: bool = True) -> None:
    """Commit a staged copy (its manifest already written) and, unless told to keep
    them, drop the older ones."""
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    if drop_older:
        _drop_older(final)


def _drop_older(newest: Path) -> None:
    for name, path in _committed(newest.parent).items():
        if name != newest.name:
            shutil.rmtree(path, ignore_errors=True)


def _clean_staging(folder: Path) -> None:
    if folder.is_dir():
        for p in folder.iterdir():
            if p.name.endswith(".tmp") and STEP_RE.match(p.name):
                shutil.rmtree(p, ignore_errors=True)


class PartnerCopies:
    """One rank's part of the memory tier across nodes. `manager` is the tier's
    `CheckpointManager`: its gloo group carries every collective and transfer here, and
    its `_load` reads a restored step."""

    def __init__(self, manager: Any, state_io: StateIO, root: str | Path, layout: Layout) -> None:
        self.manager = manager
        self.state_io = state_io
        self.layout = layout
        self.dir = node_dir(root, layout.node)
        self._pending: threading.Thread | None = None
        self._error: BaseException | None = None
        # Seconds each copy's commit and send to the partner took (behind training
        # when the backend saves in the background; the loop's stall is the tier's
        # `stall_s`).
        self.send_s: list[float] = []
        self.received_bytes = 0  # what the last restore brought to this rank over the wire

    @property
    def leader(self) -> bool:
        return self.layout.local_rank == 0

    # -- save ------------------------------------------------------------------------

    def copy(self, step: int, trainer: Stateful | None, *, background: bool) -> None:
        """Write `step` into this node's memory; then (behind training when
        `background`) commit the node's slice and send it to the partner node."""
        self.wait()
        tmp = self.dir / OWN / (step_dirname(step) + ".tmp")
        if self.leader:
            _clean_staging(self.dir / OWN)
            (tmp / TRAINER_DIR).mkdir(parents=True, exist_ok=True)
        self.manager._barrier()
        self.manager._write_trainer_state(tmp, step, trainer)
        if not background:
            self.state_io.save(tmp, self.manager.group)
            self._commit_and_send(None, step, tmp)
            return
        future = self.state_io.save_async(tmp, self.manager.group)
        self._error = None
        self._pending = threading.Thread(
            target=self._behind, args=(future, step, tmp), name=f"shardctl-memory-{step}",
            daemon=True,
        )  # fmt: skip
        self._pending.start()

    def _behind(self, future: Any, step: int, tmp: Path) -> None:
        try:
            self._commit_and_send(future, step, tmp)
        except BaseException as exc:  # re-raised in the training thread by wait()
            self._error = exc

    def wait(self, *, quiet: bool = False) -> None:
        """Until the copy in flight is committed here and at the partner; its failure
        is raised (`quiet`: logged, when the copies are about to go anyway)."""
        if self._pending is not None:
            self._pending.join()
            self._pending = None
            if self._error is not None:
                exc, self._error = self._error, None
                if quiet:
                    log.error("the memory copy failed: %s", exc)
                    return
                raise CheckpointError(f"the memory copy failed: {exc}") from exc

    def _commit_and_send(self, future: Any, step: int, tmp: Path) -> None:
        if future is not None:
            future.result()
        m, lay = self.manager, self.layout
        m._barrier()  # every rank's files are written
        # The node's files: listed by its first rank, hashed by a share each.
        listed = m._all_gather(
            {rel: (tmp / rel).stat().st_size for rel in list_files(tmp)} if self.leader else None
        )
        sizes = listed[lay.rank_on(lay.node, 0)]
        mine = share_of(sizes, lay.local_rank, lay.local_world)
        parts = m._all_gather((lay.node, describe_files(tmp, mine)))
        files = {rel: d for node, part in parts if node == lay.node for rel, d in part.items()}
        manifest = {**m._manifest(step, files), "node": lay.node, "nodes": lay.nodes}
        final = self.dir / OWN / step_dirname(step)
        if self.leader:
            write_manifest(tmp, manifest)  # the commit marker, written last
            # The older copy stays until the partner holds this one: a node lost while
            # the copy is on its way is served by the step both nodes still hold.
            _publish(tmp, final, drop_older=False)
        m._barrier()
        self._send_to_partner(step, final, manifest, sizes)

    def _send_to_partner(
        self, step: int, final: Path, manifest: dict[str, Any], sizes: dict[str, int]
    ) -> None:
        """Each rank sends its share of the slice to the same local rank on the partner
        node and receives its share of the previous node's slice."""
        lay, group = self.layout, self.manager.group
        t0 = time.perf_counter()
        mine = share_of(sizes, lay.local_rank, lay.local_world)
        outgoing = {"manifest": manifest if self.leader else None,
                    "files": _pack(final, manifest, mine)}  # fmt: skip
        source = (lay.node - 1) % lay.nodes
        dst = lay.rank_on(partner_of(lay.node, lay.nodes), lay.local_rank)
        incoming = _exchange(outgoing, dst, lay.rank_on(source, lay.local_rank), group)
        held = self.dir / held_dir(source)
        tmp = held / (step_dirname(step) + ".tmp")
        if self.leader:
            _clean_staging(held)
            tmp.mkdir(parents=True, exist_ok=True)
        self.manager._barrier()
        problem = None
        try:
            _unpack(incoming["files"], tmp, f"node {source}")
        except (OSError, CheckpointError) as exc:
            problem = f"rank {lay.rank}: {exc}"
        problems = [p for p in self.manager._all_gather(problem) if p]
        if problems:
            raise CheckpointError(f"the partner copy of step {step} failed: {problems[0]}")
        if self.leader:
            write_manifest(tmp, incoming["manifest"])
            _publish(tmp, held / step_dirname(step))
        self.manager._barrier()  # the partner holds this copy: the older own one can go
        if self.leader:
            _drop_older(final)
        self.send_s.append(time.perf_counter() - t0)

    # -- restore -----------------------------------------------------------------

    def _folders(self, every_node: bool) -> list[tuple[int, Path]]:
        """(slice node, folder) of the copies this node may hold: those in its own
        folder; with `every_node` (no other node shares this host's memory) also those
        in the folders it wrote under another node rank (a rendezvous that numbers
        nodes by arrival may have numbered it differently before)."""
        dirs = [self.dir]
        if every_node and self.dir.parent.is_dir():
            dirs += sorted(
                p for p in self.dir.parent.iterdir()
                if p != self.dir and NODE_DIR_RE.match(p.name) and p.is_dir()
            )  # fmt: skip
        out = []
        for folder in dirs:
            wrote_as = int(NODE_DIR_RE.match(folder.name).group(1))  # type: ignore[union-attr]
            out.append((wrote_as, folder / OWN))
            out += [(n, folder / held_dir(n)) for n in range(self.layout.nodes) if n != wrote_as]
        return out

    def inventory(
        self, newer_than: int, *, every_node: bool = False, verified: bool = True
    ) -> tuple[dict[tuple[int, int], Any], list[str]]:
        """This node's copies newer than `newer_than`, `{(slice node, step): {"path",
        "manifest"}}`, verified unless told not to (`restore` has the node's ranks
        verify a share each), and a line for each copy refused (an unreadable manifest,
        its sha256, a missing file). `every_node`: see `_folders`."""
        found: dict[tuple[int, int], Any] = {}
        refused: list[str] = []
        lay = self.layout
        for slice_node, folder in self._folders(every_node):
            for name, path in _committed(folder).items():
                step = int(STEP_RE.match(name).group(1))  # type: ignore[union-attr]
                if step <= newer_than or (slice_node, step) in found:
                    continue  # the durable tier is as new (not worth reading), or held twice
                try:
                    manifest = read_manifest(path)
                except CheckpointError as exc:
                    refused.append(f"node {lay.node}'s copy of node {slice_node}: {exc}")
                    continue
                problems = verify(path, manifest=manifest) if verified else []
                if problems:
                    refused.append(
                        f"node {lay.node}'s copy of node {slice_node}'s {name} failed "
                        f"verification: {problems[0]}"
                    )
                    continue
                entry = {"path": str(path), "manifest": manifest}
                if "dcp/.metadata" in manifest["files"]:
                    entry["shared"] = dcp_shared_files(path)
                found[slice_node, int(manifest["step"])] = entry
        return found, refused

    def restore(
        self, trainer: Stateful | None, *, newer_than: int, fresh: set[int] | None = None
    ) -> PartnerRestore:
        """Load the newest step newer than `newer_than` for which every node's slice has
        a verified copy on some node (a collective); `step` None when there is none."""
        lay, m = self.layout, self.manager
        fresh = fresh_nodes_from_env() if fresh is None else fresh
        hosts = m._all_gather(socket.gethostname())
        alone = hosts.count(hosts[lay.rank]) == lay.local_world  # no other node's ranks here
        mine: Any = None
        if self.leader and lay.node not in fresh:
            mine = self.inventory(newer_than, every_node=alone, verified=False)
        gathered = [entry or ({}, []) for entry in m._all_gather(mine)]
        tables = self._verified({n: gathered[lay.rank_on(n, 0)] for n in range(lay.nodes)})
        try:
            return self._restore_from(trainer, tables, newer_than)
        finally:
            m._barrier()  # every transfer done: what this host wrote as another node can go
            if alone and self.leader:
                self._drop_other_node_folders()

    def _drop_other_node_folders(self) -> None:
        """The copies this host wrote under another node rank: older than any this
        node writes from now on."""
        if not self.dir.parent.is_dir():
            return
        for p in self.dir.parent.iterdir():
            if p != self.dir and NODE_DIR_RE.match(p.name) and p.is_dir():
                shutil.rmtree(p, ignore_errors=True)

    def _verified(self, tables: dict[int, Any]) -> dict[int, Any]:
        """`tables` without the copies that fail verification (each node's ranks hash
        a share of its copies; a collective), each refusal said in its node's lines."""
        lay = self.layout
        failed = []
        for (slice_node, step), held in sorted(tables[lay.node][0].items()):
            files = held["manifest"]["files"]
            sizes = {rel: f["size"] for rel, f in files.items()}
            share = share_of(sizes, lay.local_rank, lay.local_world)
            problems = verify(held["path"], files=share, manifest=held["manifest"])
            if problems:
                failed.append((slice_node, step, problems[0]))
        for node, failures in self.manager._all_gather((lay.node, failed)):
            for slice_node, step, problem in failures:
                if tables[node][0].pop((slice_node, step), None) is not None:
                    tables[node][1].append(
                        f"node {node}'s copy of node {slice_node}'s {step_dirname(step)} failed "
                        f"verification: {problem}"
                    )
        return tables

    def _restore_from(
        self, trainer: Stateful | None, tables: dict[int, Any], newer_than: int
    ) -> PartnerRestore:
        from torch.distributed.checkpoint.api import CheckpointException

        lay, m = self.layout, self.manager
        refused = [line for n in sorted(tables) for line in tables[n][1]]
        step, plan = choose(tables, lay.nodes, newer_than)
        if step is None:
            why = why_not(tables, lay.nodes, newer_than, refused)
            return PartnerRestore(None, why_not=why)
        manifest = merged_manifest(tables, plan, step)
        self.received_bytes = 0
        try:
            folder = self._assemble(step, tables, plan)
        except CheckpointError as exc:  # every rank raises it (gathered): all fall back
            return PartnerRestore(None, why_not=str(exc))
        received = sum(m._all_gather(self.received_bytes))
        try:
            m._load(folder, manifest, trainer)
        except CheckpointException as exc:  # DCP raises it on every rank alike
            # A file a rank reads was not sent (a model laid out otherwise than the
            # spec says): the durable tier loads every value again.
            return PartnerRestore(None, why_not=f"loading step {step} from memory failed: {exc}")
        finally:
            m._barrier()
            if self.leader:
                shutil.rmtree(folder.parent, ignore_errors=True)
        why = "; ".join(refused) or None
        return PartnerRestore(step, served_by=plan, why_not=why, received_bytes=received)

    def _assemble(self, step: int, tables: dict[int, Any], plan: dict[int, int]) -> Path:
        """This node's `restore/step-N`: the slices it holds hard-linked, the others
        received from the nodes the plan names (each rank a share)."""
        lay, m = self.layout, self.manager
        folder = self.dir / RESTORE / step_dirname(step)
        if self.leader:
            shutil.rmtree(folder.parent, ignore_errors=True)
            folder.mkdir(parents=True)
            for slice_node in range(lay.nodes):
                held = tables[lay.node][0].get((slice_node, step))
                if held is not None:
                    _link_tree(Path(held["path"]), folder)
        m._barrier()
        problem = None
        shared = shared_files(tables, plan, step, lay.world_size)
        try:
            for slice_node, sender, receiver in transfers(tables, plan, step, lay.nodes):
                held = tables[sender][0][slice_node, step]
                sizes = {
                    rel: f["size"] for rel, f in held["manifest"]["files"].items()
                    if shared is None or receiver == slice_node or rel in shared
                }  # fmt: skip
                if not sizes:
                    continue  # nothing of this slice is read on the receiving node
                share = share_of(sizes, lay.local_rank, lay.local_world)
                if sender == lay.node:
                    data = _pack(Path(held["path"]), held["manifest"], share)
                    _send(data, lay.rank_on(receiver, lay.local_rank), m.group)
                elif receiver == lay.node:
                    data = _recv(lay.rank_on(sender, lay.local_rank), m.group)
                    _unpack(data, folder, f"node {sender}")
                    self.received_bytes += sum(len(blob) for blob, _ in data.values())
        except (OSError, CheckpointError) as exc:
            problem = f"rank {lay.rank}: {exc}"
        problems = [p for p in m._all_gather(problem) if p]
        if problems:
            raise CheckpointError(f"restoring step {step} from memory failed: {problems[0]}")
        return folder

    # -- clear -------------------------------------------------------------------

    def clear(self) -> None:
        """Free this node's copies (its own, the one held for its peer, a restore's);
        a collective."""
        self.wait(quiet=True)
        self.manager._barrier()
        if self.leader and self.dir.is_dir():
            for sub in self.dir.iterdir():
                if sub.is_dir() and (
                    sub.name in (OWN, RESTORE) or sub.name.startswith("partner-of-node-")
                ):
                    shutil.rmtree(sub, ignore_errors=True)
            try:
                self.dir.rmdir()
                self.dir.parent.rmdir()  # only when empty: a folder the user named may hold more
            except OSError:
                pass
        self.manager._barrier()


def _link_tree(source: Path, into: Path) -> None:
    """Hard-link every file of a copy (its manifest aside) into `into`: no bytes copied."""
    for rel in list_files(source):
        if rel == "manifest.json":
            continue
        target = into / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        os.link(source / rel, target)


# ------------------------------------------------------ the plan (same on every rank)


def choose(
    tables: dict[int, Any], nodes: int, newer_than: int
) -> tuple[int | None, dict[int, int]]:
    """The newest step newer than `newer_than` for which every slice has a verified
    copy, and for each slice the node that serves it (its own node first)."""
    for step in sorted((s for s in _steps(tables) if s > newer_than), reverse=True):
        plan: dict[int, int] = {}
        for slice_node in range(nodes):
            holders = [
                n for n in sorted(tables, key=lambda n: (n != slice_node, n))
                if (slice_node, step) in tables[n][0]
            ]  # fmt: skip
            if not holders:
                break
            plan[slice_node] = holders[0]
        else:
            return step, plan
    return None, {}


def _steps(tables: dict[int, Any]) -> set[int]:
    """Every step some node holds a verified copy of (of any slice)."""
    return {step for n in tables for _, step in tables[n][0]}


def shared_files(
    tables: dict[int, Any], plan: dict[int, int], step: int, world_size: int
) -> set[str] | None:
    """The files of another node's slice a node reads to load `step`: with DCP at the
    world size that wrote it and every tensor sharded over the whole world (FSDP's
    full_shard or shard_grad_op), a rank reads its own shards (its node's slice) and
    only the values every rank loads whole (DCP writes each once, on any rank) plus
    `.metadata`; None (every file) otherwise (hybrid_shard's shards are replicated
    across nodes, and DCP writes each replica once, on any node)."""
    held = tables[plan[0]][0][0, step]
    manifest = held["manifest"]
    if (
        manifest.get("world_size") != world_size
        or manifest.get("sharding") not in ("full_shard", "shard_grad_op")
        or held.get("shared") is None
    ):
        return None
    return set(held["shared"])


def dcp_shared_files(step_dir: Path) -> list[str] | None:
    """`dcp/...` files of a DCP checkpoint holding what every rank loads whole (a
    non-tensor value, a tensor saved as one chunk), and `.metadata`; None when the
    folder holds no readable DCP metadata."""
    if not (step_dir / "dcp" / ".metadata").is_file():
        return None
    try:
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        meta = FileSystemReader(str(step_dir / "dcp")).read_metadata()
    except (OSError, ValueError, RuntimeError, EOFError, pickle.UnpicklingError) as exc:
        log.warning("%s: DCP metadata unreadable (%s); every file is sent", step_dir, exc)
        return None
    whole = {
        fqn for fqn, md in meta.state_dict_metadata.items()
        if not isinstance(md, TensorStorageMetadata)
        or (len(md.chunks) == 1 and tuple(md.chunks[0].sizes) == tuple(md.size))
    }  # fmt: skip
    files = {f"dcp/{info.relative_path}" for index, info in (meta.storage_data or {}).items()
             if index.fqn in whole}  # fmt: skip
    return sorted(files | {"dcp/.metadata"})


def transfers(
    tables: dict[int, Any], plan: dict[int, int], step: int, nodes: int
) -> list[tuple[int, int, int]]:
    """(slice, sender node, receiver node) for every slice a node lacks at `step`, in
    one order every rank computes alike."""
    out = []
    for receiver in range(nodes):
        for slice_node in range(nodes):
            if (slice_node, step) not in tables[receiver][0]:
                out.append((slice_node, plan[slice_node], receiver))
    return out


def merged_manifest(tables: dict[int, Any], plan: dict[int, int], step: int) -> dict[str, Any]:
    """The step's manifest as one folder holds it: node 0's slice's fields, every
    slice's files."""
    manifests = [tables[holder][0][s, step]["manifest"] for s, holder in sorted(plan.items())]
    files = {rel: f for man in manifests for rel, f in man["files"].items()}
    merged = {k: v for k, v in manifests[0].items() if k not in ("node", "files")}
    return {**merged, "files": dict(sorted(files.items()))}


def why_not(tables: dict[int, Any], nodes: int, newer_than: int, refused: list[str]) -> str | None:
    """Why no memory step serves (None: no copy newer than the durable tier anywhere)."""
    newest = max((s for s in _steps(tables) if s > newer_than), default=None)
    if newest is None:
        return "; ".join(refused) or None
    lost = []
    for slice_node in range(nodes):
        if not any((slice_node, newest) in tables[n][0] for n in tables):
            lost.append(
                f"node {slice_node}'s memory copy of step {newest} and its partner copy "
                f"(on node {partner_of(slice_node, nodes)}) are both gone"
            )
    return "; ".join(lost + refused)
