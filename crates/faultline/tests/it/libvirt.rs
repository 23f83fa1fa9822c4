//! `--libvirt`: the servers' VMs are real libvirt/QEMU domains (`--hypervisor-url
//! libvirt+qemu:///system`) and the ground truth is read from libvirt with `virsh`. Needs
//! libvirtd running and a leasebroker built with its `libvirt` feature (a test fails, saying so,
//! when the one at hand lacks it); without libvirt every test prints SKIPPED and passes, and fails
//! under `CI=true`.

use std::process::Command;

use crate::support::{SERIAL, broken, num, run, run_faultline, servers};

const URI: &str = "qemu:///system";
/// Where faultline's runs keep their images (its default `--libvirt-dir`).
const RUNS_DIR: &str = "/var/tmp/faultline-libvirt";

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

/// The host's domains whose XML mentions `needle`.
fn domains_mentioning(needle: &str) -> Vec<String> {
    let names = virsh(&["list", "--all", "--name"]).expect("virsh list");
    names
        .lines()
        .map(str::trim)
        .filter(|n| !n.is_empty())
        .filter(|n| virsh(&["dumpxml", n]).is_some_and(|xml| xml.contains(needle)))
        .map(str::to_owned)
        .collect()
}

/// The leasebroker the runs start has the libvirt backend (`cargo nextest run --workspace
/// --all-features` builds it with it); the test fails with one line saying how to build it if not.
fn libvirt_servers() {
    let (leasebroker, _) = servers();
    let help = Command::new(&leasebroker).args(["serve", "--help"]).output().expect("serve --help");
    assert!(
        String::from_utf8_lossy(&help.stdout).contains("--libvirt-images"),
        "{} has no libvirt backend: build it with `cargo build -p leasebroker --features libvirt`",
        leasebroker.display()
    );
}

#[test]
fn real_domains_booted_rebooted_and_deleted_through_sigkills_hold_every_invariant_and_are_removed() {
    if !libvirt_or_skip(
        "real_domains_booted_rebooted_and_deleted_through_sigkills_hold_every_invariant_and_are_removed",
    ) {
        return;
    }
    let _serial = SERIAL.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    libvirt_servers();
    let (code, report) = run_faultline(&[
        "--no-naive",
        "--libvirt",
        "--ops",
        "40",
        "--concurrency",
        "4",
        "--client-faults",
        "0.2",
        "--server-kills",
        "2",
        "--hypervisor-timeout",
        "10s",
        // Each operation's retry budget: a create cut by a SIGKILL during a libvirt boot waits
        // out the restart and the settle window (12 s) at least once, and on a loaded machine
        // QEMU starts take seconds; the default 60 s ran out once under a busy loop on both cores
        // (lbctl gave up after 9 attempts in 49 s, and the server finished the create after it).
        "--op-max-elapsed",
        "150s",
        "--max-duration",
        "240s",
    ]);
    let protected = run(&report, "protected");
    let broken = broken(protected);
    assert!(broken.is_empty(), "protected run broke invariants: {broken:#?}\nfailures: {:#}", protected["failures"]);
    assert_eq!(code, 0);
    assert_eq!(protected["setup"]["hypervisor"], format!("libvirt {URI}"));
    assert_eq!(num(protected, &["server_kills"]), 2);
    // The truth was read from libvirt: every worker a create made is a domain libvirt started,
    // and the domains that run at the end are the workers'.
    let creates = num(protected, &["outcomes", "creates_ok"]);
    assert!(creates > 0);
    assert!(num(protected, &["hypervisor", "boots_total"]) >= creates, "{}", protected["hypervisor"]);
    assert_eq!(num(protected, &["hypervisor", "running"]), num(protected, &["fleet", "workers_active"]));
    assert!(num(protected, &["fleet", "workers_active"]) > 0, "some workers held at the end");
    // The resets were read from QEMU's events: as many as the reboots that succeeded (fewer only
    // when a kill fell between a reboot's tag and its reset).
    let reboots = num(protected, &["outcomes", "reboots_ok"]);
    let resets = num(protected, &["hypervisor", "reboots_total"]);
    assert!(reboots == 0 || (resets > 0 && resets <= reboots), "{reboots} reboots, {resets} resets");
    // Every domain the run made is gone.
    assert_eq!(domains_mentioning(RUNS_DIR), Vec::<String>::new(), "the run's domains are removed");
}

#[test]
fn a_run_on_a_host_with_another_leasebrokers_domain_leaves_that_domain_alone() {
    if !libvirt_or_skip("a_run_on_a_host_with_another_leasebrokers_domain_leaves_that_domain_alone") {
        return;
    }
    let _serial = SERIAL.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    libvirt_servers();
    let name = format!("vm-faultline-foreign-{}", std::process::id());
    let xml = format!(
        "<domain type='qemu'><name>{name}</name><memory unit='MiB'>32</memory><vcpu>1</vcpu>\
         <metadata><lb:vm xmlns:lb='https://leasebroker.example/ns/1' tag='sk-foreign'/></metadata>\
         <os><type arch='x86_64' machine='pc'>hvm</type></os><devices/></domain>"
    );
    let file = tempfile::NamedTempFile::new().expect("temp file");
    std::fs::write(file.path(), xml).expect("write");
    assert!(virsh(&["define", &file.path().to_string_lossy()]).is_some(), "define the foreign domain");
    struct Undefine(String);
    impl Drop for Undefine {
        fn drop(&mut self) {
            let _ = virsh(&["undefine", &self.0]);
        }
    }
    let _undefine = Undefine(name.clone());

    let (leasebroker, lbctl) = servers();
    let out = tempfile::tempdir().expect("tempdir");
    let output = Command::new(env!("CARGO_BIN_EXE_faultline"))
        .args(["run", "--no-naive", "--libvirt", "--ops", "5", "--no-progress", "--leasebroker"])
        .arg(&leasebroker)
        .arg("--lbctl")
        .arg(&lbctl)
        .arg("--out")
        .arg(out.path())
        .output()
        .expect("run faultline");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "the run failed: {stderr}");
    assert!(virsh(&["dominfo", &name]).is_some(), "the other deployment's domain is left alone");
}
