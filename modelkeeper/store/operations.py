"""The sagas' records: one row per restart, drain, switch or reconfigure (migration 0008).

One of the stores on the pool :class:`~.stores.Store` owns: the API and the control
worker reach it as ``store.operations``, and all SQL stays in this package.

One saga at a time per deployment and per node is the database's rule, not a check
before an insert: two partial unique indexes refuse a second running row, and
:class:`OperationConflictError` names the one that runs.
"""

from __future__ import annotations

from typing import Any

import asyncpg

from ..domain.ids import DeploymentId, NodeId, OperationId
from ..domain.operations import OperationKind, OperationRecord, OperationState
from ..names import operation_workflow_id

#: The partial unique indexes of migration 0008, by the subject they guard.
_RUNNING_PER_DEPLOYMENT = "operations_one_running_per_deployment"
_RUNNING_PER_NODE = "operations_one_running_per_node"

#: Numbers tried by :meth:`OperationsStore.begin_next` before it gives up. Each lost try
#: means another id of the subject was taken meanwhile (a racing request, or an id a
#: person chose with the ``temporal`` CLI); a handful covers any real race.
_NUMBER_TRIES = 20
#: A conflict whose running row ended before it could be read is tried again this often.
_CONFLICT_TRIES = 3

#: The most rows one :meth:`OperationsStore.list_operations` answers.
MAX_LIST_LIMIT = 500


class OperationConflictError(Exception):
    """Another saga runs on the same deployment or node: ``running`` is its record."""

    def __init__(self, running: OperationRecord, subject: str) -> None:
        self.running = running
        self.subject = subject
        super().__init__(
            f"{running.operation_id} ({running.kind.value}) is running on {subject}; wait "
            f"for it or cancel it: modelkeeper operations cancel {running.operation_id}")


class OperationNumberingError(Exception):
    """No free ``kind/subject/n`` was found in :data:`_NUMBER_TRIES` numbers."""


