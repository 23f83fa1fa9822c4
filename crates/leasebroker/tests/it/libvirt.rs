//! A real libvirt/QEMU host (SPEC 3.3a): the real binary with `--hypervisor-url
//! libvirt+qemu:///system`, ground truth read with `virsh` (not through the service's own code).
//! Needs libvirtd running (`scripts/install-libvirt`); without it every test prints SKIPPED and
//! passes, and fails under `CI=true`.

use std::process::Command;

use reqwest::{Method, StatusCode};
use serde_json::json;

use crate::support::{TOKEN, create, send, serve, sqlite_url};

const URI: &str = "qemu:///system";
const URL: &str = "libvirt+qemu:///system";
const NS: &str = "https://leasebroker.example/ns/1";

/// Whether libvirt answers; SKIPPED (or a failure under CI=true) when it does not.
fn libvirt_or_skip(test: &str) -> bool {
    let ok = Command::new("virsh").args(["-c", URI, "version"]).output().is_ok_and(|o| o.status.success());
    if !ok {
        assert!(
            std::env::var("CI").as_deref() != Ok("true"),
            "{test}: libvirt does not answer at {URI} (run scripts/install-libvirt)"
        );
        eprintln!("SKIPPED {test}: libvirt does not answer at {URI} (run scripts/install-libvirt)");
    }
    ok
}

