-- 0025: engine versions per node, and the versions a model or profile requires
-- (modelkeeper.domain.versions, placement rule 11, docs/engines.md "Engine versions").

-- The engines a node's agent can run, {"vllm": "0.6.3", "sim": "0.2.0", ...}; NULL from an
-- agent older than the field (placement then takes it as able to run anything).
ALTER TABLE nodes ADD COLUMN engines jsonb
    CHECK (engines IS NULL OR jsonb_typeof(engines) = 'object');

-- A model's requirement on its engine's version (PEP 440: ">=0.6.0", "==0.6.3"); NULL:
-- any version. A profile's lives in its JSON (models.profiles).
ALTER TABLE models ADD COLUMN engine_version text;
