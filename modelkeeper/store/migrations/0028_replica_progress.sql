-- 0028: a starting replica's progress as its agent reports it (download bytes and rate,
-- its place in the node's start-up queue, what it waits for), shown by the API and `ls`
-- (modelkeeper/domain/start_progress.py). A table of its own, not columns of replicas:
-- replicas' NOTIFY trigger (0002) would have every gateway re-read a deployment's routes
-- at each progress write. Written at most once a second per replica (plus each phase
-- change), and only by the agent of a node the replica is allocated to.
CREATE TABLE replica_progress (
    replica_id  text PRIMARY KEY REFERENCES replicas (replica_id) ON DELETE CASCADE,
    node_id     text NOT NULL,
    phase       text NOT NULL,
    progress    jsonb NOT NULL,
    updated_at  timestamptz NOT NULL
);

-- `modelkeeper logs` finds the node of a replica that is gone (failed, replaced) by its
-- last replica.placed event: by replica, newest first.
CREATE INDEX events_by_replica ON events (replica_id, event_id) WHERE replica_id IS NOT NULL;
