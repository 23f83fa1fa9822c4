//! libpq's multi-host URLs on a sqlx pool: `postgres://h1:5432,h2:5432/db?target_session_attrs=read-write`
//! connects to whichever host is the writable primary and follows it across a failover.
//!
//! sqlx 0.9 takes one host per pool (its URL parser refuses the list) and has no hook on a
//! failed connect, but a pool's connect options can be replaced while it runs
//! ([`Pool::set_connect_options`]). So [`connect_postgres`] parses the host list itself, finds
//! the primary (the first host, in order, that accepts a connection and, with
//! `target_session_attrs=read-write`, answers `transaction_read_only = off`), points the pool at
//! it, and leaves a small task watching it on one connection of its own. When that connection
//! fails or finds the host read-only (demoted), the task looks for the primary again, points the
//! pool at it, and from then on every pooled connection opened before the switch is closed at
//! its next checkout instead of reused. Each new connection checks the session once
//! (`after_connect`), so a connection to a standby is never handed out.
//!
//! A plain one-host URL without `target_session_attrs` takes sqlx's own path, unchanged.

use std::str::FromStr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use sqlx::postgres::{PgConnectOptions, PgConnection, PgPool, PgPoolOptions};
use sqlx::{ConnectOptions, Connection};
use tokio::sync::Notify;

use crate::pool::{PING_IF_IDLE_FOR, bounded_session};

/// How often the watching task asks the primary whether it still is one.
const CHECK_EVERY: Duration = Duration::from_millis(500);
/// How long one host may take to accept a connection while the primary is looked for.
const HOST_CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

/// What `target_session_attrs` asks of a host (libpq's names).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SessionAttrs {
    /// `any` (libpq's default): the first host that accepts a connection.
    Any,
    /// `read-write`: `transaction_read_only` is `off`.
    ReadWrite,
    /// `primary`: not in recovery.
    Primary,
}

/// The hosts of a URL, in order, as connect options, and what each must be.
#[derive(Debug, Clone)]
struct Hosts {
    targets: Vec<PgConnectOptions>,
    attrs: SessionAttrs,
}

/// Why a PostgreSQL URL cannot be used.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum UrlError {
    /// A host of the list is empty or its port is not a number.
    #[error("bad host {0:?} in the host list")]
    BadHost(String),
    /// `target_session_attrs` names a kind of session the stores cannot use.
    #[error("target_session_attrs={0} is not supported: use read-write, primary or any")]
    SessionAttrs(String),
    /// sqlx refused the URL.
    #[error("bad PostgreSQL URL")]
    Sqlx(#[source] sqlx::Error),
}

/// Splits `url` into its host list and a one-host URL built on the first host, without
/// `target_session_attrs`; `None` when there is one host and no `target_session_attrs`.
fn parse(url: &str) -> Result<Option<Hosts>, UrlError> {
    let scheme_end = url.find("://").map_or(0, |i| i + 3);
    let rest = &url[scheme_end..];
    let authority_len = rest.find(['/', '?']).unwrap_or(rest.len());
    let authority = &rest[..authority_len];
    let (userinfo, host_list) = match authority.rfind('@') {
        Some(at) => (&authority[..=at], &authority[at + 1..]),
        None => ("", authority),
    };
    let (path, query) = match rest[authority_len..].split_once('?') {
        Some((path, query)) => (path, Some(query)),
        None => (&rest[authority_len..], None),
    };
    let mut attrs = None;
    let kept: Vec<&str> = query
        .into_iter()
        .flat_map(|q| q.split('&'))
        .filter(|pair| match pair.split_once('=') {
            Some(("target_session_attrs", value)) => {
                attrs = Some(value.to_owned());
                false
            }
            _ => true,
        })
        .collect();
    let hosts: Vec<(String, Option<u16>)> = host_list.split(',').map(split_host).collect::<Result<_, _>>()?;
    if hosts.len() <= 1 && attrs.is_none() {
        return Ok(None);
    }
    let attrs = match attrs.as_deref() {
        None | Some("any") => SessionAttrs::Any,
        Some("read-write") => SessionAttrs::ReadWrite,
        Some("primary") => SessionAttrs::Primary,
        Some(other) => return Err(UrlError::SessionAttrs(other.to_owned())),
    };
    let query = if kept.is_empty() { String::new() } else { format!("?{}", kept.join("&")) };
    // The first host without its port: a host without one gets sqlx's default (PGPORT, else 5432).
    let one = format!("{}{userinfo}{}{path}{query}", &url[..scheme_end], hosts[0].0);
    let base = bounded_session(PgConnectOptions::from_str(&one).map_err(UrlError::Sqlx)?);
    let targets = hosts
        .into_iter()
        .map(|(host, port)| {
            let host = host.trim_start_matches('[').trim_end_matches(']').to_owned();
            base.clone().host(&host).port(port.unwrap_or(base.get_port()))
        })
        .collect();
    Ok(Some(Hosts { targets, attrs }))
}

