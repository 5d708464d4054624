-- 0003: what the gateway keeps in the store: client API keys, and usage for idle stop
-- and autoscaling to read.

-- Client API keys. Only a SHA-256 of each key is stored: keys are 256-bit random strings,
-- so a fast hash is enough (a slow password hash guards low-entropy secrets, which these
-- are not) and lets the gateway check a key per request in a microsecond.
CREATE TABLE api_keys (
    key_id      text PRIMARY KEY,
    name        text NOT NULL,
    -- The first characters of the key, shown by `keys ls` and accepted by `keys revoke`,
    -- so an operator can tell keys apart without anyone storing the key itself.
    prefix      text NOT NULL,
    key_sha256  text NOT NULL UNIQUE,
    created_at  timestamptz NOT NULL DEFAULT now(),
    revoked_at  timestamptz
);
CREATE INDEX api_keys_by_prefix ON api_keys (prefix);

-- Gateways cache the keys; tell them when one is created or revoked.
CREATE FUNCTION notify_api_key_change() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('modelkeeper_api_keys', COALESCE(NEW.key_id, OLD.key_id));
    RETURN NULL;
END $$;
CREATE TRIGGER api_keys_notify AFTER INSERT OR UPDATE OR DELETE ON api_keys
    FOR EACH ROW EXECUTE FUNCTION notify_api_key_change();

-- Usage, written by each gateway worker once per tick (not per request). Rows are per
-- gateway worker, because several workers and gateways serve the same replica and each
-- only knows its own counts: a reader sums the rows whose updated_at is recent. A worker
-- deletes its rows when it stops; rows of one that died go stale and are ignored.
CREATE TABLE replica_usage (
    gateway_id     text NOT NULL,
    replica_id     text NOT NULL REFERENCES replicas (replica_id) ON DELETE CASCADE,
    -- Requests this worker has open at the replica right now.
    in_flight      integer NOT NULL CHECK (in_flight >= 0),
    last_used_at   timestamptz,
    updated_at     timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (gateway_id, replica_id)
);
CREATE INDEX replica_usage_by_replica ON replica_usage (replica_id);

-- Requests waiting because a deployment has no ready replica have no replica to be
-- counted against, so waiting is counted per deployment; scaling from zero needs it.
CREATE TABLE deployment_usage (
    gateway_id       text NOT NULL,
    deployment_id    text NOT NULL REFERENCES deployments (deployment_id) ON DELETE CASCADE,
    waiting          integer NOT NULL CHECK (waiting >= 0),
    last_request_at  timestamptz,
    updated_at       timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (gateway_id, deployment_id)
);
