-- 0014: a model's own bounds on tokens per request, applied by the gateway.
-- default_max_tokens: sent as max_tokens with a request that names none (an engine would
-- otherwise generate until its context is full). max_tokens_limit: a larger max_tokens
-- (or max_completion_tokens) is lowered to it. NULL: none of the model's own.
-- The bounds match modelkeeper.domain.catalog.MAX_TOKENS_BOUND (2^20).

ALTER TABLE models
    ADD COLUMN default_max_tokens integer
        CHECK (default_max_tokens BETWEEN 1 AND 1048576),
    ADD COLUMN max_tokens_limit integer
        CHECK (max_tokens_limit BETWEEN 1 AND 1048576),
    ADD CONSTRAINT models_default_max_tokens_within_limit
        CHECK (default_max_tokens <= max_tokens_limit);

-- The gateway reads them with its routes, on its own role (0013): it may read these
-- columns and the key that joins them, not the rest of a catalog entry (its source,
-- engine arguments, secret name). Column privileges, so `SELECT * FROM models` is still
-- refused. Where the role does not exist yet, the operator grants this with the rest
-- (docs/security.md).
DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'modelkeeper_gateway') THEN
        GRANT SELECT (model_id, default_max_tokens, max_tokens_limit) ON models
            TO modelkeeper_gateway;
    END IF;
END $$;
