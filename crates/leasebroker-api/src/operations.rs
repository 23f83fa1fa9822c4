//! Long-running operations (docs/protocol.md#firmware-operations): the firmware flash that starts one, and the operation as
//! the API shows it.

use std::fmt;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use crate::{InvalidRequest, NodeId, OperationId};

/// `POST /admin/v1/nodes/{node_id}/firmware` body.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct FlashFirmware {
    /// The firmware version to flash: 1-64 ASCII letters, digits, `.`, `-`, `_` or `+`.
    #[cfg_attr(feature = "openapi", schema(min_length = 1, max_length = 64, example = "2.4.1"))]
    pub version: String,
    /// Flash even though a worker holds the node (its VM is disrupted). Without it, a flash of
    /// a held node answers `409 node-in-use`.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub force: bool,
}

/// The longest firmware version.
pub const MAX_VERSION: usize = 64;

impl FlashFirmware {
    /// A request to flash `version` (refused while a worker holds the node).
    pub fn new(version: impl Into<String>) -> Self {
        FlashFirmware { version: version.into(), force: false }
    }

    /// The same request, flashing even a node a worker holds.
    pub fn forced(self) -> Self {
        FlashFirmware { force: true, ..self }
    }

    /// Checks the version.
    pub fn validate(&self) -> Result<(), InvalidRequest> {
        let v = &self.version;
        if v.is_empty() || v.len() > MAX_VERSION {
            return Err(InvalidRequest(format!(
                "version must be 1 to {MAX_VERSION} characters, got {}",
                v.chars().count()
            )));
        }
        if !v.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'-' | b'_' | b'+')) {
            return Err(InvalidRequest("version may hold only ASCII letters, digits, '.', '-', '_' and '+'".into()));
        }
        Ok(())
    }
}

/// A string enum of the wire with a fallback, `Other`, for names this side does not know yet:
/// the enum, its names, `From<String>`, `Into<String>`, `Display` and (with `openapi`) a schema listing the
/// known names.
macro_rules! open_enum {
    ($(#[$doc:meta])* $name:ident { $($(#[$vdoc:meta])* $variant:ident = $wire:literal,)+ }) => {
        $(#[$doc])*
        #[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
        #[serde(from = "String", into = "String")]
        pub enum $name {
            $($(#[$vdoc])* $variant,)+
            /// A name this side does not know yet, as the server wrote it.
            Other(String),
        }

        impl $name {
            /// The names this side knows, in the order they were declared: the values a flag or
            /// a form offers.
            pub const KNOWN: &'static [&'static str] = &[$($wire),+];

            /// The name as the API writes it.
            pub fn as_str(&self) -> &str {
                match self {
                    $($name::$variant => $wire,)+
                    $name::Other(name) => name,
                }
            }
        }

        impl From<String> for $name {
            fn from(name: String) -> Self {
                match name.as_str() {
                    $($wire => $name::$variant,)+
                    _ => $name::Other(name),
                }
            }
        }

        impl From<$name> for String {
            fn from(value: $name) -> String {
                match value {
                    $name::Other(name) => name,
                    known => known.as_str().to_owned(),
                }
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.as_str())
            }
        }

        #[cfg(feature = "openapi")]
        impl utoipa::PartialSchema for $name {
            fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
                utoipa::openapi::schema::ObjectBuilder::new()
                    .schema_type(utoipa::openapi::schema::Type::String)
                    .enum_values(Some([$($wire),+]))
                    .into()
            }
        }

        #[cfg(feature = "openapi")]
        impl utoipa::ToSchema for $name {}
    };
}

open_enum!(
    /// What a long-running operation does. A kind this side does not know yet is kept as
    /// [`OperationKind::Other`], so a newer server's operations still parse.
    OperationKind {
        /// `firmware-flash`: a node's BMC firmware is written.
        FirmwareFlash = "firmware-flash",
    }
);

open_enum!(
    /// Where a long-running operation is. A state this side does not know yet is kept as
    /// [`OperationState::Other`] instead of failing the parse: a newer server may add states,
    /// and a client that cannot read them would lose track of an operation that is still running.
    OperationState {
        /// The work goes on.
        Running = "running",
        /// The work is done.
        Succeeded = "succeeded",
        /// The work ended without success; [`Operation::error`] says why.
        Failed = "failed",
        /// The work was sent and what came of it cannot be read ([`Operation::error`] says
        /// why): nothing more happens until an operator checks the machine and resolves it
        /// (`POST /admin/v1/operations/{op_id}/resolve`), and its node takes no other flash.
        Uncertain = "uncertain",
    }
);

impl OperationState {
    /// Whether this is one of the known final states (`succeeded`, `failed`). An unknown state
    /// is not known to be final: see [`Operation::is_finished`]; nor is `uncertain`, which an
    /// operator resolves to one of them.
    pub fn is_terminal(&self) -> bool {
        matches!(self, OperationState::Succeeded | OperationState::Failed)
    }
}

/// How an operator found the machine of an `uncertain` operation: the `state` of
/// [`ResolveOperation`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "lowercase")]
pub enum Resolution {
    /// The machine runs the version: the operation succeeded.
    Succeeded,
    /// It does not: the operation failed.
    Failed,
}

impl Resolution {
    /// The operation's state after it: `succeeded` or `failed`.
    pub fn as_str(self) -> &'static str {
        match self {
            Resolution::Succeeded => "succeeded",
            Resolution::Failed => "failed",
        }
    }
}

