-- no-transaction
-- Operators find a record by its id and list records a page at a time in record-id order
-- (keyset paging: a page starts after the previous page's last id). Built CONCURRENTLY, so
-- claims and completions go on while an existing table is indexed.
CREATE INDEX CONCURRENTLY IF NOT EXISTS idempotency_records_record_id ON idempotency_records (record_id);
