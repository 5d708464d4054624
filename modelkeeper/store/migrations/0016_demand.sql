-- 0016: following demand (modelkeeper.domain.demand, docs/demand.md).

-- A deployment's scaling policy (ScalingPolicy as JSON); NULL: fixed at `replicas`
-- (min = max = replicas), which never starts on demand. `replicas` stays the number the
-- keeper wants now, within the policy's bounds. The gateway reads it with its routes.
ALTER TABLE deployments ADD COLUMN scaling jsonb;
-- Loading on demand: since when, and why ("asked for: 3 requests waiting"); NULL: not
-- loading on demand.
ALTER TABLE deployments ADD COLUMN loading_since timestamptz;
ALTER TABLE deployments ADD COLUMN loading_reason text;
-- The last demand step and why ("-1 (d-1-r2): idle: unused for 12 min"), an eviction's
-- reason included: what `ls` and the web UI show beside the status.
ALTER TABLE deployments ADD COLUMN demand_note text;

-- What a sleeping replica keeps of a model's memory (its weights); NULL: all of it (the
-- accounting then frees nothing on sleep, which is never wrong, only pessimistic).
ALTER TABLE models ADD COLUMN weights_bytes bigint CHECK (weights_bytes > 0);

-- A sleeping replica's claim: memory_bytes is what it keeps asleep, and this what it
-- held awake (what a wake takes back, checked against free memory first). NULL: awake.
ALTER TABLE allocations ADD COLUMN awake_memory_bytes bigint
    CHECK (awake_memory_bytes >= memory_bytes);

-- Since when the gateway worker has reported the replica: its idle clock starts no
-- earlier (a gateway that has just restarted knows nothing of the time before, and
-- unknown is not idle). Set on insert only: the gateway's upsert does not name it.
ALTER TABLE replica_usage ADD COLUMN reporting_since timestamptz NOT NULL DEFAULT now();

-- A request waiting for a deployment with no ready replica is what loads an on-demand
-- model: a trigger tells the control plane at once (channel modelkeeper_demand, payload
-- the deployment id) when a gateway worker's waiting count rises from 0, rather than on
-- the next poll. Once per rise, not per request: a thousand requests make one notice.
CREATE FUNCTION notify_demand() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.waiting > 0 AND (TG_OP = 'INSERT' OR OLD.waiting = 0) THEN
        PERFORM pg_notify('modelkeeper_demand', NEW.deployment_id);
    END IF;
    RETURN NULL;
END $$;
CREATE TRIGGER deployment_usage_demand AFTER INSERT OR UPDATE ON deployment_usage
    FOR EACH ROW EXECUTE FUNCTION notify_demand();

-- The gateway reads the new deployment columns with its routes (0013 grants SELECT on
-- the whole table) and the model's weights_bytes is none of its business.
