//! The keyed routes the service itself reasons about beyond their response: a create, whose body
//! may carry AIP-155's `request_id`, and a firmware flash, whose record starts an operation. They
//! are recognised with the router axum is built on (matchit), from a request's method and path or
//! from a record's endpoint (`POST /admin/v1/nodes/node-0003/firmware`), never by cutting strings.

use std::sync::LazyLock;

use axum::http::Method;

/// A keyed route of the service's own.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyedRoute {
    /// `POST /v1/workers`.
    CreateWorker,
    /// `POST /admin/v1/nodes/{node_id}/firmware`.
    FlashFirmware,
}

/// The routes, by path template (the method is POST for both).
static ROUTES: LazyLock<matchit::Router<KeyedRoute>> = LazyLock::new(|| {
    let mut router = matchit::Router::new();
    for (template, route) in
        [("/v1/workers", KeyedRoute::CreateWorker), ("/admin/v1/nodes/{node_id}/firmware", KeyedRoute::FlashFirmware)]
    {
        router.insert(template, route).expect("the templates are distinct and well formed");
    }
    router
});

impl KeyedRoute {
    /// The route of a request, if it is one of these.
    pub fn of(method: &Method, path: &str) -> Option<Self> {
        if method != Method::POST {
            return None;
        }
        ROUTES.at(path).ok().map(|found| *found.value)
    }

    /// The route of a record's endpoint (`METHOD /path`, as the layer scopes records).
    pub fn of_endpoint(endpoint: &str) -> Option<Self> {
        let (method, path) = endpoint.split_once(' ')?;
        Self::of(&method.parse().ok()?, path)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_two_routes_are_told_by_method_and_template() {
        assert_eq!(KeyedRoute::of(&Method::POST, "/v1/workers"), Some(KeyedRoute::CreateWorker));
        assert_eq!(
            KeyedRoute::of(&Method::POST, "/admin/v1/nodes/node-0003/firmware"),
            Some(KeyedRoute::FlashFirmware)
        );
        assert_eq!(KeyedRoute::of_endpoint("POST /admin/v1/nodes/node-0003/firmware"), Some(KeyedRoute::FlashFirmware));
        assert_eq!(KeyedRoute::of_endpoint("POST /v1/workers"), Some(KeyedRoute::CreateWorker));
    }

    #[test]
    fn anything_else_is_none() {
        for (method, path) in [
            (Method::GET, "/v1/workers"),
            (Method::DELETE, "/admin/v1/nodes/node-0003/firmware"),
            (Method::POST, "/v1/workers/wkr-1/reboot"),
            // The string test this replaces took this one for the firmware route; axum's router
            // does not route it there.
            (Method::POST, "/admin/v1/nodes/a/b/firmware"),
            (Method::POST, "/admin/v1/nodes/node-0003/firmware/x"),
        ] {
            assert_eq!(KeyedRoute::of(&method, path), None, "{method} {path}");
        }
        for endpoint in ["", "POST", "post /v1/workers x", "BAD METHOD /v1/workers"] {
            assert_eq!(KeyedRoute::of_endpoint(endpoint), None, "{endpoint:?}");
        }
    }
}
