-- 0008: the sagas (restart, drain, switch, reconfigure) as GET /operations shows them.
-- One row per saga, keyed by its workflow id (restart/d1/3); the saga writes its steps and
-- outcome here as it goes (activities.operations), and the API inserts the row before it
-- starts the workflow, so a second saga is refused before anything runs.
-- No foreign keys: a deleted deployment or a node that left keeps its history.

CREATE TABLE operations (
    operation_id   text PRIMARY KEY,
    kind           text NOT NULL CHECK (kind IN ('restart', 'drain', 'switch', 'reconfigure')),
    -- restart, switch, reconfigure: the deployment it changes; drain: NULL.
    deployment_id  text,
    -- drain: the node it empties; otherwise NULL.
    node_id        text,
    state          text NOT NULL CHECK (state IN ('running', 'succeeded', 'failed',
                                                   'rolled_back', 'rollback_incomplete',
                                                   'cancelled')),
    summary        text NOT NULL DEFAULT '',
    -- OperationStep values, in order (name, state, detail, started_at, ended_at).
    steps          jsonb NOT NULL DEFAULT '[]'::jsonb,
    error          text,
    requested_by   text NOT NULL DEFAULT '',
    created_at     timestamptz NOT NULL DEFAULT now(),
    updated_at     timestamptz NOT NULL DEFAULT now(),
    CHECK (deployment_id IS NOT NULL OR node_id IS NOT NULL)
);

-- One saga at a time per deployment and per node: the second INSERT of a running row
-- fails on these, and the store names the one that runs (OperationConflictError).
CREATE UNIQUE INDEX operations_one_running_per_deployment ON operations (deployment_id)
    WHERE state = 'running' AND deployment_id IS NOT NULL;
CREATE UNIQUE INDEX operations_one_running_per_node ON operations (node_id)
    WHERE state = 'running' AND node_id IS NOT NULL;

-- GET /operations: newest first, optionally for one deployment or node.
CREATE INDEX operations_by_created ON operations (created_at DESC, operation_id);
CREATE INDEX operations_by_deployment ON operations (deployment_id, created_at DESC);
CREATE INDEX operations_by_node ON operations (node_id, created_at DESC);
