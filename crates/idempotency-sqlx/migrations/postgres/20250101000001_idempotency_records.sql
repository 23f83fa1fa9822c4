-- Idempotency records (PostgreSQL).
CREATE TABLE IF NOT EXISTS idempotency_records (
    principal         TEXT        NOT NULL,
    endpoint          TEXT        NOT NULL,
    key               TEXT        NOT NULL,
    record_id         BYTEA       NOT NULL CHECK (octet_length(record_id) = 16),
    fingerprint       TEXT        NOT NULL,
    state             TEXT        NOT NULL CHECK (state IN ('in_flight', 'completed', 'failed')),
    generation        BIGINT      NOT NULL,
    response_status   INTEGER,
    response_headers  TEXT,
    response_body     BYTEA,
    response_encoding TEXT,
    created_at        TIMESTAMPTZ NOT NULL,
    started_at        TIMESTAMPTZ NOT NULL,
    expires_at        TIMESTAMPTZ NOT NULL,
    PRIMARY KEY (principal, endpoint, key),
    -- A completed record carries its whole response; the others carry none.
    CHECK ((state = 'completed') = (response_status IS NOT NULL AND response_headers IS NOT NULL
                                    AND response_body IS NOT NULL AND response_encoding IS NOT NULL))
);

CREATE INDEX IF NOT EXISTS idempotency_records_expires_at ON idempotency_records (expires_at);
