//! The simulator over HTTP: routes, faults, and the counters.

use serde_json::{Value, json};
use tokio::sync::oneshot;

use super::*;
use crate::hypervisor::api::{Vm, VmList};

/// Serves a fresh simulator on an ephemeral loopback port.
async fn start(config: SimConfig) -> (Simulator, String) {
    let sim = Simulator::new(config);
    let url = serve_on_loopback(&sim).await;
    (sim, url)
}

/// Serves `sim` on an ephemeral loopback port; its base URL.
pub(super) async fn serve_on_loopback(sim: &Simulator) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let url = format!("http://{}", listener.local_addr().expect("addr"));
    tokio::spawn(serve(listener, sim.clone(), std::future::pending()));
    url
}

fn boot_body(tag: &str) -> Value {
    json!({"image": "ubuntu-24.04", "cpu": 2, "memory_gb": 4, "tag": tag})
}

async fn post(url: &str, body: &Value) -> reqwest::Response {
    reqwest::Client::new().post(url).json(body).send().await.expect("send")
}

#[tokio::test]
async fn bad_json_is_400_and_missing_fields_are_422_and_nothing_boots() {
    let (sim, url) = start(SimConfig::default()).await;
    let http = reqwest::Client::new();
    let send_raw = |body: &'static str| {
        http.post(format!("{url}/v1/vms")).header("content-type", "application/json").body(body).send()
    };

    let response = send_raw("{\"image\": ").await.expect("send");
    assert_eq!(response.status(), 400);
    assert_eq!(response.headers()["content-type"], "application/problem+json");
    let problem: Value = response.json().await.expect("json body");
    assert_eq!(problem["type"], "/problems/invalid-json");
    assert_eq!(problem["status"], 400);

    let response = send_raw(r#"{"image": "x", "cpu": 1, "memory_gb": 1}"#).await.expect("send");
    assert_eq!(response.status(), 422);
    let problem: Value = response.json().await.expect("json body");
    assert_eq!(problem["type"], "/problems/invalid-request");

    let response = send_raw(r#"{"image": "x", "cpu": "two", "memory_gb": 1, "tag": "t"}"#).await.expect("send");
    assert_eq!(response.status(), 422);

    let response = post(&format!("{url}/v1/vms"), &json!({"image": "x", "cpu": 0, "memory_gb": 1, "tag": "t"})).await;
    assert_eq!(response.status(), 422);

    let response = send_raw("[]").await.expect("send");
    assert_eq!(response.status(), 422);

    let response = http
        .post(format!("{url}/v1/vms/vm-1/reboot"))
        .header("content-type", "application/json")
        .body("not json")
        .send()
        .await
        .expect("send");
    assert_eq!(response.status(), 400);

    let response = http.put(format!("{url}/v1/faults")).json(&json!({"fail_before": 2.0})).send().await.expect("send");
    assert_eq!(response.status(), 422);

    assert_eq!(sim.stats(), SimStats::default());
}

#[tokio::test]
async fn boot_answers_201_with_a_generated_id_and_the_tag() {
    let (sim, url) = start(SimConfig::default()).await;
    let response = post(&format!("{url}/v1/vms"), &boot_body("tag-a")).await;
    assert_eq!(response.status(), 201);
    let location = response.headers()["location"].to_str().expect("ascii").to_owned();
    let vm: Value = response.json().await.expect("json");
    let vm_id = vm["vm_id"].as_str().expect("vm_id");
    assert!(vm_id.starts_with("vm-") && vm_id[3..].chars().all(|c| c.is_ascii_hexdigit()), "{vm_id}");
    assert_eq!(vm["tag"], "tag-a");
    assert_eq!(vm["state"], "running");
    assert_eq!(location, format!("/v1/vms/{vm_id}"));

    let detail: Value = reqwest::get(format!("{url}/v1/vms/{vm_id}")).await.expect("get").json().await.expect("json");
    assert_eq!(detail["image"], "ubuntu-24.04");
    assert_eq!(detail["cpu"], 2);
    assert_eq!(detail["memory_gb"], 4);
    assert_eq!(detail["reboot_tags"], json!([]));
    assert_eq!(sim.stats().running, 1);
}

#[tokio::test]
async fn stats_count_duplicate_boot_tags_even_after_delete_but_not_empty_tags() {
    let (sim, url) = start(SimConfig::default()).await;
    let http = reqwest::Client::new();
    let first: Vm = post(&format!("{url}/v1/vms"), &boot_body("t1")).await.json().await.expect("json");
    post(&format!("{url}/v1/vms"), &boot_body("t2")).await;
    post(&format!("{url}/v1/vms"), &boot_body("")).await;
    post(&format!("{url}/v1/vms"), &boot_body("")).await;
    assert_eq!(sim.stats().duplicate_boot_tags, 0);

    let response = http.delete(format!("{url}/v1/vms/{}", first.vm_id)).send().await.expect("delete");
    assert_eq!(response.status(), 204);
    let response = http.delete(format!("{url}/v1/vms/{}", first.vm_id)).send().await.expect("delete");
    assert_eq!(response.status(), 404);

    // t1's VM is gone, but booting t1 again is still a second boot for that tag.
    post(&format!("{url}/v1/vms"), &boot_body("t1")).await;
    let stats: SimStats = reqwest::get(format!("{url}/v1/stats")).await.expect("stats").json().await.expect("json");
    assert_eq!(
        stats,
        SimStats {
            boots_total: 5,
            running: 4,
            duplicate_boot_tags: 1,
            reboots_total: 0,
            duplicate_reboot_tags: 0,
            ..SimStats::default()
        }
    );
    assert_eq!(stats, sim.stats());
}

#[tokio::test]
async fn reboots_append_tags_and_count_repeats_per_vm() {
    let (sim, url) = start(SimConfig::default()).await;
    let a: Vm = post(&format!("{url}/v1/vms"), &boot_body("a")).await.json().await.expect("json");
    let b: Vm = post(&format!("{url}/v1/vms"), &boot_body("b")).await.json().await.expect("json");
    for (vm, tag) in [(&a, "r1"), (&a, "r1"), (&a, "r2"), (&b, "r1")] {
        let response = post(&format!("{url}/v1/vms/{}/reboot", vm.vm_id), &json!({"tag": tag})).await;
        assert_eq!(response.status(), 202);
    }
    let response = post(&format!("{url}/v1/vms/vm-0000/reboot"), &json!({"tag": "r1"})).await;
    assert_eq!(response.status(), 404);

    let detail: VmDetail =
        reqwest::get(format!("{url}/v1/vms/{}", a.vm_id)).await.expect("get").json().await.expect("json");
    assert_eq!(detail.reboot_tags, ["r1", "r1", "r2"]);
    let stats = sim.stats();
    assert_eq!(stats.reboots_total, 4);
    // Only a's second r1 repeats; b's r1 is b's first.
    assert_eq!(stats.duplicate_reboot_tags, 1);
}

#[tokio::test]
async fn list_filters_by_exact_tag_in_boot_order() {
    let (_sim, url) = start(SimConfig::default()).await;
    let mut booted = Vec::new();
    for tag in ["x", "y", "x", "x y"] {
        let vm: Vm = post(&format!("{url}/v1/vms"), &boot_body(tag)).await.json().await.expect("json");
        booted.push(vm.vm_id);
    }
    let list = |query: &'static str| {
        let url = url.clone();
        async move {
            let body: VmList<VmDetail> =
                reqwest::get(format!("{url}/v1/vms{query}")).await.expect("list").json().await.expect("json");
            body.vms.into_iter().map(|vm| vm.vm_id).collect::<Vec<_>>()
        }
    };
    assert_eq!(list("").await, booted);
    assert_eq!(list("?tag=x").await, [booted[0].clone(), booted[2].clone()]);
    assert_eq!(list("?tag=x%20y").await, [booted[3].clone()]);
    assert!(list("?tag=z").await.is_empty());
    assert!(list("?tag=").await.is_empty());
}

