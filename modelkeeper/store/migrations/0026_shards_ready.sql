-- 0026: a multi-node replica's progress while it starts (docs/engines.md "Multi-node
-- replicas"): how many of its shards are ready; NULL once it is ready (or for a replica
-- of one shard, which has no progress to show).
ALTER TABLE replicas ADD COLUMN shards_ready integer CHECK (shards_ready >= 0);
