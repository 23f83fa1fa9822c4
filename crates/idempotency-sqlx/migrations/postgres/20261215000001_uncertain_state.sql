-- The `uncertain` state: a request sent on (by a gateway) whose outcome is unknown. Stored like
-- `failed` (no response), never run again on a guess; see `idempotency::RecordState::Uncertain`.
-- The CHECK of the first migration named the states; it is replaced by one that adds this one.
-- Processes of the previous version never write it, so a rolling upgrade may run them side by
-- side (they read an uncertain row as corrupt: upgrade every replica before enabling a gateway).
ALTER TABLE idempotency_records DROP CONSTRAINT IF EXISTS idempotency_records_state_check;
ALTER TABLE idempotency_records ADD CONSTRAINT idempotency_records_state_check
    CHECK (state IN ('in_flight', 'completed', 'failed', 'uncertain'));
