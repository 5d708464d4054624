-- 0009: when a replica last left routing (its state moved from ready to anything else).
-- A drain waits for every gateway to report 0 in flight in a usage row written after the
-- replica left routing; when the keeper's own state write (stopping) took it out before
-- the drain marked it, this is the moment to count from, not the drain's mark: a gateway
-- that dropped it then has no reason to write about it again, and counting from the later
-- mark made the drain wait out its stale-row rule (5 flush intervals) for nothing.
-- Set when ready is left, cleared when ready again; NULL: routed, or never ready.

ALTER TABLE replicas ADD COLUMN left_routing_at timestamptz;
