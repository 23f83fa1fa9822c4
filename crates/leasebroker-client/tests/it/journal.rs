//! The durable journal on temp SQLite files.

use leasebroker_client::journal::{Journal, JournalError, RequestFingerprint};

use crate::full_chain;

fn create(cpu: u32) -> RequestFingerprint {
    RequestFingerprint::of("POST", "/v1/workers", format!(r#"{{"image":"img","cpu":{cpu},"memory_gb":4}}"#).as_bytes())
}

#[tokio::test]
async fn begin_twice_returns_the_same_key() {
    let dir = tempfile::tempdir().unwrap();
    let journal = Journal::open(dir.path().join("j.db")).await.unwrap();
    let first = journal.begin("op-1", &create(2)).await.unwrap();
    let again = journal.begin("op-1", &create(2)).await.unwrap();
    assert_eq!(first, again);
    let other = journal.begin("op-2", &create(2)).await.unwrap();
    assert_ne!(first, other, "two operations must not share a key");
}

#[tokio::test]
async fn a_different_request_under_one_op_id_is_refused_and_keeps_the_key() {
    let dir = tempfile::tempdir().unwrap();
    let journal = Journal::open(dir.path().join("j.db")).await.unwrap();
    let key = journal.begin("op-1", &create(2)).await.unwrap();
    let err = journal.begin("op-1", &create(128)).await.expect_err("changed request");
    match err {
        JournalError::RequestChanged { op_id, recorded, requested } => {
            assert_eq!(op_id, "op-1");
            assert_eq!(recorded, create(2).as_str());
            assert_eq!(requested, create(128).as_str());
        }
        other => panic!("expected RequestChanged, got {other:?}"),
    }
    let delete = RequestFingerprint::of("DELETE", "/v1/workers/wkr-1", b"");
    assert!(matches!(journal.begin("op-1", &delete).await, Err(JournalError::RequestChanged { .. })));
    assert_eq!(journal.begin("op-1", &create(2)).await.unwrap(), key);
}

#[tokio::test]
async fn a_key_is_committed_before_begin_returns_and_survives_reopen() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("nested/state/j.db");
    let journal = Journal::open(&path).await.unwrap();
    let key = journal.begin("op-1", &create(2)).await.unwrap();
    // Another connection sees it at once: it was committed, not buffered in this one.
    let reader = Journal::open(&path).await.unwrap();
    assert_eq!(reader.entry("op-1").await.unwrap().expect("committed").key, key);
    reader.close().await;
    journal.finish("op-1", 201, br#"{"id":"wkr-1"}"#).await.unwrap();
    // Dropped without close(), as a killed process would leave it.
    drop(journal);

    let reopened = Journal::open(&path).await.unwrap();
    assert_eq!(reopened.begin("op-1", &create(2)).await.unwrap(), key);
    let entry = reopened.entry("op-1").await.unwrap().unwrap();
    assert_eq!(entry.fingerprint, create(2));
    assert!(entry.created_at.ends_with('Z'), "{}", entry.created_at);
    let outcome = entry.outcome.expect("finished");
    assert_eq!((outcome.status, outcome.body.as_slice()), (201, br#"{"id":"wkr-1"}"#.as_slice()));
    assert!(reopened.entry("op-unknown").await.unwrap().is_none());
}

#[tokio::test]
async fn finish_of_an_unknown_op_is_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let journal = Journal::open(dir.path().join("j.db")).await.unwrap();
    assert!(matches!(journal.finish("never-begun", 201, b"").await, Err(JournalError::UnknownOp(_))));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn racing_journals_on_one_file_agree_on_one_key() {
    // Each task has its own Journal (its own SQLite connection), as separate processes would, and
    // all of them open the fresh file at the same moment: SQLite answers some of those opens with
    // an immediate SQLITE_BUSY, which open() must wait out rather than fail.
    for round in 0..20 {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("j.db");
        let barrier = std::sync::Arc::new(tokio::sync::Barrier::new(8));
        let tasks: Vec<_> = (0..8)
            .map(|_| {
                let (path, barrier) = (path.clone(), barrier.clone());
                tokio::spawn(async move {
                    // Nothing that can fail comes before the barrier, so one failure cannot strand the rest.
                    barrier.wait().await;
                    let journal = Journal::open(&path).await?;
                    journal.begin("shared-op", &create(2)).await
                })
            })
            .collect();
        let mut keys = Vec::new();
        for task in tasks {
            let outcome = tokio::time::timeout(std::time::Duration::from_secs(60), task)
                .await
                .unwrap_or_else(|_| panic!("round {round}: a racer hung"));
            keys.push(outcome.unwrap().unwrap_or_else(|e| panic!("round {round}: a racer failed: {e}")));
        }
        assert!(keys.iter().all(|k| *k == keys[0]), "round {round}: racers got different keys: {keys:?}");
    }
}

#[cfg(unix)]
#[tokio::test]
async fn the_journal_and_its_wal_are_private_in_a_private_directory() {
    use std::os::unix::fs::PermissionsExt;
    let mode = |path: &std::path::Path| std::fs::metadata(path).unwrap().permissions().mode() & 0o777;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("state/lbctl/j.db");
    let journal = Journal::open(&path).await.unwrap();
    journal.begin("op-1", &create(2)).await.unwrap();
    // While it is open, SQLite's WAL and shared-memory files exist beside it.
    for file in [path.clone(), path.with_extension("db-wal"), path.with_extension("db-shm")] {
        assert_eq!(mode(&file), 0o600, "{} is {:o}", file.display(), mode(&file));
    }
    for created in [dir.path().join("state"), dir.path().join("state/lbctl")] {
        assert_eq!(mode(&created), 0o700, "{} is {:o}", created.display(), mode(&created));
    }
    journal.close().await;

    // A directory that already exists keeps its mode: it is the user's.
    let shared = dir.path().join("shared");
    std::fs::create_dir(&shared).unwrap();
    std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(0o755)).unwrap();
    let journal = Journal::open(shared.join("j.db")).await.unwrap();
    assert_eq!((mode(&shared), mode(&shared.join("j.db"))), (0o755, 0o600));
    journal.close().await;
}

#[tokio::test]
async fn a_recorded_refusal_reads_back_as_the_error_it_was() {
    let dir = tempfile::tempdir().unwrap();
    let journal = Journal::open(dir.path().join("j.db")).await.unwrap();
    journal.begin("op-ok", &create(2)).await.unwrap();
    journal.finish("op-ok", 201, br#"{"id":"wkr-1"}"#).await.unwrap();
    journal.begin("op-404", &create(3)).await.unwrap();
    let problem = br#"{"type":"https://leasebroker.test/problems/not-found","status":404}"#;
    journal.finish("op-404", 404, problem).await.unwrap();
    assert!(journal.entry("op-ok").await.unwrap().unwrap().outcome.unwrap().error().is_none());
    let err = journal.entry("op-404").await.unwrap().unwrap().outcome.unwrap().error().expect("a refusal");
    assert!(
        matches!(&err, leasebroker_client::Error::Refused { status, problem: Some(p) } if *status == 404 && p.is("not-found")),
        "{err:?}"
    );
}

#[tokio::test]
async fn a_journal_that_cannot_be_created_names_the_path_and_its_cause_once() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("not-a-directory");
    std::fs::write(&file, b"").unwrap();
    let err = Journal::open(file.join("lbctl/j.db")).await.expect_err("its parent is a file");
    assert!(matches!(err, JournalError::Io { .. }), "{err:?}");
    let line = err.to_string();
    assert!(line.contains("not-a-directory"), "{line}");
    assert_eq!(full_chain(&err), line, "the message already carries the cause");
}

/// An existing journal (or its WAL) that group or others can read is refused, naming the file
/// and the fix; made private, it opens, with what it held.
#[cfg(unix)]
#[tokio::test]
async fn an_existing_journal_readable_by_others_is_refused() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("j.db");
    let journal = Journal::open(&path).await.unwrap();
    let key = journal.begin("op-1", &create(2)).await.unwrap();
    journal.close().await;
    for (file, mode) in [(path.clone(), 0o644), (path.with_extension("db-wal"), 0o640)] {
        if !file.exists() {
            continue; // a cleanly closed journal may have no WAL left
        }
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(mode)).unwrap();
        let err = Journal::open(&path).await.expect_err("an exposed journal was opened");
        assert!(matches!(err, JournalError::Exposed { .. }), "{err:?}");
        let text = err.to_string();
        assert!(text.contains(&file.display().to_string()) && text.contains("chmod 600"), "{text}");
        assert_eq!(text.lines().count(), 1, "{text}");
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).unwrap();
    }
    let journal = Journal::open(&path).await.unwrap();
    assert_eq!(journal.begin("op-1", &create(2)).await.unwrap(), key, "the same journal");
    journal.close().await;
}
