"""Reading an engine's log from anywhere: ``modelkeeper logs REPLICA [--follow]``.

The API asks the replica's agent through Temporal (the agent listens on no port of its
own, docs/security.md): a short ``EngineLog`` workflow runs the ``read_engine_log``
activity on the node's task queue, and the agent reads its log file
(``<data dir>/agent/logs/<replica>.log``). What comes back is bounded and scrubbed:

* at most :data:`MAX_TAIL_LINES` lines and :data:`MAX_LOG_BYTES` bytes per answer (well
  under Temporal's 2 MiB payload limit, and a screenful at a time for a person);
* scrubbed of keys and secrets on the node (modelkeeper.domain.redact), a second time
  after the log filter that wrote it (agent/log_filter.py);
* for admins only: an engine's log may hold prompts (vLLM's request logging, llama.cpp's
  verbose output), which a viewer token (a dashboard's, a read-only operator's) must not
  read.

A follow asks again from the offset the last answer ended at, every
:data:`FOLLOW_INTERVAL_S`. Pure: the cutting of bytes into lines (:func:`cut`) takes the
bytes read.
"""

from __future__ import annotations

import re

from pydantic import Field

from .base import Tolerant
from .ids import NodeId, ReplicaId

#: Lines an answer holds at most (``--tail``'s limit), and without ``--tail``.
MAX_TAIL_LINES = 5000
DEFAULT_TAIL_LINES = 100
#: Bytes of log an answer holds at most: 256 KiB is some 2,000 lines of an engine's log.
MAX_LOG_BYTES = 256 * 1024
#: A follow asks for new lines this often: each ask is one short workflow and one
#: activity on the node, so a follower costs at most one of each a second.
FOLLOW_INTERVAL_S = 1.0
#: A replica id as the keeper makes them (``<deployment>-r<n>``): also the log's file name,
#: so nothing else may reach the agent's file system through it.
REPLICA_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"


def valid_replica_id(replica_id: str) -> bool:
    """True when ``replica_id`` can name a log file (no path, no dot file)."""
    return re.fullmatch(REPLICA_ID_PATTERN, replica_id) is not None and ".." not in replica_id


class EngineLogRequest(Tolerant):
    """What the API asks an agent for: the last ``tail`` lines, or, with ``after`` (a
    byte offset an earlier answer ended at), the lines written since."""

    replica_id: ReplicaId
    tail: int = Field(default=DEFAULT_TAIL_LINES, ge=0, le=MAX_TAIL_LINES)
    after: int | None = Field(default=None, ge=0)


class EngineLogInput(Tolerant):
    """The EngineLog workflow's input: which node to ask, and what."""

    node_id: NodeId
    read: EngineLogRequest


class EngineLogChunk(Tolerant):
    """An agent's answer: lines of the log, scrubbed, and where they came from."""

    replica_id: ReplicaId
    node_id: NodeId
    #: The log file on the node.
    log_path: str
    lines: list[str] = Field(default_factory=list)
    #: The byte offsets where this read began and just past its last line: a follow
    #: asks from ``end_offset`` next.
    start_offset: int = 0
    end_offset: int = 0
    #: The log's size when read.
    size: int = 0
    #: Older lines exist that this answer leaves out (``tail`` or MAX_LOG_BYTES).
    truncated: bool = False
    #: The log is shorter than ``after``: a new log began (the engine was relaunched),
    #: and this answer starts at its beginning.
    restarted: bool = False


def cut(data: bytes, *, at_start: bool, complete: bool) -> tuple[list[str], int, int]:
    """``data``, read from a log, as whole lines: (lines, bytes skipped at the front, bytes
    used). ``at_start``: ``data`` begins at the start of a line (else its first, partial
    line is dropped). ``complete``: keep a last line without its newline (a tail shows
    all there is); else it waits for the next read (a follow)."""
    skipped = 0
    if not at_start:
        newline = data.find(b"\n")
        if newline < 0:
            return [], len(data), len(data)
        skipped = newline + 1
        data = data[skipped:]
    if not complete:
        end = data.rfind(b"\n")
        data = data[:end + 1] if end >= 0 else b""
    text = data.decode(errors="replace")
    return text.splitlines(), skipped, skipped + len(data)
