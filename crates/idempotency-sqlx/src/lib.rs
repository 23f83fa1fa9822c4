//! SQLite and PostgreSQL stores for idempotency records
