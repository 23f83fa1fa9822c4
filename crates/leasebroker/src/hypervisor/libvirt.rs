//! VMs on a real libvirt/QEMU host (docs/protocol.md#real-downstreams): `--hypervisor-url libvirt+qemu:///system`.
//!
//! libvirt picks nothing for us and echoes nothing back, but it keeps free-form metadata on each
//! domain, and that is where the tag goes, as a reconcile-by-tag needs it:
//! - a boot defines a small persistent domain named `vm-<16 hex>` (that name is the VM's id), with
//!   the tag in its `<title>` and in a `<metadata>` element of the service's namespace, then
//!   starts it. Memory is the request's GB read as MiB (at least 32), one vCPU, and a disk only
//!   when `--libvirt-images DIR` holds `<image>.qcow2`: then a qcow2 overlay of it, made with
//!   `qemu-img`, under `DIR/vms/`. A domain that cannot be started is undefined again.
//! - listing by tag reads every domain's metadata element (domains without it are not ours);
//! - a reboot first appends its tag to the metadata (live and persistent), then resets the
//!   domain (a reset works without a guest OS; an ACPI reboot needs one that listens);
//! - a delete destroys the domain if it runs, undefines it and removes its overlay.
//!
//! What stays ambiguous: a reboot whose tag was recorded when the process died before the reset
//! reads as done on the retry (the tag is the only trace a reset leaves), so at most one reboot
//! per key holds, not exactly one; a boot whose domain was defined when the process died before
//! it was started is listed `stopped` under its tag: the retry adopts it and starts it
//! ([`LibvirtVms::start`]), so the worker it answers with runs; so is one whose start is still
//! under way in libvirtd (QEMU paused, "starting up"), and the retry waits for that start. Calls go through
//! libvirt's C library on a blocking thread, a new connection each (a restarted libvirtd costs
//! nothing), bounded by `--hypervisor-timeout`: a call that times out may still take effect.

use std::path::{Path, PathBuf};
use std::time::Duration;

use reqwest::StatusCode;
use virt::connect::Connect;
use virt::domain::Domain;
use virt::error::ErrorNumber;

use super::api::{BootRequest, Vm, VmDetail, VmState};
use super::error::HvError;
use super::vms::Vms;

/// The XML namespace of the service's domain metadata.
pub const METADATA_NS: &str = "https://leasebroker.example/ns/1";
/// The prefix the metadata element is written with.
const METADATA_KEY: &str = "lb";
/// The scheme prefix that selects this backend in `--hypervisor-url`.
pub const URL_PREFIX: &str = super::url::LIBVIRT_PREFIX;

/// VMs as libvirt domains on the host at one libvirt URI.
#[derive(Debug, Clone)]
pub struct LibvirtVms {
    uri: String,
    images: Option<PathBuf>,
    timeout: Duration,
}

impl LibvirtVms {
    /// The backend for `url` (`libvirt+qemu:///system`, or any libvirt URI after `libvirt+`),
    /// overlaying base images from `images`, each call bounded by `timeout`. Checks that libvirt
    /// answers at that URI.
    pub async fn connect(url: &str, images: Option<PathBuf>, timeout: Duration) -> Result<Self, HvError> {
        let uri = url.strip_prefix(URL_PREFIX).filter(|u| !u.is_empty()).ok_or_else(|| HvError::InvalidUrl {
            url: url.to_owned(),
            reason: format!("a libvirt URL is {URL_PREFIX}<libvirt URI>, e.g. {URL_PREFIX}qemu:///system"),
        })?;
        let vms = Self { uri: uri.to_owned(), images, timeout };
        vms.call(|conn, _| conn.lib_version().map(drop).map_err(|e| classify(&e, false))).await?;
        Ok(vms)
    }

