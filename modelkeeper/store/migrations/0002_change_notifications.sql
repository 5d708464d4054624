-- 0002: push changes to listeners (the gateway) instead of having them poll.
-- A trigger, not application code, so every writer notifies and none can forget to.
-- Payload: the deployment id whose replicas or status changed; listeners re-read it.

CREATE FUNCTION notify_replica_change() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('modelkeeper_replicas',
                      COALESCE(NEW.deployment_id, OLD.deployment_id));
    RETURN NULL;
END $$;
CREATE TRIGGER replicas_notify AFTER INSERT OR UPDATE OR DELETE ON replicas
    FOR EACH ROW EXECUTE FUNCTION notify_replica_change();

CREATE FUNCTION notify_deployment_change() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('modelkeeper_deployments',
                      COALESCE(NEW.deployment_id, OLD.deployment_id));
    RETURN NULL;
END $$;
CREATE TRIGGER deployments_notify AFTER INSERT OR UPDATE OR DELETE ON deployments
    FOR EACH ROW EXECUTE FUNCTION notify_deployment_change();
