//! Ground truth from a real libvirt/QEMU host (`--libvirt`), read with `virsh`, not through the
//! service's own code.
//!
//! A run's domains are told from anyone else's by their disk: the servers get `--libvirt-images
//! DIR` with a tiny base image in it, so every domain they boot runs on a qcow2 overlay under
//! `DIR/vms/`, and `DIR` is a directory of the run's own under `--libvirt-dir`. The base image
//! boots and halts (a boot sector of `cli; hlt`), so a domain does nothing after its boot. What libvirt
//! knows of each domain comes from its XML (`virsh dumpxml`: the disk, the service's metadata
//! element with the boot tag and the reboot tags); what it did comes from its events, read for
//! the whole run: a `Started` lifecycle event (`virsh event --all --loop`) is a boot, a QEMU
//! `RESET` event that the host asked for (`virsh qemu-monitor-event --loop --event RESET`,
//! `"guest": false`) is a reset. libvirt's own `reboot` event does not count resets: the
//! firmware resets the machine once more on its own after a reset, or not, depending on when it
//! came (one to three `reboot` events per reset were seen under load); QEMU's event tells the two
//! apart.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex, PoisonError};

use anyhow::{Context, anyhow, bail};
use futures::StreamExt;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

use crate::verify::SimStats;

/// The XML namespace of leasebroker's domain metadata.
pub const METADATA_NS: &str = "https://leasebroker.example/ns/1";
/// The image every create asks for (the workload's), as the base image's file name.
const BASE_IMAGE: &str = "worker-base:2025.11.qcow2";

/// What one domain's XML says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DomainXml {
    /// The leasebroker metadata's boot tag (`None`: not a leasebroker domain).
    pub tag: Option<String>,
    /// The reboot tags the metadata records.
    pub reboot_tags: Vec<String>,
    /// The disk files the domain runs on.
    pub disks: Vec<PathBuf>,
}

impl DomainXml {
    /// Reads `virsh dumpxml`'s output.
    pub fn parse(xml: &str) -> anyhow::Result<Self> {
        let doc = roxmltree::Document::parse(xml).context("the domain XML")?;
        let meta = doc.descendants().find(|n| n.has_tag_name((METADATA_NS, "vm")));
        let tag = meta.and_then(|m| m.attribute("tag")).map(str::to_owned);
        let reboot_tags = meta
            .map(|m| {
                m.children()
                    .filter(|n| n.has_tag_name((METADATA_NS, "reboot")))
                    .filter_map(|n| n.attribute("tag").map(str::to_owned))
                    .collect()
            })
            .unwrap_or_default();
        let disks = doc
            .descendants()
            .filter(|n| n.has_tag_name("disk"))
            .filter_map(|d| d.children().find(|n| n.has_tag_name("source")))
            .filter_map(|s| s.attribute("file").map(PathBuf::from))
            .collect();
        Ok(Self { tag, reboot_tags, disks })
    }

    /// Whether it runs on a disk under `dir`.
    pub fn under(&self, dir: &Path) -> bool {
        self.disks.iter().any(|d| d.starts_with(dir))
    }
}

/// One line of `virsh event`: the event's kind, its domain and its detail.
/// `virsh event` prints `event 'KIND' for domain 'NAME': DETAIL`, `virsh qemu-monitor-event`
/// `event KIND at SECS.MICROS for domain 'NAME': DATA`.
pub fn parse_event(line: &str) -> Option<(&str, &str, &str)> {
    let rest = &line[line.find("event ")? + 6..];
    let (kind, rest) = match rest.strip_prefix('\'') {
        Some(quoted) => quoted.split_once('\'')?,
        None => rest.split_once(' ')?,
    };
    let rest = &rest[rest.find("for domain '")? + 12..];
    let (name, rest) = rest.split_once('\'')?;
    Some((kind, name, rest.strip_prefix(": ").unwrap_or("")))
}

/// What the events said of one domain.
#[derive(Debug, Clone, Default)]
struct Seen {
    /// Its XML once read (`None` until then, or when it vanished first).
    xml: Option<DomainXml>,
    /// `Started` events.
    started: u64,
    /// Resets the host asked for (QEMU `RESET` events with `"guest": false`).
    resets: u64,
    /// Seen running, or stopping: it was booted at least once, whether or not its `Started`
    /// event came through.
    ran: bool,
}