impl fmt::Display for Resolution {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for Resolution {
    type Err = InvalidRequest;

    fn from_str(s: &str) -> Result<Self, InvalidRequest> {
        match s {
            "succeeded" => Ok(Resolution::Succeeded),
            "failed" => Ok(Resolution::Failed),
            _ => Err(InvalidRequest(format!(
                "state must be succeeded or failed, got {:?}",
                s.chars().take(32).collect::<String>()
            ))),
        }
    }
}

/// The longest reason an operator gives when resolving an operation, in characters.
pub const MAX_REASON: usize = 500;

/// `POST /admin/v1/operations/{op_id}/resolve` body: ends an `uncertain` operation as the
/// operator found the machine.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct ResolveOperation {
    /// `succeeded` (the machine runs the version) or `failed`.
    pub state: Resolution,
    /// What the operator found, and how: 1 to 500 characters, no control characters.
    #[cfg_attr(
        feature = "openapi",
        schema(min_length = 1, max_length = 500, example = "the BMC shows 2.4.1 after a power cycle")
    )]
    pub reason: String,
}

impl ResolveOperation {
    /// Resolves as `state`, for `reason`.
    pub fn new(state: Resolution, reason: impl Into<String>) -> Self {
        ResolveOperation { state, reason: reason.into() }
    }

    /// Checks the reason.
    pub fn validate(&self) -> Result<(), InvalidRequest> {
        let n = self.reason.chars().count();
        if self.reason.trim().is_empty() || n > MAX_REASON {
            return Err(InvalidRequest(format!("reason must be 1 to {MAX_REASON} characters, not blank, got {n}")));
        }
        if self.reason.chars().any(char::is_control) {
            return Err(InvalidRequest("reason may not hold control characters".into()));
        }
        Ok(())
    }
}

/// A long-running operation: `GET /admin/v1/operations/{op_id}`, and the body of the `202` that
/// started it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Operation {
    /// Its id, `op-...`.
    pub id: OperationId,
    /// What it does: `firmware-flash`.
    pub kind: OperationKind,
    /// The node it works on.
    pub node_id: NodeId,
    /// The firmware version it writes.
    pub version: String,
    /// `running`, `succeeded`, `failed` or `uncertain`.
    pub state: OperationState,
    /// Why it failed, or why its outcome is uncertain; null otherwise.
    #[serde(default)]
    pub error: Option<String>,
    /// When it was accepted: RFC 3339, UTC, microseconds.
    #[serde(with = "crate::time::micros")]
    #[cfg_attr(feature = "openapi", schema(value_type = String, format = DateTime))]
    pub created_at: DateTime<Utc>,
    /// When it ended (RFC 3339, UTC, microseconds); null while it runs.
    #[serde(default, with = "crate::time::option_micros")]
    #[cfg_attr(feature = "openapi", schema(value_type = Option<String>, format = DateTime))]
    pub finished_at: Option<DateTime<Utc>>,
}

impl Operation {
    /// Whether the operation has come to its end by itself: its state is `succeeded` or
    /// `failed`, or `uncertain` (nothing more happens until an operator resolves it), or a state
    /// this side does not know together with a `finished_at` (a newer server's final state).
    pub fn is_finished(&self) -> bool {
        match self.state {
            OperationState::Other(_) => self.finished_at.is_some(),
            OperationState::Uncertain => true,
            ref state => state.is_terminal(),
        }
    }
}

#[cfg(test)]
mod tests;