    /// The same backend with each call bounded by `timeout` instead.
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Runs `f` on a fresh connection, on a blocking thread, within the timeout. The wait ends
    /// at the timeout but the thread does not: `f` checks its [`Deadline`] before each step that
    /// changes anything, so a call that outlives its caller's wait sends nothing more (else it
    /// could land after the settle window its retry waited out: a second domain, a second reset).
    async fn call<T: Send + 'static>(
        &self,
        f: impl FnOnce(&Connect, Deadline) -> Result<T, HvError> + Send + 'static,
    ) -> Result<T, HvError> {
        let uri = self.uri.clone();
        let deadline = Deadline(std::time::Instant::now() + self.timeout);
        let work = tokio::task::spawn_blocking(move || {
            // No connection: nothing was sent.
            let conn = Connect::open(Some(&uri)).map_err(|e| HvError::Libvirt {
                message: format!("cannot connect to libvirt: {}", e.message()),
                status: None,
                definite: true,
            })?;
            f(&conn, deadline)
        });
        match tokio::time::timeout(self.timeout, work).await {
            Ok(Ok(result)) => result,
            Ok(Err(join)) => Err(HvError::Libvirt {
                message: format!("the libvirt call failed: {join}"),
                status: None,
                definite: false,
            }),
            Err(_) => {
                Err(HvError::Libvirt { message: "the libvirt call timed out".into(), status: None, definite: false })
            }
        }
    }

    /// Defines and starts a domain carrying `req.tag`.
    pub async fn boot(&self, req: &BootRequest) -> Result<Vm, HvError> {
        let vm_id = format!("vm-{:016x}", rand::random::<u64>());
        let disk = match &self.images {
            Some(dir) => overlay(dir, &req.image, &vm_id)?,
            None => None,
        };
        let memory_mib = req.memory_gb.clamp(32, 4096);
        let tag = req.tag.clone();
        let id = vm_id.clone();
        let result = self
            .call(move |conn, deadline| {
                let kvm =
                    conn.capabilities().is_ok_and(|caps| caps.contains("type='kvm'") || caps.contains("type=\"kvm\""));
                let xml = domain_xml(&id, &tag, memory_mib, kvm, disk.as_deref());
                deadline.check()?;
                let dom = conn.define_domain_xml(&xml).map_err(|e| classify(&e, true))?;
                if let Err(e) = deadline.check().and_then(|()| dom.create().map(drop).map_err(|e| classify(&e, true))) {
                    // Defined but not running: take it back, so nothing is left under the tag.
                    let _ = dom.undefine();
                    return Err(e);
                }
                Ok(())
            })
            .await;
        if let Err(e) = &result
            && !e.may_have_happened()
            && let Some(dir) = &self.images
        {
            let _ = std::fs::remove_file(overlay_path(dir, &vm_id));
        }
        result.map(|()| Vm { vm_id, tag: req.tag.clone(), state: VmState::Running })
    }

    /// Every domain carrying the service's metadata.
    pub async fn list_all(&self) -> Result<Vec<Vm>, HvError> {
        self.call(|conn, _| {
            let domains = conn.list_all_domains(0).map_err(|e| classify(&e, false))?;
            let mut vms = Vec::new();
            for dom in domains {
                // A domain that vanished between the listing and this read is no longer there.
                if let Some(detail) = detail_of(&dom)? {
                    vms.push(Vm { vm_id: detail.vm_id, tag: detail.tag, state: detail.state });
                }
            }
            Ok(vms)
        })
        .await
    }

    /// The domains whose tag is exactly `tag`.
    pub async fn list_by_tag(&self, tag: &str) -> Result<Vec<Vm>, HvError> {
        let mut vms = self.list_all().await?;
        vms.retain(|vm| vm.tag == tag);
        Ok(vms)
    }

    /// One domain in full, or `None` when there is no such domain of ours.
    pub async fn get(&self, vm_id: &str) -> Result<Option<VmDetail>, HvError> {
        let vm_id = vm_id.to_owned();
        self.call(move |conn, _| match lookup(conn, &vm_id)? {
            Some(dom) => detail_of(&dom),
            None => Ok(None),
        })
        .await
    }

    /// Starts a domain of ours that is defined but not running (what a boot leaves when its
    /// process died between the define and the start), and returns once it runs. A domain whose
    /// start job is still under way (libvirt runs QEMU paused, "starting up", until the job ends:
    /// the start of a process killed mid-boot goes on in libvirtd) is waited for, not taken for
    /// running. One that runs already is left alone. No such domain: a definite 404.
    pub async fn start(&self, vm_id: &str) -> Result<(), HvError> {
        let vm_id = vm_id.to_owned();
        self.call(move |conn, deadline| {
            let dom = lookup(conn, &vm_id)?.ok_or_else(|| not_found(&vm_id))?;
            read_metadata(&dom)?.ok_or_else(|| not_found(&vm_id))?;
            let mut started = false;
            loop {
                if starting_up(&dom)? {
                    deadline.check()?;
                    std::thread::sleep(Duration::from_millis(100));
                    continue;
                }
                if started || dom.is_active().map_err(|e| classify(&e, false))? {
                    return Ok(());
                }
                deadline.check()?;
                match dom.create() {
                    Ok(_) => return Ok(()),
                    // Started meanwhile, by another call: wait for its start to end.
                    Err(e) if code(&e) == Some(ErrorNumber::OperationInvalid) => started = true,
                    Err(e) => return Err(classify(&e, false)),
                }
            }
        })
        .await
    }

    /// Records `tag` on the domain, then resets it. No such domain: a definite 404.
    pub async fn reboot(&self, vm_id: &str, tag: &str) -> Result<(), HvError> {
        let (vm_id, tag) = (vm_id.to_owned(), tag.to_owned());
        self.call(move |conn, deadline| {
            let dom = lookup(conn, &vm_id)?.ok_or_else(|| not_found(&vm_id))?;
            let mut meta = read_metadata(&dom)?.ok_or_else(|| not_found(&vm_id))?;
            if !meta.reboot_tags.contains(&tag) {
                meta.reboot_tags.push(tag);
            }
            let live = dom.is_active().map_err(|e| classify(&e, true))?;
            // Checked once, before the tag is recorded: a recorded tag is what a retry adopts as
            // the reset done, so the reset follows it at once.
            deadline.check()?;
            let mut flags = virt::sys::VIR_DOMAIN_AFFECT_CONFIG;
            if live {
                flags |= virt::sys::VIR_DOMAIN_AFFECT_LIVE;
            }
            dom.set_metadata(
                virt::sys::VIR_DOMAIN_METADATA_ELEMENT as i32,
                Some(&meta.to_xml()),
                Some(METADATA_KEY),
                Some(METADATA_NS),
                flags,
            )
            .map_err(|e| classify(&e, true))?;
            if live {
                dom.reset().map_err(|e| classify(&e, false))?;
            } else {
                dom.create().map_err(|e| classify(&e, false))?;
            }
            Ok(())
        })
        .await
    }

    /// Destroys and undefines a domain and removes its overlay: `true` if it existed.
    pub async fn delete(&self, vm_id: &str) -> Result<bool, HvError> {
        let id = vm_id.to_owned();
        let existed = self
            .call(move |conn, deadline| {
                let Some(dom) = lookup(conn, &id)? else { return Ok(false) };
                if read_metadata(&dom)?.is_none() {
                    return Ok(false); // not one of ours: never touched
                }
                deadline.check()?;
                if dom.is_active().map_err(|e| classify(&e, false))? {
                    match dom.destroy() {
                        Ok(()) => {}
                        Err(e) if code(&e) == Some(ErrorNumber::OperationInvalid) => {} // stopped meanwhile
                        Err(e) => return Err(classify(&e, false)),
                    }
                }
                match dom.undefine() {
                    Ok(()) => Ok(true),
                    Err(e) if code(&e) == Some(ErrorNumber::NoDomain) => Ok(true),
                    Err(e) => Err(classify(&e, false)),
                }
            })
            .await?;
        if let Some(dir) = &self.images {
            let _ = std::fs::remove_file(overlay_path(dir, vm_id));
        }
        Ok(existed)
    }
}

