-- The `uncertain` state, as in the default layout's migration of the same version: the state's
-- CHECK is replaced on the partitioned table, and with it on every partition (they inherit it).
ALTER TABLE idempotency_records_by_day DROP CONSTRAINT IF EXISTS idempotency_records_by_day_state_check;
ALTER TABLE idempotency_records_by_day ADD CONSTRAINT idempotency_records_by_day_state_check
    CHECK (state IN ('in_flight', 'completed', 'failed', 'uncertain'));
