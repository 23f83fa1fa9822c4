-- What an operation acts on, as its service names it (leasebroker: the worker id of a delete),
-- so the reaper reads it from the row instead of parsing the endpoint. NULL for operations begun
-- before this column existed, and for those that name none.
ALTER TABLE fx_operations ADD COLUMN subject TEXT;
