//! The typed leasebroker client.

use std::fmt;
use std::path::Path;
use std::time::Duration;

use bytes::Bytes;
use reqwest::header::{ACCEPT, CONTENT_TYPE};
use reqwest::{Method, StatusCode, Url};
use serde::de::DeserializeOwned;

use crate::error::{Error, retry_after};
use crate::journal::RequestFingerprint;
use crate::records::{Record, RecordFilter, RecordId, RecordPage};
use crate::retry::{HttpResponse, OpKey, Retrier};
use crate::types::{
    CreateWorker, FlashFirmware, Fleet, NodeId, Operation, OperationId, RebootResult, ResolveOperation, Worker,
    WorkerId, WorkerPage,
};

/// How often [`Client::wait_operation`] polls unless the server asks otherwise (`Retry-After`).
pub const DEFAULT_POLL_INTERVAL: Duration = Duration::from_secs(1);
/// The shortest wait between polls, whatever the server asks (`Retry-After: 0` does not make a
/// busy loop).
const MIN_POLL_INTERVAL: Duration = Duration::from_millis(100);
/// The longest wait between polls, whatever the server asks (a huge `Retry-After` does not make a
/// wait that never looks again).
const MAX_POLL_INTERVAL: Duration = Duration::from_secs(60);

/// A successful response, decoded, with how it came about.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct Response<T> {
    /// The decoded body.
    pub value: T,
    /// Whether the server answered from the stored response of an earlier attempt or run
    /// (`Idempotent-Replayed: true`): the operation had already been done.
    pub replayed: bool,
    /// How many requests this call sent.
    pub attempts: u32,
    /// The HTTP status.
    pub status: StatusCode,
    /// The body exactly as received, for callers that pass it on.
    pub body: Bytes,
}

/// A mutating call, described apart from sending it, so its fingerprint can be journaled first.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Mutation {
    /// `POST /v1/workers`.
    CreateWorker(CreateWorker),
    /// `DELETE /v1/workers/{id}`.
    DeleteWorker(WorkerId),
    /// `POST /v1/workers/{id}/reboot`.
    RebootWorker(WorkerId),
    /// `POST /admin/v1/nodes/{node_id}/firmware`.
    FlashFirmware {
        /// The node whose BMC is flashed.
        node_id: NodeId,
        /// The body.
        request: FlashFirmware,
    },
    /// `DELETE /admin/v1/records/{id}`.
    ForgetRecord(RecordId),
    /// `POST /admin/v1/operations/{id}/resolve`.
    ResolveOperation {
        /// The `uncertain` operation.
        op_id: OperationId,
        /// The body.
        request: ResolveOperation,
    },
}

impl Mutation {
    /// Method, path and body, exactly as sent.
    fn parts(&self) -> (Method, String, Option<Vec<u8>>) {
        match self {
            Mutation::CreateWorker(req) => {
                // Serializing plain strings, integers and a BTreeMap cannot fail, and its output is
                // deterministic (struct order, sorted labels), so the fingerprint is stable.
                let body = serde_json::to_vec(req).unwrap_or_default();
                (Method::POST, "/v1/workers".to_owned(), Some(body))
            }
            Mutation::DeleteWorker(id) => (Method::DELETE, format!("/v1/workers/{id}"), None),
            Mutation::RebootWorker(id) => (Method::POST, format!("/v1/workers/{id}/reboot"), None),
            Mutation::FlashFirmware { node_id, request } => {
                // One string field: serializing cannot fail and is deterministic.
                let body = serde_json::to_vec(request).unwrap_or_default();
                (Method::POST, format!("/admin/v1/nodes/{node_id}/firmware"), Some(body))
            }
            Mutation::ForgetRecord(id) => (Method::DELETE, format!("/admin/v1/records/{id}"), None),
            Mutation::ResolveOperation { op_id, request } => {
                // A lowercase name and a string: serializing cannot fail and is deterministic.
                let body = serde_json::to_vec(request).unwrap_or_default();
                (Method::POST, format!("/admin/v1/operations/{op_id}/resolve"), Some(body))
            }
        }
    }

