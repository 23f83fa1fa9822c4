//! Where the VMs and the BMCs are: `--hypervisor-url` as a [`HypervisorUrl`] and `--bmc-url` as
//! a [`BmcUrl`], each parsed once when the flag is read. A new backend is a variant here and an
//! arm where the service is built (`app.rs`).

use std::fmt;
use std::str::FromStr;

use idempotency_stores::redact;

/// The scheme prefix of a libvirt `--hypervisor-url`: `libvirt+<libvirt URI>`.
pub const LIBVIRT_PREFIX: &str = "libvirt+";

/// The scheme prefix of a Redfish `--bmc-url`: `redfish+http://...` or `redfish+https://...`.
pub const REDFISH_PREFIX: &str = "redfish+";

/// `--hypervisor-url`: the VMs behind the hypervisor's HTTP API, or on a libvirt host.
/// [`Display`](fmt::Display) and [`Debug`] show it redacted.
#[derive(Clone, PartialEq, Eq)]
pub enum HypervisorUrl {
    /// `http://HOST:PORT` or `https://...` (a path prefix is kept): the hypervisor API, whose
    /// BMC API is beside it.
    Http(String),
    /// `libvirt+URI` (`libvirt+qemu:///system`): the VMs are libvirt domains (a build with the
    /// `libvirt` feature); the BMCs are then the in-process simulator's. Holds the whole URL.
    Libvirt(String),
}

/// `--bmc-url`: a Redfish service (`redfish+http://HOST:PORT` or `redfish+https://...`, with
/// `USER:PASSWORD@` for basic authentication). [`Display`](fmt::Display) and [`Debug`] show it
/// redacted.
#[derive(Clone, PartialEq, Eq)]
pub enum BmcUrl {
    /// The whole URL, `redfish+` included.
    Redfish(String),
}

/// A URL of the wrong kind for its flag; the message says which forms the flag takes.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unsupported URL; use {0}")]
pub struct UnsupportedUrl(&'static str);

impl HypervisorUrl {
    /// The URL as given (secrets included: log `self` instead).
    pub fn as_str(&self) -> &str {
        match self {
            Self::Http(url) | Self::Libvirt(url) => url,
        }
    }
}

impl BmcUrl {
    /// The URL as given (secrets included: log `self` instead).
    pub fn as_str(&self) -> &str {
        match self {
            Self::Redfish(url) => url,
        }
    }
}

/// True when `url` is `scheme://` followed by something.
fn has_scheme(url: &str, schemes: &[&str]) -> bool {
    url.split_once("://").is_some_and(|(scheme, rest)| schemes.contains(&scheme) && !rest.is_empty())
}

impl FromStr for HypervisorUrl {
    type Err = UnsupportedUrl;

    fn from_str(url: &str) -> Result<Self, Self::Err> {
        match url.strip_prefix(LIBVIRT_PREFIX) {
            Some(uri) if !uri.is_empty() => Ok(Self::Libvirt(url.to_owned())),
            None if has_scheme(url, &["http", "https"]) => Ok(Self::Http(url.to_owned())),
            _ => Err(UnsupportedUrl("http://HOST:PORT, https://HOST:PORT or libvirt+URI (libvirt+qemu:///system)")),
        }
    }
}

impl FromStr for BmcUrl {
    type Err = UnsupportedUrl;

    fn from_str(url: &str) -> Result<Self, Self::Err> {
        match url.strip_prefix(REDFISH_PREFIX) {
            Some(plain) if has_scheme(plain, &["http", "https"]) => Ok(Self::Redfish(url.to_owned())),
            _ => Err(UnsupportedUrl(
                "redfish+http://HOST:PORT or redfish+https://HOST:PORT (without it the BMCs are the hypervisor's)",
            )),
        }
    }
}

impl fmt::Display for HypervisorUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&redact(self.as_str()))
    }
}

impl fmt::Debug for HypervisorUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = match self {
            Self::Http(_) => "Http",
            Self::Libvirt(_) => "Libvirt",
        };
        f.debug_tuple(kind).field(&redact(self.as_str())).finish()
    }
}

impl fmt::Display for BmcUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&redact(self.as_str()))
    }
}

impl fmt::Debug for BmcUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("Redfish").field(&redact(self.as_str())).finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hypervisor_urls_parse_to_their_backend() {
        for url in ["http://127.0.0.1:8090", "https://hv.example/api/", "http://u:p@h:1"] {
            assert_eq!(url.parse(), Ok(HypervisorUrl::Http(url.to_owned())), "{url}");
        }
        for url in ["libvirt+qemu:///system", "libvirt+qemu+ssh://root@host/system", "libvirt+test:///default"] {
            assert_eq!(url.parse(), Ok(HypervisorUrl::Libvirt(url.to_owned())), "{url}");
        }
        for url in ["", "libvirt+", "ftp://h", "http://", "127.0.0.1:8090", "redfish+http://h", "qemu:///system"] {
            let err = url.parse::<HypervisorUrl>().expect_err(url).to_string();
            assert!(err.contains("http://HOST:PORT") && err.contains("libvirt+URI"), "{url:?}: {err}");
        }
    }

    #[test]
    fn bmc_urls_are_redfish_only() {
        for url in ["redfish+http://127.0.0.1:8000", "redfish+https://admin:secret@bmc.example"] {
            assert_eq!(url.parse(), Ok(BmcUrl::Redfish(url.to_owned())), "{url}");
        }
        for url in ["", "https://admin:secret@bmc.example", "redfish+", "redfish+ftp://h", "redfish+http://"] {
            let err = url.parse::<BmcUrl>().expect_err(url).to_string();
            assert!(err.contains("redfish+http://") && !err.contains("secret"), "{url:?}: {err}");
        }
    }

    #[test]
    fn display_and_debug_hide_the_password() {
        let hv: HypervisorUrl = "https://hv:secret@h:8090/".parse().unwrap();
        assert_eq!(hv.to_string(), "https://hv:***@h:8090/");
        assert!(!format!("{hv:?}").contains("secret"));
        let bmc: BmcUrl = "redfish+https://admin:secret@bmc".parse().unwrap();
        assert_eq!(bmc.to_string(), "redfish+https://admin:***@bmc");
        assert!(!format!("{bmc:?}").contains("secret") && bmc.as_str().contains("secret"));
    }
}
