"""Node-local checkpoints (``checkpoint.local_dir``) and their replicas on peer nodes
(``checkpoint.replicas=R``): losing a node, disk and all, loses no checkpoint.

Each node writes its ranks' files of a checkpoint under its own root,
``<checkpoint.local_dir>/<run.name>/node<k>/`` (the node rank is in the path, so "nodes" sharing one
machine keep apart). The files a node's ranks wrote are that node's *part*; the parts' names
never collide (engine files are named by rank or by mesh position), so the union of all parts
is the checkpoint a shared directory would hold. Once its part is fsynced, a node's first
trainer (its *leader*) marks it (``part_node<k>.json``: every file and its size, written last)
and sends the bytes to the leaders of the next R nodes, ring-wise (``node+1 .. node+R`` mod the
node count, Gemini's ring placement), over torch.distributed; each receiver writes them into
its own ``.step_<n>.partial``, fsyncs them and writes the same marker last. Only after every
node's part and replicas are durable does each leader publish its directory (``complete.json``,
the rename, ``latest``), so a replica never makes a partial checkpoint look complete.

On resume the leaders exchange what each holds (complete directories only: a damaged one is
skipped with a message) and agree on the newest checkpoint whose every part survives somewhere.
Each node then fetches the parts it lacks from a peer that holds them — its own part from a
replica when its disk was lost — before any rank loads: DeepSpeed's and DCP's loaders read
other ranks' files, so each node loads from a directory holding every part. A part no node
holds is named as lost; the newest checkpoint with nothing lost is used, and none at all is an
error (never a silent fresh start).

The transport follows torchft's ``PGTransport`` (a pickled header, then the bytes as uint8
tensors over a process group): here the files of a part, one file per round on every leader at
once (``isend``/``irecv``), over a gloo group of the trainers made for this.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from plait.engine.files import atomic_write_text, fsync_path
from plait.plugins.checkpoint.directory import COMPLETE, checkpoint_problem, node_root, publish

PART = "part_node{}.json"


def holders(node: int, nnodes: int, replicas: int) -> list[int]:
    """The peers that keep a replica of ``node``'s part: the next ``replicas`` nodes, ring-wise."""
    return [(node + j) % nnodes for j in range(1, replicas + 1)]


def placement(nnodes: int, replicas: int, shown: int = 8) -> dict[str, str]:
    """``plait plan``'s lines: where each node's part and its replicas live."""
    lines = {}
    for node in range(min(nnodes, shown)):
        peers = holders(node, nnodes, replicas)
        copies = f", replica on node {', '.join(map(str, peers))}" if peers else ", no replica"
        lines[f"node {node}'s part"] = f"node {node}{copies}"
    if nnodes > shown:
        lines["other nodes"] = f"node k's part: node k, replicas on nodes k+1 .. k+{replicas}"
    return lines


def mark_part(directory: Path, node: int, nnodes: int, files: dict[str, int]) -> None:
    atomic_write_text(
        directory / PART.format(node), json.dumps({"node": node, "nnodes": nnodes, "files": files})
    )


def own_files(directory: Path) -> dict[str, int]:
    """Every file in ``directory`` but the markers: the node's part, before replicas arrive."""
    markers = {COMPLETE, *(m.name for m in directory.glob(PART.format("*")))}
    return {
        str(f.relative_to(directory)): f.stat().st_size
        for f in sorted(directory.rglob("*"))
        if f.is_file() and f.name not in markers
    }


def parts_in(directory: Path) -> dict[int, dict]:
    """The parts a complete checkpoint directory holds: ``{node: {"nnodes", "files"}}``."""
    parts = {}
    for marker in directory.glob(PART.format("*")):
        record = json.loads(marker.read_text())
        parts[record["node"]] = {"nnodes": record["nnodes"], "files": record["files"]}
    return parts


def holdings(root: Path) -> dict[str, dict[int, dict]]:
    """``{checkpoint name: parts}`` of every complete checkpoint under ``root`` (damaged and
    partial ones are skipped with a message)."""
    held = {}
    for path in sorted(root.glob("step_*")):
        problem = checkpoint_problem(path)
        if problem is not None:
            print(f"plait: skipping checkpoint {path}: {problem}", file=sys.stderr, flush=True)
            continue
        held[path.name] = parts_in(path)
    return held


