//! A route's `probe` (docs/protocol.md#gateway): asking the upstream what became of an uncertain record's request,
//! at `GET /orders/by-key/{key}` with `{key}` the key the upstream was sent.

use std::sync::Arc;

use axum::body::Body;
use futures::future::BoxFuture;
use http::{Request, StatusCode};
use http_body_util::BodyExt;
use idempotency::Record;
use idempotency_tower::{Probe, Probed};

use super::Inner;
use crate::settings::MethodPath;

/// The probe of one route, on the proxy's client.
pub(super) struct UpstreamProbe {
    proxy: Arc<Inner>,
    route: MethodPath,
}

impl UpstreamProbe {
    pub(super) fn new(proxy: Arc<Inner>, route: MethodPath) -> Self {
        Self { proxy, route }
    }

    async fn ask(proxy: Arc<Inner>, route: MethodPath, key: Option<String>) -> Probed {
        let unknown = Probed::Unknown;
        // `{key}` is the forwarded key; without one (`--forward-key none`) nothing can be asked.
        let Some(key) = key else { return unknown };
        let path = route.template.replace("{key}", &key);
        let Ok(uri) = proxy.settings.upstream.uri(&path) else { return unknown };
        let Ok(req) = Request::builder().method(route.method).uri(uri).body(Body::empty()) else { return unknown };
        let timeout = proxy.settings.timeout;
        let res = match tokio::time::timeout(timeout, proxy.client.request(req)).await {
            Ok(Ok(res)) => res,
            Ok(Err(e)) => {
                tracing::warn!(error = %e, "the probe got no answer from the upstream");
                return unknown;
            }
            Err(_) => {
                tracing::warn!("the probe got no answer from the upstream in time");
                return unknown;
            }
        };
        let status = res.status();
        if status == StatusCode::NOT_FOUND {
            return Probed::NeverHappened;
        }
        if !status.is_success() {
            tracing::warn!(status = status.as_u16(), "the probe's answer says neither yes nor no");
            return unknown;
        }
        let (parts, body) = res.into_parts();
        let limited = http_body_util::Limited::new(body, proxy.settings.max_read);
        let body = match tokio::time::timeout(timeout, limited.collect()).await {
            Ok(Ok(collected)) => collected.to_bytes(),
            _ => return unknown,
        };
        // The layer keeps the replayable headers of it, as of any response it stores.
        Probed::Happened(http::Response::from_parts(parts, body))
    }
}

impl Probe for UpstreamProbe {
    fn probe<'a>(&'a self, record: &'a Record) -> BoxFuture<'a, Probed> {
        let key = self.proxy.forwarded_key(record);
        Box::pin(Self::ask(self.proxy.clone(), self.route.clone(), key))
    }
}
