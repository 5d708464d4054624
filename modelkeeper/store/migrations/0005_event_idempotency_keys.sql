-- 0005: an audit entry appended by an activity is appended once, however often Temporal
-- retries the activity. A retry may follow a first attempt that committed its entry and
-- then failed (a lost reply, a worker that died): the retry carries the same key, and
-- the unique index turns its INSERT into nothing (see Store.record_event). NULL for
-- entries nobody retries (the API's), and for every entry made before this migration;
-- NULLs never conflict.

ALTER TABLE events ADD COLUMN idempotency_key text;
CREATE UNIQUE INDEX events_by_idempotency_key ON events (idempotency_key);
