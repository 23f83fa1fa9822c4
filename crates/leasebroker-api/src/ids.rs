//! The ids the API names things by. Each is a validated string: [`is_path_id`] holds for it, so
//! an id is safe to put in a URL path as it is (no `/`, `.` or `%`) and can never address
//! another route. Parse one with `FromStr` or `TryFrom<String>` (serde does the same).

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// Whether `id` can name a worker, node, operation or record in a URL path: 1 to 128 ASCII
/// letters, digits, `-` or `_` (so it never needs escaping and never carries a `/` or `.`).
///
/// ```
/// use leasebroker_api::is_path_id;
/// assert!(is_path_id("node-0001"));
/// assert!(!is_path_id("../fleet"));
/// ```
pub fn is_path_id(id: &str) -> bool {
    !id.is_empty() && id.len() <= 128 && id.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
}

/// An id type: a string for which [`is_path_id`] holds, and the error for one that does not.
macro_rules! path_safe_id {
    ($(#[$doc:meta])* $name:ident, $(#[$err_doc:meta])* $error:ident, $what:literal) => {
        $(#[$doc])*
        #[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
        #[serde(try_from = "String", into = "String")]
        pub struct $name(String);

        impl $name {
            /// The id as text.
            pub fn as_str(&self) -> &str {
                &self.0
            }
        }

        $(#[$err_doc])*
        #[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
        #[error("{} is 1 to 128 ASCII letters, digits, '-' or '_' (got {:?})", $what, .0)]
        pub struct $error(String);

        impl FromStr for $name {
            type Err = $error;
            fn from_str(s: &str) -> Result<Self, Self::Err> {
                if is_path_id(s) { Ok($name(s.to_owned())) } else { Err($error(s.to_owned())) }
            }
        }

        impl TryFrom<String> for $name {
            type Error = $error;
            fn try_from(s: String) -> Result<Self, Self::Error> {
                if is_path_id(&s) { Ok($name(s)) } else { Err($error(s)) }
            }
        }

        impl From<$name> for String {
            fn from(id: $name) -> String {
                id.0
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }

        #[cfg(feature = "openapi")]
        impl utoipa::PartialSchema for $name {
            fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
                id_schema($what)
            }
        }

        #[cfg(feature = "openapi")]
        impl utoipa::ToSchema for $name {}
    };
}

/// The schema of every id: a string of 1 to 128 letters, digits, `-` or `_`.
#[cfg(feature = "openapi")]
fn id_schema(what: &str) -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
    use utoipa::openapi::schema::{ObjectBuilder, Type};
    ObjectBuilder::new()
        .schema_type(Type::String)
        .description(Some(format!("{what}: 1 to 128 ASCII letters, digits, '-' or '_'")))
        .min_length(Some(1))
        .max_length(Some(128))
        .pattern(Some("^[A-Za-z0-9_-]{1,128}$"))
        .into()
}

path_safe_id!(
    /// A worker id such as `wkr-7Q2K9`: 1 to 128 ASCII letters, digits, `-` or `_`.
    ///
    /// The restriction keeps an id safe to put in a URL path as it is (no `/`, `.` or `%`).
    WorkerId,
    /// A string that is not a valid worker id.
    InvalidWorkerId,
    "a worker id"
);

path_safe_id!(
    /// A node id such as `node-0001`: 1 to 128 ASCII letters, digits, `-` or `_`, like [`WorkerId`].
    NodeId,
    /// A string that is not a valid node id.
    InvalidNodeId,
    "a node id"
);

path_safe_id!(
    /// The server's id of a long-running operation, such as `op-5f1c2a`: 1 to 128 ASCII letters,
    /// digits, `-` or `_`, like [`WorkerId`].
    ///
    /// Not to be confused with lbctl's `--op-id`, the caller's own name for a request in the
    /// journal.
    OperationId,
    /// A string that is not a valid operation id.
    InvalidOperationId,
    "an operation id"
);

path_safe_id!(
    /// An idempotency record's id (32 hex digits from the server): 1 to 128 ASCII letters,
    /// digits, `-` or `_`, like [`WorkerId`].
    RecordId,
    /// A string that is not a valid record id.
    InvalidRecordId,
    "a record id"
);

impl RecordId {
    /// The id of the record whose 16 id bytes are `bytes`: their 32 lowercase hex digits, as the
    /// server writes it (always a valid id).
    pub fn from_bytes(bytes: &[u8; 16]) -> Self {
        use std::fmt::Write;
        let mut hex = String::with_capacity(32);
        for b in bytes {
            let _ = write!(hex, "{b:02x}");
        }
        RecordId(hex)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_accept_path_safe_text_only() {
        for good in ["op-5f1c2a", "A_9", "node-0001", &"x".repeat(128)] {
            assert!(is_path_id(good), "{good:?}");
            assert_eq!(good.parse::<OperationId>().unwrap().as_str(), good);
            assert_eq!(good.parse::<NodeId>().unwrap().to_string(), good);
            assert_eq!(String::from(WorkerId::try_from(good.to_owned()).unwrap()), good);
        }
        for bad in ["", "..", "../fleet", "a/b", "op.1", "op%2F", "op 1", "op-é", "a\nb", &"x".repeat(129)] {
            assert!(!is_path_id(bad), "{bad:?}");
            let err = bad.parse::<OperationId>().unwrap_err();
            assert!(err.to_string().starts_with("an operation id is 1 to 128"), "{err}");
            assert!(bad.parse::<NodeId>().is_err(), "{bad:?}");
            assert!(WorkerId::try_from(bad.to_owned()).is_err(), "{bad:?}");
            assert!(bad.parse::<RecordId>().is_err(), "{bad:?}");
        }
        let id = RecordId::from_bytes(&[0xab; 16]);
        assert_eq!(id.as_str(), "ab".repeat(16));
        assert_eq!(id.as_str().parse::<RecordId>(), Ok(id.clone()));
    }

    #[test]
    fn serde_refuses_a_bad_id() {
        let err = serde_json::from_str::<WorkerId>(r#""../../admin/v1/fleet""#).unwrap_err();
        assert!(err.to_string().starts_with("a worker id is 1 to 128"), "{err}");
        let id: WorkerId = serde_json::from_str(r#""wkr-7Q2K9""#).unwrap();
        assert_eq!(serde_json::to_string(&id).unwrap(), r#""wkr-7Q2K9""#);
    }
}
