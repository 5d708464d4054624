-- 0018: sharing the cluster (modelkeeper.domain.capacity, docs/capacity.md).

-- A deployment's capacity class (critical, standard, opportunistic); NULL: it follows the
-- scaling policy (on demand: opportunistic, else standard).
ALTER TABLE deployments ADD COLUMN capacity_class text
    CHECK (capacity_class IN ('critical', 'standard', 'opportunistic'));
-- Its owner in the tenancy tree: org, org/team or org/team/project; NULL: nobody's (no
-- quota counts it).
ALTER TABLE deployments ADD COLUMN owner text
    CHECK (owner ~ '^[a-z0-9]([a-z0-9_-]{0,61}[a-z0-9])?(/[a-z0-9]([a-z0-9_-]{0,61}[a-z0-9])?){0,2}$');
CREATE INDEX deployments_owner ON deployments (owner) WHERE owner IS NOT NULL;

-- Room held for a deployment that preempted others to make it: placement counts a hold
-- as claimed for every deployment but its holder, so that the room a victim frees is not
-- taken back by the victim (or anybody else) before the holder places. The holder's own
-- placement deletes its holds; `expires_at` bounds a holder that never comes.
CREATE TABLE room_holds (
    hold_id bigserial PRIMARY KEY,
    deployment_id text NOT NULL REFERENCES deployments (deployment_id) ON DELETE CASCADE,
    node_id text NOT NULL REFERENCES nodes (node_id) ON DELETE CASCADE,
    memory_bytes bigint NOT NULL CHECK (memory_bytes >= 0),
    cpu_cores double precision NOT NULL DEFAULT 0 CHECK (cpu_cores >= 0),
    gpu_indices integer[] NOT NULL DEFAULT '{}',
    reason text NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    expires_at timestamptz NOT NULL
);
CREATE INDEX room_holds_node ON room_holds (node_id);
CREATE INDEX room_holds_deployment ON room_holds (deployment_id);
