//! Console sessions: a random id in an HttpOnly, SameSite=Strict cookie, and the server-side map
//! from (the digest of) that id to the session's CSRF token and expiry. The admin token is
//! checked once at login and never stored in the cookie or the map.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::http::{HeaderMap, header};
use rand::RngCore;
use subtle::ConstantTimeEq;

use crate::api::token_digest;

/// The session cookie's name.
pub const COOKIE: &str = "lb_console";

/// How long a session lasts from login.
pub const SESSION_TTL: Duration = Duration::from_secs(8 * 60 * 60);

/// The most sessions kept at once: past it, a login drops the session nearest its end.
pub const MAX_SESSIONS: usize = 256;

/// A session's secrets, as a handler sees them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Session {
    /// The CSRF token every form of this session carries (64 hex digits).
    pub csrf: String,
}

#[derive(Debug)]
struct Entry {
    csrf: String,
    expires: Instant,
}

/// The server-side session map. Keyed by the SHA-256 of the session id, so a lookup's timing says
/// nothing about the ids held.
#[derive(Debug, Clone, Default)]
pub struct Sessions {
    map: Arc<Mutex<HashMap<[u8; 32], Entry>>>,
}

fn random_hex() -> String {
    let mut b = [0u8; 32];
    rand::rng().fill_bytes(&mut b);
    hex::encode(b)
}

impl Sessions {
    /// Starts a session; returns its id (for the cookie) and the session.
    pub fn start(&self) -> (String, Session) {
        let id = random_hex();
        let csrf = random_hex();
        let now = Instant::now();
        let mut map = self.map.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        map.retain(|_, e| e.expires > now);
        if map.len() >= MAX_SESSIONS
            && let Some(oldest) = map.iter().min_by_key(|(_, e)| e.expires).map(|(k, _)| *k)
        {
            map.remove(&oldest);
        }
        map.insert(token_digest(&id), Entry { csrf: csrf.clone(), expires: now + SESSION_TTL });
        (id, Session { csrf })
    }

    /// The live session whose id the request's cookie holds.
    pub fn find(&self, headers: &HeaderMap) -> Option<Session> {
        let id = cookie(headers, COOKIE)?;
        let map = self.map.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        map.get(&token_digest(id)).filter(|e| e.expires > Instant::now()).map(|e| Session { csrf: e.csrf.clone() })
    }

    /// Ends the session whose id the request's cookie holds, if any.
    pub fn end(&self, headers: &HeaderMap) {
        if let Some(id) = cookie(headers, COOKIE) {
            self.map.lock().unwrap_or_else(std::sync::PoisonError::into_inner).remove(&token_digest(id));
        }
    }

    /// How many sessions are held (expired ones included until the next login drops them).
    pub fn len(&self) -> usize {
        self.map.lock().unwrap_or_else(std::sync::PoisonError::into_inner).len()
    }

    /// Whether no session is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Whether `presented` is the session's CSRF token, compared in constant time.
pub fn csrf_matches(session: &Session, presented: Option<&str>) -> bool {
    let presented = presented.unwrap_or_default();
    bool::from(token_digest(presented).ct_eq(&token_digest(&session.csrf))) && !presented.is_empty()
}

/// The value of the cookie `name` in the request's `Cookie` headers (RFC 6265 section 5.4: pairs
/// separated by `; `), if it is there once.
pub fn cookie<'a>(headers: &'a HeaderMap, name: &str) -> Option<&'a str> {
    let mut found = headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|pair| pair.trim().split_once('='))
        .filter(|(n, _)| *n == name)
        .map(|(_, v)| v.trim());
    let first = found.next()?;
    found.next().is_none().then_some(first)
}

/// The `Set-Cookie` value that holds session `id`: HttpOnly, SameSite=Strict, Path=/console,
/// Secure when the console is served over TLS.
pub fn set_cookie(id: &str, secure: bool) -> String {
    let secure = if secure { "; Secure" } else { "" };
    format!("{COOKIE}={id}; Path=/console; HttpOnly; SameSite=Strict; Max-Age={}{secure}", SESSION_TTL.as_secs())
}

/// The `Set-Cookie` value that clears the session cookie.
pub fn clear_cookie(secure: bool) -> String {
    let secure = if secure { "; Secure" } else { "" };
    format!("{COOKIE}=; Path=/console; HttpOnly; SameSite=Strict; Max-Age=0{secure}")
}

#[cfg(test)]
mod tests {
    use axum::http::HeaderValue;

    use super::*;

    fn with_cookies(values: &[&str]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for v in values {
            h.append(header::COOKIE, HeaderValue::from_str(v).expect("value"));
        }
        h
    }

    #[test]
    fn a_session_is_found_by_its_cookie_and_ended_by_logout() {
        let sessions = Sessions::default();
        let (id, session) = sessions.start();
        assert_eq!(id.len(), 64);
        let h = with_cookies(&[&format!("theme=dark; {COOKIE}={id}")]);
        assert_eq!(sessions.find(&h), Some(session.clone()));
        assert_eq!(sessions.find(&with_cookies(&[&format!("{COOKIE}={}", "0".repeat(64))])), None);
        assert_eq!(sessions.find(&with_cookies(&[])), None);
        sessions.end(&h);
        assert_eq!(sessions.find(&h), None);
    }

    #[test]
    fn the_session_map_is_bounded() {
        let sessions = Sessions::default();
        for _ in 0..MAX_SESSIONS + 10 {
            sessions.start();
        }
        assert_eq!(sessions.len(), MAX_SESSIONS);
    }

    #[test]
    fn csrf_tokens_are_compared_whole() {
        let (_, session) = Sessions::default().start();
        assert!(csrf_matches(&session, Some(&session.csrf)));
        assert!(!csrf_matches(&session, Some(&session.csrf[..63])));
        assert!(!csrf_matches(&session, Some("")));
        assert!(!csrf_matches(&session, None));
    }

    #[test]
    fn a_cookie_sent_twice_is_no_cookie() {
        assert_eq!(cookie(&with_cookies(&["a=1; b=2"]), "b"), Some("2"));
        assert_eq!(cookie(&with_cookies(&["a=1", "b=2"]), "b"), Some("2"));
        assert_eq!(cookie(&with_cookies(&["b=1; b=2"]), "b"), None);
        assert_eq!(cookie(&with_cookies(&["ab=1"]), "b"), None);
    }

    #[test]
    fn the_cookie_is_http_only_strict_and_scoped_to_the_console() {
        let c = set_cookie("abc", false);
        assert!(c.starts_with("lb_console=abc; Path=/console; HttpOnly; SameSite=Strict"), "{c}");
        assert!(!c.contains("Secure"));
        assert!(set_cookie("abc", true).ends_with("; Secure"));
        assert!(clear_cookie(false).contains("Max-Age=0"));
    }
}
