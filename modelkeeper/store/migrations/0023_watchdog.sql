-- 0023: the memory watchdog and OOM calibration (modelkeeper.domain.watchdog,
-- docs/capacity.md "The memory watchdog", "OOM calibration").

-- Each node's memory level as its agent last reported it, since when, and why; how many
-- times it changed (the metric modelkeeper_node_memory_level_changes_total); and when
-- the watchdog last stopped a replica there (auto_protect acts at most once a minute per
-- node, across API processes: the conditional UPDATE on this column is the lock).
ALTER TABLE nodes ADD COLUMN memory_level text NOT NULL DEFAULT 'ok'
    CHECK (memory_level IN ('ok', 'warn', 'critical'));
ALTER TABLE nodes ADD COLUMN memory_level_since timestamptz;
ALTER TABLE nodes ADD COLUMN memory_level_reason text;
ALTER TABLE nodes ADD COLUMN memory_level_changes bigint NOT NULL DEFAULT 0;
ALTER TABLE nodes ADD COLUMN watchdog_acted_at timestamptz;

-- What a model was measured to take when it was killed for memory with evidence: the
-- largest peak resident memory its agents saw, and how many such kills. Placement claims
-- max(catalog memory, peak x oom_calibration_margin) for its next replicas.
CREATE TABLE model_calibrations (
    model_id text PRIMARY KEY REFERENCES models (model_id) ON DELETE CASCADE,
    peak_rss_bytes bigint NOT NULL CHECK (peak_rss_bytes >= 0),
    oom_kills integer NOT NULL DEFAULT 0 CHECK (oom_kills >= 0),
    last_replica_id text,
    last_at timestamptz NOT NULL DEFAULT now()
);
