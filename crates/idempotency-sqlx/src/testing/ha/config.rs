//! The configuration files: each Patroni member's YAML and HAProxy's.

use std::path::Path;

use super::{Member, Replication};

/// What every member's configuration shares.
pub(super) struct Shared<'a> {
    pub(super) etcd_port: u16,
    pub(super) bin: &'a Path,
    pub(super) dir: &'a Path,
    pub(super) replication: Replication,
}

/// A member's Patroni configuration: a leader lock that expires after 20 s (so a member slowed
/// down by a busy machine keeps it), checked every
/// second; trust authentication on loopback; `fsync` off (the tests kill processes, not
/// machines: the page cache survives). Patroni logs to its stderr.
pub(super) fn member_config(m: &Member, shared: &Shared<'_>) -> String {
    let Shared { etcd_port, bin, dir, replication } = *shared;
    let (name, pg_port, api_port, data) = (&m.name, m.pg_port, m.api_port, &m.data);
    let sync = replication == Replication::Synchronous;
    format!(
        "scope: ha-test
namespace: /ha-test/
name: {name}
log: {{level: INFO}}
restapi: {{listen: '127.0.0.1:{api_port}', connect_address: '127.0.0.1:{api_port}'}}
etcd3: {{hosts: '127.0.0.1:{etcd_port}'}}
bootstrap:
  dcs:
    ttl: 20
    loop_wait: 1
    retry_timeout: 5
    maximum_lag_on_failover: 1073741824
    synchronous_mode: {sync}
    postgresql:
      use_pg_rewind: true
      parameters: {{wal_log_hints: 'on', max_wal_senders: 10, max_replication_slots: 10, fsync: 'off', max_connections: 200}}
  initdb: [{{encoding: UTF8}}, {{auth: trust}}]
  pg_hba: ['host replication postgres 127.0.0.1/32 trust', 'host all all 127.0.0.1/32 trust', 'local all all trust']
postgresql:
  listen: '127.0.0.1:{pg_port}'
  connect_address: '127.0.0.1:{pg_port}'
  data_dir: {data}
  bin_dir: {bin}
  pgpass: {dir}/pgpass-{name}
  authentication:
    superuser: {{username: postgres}}
    replication: {{username: postgres}}
    rewind: {{username: postgres}}
  parameters: {{unix_socket_directories: '{dir}'}}
",
        dir = dir.display(),
        data = data.display(),
        bin = bin.display(),
    )
}

/// HAProxy in TCP mode: a server is up while Patroni's `GET /primary` answers 200 on its REST
/// port (checked every 500 ms, down after two failures), and a server marked down has its
/// connections cut, so no client keeps talking to a demoted primary.
pub(super) fn haproxy_config(port: u16, members: &[Member], dir: &Path) -> String {
    let mut cfg = format!(
        "global
  maxconn 500
  stats socket {dir}/haproxy.sock mode 600 level admin
defaults
  mode tcp
  timeout connect 2s
  timeout client 30m
  timeout server 30m
  timeout check 5s
listen primary
  bind 127.0.0.1:{port}
  option httpchk GET /primary
  http-check expect status 200
  default-server inter 500ms fall 2 rise 1 on-marked-down shutdown-sessions
",
        dir = dir.display()
    );
    for m in members {
        cfg.push_str(&format!("  server {} 127.0.0.1:{} check port {}\n", m.name, m.pg_port, m.api_port));
    }
    cfg
}
