-- Issue 30: what operators did to idempotency records (`DELETE /admin/v1/records/{id}`), one row
-- per action: who, when, which record and scope. Written after the action, never updated.
CREATE TABLE lb_record_audit (
    audit_id     BIGSERIAL PRIMARY KEY,
    at           BIGINT NOT NULL,   -- µs since the epoch
    actor        TEXT   NOT NULL,   -- the principal of the admin request
    action       TEXT   NOT NULL,   -- `forget`
    request_key  TEXT,              -- the admin request's own Idempotency-Key
    record_id    TEXT   NOT NULL,   -- 32 hex digits
    principal    TEXT   NOT NULL,
    endpoint     TEXT   NOT NULL,
    key          TEXT   NOT NULL,
    state        TEXT   NOT NULL    -- the record's state when it was forgotten
);
CREATE INDEX lb_record_audit_at ON lb_record_audit (at);
