//! An operator's word on an `uncertain` flash: `POST /admin/v1/operations/{op_id}/resolve`.

use leasebroker_api::{OperationId, Resolution, ResolveOperation};

use super::request::Firmware;
use crate::domain::{FlashRow, Resolved};
use crate::service::{ServiceError, now_micros};

impl Firmware {
    /// Ends the `uncertain` operation `op_id` as `actor` found the machine (`req`), with the
    /// audit line (who, with which request key, what and why). An operation in any other state
    /// is refused ([`ServiceError::OperationNotUncertain`]).
    pub async fn resolve(
        &self,
        op_id: &str,
        req: &ResolveOperation,
        actor: &str,
        request_key: &str,
    ) -> Result<FlashRow, ServiceError> {
        req.validate()?;
        let Ok(op) = op_id.parse::<OperationId>() else {
            return Err(ServiceError::NoSuchOperation(op_id.to_owned()));
        };
        let succeeded = req.state == Resolution::Succeeded;
        match self.domain.resolve_flash(&op, succeeded, &req.reason, now_micros()).await? {
            Resolved::Resolved(row) => {
                tracing::info!(
                    target: "leasebroker::audit",
                    actor,
                    action = "resolve-operation",
                    request_key,
                    op_id,
                    node_id = %row.node_id,
                    state = %req.state,
                    reason = %req.reason,
                    "audit: an operator resolved an uncertain operation"
                );
                Ok(row)
            }
            Resolved::NotUncertain(row) => {
                Err(ServiceError::OperationNotUncertain { op_id: row.op_id.into(), state: row.state.into() })
            }
            Resolved::NoOperation => Err(ServiceError::NoSuchOperation(op_id.to_owned())),
        }
    }
}
