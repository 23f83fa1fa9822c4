//! The client against the simulator (and a few stand-ins): round trips, and which failures are
//! definite and which ambiguous.

use tokio::net::TcpListener;

use super::*;
use crate::hypervisor::sim::{SimConfig, Simulator, serve};

const TIMEOUT: Duration = Duration::from_secs(5);

/// Serves a fresh simulator on an ephemeral loopback port, with a client for it.
async fn start(config: SimConfig) -> (Simulator, HypervisorClient) {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let url = format!("http://{}", listener.local_addr().expect("addr"));
    let sim = Simulator::new(config);
    tokio::spawn(serve(listener, sim.clone(), std::future::pending()));
    (sim, HypervisorClient::new(&url, TIMEOUT).expect("client"))
}

fn boot_req(tag: &str) -> BootRequest {
    BootRequest { image: "debian-13".into(), cpu: 8, memory_gb: 32, tag: tag.into() }
}

#[tokio::test]
async fn boot_list_get_reboot_delete_round_trip() {
    let (sim, client) = start(SimConfig::default()).await;
    let vm = client.boot(&boot_req("boot-1")).await.expect("boot");
    assert_eq!(vm.tag, "boot-1");
    assert_eq!(vm.state, VmState::Running);
    assert!(vm.state == "running");
    let other = client.boot(&boot_req("boot-2")).await.expect("boot");
    assert_ne!(vm.vm_id, other.vm_id);

    assert_eq!(client.list_by_tag("boot-1").await.expect("list"), std::slice::from_ref(&vm));
    assert!(client.list_by_tag("boot-3").await.expect("list").is_empty());
    assert_eq!(client.list_all().await.expect("list"), [vm.clone(), other.clone()]);

    client.reboot(&vm.vm_id, "reboot-1").await.expect("reboot");
    let detail = client.get(&vm.vm_id).await.expect("get").expect("exists");
    assert_eq!(detail.summary(), vm);
    assert_eq!(detail.reboot_tags, ["reboot-1"]);
    assert_eq!((detail.image.as_deref(), detail.cpu, detail.memory_gb), (Some("debian-13"), Some(8), Some(32)));

    assert!(client.delete(&vm.vm_id).await.expect("delete"), "it existed");
    assert!(!client.delete(&vm.vm_id).await.expect("delete again"), "already gone");
    assert_eq!(client.get(&vm.vm_id).await.expect("get"), None);
    assert_eq!(client.list_all().await.expect("list"), [other]);

    let stats = client.stats().await.expect("stats");
    assert_eq!(stats, sim.stats());
    assert_eq!((stats.boots_total, stats.running, stats.reboots_total), (2, 1, 1));
}

#[tokio::test]
async fn stats_count_a_repeated_boot_tag_and_a_repeated_reboot_tag() {
    let (_sim, client) = start(SimConfig::default()).await;
    let vm = client.boot(&boot_req("same")).await.expect("boot");
    client.boot(&boot_req("same")).await.expect("boot");
    client.reboot(&vm.vm_id, "r").await.expect("reboot");
    client.reboot(&vm.vm_id, "r").await.expect("reboot");
    let stats = client.stats().await.expect("stats");
    assert_eq!(
        stats,
        SimStats {
            boots_total: 2,
            running: 2,
            duplicate_boot_tags: 1,
            reboots_total: 2,
            duplicate_reboot_tags: 1,
            // Each call carried its tag as its Idempotency-Key (key propagation).
            tag_keyed_calls: 4,
            ..SimStats::default()
        }
    );
}

/// Key propagation (docs/protocol.md#records): a boot, a reboot and a flash each carry their tag as
/// `Idempotency-Key: "<tag>"`, which the simulator counts; reads carry none, and a call
/// made without the client (no header) is not counted.
#[tokio::test]
async fn boot_reboot_and_flash_carry_their_tag_as_their_idempotency_key() {
    let (sim, client) = start(SimConfig::default()).await;
    let vm = client.boot(&boot_req("wkr-1.boot")).await.expect("boot");
    client.reboot(&vm.vm_id, "wkr-1.reboot").await.expect("reboot");
    let flash = FlashRequest { version: "2.0.1".into(), tag: "node-1.flash".into() };
    client.flash("node-1", &flash).await.expect("flash");
    client.list_by_tag("wkr-1.boot").await.expect("list");
    assert_eq!(sim.stats().tag_keyed_calls, 3, "{:?}", sim.stats());
    let url = client.http.base.as_str().trim_end_matches('/').to_owned();
    let raw =
        reqwest::Client::new().post(format!("{url}/v1/vms")).json(&boot_req("raw")).send().await.expect("raw boot");
    assert_eq!(raw.status(), StatusCode::CREATED);
    // A bare key is not the structured field string form: not counted either.
    let bare = reqwest::Client::new()
        .post(format!("{url}/v1/vms"))
        .header("idempotency-key", "bare")
        .json(&boot_req("bare"))
        .send()
        .await
        .expect("bare boot");
    assert_eq!(bare.status(), StatusCode::CREATED);
    let stats = sim.stats();
    assert_eq!((stats.boots_total, stats.reboots_total, stats.flashes_total), (3, 1, 1), "{stats:?}");
    assert_eq!(stats.tag_keyed_calls, 3, "{stats:?}");
}

