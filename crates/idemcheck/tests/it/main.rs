//! idemcheck's own tests: every vector passes against the real leasebroker binary, and each
//! vector fails against a fixture with at least one deliberate defect, so none passes vacuously;
//! `idemcheck client` passes a right client and fails each deliberately broken one where it should.

mod clientcheck;
mod fixture;
mod kit;
mod leasebroker;
