//! The versioned migrations, with a history table of their own.
//!
//! The SQL files are compiled in with `include_str!` and turned into a [`Migrator`] the way
//! `sqlx::migrate!` would (same versions, descriptions and checksums, so a database migrated by
//! either is up to date for the other), without sqlx's `macros` feature: that feature builds both
//! database drivers a second time, for the compiler's proc macro.

use std::borrow::Cow;

use sqlx::SqlSafeStr;
use sqlx::migrate::{Migration, MigrationType, Migrator};

/// The table where these migrators record which versions they applied. It is not sqlx's default
/// `_sqlx_migrations`, so a service's own migrator can share the database (see the crate docs).
pub const MIGRATIONS_TABLE: &str = "_idempotency_migrations";

/// The `(file name, SQL)` of each file in a migrations directory, compiled in:
/// `embedded_migrations!("migrations/sqlite", "0001_domain.sql", "0002_operations.sql")`, with
/// the directory relative to the calling crate's manifest.
#[macro_export]
macro_rules! embedded_migrations {
    ($dir:literal, $($file:literal),+ $(,)?) => {
        &[$(($file, include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/", $dir, "/", $file)))),+]
    };
}

/// A migration file name that is not `<VERSION>_<DESCRIPTION>.sql`.
#[derive(Debug, thiserror::Error)]
#[error("migration file name {0:?} is not <VERSION>_<DESCRIPTION>.sql")]
pub struct BadMigrationName(pub &'static str);

/// The [`Migrator`] of `files` (from [`embedded_migrations!`]), read the way `sqlx::migrate!`
/// reads a directory: version and description from `<VERSION>_<DESCRIPTION>.sql` (underscores in
/// the description become spaces), no transaction when the file starts with
/// `-- no-transaction`, and the checksum of the SQL text. Its history table is sqlx's default:
/// set your own with `Migrator::dangerous_set_table_name`.
pub fn embedded_migrator(files: &[(&'static str, &'static str)]) -> Result<Migrator, BadMigrationName> {
    let migrations = files
        .iter()
        .map(|&(name, sql)| {
            let (version, rest) = name.split_once('_').ok_or(BadMigrationName(name))?;
            let version: i64 = version.parse().map_err(|_| BadMigrationName(name))?;
            let description = rest.strip_suffix(".sql").ok_or(BadMigrationName(name))?.replace('_', " ");
            let no_tx = sql.starts_with("-- no-transaction");
            Ok(Migration::new(
                version,
                Cow::Owned(description),
                MigrationType::Simple,
                sqlx::AssertSqlSafe(sql).into_sql_str(),
                no_tx,
            ))
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok(Migrator::with_migrations(migrations))
}

/// `files` recording their history in [`MIGRATIONS_TABLE`].
fn ours(files: &[(&'static str, &'static str)]) -> Migrator {
    let mut migrator = embedded_migrator(files).expect("the file names are checked by a test");
    // "dangerous" only when an existing database's history lives in another table; ours always
    // lived here.
    migrator.dangerous_set_table_name(MIGRATIONS_TABLE);
    migrator
}

#[cfg(feature = "sqlite")]
/// The SQLite migrations (`migrations/sqlite/`), recording their history in [`MIGRATIONS_TABLE`].
pub fn sqlite_migrator() -> Migrator {
    ours(embedded_migrations!(
        "migrations/sqlite",
        "20250101000001_idempotency_records.sql",
        "20261202000001_record_id_index.sql",
        "20261215000001_uncertain_state.sql",
    ))
}

#[cfg(feature = "postgres")]
/// The PostgreSQL migrations (`migrations/postgres/`), recording their history in
/// [`MIGRATIONS_TABLE`].
pub fn postgres_migrator() -> Migrator {
    ours(embedded_migrations!(
        "migrations/postgres",
        "20250101000001_idempotency_records.sql",
        "20261202000001_record_id_index.sql",
        "20261215000001_uncertain_state.sql",
    ))
}

/// For tests: what sqlx itself reads from `dir` (every file, as `Migrator::new` resolves a
/// directory), as `(version, description, checksum, no_tx)`, next to the same of `migrator`.
#[doc(hidden)]
pub async fn compare_with_directory(
    migrator: &Migrator,
    dir: &std::path::Path,
) -> (Vec<(i64, String, Vec<u8>, bool)>, Vec<(i64, String, Vec<u8>, bool)>) {
    let summary = |m: &Migrator| {
        m.iter().map(|m| (m.version, m.description.to_string(), m.checksum.to_vec(), m.no_tx)).collect::<Vec<_>>()
    };
    let from_dir = Migrator::new(dir.to_path_buf()).await.expect("sqlx reads the directory");
    (summary(migrator), summary(&from_dir))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bad_file_name_is_refused() {
        for name in ["nounderscore.sql", "x_y.sql", "1_no_suffix.txt"] {
            assert!(embedded_migrator(&[(name, "SELECT 1")]).is_err(), "{name}");
        }
        let m = embedded_migrator(&[("7_two_words.sql", "-- no-transaction\nSELECT 1")]).unwrap();
        let only = m.iter().next().unwrap();
        assert_eq!((only.version, only.description.as_ref(), only.no_tx), (7, "two words", true));
    }

    /// The compiled-in lists hold every file of their directory, read exactly as sqlx reads it
    /// (a file added to the directory but not to the list fails here).
    #[tokio::test]
    async fn the_embedded_migrations_are_the_directories() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
        #[cfg(feature = "sqlite")]
        {
            let (ours, sqlx) = compare_with_directory(&sqlite_migrator(), &root.join("migrations/sqlite")).await;
            assert_eq!(ours, sqlx);
        }
        #[cfg(feature = "postgres")]
        {
            let (ours, sqlx) = compare_with_directory(&postgres_migrator(), &root.join("migrations/postgres")).await;
            assert_eq!(ours, sqlx);
            let partitioned = crate::postgres_partitioned_migrator();
            let (ours, sqlx) =
                compare_with_directory(&partitioned, &root.join("migrations/postgres-partitioned")).await;
            assert_eq!(ours, sqlx);
        }
    }
}
