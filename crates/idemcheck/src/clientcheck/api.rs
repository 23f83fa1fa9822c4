//! The scripted API a client under test talks to: one route on loopback that answers each attempt
//! as the current scenario's script says (the work done and the answer lost, 503/429 with
//! `Retry-After`, a problem, a success) and writes down what arrived and when.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use hyper_util::service::TowerToHyperService;
use serde::Serialize;
use serde_json::{Value, json};
use tokio::net::TcpListener;
use tokio::sync::{Notify, watch};

/// What the API does with one attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Answer {
    /// Does the work (or replays it, for a key whose work is done) and answers `201`.
    Created,
    /// Does the work, then closes the connection without answering: the answer is lost.
    Lost,
    /// Does the work and never answers: the kit kills the command meanwhile.
    Held,
    /// An `application/problem+json` answer; nothing done.
    Problem {
        /// The status.
        status: u16,
        /// The last segment of the problem's `type`.
        name: &'static str,
        /// `Retry-After` in seconds, if any.
        retry_after: Option<u64>,
    },
}

/// A scenario's answers, by attempt (across the command's runs): `first`, then `then` forever.
#[derive(Debug, Clone)]
pub(crate) struct Script {
    pub(crate) first: Vec<Answer>,
    pub(crate) then: Answer,
}

impl Script {
    fn answer(&self, attempt: usize) -> Answer {
        self.first.get(attempt).copied().unwrap_or(self.then)
    }
}

/// One request that arrived.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Arrival {
    /// Which run of the command sent it (0: the first).
    pub(crate) run: usize,
    /// When it arrived, since the scenario began.
    #[serde(rename = "at_seconds", serialize_with = "seconds")]
    pub(crate) at: Duration,
    /// When its answer went out (`None`: lost or held).
    #[serde(rename = "answered_at_seconds", serialize_with = "maybe_seconds")]
    pub(crate) answered_at: Option<Duration>,
    pub(crate) method: String,
    pub(crate) path: String,
    /// Its `Idempotency-Key`, as sent.
    pub(crate) key: Option<String>,
    /// What the API did: `201 (executed #1)`, `503 Retry-After: 2`, `lost`...
    pub(crate) answer: String,
}

fn seconds<S: serde::Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_f64((d.as_secs_f64() * 1000.0).round() / 1000.0)
}

fn maybe_seconds<S: serde::Serializer>(d: &Option<Duration>, s: S) -> Result<S::Ok, S::Error> {
    match d {
        Some(d) => seconds(d, s),
        None => s.serialize_none(),
    }
}

/// What arrived during one scenario, and how often the work ran.
#[derive(Debug, Clone, Default)]
pub(crate) struct Transcript {
    pub(crate) arrivals: Vec<Arrival>,
    /// How many times the work ran (a new key's first attempt that was answered, lost or held).
    pub(crate) executions: usize,
}

/// The scenario under way.
#[derive(Debug)]
struct Stage {
    script: Option<Script>,
    started: Instant,
    run: usize,
    transcript: Transcript,
    /// The answer of each key whose work ran.
    done: HashMap<String, Value>,
}

/// The API's shared state; cloned into every connection.
#[derive(Debug, Clone)]
pub(crate) struct Api {
    stage: Arc<Mutex<Stage>>,
    arrived: Arc<watch::Sender<usize>>,
    route: Arc<Route>,
}

/// The route a client is told to call, and what a success answers.
#[derive(Debug)]
pub(crate) struct Route {
    pub(crate) path: String,
    /// The body of a `201`; `None`: `{"id": "thing-N"}`.
    pub(crate) created: Option<Value>,
}

impl Api {
    /// Serves the API on a free loopback port; the URL it is reached at.
    pub(crate) async fn start(route: Route) -> std::io::Result<(Api, String)> {
        let listener = TcpListener::bind(SocketAddr::from(([127, 0, 0, 1], 0))).await?;
        let url = format!("http://{}", listener.local_addr()?);
        let stage = Stage {
            script: None,
            started: Instant::now(),
            run: 0,
            transcript: Transcript::default(),
            done: HashMap::new(),
        };
        let api =
            Api { stage: Arc::new(Mutex::new(stage)), arrived: Arc::new(watch::channel(0).0), route: Arc::new(route) };
        tokio::spawn(serve(listener, api.clone()));
        Ok((api, url))
    }

    fn stage(&self) -> MutexGuard<'_, Stage> {
        self.stage.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Starts a scenario: its script, an empty transcript, the clock at zero.
    pub(crate) fn begin(&self, script: Script) {
        let mut stage = self.stage();
        *stage = Stage {
            script: Some(script),
            started: Instant::now(),
            run: 0,
            transcript: Transcript::default(),
            done: HashMap::new(),
        };
        self.arrived.send_replace(0);
    }

