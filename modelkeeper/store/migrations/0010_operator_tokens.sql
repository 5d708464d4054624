-- 0010: operator tokens for the control API, and who made each change in the audit log.

-- As client API keys (0003): only a SHA-256 of each token is stored. Tokens are 256-bit
-- random strings, so a fast hash is enough, and the API finds a presented token by its
-- hash (an index lookup, never a comparison of the secret itself).
CREATE TABLE operator_tokens (
    token_id      text PRIMARY KEY,
    -- Who holds it: the actor the audit log records for each change it makes.
    name          text NOT NULL,
    role          text NOT NULL CHECK (role IN ('admin', 'viewer')),
    -- The first characters of the token, shown by `tokens ls` and accepted by
    -- `tokens revoke`, so an operator can tell tokens apart.
    prefix        text NOT NULL,
    token_sha256  text NOT NULL UNIQUE,
    created_at    timestamptz NOT NULL DEFAULT now(),
    revoked_at    timestamptz
);
CREATE INDEX operator_tokens_by_prefix ON operator_tokens (prefix);

-- The token's name behind an operator's change; NULL for what the system records itself
-- (the keeper, agents, the sweeper) and for every entry made before this migration.
ALTER TABLE events ADD COLUMN actor text;
