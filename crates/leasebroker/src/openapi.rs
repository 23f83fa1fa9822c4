//! The OpenAPI document served at `/openapi.json`: what is said once for the whole API (the info,
//! the `bearer` scheme, the `Problem` schema, the responses common to every route of a kind); each
//! handler's own part is collected where the router registers it ([`crate::routes`]).

use utoipa::openapi::header::HeaderBuilder;
use utoipa::openapi::path::{Operation, ParameterBuilder, ParameterIn};
use utoipa::openapi::response::Response;
use utoipa::openapi::schema::{ObjectBuilder, Type};
use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::openapi::{Content, Ref, RefOr, Required};
use utoipa::{Modify, OpenApi};

/// What the document says once for the whole API; the router adds each handler's part as it
/// registers it ([`utoipa_axum::routes!`]), and [`finish`] what needs all of them. The handlers'
/// request and response schemas come with their paths; `Problem` is only referenced by name (from
/// `CommonResponses`), so it is listed here.
#[derive(OpenApi)]
#[openapi(
    info(title = "leasebroker", description = "Hands out worker nodes from a pool; every mutating route is safe to retry with Idempotency-Key."),
    components(schemas(Problem)),
    modifiers(&Bearer),
)]
pub(crate) struct ApiDoc;

/// The document once every route is registered: with `CommonResponses` added, which needs the
/// operations (as a modifier of [`ApiDoc`] it would run before there are any).
pub(crate) fn finish(mut collected: utoipa::openapi::OpenApi) -> utoipa::openapi::OpenApi {
    CommonResponses.modify(&mut collected);
    collected
}

/// An RFC 9457 problem: the body of every error response, as `application/problem+json`.
/// Only its schema is here: `idempotency_tower::Problem` renders the real thing.
struct Problem;

impl utoipa::PartialSchema for Problem {
    fn schema() -> RefOr<utoipa::openapi::schema::Schema> {
        let field = |ty, description: &str| ObjectBuilder::new().schema_type(ty).description(Some(description));
        ObjectBuilder::new()
            .description(Some("An RFC 9457 problem: the body of every error response, as `application/problem+json`."))
            .property(
                "type",
                field(Type::String, "A URI that ends in the problem's name, e.g. `/problems/idempotency-key-reused`."),
            )
            .property("title", field(Type::String, "The same for every occurrence of the problem."))
            .property("status", field(Type::Integer, "The HTTP status.").minimum(Some(100)).maximum(Some(599)))
            .property("detail", field(Type::String, "About this occurrence."))
            .required("type")
            .required("title")
            .required("status")
            .required("detail")
            .into()
    }
}

impl utoipa::ToSchema for Problem {}

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

/// What every route of a kind can answer besides its own outcomes, said once here rather than
/// on each handler: the bearer check's 401 and the database's 503 on authenticated routes; the
/// idempotency layer's 400, 409 and 413 on mutating ones, with the key's syntax; and the problem
/// schema on every error.
struct CommonResponses;

impl CommonResponses {
    fn operation(path: &str, mutating: bool, op: &mut Operation) {
        let authenticated = op.security.as_ref().is_some_and(|s| !s.is_empty());
        let responses = &mut op.responses.responses;
        let mut add = |status: &str, description: &str| {
            responses.entry(status.to_owned()).or_insert_with(|| RefOr::T(Response::new(description)));
        };
        if authenticated {
            add("401", "Unauthorized: no valid bearer token");
            add("503", "The database is unavailable (retry)");
        }
        if mutating && (path.starts_with("/v1/") || path.starts_with("/admin/")) {
            add("400", "A missing or invalid Idempotency-Key");
            add("409", "The key was used with another request, or its request is still in progress");
            add("413", "The body is over 1 MiB");
            for p in op.parameters.iter_mut().flatten() {
                if p.parameter_in == ParameterIn::Header && p.name.eq_ignore_ascii_case("idempotency-key") {
                    p.required = Required::True;
                    p.schema = Some(RefOr::T(
                        ObjectBuilder::new()
                            .schema_type(Type::String)
                            .min_length(Some(1))
                            .max_length(Some(128))
                            .pattern(Some("^[!-~]{1,128}$"))
                            .into(),
                    ));
                }
            }
        }
        for (status, response) in responses.iter_mut() {
            if let (RefOr::T(response), true) = (response, status.starts_with('4') || status.starts_with('5')) {
                response.content.clear();
                response.content.insert(
                    "application/problem+json".to_owned(),
                    Content::new(Some(RefOr::Ref(Ref::from_schema_name("Problem")))),
                );
            }
        }
        if mutating && (path.starts_with("/v1/") || path.starts_with("/admin/")) {
            Self::protocol_headers(op);
        }
    }
}

