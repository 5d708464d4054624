-- 0022: capacity measured, not guessed (modelkeeper.domain.measured, docs/capacity.md).

-- What one replica of a model, as one profile ('' : the model's own resources, no named
-- profile), was measured to serve within a latency objective by `modelkeeper bench`: the
-- latest measurement replaces the one before. The usage watch reads `concurrency` with
-- the gateways' rows (rules 3 and 4 of modelkeeper.domain.demand); sizing reads it all.
CREATE TABLE measured_capacity (
    model_id               text NOT NULL REFERENCES models (model_id) ON DELETE CASCADE,
    profile                text NOT NULL DEFAULT '',
    engine                 text,
    concurrency            integer NOT NULL CHECK (concurrency >= 1),
    tokens_per_s           double precision NOT NULL CHECK (tokens_per_s >= 0),
    unit                   text CHECK (unit IN ('gpu', 'core')),
    tokens_per_s_per_unit  double precision CHECK (tokens_per_s_per_unit >= 0),
    mean_request_s         double precision NOT NULL CHECK (mean_request_s > 0),
    ttft_p95_s             double precision NOT NULL CHECK (ttft_p95_s >= 0),
    itl_p95_s              double precision CHECK (itl_p95_s >= 0),
    objective_ttft_p95_s   double precision NOT NULL CHECK (objective_ttft_p95_s > 0),
    objective_itl_p95_s    double precision NOT NULL CHECK (objective_itl_p95_s > 0),
    replicas               integer NOT NULL CHECK (replicas >= 1),
    max_tokens             integer NOT NULL CHECK (max_tokens >= 1),
    measured_at            timestamptz NOT NULL,
    PRIMARY KEY (model_id, profile)
);
