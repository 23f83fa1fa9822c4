//! The versioned migrations, with a history table of their own.

use sqlx::migrate::Migrator;

/// The table where these migrators record which versions they applied. It is not sqlx's default
/// `_sqlx_migrations`, so a service's own migrator can share the database (see the crate docs).
pub const MIGRATIONS_TABLE: &str = "_idempotency_migrations";

#[cfg(feature = "sqlite")]
/// The SQLite migrations (`migrations/sqlite/`), recording their history in [`MIGRATIONS_TABLE`].
pub fn sqlite_migrator() -> Migrator {
    let mut m = sqlx::migrate!("./migrations/sqlite");
    // "dangerous" only when an existing database's history lives in another table; ours always
    // lived here.
    m.dangerous_set_table_name(MIGRATIONS_TABLE);
    m
}

#[cfg(feature = "postgres")]
/// The PostgreSQL migrations (`migrations/postgres/`), recording their history in
/// [`MIGRATIONS_TABLE`].
pub fn postgres_migrator() -> Migrator {
    let mut m = sqlx::migrate!("./migrations/postgres");
    m.dangerous_set_table_name(MIGRATIONS_TABLE);
    m
}
