-- The fence between an abandoned create's rollback and an attempt of it that still runs (issue 11).
--
-- rolled_back: 0 while the operation is live; 1 once the reaper took it for a rollback; 2 when the
-- rollback is done (the row is kept until the retention passes, so that an attempt whose claim
-- went stale while it waited can never start the operation again). Every step of a create checks
-- it in its own transaction before it takes, calls or shows anything.
ALTER TABLE lb_operations ADD COLUMN rolled_back SMALLINT NOT NULL DEFAULT 0;
