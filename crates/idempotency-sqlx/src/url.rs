//! [`DatabaseUrl`]: which of the two SQL databases a URL names, decided once where the URL is
//! read, and [`redact`], which takes a URL's secrets out for messages and logs.

use std::fmt;
use std::str::FromStr;
use std::sync::OnceLock;

use regex::Regex;

/// A SQLite or PostgreSQL URL, parsed once at the edge. [`Display`](fmt::Display) and
/// [`Debug`] show it [redacted](redact); [`DatabaseUrl::as_str`] gives the URL to connect with.
///
/// ```
/// use idempotency_sqlx::DatabaseUrl;
///
/// let url: DatabaseUrl = "postgres://app:secret@db.internal/app".parse().unwrap();
/// assert!(url.is_postgres());
/// assert_eq!(url.to_string(), "postgres://app:***@db.internal/app");
/// assert!("mysql://db/app".parse::<DatabaseUrl>().is_err());
/// ```
#[derive(Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum DatabaseUrl {
    /// `sqlite://PATH`, `sqlite:PATH` or `sqlite::memory:`: one file (or memory), one process.
    Sqlite(String),
    /// `postgres://...` or `postgresql://...`, libpq's multi-host form included. An explicit
    /// `sslmode=prefer` (or `allow`) is read as `sslmode=require`: libpq's meaning (TLS if the
    /// server offers it, else cleartext without a word) lets anyone on the path strip TLS
    /// unnoticed. Say `sslmode=disable` for cleartext.
    Postgres(String),
}

/// A URL that names neither SQLite nor PostgreSQL. Its message shows the URL redacted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unsupported database URL {shown}: use sqlite://PATH or postgres://...")]
pub struct UnsupportedDatabaseUrl {
    /// The URL, redacted.
    shown: String,
}

impl DatabaseUrl {
    /// The URL to connect with (secrets included: never log it; log `self` instead).
    pub fn as_str(&self) -> &str {
        match self {
            Self::Sqlite(url) | Self::Postgres(url) => url,
        }
    }

    /// True for PostgreSQL.
    pub fn is_postgres(&self) -> bool {
        matches!(self, Self::Postgres(_))
    }

    /// True for an SQLite database that lives in memory (`:memory:`, `mode=memory`): no file.
    pub fn is_sqlite_memory(&self) -> bool {
        matches!(self, Self::Sqlite(url) if url.contains(":memory:") || url.contains("mode=memory"))
    }
}

impl FromStr for DatabaseUrl {
    type Err = UnsupportedDatabaseUrl;

    fn from_str(url: &str) -> Result<Self, Self::Err> {
        let (scheme, rest) = url.split_once(':').unwrap_or_default();
        let rest = rest.trim_start_matches('/');
        match scheme {
            _ if rest.is_empty() => Err(UnsupportedDatabaseUrl { shown: format!("{:?}", redact(url)) }),
            "sqlite" => Ok(Self::Sqlite(url.to_owned())),
            "postgres" | "postgresql" => Ok(Self::Postgres(tls_required(url))),
            _ => Err(UnsupportedDatabaseUrl { shown: format!("{:?}", redact(url)) }),
        }
    }
}

impl fmt::Display for DatabaseUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&redact(self.as_str()))
    }
}

impl fmt::Debug for DatabaseUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = if self.is_postgres() { "Postgres" } else { "Sqlite" };
        f.debug_tuple(kind).field(&redact(self.as_str())).finish()
    }
}

/// `sslmode=prefer` and `sslmode=allow` read as `sslmode=require` (see [`DatabaseUrl::Postgres`]).
fn tls_required(url: &str) -> String {
    let Some((base, query)) = url.split_once('?') else { return url.to_owned() };
    let params: Vec<&str> = query
        .split('&')
        .map(|p| if p == "sslmode=prefer" || p == "sslmode=allow" { "sslmode=require" } else { p })
        .collect();
    format!("{base}?{}", params.join("&"))
}