#[tokio::test]
async fn fail_before_is_an_ambiguous_5xx_and_nothing_boots() {
    let (sim, client) = start(SimConfig { fail_before: 1.0, ..SimConfig::default() }).await;
    let err = client.boot(&boot_req("fb")).await.expect_err("503");
    assert!(matches!(err, HvError::Status { status: StatusCode::SERVICE_UNAVAILABLE, .. }), "{err:?}");
    assert_eq!(err.status(), Some(StatusCode::SERVICE_UNAVAILABLE));
    assert!(err.may_have_happened(), "a 5xx says nothing about whether the work was done");
    assert_eq!(sim.stats().boots_total, 0);
    assert!(client.list_by_tag("fb").await.expect("reads are not faulted").is_empty());
}

#[tokio::test]
async fn fail_after_is_ambiguous_and_the_vm_exists() {
    let (sim, client) = start(SimConfig { fail_after: 1.0, ..SimConfig::default() }).await;
    let err = client.boot(&boot_req("fa")).await.expect_err("answer lost");
    assert!(matches!(err, HvError::Transport(_)), "{err:?}");
    assert_eq!(err.status(), None);
    assert!(err.may_have_happened());
    let found = client.list_by_tag("fa").await.expect("list");
    assert_eq!(found.len(), 1, "the boot happened: reconciliation by tag finds it");

    // The same holds for reboot and delete: done, then the answer is lost.
    let vm_id = found[0].vm_id.clone();
    let err = client.reboot(&vm_id, "r").await.expect_err("answer lost");
    assert!(err.may_have_happened(), "{err:?}");
    assert_eq!(sim.stats().reboots_total, 1);
    let err = client.delete(&vm_id).await.expect_err("answer lost");
    assert!(err.may_have_happened(), "{err:?}");
    assert_eq!(sim.stats().running, 0);
}

#[tokio::test]
async fn a_timeout_is_ambiguous() {
    // The client's timeout leaves a busy machine time to send the request; the latency makes
    // sure the answer comes after it.
    let (sim, patient) = start(SimConfig { latency: Duration::from_millis(2000), ..SimConfig::default() }).await;
    let client = HypervisorClient::new(patient.http.base.as_str(), Duration::from_millis(500)).expect("client");
    let err = client.boot(&boot_req("slow")).await.expect_err("timeout");
    assert!(matches!(err, HvError::Timeout(_)), "{err:?}");
    assert!(err.may_have_happened());
    // And it does happen, after the client gave up (polled: the machine may be busy).
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while sim.stats().boots_total == 0 && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(sim.stats().boots_total, 1);
}

#[tokio::test]
async fn connection_refused_is_definite() {
    // Bind then drop a listener so the port has nothing listening on it.
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    drop(listener);
    let client = HypervisorClient::new(&format!("http://{addr}"), TIMEOUT).expect("client");
    let err = client.boot(&boot_req("nowhere")).await.expect_err("refused");
    assert!(matches!(err, HvError::Connect(_)), "{err:?}");
    assert!(!err.may_have_happened());
    let err = client.list_by_tag("nowhere").await.expect_err("refused");
    assert!(!err.may_have_happened(), "{err:?}");
}

/// A downstream that answers each call with another success than the simulator and only
/// what the contract promises (issue 24, hole 5): every call succeeds.
#[tokio::test]
async fn terse_successes_are_successes() {
    use axum::routing::{delete, get, post};
    let app = axum::Router::new()
        .route("/v1/vms", post(|| async { (StatusCode::OK, axum::Json(serde_json::json!({"vm_id": "vm-1"}))) }))
        .route("/v1/vms/{vm_id}/reboot", post(|| async { StatusCode::NO_CONTENT }))
        .route("/v1/vms/{vm_id}", delete(|| async { (StatusCode::OK, "deleted") }))
        .route("/v1/bmc/{node}/flash", post(|| async { (StatusCode::ACCEPTED, "{\"node_id\":\"n\"}") }))
        .route("/v1/bmc", get(|| async { axum::Json(serde_json::json!({"nodes": [{"node_id": "n"}]})) }));
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let url = format!("http://{}", listener.local_addr().expect("addr"));
    tokio::spawn(async move { axum::serve(listener, app).await });
    let client = HypervisorClient::new(&url, TIMEOUT).expect("client");
    let vm = client.boot(&boot_req("t")).await.expect("a 200 with only vm_id is a boot");
    assert_eq!((vm.vm_id.as_str(), vm.tag.as_str()), ("vm-1", "t"));
    client.reboot("vm-1", "r").await.expect("a 204 is a reboot");
    assert!(client.delete("vm-1").await.expect("a 200 is a delete"));
    client.flash("n", &FlashRequest { version: "2".into(), tag: "f".into() }).await.expect("a terse 202");
    assert_eq!(client.bmcs_by_tag("f").await.expect("a terse listing"), 1);
}

