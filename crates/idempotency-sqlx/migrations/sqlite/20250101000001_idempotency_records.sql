-- Idempotency records (SQLite). Timestamps are integer microseconds since the Unix epoch, so
-- they round-trip exactly and compare as integers.
CREATE TABLE IF NOT EXISTS idempotency_records (
    principal         TEXT    NOT NULL,
    endpoint          TEXT    NOT NULL,
    key               TEXT    NOT NULL,
    record_id         BLOB    NOT NULL CHECK (length(record_id) = 16),
    fingerprint       TEXT    NOT NULL,
    state             TEXT    NOT NULL CHECK (state IN ('in_flight', 'completed', 'failed')),
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

CREATE INDEX IF NOT EXISTS idempotency_records_expires_at ON idempotency_records (expires_at);
