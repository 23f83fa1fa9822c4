-- Operators find a record by its id and list records a page at a time in record-id order
-- (keyset paging: a page starts after the previous page's last id).
--
-- Not CONCURRENTLY: a concurrent build waits for every open transaction, and the migrator of the
-- service sharing this database holds one while it waits for the migration lock this migrator
-- holds, a deadlock (seen in `migrators::postgres_migrators_coexist_in_either_order_and_at_once`).
-- A plain build holds writes to the table while it runs: on a large existing table, build the
-- index CONCURRENTLY by hand before upgrading, and this statement then finds it.
CREATE INDEX IF NOT EXISTS idempotency_records_record_id ON idempotency_records (record_id);
