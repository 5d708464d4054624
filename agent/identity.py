"""A node's stable identity, kept in the agent's data dir across restarts: its id, and the
credential the API issued it when it joined."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

from modelkeeper.domain.ids import NodeId

#: The credential file's mode: the agent's user reads it, nobody else. It speaks for the
#: node: whoever holds it can heartbeat, report and re-register as this node.
CREDENTIAL_MODE = 0o600
NODE_ID_FILE = "node_id"
CREDENTIAL_FILE = "node_credential"


def load_or_create_node_id(agent_dir: Path) -> NodeId:
    """The node id stored in ``agent_dir``, created on first start."""
    path = agent_dir / NODE_ID_FILE
    if path.exists():
        text = path.read_text().strip()
        if text:
            return NodeId(text)
    agent_dir.mkdir(parents=True, exist_ok=True)
    node_id = f"n-{uuid.uuid4().hex[:12]}"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(node_id + "\n")
    tmp.replace(path)  # atomic: a crash mid-write must not leave an empty id
    return NodeId(node_id)


def load_credential(agent_dir: Path) -> str | None:
    """The node's credential, kept beside its id; None before the node has joined."""
    try:
        return (agent_dir / CREDENTIAL_FILE).read_text().strip() or None
    except FileNotFoundError:
        return None


def save_credential(agent_dir: Path, credential: str) -> None:
    """Keep ``credential`` beside the node id, readable by this user only.

    Created with its mode from the start (never written world-readable and narrowed
    after), then moved into place atomically, so a crash leaves the old one or the new.
    """
    agent_dir.mkdir(parents=True, exist_ok=True)
    path = agent_dir / CREDENTIAL_FILE
    tmp = path.with_suffix(".tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, CREDENTIAL_MODE)
    with os.fdopen(fd, "w") as out:
        out.write(credential + "\n")
    tmp.replace(path)