/// When a libvirt call's caller stops waiting for it ([`LibvirtVms::call`]).
#[derive(Debug, Clone, Copy)]
struct Deadline(std::time::Instant);

/// The VM calls, on this host.
#[async_trait::async_trait]
impl Vms for LibvirtVms {
    async fn boot(&self, req: &BootRequest) -> Result<Vm, HvError> {
        LibvirtVms::boot(self, req).await
    }
    async fn list_by_tag(&self, tag: &str) -> Result<Vec<Vm>, HvError> {
        LibvirtVms::list_by_tag(self, tag).await
    }
    async fn list_all(&self) -> Result<Vec<Vm>, HvError> {
        LibvirtVms::list_all(self).await
    }
    async fn get(&self, vm_id: &str) -> Result<Option<VmDetail>, HvError> {
        LibvirtVms::get(self, vm_id).await
    }
    /// A boot is a define and then a start: a domain listed `stopped` under a boot's tag is one
    /// whose start never ran, or is still under way in libvirtd (the start of a process killed
    /// mid-boot): it is started, or waited for.
    async fn ensure_running(&self, vm: &Vm) -> Result<(), HvError> {
        if vm.state == VmState::Stopped {
            return self.start(&vm.vm_id).await;
        }
        Ok(())
    }
    /// [`Vms::ensure_running`] of the domain, read first.
    async fn ensure_running_by_id(&self, vm_id: &str) -> Result<(), HvError> {
        match LibvirtVms::get(self, vm_id).await? {
            Some(vm) => Vms::ensure_running(self, &vm.summary()).await,
            None => Ok(()),
        }
    }
    async fn reboot(&self, vm_id: &str, tag: &str) -> Result<(), HvError> {
        LibvirtVms::reboot(self, vm_id, tag).await
    }
    async fn delete(&self, vm_id: &str) -> Result<bool, HvError> {
        LibvirtVms::delete(self, vm_id).await
    }
}