class PartLost(RuntimeError):
    """A checkpoint part that no node holds."""


@dataclass
class Restore:
    """What the resume agreed on: the checkpoint, and the parts each node fetches first
    (``(receiver, part, sender)``, in the order every leader walks them)."""

    name: str
    fetches: list[tuple[int, int, int]] = field(default_factory=list)
    lost_newer: list[str] = field(default_factory=list)  # newer checkpoints with a part lost


def surviving(name: str, held: dict[int, dict]) -> dict[int, dict]:
    """Every part of checkpoint ``name`` that some node holds."""
    return {part: record for node in held.values() for part, record in node.get(name, {}).items()}


def lost_parts(name: str, held: dict[int, dict], replicas: int) -> str | None:
    parts = surviving(name, held)
    saved_nodes = next(iter(parts.values()))["nnodes"]
    lost = sorted(set(range(saved_nodes)) - parts.keys())
    if not lost:
        return None
    which = ", ".join(f"node {p}'s" for p in lost)
    return (
        f"{which} part of checkpoint {name} is lost: no node holds it or a replica of it "
        f"(checkpoint.replicas={replicas}; a node's part survives the loss of its disk only with "
        "checkpoint.replicas >= 1)"
    )


def plan_restore(
    held: dict[int, dict[str, dict[int, dict]]], nnodes: int, replicas: int
) -> Restore | None:
    """The newest checkpoint whose every part some node holds, and who sends which part to whom
    so that each of the ``nnodes`` nodes holds them all. ``held``: ``{node: holdings(root)}``.
    None when no node holds any checkpoint; :class:`PartLost` when every one has a part lost."""
    names = sorted({name for node in held.values() for name in node}, reverse=True)
    lost = []
    for name in names:
        problem = lost_parts(name, held, replicas)
        if problem is not None:
            lost.append(problem)
            continue
        restore = Restore(name, lost_newer=lost)
        saved_nodes = next(iter(surviving(name, held).values()))["nnodes"]
        for node in range(nnodes):
            have = held.get(node, {}).get(name, {})
            for part in range(saved_nodes):
                if part in have:
                    continue
                senders = [n for n in sorted(held) if part in held[n].get(name, {})]
                sender = part if part in senders else senders[0]  # the original first
                restore.fetches.append((node, part, sender))
        return restore
    if lost:
        raise PartLost(
            "; ".join(lost) + ": no checkpoint can be resumed whole. Start afresh "
            "with resume=null and another run.name, or bring back the lost disk"
        )
    return None


def leaders_group(topology) -> dist.ProcessGroup | None:
    """The gloo group over the trainers the replicas' traffic runs on (the topology makes it
    once: a collective, every trainer calls this at the same point)."""
    return topology.side_group("checkpoint replicas")


def leader_of(topology, node: int) -> int:
    return min(r for r in topology.trainer_ranks if topology.node_of[r] == node)


def is_leader(topology) -> bool:
    return topology.local_trainer_rank == 0


def _file_tensor(path: Path) -> torch.Tensor:
    return torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.uint8)


def transfer(
    group,
    sends: list[tuple[Path, list[str], int]],
    receives: list[tuple[Path, list[tuple[str, int]], int]],
) -> int:
    """Send and receive files, one file of every transfer per round so that every leader's
    sends and receives are posted together (no ring of blocking sends can wait on itself).
    ``sends``: ``(directory, names, to rank)``; ``receives``: ``(directory, [(name, size)],
    from rank)``. Returns the bytes this rank sent."""
    sent = 0
    rounds = max([len(n) for _, n, _ in sends] + [len(f) for _, f, _ in receives] + [0])
    for i in range(rounds):
        works, landed = [], []
        for directory, names, to in sends:
            if i < len(names) and (directory / names[i]).stat().st_size:
                tensor = _file_tensor(directory / names[i])
                works.append(dist.isend(tensor, dst=to, group=group, tag=i))
                sent += tensor.numel()
        for directory, files, src in receives:
            if i < len(files):
                name, size = files[i]
                buffer = torch.empty(size, dtype=torch.uint8)
                if size:
                    works.append(dist.irecv(buffer, src=src, group=group, tag=i))
                landed.append((directory / name, buffer))
        for work in works:
            work.wait()
        for path, buffer in landed:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "wb") as f:
                f.write(buffer.numpy().tobytes())
                f.flush()
                os.fsync(f.fileno())
    return sent


