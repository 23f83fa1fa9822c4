//! A durable journal of operation keys, so a rerun after a crash reuses the key of the first run.
//!
//! The journal maps a caller's operation id (`--op-id` in lbctl) to the [`OpKey`] made for it and
//! the fingerprint of the request it was first used with. [`Journal::begin`] writes a new key and
//! commits it with `synchronous=FULL` before it returns, so no attempt ever goes out with a key
//! that a crash could lose. Several processes may share one file: it runs in WAL mode with a busy
//! timeout, and the insert is one atomic `INSERT .. ON CONFLICT DO NOTHING`, so processes racing
//! on one op id all get the key of whichever insert won.
//!
//! The journal holds keys and the responses they got, so on Unix its file (and SQLite's WAL and
//! shared-memory files, which SQLite gives the database file's mode) is created readable by its
//! owner only (0600), and a directory [`Journal::open`] creates is 0700.
//!
//! ```no_run
//! use leasebroker_client::journal::{Journal, RequestFingerprint};
//! # async fn demo() -> Result<(), leasebroker_client::journal::JournalError> {
//! let journal = Journal::open("/tmp/lbctl-journal.db").await?;
//! let fingerprint = RequestFingerprint::of("POST", "/v1/workers", br#"{"image":"base","cpu":2,"memory_gb":4}"#);
//! let key = journal.begin("nightly-ci-worker", &fingerprint).await?; // same key on every rerun
//! // ... send the request with `key`, then:
//! journal.finish("nightly-ci-worker", 201, b"{}").await?;
//! # Ok(()) }
//! ```

use std::fmt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use backon::{ExponentialBuilder, Retryable};
use sha2::{Digest, Sha256};
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions, SqliteSynchronous};

use reqwest::StatusCode;
use reqwest::header::HeaderMap;

use crate::error::Error;
use crate::retry::OpKey;

/// How long a writer waits for another process's lock before failing.
const BUSY_TIMEOUT: Duration = Duration::from_secs(30);

const SCHEMA: &str = "CREATE TABLE IF NOT EXISTS operations (
    op_id          TEXT PRIMARY KEY NOT NULL,
    idem_key       TEXT NOT NULL,
    fingerprint    TEXT NOT NULL,
    created_at     TEXT NOT NULL,
    outcome_status INTEGER,
    outcome_body   BLOB,
    finished_at    TEXT
) STRICT";

/// The SHA-256 of the method, path and body a key was first used with, as `sha256:<hex>`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct RequestFingerprint(String);

impl RequestFingerprint {
    /// Fingerprints a request. `path` is the request path without host or query string.
    pub fn of(method: &str, path: &str, body: &[u8]) -> Self {
        let mut hash = Sha256::new();
        // Neither a method nor a path contains a space or a newline, so the framing is unambiguous.
        hash.update(method.as_bytes());
        hash.update(b" ");
        hash.update(path.as_bytes());
        hash.update(b"\n");
        hash.update(body);
        RequestFingerprint(format!("sha256:{}", hex::encode(hash.finalize())))
    }

    /// The `sha256:<hex>` form.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for RequestFingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Why the journal could not answer.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum JournalError {
    /// The op id is already recorded for a different request: reusing its key would be refused by
    /// the server (or worse, on a server without fingerprints, return the other request's result).
    #[error("operation {op_id:?} was first used with a different request ({recorded}, now {requested})")]
    RequestChanged {
        /// The operation id.
        op_id: String,
        /// The fingerprint recorded on first use.
        recorded: String,
        /// The fingerprint of the request now asked for.
        requested: String,
    },
    /// [`Journal::finish`] for an op id that [`Journal::begin`] never recorded.
    #[error("operation {0:?} is not in the journal")]
    UnknownOp(String),
    /// The stored key is not a valid key (the file was edited or damaged).
    #[error("operation {0:?} has a corrupt key in the journal")]
    Corrupt(String),
    /// The journal's directory or file could not be created.
    #[error("cannot create {}: {error}", path.display())]
    Io {
        /// The directory or file.
        path: PathBuf,
        /// Why.
        error: std::io::Error,
    },
    /// An existing journal file (or its WAL or shared-memory file) is readable or writable by
    /// group or others: the keys and responses in it are not private, and anyone who can write
    /// it could plant an answer.
    #[error(
        "{} is readable or writable by group or others (mode {mode:03o}); make it owner-only with `chmod 600 {}`",
        path.display(),
        path.display()
    )]
    Exposed {
        /// The file.
        path: PathBuf,
        /// Its permission bits.
        mode: u32,
    },
    /// The database failed (cannot open, locked past the busy timeout, disk full).
    #[error("journal database error: {0}")]
    Database(sqlx::Error),
}