impl Deadline {
    /// Nothing more may be sent once the caller stopped waiting: a definite error (this step
    /// was not taken). The caller is usually told the call timed out first; on a loaded machine
    /// its timer may fire after the thread has answered this, and then it sees this answer,
    /// which is as true (nothing of this step was sent) and retried the same way.
    fn check(self) -> Result<(), HvError> {
        if std::time::Instant::now() < self.0 {
            return Ok(());
        }
        Err(HvError::Libvirt {
            message: "the libvirt call's time ran out before this step was sent".into(),
            status: None,
            definite: true,
        })
    }
}

/// The service's metadata on one domain.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Metadata {
    tag: String,
    reboot_tags: Vec<String>,
}

impl Metadata {
    /// The element as written with `virDomainSetMetadata` (libvirt adds the namespace).
    fn to_xml(&self) -> String {
        let mut xml = format!("<vm tag=\"{}\">", escape(&self.tag));
        for t in &self.reboot_tags {
            xml.push_str(&format!("<reboot tag=\"{}\"/>", escape(t)));
        }
        xml.push_str("</vm>");
        xml
    }

    /// Reads the element libvirt returns; `None` when it is not ours.
    fn parse(xml: &str) -> Option<Self> {
        let doc = roxmltree::Document::parse(xml).ok()?;
        let root = doc.root_element();
        if root.tag_name().name() != "vm" {
            return None;
        }
        let tag = root.attribute("tag")?.to_owned();
        let reboot_tags = root
            .children()
            .filter(|n| n.is_element() && n.tag_name().name() == "reboot")
            .filter_map(|n| n.attribute("tag").map(str::to_owned))
            .collect();
        Some(Self { tag, reboot_tags })
    }
}

fn read_metadata(dom: &Domain) -> Result<Option<Metadata>, HvError> {
    match dom.metadata(virt::sys::VIR_DOMAIN_METADATA_ELEMENT as i32, Some(METADATA_NS), 0) {
        Ok(xml) => Ok(Metadata::parse(&xml)),
        Err(e) if matches!(code(&e), Some(ErrorNumber::NoDomainMetadata | ErrorNumber::NoDomain)) => Ok(None),
        Err(e) => Err(classify(&e, false)),
    }
}

