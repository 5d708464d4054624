"""Measured capacity: what one replica of a model was measured to serve
(:class:`~modelkeeper.domain.measured.MeasuredCapacity`), one row per model and profile.

``modelkeeper bench`` writes it through the API; the model's view and sizing read it here,
and the usage watch reads the concurrency with the gateways' rows
(:meth:`.usage.UsageStore.demand_samples`), in the same query.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import asyncpg

from ..domain.measured import MeasuredCapacity, Objective


class MeasuredStore:
    """The ``measured_capacity`` table, on the pool :class:`~.stores.Store` owns."""

    def __init__(self, pool: asyncpg.Pool) -> None:
        self._pool = pool

    async def put_measured(self, measured: MeasuredCapacity) -> MeasuredCapacity:
        """Store ``measured``, replacing the model's earlier measurement of that profile.
        The model must be in the catalog (asyncpg.ForeignKeyViolationError otherwise)."""
        await self._pool.execute(
            """
            INSERT INTO measured_capacity (
                model_id, profile, engine, concurrency, tokens_per_s, unit,
                tokens_per_s_per_unit, mean_request_s, ttft_p95_s, itl_p95_s,
                objective_ttft_p95_s, objective_itl_p95_s, replicas, max_tokens, measured_at)
            VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15)
            ON CONFLICT (model_id, profile) DO UPDATE SET
                engine = EXCLUDED.engine, concurrency = EXCLUDED.concurrency,
                tokens_per_s = EXCLUDED.tokens_per_s, unit = EXCLUDED.unit,
                tokens_per_s_per_unit = EXCLUDED.tokens_per_s_per_unit,
                mean_request_s = EXCLUDED.mean_request_s, ttft_p95_s = EXCLUDED.ttft_p95_s,
                itl_p95_s = EXCLUDED.itl_p95_s,
                objective_ttft_p95_s = EXCLUDED.objective_ttft_p95_s,
                objective_itl_p95_s = EXCLUDED.objective_itl_p95_s,
                replicas = EXCLUDED.replicas, max_tokens = EXCLUDED.max_tokens,
                measured_at = EXCLUDED.measured_at
            """,
            measured.model_id, measured.profile,
            None if measured.engine is None else measured.engine.value,
            measured.concurrency, measured.tokens_per_s,
            None if measured.unit is None else measured.unit.value,
            measured.tokens_per_s_per_unit, measured.mean_request_s, measured.ttft_p95_s,
            measured.itl_p95_s, measured.objective.ttft_p95_s, measured.objective.itl_p95_s,
            measured.replicas, measured.max_tokens, measured.measured_at)
        return measured

    async def measured_of(self, model_id: str) -> list[MeasuredCapacity]:
        """The model's measurements, one per profile, by profile name."""
        rows = await self._pool.fetch(
            "SELECT * FROM measured_capacity WHERE model_id = $1 ORDER BY profile", model_id)
        return [_measured(row) for row in rows]


def _measured(row: Mapping[str, Any]) -> MeasuredCapacity:
    return MeasuredCapacity(
        model_id=row["model_id"], profile=row["profile"], engine=row["engine"],
        concurrency=row["concurrency"], tokens_per_s=row["tokens_per_s"], unit=row["unit"],
        tokens_per_s_per_unit=row["tokens_per_s_per_unit"],
        mean_request_s=row["mean_request_s"], ttft_p95_s=row["ttft_p95_s"],
        itl_p95_s=row["itl_p95_s"],
        objective=Objective(ttft_p95_s=row["objective_ttft_p95_s"],
                            itl_p95_s=row["objective_itl_p95_s"]),
        replicas=row["replicas"], max_tokens=row["max_tokens"],
        measured_at=row["measured_at"])
