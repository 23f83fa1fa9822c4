//! [`HvError`]: why a hypervisor (or BMC) call failed, and whether it may have taken effect.

use reqwest::StatusCode;

/// Why a hypervisor call failed.
///
/// The variants fall in two classes, told apart by [`HvError::may_have_happened`]: *definite*
/// failures, where the hypervisor certainly did nothing, and *ambiguous* ones, where the call may
/// have taken effect even though no answer came back.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum HvError {
    /// The base URL given to [`HypervisorClient::new`](super::client::HypervisorClient::new) is unusable. Definite.
    #[error("invalid hypervisor URL {url:?}: {reason}")]
    InvalidUrl {
        /// The URL as given.
        url: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A setting of a BMC backend is unusable (`--bmc-url`, `--firmware-images`). Definite.
    #[error("{flag} {value:?}: {reason}")]
    InvalidSetting {
        /// The flag.
        flag: &'static str,
        /// The value as given.
        value: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The CA certificate file given to
    /// [`HypervisorClient::with_ca_cert`](super::client::HypervisorClient::with_ca_cert) is unusable. Definite.
    #[error("hypervisor CA certificate {}: {reason}", path.display())]
    InvalidCaCert {
        /// The file as given.
        path: std::path::PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    /// The request could not be built or no connection could be made (refused, unreachable, DNS,
    /// connect timeout): nothing was sent. Definite.
    #[error("could not reach the hypervisor")]
    Connect(#[source] reqwest::Error),
    /// No complete answer arrived within the per-call timeout. Ambiguous: the request may have
    /// been received and acted on.
    #[error("hypervisor call timed out")]
    Timeout(#[source] reqwest::Error),
    /// The connection failed after the request went out (reset, closed before or during the
    /// answer). Ambiguous.
    #[error("hypervisor connection failed mid-request")]
    Transport(#[source] reqwest::Error),
    /// The hypervisor answered with a status other than the one the call expects. A 4xx (such
    /// as 404 or 422) is a refusal and definite; anything else (any 5xx, 503 included, a redirect,
    /// an unknown success code) is ambiguous, since it says nothing reliable about whether the work
    /// was done.
    #[error("hypervisor answered {status}: {body}")]
    Status {
        /// The status.
        status: StatusCode,
        /// The start of the answer's body (empty if it could not be read).
        body: String,
    },
    /// A success status whose body could not be read as the expected JSON. Ambiguous: the work
    /// was done, but its result (the VM id) is unknown.
    #[error("could not decode the hypervisor's answer")]
    Decode(#[source] reqwest::Error),
    /// A client middleware failed the call (the key propagation never does). Ambiguous: where in
    /// the chain it failed is not known.
    #[error("hypervisor call failed in the client: {message}")]
    Middleware {
        /// The middleware's message.
        message: String,
    },
    /// A libvirt call failed (`--hypervisor-url libvirt+...`). Definite when libvirt refused it
    /// before acting (no such domain, an invalid definition, no connection); ambiguous when the
    /// connection was lost mid-call, the call timed out, or libvirt failed inside.
    #[error("{message}")]
    Libvirt {
        /// libvirt's message (bounded).
        message: String,
        /// The HTTP status the refusal stands for (404: no such domain; 422: a definition
        /// libvirt refused), so the service answers as it would for the HTTP hypervisor.
        status: Option<StatusCode>,
        /// Whether libvirt certainly did nothing.
        definite: bool,
    },
}

impl HvError {
    /// Whether the call may have taken effect on the hypervisor despite the error.
    ///
    /// `false` only when the hypervisor certainly did nothing: the request was refused with a 4xx,
    /// or never left this process (bad URL, connection not established). Everything else (a
    /// timeout, a connection lost mid-request, any 5xx, an unreadable success) is `true`: the
    /// caller must reconcile before concluding the work did not happen.
    pub fn may_have_happened(&self) -> bool {
        match self {
            Self::InvalidUrl { .. } | Self::InvalidSetting { .. } | Self::InvalidCaCert { .. } | Self::Connect(_) => {
                false
            }
            Self::Status { status, .. } => !status.is_client_error(),
            Self::Timeout(_) | Self::Transport(_) | Self::Decode(_) | Self::Middleware { .. } => true,
            Self::Libvirt { definite, .. } => !definite,
        }
    }

    /// The HTTP status the hypervisor answered with, if it answered.
    pub fn status(&self) -> Option<StatusCode> {
        match self {
            Self::Status { status, .. } => Some(*status),
            Self::Libvirt { status, .. } => *status,
            Self::InvalidUrl { .. }
            | Self::InvalidSetting { .. }
            | Self::InvalidCaCert { .. }
            | Self::Connect(_)
            | Self::Timeout(_)
            | Self::Transport(_)
            | Self::Decode(_)
            | Self::Middleware { .. } => None,
        }
    }

    /// Classifies an error of the client with middleware like [`HvError::from_transport`].
    pub(in crate::hypervisor) fn from_middleware(err: reqwest_middleware::Error) -> Self {
        match err {
            reqwest_middleware::Error::Reqwest(err) => Self::from_transport(err),
            reqwest_middleware::Error::Middleware(err) => Self::Middleware { message: format!("{err:#}") },
        }
    }

    /// Classifies a transport-level error by whether the request could have reached the server.
    pub(in crate::hypervisor) fn from_transport(err: reqwest::Error) -> Self {
        // Connect first: a connect timeout is also a timeout, but nothing was sent. A failed TLS
        // handshake (an untrusted certificate) is part of connecting, so it lands here too.
        if err.is_connect() || err.is_builder() {
            Self::Connect(err)
        } else if err.is_timeout() {
            Self::Timeout(err)
        } else if err.is_decode() {
            Self::Decode(err)
        } else {
            Self::Transport(err)
        }
    }
}
