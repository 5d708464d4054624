-- 0028: announce each audit-log entry, so the API's live stream (GET /events/stream)
-- hears of it at once instead of polling the table.
-- A trigger, not application code, as in 0002: the sweep appends its event in SQL of its
-- own, and every writer must be heard. An idempotent append that conflicts inserts no row
-- and announces nothing.
-- Payload: the event id only. NOTIFY refuses a payload of 8,000 bytes or more, and an
-- entry's data may be longer: the whole row would make such an INSERT fail. The listener
-- reads the rows by id, which also keeps an entry that commits after a later-numbered one.

CREATE FUNCTION notify_event() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('modelkeeper_events', NEW.event_id::text);
    RETURN NULL;
END $$;
CREATE TRIGGER events_notify AFTER INSERT ON events
    FOR EACH ROW EXECUTE FUNCTION notify_event();
