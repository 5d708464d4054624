-- 0011: what a node proves, what it may claim, and whose key a replica's engine holds.
--
-- credential_sha256: SHA-256 (hex) of the node's own credential, issued once at
--   registration in exchange for the join token. The credential is 256 random bits, so a
--   plain hash is a safe stored form (as for the gateway's client keys). NULL: the node
--   registered before credentials existed; its agent must join again with the join token.
-- credential_confirmed_at: when the node first authenticated with that credential. NULL
--   while the answer that carried it may have been lost: only then may the join token
--   alone issue the node a new one (see api/agents.py).
-- address: already in 0001, unused until now: the address the node's registration came
--   from (docs/security.md, "Nodes and engine keys"). The host of every endpoint it
--   reports must be this address.
-- engine_port_low, engine_port_high: the ports the agent declared it hands to engines;
--   an endpoint's port must lie between them. NULL: none declared, so every endpoint the
--   node reports is refused.

ALTER TABLE nodes
    ADD COLUMN credential_sha256 text,
    ADD COLUMN credential_confirmed_at timestamptz,
    ADD COLUMN engine_port_low integer CHECK (engine_port_low BETWEEN 1 AND 65535),
    ADD COLUMN engine_port_high integer CHECK (engine_port_high BETWEEN 1 AND 65535),
    ADD CONSTRAINT nodes_engine_ports_ordered CHECK (engine_port_low <= engine_port_high);

-- The node whose registered address and engine ports a replica's endpoint was checked
-- against when it was recorded (its rank 0's): the gateway derives the replica's engine
-- key from this node's key. Set and cleared with the endpoint. A replica whose endpoint
-- was recorded before this column existed has none, and is not routed until it is
-- replaced (its engine holds a key of the old scheme).
ALTER TABLE replicas ADD COLUMN endpoint_node_id text;
