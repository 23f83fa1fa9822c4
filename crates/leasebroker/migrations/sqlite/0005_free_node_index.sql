-- Allocation by index (issue 16): a create takes the first free node in id order. Without this
-- index SQLite read every free node and sorted them (a temporary B-tree per create), and
-- PostgreSQL walked the primary key past every allocated node. The partial index holds the free
-- nodes only, in id order, so the first one is the index's first entry.
CREATE INDEX lb_nodes_free ON lb_nodes (node_id) WHERE alloc_id IS NULL;
-- The quota's count of a principal's nodes (`--max-workers-per-principal`) read every node.
CREATE INDEX lb_nodes_by_principal ON lb_nodes (principal);

-- The boots counter in 64 rows (`boots:0` .. `boots:63`; the total adds the `boots` row): every
-- create counted on one row, and on PostgreSQL that row stays locked until the counting
-- transaction's commit is flushed, so creates took turns at it.
WITH RECURSIVE shard(i) AS (SELECT 0 UNION ALL SELECT i + 1 FROM shard WHERE i < 63)
INSERT INTO lb_counters (name, value) SELECT 'boots:' || i, 0 FROM shard;