#[tokio::test]
async fn refusals_are_definite_and_a_missing_vm_is_none() {
    let (sim, client) = start(SimConfig::default()).await;
    assert_eq!(client.get("vm-0123456789abcdef").await.expect("get"), None);
    // An id that would escape its path segment is encoded, not routed elsewhere.
    assert_eq!(client.get("x/reboot").await.expect("get"), None);

    let err = client.reboot("vm-0123456789abcdef", "r").await.expect_err("404");
    assert_eq!(err.status(), Some(StatusCode::NOT_FOUND));
    assert!(!err.may_have_happened());

    let err = client.boot(&BootRequest { cpu: 0, ..boot_req("bad") }).await.expect_err("422");
    assert!(matches!(&err, HvError::Status { status, body } if *status == 422 && body.contains("cpu")), "{err:?}");
    assert!(!err.may_have_happened());
    assert_eq!(sim.stats(), SimStats::default());
}

#[test]
fn only_4xx_statuses_are_definite() {
    let status = |code: u16| HvError::Status { status: StatusCode::from_u16(code).expect("code"), body: String::new() };
    for code in [400, 404, 409, 422, 429] {
        assert!(!status(code).may_have_happened(), "{code}");
    }
    for code in [200, 302, 500, 502, 503, 504] {
        assert!(status(code).may_have_happened(), "{code}");
    }
}

#[test]
fn unusable_base_urls_are_rejected_up_front() {
    for url in ["", "not a url", "ftp://host", "mailto:a@b", "http://host/?q=1"] {
        let err = HypervisorClient::new(url, TIMEOUT).expect_err(url);
        assert!(matches!(err, HvError::InvalidUrl { .. }), "{url}: {err:?}");
        assert!(!err.may_have_happened());
    }
    assert!(HypervisorClient::new("http://127.0.0.1:8090/", TIMEOUT).is_ok());
}

/// Serves a fresh simulator over TLS on an ephemeral loopback port, with a certificate for
/// 127.0.0.1 from a fresh private CA: its URL, the simulator and the CA's PEM file.
async fn start_tls(dir: &Path) -> (String, Simulator, std::path::PathBuf) {
    start_tls_with(dir, Simulator::new(SimConfig::default())).await
}

/// [`start_tls`] with a given simulator.
async fn start_tls_with(dir: &Path, sim: Simulator) -> (String, Simulator, std::path::PathBuf) {
    use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair};
    let ca_key = KeyPair::generate().expect("key");
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).expect("params");
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca_params.distinguished_name.push(DnType::CommonName, "hypervisor test CA");
    let ca_cert = ca_params.self_signed(&ca_key).expect("CA");
    let issuer = Issuer::new(ca_params, ca_key);
    let leaf_key = KeyPair::generate().expect("key");
    let leaf = CertificateParams::new(vec!["127.0.0.1".to_owned()])
        .expect("params")
        .signed_by(&leaf_key, &issuer)
        .expect("leaf");
    let ca_file = dir.join("ca.pem");
    std::fs::write(&ca_file, ca_cert.pem()).expect("write CA");
    let key = rustls::pki_types::PrivatePkcs8KeyDer::from(leaf_key.serialize_der());
    let config = rustls::ServerConfig::builder()
        .with_no_client_auth()
        .with_single_cert(vec![leaf.der().clone()], key.into())
        .expect("server config");
    let acceptor = tokio_rustls::TlsAcceptor::from(std::sync::Arc::new(config));

    // The simulator on a plain port, behind a TLS-terminating proxy.
    let plain = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let upstream = plain.local_addr().expect("addr");
    tokio::spawn(serve(plain, sim.clone(), std::future::pending()));
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let url = format!("https://{}", listener.local_addr().expect("addr"));
    tokio::spawn(async move {
        while let Ok((tcp, _)) = listener.accept().await {
            let acceptor = acceptor.clone();
            tokio::spawn(async move {
                let Ok(mut tls) = acceptor.accept(tcp).await else { return };
                let Ok(mut plain) = tokio::net::TcpStream::connect(upstream).await else { return };
                let _ = tokio::io::copy_bidirectional(&mut tls, &mut plain).await;
            });
        }
    });
    (url, sim, ca_file)
}