fn virsh(args: &[&str]) -> Option<String> {
    let out = Command::new("virsh").args(["-c", URI]).args(args).output().expect("run virsh");
    out.status.success().then(|| String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The service's metadata element on a domain, as `virsh metadata` prints it.
fn metadata(vm_id: &str) -> Option<String> {
    virsh(&["metadata", vm_id, NS])
}

/// The tag attribute of a domain's metadata element.
fn tag_of(vm_id: &str) -> String {
    let xml = metadata(vm_id).unwrap_or_else(|| panic!("no metadata on {vm_id}"));
    let start = xml.find("tag=\"").expect("tag attribute") + 5;
    xml[start..].split('"').next().expect("closing quote").to_owned()
}

/// Every domain (running or not) whose metadata tag is `tag`.
fn domains_tagged(tag: &str) -> Vec<String> {
    let names = virsh(&["list", "--all", "--name"]).expect("virsh list");
    names
        .lines()
        .map(str::trim)
        .filter(|n| n.starts_with("vm-"))
        .filter(|n| metadata(n).is_some_and(|xml| xml.contains(&format!("tag=\"{tag}\""))))
        .map(str::to_owned)
        .collect()
}

fn running(vm_id: &str) -> bool {
    virsh(&["domstate", vm_id]).is_some_and(|s| s.trim() == "running")
}

/// Removes the domains carrying `tag`, whatever the test's outcome.
struct Cleanup(Vec<String>);

impl Drop for Cleanup {
    fn drop(&mut self) {
        for tag in &self.0 {
            for vm in domains_tagged(tag) {
                let _ = virsh(&["destroy", &vm]);
                let _ = virsh(&["undefine", &vm]);
            }
        }
    }
}

fn body() -> serde_json::Value {
    json!({"image": "worker-base:2025.11", "cpu": 2, "memory_gb": 48})
}

#[tokio::test]
async fn a_create_boots_one_real_domain_reboots_once_per_key_and_delete_removes_it() {
    if !libvirt_or_skip("a_create_boots_one_real_domain_reboots_once_per_key_and_delete_removes_it") {
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let lb = serve(&sqlite_url(&dir), &["--hypervisor-url", URL]);
    let first = create(&lb.url, TOKEN, "lv-create-1", &body()).await;
    assert_eq!(first.status, StatusCode::CREATED, "{}", String::from_utf8_lossy(&first.body));
    let worker = first.json();
    let vm_id = worker["vm_id"].as_str().expect("vm_id").to_owned();
    let tag = tag_of(&vm_id);
    let _cleanup = Cleanup(vec![tag.clone()]);
    assert!(tag.starts_with("sk-"), "the tag is the boot's sub-key: {tag}");
    assert!(running(&vm_id), "the domain runs");
    let title = virsh(&["desc", &vm_id, "--title"]).expect("title");
    assert_eq!(title.trim(), tag, "the title carries the tag too");

    let retry = create(&lb.url, TOKEN, "lv-create-1", &body()).await;
    assert!(retry.replayed() && retry.body == first.body, "the retry replays the 201");
    assert_eq!(domains_tagged(&tag), vec![vm_id.clone()], "one domain carries the tag");

    let id = worker["id"].as_str().expect("id");
    let reboot_url = format!("{}/v1/workers/{id}/reboot", lb.url);
    for _ in 0..2 {
        let r = send(Method::POST, &reboot_url, TOKEN, Some("lv-reboot-1"), None).await;
        assert_eq!(r.status, StatusCode::ACCEPTED, "{}", String::from_utf8_lossy(&r.body));
        assert_eq!(r.json()["reboot_count"], 1);
    }
    let meta = metadata(&vm_id).expect("metadata");
    assert_eq!(meta.matches("<reboot ").count(), 1, "one reboot recorded for one key: {meta}");
    assert!(running(&vm_id), "the domain runs after its reset");

    let del = send(Method::DELETE, &format!("{}/v1/workers/{id}", lb.url), TOKEN, Some("lv-delete-1"), None).await;
    assert_eq!(del.status, StatusCode::NO_CONTENT, "{}", String::from_utf8_lossy(&del.body));
    assert!(virsh(&["dominfo", &vm_id]).is_none(), "the domain is destroyed and undefined");
    assert!(domains_tagged(&tag).is_empty());
}

#[tokio::test]
async fn a_vm_boots_from_an_overlay_of_its_image_and_delete_removes_the_overlay() {
    if !libvirt_or_skip("a_vm_boots_from_an_overlay_of_its_image_and_delete_removes_the_overlay") {
        return;
    }
    let images = tempfile::tempdir().expect("tempdir");
    // libvirt's QEMU runs as another user: it must reach the files.
    std::fs::set_permissions(images.path(), std::os::unix::fs::PermissionsExt::from_mode(0o755)).expect("chmod");
    let base = images.path().join("worker-base:2025.11.qcow2");
    let made = Command::new("qemu-img").args(["create", "-q", "-f", "qcow2"]).arg(&base).arg("16M").status();
    if !made.is_ok_and(|s| s.success()) {
        assert!(std::env::var("CI").as_deref() != Ok("true"), "qemu-img is missing (run scripts/install-libvirt)");
        eprintln!("SKIPPED a_vm_boots_from_an_overlay_of_its_image_and_delete_removes_the_overlay: no qemu-img");
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let images_arg = images.path().to_string_lossy().into_owned();
    let lb = serve(&sqlite_url(&dir), &["--hypervisor-url", URL, "--libvirt-images", &images_arg]);
    let r = create(&lb.url, TOKEN, "lv-disk-1", &body()).await;
    assert_eq!(r.status, StatusCode::CREATED, "{}", String::from_utf8_lossy(&r.body));
    let vm_id = r.json()["vm_id"].as_str().expect("vm_id").to_owned();
    let _cleanup = Cleanup(vec![tag_of(&vm_id)]);
    let overlay = images.path().join("vms").join(format!("{vm_id}.qcow2"));
    assert!(overlay.is_file(), "the overlay {} exists", overlay.display());
    let disks = virsh(&["domblklist", &vm_id]).expect("domblklist");
    assert!(disks.contains(&overlay.to_string_lossy().into_owned()), "the domain boots from it: {disks}");
    let info = Command::new("qemu-img").args(["info", "-U"]).arg(&overlay).output().expect("qemu-img info");
    assert!(String::from_utf8_lossy(&info.stdout).contains("backing file"), "an overlay of the base image");

    let id = r.json()["id"].as_str().expect("id").to_owned();
    let del = send(Method::DELETE, &format!("{}/v1/workers/{id}", lb.url), TOKEN, Some("lv-disk-del"), None).await;
    assert_eq!(del.status, StatusCode::NO_CONTENT);
    assert!(virsh(&["dominfo", &vm_id]).is_none(), "the domain is gone");
    assert!(!overlay.exists(), "and its disk");
}

#[tokio::test]
async fn sigkill_during_the_libvirt_boot_then_a_retry_leaves_one_domain() {
    if !libvirt_or_skip("sigkill_during_the_libvirt_boot_then_a_retry_leaves_one_domain") {
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let db = sqlite_url(&dir);
    let args =
        ["--hypervisor-url", URL, "--in-flight-ttl", "1s", "--hypervisor-timeout", "3s", "--hypervisor-settle", "4s"];
    let mut lb = serve(&db, &args);
    let base = lb.url.clone();
    let pending = tokio::spawn(async move { create(&base, TOKEN, "lv-kill-1", &body()).await });
    // A boot takes about a second here (define, start): the kill lands before, during or after.
    tokio::time::sleep(std::time::Duration::from_millis(400)).await;
    lb.sigkill();
    let _ = pending.await;

    let lb = serve(&db, &args);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    let r = loop {
        let r = create(&lb.url, TOKEN, "lv-kill-1", &body()).await;
        if r.status == StatusCode::CREATED || std::time::Instant::now() > deadline {
            break r;
        }
        tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    };
    assert_eq!(r.status, StatusCode::CREATED, "{}", String::from_utf8_lossy(&r.body));
    let vm_id = r.json()["vm_id"].as_str().expect("vm_id").to_owned();
    let tag = tag_of(&vm_id);
    let _cleanup = Cleanup(vec![tag.clone()]);
    assert_eq!(domains_tagged(&tag), vec![vm_id.clone()], "one domain for one key, wherever the kill landed");
    assert!(running(&vm_id));
}
