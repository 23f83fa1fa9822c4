//! The OpenAPI document served at `/openapi.json`.

use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::{Modify, OpenApi};

#[derive(OpenApi)]
#[openapi(
    info(title = "leasebroker", description = "Hands out worker nodes from a pool; every mutating route is safe to retry with Idempotency-Key."),
    paths(
        crate::api::create_worker,
        crate::api::list_workers,
        crate::api::get_worker,
        crate::api::delete_worker,
        crate::api::reboot_worker,
        crate::api::fleet,
        crate::api::healthz,
        crate::api::readyz,
        crate::api::metrics,
    ),
    components(schemas(crate::service::CreateWorker, crate::api::Worker, crate::api::WorkerPage, crate::api::RebootResult, crate::api::Fleet)),
    modifiers(&Bearer),
)]
struct ApiDoc;

struct Bearer;

impl Modify for Bearer {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        let components = openapi.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "bearer",
            SecurityScheme::Http(HttpBuilder::new().scheme(HttpAuthScheme::Bearer).build()),
        );
    }
}

/// The document.
pub fn document() -> utoipa::openapi::OpenApi {
    ApiDoc::openapi()
}