#[tokio::test]
async fn fail_before_answers_503_and_does_nothing_but_reads_are_never_faulted() {
    let (sim, url) = start(SimConfig { fail_before: 1.0, ..SimConfig::default() }).await;
    let response = post(&format!("{url}/v1/vms"), &boot_body("t")).await;
    assert_eq!(response.status(), 503);
    let problem: Value = response.json().await.expect("json");
    assert_eq!(problem["type"], "/problems/unavailable");
    assert_eq!(sim.stats(), SimStats::default());

    assert_eq!(reqwest::get(format!("{url}/v1/vms")).await.expect("list").status(), 200);
    assert_eq!(reqwest::get(format!("{url}/v1/stats")).await.expect("stats").status(), 200);

    // Lift the fault over HTTP and the same request goes through.
    let http = reqwest::Client::new();
    let response = http.put(format!("{url}/v1/faults")).json(&json!({"fail_before": 0.0})).send().await.expect("put");
    assert_eq!(response.status(), 204);
    assert_eq!(sim.faults(), SimConfig::default());
    assert_eq!(post(&format!("{url}/v1/vms"), &boot_body("t")).await.status(), 201);
    assert_eq!(sim.stats().boots_total, 1);
}

#[tokio::test]
async fn fail_after_does_the_work_then_drops_the_connection_without_a_status() {
    let (sim, url) = start(SimConfig { fail_after: 1.0, ..SimConfig::default() }).await;
    let err = reqwest::Client::new()
        .post(format!("{url}/v1/vms"))
        .json(&boot_body("lost"))
        .send()
        .await
        .expect_err("the answer must be lost, not delivered");
    assert!(err.status().is_none(), "{err:?}");
    assert!(!err.is_connect() && !err.is_timeout(), "{err:?}");
    assert_eq!(sim.stats().boots_total, 1);
    assert_eq!(sim.state().list(Some("lost")).len(), 1);
}