    /// The fingerprint of the request this mutation sends (method, path, body).
    pub fn fingerprint(&self) -> RequestFingerprint {
        let (method, path, body) = self.parts();
        RequestFingerprint::of(method.as_str(), &path, body.as_deref().unwrap_or_default())
    }
}

/// A leasebroker client: bearer auth, JSON, and the [`Retrier`] around every call.
#[derive(Clone)]
pub struct Client {
    http: reqwest::Client,
    base: String,
    token: String,
    retrier: Retrier,
    poll_interval: Duration,
}

impl fmt::Debug for Client {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The token is a credential: never print it.
        f.debug_struct("Client")
            .field("base", &self.base)
            .field("retrier", &self.retrier)
            .field("poll_interval", &self.poll_interval)
            .finish_non_exhaustive()
    }
}

/// Builds a [`Client`]: the base URL and token, plus the CA certificates to trust beyond the
/// system's roots and the retrier.
///
/// ```no_run
/// # fn demo(pem: &[u8]) -> Result<(), leasebroker_client::Error> {
/// let client = leasebroker_client::Client::builder("https://leasebroker.internal:8443", "secret-token")
///     .ca_certificates_pem(pem)? // a private CA, trusted in addition to the system's roots
///     .build()?;
/// # Ok(()) }
/// ```
pub struct ClientBuilder {
    base_url: String,
    token: String,
    roots: Vec<reqwest::Certificate>,
    retrier: Retrier,
    poll_interval: Duration,
}

impl fmt::Debug for ClientBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The token is a credential: never print it.
        f.debug_struct("ClientBuilder")
            .field("base_url", &self.base_url)
            .field("ca_certificates", &self.roots.len())
            .field("retrier", &self.retrier)
            .field("poll_interval", &self.poll_interval)
            .finish_non_exhaustive()
    }
}

impl ClientBuilder {
    /// Trusts the CA certificates of a PEM bundle (one or more `CERTIFICATE` blocks) for `https`
    /// URLs, in addition to the system's roots.
    pub fn ca_certificates_pem(mut self, pem: &[u8]) -> Result<Self, Error> {
        let certs = reqwest::Certificate::from_pem_bundle(pem)
            .map_err(|e| Error::InvalidRequest(format!("CA certificates: {e}")))?;
        if certs.is_empty() {
            return Err(Error::InvalidRequest("CA certificates: no PEM CERTIFICATE block found".to_owned()));
        }
        self.roots.extend(certs);
        Ok(self)
    }

    /// [`ClientBuilder::ca_certificates_pem`] with the contents of the file at `path`.
    pub fn ca_certificates_file(self, path: impl AsRef<Path>) -> Result<Self, Error> {
        let path = path.as_ref();
        let pem = std::fs::read(path).map_err(|e| Error::InvalidRequest(format!("{}: {e}", path.display())))?;
        self.ca_certificates_pem(&pem).map_err(|e| match e {
            Error::InvalidRequest(reason) => Error::InvalidRequest(format!("{}: {reason}", path.display())),
            other => other,
        })
    }

    /// Uses `retrier` (policy and attempt hook) for every call.
    pub fn retrier(mut self, retrier: Retrier) -> Self {
        self.retrier = retrier;
        self
    }

    /// Polls a running operation every `interval` in [`Client::wait_operation`] (default
    /// [`DEFAULT_POLL_INTERVAL`]), unless the server asks for another wait with `Retry-After`.
    pub fn poll_interval(mut self, interval: Duration) -> Self {
        self.poll_interval = interval;
        self
    }

    /// The client.
    pub fn build(self) -> Result<Client, Error> {
        let ClientBuilder { base_url, token, roots, retrier, poll_interval } = self;
        let url = Url::parse(&base_url).map_err(|e| Error::InvalidRequest(format!("base URL {base_url:?}: {e}")))?;
        if !matches!(url.scheme(), "http" | "https") || url.cannot_be_a_base() {
            return Err(Error::InvalidRequest(format!("base URL {base_url:?} is not an http(s) URL")));
        }
        if url.query().is_some() || url.fragment().is_some() {
            return Err(Error::InvalidRequest(format!("base URL {base_url:?} has a query or fragment")));
        }
        let http = reqwest::Client::builder()
            // A redirect would re-send a mutation somewhere else; report it instead.
            .redirect(reqwest::redirect::Policy::none())
            .user_agent(concat!("leasebroker-client/", env!("CARGO_PKG_VERSION")))
            .tls_backend_rustls();
        // rustls with the system's roots (rustls-platform-verifier), plus the caller's CAs. Redirects
        // are off, so an http base never needs TLS: skip loading the system's roots (a host without
        // them can still use one).
        let http = if url.scheme() == "https" { http.tls_certs_merge(roots) } else { http.tls_certs_only(roots) }
            .build()
            .map_err(Error::from_reqwest)?;
        let base = url.as_str().trim_end_matches('/').to_owned();
        Ok(Client { http, base, token, retrier, poll_interval })
    }
}

