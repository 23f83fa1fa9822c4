//! The `[[route]]` table: method and path templates matched with `matchit` (the router axum is
//! built on), the first matching route winning.

use http::Method;

use crate::config::{ConfigError, RouteConfig};

/// The routes in their order. Each template has a router of its own, so that the order of the
/// file decides (matchit alone would prefer the most specific template, and refuse overlaps).
#[derive(Debug)]
pub struct RouteTable {
    routes: Vec<(Method, matchit::Router<()>)>,
}

/// A request's route: its index in the file, and the values of the template's parameters.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Matched {
    /// The route's position (0: the first `[[route]]`).
    pub index: usize,
    /// `(name, value)` of each `{name}` in the template.
    pub params: Vec<(String, String)>,
}

impl RouteTable {
    /// The table of `routes`; a template matchit refuses is a [`ConfigError`] naming its route.
    pub fn new(routes: &[RouteConfig]) -> Result<Self, ConfigError> {
        let routes = routes
            .iter()
            .enumerate()
            .map(|(i, route)| {
                let mut router = matchit::Router::new();
                router
                    .insert(route.matches.template.as_str(), ())
                    .map_err(|e| ConfigError(format!("match of route {} ({}): {e}", i + 1, route.matches.template)))?;
                Ok((route.matches.method.clone(), router))
            })
            .collect::<Result<_, ConfigError>>()?;
        Ok(Self { routes })
    }

    /// The first route that matches `method` and `path` (normalized, without the query).
    pub fn find(&self, method: &Method, path: &str) -> Option<Matched> {
        self.routes.iter().enumerate().find_map(|(index, (m, router))| {
            if m != method {
                return None;
            }
            let found = router.at(path).ok()?;
            let params = found.params.iter().map(|(k, v)| (k.to_owned(), v.to_owned())).collect();
            Some(Matched { index, params })
        })
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::settings::{Fingerprint, Policy, UncertainMode};

    fn route(m: &str) -> RouteConfig {
        RouteConfig {
            matches: m.parse().expect("method and path"),
            policy: Policy::Required,
            fingerprint: Fingerprint::Raw,
            on_uncertain: UncertainMode::Hold,
            probe: None,
            uncertain_on_5xx: false,
            retention: Duration::from_secs(3600),
        }
    }

    #[test]
    fn the_first_matching_route_wins_and_its_parameters_are_kept() {
        let table = RouteTable::new(&[
            route("POST /orders/{id}/cancel"),
            route("POST /orders/{*rest}"),
            route("PUT /orders/{id}"),
        ])
        .expect("valid");
        let cancel = table.find(&Method::POST, "/orders/o-1/cancel").expect("matches");
        assert_eq!(cancel, Matched { index: 0, params: vec![("id".into(), "o-1".into())] });
        assert_eq!(table.find(&Method::POST, "/orders/o-1").map(|m| m.index), Some(1));
        assert_eq!(table.find(&Method::PUT, "/orders/o-1").map(|m| m.index), Some(2));
        assert_eq!(table.find(&Method::DELETE, "/orders/o-1"), None, "the method is part of the match");
        assert_eq!(table.find(&Method::PUT, "/orders/o-1/cancel"), None);
    }

    #[test]
    fn a_template_matchit_refuses_names_its_route() {
        let e = RouteTable::new(&[route("POST /a"), route("POST /orders/{id")]).expect_err("unclosed parameter");
        assert!(e.0.starts_with("match of route 2 (/orders/{id)"), "{e}");
    }
}
