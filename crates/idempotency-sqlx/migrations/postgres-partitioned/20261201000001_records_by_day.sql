-- Idempotency records partitioned by expiry day (PostgreSQL), the opt-in layout of
-- `PartitionedPostgresStore`. A table of its own name, beside (never instead of) the default
-- layout's `idempotency_records`.
--
-- The partition key is `expires_at` itself, in one partition per UTC day: an update that moves a
-- record's expiry to another day moves the row to that day's partition (PostgreSQL row movement),
-- so every row of the partition for day D expires before D + 1 day, and the sweeper may drop the
-- whole partition once D + 1 day <= now. The partitions (`idempotency_records_by_day_pYYYYMMDD`)
-- are created by the store, ahead of time and on demand.
CREATE TABLE IF NOT EXISTS idempotency_records_by_day (
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
    -- A unique index on a partitioned table must contain the partition key, so this does NOT
    -- make (principal, endpoint, key) unique across the table: the claim function below does,
    -- by serialising the claims of one key. The index serves every lookup by key (one probe per
    -- partition).
    PRIMARY KEY (principal, endpoint, key, expires_at),
    -- A completed record carries its whole response; the others carry none.
    CHECK ((state = 'completed') = (response_status IS NOT NULL AND response_headers IS NOT NULL
                                    AND response_body IS NOT NULL AND response_encoding IS NOT NULL))
) PARTITION BY RANGE (expires_at);

-- Claims a key: none -> in_flight, or an expired record replaced by a fresh one; otherwise
-- returns the live record untouched. Returns one row (the record, and whether this call created
-- it), or none when the expired record it meant to replace changed under it (run it again).
--
-- Why this is safe without a table-wide unique index: every statement that creates a record for
-- a key (the insert and the replacement here) runs while holding a transaction-scoped advisory
-- lock on a hash of the key's scope, taken before the look-up. Under READ COMMITTED each
-- statement of a VOLATILE function takes a fresh snapshot, so the look-up after the lock sees
-- every claim of the key that committed before (a lock is released only after its transaction's
-- commit is visible). Updates that move a row between partitions delete and insert it in one
-- transaction, so any snapshot sees exactly one version of it. A hash collision only makes two
-- keys wait for each other.
CREATE OR REPLACE FUNCTION idempotency_claim_by_day(
    p_principal TEXT, p_endpoint TEXT, p_key TEXT, p_record_id BYTEA, p_fingerprint TEXT,
    p_now TIMESTAMPTZ, p_expires_at TIMESTAMPTZ)
RETURNS TABLE (
    o_principal TEXT, o_endpoint TEXT, o_key TEXT, o_record_id BYTEA, o_fingerprint TEXT, o_state TEXT,
    o_generation BIGINT, o_response_status INTEGER, o_response_headers TEXT, o_response_body BYTEA,
    o_response_encoding TEXT, o_created_at TIMESTAMPTZ, o_started_at TIMESTAMPTZ, o_expires_at TIMESTAMPTZ,
    o_inserted BOOLEAN)
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    cur idempotency_records_by_day;
BEGIN
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        RAISE EXCEPTION 'idempotency_claim_by_day needs READ COMMITTED isolation, not %',
            current_setting('transaction_isolation');
    END IF;
    -- 1229144399: this layout's lock namespace (the first of the two-int form, which cannot
    -- collide with one-bigint advisory locks such as the migrator's).
    PERFORM pg_advisory_xact_lock(1229144399, hashtext(p_principal || ' ' || p_endpoint || ' ' || p_key));
    SELECT * INTO cur FROM idempotency_records_by_day r
      WHERE r.principal = p_principal AND r.endpoint = p_endpoint AND r.key = p_key;
    IF NOT FOUND THEN
        RETURN QUERY INSERT INTO idempotency_records_by_day AS r
            (principal, endpoint, key, record_id, fingerprint, state, generation, created_at, started_at, expires_at)
          VALUES (p_principal, p_endpoint, p_key, p_record_id, p_fingerprint, 'in_flight', 1, p_now, p_now, p_expires_at)
          RETURNING r.principal, r.endpoint, r.key, r.record_id, r.fingerprint, r.state, r.generation,
            r.response_status, r.response_headers, r.response_body, r.response_encoding, r.created_at,
            r.started_at, r.expires_at, true;
    ELSIF cur.expires_at <= p_now THEN
        -- A compare-and-set on the version read: a concurrent reclaim or completion (which take
        -- no key lock) makes it match nothing, and the caller looks again.
        RETURN QUERY UPDATE idempotency_records_by_day AS r SET record_id = p_record_id,
            fingerprint = p_fingerprint, state = 'in_flight', generation = 1, response_status = NULL,
            response_headers = NULL, response_body = NULL, response_encoding = NULL,
            created_at = p_now, started_at = p_now, expires_at = p_expires_at
          WHERE r.principal = p_principal AND r.endpoint = p_endpoint AND r.key = p_key
            AND r.record_id = cur.record_id AND r.generation = cur.generation AND r.expires_at <= p_now
          RETURNING r.principal, r.endpoint, r.key, r.record_id, r.fingerprint, r.state, r.generation,
            r.response_status, r.response_headers, r.response_body, r.response_encoding, r.created_at,
            r.started_at, r.expires_at, true;
    ELSE
        RETURN QUERY SELECT cur.principal, cur.endpoint, cur.key, cur.record_id, cur.fingerprint, cur.state,
            cur.generation, cur.response_status, cur.response_headers, cur.response_body, cur.response_encoding,
            cur.created_at, cur.started_at, cur.expires_at, false;
    END IF;
END
$$;