impl Client {
    /// A client for the service at `base_url` (`http://127.0.0.1:8080` or `https://...`),
    /// authenticating with `token`, retrying with the default [`crate::retry::RetryPolicy`], and
    /// trusting the system's roots for `https`. [`Client::builder`] sets more.
    pub fn new(base_url: &str, token: impl Into<String>) -> Result<Self, Error> {
        Client::builder(base_url, token).build()
    }

    /// A [`ClientBuilder`] for the service at `base_url`, authenticating with `token`.
    pub fn builder(base_url: &str, token: impl Into<String>) -> ClientBuilder {
        ClientBuilder {
            base_url: base_url.to_owned(),
            token: token.into(),
            roots: Vec::new(),
            retrier: Retrier::default(),
            poll_interval: DEFAULT_POLL_INTERVAL,
        }
    }

    /// Uses `http` for every call instead of the default client: to set timeouts, a proxy, TLS
    /// roots, or connection reuse (the fault harness turns reuse off so that each injected fault
    /// hits one attempt). Keep redirects off in it: a followed redirect re-sends a mutation.
    pub fn with_http(mut self, http: reqwest::Client) -> Self {
        self.http = http;
        self
    }

    /// Uses `retrier` (policy and attempt hook) for every call.
    pub fn with_retrier(mut self, retrier: Retrier) -> Self {
        self.retrier = retrier;
        self
    }

    /// Polls every `interval` in [`Client::wait_operation`]; see [`ClientBuilder::poll_interval`].
    pub fn with_poll_interval(mut self, interval: Duration) -> Self {
        self.poll_interval = interval;
        self
    }

    /// The retrier in use.
    pub fn retrier(&self) -> &Retrier {
        &self.retrier
    }

    /// `POST /v1/workers` with `key` on every attempt.
    pub async fn create_worker(&self, request: &CreateWorker, key: &OpKey) -> Result<Response<Worker>, Error> {
        self.mutate(&Mutation::CreateWorker(request.clone()), key).await?.decoded()
    }

    /// `GET /v1/workers/{id}`.
    pub async fn get_worker(&self, id: &WorkerId) -> Result<Response<Worker>, Error> {
        self.get(self.url(&format!("/v1/workers/{id}"))?).await?.decoded()
    }

    /// `GET /v1/workers`: one page of the caller's workers.
    pub async fn list_workers(&self, limit: Option<u32>, cursor: Option<&str>) -> Result<Response<WorkerPage>, Error> {
        let mut url = self.url("/v1/workers")?;
        {
            let mut query = url.query_pairs_mut();
            if let Some(limit) = limit {
                query.append_pair("limit", &limit.to_string());
            }
            if let Some(cursor) = cursor {
                query.append_pair("cursor", cursor);
            }
        }
        if url.query() == Some("") {
            url.set_query(None);
        }
        self.get(url).await?.decoded()
    }

    /// `DELETE /v1/workers/{id}` with `key` on every attempt.
    pub async fn delete_worker(&self, id: &WorkerId, key: &OpKey) -> Result<Response<()>, Error> {
        let raw = self.mutate(&Mutation::DeleteWorker(id.clone()), key).await?;
        Ok(Response { value: (), replayed: raw.replayed, attempts: raw.attempts, status: raw.status, body: raw.body })
    }

    /// `POST /v1/workers/{id}/reboot` with `key` on every attempt: one reboot per key, ever.
    pub async fn reboot_worker(&self, id: &WorkerId, key: &OpKey) -> Result<Response<RebootResult>, Error> {
        self.mutate(&Mutation::RebootWorker(id.clone()), key).await?.decoded()
    }