#[tokio::test]
async fn a_caller_that_hangs_up_during_latency_does_not_cancel_the_boot() {
    // The caller hangs up a quarter of the way into the latency: late enough that the simulator
    // has read the request on a busy machine (CI once saw a 50 ms timeout hang up before it had,
    // so that nothing was booted), early enough that it is still sleeping.
    let (sim, url) = start(SimConfig { latency: Duration::from_millis(2000), ..SimConfig::default() }).await;
    let err = reqwest::Client::new()
        .post(format!("{url}/v1/vms"))
        .json(&boot_body("slow"))
        .timeout(Duration::from_millis(500))
        .send()
        .await
        .expect_err("times out");
    assert!(err.is_timeout(), "{err:?}");
    assert_eq!(sim.stats().boots_total, 0, "still sleeping");
    // Poll rather than sleep a fixed time: the machine may be busy.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while sim.stats().boots_total == 0 && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(sim.stats().boots_total, 1, "the boot landed after the caller gave up");
}

#[tokio::test]
async fn faults_round_trip_over_http_and_are_clamped_in_process() {
    let (sim, url) = start(SimConfig::default()).await;
    let http = reqwest::Client::new();
    let response = http
        .put(format!("{url}/v1/faults"))
        .json(&json!({"fail_before": 0.25, "fail_after": 0.5, "latency_ms": 7}))
        .send()
        .await
        .expect("put");
    assert_eq!(response.status(), 204);
    let set =
        SimConfig { fail_before: 0.25, fail_after: 0.5, latency: Duration::from_millis(7), ..SimConfig::default() };
    assert_eq!(sim.faults(), set);
    let faults: Value = reqwest::get(format!("{url}/v1/faults")).await.expect("get").json().await.expect("json");
    assert_eq!(
        faults,
        json!({"fail_before": 0.25, "fail_after": 0.5, "latency_ms": 7, "slow": 0.0, "slow_ms": 0, "refuse": 0.0})
    );

    let all =
        json!({"fail_before": 0.0, "fail_after": 0.0, "latency_ms": 0, "slow": 0.5, "slow_ms": 1500, "refuse": 0.125});
    let response = http.put(format!("{url}/v1/faults")).json(&all).send().await.expect("put");
    assert_eq!(response.status(), 204);
    let faults: Value = reqwest::get(format!("{url}/v1/faults")).await.expect("get").json().await.expect("json");
    assert_eq!(faults, all);
    let response = http.put(format!("{url}/v1/faults")).json(&json!({"refuse": 1.5})).send().await.expect("put");
    assert_eq!(response.status(), 422);

    sim.set_faults(SimConfig {
        fail_before: f64::NAN,
        fail_after: 3.0,
        slow: -1.0,
        refuse: 2.0,
        ..SimConfig::default()
    });
    assert_eq!(
        sim.faults(),
        SimConfig { fail_before: 0.0, fail_after: 1.0, slow: 0.0, refuse: 1.0, ..SimConfig::default() }
    );
}