/// `host`, `host:port`, `[v6]` or `[v6]:port`.
fn split_host(entry: &str) -> Result<(String, Option<u16>), UrlError> {
    let bad = || UrlError::BadHost(entry.to_owned());
    let (host, port) = match entry.strip_prefix('[') {
        Some(v6) => {
            let (addr, after) = v6.split_once(']').ok_or_else(bad)?;
            (format!("[{addr}]"), after.strip_prefix(':'))
        }
        None => match entry.rsplit_once(':') {
            Some((host, port)) => (host.to_owned(), Some(port)),
            None => (entry.to_owned(), None),
        },
    };
    if host.is_empty() || host == "[]" {
        return Err(bad());
    }
    let port = port.map(|p| p.parse::<u16>().map_err(|_| bad())).transpose()?;
    Ok((host, port))
}

/// Whether the session on `conn` is what `attrs` asks for.
async fn suits(conn: &mut PgConnection, attrs: SessionAttrs) -> Result<bool, sqlx::Error> {
    Ok(match attrs {
        SessionAttrs::Any => true,
        SessionAttrs::ReadWrite => {
            sqlx::query_scalar::<_, String>("SHOW transaction_read_only").fetch_one(&mut *conn).await? == "off"
        }
        SessionAttrs::Primary => {
            !sqlx::query_scalar::<_, bool>("SELECT pg_is_in_recovery()").fetch_one(&mut *conn).await?
        }
    })
}

/// The first host, in order, that accepts a connection and suits `attrs`, with that connection.
async fn find(hosts: &Hosts) -> Option<(usize, PgConnection)> {
    for (i, target) in hosts.targets.iter().enumerate() {
        let mut conn = match tokio::time::timeout(HOST_CONNECT_TIMEOUT, target.connect()).await {
            Ok(Ok(conn)) => conn,
            _ => continue,
        };
        match suits(&mut conn, hosts.attrs).await {
            Ok(true) => return Some((i, conn)),
            _ => {
                let _ = conn.close().await;
            }
        }
    }
    None
}

/// What the pool's callbacks and the watching task share.
#[derive(Debug)]
struct Watch {
    hosts: Hosts,
    /// When the pool was last pointed at a host: connections opened before are not reused.
    switched_at: Mutex<Instant>,
    /// Wakes the watching task early: a new connection found its host unsuitable.
    check_now: Notify,
}