impl From<sqlx::Error> for JournalError {
    fn from(error: sqlx::Error) -> Self {
        JournalError::Database(error)
    }
}

/// The outcome recorded by [`Journal::finish`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outcome {
    /// The final HTTP status.
    pub status: u16,
    /// The final response body.
    pub body: Vec<u8>,
    /// When it was recorded (RFC 3339, UTC).
    pub finished_at: String,
}

impl Outcome {
    /// The error the recorded response was, as the client would have reported it live; `None` for
    /// a success (2xx).
    pub fn error(&self) -> Option<Error> {
        let status = StatusCode::from_u16(self.status).ok()?;
        Error::from_response(status, &HeaderMap::new(), &self.body)
    }
}

/// Creates the journal's missing directories (0700) and its file (0600) before SQLite opens it, so
/// the keys and responses in it are never readable by others, not even for a moment. An existing
/// directory keeps the mode it has; an existing file that group or others can read or write is
/// refused ([`JournalError::Exposed`]).
fn create_private(path: &Path) -> Result<(), JournalError> {
    fn io(path: &Path) -> impl FnOnce(std::io::Error) -> JournalError + '_ {
        move |error| JournalError::Io { path: path.to_path_buf(), error }
    }
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty() && !d.exists()) {
        let mut builder = std::fs::DirBuilder::new();
        builder.recursive(true);
        #[cfg(unix)]
        std::os::unix::fs::DirBuilderExt::mode(&mut builder, 0o700);
        builder.create(dir).map_err(io(dir))?;
    }
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create(true).truncate(false);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::mode(&mut options, 0o600);
    options.open(path).map(drop).map_err(io(path))?;
    #[cfg(unix)]
    for suffix in ["", "-wal", "-shm"] {
        use std::os::unix::fs::PermissionsExt;
        let mut file = path.as_os_str().to_owned();
        file.push(suffix);
        let Ok(meta) = std::fs::metadata(&file) else { continue };
        let mode = meta.permissions().mode() & 0o777;
        if mode & 0o077 != 0 {
            return Err(JournalError::Exposed { path: PathBuf::from(file), mode });
        }
    }
    Ok(())
}

/// One journal entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    /// The caller's operation id.
    pub op_id: String,
    /// The key made for it.
    pub key: OpKey,
    /// The fingerprint of the request it was first used with.
    pub fingerprint: RequestFingerprint,
    /// When the key was made (RFC 3339, UTC).
    pub created_at: String,
    /// The outcome, once recorded.
    pub outcome: Option<Outcome>,
}

/// The journal: a SQLite file of op id -> key, request fingerprint and outcome.
#[derive(Debug, Clone)]
pub struct Journal {
    pool: SqlitePool,
    path: PathBuf,
}

/// SQLITE_BUSY and its extended codes (RECOVERY 261, SNAPSHOT 517, TIMEOUT 773).
fn is_busy(error: &sqlx::Error) -> bool {
    let sqlx::Error::Database(db) = error else { return false };
    matches!(db.code().as_deref(), Some("5" | "261" | "517" | "773"))
}

type Row = (String, String, String, Option<i64>, Option<Vec<u8>>, Option<String>);

impl Journal {
    /// Opens (creating it and its directory if needed) the journal at `path`.
    pub async fn open(path: impl AsRef<Path>) -> Result<Self, JournalError> {
        let path = path.as_ref().to_path_buf();
        create_private(&path)?;
        // Processes opening a fresh file together race to switch it to WAL and to create the
        // table, and SQLite answers some of those races with SQLITE_BUSY at once, without waiting
        // on the busy timeout. Opening again a moment later always finds the winner's work done.
        let pool = (|| Self::connect(&path))
            .retry(
                ExponentialBuilder::default()
                    .with_min_delay(Duration::from_millis(5))
                    .with_max_delay(Duration::from_millis(250))
                    .with_total_delay(Some(BUSY_TIMEOUT))
                    .without_max_times()
                    .with_jitter(),
            )
            .sleep(tokio::time::sleep)
            .when(is_busy)
            .await?;
        Ok(Journal { pool, path })
    }

