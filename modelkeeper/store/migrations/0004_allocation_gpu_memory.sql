-- 0004: keep each shard's GPU memory with its claim.
-- place_replica is idempotent per replica: a retried call rebuilds the shard specs from the
-- allocations. Without this column it rebuilt them with no GPU memory, and vLLM and SGLang,
-- which turn memory_bytes into a fraction of it, refused to start. NULL: no GPU held.
-- (0001 says claims are made under a lock on the node rows; placement now takes advisory
-- locks on the chosen nodes instead, so heartbeats never wait: see Store.place_replica.)

ALTER TABLE allocations ADD COLUMN gpu_memory_bytes bigint
    CHECK (gpu_memory_bytes >= 0);

-- Claims made before this migration: the node's GPUs as it reports them now are the best
-- record left of what placement summed when it chose them.
UPDATE allocations a SET gpu_memory_bytes = (
    SELECT SUM((g ->> 'memory_bytes')::bigint)
    FROM nodes n, jsonb_array_elements(n.gpus) g
    WHERE n.node_id = a.node_id AND (g ->> 'index')::integer = ANY (a.gpu_indices)
)
WHERE cardinality(a.gpu_indices) > 0;