    /// `GET /admin/v1/fleet`; needs a client made with the admin token.
    pub async fn fleet(&self) -> Result<Response<Fleet>, Error> {
        self.get(self.url("/admin/v1/fleet")?).await?.decoded()
    }

    /// `POST /admin/v1/nodes/{node_id}/firmware` with `key` on every attempt; needs a client made
    /// with the admin token.
    ///
    /// The server answers `202` with the operation as soon as it has accepted the flash, and
    /// replays that `202` to every retry with the same key, while the flash runs or after: a retry
    /// attaches to the running operation instead of starting a second flash. Follow it with
    /// [`Client::wait_operation`]. Another key's flash already running on the node is
    /// [`Error::Refused`] (409, problem [`crate::OPERATION_CONFLICT`], naming that operation in
    /// [`crate::Problem::operation_id`]); it is not retried.
    pub async fn flash_firmware(
        &self,
        node_id: &NodeId,
        request: &FlashFirmware,
        key: &OpKey,
    ) -> Result<Response<Operation>, Error> {
        let mutation = Mutation::FlashFirmware { node_id: node_id.clone(), request: request.clone() };
        self.mutate(&mutation, key).await?.decoded()
    }

    /// `GET /admin/v1/operations/{id}`; needs a client made with the admin token. An unknown
    /// operation is [`Error::Refused`] (404).
    pub async fn get_operation(&self, id: &OperationId) -> Result<Response<Operation>, Error> {
        self.get(self.url(&format!("/admin/v1/operations/{id}"))?).await?.decoded()
    }

    /// `POST /admin/v1/operations/{id}/resolve` with `key` on every attempt; needs a client made
    /// with the admin token. Ends an `uncertain` operation as the operator found the machine
    /// (`succeeded` or `failed`, and why); the server writes an audit line. An operation in any
    /// other state is [`Error::Refused`] (409, problem `operation-not-uncertain`).
    pub async fn resolve_operation(
        &self,
        id: &OperationId,
        request: &ResolveOperation,
        key: &OpKey,
    ) -> Result<Response<Operation>, Error> {
        let mutation = Mutation::ResolveOperation { op_id: id.clone(), request: request.clone() };
        self.mutate(&mutation, key).await?.decoded()
    }

    /// Polls `GET /admin/v1/operations/{id}` until the operation has come to its end
    /// ([`Operation::is_finished`]) and returns its last state, `succeeded`, `failed` or
    /// `uncertain` alike: an operation that did not succeed is an answer, not an error of this
    /// call.
    ///
    /// The first poll goes out at once; then one every [`ClientBuilder::poll_interval`] (1 s by
    /// default), or as long as the server asks with `Retry-After` (held between 100 ms and 60 s).
    /// `on_poll` sees every state observed, one call per poll, so a caller can draw progress.
    /// Each poll is retried like any read (connection errors, 5xx, 429) within the retry budget,
    /// so an outage shorter than the budget only delays the answer; there is no limit on how long
    /// the operation itself may run. Errors that end the wait: a 4xx (404: no such operation),
    /// bad credentials, a retry budget spent on one poll ([`Error::GaveUp`]), or a body that is not
    /// an operation.
    ///
    /// ```no_run
    /// use leasebroker_client::{Client, FlashFirmware, OpKey, OperationState};
    /// # async fn demo() -> Result<(), leasebroker_client::Error> {
    /// let admin = Client::new("http://127.0.0.1:8080", "admin-token")?;
    /// let node = "node-0007".parse().expect("a valid node id");
    /// let accepted = admin.flash_firmware(&node, &FlashFirmware::new("2.1.0"), &OpKey::new_v4()).await?;
    /// let done = admin.wait_operation(&accepted.value.id, |op| eprintln!("{}: {}", op.id, op.state)).await?;
    /// assert!(matches!(
    ///     done.value.state,
    ///     OperationState::Succeeded | OperationState::Failed | OperationState::Uncertain
    /// ));
    /// # Ok(()) }
    /// ```
    pub async fn wait_operation<F>(&self, id: &OperationId, mut on_poll: F) -> Result<Response<Operation>, Error>
    where
        F: FnMut(&Operation),
    {
        let url = self.url(&format!("/admin/v1/operations/{id}"))?;
        loop {
            let raw = self.get(url.clone()).await?;
            let asked = retry_after(&raw.headers);
            let response: Response<Operation> = raw.decoded()?;
            on_poll(&response.value);
            if response.value.is_finished() {
                return Ok(response);
            }
            let wait = asked.map_or(self.poll_interval, |asked| asked.clamp(MIN_POLL_INTERVAL, MAX_POLL_INTERVAL));
            tokio::time::sleep(wait).await;
        }
    }

