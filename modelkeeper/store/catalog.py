"""The model catalog: the models a deployment can run."""

from __future__ import annotations

import asyncpg

from ..domain.catalog import CatalogModel
from .pool import record


class ModelExistsError(Exception):
    """A model with this id is already in the catalog."""


class ModelInUseError(Exception):
    """The model has a deployment; delete that first."""


class CatalogStore:
    """The ``models`` table, on the pool :class:`~.stores.Store` owns."""

    def __init__(self, pool: asyncpg.Pool) -> None:
        self._pool = pool

    async def create_model(self, model: CatalogModel) -> CatalogModel:
        """Add a model; :class:`ModelExistsError` if the id is taken."""
        try:
            row = await self._pool.fetchrow(
                """
                INSERT INTO models (model_id, engine, source, memory_bytes, memory_estimated,
                                    cpu_cores, gpus, engine_args, min_nodes, sha256, secret,
                                    default_max_tokens, max_tokens_limit, weights_bytes,
                                    profiles, watts, engine_version)
                VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16,
                        $17)
                RETURNING created_at
                """,
                model.model_id, model.engine.value, model.source, model.memory_bytes,
                model.memory_estimated, model.cpu_cores, model.gpus, model.engine_args,
                model.min_nodes, model.sha256, model.secret, model.default_max_tokens,
                model.max_tokens_limit, model.weights_bytes,
                [p.model_dump(mode="json") for p in model.profiles], model.watts,
                model.engine_version)
        except asyncpg.UniqueViolationError:
            raise ModelExistsError(model.model_id) from None
        assert row is not None
        return model.model_copy(update={"created_at": row["created_at"]})

    async def get_model(self, model_id: str) -> CatalogModel | None:
        """One catalog entry; None when unknown."""
        row = await self._pool.fetchrow("SELECT * FROM models WHERE model_id = $1", model_id)
        return None if row is None else _model(row)

    async def list_models(self) -> list[CatalogModel]:
        """The catalog, by id."""
        rows = await self._pool.fetch("SELECT * FROM models ORDER BY model_id")
        return [_model(row) for row in rows]

    async def update_spec(self, model: CatalogModel) -> CatalogModel | None:
        """Write a model's memory, engine arguments, source and sha256, and mark its spec
        changed now (replicas placed before run the old one: outdated); None when the
        model is gone."""
        row = await self._pool.fetchrow(
            """
            UPDATE models SET memory_bytes = $2, memory_estimated = $3, engine_args = $4,
                              source = $5, sha256 = $6, spec_changed_at = now()
            WHERE model_id = $1
            RETURNING *
            """,
            model.model_id, model.memory_bytes, model.memory_estimated, model.engine_args,
            model.source, model.sha256)
        return None if row is None else _model(row)

    async def deployments_of(self, model_id: str, *, limit: int) -> tuple[list[str], int]:
        """The deployments that serve ``model_id`` (by name, or behind a name after a
        switch), by id: at most ``limit`` of them, and how many there are."""
        rows = await self._pool.fetch(
            """
            SELECT deployment_id, count(*) OVER () AS total FROM deployments
            WHERE model_id = $1 OR runs_model_id = $1
            ORDER BY deployment_id LIMIT $2
            """, model_id, limit)
        return [row["deployment_id"] for row in rows], (rows[0]["total"] if rows else 0)

    async def delete_model(self, model_id: str) -> bool:
        """Remove a model; :class:`ModelInUseError` while it has a deployment."""
        try:
            done = await self._pool.execute("DELETE FROM models WHERE model_id = $1", model_id)
        except asyncpg.ForeignKeyViolationError:
            raise ModelInUseError(model_id) from None
        return bool(done.endswith(" 1"))


def _model(row: asyncpg.Record) -> CatalogModel:
    data = record(row)
    if data.get("cpu_cores") is not None:
        data["cpu_cores"] = float(data["cpu_cores"])
    return CatalogModel(**data)

