-- Operators find a record by its id and list records a page at a time in record-id order
-- (keyset paging: a page starts after the previous page's last id).
CREATE INDEX IF NOT EXISTS idempotency_records_record_id ON idempotency_records (record_id);
