-- 0012: what the agent needs to trust a model's weights, on the catalog entry.
-- sha256: the weights file's digest (64 lowercase hex digits), checked by the agent before
-- the engine reads the file. NULL: not checked (the source policy still applies).
-- secret: the NAME of a token, never a token: the agent sends its own
-- MODELKEEPER_SOURCE_TOKEN_<secret> with the download. NULL: no token.

ALTER TABLE models
    ADD COLUMN sha256 text CHECK (sha256 ~ '^[0-9a-f]{64}$'),
    ADD COLUMN secret text CHECK (secret ~ '^[A-Z0-9][A-Z0-9_]{0,63}$');
