//! The fault harness: real processes, real faults, and a count of what was duplicated or lost