    /// `GET /admin/v1/records`: one page of idempotency records; needs the admin token.
    pub async fn list_records(&self, filter: &RecordFilter) -> Result<Response<RecordPage>, Error> {
        let mut url = self.url("/admin/v1/records")?;
        {
            let mut query = url.query_pairs_mut();
            let pairs = [
                ("state", filter.state.as_ref().map(ToString::to_string)),
                ("principal", filter.principal.clone()),
                ("older_than", filter.older_than.clone()),
                ("limit", filter.limit.map(|l| l.to_string())),
                ("cursor", filter.cursor.clone()),
            ];
            for (name, value) in pairs {
                if let Some(value) = value {
                    query.append_pair(name, &value);
                }
            }
        }
        if url.query() == Some("") {
            url.set_query(None);
        }
        self.get(url).await?.decoded()
    }

    /// `GET /admin/v1/records/{id}`, with the stored response body when `body`; needs the admin
    /// token. An unknown record is [`Error::Refused`] (404).
    pub async fn get_record(&self, id: &RecordId, body: bool) -> Result<Response<Record>, Error> {
        let query = if body { "?body=true" } else { "" };
        self.get(self.url(&format!("/admin/v1/records/{id}{query}"))?).await?.decoded()
    }

    /// `DELETE /admin/v1/records/{id}` with `key` on every attempt: forgets a completed or failed
    /// record, so its key's next request runs as a new operation. One in flight is
    /// [`Error::Refused`] (409, problem `record-in-flight`).
    pub async fn forget_record(&self, id: &RecordId, key: &OpKey) -> Result<Response<()>, Error> {
        let raw = self.mutate(&Mutation::ForgetRecord(id.clone()), key).await?;
        Ok(Response { value: (), replayed: raw.replayed, attempts: raw.attempts, status: raw.status, body: raw.body })
    }

    /// Sends `mutation` with `key` on every attempt and returns the raw successful response.
    pub async fn mutate(&self, mutation: &Mutation, key: &OpKey) -> Result<HttpResponse, Error> {
        let (method, path, body) = mutation.parts();
        let url = self.url(&path)?;
        let body = body.map(Bytes::from);
        self.retrier
            .send(Some(key), || {
                let request = self
                    .http
                    .request(method.clone(), url.clone())
                    .bearer_auth(&self.token)
                    .header(ACCEPT, "application/json");
                match &body {
                    Some(body) => request.header(CONTENT_TYPE, "application/json").body(body.clone()),
                    None => request,
                }
            })
            .await
    }

    async fn get(&self, url: Url) -> Result<HttpResponse, Error> {
        // Reads are idempotent by nature: retried without a key.
        self.retrier
            .send(None, || self.http.get(url.clone()).bearer_auth(&self.token).header(ACCEPT, "application/json"))
            .await
    }

    fn url(&self, path: &str) -> Result<Url, Error> {
        Url::parse(&format!("{}{path}", self.base)).map_err(|e| Error::InvalidRequest(format!("{path}: {e}")))
    }
}

trait Decode {
    fn decoded<T: DeserializeOwned>(self) -> Result<Response<T>, Error>;
}

impl Decode for HttpResponse {
    fn decoded<T: DeserializeOwned>(self) -> Result<Response<T>, Error> {
        let value = serde_json::from_slice(&self.body).map_err(|error| Error::Decode { status: self.status, error })?;
        Ok(Response { value, replayed: self.replayed, attempts: self.attempts, status: self.status, body: self.body })
    }
}