def replicate(partial: Path, name: str, topology, replicas: int) -> int:
    """After every node's part in ``partial`` is durable: mark it, and keep each node's part
    on its ``replicas`` peers too (every trainer calls this; the leaders do the work). Returns
    the bytes this rank sent."""
    group = leaders_group(topology)
    nnodes, node = topology.dims.nnodes, topology.node_rank
    part = None
    if is_leader(topology):
        part = own_files(partial)
        mark_part(partial, node, nnodes, part)
    if replicas == 0:
        return 0
    parts = [None] * len(topology.trainer_ranks)
    dist.all_gather_object(parts, part, group=group)
    if not is_leader(topology):
        return 0
    by_node = {
        topology.node_of[rank]: p for rank, p in zip(topology.trainer_ranks, parts) if p is not None
    }
    sends = [
        (partial, list(by_node[node]), leader_of(topology, peer))
        for peer in holders(node, nnodes, replicas)
    ]
    sources = [peer for peer in range(nnodes) if node in holders(peer, nnodes, replicas)]
    receives = [
        (partial, list(by_node[peer].items()), leader_of(topology, peer)) for peer in sources
    ]
    sent = transfer(group, sends, receives)
    for peer in sources:
        mark_part(partial, peer, nnodes, by_node[peer])
    fsync_path(partial)
    print(
        f"plait: node {node} sent its part of {name} ({sent} bytes) to node(s) "
        f"{', '.join(map(str, holders(node, nnodes, replicas)))}",
        flush=True,
    )
    return sent


def restore(cfg, topology) -> Path | None:
    """Agree on the newest checkpoint whose every part survives, fetch the parts this node
    lacks (its own from a replica when its disk was lost), and return this node's directory of
    it; None when no node holds a checkpoint. Every trainer calls this."""
    group = leaders_group(topology)
    root = node_root(cfg, topology.node_rank)
    leader = is_leader(topology)
    mine = holdings(root) if leader else None
    every = [None] * len(topology.trainer_ranks)
    dist.all_gather_object(every, mine, group=group)
    held = {
        topology.node_of[rank]: h for rank, h in zip(topology.trainer_ranks, every) if h is not None
    }
    plan = plan_restore(held, topology.dims.nnodes, cfg.checkpoint.replicas)
    if plan is None:
        return None
    if leader:
        if topology.is_logging_rank:
            for problem in plan.lost_newer:
                print(
                    f"plait: {problem}; resuming from the older {plan.name}",
                    file=sys.stderr,
                    flush=True,
                )
        fetch_parts(root, plan, held, topology, group)
    dist.barrier(group=group)
    return root / plan.name


def fetch_parts(root: Path, plan: Restore, held: dict, topology, group) -> None:
    """This leader's share of ``plan.fetches``: send the parts asked of it, receive the parts it
    lacks into a fresh ``.partial`` (beside links to what it holds), then publish that."""
    node, name = topology.node_rank, plan.name
    partial = root / f".{name}.partial"
    wanted = [(part, sender) for receiver, part, sender in plan.fetches if receiver == node]
    if wanted:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        for part in held.get(node, {}).get(name, {}):
            for file in [*held[node][name][part]["files"], PART.format(part)]:
                (partial / file).parent.mkdir(parents=True, exist_ok=True)
                os.link(root / name / file, partial / file)
    for receiver, part, sender in plan.fetches:
        files = held[sender][name][part]["files"]
        if node == sender:
            transfer(group, [(root / name, list(files), leader_of(topology, receiver))], [])
        elif node == receiver:
            transfer(group, [], [(partial, list(files.items()), leader_of(topology, sender))])
            mark_part(partial, part, held[sender][name][part]["nnodes"], files)
            how = (
                f"restored from node {sender}'s replica"
                if part == node
                else f"fetched from node {sender} (a node loads every part)"
            )
            print(f"plait: node {node}: node {part}'s part of checkpoint {name} {how}", flush=True)
    if wanted:
        publish(root, partial, name)
