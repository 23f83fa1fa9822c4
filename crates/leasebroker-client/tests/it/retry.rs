//! The retry core against a scripted server.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use leasebroker_client::Error;
use leasebroker_client::retry::{AttemptOutcome, HttpResponse, OpKey, Retrier, RetryPolicy};

use crate::full_chain;
use crate::server::{Reply, Scripted, closed_port_url};

const CREATED: &str = r#"{"id":"res-1"}"#;

/// Fast delays so tests spend their time on what they measure.
fn fast() -> RetryPolicy {
    RetryPolicy::default()
        .with_delays(Duration::from_millis(10), Duration::from_millis(50))
        .with_max_elapsed(Duration::from_secs(20))
        .with_attempt_timeout(Duration::from_secs(5))
}

async fn post(retrier: &Retrier, server: &Scripted, key: &OpKey) -> Result<HttpResponse, Error> {
    let http = reqwest::Client::new();
    let url = format!("{}/v1/things", server.url);
    retrier.send(Some(key), || http.post(&url).body(r#"{"n":1}"#)).await
}

fn assert_all_keys(server: &Scripted, key: &OpKey) {
    let keys = server.keys();
    assert!(!keys.is_empty());
    for (i, seen) in keys.iter().enumerate() {
        assert_eq!(seen.as_deref(), Some(key.as_str()), "attempt {} carried another key", i + 1);
    }
}

#[tokio::test]
async fn two_503_then_201_succeeds_on_the_third_attempt_with_one_key() {
    let server = Scripted::start([
        Reply::problem(503, "upstream-unavailable"),
        Reply::problem(503, "upstream-unavailable"),
        Reply::json(201, CREATED),
    ])
    .await;
    let key = OpKey::new_v4();
    let response = post(&Retrier::new(fast()), &server, &key).await.expect("success after retries");
    assert_eq!(response.status, 201);
    assert_eq!(response.attempts, 3);
    assert_eq!(&response.body[..], CREATED.as_bytes());
    assert_eq!(server.count(), 3);
    assert_all_keys(&server, &key);
}

#[tokio::test]
async fn retry_after_is_waited_at_least() {
    let server = Scripted::start([
        Reply::problem(503, "capacity-exhausted").header("retry-after", "1"),
        Reply::json(201, CREATED),
    ])
    .await;
    let key = OpKey::new_v4();
    let start = Instant::now();
    let response = post(&Retrier::new(fast()), &server, &key).await.expect("success");
    let elapsed = start.elapsed();
    assert_eq!(response.attempts, 2);
    assert!(elapsed >= Duration::from_secs(1), "retried after {elapsed:?}, before the 1s the server asked for");
    assert_all_keys(&server, &key);
}

#[tokio::test]
async fn in_progress_is_retried_until_created() {
    let server = Scripted::start([
        Reply::problem(409, "request-in-progress").header("retry-after", "0"),
        Reply::problem(409, "request-in-progress"),
        Reply::json(201, CREATED).header("idempotent-replayed", "true"),
    ])
    .await;
    let key = OpKey::new_v4();
    let response = post(&Retrier::new(fast()), &server, &key).await.expect("success");
    assert_eq!(response.attempts, 3);
    assert!(response.replayed, "Idempotent-Replayed: true must be reported");
    assert_all_keys(&server, &key);
}

#[tokio::test]
async fn key_reused_is_never_retried() {
    for status in [409, 422, 400] {
        let server =
            Scripted::start([Reply::problem(status, "idempotency-key-reused"), Reply::json(201, CREATED)]).await;
        let err = post(&Retrier::new(fast()), &server, &OpKey::new_v4()).await.expect_err("must fail");
        assert!(
            matches!(&err, Error::KeyReused { status: s, problem } if s.as_u16() == status && problem.is("idempotency-key-reused")),
            "{status}: got {err:?}"
        );
        assert_eq!(server.count(), 1, "{status}: a reused key was retried");
    }
}

#[tokio::test]
async fn validation_422_is_refused_without_retry() {
    let server = Scripted::start([Reply::problem(422, "validation-failed"), Reply::json(201, CREATED)]).await;
    let err = post(&Retrier::new(fast()), &server, &OpKey::new_v4()).await.expect_err("must fail");
    match &err {
        Error::Refused { status, problem: Some(problem) } => {
            assert_eq!(*status, 422);
            assert!(problem.is("validation-failed"));
        }
        other => panic!("expected Refused, got {other:?}"),
    }
    assert_eq!(server.count(), 1);
}

#[tokio::test]
async fn unauthorized_is_not_retried() {
    for status in [401, 403] {
        let server = Scripted::start([Reply::problem(status, "unauthorized"), Reply::json(201, CREATED)]).await;
        let err = post(&Retrier::new(fast()), &server, &OpKey::new_v4()).await.expect_err("must fail");
        assert!(matches!(err, Error::Unauthorized { .. }), "{status}: got {err:?}");
        assert_eq!(server.count(), 1);
    }
}

#[tokio::test]
async fn max_elapsed_bounds_the_whole_operation() {
    let server = Scripted::start([Reply::problem(503, "upstream-unavailable")]).await;
    let (budget, max_delay) = (Duration::from_secs(2), Duration::from_millis(200));
    let policy = RetryPolicy::default().with_delays(Duration::from_millis(50), max_delay).with_max_elapsed(budget);
    let start = Instant::now();
    let err = post(&Retrier::new(policy), &server, &OpKey::new_v4()).await.expect_err("must give up");
    let elapsed = start.elapsed();
    match &err {
        Error::GaveUp { attempts, elapsed: reported, last } => {
            assert!(*attempts >= 3, "only {attempts} attempts in {budget:?}");
            assert_eq!(*attempts as usize, server.count());
            // It gives up only when the next wait would not fit: after budget - max_delay at the
            // earliest, whatever the machine's load.
            assert!(*reported >= budget - max_delay, "gave up after {reported:?} of a {budget:?} budget");
            // The last attempt runs on what is left of the budget; on a busy machine that may not
            // be enough for an answer, so it may end in a timeout instead of the server's 503.
            match &**last {
                Error::Server { status, .. } => assert_eq!(*status, 503),
                Error::Transport(e) => assert!(e.is_timeout(), "last: {e:?}"),
                other => panic!("last: {other:?}"),
            }
        }
        other => panic!("expected GaveUp, got {other:?}"),
    }
    // No attempt or wait reaches past the budget; the slack is for a loaded machine, and is far
    // below the minutes that retrying without a budget would take here.
    assert!(elapsed < budget + Duration::from_secs(5), "took {elapsed:?} with a {budget:?} budget");
}

#[tokio::test]
async fn the_time_budget_is_not_cut_short_by_an_attempt_cap() {
    // The default policy has no attempt cap: it retries until max_elapsed is spent, however many
    // attempts that takes (here: hundreds of quick 503s).
    let server = Scripted::start([Reply::problem(503, "upstream-unavailable")]).await;
    let (budget, max_delay) = (Duration::from_secs(2), Duration::from_millis(5));
    let policy = RetryPolicy::default().with_delays(Duration::from_millis(1), max_delay).with_max_elapsed(budget);
    let err = post(&Retrier::new(policy), &server, &OpKey::new_v4()).await.expect_err("must give up");
    match &err {
        Error::GaveUp { attempts, elapsed, .. } => {
            assert!(*elapsed >= budget - max_delay, "gave up after {elapsed:?} and {attempts} attempts");
            assert!(*attempts > 16, "{attempts} attempts in {elapsed:?}");
        }
        other => panic!("expected GaveUp, got {other:?}"),
    }
}

#[tokio::test]
async fn retry_after_beyond_the_budget_gives_up_at_once() {
    let server = Scripted::start([Reply::problem(503, "capacity-exhausted").header("retry-after", "60")]).await;
    let policy = fast().with_max_elapsed(Duration::from_secs(30));
    let start = Instant::now();
    let err = post(&Retrier::new(policy), &server, &OpKey::new_v4()).await.expect_err("must give up");
    assert!(matches!(err, Error::GaveUp { attempts: 1, .. }), "got {err:?}");
    // Sleeping the 60s asked for could not fit the 30s budget; giving up takes one quick request.
    assert!(start.elapsed() < Duration::from_secs(20), "slept although the wait could not fit the budget");
}

#[tokio::test]
async fn max_attempts_bounds_the_number_of_requests() {
    let server = Scripted::start([Reply::problem(500, "internal")]).await;
    let err =
        post(&Retrier::new(fast().with_max_attempts(3)), &server, &OpKey::new_v4()).await.expect_err("must give up");
    assert!(matches!(err, Error::GaveUp { attempts: 3, .. }), "got {err:?}");
    assert_eq!(server.count(), 3);
}

#[tokio::test]
async fn connection_refused_is_retried_then_gives_up() {
    let url = closed_port_url();
    let http = reqwest::Client::new();
    let policy = fast().with_max_elapsed(Duration::from_secs(3));
    let err = Retrier::new(policy)
        .send(Some(&OpKey::new_v4()), || http.post(format!("{url}/v1/things")))
        .await
        .expect_err("nothing listens");
    match err {
        Error::GaveUp { attempts, last, .. } => {
            assert!(attempts >= 2, "connection refused was not retried");
            assert!(matches!(*last, Error::Transport(_)), "last: {last:?}");
        }
        other => panic!("expected GaveUp, got {other:?}"),
    }
}

#[tokio::test]
async fn a_gave_up_error_names_its_cause_once_in_its_full_chain() {
    let url = closed_port_url();
    let http = reqwest::Client::new();
    let policy = fast().with_max_elapsed(Duration::from_millis(300));
    let err = Retrier::new(policy)
        .send(Some(&OpKey::new_v4()), || http.post(format!("{url}/v1/things")))
        .await
        .expect_err("nothing listens");
    let line = err.to_string();
    assert!(line.starts_with("gave up after") && line.contains("transport error"), "{line}");
    // Logged with `{:#}` (or any chain walker), the transport error appears once, not once in
    // the message and again as each source.
    let chained = full_chain(&err);
    assert_eq!(chained.matches("transport error").count(), 1, "{chained}");
    assert_eq!(chained, line, "the message already carries every cause");
}

#[tokio::test]
async fn a_lost_response_is_retried_with_the_same_key() {
    // The first attempt's answer comes too late (the server did the work, the client timed out).
    // The attempt timeout leaves the prompt replay seconds to arrive, even on a busy machine.
    let server = Scripted::start([
        Reply::json(201, CREATED).delay(Duration::from_secs(60)),
        Reply::json(201, CREATED).header("idempotent-replayed", "true"),
    ])
    .await;
    let key = OpKey::new_v4();
    let policy = fast().with_attempt_timeout(Duration::from_secs(3)).with_max_elapsed(Duration::from_secs(40));
    let response = post(&Retrier::new(policy), &server, &key).await.expect("success on retry");
    assert_eq!(response.attempts, 2);
    assert!(response.replayed);
    assert_eq!(server.count(), 2);
    assert_all_keys(&server, &key);
}

#[tokio::test]
async fn the_hook_sees_every_attempt_and_its_full_jitter_wait() {
    let server = Scripted::start([
        Reply::problem(503, "x"),
        Reply::problem(429, "slow-down"),
        Reply::problem(502, "x"),
        Reply::problem(504, "x"),
        Reply::problem(503, "x"),
        Reply::json(201, CREATED),
    ])
    .await;
    let cap = Duration::from_millis(40);
    let events = Arc::new(Mutex::new(Vec::new()));
    let sink = events.clone();
    let retrier = Retrier::new(fast().with_delays(cap, cap)).on_attempt(move |attempt| {
        let failed = matches!(attempt.outcome, AttemptOutcome::Failed(_));
        sink.lock().unwrap().push((attempt.number, failed, attempt.next_wait, attempt.to_string()));
    });
    post(&retrier, &server, &OpKey::new_v4()).await.expect("success");
    let events = events.lock().unwrap().clone();
    let numbers: Vec<u32> = events.iter().map(|e| e.0).collect();
    assert_eq!(numbers, [1, 2, 3, 4, 5, 6]);
    assert!(events[..5].iter().all(|e| e.1 && e.2.is_some()), "{events:?}");
    assert!(!events[5].1 && events[5].2.is_none(), "{events:?}");
    let waits: Vec<Duration> = events[..5].iter().filter_map(|e| e.2).collect();
    assert!(waits.iter().all(|w| *w <= cap), "a wait exceeded its cap: {waits:?}");
    // Full jitter draws from [0, cap]: five draws all at the cap would mean no jitter at all.
    assert!(waits.iter().any(|w| *w < cap.mul_f64(0.99)), "no jitter: {waits:?}");
    assert!(events[1].3.contains("429") && events[1].3.contains("retrying in"), "{}", events[1].3);
}

#[tokio::test]
async fn reads_without_a_key_send_no_key_header() {
    let server = Scripted::start([Reply::problem(503, "x"), Reply::json(200, "{}")]).await;
    let http = reqwest::Client::new();
    let url = format!("{}/v1/things", server.url);
    let response = Retrier::new(fast()).send(None, || http.get(&url)).await.expect("success");
    assert_eq!(response.attempts, 2);
    assert_eq!(server.keys(), [None, None]);
}

#[test]
fn keys_are_validated_and_fresh() {
    assert!(OpKey::parse("").is_err());
    assert!(OpKey::parse(&"a".repeat(129)).is_err());
    assert!(OpKey::parse("has space").is_err());
    assert!(OpKey::parse("caf\u{e9}").is_err());
    assert_eq!(OpKey::parse(&"a".repeat(128)).unwrap().as_str().len(), 128);
    let (a, b) = (OpKey::new_v4(), OpKey::new_v4());
    assert_ne!(a, b);
    assert_eq!(a.as_str().len(), 36);
    assert_eq!(OpKey::parse(a.as_str()).unwrap(), a);
}
