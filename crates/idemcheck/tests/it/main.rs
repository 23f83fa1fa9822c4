//! idemcheck's own tests: every vector passes against the real leasebroker binary, and each
//! vector fails against a fixture with at least one deliberate defect, so none passes vacuously;
//! `idemcheck client` passes a right client and fails each deliberately broken one where it should.

// A test is one scenario read top to bottom; the 100-line rule is for the code it tests.
#![allow(clippy::too_many_lines)]

mod clientcheck;
mod fixture;
mod kit;
mod leasebroker;
