//! lbctl: the leasebroker command line
