//! [`StoreUrl`]: which store a URL names, parsed once.

use std::fmt;
use std::str::FromStr;

use idempotency_sqlx::{DatabaseUrl, redact};

/// Where idempotency records live, parsed from a URL once at the edge (a flag, a setting).
/// [`Display`](fmt::Display) and [`Debug`] show it [redacted](redact); [`StoreUrl::as_str`]
/// gives the URL to connect with.
///
/// ```
/// use idempotency_stores::StoreUrl;
///
/// let url: StoreUrl = "redis+cluster://:secret@10.0.0.1:6379,10.0.0.2:6379".parse().unwrap();
/// assert!(matches!(url, StoreUrl::RedisCluster(_)));
/// assert_eq!(url.to_string(), "redis+cluster://:***@10.0.0.1:6379,10.0.0.2:6379");
/// assert!(matches!("memory".parse(), Ok(StoreUrl::Memory)));
/// ```
#[derive(Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum StoreUrl {
    /// `memory`: the in-memory store, one process (tests, a single short-lived instance).
    Memory,
    /// `sqlite://PATH` or `postgres://...`: the SQL stores, on a database of their own or one
    /// the service shares.
    Sql(DatabaseUrl),
    /// `redis://[USER:PASSWORD@]HOST:PORT[/DB]` or `rediss://...` (TLS): one Redis server.
    Redis(String),
    /// `redis+cluster://[USER:PASSWORD@]HOST:PORT[,HOST:PORT]...`: a Redis Cluster (any
    /// reachable node serves to discover the rest).
    RedisCluster(String),
}

/// A URL that names no store. Its message lists the forms accepted and shows the URL redacted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "unsupported store URL {shown}: use memory, sqlite://PATH, postgres://..., redis://HOST:PORT, \
     rediss://HOST:PORT or redis+cluster://HOST:PORT[,HOST:PORT]..."
)]
pub struct UnsupportedStoreUrl {
    /// The URL, redacted.
    shown: String,
}

impl StoreUrl {
    /// The URL to connect with (secrets included: never log it; log `self` instead). `memory`
    /// for [`StoreUrl::Memory`].
    pub fn as_str(&self) -> &str {
        match self {
            Self::Memory => "memory",
            Self::Sql(url) => url.as_str(),
            Self::Redis(url) | Self::RedisCluster(url) => url,
        }
    }

    /// True for the Redis forms (one server or a cluster).
    pub fn is_redis(&self) -> bool {
        matches!(self, Self::Redis(_) | Self::RedisCluster(_))
    }
}

impl FromStr for StoreUrl {
    type Err = UnsupportedStoreUrl;

    fn from_str(url: &str) -> Result<Self, Self::Err> {
        let unsupported = || UnsupportedStoreUrl { shown: format!("{:?}", redact(url)) };
        let (scheme, rest) = url.split_once(':').unwrap_or((url, ""));
        let hosts = rest.strip_prefix("//").filter(|hosts| !hosts.is_empty());
        match scheme {
            "memory" if rest.is_empty() => Ok(Self::Memory),
            "redis" | "rediss" if hosts.is_some() => Ok(Self::Redis(url.to_owned())),
            "redis+cluster" if hosts.is_some() => Ok(Self::RedisCluster(url.to_owned())),
            "sqlite" | "postgres" | "postgresql" => url.parse().map(Self::Sql).map_err(|_| unsupported()),
            _ => Err(unsupported()),
        }
    }
}

impl fmt::Display for StoreUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&redact(self.as_str()))
    }
}

impl fmt::Debug for StoreUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Memory => f.write_str("Memory"),
            Self::Sql(url) => f.debug_tuple("Sql").field(url).finish(),
            Self::Redis(url) => f.debug_tuple("Redis").field(&redact(url)).finish(),
            Self::RedisCluster(url) => f.debug_tuple("RedisCluster").field(&redact(url)).finish(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_form_parses_to_its_store() {
        assert_eq!("memory".parse(), Ok(StoreUrl::Memory));
        for url in ["sqlite://records.db", "sqlite:records.db", "sqlite::memory:", "sqlite:///var/lib/x.db?mode=rwc"] {
            assert!(matches!(url.parse(), Ok(StoreUrl::Sql(DatabaseUrl::Sqlite(u))) if u == url), "{url}");
        }
        for url in
            ["postgres://u@h/db", "postgresql://h:5432/db", "postgres://h1,h2/db?target_session_attrs=read-write"]
        {
            assert!(matches!(url.parse(), Ok(StoreUrl::Sql(DatabaseUrl::Postgres(u))) if u == url), "{url}");
        }
        for url in ["redis://127.0.0.1:6379", "redis://u:p@h:6379/2", "rediss://h:6380"] {
            assert_eq!(url.parse(), Ok(StoreUrl::Redis(url.to_owned())), "{url}");
        }
        let cluster = "redis+cluster://10.0.0.1:6379,10.0.0.2:6379";
        assert_eq!(cluster.parse(), Ok(StoreUrl::RedisCluster(cluster.to_owned())));
        for url in ["memory", "sqlite://a.db", "postgres://h/db", "redis://h:1", cluster] {
            let parsed: StoreUrl = url.parse().unwrap();
            assert_eq!(parsed.as_str(), url, "the URL to connect with is the one given");
            assert_eq!(parsed.is_redis(), url.starts_with("redis"), "{url}");
        }
    }

    #[test]
    fn bad_input_is_one_line_listing_the_forms_without_the_password() {
        for url in [
            "",
            "mem",
            "memory://",
            "Memory",
            "redis://",
            "redis:h:6379",
            "redis+cluster://",
            "http://u:secret@h",
            "mysql://u:secret@h/db",
            "postgres://",
            "records.db",
        ] {
            let err = url.parse::<StoreUrl>().expect_err(url).to_string();
            assert!(err.starts_with("unsupported store URL"), "{url:?}: {err}");
            assert!(err.contains("memory, sqlite://PATH, postgres://..., redis://HOST:PORT"), "{url:?}: {err}");
            assert!(!err.contains("secret") && !err.contains('\n'), "{url:?}: {err}");
        }
    }

    #[test]
    fn display_and_debug_hide_secrets() {
        for (url, shown) in [
            ("postgres://app:secret@db/app", "postgres://app:***@db/app"),
            ("redis://default:secret@h:6379", "redis://default:***@h:6379"),
            ("redis+cluster://:secret@a:1,b:2", "redis+cluster://:***@a:1,b:2"),
            ("sqlite://x.db", "sqlite://x.db"),
            ("memory", "memory"),
        ] {
            let parsed: StoreUrl = url.parse().unwrap();
            assert_eq!(parsed.to_string(), shown);
            assert!(!format!("{parsed:?}").contains("secret"), "{parsed:?}");
        }
    }
}
