-- 0001: the control plane's tables.
-- Memory is in bytes (bigint), times are timestamptz, free-form maps are jsonb.

CREATE TABLE nodes (
    node_id                 text PRIMARY KEY,
    name                    text NOT NULL,
    address                 text,
    -- What the agent reports about itself. NULL memory means an older agent that does not
    -- report it: the node is still usable and shows "-", never 0.
    agent_labels            jsonb NOT NULL DEFAULT '{}'::jsonb,
    memory_total_bytes      bigint CHECK (memory_total_bytes >= 0),
    memory_available_bytes  bigint CHECK (memory_available_bytes >= 0),
    cpu_count               integer CHECK (cpu_count >= 0),
    gpus                    jsonb NOT NULL DEFAULT '[]'::jsonb,
    -- Operator settings outrank the agent's and survive re-registration.
    operator_labels         jsonb NOT NULL DEFAULT '{}'::jsonb,
    cordoned                boolean NOT NULL DEFAULT false,
    cordon_reason           text,
    registered_at           timestamptz NOT NULL DEFAULT now(),
    last_seen               timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE models (
    model_id          text PRIMARY KEY,
    engine            text NOT NULL CHECK (engine IN ('llamacpp', 'vllm', 'sglang', 'sim')),
    source            text NOT NULL,
    memory_bytes      bigint NOT NULL CHECK (memory_bytes > 0),
    memory_estimated  boolean NOT NULL DEFAULT false,
    cpu_cores         numeric CHECK (cpu_cores > 0),
    gpus              integer CHECK (gpus >= 0),
    engine_args       jsonb NOT NULL DEFAULT '{}'::jsonb,
    min_nodes         integer NOT NULL DEFAULT 1 CHECK (min_nodes >= 1),
    created_at        timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE deployments (
    deployment_id         text PRIMARY KEY,
    -- One deployment per model: the unique index makes two racing creates end with one.
    model_id              text NOT NULL UNIQUE REFERENCES models (model_id),
    replicas              integer NOT NULL CHECK (replicas >= 0),
    min_nodes             integer NOT NULL DEFAULT 1 CHECK (min_nodes >= 1),
    node_ids              text[],
    labels                jsonb NOT NULL DEFAULT '{}'::jsonb,
    status                text NOT NULL DEFAULT 'placing',
    placement_error       text,
    consecutive_failures  integer NOT NULL DEFAULT 0,
    last_failure          text,
    workflow_id           text NOT NULL,
    created_at            timestamptz NOT NULL DEFAULT now(),
    updated_at            timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE replicas (
    replica_id     text PRIMARY KEY,
    deployment_id  text NOT NULL REFERENCES deployments (deployment_id) ON DELETE CASCADE,
    state          text NOT NULL,
    endpoint       text,
    created_at     timestamptz NOT NULL DEFAULT now(),
    started_at     timestamptz,
    ready_at       timestamptz
);
CREATE INDEX replicas_by_deployment ON replicas (deployment_id);

-- What each replica claims on each node. Placement inserts these in the same transaction
-- that reads free capacity, under a lock on the node rows, so two placements can never
-- hand out the same memory.
CREATE TABLE allocations (
    replica_id    text NOT NULL REFERENCES replicas (replica_id) ON DELETE CASCADE,
    node_id       text NOT NULL REFERENCES nodes (node_id),
    rank          integer NOT NULL CHECK (rank >= 0),
    memory_bytes  bigint NOT NULL CHECK (memory_bytes >= 0),
    cpu_cores     numeric NOT NULL DEFAULT 0 CHECK (cpu_cores >= 0),
    gpu_indices   integer[] NOT NULL DEFAULT '{}',
    PRIMARY KEY (replica_id, node_id)
);
CREATE INDEX allocations_by_node ON allocations (node_id);

-- Append-only audit log: who did what to which deployment, node or replica, and why.
CREATE TABLE events (
    event_id       bigserial PRIMARY KEY,
    at             timestamptz NOT NULL DEFAULT now(),
    kind           text NOT NULL,
    deployment_id  text,
    node_id        text,
    replica_id     text,
    message        text NOT NULL,
    data           jsonb NOT NULL DEFAULT '{}'::jsonb
);
CREATE INDEX events_by_deployment ON events (deployment_id, event_id);

CREATE FUNCTION events_are_append_only() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'events is append-only (% refused)', TG_OP;
END $$;
CREATE TRIGGER events_append_only BEFORE UPDATE OR DELETE ON events
    FOR EACH ROW EXECUTE FUNCTION events_are_append_only();