/// The host's domains of one run, watched from the run's start.
#[derive(Debug)]
pub struct Libvirt {
    uri: String,
    /// The run's directory: its base image, and its domains' overlays under `vms/`.
    pub dir: PathBuf,
    seen: Arc<Mutex<HashMap<String, Seen>>>,
    /// How many started domains without XML were last warned about.
    unread_warned: Mutex<usize>,
    /// How many domains that ran without a `Started` event seen were last warned about.
    unstarted_warned: Mutex<usize>,
    /// How many tagged domains seen defined but never running were last warned about.
    never_started_warned: Mutex<usize>,
    _events: [Child; 2],
}

/// The domains of the run as they are now: name, tag, running.
#[derive(Debug, Clone)]
pub struct Domain {
    /// The domain's name (the VM's id).
    pub name: String,
    /// Its boot tag.
    pub tag: String,
    /// Whether it runs.
    pub running: bool,
}

/// Runs `virsh -c URI ARGS`; its stdout when it succeeded.
async fn virsh(uri: &str, args: &[&str]) -> anyhow::Result<Option<String>> {
    let out = Command::new("virsh")
        .args(["-q", "-c", uri])
        .args(args)
        .stdin(Stdio::null())
        .output()
        .await
        .context("running virsh (Debian: libvirt-clients)")?;
    Ok(out.status.success().then(|| String::from_utf8_lossy(&out.stdout).into_owned()))
}

/// The XML of domain `name`, `None` when it is gone. A failure that is not "no such domain" (a
/// busy libvirtd refusing connections, as on a loaded host) is retried for a few seconds.
async fn dumpxml(uri: &str, name: &str) -> anyhow::Result<Option<DomainXml>> {
    let mut last = String::new();
    for attempt in 0..8u64 {
        if attempt > 0 {
            tokio::time::sleep(std::time::Duration::from_millis(250 * attempt)).await;
        }
        let out = Command::new("virsh")
            .args(["-q", "-c", uri, "dumpxml", name])
            .stdin(Stdio::null())
            .output()
            .await
            .context("running virsh (Debian: libvirt-clients)")?;
        if out.status.success() {
            return DomainXml::parse(&String::from_utf8_lossy(&out.stdout)).map(Some);
        }
        last = String::from_utf8_lossy(&out.stderr).trim().to_owned();
        if last.contains("failed to get domain") || last.contains("Domain not found") {
            return Ok(None);
        }
    }
    bail!("virsh dumpxml {name}: {last}")
}

/// The names of the host's domains (all, or only the running ones).
async fn names(uri: &str, all: bool) -> anyhow::Result<Vec<String>> {
    let args: &[&str] = if all { &["list", "--all", "--name"] } else { &["list", "--name"] };
    let out = virsh(uri, args).await?.ok_or_else(|| anyhow!("virsh -c {uri} list failed"))?;
    Ok(out.lines().map(str::trim).filter(|n| !n.is_empty()).map(str::to_owned).collect())
}

/// Destroys and undefines every domain running on a disk under `dir`, eight at a time (a destroy
/// waits for its QEMU to exit). Returns how many went.
async fn remove_under(uri: &str, dir: &Path) -> anyhow::Result<usize> {
    let removed: Vec<anyhow::Result<bool>> = futures::stream::iter(names(uri, true).await?)
        .map(|name| async move {
            if dumpxml(uri, &name).await?.is_some_and(|x| x.under(dir)) {
                remove(uri, &name).await?;
                return Ok(true);
            }
            Ok(false)
        })
        .buffer_unordered(8)
        .collect()
        .await;
    let mut n = 0;
    for r in removed {
        n += usize::from(r?);
    }
    Ok(n)
}

/// Destroys and undefines domain `name` (whatever state it is in).
async fn remove(uri: &str, name: &str) -> anyhow::Result<()> {
    let _ = virsh(uri, &["destroy", name]).await?;
    let _ = virsh(uri, &["undefine", name]).await?;
    Ok(())
}

