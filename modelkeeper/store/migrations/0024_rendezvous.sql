-- 0024: multi-node replicas rendezvous at rank 0 (docs/engines.md "Multi-node replicas").
-- Rank 0's allocation holds the port on its node where the other ranks join it, claimed
-- with the replica's memory (modelkeeper.domain.shards.rendezvous_port) and released
-- with it. NULL for one-node replicas and for every rank but 0. The unique index is the
-- safety net under the node lock: two replicas never get one port on one node.
ALTER TABLE allocations ADD COLUMN rendezvous_port integer
    CHECK (rendezvous_port IS NULL OR (rendezvous_port BETWEEN 1 AND 65535 AND rank = 0));
CREATE UNIQUE INDEX allocations_rendezvous_port ON allocations (node_id, rendezvous_port)
    WHERE rendezvous_port IS NOT NULL;
