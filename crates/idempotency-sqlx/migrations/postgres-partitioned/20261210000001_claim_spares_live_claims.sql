-- The claim function again, with the stale cutoff as an eighth argument: an expired record is
-- replaced only when it is not in flight under a live claim (started after `p_stale_before`; a
-- NULL cutoff means no claim can be that old), so a key never runs twice because its record
-- expired under a running attempt (SPEC 1.3). The store also gives every record in flight an
-- expiry no earlier than its claim plus the in-flight TTL; this is the check behind that rule.
--
-- A new overload beside the seven-argument function of 20261201000001, which is left for
-- processes of the previous version during a rolling upgrade; nothing of this version calls it.
CREATE OR REPLACE FUNCTION idempotency_claim_by_day(
    p_principal TEXT, p_endpoint TEXT, p_key TEXT, p_record_id BYTEA, p_fingerprint TEXT,
    p_now TIMESTAMPTZ, p_expires_at TIMESTAMPTZ, p_stale_before TIMESTAMPTZ)
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
    -- The same key lock as the seven-argument function's, so the two serialise with each other.
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
    ELSIF cur.expires_at <= p_now AND (cur.state <> 'in_flight' OR cur.started_at <= p_stale_before) THEN
        -- A compare-and-set on the version read: a concurrent reclaim, heartbeat or completion
        -- (which take no key lock) makes it match nothing, and the caller looks again.
        RETURN QUERY UPDATE idempotency_records_by_day AS r SET record_id = p_record_id,
            fingerprint = p_fingerprint, state = 'in_flight', generation = 1, response_status = NULL,
            response_headers = NULL, response_body = NULL, response_encoding = NULL,
            created_at = p_now, started_at = p_now, expires_at = p_expires_at
          WHERE r.principal = p_principal AND r.endpoint = p_endpoint AND r.key = p_key
            AND r.record_id = cur.record_id AND r.generation = cur.generation AND r.expires_at <= p_now
            AND (r.state <> 'in_flight' OR r.started_at <= p_stale_before)
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