impl CommonResponses {
    /// docs/protocol.md#records's protocol headers on a protected operation: `Prefer: wait=N` and the
    /// Repeatable Requests headers in, and `Idempotency-Key-Expires`, `Repeatability-Result` and
    /// `Preference-Applied` out.
    fn protocol_headers(op: &mut Operation) {
        let string = || ObjectBuilder::new().schema_type(Type::String);
        let prefer = ParameterBuilder::new()
            .name("Prefer")
            .parameter_in(ParameterIn::Header)
            .required(Required::False)
            .description(Some(
                "RFC 7240 preferences; `wait=N`: when the key's request is still in flight, wait up to \
                 min(N, --max-wait) seconds for it to complete and get its response (replayed, with \
                 `Preference-Applied`) instead of `409 request-in-progress`. Other preferences are ignored.",
            ))
            .schema(Some(string().examples(["wait=10"])))
            .build();
        let optional_header = |name: &str, description: &str, example: &str| {
            ParameterBuilder::new()
                .name(name)
                .parameter_in(ParameterIn::Header)
                .required(Required::False)
                .description(Some(description))
                .schema(Some(string().examples([example])))
                .build()
        };
        let repeatability = [
            optional_header(
                "Repeatability-Request-ID",
                "Only when the service runs with `--key-sources repeatability`: the request's key, as \
                 OASIS Repeatable Requests send it; the same record and scope as `Idempotency-Key` with \
                 the same value (then `Idempotency-Key` may be left out; two different keys: `400`). \
                 Needs `Repeatability-First-Sent`. Likewise, with `--key-sources request-id`, the \
                 top-level JSON body field `request_id` (AIP-155) on the operations with a body.",
                "0f8fad5b-d9cb-469f-a165-70867728950e",
            ),
            optional_header(
                "Repeatability-First-Sent",
                "With `Repeatability-Request-ID`: when the request was first sent (IMF-fixdate). Longer \
                 ago than the retention: `412 repeatability-expired`, nothing runs.",
                "Sun, 06 Nov 1994 08:49:37 GMT",
            ),
        ];
        let params = op.parameters.get_or_insert_with(Vec::new);
        for p in std::iter::once(prefer).chain(repeatability) {
            if !params.iter().any(|q| q.name.eq_ignore_ascii_case(&p.name)) {
                params.push(p);
            }
        }
        for response in op.responses.responses.values_mut() {
            let RefOr::T(response) = response else { continue };
            response.headers.insert(
                "Idempotency-Key-Expires".to_owned(),
                HeaderBuilder::new()
                    .schema(string().format(Some(utoipa::openapi::SchemaFormat::Custom("http-date".to_owned()))))
                    .description(Some(
                        "When the key's record expires, as an IMF-fixdate (`Sun, 06 Nov 1994 08:49:37 GMT`): \
                         until then a retry with the key is answered from the record; after it the key is \
                         free again. Sent on every response that has a record (the first response once \
                         stored, replays, `409` in flight, the key-reused problem), not on a response \
                         that stored nothing (5xx, 401, 429, ...).",
                    ))
                    .build(),
            );
            response.headers.insert(
                "Repeatability-Result".to_owned(),
                HeaderBuilder::new()
                    .schema(string().enum_values(Some(["accepted", "rejected"])))
                    .description(Some(
                        "On the answer to a request keyed by `Repeatability-Request-ID`: `accepted` when \
                         it was executed or replayed, `rejected` when the idempotency layer refused it.",
                    ))
                    .build(),
            );
            response.headers.insert(
                "Preference-Applied".to_owned(),
                HeaderBuilder::new()
                    .schema(string())
                    .description(Some(
                        "`wait=W` when the request's `Prefer: wait` was honoured: it waited up to W seconds \
                         for the request in flight with its key.",
                    ))
                    .build(),
            );
        }
    }
}

impl Modify for CommonResponses {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        for (path, item) in openapi.paths.paths.iter_mut() {
            for (op, mutating) in [
                (&mut item.get, false),
                (&mut item.head, false),
                (&mut item.options, false),
                (&mut item.post, true),
                (&mut item.put, true),
                (&mut item.patch, true),
                (&mut item.delete, true),
            ] {
                if let Some(op) = op {
                    Self::operation(path, mutating, op);
                }
            }
        }
    }
}