    /// The time since the scenario began.
    pub(crate) fn now(&self) -> Duration {
        self.stage().started.elapsed()
    }

    /// The command's next run of this scenario begins.
    pub(crate) fn next_run(&self, run: usize) {
        self.stage().run = run;
    }

    /// Watches the count of the scenario's arrivals.
    pub(crate) fn arrivals(&self) -> watch::Receiver<usize> {
        self.arrived.subscribe()
    }

    /// Ends the scenario: what arrived. Requests after this are answered `503` and not kept.
    pub(crate) fn finish(&self) -> Transcript {
        let mut stage = self.stage();
        stage.script = None;
        std::mem::take(&mut stage.transcript)
    }

    /// Answers one request as the script says; `cut` closes its connection.
    async fn answer(&self, request: Request, cut: &Notify) -> Response {
        let key = request.headers().get("idempotency-key").map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned());
        let method = request.method().to_string();
        let path = request.uri().path().to_owned();
        let wrong_route = method != "POST" || path != self.route.path;
        let (answer, response) = {
            let mut stage = self.stage();
            let Some(script) = stage.script.clone() else {
                return problem(503, "between-scenarios", None, "no scenario is running");
            };
            let at = stage.started.elapsed();
            let attempt = stage.transcript.arrivals.len();
            let answer = if wrong_route {
                Answer::Problem { status: 404, name: "not-found", retry_after: None }
            } else {
                script.answer(attempt)
            };
            let (said, response) = self.respond(&mut stage, answer, key.as_deref());
            let answered_at = response.is_some().then(|| stage.started.elapsed());
            let run = stage.run;
            stage.transcript.arrivals.push(Arrival { run, at, answered_at, method, path, key, answer: said });
            (answer, response)
        };
        self.arrived.send_modify(|n| *n += 1);
        match (answer, response) {
            (_, Some(response)) => response,
            (Answer::Lost, None) => {
                cut.notify_one();
                std::future::pending().await
            }
            (_, None) => std::future::pending().await,
        }
    }

    /// Does what `answer` says for `key`: what to write down, and the response (`None`: none).
    fn respond(&self, stage: &mut Stage, answer: Answer, key: Option<&str>) -> (String, Option<Response>) {
        if let Answer::Problem { status, name, retry_after } = answer {
            let said = match retry_after {
                Some(s) => format!("{status} {name}, Retry-After: {s}"),
                None => format!("{status} {name}"),
            };
            return (said, Some(problem(status, name, retry_after, "scripted by idemcheck client")));
        }
        let replay = key.and_then(|k| stage.done.get(k)).cloned();
        let (body, did) = match replay {
            Some(body) => (body, "replayed".to_owned()),
            None => {
                stage.transcript.executions += 1;
                let n = stage.transcript.executions;
                let body = self.route.created.clone().unwrap_or_else(|| json!({ "id": format!("thing-{n}") }));
                if let Some(k) = key {
                    stage.done.insert(k.to_owned(), body.clone());
                }
                (body, format!("executed #{n}"))
            }
        };
        match answer {
            Answer::Created => {
                let mut response = (StatusCode::CREATED, axum::Json(body)).into_response();
                if did == "replayed" {
                    response.headers_mut().insert("idempotent-replayed", HeaderValue::from_static("true"));
                }
                (format!("201 ({did})"), Some(response))
            }
            Answer::Lost => (format!("{did}, answer lost (connection closed)"), None),
            _ => (format!("{did}, held (no answer)"), None),
        }
    }
}

/// An RFC 9457 problem.
fn problem(status: u16, name: &str, retry_after: Option<u64>, detail: &str) -> Response {
    let status = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let body = json!({
        "type": format!("/problems/{name}"),
        "title": name.replace('-', " "),
        "status": status.as_u16(),
        "detail": detail,
    });
    let mut response = Response::new(Body::from(body.to_string()));
    *response.status_mut() = status;
    response.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("application/problem+json"));
    if let Some(s) = retry_after {
        response.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from(s));
    }
    response
}

/// Accepts connections; each may be closed by its request's handler (a lost answer).
async fn serve(listener: TcpListener, api: Api) {
    loop {
        let Ok((stream, _)) = listener.accept().await else { continue };
        let api = api.clone();
        tokio::spawn(async move {
            let cut = Arc::new(Notify::new());
            let app = Router::new().fallback(handle).with_state((api, cut.clone()));
            let builder = auto::Builder::new(TokioExecutor::new()).http1_only();
            let connection = builder.serve_connection(TokioIo::new(stream), TowerToHyperService::new(app));
            // Dropping the connection closes the socket without an answer.
            tokio::select! {
                _ = connection => {}
                () = cut.notified() => {}
            }
        });
    }
}

async fn handle(State((api, cut)): State<(Api, Arc<Notify>)>, request: Request) -> Response {
    api.answer(request, &cut).await
}