class OperationsStore:
    """The ``operations`` table, on the pool :class:`~.stores.Store` owns (and closes)."""

    def __init__(self, pool: asyncpg.Pool) -> None:
        self._pool = pool

    async def begin(self, record: OperationRecord) -> OperationRecord:
        """Insert ``record``; idempotent per ``operation_id``.

        When a row with that id exists (the API inserted it before starting the saga, or
        this is a retry whose first attempt committed), nothing is written and the row is
        answered as stored, whatever its state. Raises :class:`OperationConflictError`
        when another operation runs on the same deployment or node.
        """
        stored = await self._write(record, _INSERT + " ON CONFLICT (operation_id) DO NOTHING")
        if stored is not None:
            return stored
        existing = await self.get(record.operation_id)
        assert existing is not None  # rows are never deleted: the one in the way stays
        return existing

    async def begin_next(self, kind: OperationKind, subject: str, *,
                         deployment_id: DeploymentId | None = None,
                         node_id: NodeId | None = None, summary: str = "",
                         requested_by: str = "") -> OperationRecord:
        """Insert a new running operation under the first free readable id
        ``kind/subject/n``, from :meth:`next_number` on. Raises
        :class:`OperationConflictError` when another operation runs on the subject."""
        first = await self.next_number(kind, subject)
        for number in range(first, first + _NUMBER_TRIES):
            record = OperationRecord(
                operation_id=OperationId(operation_workflow_id(kind.value, subject, number)),
                kind=kind, deployment_id=deployment_id, node_id=node_id, summary=summary,
                requested_by=requested_by)
            stored = await self._write(
                record, _INSERT + " ON CONFLICT (operation_id) DO NOTHING")
            if stored is not None:
                return stored
        raise OperationNumberingError(
            f"no free id {kind.value}/{subject}/<n> for n from {first} to "
            f"{first + _NUMBER_TRIES - 1}")

    async def next_number(self, kind: OperationKind, subject: str) -> int:
        """One more than the operations of ``kind`` on ``subject`` so far: the ``n`` of
        the next readable id. Two callers may get the same number; the primary key lets
        one insert it, and :meth:`begin_next` moves the other on."""
        column = "node_id" if kind is OperationKind.DRAIN else "deployment_id"
        count = await self._pool.fetchval(
            f"SELECT count(*) FROM operations WHERE kind = $1 AND {column} = $2",
            kind.value, subject)
        return int(count) + 1

    async def save(self, record: OperationRecord) -> OperationRecord:
        """Write ``record``'s state, summary, steps and error (inserting it if missing);
        idempotent. The kind, subject, requester and creation time stay as first written.
        Raises :class:`OperationConflictError` for a running record inserted here while
        another runs on its subject."""
        stored = await self._write(record, _INSERT + """
            ON CONFLICT (operation_id) DO UPDATE SET
                state = EXCLUDED.state, summary = EXCLUDED.summary,
                steps = EXCLUDED.steps, error = EXCLUDED.error, updated_at = now()
            """)
        assert stored is not None  # an upsert always returns its row
        return stored

    async def finish_if_running(self, operation_id: str, state: OperationState,
                                error: str) -> OperationRecord | None:
        """End a running operation with ``state`` and ``error``, unless it ended already
        (its saga wrote its own outcome meanwhile, which wins). For an operation whose
        workflow never started or ended without writing one. The row as it stands after;
        None when unknown."""
        row = await self._pool.fetchrow(
            """
            WITH ended AS (
                UPDATE operations SET state = $2, error = $3, updated_at = now()
                WHERE operation_id = $1 AND state = 'running'
                RETURNING *
            )
            SELECT * FROM ended
            UNION ALL
            SELECT * FROM operations
            WHERE operation_id = $1 AND NOT EXISTS (SELECT 1 FROM ended)
            """,
            operation_id, state.value, error)
        return None if row is None else _operation(row)

    async def get(self, operation_id: str) -> OperationRecord | None:
        """One operation; None when unknown."""
        row = await self._pool.fetchrow(
            "SELECT * FROM operations WHERE operation_id = $1", operation_id)
        return None if row is None else _operation(row)

    async def list_operations(self, *, deployment_id: str | None = None,
                              node_id: str | None = None, state: OperationState | None = None,
                              limit: int = 50) -> list[OperationRecord]:
        """The newest ``limit`` operations (at most :data:`MAX_LIST_LIMIT`), newest first,
        optionally only those on one deployment, one node, or in one state."""
        rows = await self._pool.fetch(
            """
            SELECT * FROM operations
            WHERE ($1::text IS NULL OR deployment_id = $1)
              AND ($2::text IS NULL OR node_id = $2)
              AND ($3::text IS NULL OR state = $3)
            ORDER BY created_at DESC, operation_id DESC
            LIMIT $4
            """,
            deployment_id, node_id, None if state is None else state.value,
            max(0, min(limit, MAX_LIST_LIMIT)))
        return [_operation(row) for row in rows]

    async def running_on(self, *, deployment_id: str | None = None,
                         node_id: str | None = None) -> OperationRecord | None:
        """The operation running on a deployment (or a node), if any."""
        column = "deployment_id" if deployment_id is not None else "node_id"
        row = await self._pool.fetchrow(
            f"SELECT * FROM operations WHERE state = 'running' AND {column} = $1",
            deployment_id if deployment_id is not None else node_id)
        return None if row is None else _operation(row)

    async def _write(self, record: OperationRecord, sql: str) -> OperationRecord | None:
        """Run ``sql`` (an INSERT of ``record``) and answer the row it returns, or None.
        A running record refused by a running-per-subject index raises
        :class:`OperationConflictError`; when the running one ended before it could be
        read, the write is tried again."""
        for attempt in range(_CONFLICT_TRIES):
            try:
                row = await self._pool.fetchrow(sql + " RETURNING *", *_values(record))
            except asyncpg.UniqueViolationError as exc:
                subject = _conflict_subject(record, exc)
                if subject is None:
                    raise
                running = await self.running_on(**subject)
                if running is not None:
                    raise OperationConflictError(running, next(iter(subject.values()))) \
                        from exc
                if attempt == _CONFLICT_TRIES - 1:
                    raise
                continue
            return None if row is None else _operation(row)
        raise AssertionError("unreachable: the last attempt returns or raises")


_INSERT = """
    INSERT INTO operations (operation_id, kind, deployment_id, node_id, state, summary,
                            steps, error, requested_by)
    VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)
"""


def _values(record: OperationRecord) -> tuple[Any, ...]:
    return (record.operation_id, record.kind.value, record.deployment_id, record.node_id,
            record.state.value, record.summary,
            [s.model_dump(mode="json") for s in record.steps], record.error,
            record.requested_by)


def _conflict_subject(record: OperationRecord, exc: asyncpg.UniqueViolationError
                      ) -> dict[str, str] | None:
    """The subject whose running-per-subject index ``exc`` names, as the keyword of
    :meth:`OperationsStore.running_on`; None for another unique violation."""
    if exc.constraint_name == _RUNNING_PER_DEPLOYMENT and record.deployment_id is not None:
        return {"deployment_id": record.deployment_id}
    if exc.constraint_name == _RUNNING_PER_NODE and record.node_id is not None:
        return {"node_id": record.node_id}
    return None


def _operation(row: asyncpg.Record) -> OperationRecord:
    return OperationRecord(**dict(row.items()))