/// Connects a pool built with `options` to `url`, a libpq URL with one host or several
/// (`postgres://h1:5432,h2:5432/db?target_session_attrs=read-write`). With several hosts or a
/// `target_session_attrs`, the pool follows the primary as the module docs say (and the
/// `after_connect` and `before_acquire` of `options` are replaced); otherwise this is
/// `options.connect(url)`. Either way every session is bounded ([`crate::bounded_session`]): a
/// process stopped inside a transaction holds its locks for seconds, not until it resumes.
///
/// # Errors
///
/// A URL that cannot be parsed, or no host that accepts a connection and suits
/// `target_session_attrs` (as [`sqlx::Error::PoolTimedOut`] after trying each once).
pub async fn connect_postgres(url: &str, options: PgPoolOptions) -> Result<PgPool, sqlx::Error> {
    let hosts = match parse(url) {
        Ok(Some(hosts)) => hosts,
        Ok(None) => return options.connect_with(bounded_session(PgConnectOptions::from_str(url)?)).await,
        Err(UrlError::Sqlx(e)) => return Err(e),
        Err(e) => return Err(sqlx::Error::Configuration(Box::new(e))),
    };
    let (first, conn) = find(&hosts).await.ok_or(sqlx::Error::PoolTimedOut)?;
    let target = hosts.targets[first].clone();
    let watch = Arc::new(Watch { hosts, switched_at: Mutex::new(Instant::now()), check_now: Notify::new() });
    let (on_connect, on_acquire) = (watch.clone(), watch.clone());
    let pool = options
        .after_connect(move |conn, _| {
            let watch = on_connect.clone();
            Box::pin(async move {
                if suits(conn, watch.hosts.attrs).await? {
                    Ok(())
                } else {
                    watch.check_now.notify_one();
                    Err(sqlx::Error::Protocol("the host is no longer the primary".into()))
                }
            })
        })
        .before_acquire(move |conn, meta| {
            let watch = on_acquire.clone();
            Box::pin(async move {
                let since_switch = watch.switched_at.lock().unwrap_or_else(|e| e.into_inner()).elapsed();
                if meta.age > since_switch {
                    return Ok(false);
                }
                if meta.idle_for >= PING_IF_IDLE_FOR {
                    conn.ping().await?;
                }
                Ok(true)
            })
        })
        .connect_with(target)
        .await?;
    tokio::spawn(follow(pool.clone(), watch, first, conn));
    Ok(pool)
}

/// Watches the primary on a connection of its own; when it fails or is demoted, points `pool` at
/// the new primary. Ends when the pool is closed.
async fn follow(pool: PgPool, watch: Arc<Watch>, mut current: usize, conn: PgConnection) {
    let mut conn = Some(conn);
    while !pool.is_closed() {
        tokio::select! {
            () = tokio::time::sleep(CHECK_EVERY) => {}
            () = watch.check_now.notified() => {}
        }
        if let Some(c) = conn.as_mut()
            && matches!(suits(c, watch.hosts.attrs).await, Ok(true))
        {
            continue;
        }
        if let Some(c) = conn.take() {
            let _ = c.close_hard().await;
            tracing::warn!(
                host = watch.hosts.targets[current].get_host(),
                "lost the PostgreSQL primary; looking for it"
            );
        }
        let Some((found, c)) = find(&watch.hosts).await else { continue };
        pool.set_connect_options(watch.hosts.targets[found].clone());
        *watch.switched_at.lock().unwrap_or_else(|e| e.into_inner()) = Instant::now();
        tracing::warn!(
            from = watch.hosts.targets[current].get_host(),
            to = watch.hosts.targets[found].get_host(),
            port = watch.hosts.targets[found].get_port(),
            "following the PostgreSQL primary; connections opened before are not reused"
        );
        current = found;
        conn = Some(c);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_host_without_session_attrs_is_sqlx_own() {
        assert!(parse("postgres://u:p@h:5432/db?sslmode=disable").expect("parse").is_none());
        assert!(parse("postgres://h/db").expect("parse").is_none());
    }

    #[test]
    fn host_lists_keep_order_ports_and_the_rest() {
        let hosts =
            parse("postgres://u:p%40ss@h1:5433,[::1]:5434,h3/db?sslmode=disable&target_session_attrs=read-write")
                .expect("parse")
                .expect("hosts");
        assert_eq!(hosts.attrs, SessionAttrs::ReadWrite);
        let shown: Vec<(String, u16)> = hosts.targets.iter().map(|t| (t.get_host().to_owned(), t.get_port())).collect();
        assert_eq!(shown, [("h1".into(), 5433), ("::1".into(), 5434), ("h3".into(), 5432)]);
        assert!(hosts.targets.iter().all(|t| t.get_database() == Some("db") && t.get_username() == "u"));
    }

    #[test]
    fn bad_lists_and_session_kinds_are_refused() {
        assert!(matches!(parse("postgres://h1:x,h2/db"), Err(UrlError::BadHost(_))));
        assert!(matches!(parse("postgres://h1,,h2/db"), Err(UrlError::BadHost(_))));
        assert!(matches!(parse("postgres://h1,h2/db?target_session_attrs=standby"), Err(UrlError::SessionAttrs(_))));
        assert_eq!(
            parse("postgres://h1/db?target_session_attrs=primary").expect("ok").expect("hosts").attrs,
            SessionAttrs::Primary
        );
    }
}
