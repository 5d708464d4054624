"""An engine's log read for the API (modelkeeper.domain.log_reads): bounded, scrubbed.

Reads ``<agent dir>/logs/<replica>.log``, the file the start-up path writes
(agent.shard_startup): the log of a running engine, and of one that failed or exited, as
long as the file is there.
"""

from __future__ import annotations

import os
from pathlib import Path

from modelkeeper.domain.ids import NodeId
from modelkeeper.domain.log_reads import (
    MAX_LOG_BYTES,
    EngineLogChunk,
    EngineLogRequest,
    cut,
    valid_replica_id,
)
from modelkeeper.domain.redact import scrub_secrets


class NoEngineLog(LookupError):
    """No log for the replica on this node: it never launched here, or its log is gone."""


def read_engine_log(logs_dir: Path, node_id: NodeId, request: EngineLogRequest, *,
                    max_bytes: int = MAX_LOG_BYTES) -> EngineLogChunk:
    """The lines of ``request``'s replica's log it asks for (see :class:`EngineLogRequest`).

    Raises :class:`NoEngineLog` when there is no such log here, ValueError for a replica
    id that cannot name one.
    """
    if not valid_replica_id(request.replica_id):
        raise ValueError(f"replica_id {request.replica_id!r} cannot name a log file")
    path = logs_dir / f"{request.replica_id}.log"
    try:
        with path.open("rb") as f:
            size = os.fstat(f.fileno()).st_size
            restarted = request.after is not None and request.after > size
            if request.after is not None and not restarted:
                start = request.after
                f.seek(start)
                data = f.read(min(max_bytes, size - start))
                # A line still being written waits for the next read, so a follow never
                # prints one line in two pieces (the tail shows it).
                lines, skipped, used = cut(data, at_start=True, complete=False)
                if used == 0 and len(data) == max_bytes:
                    # One line longer than an answer holds: shown in pieces, or the
                    # follow would stand still on it.
                    lines, skipped, used = cut(data, at_start=True, complete=True)
                truncated = False
            else:
                start = max(0, size - max_bytes)
                f.seek(start)
                data = f.read(size - start)
                lines, skipped, used = cut(data, at_start=start == 0, complete=True)
                truncated = start > 0
                if len(lines) > request.tail:
                    truncated = True
                    lines = lines[len(lines) - request.tail:] if request.tail else []
    except FileNotFoundError:
        raise NoEngineLog(f"no log for {request.replica_id} on node {node_id} ({path}): "
                          "it never launched here, or its log was removed") from None
    return EngineLogChunk(
        replica_id=request.replica_id, node_id=node_id, log_path=str(path),
        lines=[scrub_secrets(line) for line in lines], start_offset=start + skipped,
        end_offset=start + used, size=size, truncated=truncated, restarted=restarted)