/// The URL or connection string without its secrets, for messages and logs: the password of
/// `scheme://user:password@host`, and the value of any `password`-like parameter, whether in a
/// query (`?password=...&sslpassword=...`) or a libpq `key=value` string (`password='...'`).
pub fn redact(url: &str) -> String {
    static PARAM: OnceLock<Regex> = OnceLock::new();
    let param = PARAM.get_or_init(|| {
        Regex::new(
            r#"(?i)((?:^|[?&;\s])[a-z_]*(?:password|passwd|pwd|secret|token)\s*=\s*)('(?:[^'\\]|\\.)*'?|[^&;\s]*)"#,
        )
        .expect("a valid pattern")
    });
    let url = match (url.find("://"), url.rfind('@')) {
        (Some(s), Some(at)) if at > s => {
            let creds = &url[s + 3..at];
            match creds.split_once(':') {
                Some((user, _)) => format!("{}{user}:***{}", &url[..s + 3], &url[at..]),
                None => url.to_owned(),
            }
        }
        _ => url.to_owned(),
    };
    param.replace_all(&url, "${1}***").into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_form_parses_to_its_database() {
        for url in ["sqlite://leasebroker.db", "sqlite:x.db", "sqlite::memory:", "sqlite://dir/a.db?mode=rwc"] {
            assert!(matches!(url.parse(), Ok(DatabaseUrl::Sqlite(u)) if u == url), "{url}");
        }
        for url in [
            "postgres://u@h/db",
            "postgresql://h:5432/db",
            "postgres://h1:5432,h2:5432/db?target_session_attrs=read-write",
        ] {
            assert!(matches!(url.parse(), Ok(DatabaseUrl::Postgres(u)) if u == url), "{url}");
        }
        assert!("sqlite::memory:".parse::<DatabaseUrl>().unwrap().is_sqlite_memory());
        assert!(!"sqlite://a.db".parse::<DatabaseUrl>().unwrap().is_sqlite_memory());
    }

    #[test]
    fn anything_else_is_refused_in_one_line_without_its_password() {
        for url in ["", "mysql://u:secret@h/db", "sqlite:", "postgres://", "leasebroker.db", "redis://h:6379"] {
            let err = url.parse::<DatabaseUrl>().unwrap_err().to_string();
            assert!(err.contains("use sqlite://PATH or postgres://..."), "{url}: {err}");
            assert!(!err.contains("secret") && !err.contains('\n'), "{err}");
        }
    }

    #[test]
    fn prefer_and_allow_become_require() {
        let url: DatabaseUrl = "postgres://h/db?sslmode=prefer&application_name=x".parse().unwrap();
        assert_eq!(url.as_str(), "postgres://h/db?sslmode=require&application_name=x");
        let url: DatabaseUrl = "postgres://h/db?sslmode=allow".parse().unwrap();
        assert_eq!(url.as_str(), "postgres://h/db?sslmode=require");
        let url: DatabaseUrl = "postgres://h/db?sslmode=disable".parse().unwrap();
        assert_eq!(url.as_str(), "postgres://h/db?sslmode=disable");
    }

    #[test]
    fn display_and_debug_hide_the_password() {
        let url: DatabaseUrl = "postgres://u:secret@h/db?sslpassword=key".parse().unwrap();
        assert_eq!(url.to_string(), "postgres://u:***@h/db?sslpassword=***");
        assert!(!format!("{url:?}").contains("secret"));
        assert!(url.as_str().contains("secret"), "the URL to connect with keeps it");
    }

    #[test]
    fn redacts_passwords() {
        assert_eq!(redact("postgres://u:secret@h/db"), "postgres://u:***@h/db");
        assert_eq!(redact("postgres://u@h/db"), "postgres://u@h/db");
        assert_eq!(redact("sqlite://x.db"), "sqlite://x.db");
        assert_eq!(redact("http://hv:p@ss@h:8090/"), "http://hv:***@h:8090/");
    }

    #[test]
    fn redacts_password_parameters_in_queries_and_libpq_strings() {
        assert_eq!(redact("postgres://u@h/db?password=secret"), "postgres://u@h/db?password=***");
        assert_eq!(
            redact("postgres://h/db?sslmode=require&PASSWORD=secret&sslpassword=key2&application_name=lb"),
            "postgres://h/db?sslmode=require&PASSWORD=***&sslpassword=***&application_name=lb"
        );
        assert_eq!(redact("host=h user=u password=secret dbname=lb"), "host=h user=u password=*** dbname=lb");
        assert_eq!(redact("host=h password = 'se cr\\'et' dbname=lb"), "host=h password = *** dbname=lb");
        assert_eq!(redact("password=secret"), "password=***");
        assert_eq!(redact("http://h/hv?token=abc&x=1"), "http://h/hv?token=***&x=1");
        assert_eq!(redact("host=h dbname=lb"), "host=h dbname=lb");
    }
}
