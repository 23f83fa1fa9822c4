-- leasebroker's domain: the node pool, leases, hypervisor intents and workers.
-- Every side effect of a request is keyed by a sub-key derived from its idempotency record,
-- and each key column is UNIQUE, so a retry finds what an earlier attempt did instead of
-- doing it again.
CREATE TABLE lb_nodes (
    node_id      TEXT PRIMARY KEY,
    cpu          BIGINT NOT NULL,
    memory_gb    BIGINT NOT NULL,
    alloc_id     TEXT UNIQUE,
    principal    TEXT,
    allocated_at BIGINT
);

CREATE TABLE lb_leases (
    lease_id   TEXT PRIMARY KEY,
    node_id    TEXT NOT NULL UNIQUE REFERENCES lb_nodes (node_id),
    principal  TEXT NOT NULL,
    created_at BIGINT NOT NULL
);

CREATE TABLE lb_intents (
    intent_id       TEXT PRIMARY KEY,
    kind            TEXT NOT NULL,
    state           TEXT NOT NULL,
    vm_id           TEXT,
    created_at      BIGINT NOT NULL,
    last_attempt_at BIGINT NOT NULL
);

CREATE TABLE lb_workers (
    worker_id    TEXT PRIMARY KEY,
    principal    TEXT NOT NULL,
    image        TEXT NOT NULL,
    cpu          BIGINT NOT NULL,
    memory_gb    BIGINT NOT NULL,
    labels       TEXT NOT NULL,
    node_id      TEXT NOT NULL UNIQUE REFERENCES lb_nodes (node_id),
    lease_id     TEXT NOT NULL UNIQUE REFERENCES lb_leases (lease_id),
    vm_id        TEXT NOT NULL,
    state        TEXT NOT NULL,
    reboot_count BIGINT NOT NULL DEFAULT 0,
    created_at   BIGINT NOT NULL
);

CREATE INDEX lb_workers_by_principal ON lb_workers (principal, worker_id);
