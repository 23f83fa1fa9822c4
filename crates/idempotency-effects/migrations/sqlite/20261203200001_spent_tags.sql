-- Tags this ledger issued whose intents are gone (a finished or rolled-back operation's, or a
-- kept resource the service deleted), kept until the retention passes after spent_at: the
-- inventory sweep undoes only what carries a tag this ledger issued, never another service's on
-- a downstream they share.
CREATE TABLE fx_spent (
    tag      TEXT    PRIMARY KEY,
    spent_at INTEGER NOT NULL
);
CREATE INDEX fx_spent_at ON fx_spent (spent_at);
