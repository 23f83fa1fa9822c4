-- Compact marks and the reaper's schedule (issue 24).
--
-- rolled_back gains a fourth value: 3, the operation finished (a create made its worker, a
-- reboot was done, or the reaper found its record completed). The row is kept, its intents
-- deleted, until the retention passes after the mark (last_attempt_at then holds the mark's
-- time), so an attempt that outlived its claim can never start a finished operation again.
--
-- next_check_at: when the reaper looks at the row next. Each attempt sets it to the end of its
-- settle window; a row the reaper waits on is put off to when it may change, so a waiting row
-- never comes up again before its time and never delays another.
ALTER TABLE lb_operations ADD COLUMN next_check_at BIGINT NOT NULL DEFAULT 0;
UPDATE lb_operations SET next_check_at = last_attempt_at;
CREATE INDEX lb_operations_due ON lb_operations (next_check_at) WHERE rolled_back < 2;

-- The inventory sweep asks, for each VM carrying the service's tag, whether a worker runs on it.
CREATE INDEX lb_workers_by_vm ON lb_workers (vm_id);