fn detail_of(dom: &Domain) -> Result<Option<VmDetail>, HvError> {
    let Some(meta) = read_metadata(dom)? else { return Ok(None) };
    let vm_id = match dom.name() {
        Ok(name) => name,
        Err(e) if code(&e) == Some(ErrorNumber::NoDomain) => return Ok(None),
        Err(e) => return Err(classify(&e, false)),
    };
    let state = match dom.is_active() {
        Ok(true) if starting_up(dom)? => VmState::Stopped,
        Ok(true) => VmState::Running,
        Ok(false) => VmState::Stopped,
        Err(e) if code(&e) == Some(ErrorNumber::NoDomain) => return Ok(None),
        Err(e) => return Err(classify(&e, false)),
    };
    Ok(Some(VmDetail {
        vm_id,
        tag: meta.tag,
        state,
        reboot_tags: meta.reboot_tags,
        image: None,
        cpu: None,
        memory_gb: None,
    }))
}

/// Whether `dom`'s start job is under way: libvirt runs QEMU paused ("starting up") until it
/// ends, and the domain reads active meanwhile. Such a domain is not running yet.
fn starting_up(dom: &Domain) -> Result<bool, HvError> {
    use virt::domain::{DomainPausedReason, DomainStateReason};
    use virt::enumutil::Enum;
    let (_, reason) = dom.state().map_err(|e| classify(&e, false))?;
    Ok(matches!(reason, Enum::Known(DomainStateReason::Paused(Enum::Known(DomainPausedReason::StartingUp)))))
}

fn lookup(conn: &Connect, vm_id: &str) -> Result<Option<Domain>, HvError> {
    match conn.lookup_domain_by_name(vm_id) {
        Ok(dom) => Ok(Some(dom)),
        Err(e) if code(&e) == Some(ErrorNumber::NoDomain) => Ok(None),
        Err(e) => Err(classify(&e, false)),
    }
}

/// The error's number, when libvirt's is one this binding knows.
fn code(e: &virt::error::Error) -> Option<ErrorNumber> {
    match e.code() {
        virt::enumutil::Enum::Known(number) => Some(number),
        virt::enumutil::Enum::Unknown(_) => None,
    }
}

fn not_found(vm_id: &str) -> HvError {
    HvError::Libvirt { message: format!("no domain {vm_id}"), status: Some(StatusCode::NOT_FOUND), definite: true }
}

/// Classifies a libvirt error: a lost connection or an internal failure may have happened; a
/// refusal libvirt decided before acting is definite, and `refusal_is_422` says whether a
/// refusal of this call means the request itself is bad.
fn classify(e: &virt::error::Error, refusal_is_422: bool) -> HvError {
    let message = e.message().chars().take(512).collect::<String>();
    match code(e) {
        Some(ErrorNumber::NoDomain) => {
            HvError::Libvirt { message, status: Some(StatusCode::NOT_FOUND), definite: true }
        }
        Some(
            ErrorNumber::XmlError
            | ErrorNumber::XmlDetail
            | ErrorNumber::ConfigUnsupported
            | ErrorNumber::InvalidArg
            | ErrorNumber::OperationInvalid
            | ErrorNumber::OperationUnsupported
            | ErrorNumber::NoSupport
            | ErrorNumber::OperationDenied
            | ErrorNumber::AuthFailed,
        ) => HvError::Libvirt {
            message,
            status: Some(if refusal_is_422 { StatusCode::UNPROCESSABLE_ENTITY } else { StatusCode::CONFLICT }),
            definite: true,
        },
        _ => HvError::Libvirt { message, status: None, definite: false },
    }
}

