-- 0019: hardware profiles (modelkeeper.domain.profiles, docs/capacity.md).

-- A model's ways to run it, tried in priority order where a replica is placed: a JSON
-- array of modelkeeper.domain.catalog.HardwareProfile, at most MAX_PROFILES (8). Empty:
-- the model's own engine, memory, cores, GPUs and engine_args, as one implicit profile.
ALTER TABLE models ADD COLUMN profiles jsonb NOT NULL DEFAULT '[]'
    CHECK (jsonb_typeof(profiles) = 'array' AND jsonb_array_length(profiles) <= 8);

-- The profile a replica runs, by name; NULL: its model declares none.
ALTER TABLE replicas ADD COLUMN profile text;