/// Starts `virsh -c URI ARGS` (an event stream) and a task that reads its lines into `seen`,
/// reading a domain's XML when it is defined, after a reset (its metadata then has the reboot's
/// tag) and whenever it is not known yet.
fn watch(uri: &str, args: &[&str], seen: Arc<Mutex<HashMap<String, Seen>>>, run_dir: PathBuf) -> anyhow::Result<Child> {
    let mut child = Command::new("virsh")
        .args(["-c", uri])
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .with_context(|| format!("running virsh {}", args.join(" ")))?;
    let stdout = child.stdout.take().ok_or_else(|| anyhow!("no stdout from virsh {}", args.join(" ")))?;
    let uri = uri.to_owned();
    tokio::spawn(async move {
        let mut lines = BufReader::new(stdout).lines();
        while let Ok(Some(line)) = lines.next_line().await {
            let Some((kind, name, detail)) = parse_event(&line) else { continue };
            let read_xml = {
                let mut seen = seen.lock().unwrap_or_else(PoisonError::into_inner);
                let entry = seen.entry(name.to_owned()).or_default();
                let reset = kind == "RESET" && host_reset(detail);
                match kind {
                    "lifecycle" if detail.starts_with("Started") => entry.started += 1,
                    "lifecycle" if detail.starts_with("Stopped") => entry.ran = true,
                    "RESET" if reset => entry.resets += 1,
                    _ => {}
                }
                (kind == "lifecycle" && detail.starts_with("Defined")) || reset || entry.xml.is_none()
            };
            if read_xml {
                let (uri, seen, name, run_dir) = (uri.clone(), seen.clone(), name.to_owned(), run_dir.clone());
                tokio::spawn(async move {
                    if let Ok(Some(xml)) = dumpxml(&uri, &name).await
                        && xml.under(&run_dir)
                    {
                        let mut seen = seen.lock().unwrap_or_else(PoisonError::into_inner);
                        seen.entry(name).or_default().xml = Some(xml);
                    }
                });
            }
        }
    });
    Ok(child)
}

/// Whether a QEMU `RESET` event's data says the host asked for it (`"guest": false`), not the
/// guest or its firmware.
pub fn host_reset(data: &str) -> bool {
    serde_json::from_str::<serde_json::Value>(data).is_ok_and(|v| v["guest"] == serde_json::Value::Bool(false))
}

impl Libvirt {
    /// Checks that libvirt answers at `uri` (and qemu-img is there), removes every domain an
    /// earlier run left under `parent`, makes the run's directory with its base image and starts
    /// watching the events. Domains of anyone else (another leasebroker deployment's included:
    /// the inventory sweep leaves tags its ledger never issued alone) are never touched.
    pub async fn start(uri: &str, parent: &Path) -> anyhow::Result<Self> {
        if virsh(uri, &["version"]).await?.is_none() {
            bail!("--libvirt: libvirt does not answer at {uri} (is libvirtd running? scripts/install-libvirt)");
        }
        let left = Self::remove_left_over(uri, parent).await?;
        if left > 0 {
            eprintln!("faultline: removed {left} domain(s) an earlier run left under {}", parent.display());
        }
        let dir = parent.join(format!(
            "run-{}-{}",
            std::process::id(),
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_millis()
        ));
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        // libvirt's QEMU may run as another user: it must reach the images.
        for d in [parent, dir.as_path()] {
            std::fs::set_permissions(d, std::os::unix::fs::PermissionsExt::from_mode(0o755))
                .with_context(|| format!("chmod {}", d.display()))?;
        }
        // A disk the firmware boots and whose boot sector halts the CPU (`cli; hlt; jmp $-1`):
        // without a bootable disk SeaBIOS resets the domain every 60 s, which reads as a reboot.
        let raw = dir.join("base.raw");
        let mut sector = vec![0u8; 1 << 20];
        sector[..4].copy_from_slice(&[0xFA, 0xF4, 0xEB, 0xFD]);
        sector[510..512].copy_from_slice(&[0x55, 0xAA]);
        std::fs::write(&raw, &sector).with_context(|| format!("writing {}", raw.display()))?;
        let made = Command::new("qemu-img")
            .args(["convert", "-q", "-f", "raw", "-O", "qcow2"])
            .arg(&raw)
            .arg(dir.join(BASE_IMAGE))
            .status()
            .await
            .context("running qemu-img (Debian: qemu-utils)")?;
        let _ = std::fs::remove_file(&raw);
        if !made.success() {
            bail!("qemu-img could not make the base image in {}", dir.display());
        }
        let seen: Arc<Mutex<HashMap<String, Seen>>> = Arc::default();
        let lifecycle = watch(uri, &["event", "--all", "--loop"], seen.clone(), dir.clone())?;
        let resets = watch(uri, &["qemu-monitor-event", "--loop", "--event", "RESET"], seen.clone(), dir.clone())?;
        Ok(Self {
            uri: uri.to_owned(),
            dir,
            seen,
            unread_warned: Mutex::new(0),
            unstarted_warned: Mutex::new(0),
            never_started_warned: Mutex::new(0),
            _events: [lifecycle, resets],
        })
    }