#[tokio::test]
async fn an_https_hypervisor_works_with_its_ca_and_an_untrusted_one_is_definite() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (url, sim, ca_file) = start_tls(dir.path()).await;
    let client = HypervisorClient::with_ca_cert(&url, TIMEOUT, Some(&ca_file)).expect("client");
    let vm = client.boot(&boot_req("tls-1")).await.expect("boot over https");
    assert_eq!(client.list_by_tag("tls-1").await.expect("list"), [vm]);

    // Without the CA the handshake fails: nothing was sent, so it is definite.
    let untrusted = HypervisorClient::new(&url, TIMEOUT).expect("client");
    let err = untrusted.boot(&boot_req("tls-2")).await.expect_err("untrusted certificate");
    assert!(matches!(err, HvError::Connect(_)), "{err:?}");
    assert!(!err.may_have_happened());
    assert_eq!(sim.stats().boots_total, 1);

    for bad in [Path::new("/dev/null"), &dir.path().join("missing.pem")] {
        let err = HypervisorClient::with_ca_cert(&url, TIMEOUT, Some(bad)).expect_err("not a CA file");
        assert!(matches!(err, HvError::InvalidCaCert { .. }), "{err:?}");
    }
}

/// `--bmc-url redfish+https://...` with `--bmc-ca-cert`: the same TLS as the hypervisor's.
#[tokio::test]
async fn a_redfish_bmc_over_https_works_with_its_ca_and_an_untrusted_one_is_definite() {
    use crate::hypervisor::redfish::{Firmware, RedfishBmc, Target, TaskLookup, TaskOutcome};
    use crate::hypervisor::sim::RedfishOptions;
    let dir = tempfile::tempdir().expect("tempdir");
    let sim = Simulator::new(SimConfig::default())
        .with_flash_time(Duration::from_millis(200))
        .with_redfish(RedfishOptions { systems: 2, ..RedfishOptions::default() });
    let (url, sim, ca_file) = start_tls_with(dir.path(), sim).await;
    let bmc_url = format!("redfish+{url}");
    let images = "https://images.test/fw";
    let bmc = RedfishBmc::new(&bmc_url, TIMEOUT, Some(&ca_file), images).expect("client");
    let target = bmc.target("node-0002").await.expect("systems over https");
    assert_eq!(target, Target::System("/redfish/v1/Systems/node-0002".into()));
    let followed = bmc.flash(&target, "4.2", "tls-flash").await.expect("flash over https");
    let TaskLookup::Found(task) = bmc.find_task("tls-flash").await.expect("tasks") else { panic!("by its tag") };
    assert!(followed.is_some_and(|monitor| monitor.starts_with("/redfish/v1/TaskService/")), "a path on the BMC");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while bmc.task_outcome(&task).await.expect("task") == TaskOutcome::Running {
        assert!(tokio::time::Instant::now() < deadline, "the flash did not end");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(bmc.runs_version("node-0002", "4.2").await.expect("inventory"), Firmware::Runs);

    let untrusted = RedfishBmc::new(&bmc_url, TIMEOUT, None, images).expect("client");
    let err = untrusted.flash(&target, "4.3", "tls-untrusted").await.expect_err("untrusted certificate");
    assert!(matches!(err, HvError::Connect(_)), "{err:?}");
    assert!(!err.may_have_happened());
    assert_eq!(sim.stats().flashes_total, 1);
    // The flash carried its tag as its Idempotency-Key (key propagation).
    assert_eq!(sim.stats().tag_keyed_calls, 1);
}

#[tokio::test]
async fn a_base_path_prefix_is_kept() {
    let (_sim, client) = start(SimConfig::default()).await;
    let prefixed = HypervisorClient::new(&format!("{}hv/", client.http.base), TIMEOUT).expect("client");
    assert_eq!(prefixed.http.url(&["v1", "vms", "a b"], Some("t&u")).path(), "/hv/v1/vms/a%20b");
    assert_eq!(prefixed.http.url(&["v1", "vms"], Some("t&u")).query(), Some("tag=t%26u"));
    // Against the simulator (no prefix), a prefixed path is an unknown route: a definite 404.
    let err = prefixed.list_all().await.expect_err("no such route");
    assert_eq!(err.status(), Some(StatusCode::NOT_FOUND));
}
