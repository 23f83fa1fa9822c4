-- The `uncertain` state: a request sent on (by a gateway) whose outcome is unknown; see
-- `idempotency::RecordState::Uncertain`. SQLite cannot change a CHECK constraint in place, so the
-- table is rebuilt with the wider one (SQLite's documented way: create, copy, drop, rename), and
-- its indexes made again. Runs in the migration's transaction: all or nothing.
CREATE TABLE idempotency_records_uncertain (
    principal         TEXT    NOT NULL,
    endpoint          TEXT    NOT NULL,
    key               TEXT    NOT NULL,
    record_id         BLOB    NOT NULL CHECK (length(record_id) = 16),
    fingerprint       TEXT    NOT NULL,
    state             TEXT    NOT NULL CHECK (state IN ('in_flight', 'completed', 'failed', 'uncertain')),
    generation        INTEGER NOT NULL,
    response_status   INTEGER,
    response_headers  TEXT,
    response_body     BLOB,
    response_encoding TEXT,
    created_at        INTEGER NOT NULL,
    started_at        INTEGER NOT NULL,
    expires_at        INTEGER NOT NULL,
    PRIMARY KEY (principal, endpoint, key),
    -- A completed record carries its whole response; the others carry none.
    CHECK ((state = 'completed') = (response_status IS NOT NULL AND response_headers IS NOT NULL
                                    AND response_body IS NOT NULL AND response_encoding IS NOT NULL))
);

INSERT INTO idempotency_records_uncertain
    (principal, endpoint, key, record_id, fingerprint, state, generation, response_status, response_headers,
     response_body, response_encoding, created_at, started_at, expires_at)
SELECT principal, endpoint, key, record_id, fingerprint, state, generation, response_status, response_headers,
       response_body, response_encoding, created_at, started_at, expires_at
FROM idempotency_records;

DROP TABLE idempotency_records;
ALTER TABLE idempotency_records_uncertain RENAME TO idempotency_records;

CREATE INDEX IF NOT EXISTS idempotency_records_expires_at ON idempotency_records (expires_at);
CREATE INDEX IF NOT EXISTS idempotency_records_record_id ON idempotency_records (record_id);
