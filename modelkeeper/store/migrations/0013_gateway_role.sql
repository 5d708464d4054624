-- 0013: the gateway's own database role, with no DDL rights.
--
-- The gateway is the process that faces clients; if it is ever taken over, a role that
-- can only read routes and keys and write its usage rows cannot drop, alter or create
-- anything. Only the migrating processes (the API and the worker) connect as the role
-- that owns the schema. The gateway uses this one through MODELKEEPER_GATEWAY_DATABASE_URL
-- and then never migrates (see docs/security.md).
--
-- Safe everywhere this runs:
-- * The role is created only if it is missing and the migrating role may create roles
--   (`up`'s embedded superuser). Otherwise (a managed database, compose's `modelkeeper`
--   role) the operator creates it, with a password, before or after this migration; the
--   grants below are then theirs to run (docs/security.md lists them), and this
--   migration only says so.
-- * CREATE ROLE is cluster-wide while migrations lock one database, so two databases
--   migrating at once may race to create it: the loser takes the winner's role.
-- * GRANT is idempotent.
--
-- It logs in without a password of its own: under `up`, PostgreSQL trusts loopback
-- connections anyway; elsewhere a role with no password cannot log in with password
-- authentication until the operator gives it one (ALTER ROLE ... PASSWORD).
--
-- The grants are the least the gateway's queries (modelkeeper/store/routing.py) need:
-- * read: deployments and replicas (its routes), api_keys (the hashes of unrevoked keys;
--   keys are created and revoked by `modelkeeper keys`, which connects as the owner);
-- * read and write: replica_usage and deployment_usage (its usage rows, upserted and
--   deleted). Their keys are text, so no sequence is involved and none is granted.
-- LISTEN needs no privilege. A later migration that gives the gateway a new table or
-- sequence grants it there.
DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'modelkeeper_gateway') THEN
        IF NOT EXISTS (SELECT 1 FROM pg_roles
                       WHERE rolname = current_user AND (rolsuper OR rolcreaterole)) THEN
            RAISE NOTICE 'role modelkeeper_gateway does not exist and % may not create it: '
                         'create it and grant it its tables (docs/security.md)', current_user;
            RETURN;
        END IF;
        BEGIN
            CREATE ROLE modelkeeper_gateway LOGIN;
        EXCEPTION WHEN duplicate_object OR unique_violation THEN
            NULL;  -- created meanwhile by another database's migration: the same role
        END;
    END IF;
    -- PUBLIC has USAGE on the public schema by default; a schema of the operator's own
    -- may not grant it.
    IF NOT has_schema_privilege('modelkeeper_gateway', current_schema(), 'USAGE') THEN
        EXECUTE format('GRANT USAGE ON SCHEMA %I TO modelkeeper_gateway', current_schema());
    END IF;
    GRANT SELECT ON deployments, replicas, api_keys TO modelkeeper_gateway;
    GRANT SELECT, INSERT, UPDATE, DELETE ON replica_usage, deployment_usage
        TO modelkeeper_gateway;
END $$;
