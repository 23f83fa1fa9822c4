-- Operations, tombstones and counters (issue 11).
--
-- lb_operations maps each protected operation back to its idempotency record, written at the
-- start of every attempt, so the reaper can find operations nobody finished, take their record's
-- claim, and roll back what they hold; and clean up the intents of finished ones.
CREATE TABLE lb_operations (
    op_id           TEXT PRIMARY KEY,
    kind            TEXT NOT NULL,
    principal       TEXT NOT NULL,
    endpoint        TEXT NOT NULL,
    idem_key        TEXT NOT NULL,
    record_id       TEXT NOT NULL,
    last_attempt_at INTEGER NOT NULL
);
CREATE INDEX lb_operations_by_attempt ON lb_operations (last_attempt_at);

-- Which operation an intent belongs to (NULL for intents recorded before this migration).
ALTER TABLE lb_intents ADD COLUMN op_id TEXT;
CREATE INDEX lb_intents_by_op ON lb_intents (op_id);

-- A deleted worker: keyed by the delete's sub-key (its retry answers 204, not 404) and by the
-- worker id (a retry of the worker's create never brings it back). Pruned after the retention.
CREATE TABLE lb_tombstones (
    tombstone_id TEXT PRIMARY KEY,
    worker_id    TEXT NOT NULL UNIQUE,
    principal    TEXT NOT NULL,
    deleted_at   INTEGER NOT NULL
);
CREATE INDEX lb_tombstones_by_age ON lb_tombstones (deleted_at);

-- Totals that outlive the intents they count (finished intents are cleaned up).
CREATE TABLE lb_counters (
    name  TEXT PRIMARY KEY,
    value INTEGER NOT NULL
);
INSERT INTO lb_counters (name, value) SELECT 'boots', COUNT(*) FROM lb_intents WHERE kind = 'boot' AND state = 'done';
INSERT INTO lb_counters (name, value) SELECT 'reboots', COUNT(*) FROM lb_intents WHERE kind = 'reboot' AND state = 'done';
