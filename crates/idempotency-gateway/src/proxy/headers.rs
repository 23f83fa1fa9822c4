//! What a proxy does to headers (RFC 9110 7.6): hop-by-hop headers removed both ways, and the
//! client's address and scheme added for the upstream (`Forwarded`, RFC 7239, and the
//! `X-Forwarded-*` headers most frameworks read).

use std::net::{IpAddr, SocketAddr};

use http::header::{CONNECTION, FORWARDED, HOST};
use http::{HeaderMap, HeaderName, HeaderValue};

/// The hop-by-hop headers of RFC 9110 7.6.1, and the ones older proxies used.
const HOP_BY_HOP: [&str; 9] = [
    "connection",
    "keep-alive",
    "proxy-connection",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
];

const X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
const X_FORWARDED_PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");
const X_FORWARDED_HOST: HeaderName = HeaderName::from_static("x-forwarded-host");

/// Removes the hop-by-hop headers: the standard ones and those the `Connection` header names.
pub fn remove_hop_by_hop(headers: &mut HeaderMap) {
    let named: Vec<HeaderName> = headers
        .get_all(CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|name| HeaderName::from_bytes(name.trim().as_bytes()).ok())
        .collect();
    for name in named {
        headers.remove(name);
    }
    for name in HOP_BY_HOP {
        headers.remove(name);
    }
}

/// Prepares a client's request headers for the upstream: hop-by-hop headers removed, `Host`
/// removed (the client sets the upstream's), and `Forwarded`, `X-Forwarded-For`,
/// `X-Forwarded-Proto` and `X-Forwarded-Host` added for a client at `peer` that reached the
/// gateway over `proto`. Earlier proxies' `Forwarded` and `X-Forwarded-For` are kept, this hop
/// appended.
pub fn for_upstream(headers: &mut HeaderMap, peer: Option<SocketAddr>, proto: &'static str) {
    remove_hop_by_hop(headers);
    let host = headers.remove(HOST);
    let node = peer.map_or_else(|| "unknown".to_owned(), |p| forwarded_node(p.ip()));
    let mut forwarded = format!("for={node};proto={proto}");
    if let Some(host) = host.as_ref().and_then(|h| h.to_str().ok()) {
        forwarded.push_str(&format!(";host=\"{}\"", host.replace(['"', '\\'], "")));
    }
    if let Ok(v) = HeaderValue::from_str(&forwarded) {
        headers.append(FORWARDED, v);
    }
    if let Some(peer) = peer {
        let earlier: Vec<&str> = headers.get_all(&X_FORWARDED_FOR).iter().filter_map(|v| v.to_str().ok()).collect();
        let mut chain = earlier.join(", ");
        if !chain.is_empty() {
            chain.push_str(", ");
        }
        chain.push_str(&peer.ip().to_canonical().to_string());
        if let Ok(v) = HeaderValue::from_str(&chain) {
            headers.insert(X_FORWARDED_FOR, v);
        }
    }
    headers.insert(X_FORWARDED_PROTO, HeaderValue::from_static(proto));
    if let Some(host) = host {
        headers.insert(X_FORWARDED_HOST, host);
    }
}

/// A `Forwarded` node (RFC 7239 6): an IPv4 address as is, an IPv6 one quoted in brackets.
fn forwarded_node(ip: IpAddr) -> String {
    match ip.to_canonical() {
        IpAddr::V4(v4) => v4.to_string(),
        IpAddr::V6(v6) => format!("\"[{v6}]\""),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn map(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(HeaderName::from_bytes(k.as_bytes()).expect("name"), HeaderValue::from_str(v).expect("value"));
        }
        h
    }

    #[test]
    fn hop_by_hop_headers_and_those_connection_names_are_removed() {
        let mut h = map(&[
            ("connection", "keep-alive, x-private"),
            ("x-private", "1"),
            ("keep-alive", "timeout=5"),
            ("transfer-encoding", "chunked"),
            ("upgrade", "h2c"),
            ("content-type", "application/json"),
            ("authorization", "Bearer t"),
        ]);
        remove_hop_by_hop(&mut h);
        // A HeaderMap's order after removals is not the insertion order: compare as a set.
        let mut left: Vec<&str> = h.keys().map(HeaderName::as_str).collect();
        left.sort_unstable();
        assert_eq!(left, ["authorization", "content-type"]);
    }

    #[test]
    fn the_client_is_named_to_the_upstream_after_earlier_proxies() {
        let mut h = map(&[("host", "api.example"), ("x-forwarded-for", "10.0.0.9"), ("forwarded", "for=10.0.0.9")]);
        for_upstream(&mut h, Some("192.0.2.7:5555".parse().expect("addr")), "http");
        assert_eq!(h.get(HOST), None, "the upstream's host is set by the client");
        assert_eq!(h["x-forwarded-for"], "10.0.0.9, 192.0.2.7");
        assert_eq!(h["x-forwarded-proto"], "http");
        assert_eq!(h["x-forwarded-host"], "api.example");
        let forwarded: Vec<&str> = h.get_all(FORWARDED).iter().map(|v| v.to_str().expect("ascii")).collect();
        assert_eq!(forwarded, ["for=10.0.0.9", "for=192.0.2.7;proto=http;host=\"api.example\""]);

        let mut v6 = HeaderMap::new();
        for_upstream(&mut v6, Some("[2001:db8::1]:80".parse().expect("addr")), "http");
        assert_eq!(v6[FORWARDED], "for=\"[2001:db8::1]\";proto=http");
        assert_eq!(v6["x-forwarded-for"], "2001:db8::1");
    }
}
