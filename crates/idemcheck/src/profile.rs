//! Profiles: what a kind of implementation promises, and the requests that exercise it.

use serde_json::{Value, json};

/// A request the kit sends: method, path (on the target's URL), JSON body, and which `--token`
/// it carries (0: the first).
#[derive(Debug, Clone)]
pub(crate) struct Req {
    pub(crate) method: String,
    pub(crate) path: String,
    pub(crate) body: Option<Value>,
    pub(crate) token: usize,
}

impl Req {
    pub(crate) fn new(method: &str, path: &str, body: Option<Value>) -> Self {
        Self { method: method.to_owned(), path: path.to_owned(), body, token: 0 }
    }

    /// `'POST /path'` and a JSON body, as `--route` and `--body` give them.
    pub(crate) fn parse(route: &str, body: Option<&str>) -> Result<Self, String> {
        let (method, path) =
            route.trim().split_once(' ').ok_or_else(|| format!("--route {route:?}: expected 'METHOD /path'"))?;
        let method = method.to_ascii_uppercase();
        if !["POST", "PUT", "PATCH", "DELETE"].contains(&method.as_str()) {
            return Err(format!("--route {route:?}: the method must be POST, PUT, PATCH or DELETE"));
        }
        let path = path.trim();
        if !path.starts_with('/') {
            return Err(format!("--route {route:?}: the path must start with /"));
        }
        let body = match body {
            Some(b) => Some(serde_json::from_str(b).map_err(|e| format!("--body: not JSON: {e}"))?),
            None => None,
        };
        Ok(Self::new(&method, path, body))
    }

    /// The same request with another body: the variant a mismatch is made of.
    pub(crate) fn variant(&self) -> Self {
        let body = match &self.body {
            Some(Value::Object(map)) => {
                let mut map = map.clone();
                map.insert("idemcheck_variant".into(), json!(1));
                Some(Value::Object(map))
            }
            Some(other) => Some(json!({ "idemcheck_variant": other })),
            None => Some(json!({ "idemcheck_variant": 1 })),
        };
        Self { body, ..self.clone() }
    }

    pub(crate) fn with_token(mut self, token: usize) -> Self {
        self.token = token;
        self
    }

    pub(crate) fn describe(&self) -> String {
        format!("{} {}", self.method, self.path)
    }
}

/// How executions are counted: a GET whose answer holds a number, or an array whose length
/// counts (followed page by page through a cursor).
#[derive(Debug, Clone)]
pub(crate) struct Counter {
    pub(crate) path: String,
    /// A JSON pointer to the array (or number) that counts.
    pub(crate) pointer: String,
    /// A JSON pointer to the next page's cursor, and the query parameter that takes it.
    pub(crate) next: Option<(String, String)>,
    pub(crate) describe: String,
}

impl Counter {
    /// `PATH` or `PATH#POINTER`, as `--counter` gives it: a GET path on the target and a JSON
    /// pointer into its answer (none: the whole answer).
    pub(crate) fn parse(arg: &str) -> Result<Self, String> {
        let (path, pointer) = arg.split_once('#').unwrap_or((arg, ""));
        if !path.starts_with('/') || path.contains(char::is_whitespace) {
            return Err(format!("--counter {arg:?}: expected PATH or PATH#POINTER, the path starting with /"));
        }
        if !(pointer.is_empty() || pointer.starts_with('/')) {
            return Err(format!("--counter {arg:?}: the JSON pointer after # must start with / (e.g. #/count)"));
        }
        let at = if pointer.is_empty() { String::new() } else { format!(" at {pointer}") };
        Ok(Self { path: path.to_owned(), pointer: pointer.to_owned(), next: None, describe: format!("GET {path}{at}") })
    }
}

/// What a profile expects of the target.
#[derive(Debug, Clone)]
pub(crate) struct Profile {
    pub(crate) name: &'static str,
    pub(crate) about: &'static str,
    /// The status of a key reused with another request.
    pub(crate) mismatch_status: u16,
    /// A request without a key is refused (`400`), rather than run unprotected.
    pub(crate) key_required: bool,
    /// Keys in the Structured Field String form (`"..."`) are read as such.
    pub(crate) sf_keys: bool,
    /// The header (lower case) and value that mark a replay.
    pub(crate) replay_header: Option<(&'static str, &'static str)>,
    /// Errors are RFC 9457 problems whose `type` ends in the names of docs/protocol.md.
    pub(crate) problem_types: bool,
    /// `Idempotency-Key-Expires` on responses with a record.
    pub(crate) expires_header: bool,
    /// `Prefer: wait=N` attaches to the request in flight.
    pub(crate) prefer_wait: bool,
    /// The body of a request is fingerprinted with its query string and content type too.
    pub(crate) full_fingerprint: bool,
    /// Every answer to a protected request that stores nothing (5xx) is run again on retry.
    pub(crate) primary: Option<Req>,
    pub(crate) secondary: Option<Req>,
    pub(crate) counter: Option<Counter>,
    /// A request answered with a 4xx that is stored (a permanent decision).
    pub(crate) stored_error: Option<Req>,
    /// A request answered with a 5xx.
    pub(crate) server_error: Option<Req>,
    /// A long-running operation: `202` + `Location`.
    pub(crate) long_running: Option<Req>,
    /// A created resource can be deleted at its `Location` (DELETE, with a key of its own).
    pub(crate) delete_location: bool,
    /// `Repeatability-Request-ID` names the same record as `Idempotency-Key`.
    pub(crate) repeatability: bool,
    /// A top-level JSON body field that names the same record as `Idempotency-Key`.
    pub(crate) body_key_field: Option<&'static str>,
    /// How the profile's own target turns on what a default one leaves off, for the reasons of
    /// the vectors that find it off.
    pub(crate) switches: Switches,
}

