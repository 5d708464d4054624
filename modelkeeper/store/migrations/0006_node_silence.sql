-- 0006: a node the API's liveness channel found silent (its agent's stream broke without
-- a goodbye, or carried no ping for node_silent_after_s). Placement treats a silent node
-- as unreachable at once, instead of after node_unreachable_after_s without a heartbeat.
-- The API sets it once per silence; the node's next ping or heartbeat clears it (a
-- heartbeat only when it reached the API after the silence began). NULL: not silent.
-- No index: it is read with the node rows placement already reads.

ALTER TABLE nodes ADD COLUMN silent_since timestamptz;
