-- 0007: what each replica runs, and what its deployment runs now (safe change, issue 10).
-- A restart, switch or reconfigure gives the deployment its next generation; a replica keeps
-- the generation it was placed on until it is replaced, so "every replica is on the new
-- generation" is a query, and one still on an older one shows as outdated.
--
-- runs_model_id: the catalog model behind the served name (deployments.model_id, which a
-- switch does not change). NULL: that model itself, which is what every row before this
-- migration ran. It references the catalog as model_id does, so a model that a replica
-- runs, or that a deployment was switched to, cannot leave the catalog under it
-- (DELETE /models answers 409, as for a deployed model).
-- engine_args: the generation's overrides, laid over the catalog entry's engine_args
-- (NULL: none); the entry's own are not copied, the catalog keeps them.
-- placement_note: why a replica shares a node with another replica of its deployment (no
-- other node had room); NULL when it does not. On the replica, written with its claims, so
-- a retried place_replica answers the note the first attempt did; on the deployment, the
-- last placement's, as the keeper reports it.
-- Defaults of 0 and NULL describe every existing row exactly, so no backfill.

ALTER TABLE replicas
    ADD COLUMN generation     integer NOT NULL DEFAULT 0,
    ADD COLUMN runs_model_id  text REFERENCES models (model_id),
    ADD COLUMN engine_args    jsonb,
    ADD COLUMN placement_note text;

ALTER TABLE deployments
    ADD COLUMN generation      integer NOT NULL DEFAULT 0,
    ADD COLUMN runs_model_id   text REFERENCES models (model_id),
    ADD COLUMN placement_note  text;
