"""A node's stable identity, kept in the agent's data dir across restarts."""

from __future__ import annotations

import uuid
from pathlib import Path

from modelkeeper.domain.ids import NodeId


def load_or_create_node_id(agent_dir: Path) -> NodeId:
    """The node id stored in ``agent_dir``, created on first start."""
    path = agent_dir / "node_id"
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