    /// The libvirt URI.
    pub fn uri(&self) -> &str {
        &self.uri
    }

    /// Destroys and undefines every domain running on a disk under `parent` (every faultline
    /// run's), and removes the run directories there. Returns how many domains went.
    pub async fn remove_left_over(uri: &str, parent: &Path) -> anyhow::Result<usize> {
        let removed = remove_under(uri, parent).await?;
        if let Ok(entries) = std::fs::read_dir(parent) {
            for e in entries.flatten() {
                if e.file_name().to_string_lossy().starts_with("run-") {
                    let _ = std::fs::remove_dir_all(e.path());
                }
            }
        }
        Ok(removed)
    }

    /// The run's domains as they are now (read from libvirt, each one's XML once more, so the
    /// reboot tags are current).
    pub async fn domains(&self) -> anyhow::Result<Vec<Domain>> {
        let all = names(&self.uri, true).await?;
        let running: HashSet<String> = names(&self.uri, false).await?.into_iter().collect();
        let read: Vec<(String, anyhow::Result<Option<DomainXml>>)> = futures::stream::iter(all)
            .map(|name| async move {
                let xml = dumpxml(&self.uri, &name).await;
                (name, xml)
            })
            .buffer_unordered(8)
            .collect()
            .await;
        let mut out = Vec::new();
        let mut seen = self.seen.lock().unwrap_or_else(PoisonError::into_inner);
        for (name, xml) in read {
            let Some(xml) = xml? else { continue }; // gone meanwhile
            if !xml.under(&self.dir) {
                continue;
            }
            if let Some(tag) = xml.tag.clone() {
                out.push(Domain { running: running.contains(&name), name: name.clone(), tag });
            }
            let entry = seen.entry(name.clone()).or_default();
            entry.xml = Some(xml);
            entry.ran |= running.contains(&name);
        }
        out.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(out)
    }

    /// The counters the simulator would keep, from what libvirt showed: boots (`Started`
    /// events), distinct domains booted per tag beyond the first, resets, resets beyond the
    /// reboot tags a domain records, and the domains that run now. The BMC fields stay zero.
    pub async fn stats(&self) -> anyhow::Result<SimStats> {
        let running = self.domains().await?.iter().filter(|d| d.running).count() as u64;
        let seen = self.seen.lock().unwrap_or_else(PoisonError::into_inner);
        let ours = seen.iter().filter_map(|(n, s)| s.xml.as_ref().and_then(|x| x.tag.clone()).map(|tag| (n, tag, s)));
        let mut stats = SimStats { running, ..SimStats::default() };
        let mut per_tag: HashMap<String, u64> = HashMap::new();
        let mut unstarted = Vec::new();
        let mut never_started = Vec::new();
        for (name, tag, s) in ours {
            // Defined under a boot's tag, never seen running: a boot cut between its define and
            // its start. Not a boot; named below, since a create answered for it would be a
            // worker without a VM that ever ran.
            if s.started == 0 && !s.ran {
                never_started.push(format!("{name} ({tag})"));
            }
            // A domain seen running (or stopping) was booted, also when its `Started` event was
            // not seen.
            if s.started == 0 && s.ran {
                unstarted.push(tag.clone());
            }
            let started = s.started.max(u64::from(s.ran));
            stats.boots_total += started;
            stats.reboots_total += s.resets;
            let tags = s.xml.as_ref().map_or(0, |x| x.reboot_tags.iter().collect::<HashSet<_>>().len() as u64);
            stats.duplicate_reboot_tags += s.resets.saturating_sub(tags);
            if started > 0 {
                *per_tag.entry(tag).or_default() += 1;
            }
        }
        stats.duplicate_boot_tags = per_tag.values().map(|n| n - 1).sum();
        let unread: Vec<&String> =
            seen.iter().filter(|(_, s)| (s.started > 0 || s.ran) && s.xml.is_none()).map(|(n, _)| n).collect();
        let mut unstarted_warned = self.unstarted_warned.lock().unwrap_or_else(PoisonError::into_inner);
        if unstarted.len() != *unstarted_warned {
            *unstarted_warned = unstarted.len();
            eprintln!(
                "faultline: {} domain(s) of the run ran without a Started event seen (each counted as one boot)",
                unstarted.len()
            );
        }
        let mut never_started_warned = self.never_started_warned.lock().unwrap_or_else(PoisonError::into_inner);
        if never_started.len() != *never_started_warned {
            *never_started_warned = never_started.len();
            never_started.sort();
            eprintln!(
                "faultline: {} domain(s) of the run were defined and never seen running (not counted as boots): {never_started:?}",
                never_started.len()
            );
        }
        let mut warned = self.unread_warned.lock().unwrap_or_else(PoisonError::into_inner);
        if unread.len() != *warned {
            *warned = unread.len();
            // Not counted: nothing tells whose they were. Named here so a gap in the truth shows.
            eprintln!(
                "faultline: {} domain(s) started during the run were gone before their XML could be read (not counted): {unread:?}",
                unread.len()
            );
        }
        Ok(stats)
    }

