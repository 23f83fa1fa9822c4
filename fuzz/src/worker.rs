//! leasebroker's `POST /v1/workers` body: serde, then `CreateWorker::validate` (from
//! `leasebroker-api`, the code the service runs, without the service around it).

use std::collections::BTreeMap;

use arbitrary::Arbitrary;
use leasebroker_api::{CreateWorker, Limits};

/// The default node size (`--node-cpu 64 --node-memory-gb 512`).
const LIMITS: Limits = Limits { node_cpu: 64, node_memory_gb: 512 };

/// Arbitrary bytes as the body: never panics, and whatever parses is judged as the SPEC says.
pub fn check_bytes(body: &[u8]) {
    if let Ok(req) = serde_json::from_slice::<CreateWorker>(body) {
        check(&req);
    }
}

/// A structured body: the fields a client could send, serialised and parsed back first.
#[derive(Debug, Arbitrary)]
pub struct Fields {
    image: String,
    cpu: i64,
    memory_gb: i64,
    labels: Option<Vec<(String, String)>>,
    node_cpu: u8,
}

/// Structured input: serde round trip, then the same judgement with a node size from the input.
pub fn check_fields(f: &Fields) {
    let labels = f.labels.as_ref().map(|l| l.iter().cloned().collect::<BTreeMap<_, _>>());
    let body = serde_json::json!({"image": f.image, "cpu": f.cpu, "memory_gb": f.memory_gb, "labels": labels});
    let req: CreateWorker = serde_json::from_value(body).expect("every well-typed body parses");
    let limits = Limits { node_cpu: i64::from(f.node_cpu), node_memory_gb: LIMITS.node_memory_gb };
    judge(&req, limits);
}

fn check(req: &CreateWorker) {
    judge(req, LIMITS);
}

/// `validate` agrees with the limits as SPEC 3.2 and the field docs state them, and every
/// refusal (a 422) carries a message that displays as itself.
fn judge(req: &CreateWorker, limits: Limits) {
    let image = req.image.chars().count();
    let labels_ok = req.labels.as_ref().is_none_or(|l| {
        l.len() <= 64 && l.iter().all(|(k, v)| (1..=63).contains(&k.chars().count()) && v.chars().count() <= 255)
    });
    let expected = (1..=200).contains(&image)
        && !req.image.chars().any(char::is_control)
        && !req.image.trim().is_empty()
        && (1..=limits.node_cpu).contains(&req.cpu)
        && (1..=limits.node_memory_gb).contains(&req.memory_gb)
        && labels_ok;
    match req.validate(limits) {
        Ok(()) => assert!(expected, "accepted {req:?}"),
        Err(e) => {
            assert!(!e.message().is_empty() && e.to_string() == e.message(), "{e:?}");
            assert!(!expected, "refused {req:?}: {e}");
        }
    }
}
