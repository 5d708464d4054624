-- 0017: the engines' own queues, as the gateway scrapes them (gateway/engine_queue.py).

-- Requests waiting in the engine's own queue (vLLM's vllm:num_requests_waiting, SGLang's
-- sglang:num_queue_reqs), as the gateway worker last scraped the replica's /metrics;
-- NULL: unknown (an engine without such a gauge, a scrape that failed, a replica out of
-- routing). Several workers scrape the same engine, so a reader takes the largest per
-- replica, never the sum (modelkeeper/store/usage.py).
ALTER TABLE replica_usage ADD COLUMN engine_waiting integer CHECK (engine_waiting >= 0);

-- The gateway reads the engine a deployment runs with its routes, to know which gauge to
-- scrape: the engine's kind and nothing else of the catalog entry, on its own role
-- (0013, 0014). Where the role does not exist yet, the operator grants this with the
-- rest (docs/security.md).
DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'modelkeeper_gateway') THEN
        GRANT SELECT (engine) ON models TO modelkeeper_gateway;
    END IF;
END $$;
