-- Long-running operations (issue 15): firmware flashes.
--
-- One row per operation, keyed by a sub-key derived from its request's idempotency record, so a
-- retry finds the operation an earlier attempt started. The row carries the flash's intent: the
-- tag sent to the BMC (another derived sub-key, by which a retry reconciles) and the moment the
-- call was last sent (the settle window runs from it). A watcher follows every running operation
-- to its end, holding a lease on the row (watcher, watch_until) taken by compare-and-set, so that
-- several replicas never watch one operation at once and a restarted one resumes from the rows.
CREATE TABLE lb_flash_operations (
    op_id        TEXT PRIMARY KEY,
    node_id      TEXT NOT NULL REFERENCES lb_nodes (node_id),
    version      TEXT NOT NULL,
    -- running | succeeded | failed
    state        TEXT NOT NULL,
    error        TEXT,
    -- The BMC call: 'unsent' (definitely not sent), 'pending' (sent at sent_at, outcome unknown),
    -- 'accepted' (the BMC took it, or holds its tag).
    intent       TEXT NOT NULL,
    tag          TEXT NOT NULL UNIQUE,
    sent_at      INTEGER NOT NULL,
    created_at   INTEGER NOT NULL,
    finished_at  INTEGER,
    watcher      TEXT,
    watch_until  INTEGER NOT NULL DEFAULT 0
);
-- At most one running operation per node: a second key's flash is refused (409), never sent.
CREATE UNIQUE INDEX lb_flash_one_running_per_node ON lb_flash_operations (node_id) WHERE state = 'running';
CREATE INDEX lb_flash_running ON lb_flash_operations (state, watch_until);

-- Nodes a watcher saw bricked (for /admin/v1/fleet's nodes_bricked).
CREATE TABLE lb_bricked_nodes (
    node_id    TEXT PRIMARY KEY,
    seen_at    INTEGER NOT NULL
);

INSERT INTO lb_counters (name, value) VALUES ('flashes', 0);
