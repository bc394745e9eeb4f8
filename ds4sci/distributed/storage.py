"""Which nodes see the folder that rank 0 sees: the check behind a shared ``train.out_dir`` and a node-local
``data.cache_dir``.

A path names a folder per host: ``/lus/project/run`` may be one folder on every node of a job (a parallel file
system), while ``$TMPDIR/cache`` or a relative path run from another working directory is a different folder on
each node. Nothing in the path tells which, so :func:`nodes_seeing` asks the folders themselves: rank 0 writes a
marker file (a random token, in its name and as its content) into the folder, the first process of each node (local
rank 0) looks for it, every rank learns every node's answer, and rank 0 removes the marker. Collective: every rank
calls it, and every rank gets the same answer (or the same error), so none is left waiting.

The marker's name starts with :data:`MARKER_PREFIX`, so a run folder's rules (:mod:`ds4sci.train.run_dir`) can tell
one that a killed process left behind from a run's files.

Nodes: a rank's node is :func:`ds4sci.distributed.nodes.node_of` of its rank and the launch's processes per node,
the one rank-to-node mapping of the trainer, the inference commands and the planner.
"""
from __future__ import annotations

import os
import secrets
import socket
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from ds4sci.distributed.launch import Launch
from ds4sci.distributed.nodes import node_of

MARKER_PREFIX = ".ds4sci.node-check-"


@dataclass(frozen=True)
class NodeView:
    """What the first process of node ``node`` (on host ``host``) found: ``sees`` rank 0's marker or not."""

    node: int
    host: str
    sees: bool


def nodes_seeing(folder: str | os.PathLike, launch: Launch) -> list[NodeView]:
    """Whether the first process of each node sees ``folder`` as rank 0 does (collective: every rank calls it).

    Rank 0 creates ``folder`` (with its parents) if missing. Without a process group of more than one rank, the
    answer is rank 0's own node.

    Returns:
        one :class:`NodeView` per node, by node index (node 0 always sees it).
    Raises:
        OSError: rank 0 cannot create ``folder`` or write the marker (naming the folder; on every rank).
    """
    folder = Path(folder)
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return [NodeView(0, socket.gethostname(), True)]
    box: list = [None]  # the marker's token, or rank 0's error message
    marker = None
    if dist.get_rank() == 0:
        token = secrets.token_hex(16)
        marker = folder / f"{MARKER_PREFIX}{token}"
        try:
            folder.mkdir(parents=True, exist_ok=True)
            marker.write_text(token)
            box[0] = ("ok", token)
        except OSError as err:
            box[0] = ("error", f"{folder}: rank 0 cannot write there ({err.strerror or err})")
    try:
        dist.broadcast_object_list(box, src=0)
        status, value = box[0]
        if status != "ok":
            raise OSError(value)
        view = None
        if launch.local_rank == 0:
            try:
                sees = (folder / f"{MARKER_PREFIX}{value}").read_text() == value
            except OSError:  # missing, or the folder itself is missing or unreadable on this node
                sees = False
            view = NodeView(node_of(launch.rank, launch.local_world_size), socket.gethostname(), sees)
        views: list = [None] * dist.get_world_size()
        dist.all_gather_object(views, view)
    finally:
        if marker is not None:
            marker.unlink(missing_ok=True)
    return sorted((v for v in views if v is not None), key=lambda v: v.node)


def check_same_folder(folder: str | os.PathLike, key: str, launch: Launch) -> None:
    """Stop, on every rank, unless every node sees ``folder`` as rank 0 does (collective; :func:`nodes_seeing`).

    Raises:
        ValueError: one line naming the config ``key``, the folder, and the first node (index and host) that does
            not see it.
        OSError: rank 0 cannot write into ``folder``.
    """
    blind = [v for v in nodes_seeing(folder, launch) if not v.sees]
    if blind:
        v = blind[0]
        more = f" (and {len(blind) - 1} other node(s))" if len(blind) > 1 else ""
        raise ValueError(f"{key} {folder} is not the folder rank 0 sees on node {v.node} (host {v.host}){more}: "
                         f"every node must see the same {key} (a shared file system, by a path that names the same "
                         f"folder on every node; not a node-local path such as $TMPDIR, nor a relative path from "
                         f"different working directories)")