#[tokio::test]
async fn refuse_answers_409_at_once_and_does_nothing() {
    let (sim, url) = start(SimConfig { refuse: 1.0, latency: Duration::from_secs(60), ..SimConfig::default() }).await;
    let http = reqwest::Client::builder().timeout(Duration::from_secs(30)).build().expect("client");
    let response = http.post(format!("{url}/v1/vms")).json(&boot_body("r")).send().await.expect("not delayed");
    assert_eq!(response.status(), 409);
    assert_eq!(response.headers()["content-type"], "application/problem+json");
    let problem: Value = response.json().await.expect("json");
    assert_eq!(problem["type"], "/problems/refused");
    let response = http.delete(format!("{url}/v1/vms/vm-0")).send().await.expect("delete");
    assert_eq!(response.status(), 409, "refused before looking the VM up");
    assert_eq!(sim.stats(), SimStats::default());
    assert!(sim.state().list(Some("r")).is_empty());
}

#[tokio::test]
async fn a_slow_call_lands_after_its_caller_gave_up() {
    let (sim, url) =
        start(SimConfig { slow: 1.0, slow_latency: Duration::from_millis(800), ..SimConfig::default() }).await;
    let err = reqwest::Client::new()
        .post(format!("{url}/v1/vms"))
        .json(&boot_body("late"))
        .timeout(Duration::from_millis(100))
        .send()
        .await
        .expect_err("times out");
    assert!(err.is_timeout(), "{err:?}");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while sim.stats().boots_total == 0 && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(sim.state().list(Some("late")).len(), 1, "the slow boot landed late");

    // With no slow share, the same latency is never added.
    sim.set_faults(SimConfig { slow: 0.0, slow_latency: Duration::from_secs(60), ..SimConfig::default() });
    let response = reqwest::Client::builder()
        .timeout(Duration::from_secs(30))
        .build()
        .expect("client")
        .post(format!("{url}/v1/vms"))
        .json(&boot_body("fast"))
        .send()
        .await
        .expect("answered without the slow latency");
    assert_eq!(response.status(), 201);
}

#[tokio::test]
async fn unknown_routes_and_methods_answer_json() {
    let (_sim, url) = start(SimConfig::default()).await;
    let response = reqwest::get(format!("{url}/v2/nothing")).await.expect("get");
    assert_eq!(response.status(), 404);
    assert_eq!(response.headers()["content-type"], "application/problem+json");
    let response = reqwest::Client::new().patch(format!("{url}/v1/vms")).send().await.expect("patch");
    assert_eq!(response.status(), 405);
    assert_eq!(response.headers()["content-type"], "application/problem+json");
}

#[tokio::test]
async fn serve_returns_once_shutdown_resolves() {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let (stop, stopped) = oneshot::channel::<()>();
    let server = tokio::spawn(serve(listener, Simulator::new(SimConfig::default()), async {
        let _ = stopped.await;
    }));
    stop.send(()).expect("server alive");
    let result = tokio::time::timeout(Duration::from_secs(5), server).await.expect("stops in time");
    result.expect("task").expect("serve");
}
