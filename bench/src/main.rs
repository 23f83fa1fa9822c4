//! `idem-bench`: the pieces `bench/run` drives, one subcommand each. Every measuring
//! subcommand prints one JSON object on stdout; `report` turns the collected lines into the
//! table of ratios. See `bench/README.md`.

mod create;
mod load;
mod partition;
mod pg;
mod redis;
mod replication;
mod report;
mod scale;
mod server;
mod wait;

use std::path::PathBuf;

use clap::{Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(name = "idem-bench", about = "Side-by-side benchmarks of the idempotency layer and stores")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Serves a trivial `POST /v1/workers` on 127.0.0.1:0 behind the chosen layer and store;
    /// prints `listening on http://ADDR`.
    Serve(server::ServeArgs),
    /// Creates the schema and `--keys` completed records (`r-0` ...) to replay.
    PgPrepare(pg::PrepareArgs),
    /// Drives `PostgresStore` directly: first executions (claim + complete) or replays.
    PgStore(pg::StoreArgs),
    /// Writes the pgbench scripts: the store's own statements with literal arguments.
    PgbenchScripts {
        /// Where to write `replay.sql` and `first.sql`.
        #[arg(long)]
        dir: PathBuf,
        /// How many prepared keys the replay script picks from.
        #[arg(long, default_value_t = pg::DEFAULT_KEYS)]
        keys: u32,
    },
    /// Writes `create.sql`: one leasebroker create's unavoidable writes, for pgbench.
    CreateFloorScript {
        /// Where to write `create.sql`.
        #[arg(long)]
        dir: PathBuf,
    },
    /// The same writes on a SQLite file from 16 tasks: the SQLite floor under a create.
    SqliteCreateFloor(create::SqliteFloorArgs),
    /// Claim latency while the sweeper deletes `--rows` expired rows, against idle.
    Sweeper(pg::SweepArgs),
    /// Sweeping `--rows` expired rows: batched DELETE against dropping whole days (the layout
    /// partitioned by expiry day): WAL, duration, claim latency while sweeping.
    Partition(pg::SweepArgs),
    /// Bytes per stored record with a 1 KiB JSON body, compressed and raw.
    RecordSize(pg::SizeArgs),
    /// Completes the record Redis replays read and writes the `redis-benchmark` floor's
    /// scripts and argument lists.
    RedisPrepare(redis::PrepareArgs),
    /// Creates in-flight records for the floor's completions to complete.
    RedisFill(redis::FillArgs),
    /// Deletes the run's keys, counting them by record state.
    RedisClean(redis::CleanArgs),
    /// Drives `RedisStore` directly: first executions (claim + complete) or replays.
    RedisStore(redis::StoreArgs),
    /// What waiting for a replica costs: the store on a synchronous against an asynchronous
    /// Patroni cluster, and on Redis with `WAIT 1` against none; prints raw lines.
    Replication(replication::ReplicationArgs),
    /// Reads the raw measurements and writes `results.json` and `results.md`.
    Report(report::ReportArgs),
    /// Grows the scale part's table to `--records` completed records (set-based SQL).
    ScaleFill(scale::FillArgs),
    /// Plots the scale part's rows of the raw measurements as an SVG.
    PlotScale(scale::PlotArgs),
    /// `Prefer: wait`: from the first request's answer to the waiting retry's (p50/p99 ms).
    PreferWait(wait::WaitArgs),
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    match cli.command {
        Command::Serve(a) => rt.block_on(server::serve(a)),
        Command::PgPrepare(a) => rt.block_on(pg::prepare(a)),
        Command::PgStore(a) => rt.block_on(pg::drive_store(a)),
        Command::PgbenchScripts { dir, keys } => pg::write_pgbench_scripts(&dir, keys),
        Command::CreateFloorScript { dir } => create::write_pgbench_script(&dir),
        Command::SqliteCreateFloor(a) => rt.block_on(create::sqlite_floor(a)),
        Command::Sweeper(a) => rt.block_on(pg::sweeper(a)),
        Command::Partition(a) => rt.block_on(partition::partition(a)),
        Command::RecordSize(a) => rt.block_on(pg::record_size(a)),
        Command::RedisPrepare(a) => rt.block_on(redis::prepare(a)),
        Command::RedisFill(a) => rt.block_on(redis::fill(a)),
        Command::RedisClean(a) => rt.block_on(redis::clean(a)),
        Command::RedisStore(a) => rt.block_on(redis::drive_store(a)),
        Command::Replication(a) => rt.block_on(replication::replication(a)),
        Command::Report(a) => report::report(a),
        Command::ScaleFill(a) => rt.block_on(scale::fill(a)),
        Command::PlotScale(a) => scale::plot(a),
        Command::PreferWait(a) => rt.block_on(wait::wait(a)),
    }
}