    async fn connect(path: &Path) -> Result<SqlitePool, sqlx::Error> {
        let options = SqliteConnectOptions::new()
            .filename(path)
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            // FULL: a commit is on disk before begin() returns, even across a power cut.
            .synchronous(SqliteSynchronous::Full)
            .busy_timeout(BUSY_TIMEOUT);
        // One connection: a CLI process needs no more, and it keeps each process one SQLite client.
        let pool = SqlitePoolOptions::new().max_connections(1).connect_with(options).await?;
        if let Err(error) = sqlx::query(SCHEMA).execute(&pool).await {
            pool.close().await;
            return Err(error);
        }
        Ok(pool)
    }

    /// The file this journal lives in.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The key for `op_id`: the recorded one if `op_id` was begun before with the same request,
    /// else a new one, committed before this returns.
    ///
    /// Fails with [`JournalError::RequestChanged`] if `op_id` was begun with a different request.
    pub async fn begin(&self, op_id: &str, request: &RequestFingerprint) -> Result<OpKey, JournalError> {
        let fresh = OpKey::new_v4();
        // Insert-or-keep in one statement: of several processes racing here exactly one insert
        // lands, and everyone then reads that row.
        sqlx::query(
            "INSERT INTO operations (op_id, idem_key, fingerprint, created_at)
             VALUES (?1, ?2, ?3, strftime('%Y-%m-%dT%H:%M:%fZ', 'now'))
             ON CONFLICT (op_id) DO NOTHING",
        )
        .bind(op_id)
        .bind(fresh.as_str())
        .bind(request.as_str())
        .execute(&self.pool)
        .await?;
        let entry = self.entry(op_id).await?.ok_or_else(|| JournalError::UnknownOp(op_id.to_owned()))?;
        if entry.fingerprint != *request {
            return Err(JournalError::RequestChanged {
                op_id: op_id.to_owned(),
                recorded: entry.fingerprint.0,
                requested: request.0.clone(),
            });
        }
        Ok(entry.key)
    }

    /// Records the final outcome of `op_id` (overwriting an earlier one).
    pub async fn finish(&self, op_id: &str, status: u16, body: &[u8]) -> Result<(), JournalError> {
        let done = sqlx::query(
            "UPDATE operations
             SET outcome_status = ?2, outcome_body = ?3, finished_at = strftime('%Y-%m-%dT%H:%M:%fZ', 'now')
             WHERE op_id = ?1",
        )
        .bind(op_id)
        .bind(i64::from(status))
        .bind(body)
        .execute(&self.pool)
        .await?;
        if done.rows_affected() == 0 {
            return Err(JournalError::UnknownOp(op_id.to_owned()));
        }
        Ok(())
    }

    /// The entry for `op_id`, if there is one.
    pub async fn entry(&self, op_id: &str) -> Result<Option<Entry>, JournalError> {
        let row: Option<Row> = sqlx::query_as(
            "SELECT idem_key, fingerprint, created_at, outcome_status, outcome_body, finished_at
             FROM operations WHERE op_id = ?1",
        )
        .bind(op_id)
        .fetch_optional(&self.pool)
        .await?;
        let Some((key, fingerprint, created_at, status, body, finished_at)) = row else {
            return Ok(None);
        };
        let key = OpKey::parse(&key).map_err(|_| JournalError::Corrupt(op_id.to_owned()))?;
        let outcome = match (status, finished_at) {
            (Some(status), Some(finished_at)) => Some(Outcome {
                status: u16::try_from(status).map_err(|_| JournalError::Corrupt(op_id.to_owned()))?,
                body: body.unwrap_or_default(),
                finished_at,
            }),
            _ => None,
        };
        Ok(Some(Entry {
            op_id: op_id.to_owned(),
            key,
            fingerprint: RequestFingerprint(fingerprint),
            created_at,
            outcome,
        }))
    }

    /// Closes the database cleanly (checkpointing is left to SQLite).
    pub async fn close(self) {
        self.pool.close().await;
    }
}
