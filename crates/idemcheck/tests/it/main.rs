//! idemcheck's own tests: every vector passes against the real leasebroker binary, and each
//! vector fails against a fixture with at least one deliberate defect, so none passes vacuously.

mod fixture;
mod kit;
mod leasebroker;
