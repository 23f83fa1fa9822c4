-- Every side effect's intent and every operation's mark now live in the effect ledger
-- (idempotency-effects: fx_operations, fx_intents, fx_owned, created by its own migrations,
-- which run before these). The rows of an operation in progress move there, so an upgrade in
-- the middle of a create keeps its intent: a retry after the upgrade still reconciles by tag
-- instead of booting again.
--
-- lb_operations.rolled_back becomes fx_operations.mark (same numbers: 0 live, 1 rolling back,
-- 2 rolled back, 3 finished; a marked row's last_attempt_at was its mark's time). An intent's
-- last_attempt_at was its send stamp; a boot's VM is kept by its finished operation (keeps = 1).
INSERT INTO fx_operations (op_id, kind, principal, endpoint, idem_key, record_id, mark, last_attempt_at,
                           next_check_at, marked_at)
SELECT op_id, kind, principal, endpoint, idem_key, record_id, rolled_back, last_attempt_at, next_check_at,
       CASE WHEN rolled_back >= 2 THEN last_attempt_at ELSE 0 END
FROM lb_operations
WHERE true -- (SQLite reads an upsert's SELECT only with a WHERE)
ON CONFLICT (op_id) DO NOTHING;

INSERT INTO fx_intents (intent_id, op_id, effect, keeps, state, resource_id, created_at, sent_at)
SELECT intent_id, op_id, kind, CASE WHEN kind = 'boot' THEN 1 ELSE 0 END, state, vm_id, created_at, last_attempt_at
FROM lb_intents
WHERE op_id IS NOT NULL
ON CONFLICT (intent_id) DO NOTHING;

DROP TABLE lb_intents;
DROP TABLE lb_operations;

-- A firmware flash's BMC call is an intent in the ledger too (effect 'flash', long-running: the
-- ledger's watcher follows it once accepted), under the ledger operation ledger_op (the flash
-- request's derived sub-key 'op'). lb_flash_operations keeps the operation as the API shows it;
-- its intent column now says only 'accepted' (the BMC took the flash) or 'unsent' (not yet).
-- A running flash moves with its call: its operation row in the ledger carries no record scope
-- (the old table kept none), so the reaper leaves it to the flash pass, which settles it as
-- before; a retry of its request is answered from the operation once that pass settled it.
ALTER TABLE lb_flash_operations ADD COLUMN ledger_op TEXT;
UPDATE lb_flash_operations SET ledger_op = op_id;
INSERT INTO fx_operations (op_id, kind, principal, endpoint, idem_key, record_id, mark, last_attempt_at,
                           next_check_at, marked_at)
SELECT op_id, 'flash', '', '', '', '', CASE WHEN intent = 'accepted' THEN 3 ELSE 0 END,
       CASE WHEN sent_at > created_at THEN sent_at ELSE created_at END, 9223372036854775807, created_at
FROM lb_flash_operations
WHERE state = 'running'
ON CONFLICT (op_id) DO NOTHING;
INSERT INTO fx_intents (intent_id, op_id, effect, keeps, state, resource_id, created_at, sent_at)
SELECT tag, op_id, 'flash', 0, intent, node_id, created_at, sent_at
FROM lb_flash_operations
WHERE state = 'running' AND intent IN ('pending', 'accepted')
ON CONFLICT (intent_id) DO NOTHING;
UPDATE lb_flash_operations SET intent = 'unsent' WHERE intent = 'pending';
DROP INDEX lb_flash_running;
ALTER TABLE lb_flash_operations DROP COLUMN sent_at;
ALTER TABLE lb_flash_operations DROP COLUMN watcher;
ALTER TABLE lb_flash_operations DROP COLUMN watch_until;
CREATE INDEX lb_flash_unaccepted ON lb_flash_operations (op_id) WHERE state = 'running' AND intent <> 'accepted';
