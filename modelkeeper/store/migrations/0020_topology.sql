-- 0019: facility-aware placement (modelkeeper.domain.topology, docs/capacity.md).

-- A node held (reserved) for replicas running as one class, or owned within one scope;
-- NULL: not held for that. Placement refuses every other replica there (rule 5).
ALTER TABLE nodes ADD COLUMN hold_class text
    CHECK (hold_class IN ('critical', 'standard', 'opportunistic'));
ALTER TABLE nodes ADD COLUMN hold_owner text
    CHECK (hold_owner ~ '^[a-z0-9]([a-z0-9_-]{0,61}[a-z0-9])?(/[a-z0-9]([a-z0-9_-]{0,61}[a-z0-9])?){0,2}$');

-- The watts one shard of the model draws, as declared; NULL: none declared (no cap counts it).
ALTER TABLE models ADD COLUMN watts integer CHECK (watts >= 0);
-- What each shard was placed with: a PDU's draw is the sum over its nodes' claims.
ALTER TABLE allocations ADD COLUMN watts integer NOT NULL DEFAULT 0 CHECK (watts >= 0);

-- Power caps by PDU name (a node's topology.pdu label); the facility's under '_facility'.
CREATE TABLE power_caps (
    pdu text PRIMARY KEY,
    watts bigint NOT NULL CHECK (watts >= 0),
    updated_at timestamptz NOT NULL DEFAULT now()
);

-- A deployment's spread over a topology key: {"key": "rack", "max_skew": 1}; NULL: none.
ALTER TABLE deployments ADD COLUMN spread jsonb;
