-- The effect ledger: operations, their intents, and what finished operations keep.
--
-- fx_operations.mark: 0 live; 1 taken by the reaper for a rollback; 2 rolled back; 3 finished.
-- A row marked 2 or 3 is kept, compact (its intents deleted), until the retention passes after
-- marked_at, so an attempt that outlived its claim can never start the operation again.
-- next_check_at: when the reaper looks at the row next (a row it waits on is put off).
CREATE TABLE fx_operations (
    op_id           TEXT    PRIMARY KEY,
    kind            TEXT    NOT NULL,
    principal       TEXT    NOT NULL,
    endpoint        TEXT    NOT NULL,
    idem_key        TEXT    NOT NULL,
    record_id       TEXT    NOT NULL,
    mark            INTEGER NOT NULL DEFAULT 0,
    last_attempt_at INTEGER NOT NULL,
    next_check_at   INTEGER NOT NULL,
    marked_at       INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX fx_operations_due ON fx_operations (next_check_at) WHERE mark < 2;
CREATE INDEX fx_operations_marked ON fx_operations (marked_at) WHERE mark >= 2;

-- One intent per side effect (intent_id: the derived sub-key, also the tag sent downstream).
-- state: pending (recorded; sent or about to be), accepted (a long-running effect the downstream
-- took), done, failed (definitely did not happen). sent_at: the send stamp, moved by
-- compare-and-set before every send. watcher/watch_until: the lease of the process that watches
-- an accepted effect.
CREATE TABLE fx_intents (
    intent_id   TEXT    PRIMARY KEY,
    op_id       TEXT    NOT NULL,
    effect      TEXT    NOT NULL,
    keeps       INTEGER NOT NULL,
    state       TEXT    NOT NULL,
    resource_id TEXT,
    created_at  INTEGER NOT NULL,
    sent_at     INTEGER NOT NULL,
    watcher     TEXT,
    watch_until INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX fx_intents_by_op ON fx_intents (op_id);
CREATE INDEX fx_intents_to_watch ON fx_intents (watch_until) WHERE state = 'accepted';

-- What finished operations own downstream (effects that keep their resource): the inventory
-- sweep leaves these alone until the service disowns them.
CREATE TABLE fx_owned (
    tag         TEXT    PRIMARY KEY,
    resource_id TEXT    NOT NULL,
    op_id       TEXT    NOT NULL,
    owned_at    INTEGER NOT NULL
);
CREATE INDEX fx_owned_by_resource ON fx_owned (resource_id);