/// For each feature a target may leave off, how the profile's own target turns it on (empty:
/// the profile names no switch). Whether it is on is found from the target's answers.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Switches {
    /// `Repeatability-Request-ID`.
    pub(crate) repeatability: &'static str,
    /// The key in a body field.
    pub(crate) body_key: &'static str,
    /// The request the profile expects a 5xx for.
    pub(crate) server_error: &'static str,
}

impl Switches {
    /// `" (SWITCH)"`, or nothing.
    pub(crate) fn say(switch: &str) -> String {
        if switch.is_empty() { String::new() } else { format!(" ({switch})") }
    }
}

pub(crate) const NAMES: [&str; 3] = ["ietf-draft", "stripe", "leasebroker"];

impl Profile {
    pub(crate) fn named(name: &str) -> Option<Self> {
        let base = Profile {
            name: "ietf-draft",
            about: "draft-ietf-httpapi-idempotency-key-header: sf-string keys, 400 without a key, 422 for a reused \
                    key, 409 while in flight",
            mismatch_status: 422,
            key_required: true,
            sf_keys: true,
            replay_header: None,
            problem_types: false,
            expires_header: false,
            prefer_wait: false,
            full_fingerprint: false,
            primary: None,
            secondary: None,
            counter: None,
            stored_error: None,
            server_error: None,
            long_running: None,
            delete_location: false,
            repeatability: false,
            body_key_field: None,
            switches: Switches::default(),
        };
        match name {
            "ietf-draft" => Some(base),
            "stripe" => Some(Profile {
                name: "stripe",
                about: "Stripe's documented behaviour: bare keys up to 255 characters, optional, 400 for a reused \
                        key, `Idempotent-Replayed: true` on a replay, 409 while in flight",
                mismatch_status: 400,
                key_required: false,
                sf_keys: false,
                replay_header: Some(("idempotent-replayed", "true")),
                ..base
            }),
            "leasebroker" => Some(Profile {
                name: "leasebroker",
                about: "this workspace's contract (docs/protocol.md, the library and leasebroker): both key forms, 409 for a reused key \
                        (--mismatch-status), problem types, Idempotency-Key-Expires, Prefer: wait, Repeatability-Request-ID \
                        and a body request_id, a 5xx not stored; tokens: 1st and 2nd two tenants, 3rd the admin token \
                        (firmware flash). A default leasebroker passes or is n/a on every vector; all of them pass with \
                        serve --key-sources repeatability,request-id --sim-missing-image idemcheck-missing:1 \
                        --sim-latency-ms 300 --pool-nodes 256 --rate-limit 0",
                mismatch_status: 409,
                key_required: true,
                sf_keys: true,
                replay_header: Some(("idempotent-replayed", "true")),
                problem_types: true,
                expires_header: true,
                prefer_wait: true,
                full_fingerprint: true,
                primary: Some(Req::new(
                    "POST",
                    "/v1/workers",
                    Some(json!({"image": "idemcheck:1", "cpu": 1, "memory_gb": 1})),
                )),
                secondary: Some(Req::new("POST", "/v1/workers/wkr-idemcheck-none/reboot", None)),
                counter: Some(Counter {
                    path: "/v1/workers?limit=100".into(),
                    pointer: "/workers".into(),
                    next: Some(("/next_cursor".into(), "cursor".into())),
                    describe: "the caller's workers (GET /v1/workers, every page)".into(),
                }),
                stored_error: Some(Req::new(
                    "POST",
                    "/v1/workers",
                    Some(json!({"image": "idemcheck:1", "cpu": 0, "memory_gb": 1})),
                )),
                // An image its hypervisor lacks (`serve --sim-missing-image idemcheck-missing:1`):
                // refused downstream, 502.
                server_error: Some(Req::new(
                    "POST",
                    "/v1/workers",
                    Some(json!({"image": "idemcheck-missing:1", "cpu": 1, "memory_gb": 1})),
                )),
                long_running: Some(
                    Req::new(
                        "POST",
                        "/admin/v1/nodes/node-0001/firmware",
                        Some(json!({"version": "idemcheck-1", "force": true})),
                    )
                    .with_token(2),
                ),
                delete_location: true,
                // `serve --key-sources repeatability,request-id`.
                repeatability: true,
                body_key_field: Some("request_id"),
                switches: Switches {
                    repeatability: "leasebroker: serve --key-sources repeatability",
                    body_key: "leasebroker: serve --key-sources request-id",
                    server_error: "leasebroker: serve --sim-missing-image idemcheck-missing:1",
                },
            }),
            _ => None,
        }
    }

    /// Routes from the command line replace the profile's: the first is the primary route
    /// (answers 2xx), the second another endpoint.
    pub(crate) fn with_routes(mut self, routes: Vec<Req>) -> Self {
        let mut routes = routes.into_iter();
        if let Some(r) = routes.next() {
            self.primary = Some(r);
            // The profile's counter and extra requests are about its own routes.
            self.counter = None;
            self.secondary = None;
            self.stored_error = None;
            self.server_error = None;
            self.delete_location = false;
        }
        if let Some(r) = routes.next() {
            self.secondary = Some(r);
        }
        self
    }
}
