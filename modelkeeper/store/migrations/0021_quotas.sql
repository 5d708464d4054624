-- 0021: quotas per scope of the tenancy tree (modelkeeper.domain.capacity, docs/capacity.md),
-- and operator tokens bound to a scope.

-- A scope's guarantee and limit of memory, GPUs and CPU cores. A NULL limit part is
-- unlimited; a guarantee part of 0 promises nothing of it.
CREATE TABLE quotas (
    scope text PRIMARY KEY
        CHECK (scope ~ '^[a-z0-9]([a-z0-9_-]{0,61}[a-z0-9])?(/[a-z0-9]([a-z0-9_-]{0,61}[a-z0-9])?){0,2}$'),
    guarantee_memory_bytes bigint NOT NULL DEFAULT 0 CHECK (guarantee_memory_bytes >= 0),
    guarantee_gpus integer NOT NULL DEFAULT 0 CHECK (guarantee_gpus >= 0),
    guarantee_cpu_cores double precision NOT NULL DEFAULT 0 CHECK (guarantee_cpu_cores >= 0),
    limit_memory_bytes bigint CHECK (limit_memory_bytes >= 0),
    limit_gpus integer CHECK (limit_gpus >= 0),
    limit_cpu_cores double precision CHECK (limit_cpu_cores >= 0),
    updated_at timestamptz NOT NULL DEFAULT now()
);

-- The scope an operator token is bound to: it may create, change and delete only the
-- deployments whose owner is that scope or beneath it, and nothing else. NULL: unbound.
ALTER TABLE operator_tokens ADD COLUMN scope text
    CHECK (scope ~ '^[a-z0-9]([a-z0-9_-]{0,61}[a-z0-9])?(/[a-z0-9]([a-z0-9_-]{0,61}[a-z0-9])?){0,2}$');