/// The domain XML of a boot.
fn domain_xml(vm_id: &str, tag: &str, memory_mib: i64, kvm: bool, disk: Option<&Path>) -> String {
    let kind = if kvm { "kvm" } else { "qemu" };
    let tag = escape(tag);
    let (boot, devices) = match disk {
        Some(path) => (
            "hd",
            format!(
                "<disk type='file' device='disk'><driver name='qemu' type='qcow2'/>\
                 <source file='{}'/><target dev='vda' bus='virtio'/></disk>",
                escape(&path.to_string_lossy())
            ),
        ),
        None => ("network", String::new()),
    };
    format!(
        "<domain type='{kind}'><name>{vm_id}</name><title>{tag}</title>\
         <memory unit='MiB'>{memory_mib}</memory><vcpu>1</vcpu>\
         <metadata><{METADATA_KEY}:vm xmlns:{METADATA_KEY}='{METADATA_NS}' tag='{tag}'/></metadata>\
         <os><type arch='x86_64' machine='pc'>hvm</type><boot dev='{boot}'/></os>\
         <on_reboot>restart</on_reboot><devices>{devices}<serial type='pty'/></devices></domain>"
    )
}

fn overlay_path(dir: &Path, vm_id: &str) -> PathBuf {
    dir.join("vms").join(format!("{vm_id}.qcow2"))
}

/// A qcow2 overlay of `DIR/<image>.qcow2` for `vm_id`, when that base image exists (and
/// `qemu-img` does); `None` boots without a disk.
fn overlay(dir: &Path, image: &str, vm_id: &str) -> Result<Option<PathBuf>, HvError> {
    let refused =
        |message: String| HvError::Libvirt { message, status: Some(StatusCode::UNPROCESSABLE_ENTITY), definite: true };
    if image.is_empty() || image.contains('/') || image.starts_with('.') {
        return Err(refused(format!("image {image:?} cannot name a file under --libvirt-images")));
    }
    let base = dir.join(format!("{image}.qcow2"));
    if !base.is_file() {
        return Ok(None);
    }
    let path = overlay_path(dir, vm_id);
    std::fs::create_dir_all(dir.join("vms"))
        .map_err(|e| refused(format!("cannot create the overlay directory: {e}")))?;
    let made = std::process::Command::new("qemu-img")
        .args(["create", "-q", "-f", "qcow2", "-F", "qcow2", "-b"])
        .arg(&base)
        .arg(&path)
        .output();
    match made {
        Ok(out) if out.status.success() => Ok(Some(path)),
        Ok(out) => Err(refused(format!(
            "qemu-img could not make an overlay: {}",
            String::from_utf8_lossy(&out.stderr).chars().take(256).collect::<String>()
        ))),
        Err(_) => Ok(None), // no qemu-img: boot without a disk
    }
}

/// Escapes text for an XML attribute or element.
fn escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&apos;"),
            c if c.is_control() => out.push(' '),
            c => out.push(c),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metadata_round_trips_through_the_element_libvirt_returns() {
        let meta = Metadata { tag: "sk-1<&>\"'".into(), reboot_tags: vec!["sk-r1".into(), "sk-r2".into()] };
        // libvirt hands the element back with the namespace as the default one.
        let returned = meta.to_xml().replacen("<vm ", &format!("<vm xmlns=\"{METADATA_NS}\" "), 1);
        assert_eq!(Metadata::parse(&returned), Some(meta));
        assert_eq!(Metadata::parse("<other tag='x'/>"), None);
        assert_eq!(Metadata::parse("not xml"), None);
    }

    #[test]
    fn the_domain_xml_escapes_the_tag_and_parses() {
        let xml = domain_xml("vm-1", "a'b<c", 64, true, None);
        let doc = roxmltree::Document::parse(&xml).expect("well-formed");
        let title = doc.descendants().find(|n| n.has_tag_name("title")).and_then(|n| n.text());
        assert_eq!(title, Some("a'b<c"));
        let meta = doc.descendants().find(|n| n.has_tag_name((METADATA_NS, "vm"))).expect("metadata element");
        assert_eq!(meta.attribute("tag"), Some("a'b<c"));
    }

    #[test]
    fn an_image_name_cannot_leave_the_images_directory() {
        let dir = tempfile::tempdir().expect("tempdir");
        for image in ["../etc/passwd", "a/b", ".hidden", ""] {
            assert!(overlay(dir.path(), image, "vm-1").is_err(), "{image}");
        }
        assert_eq!(overlay(dir.path(), "absent", "vm-1").expect("no base image"), None);
    }
}
