-- 0030: the catalog changes live (PATCH /models/{id}, docs/operations.md "Changing a
-- model"). When the model's spec (memory, engine arguments, source) last changed; NULL:
-- never since it was added. A replica placed before it runs the old spec and shows as
-- outdated until a restart replaces it.
ALTER TABLE models ADD COLUMN spec_changed_at timestamptz;

-- The generation a deployment's last failure happened on (first written); NULL: none, or
-- written before this column. One from an older generation is over: a restart, switch or
-- reconfigure has replaced what failed, and `ls` no longer shows it as history.
ALTER TABLE deployments ADD COLUMN last_failure_generation integer;
