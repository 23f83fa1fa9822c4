-- Operators find a record by its id and list records a page at a time in record-id order
-- (keyset paging). On the partitioned table, so every partition, including those the store
-- creates later, has the index.
CREATE INDEX IF NOT EXISTS idempotency_records_by_day_record_id ON idempotency_records_by_day (record_id);