    /// Destroys and undefines every domain of the run and removes its directory. Returns how
    /// many domains went.
    pub async fn clean_up(&self) -> anyhow::Result<usize> {
        let removed = remove_under(&self.uri, &self.dir).await?;
        let _ = std::fs::remove_dir_all(&self.dir);
        Ok(removed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_tag_the_reboot_tags_and_the_disk_of_a_domain() {
        let xml = r#"<domain type='kvm'><name>vm-1</name><title>sk-a</title>
            <metadata><lb:vm xmlns:lb="https://leasebroker.example/ns/1" tag="sk-a"><lb:reboot tag="sk-r1"/><lb:reboot tag="sk-r2"/></lb:vm></metadata>
            <devices><disk type='file' device='disk'><source file='/var/tmp/faultline-libvirt/run-1/vms/vm-1.qcow2' index='1'/>
            <backingStore type='file'><source file='/var/tmp/faultline-libvirt/run-1/base.qcow2'/></backingStore></disk>
            <serial type='pty'><source path='/dev/pts/0'/></serial></devices></domain>"#;
        let d = DomainXml::parse(xml).expect("parses");
        assert_eq!(d.tag.as_deref(), Some("sk-a"));
        assert_eq!(d.reboot_tags, ["sk-r1", "sk-r2"]);
        assert!(d.under(Path::new("/var/tmp/faultline-libvirt/run-1")));
        assert!(d.under(Path::new("/var/tmp/faultline-libvirt")));
        assert!(!d.under(Path::new("/var/tmp/faultline-libvirt/run-2")));
        // Another namespace's metadata, or none: not a leasebroker domain.
        let other = "<domain><metadata><x:vm xmlns:x='urn:other' tag='t'/></metadata><devices/></domain>";
        assert_eq!(DomainXml::parse(other).expect("parses").tag, None);
        assert!(DomainXml::parse("not xml").is_err());
    }

    #[test]
    fn reads_an_event_line() {
        let line = "2026-12-02 14:24:51.851+0000: event 'lifecycle' for domain 'vm-1': Started Booted";
        assert_eq!(parse_event(line), Some(("lifecycle", "vm-1", "Started Booted")));
        assert_eq!(parse_event("event 'reboot' for domain 'vm-2'"), Some(("reboot", "vm-2", "")));
        assert_eq!(parse_event("events received: 3"), None);
        // As virsh qemu-monitor-event prints it (without --timestamp: QEMU's own time).
        let reset =
            r#"event RESET at 1764686730.479000 for domain 'vm-3': {"guest":false,"reason":"host-qmp-system-reset"}"#;
        let (kind, name, data) = parse_event(reset).expect("a QEMU event");
        assert_eq!((kind, name), ("RESET", "vm-3"));
        assert!(host_reset(data));
        assert!(!host_reset(r#"{"guest":true,"reason":"guest-reset"}"#), "the guest's own reset");
        assert!(!host_reset("<null>"));
    }
}
