//! Operations through real `lbctl` processes, some killed with SIGKILL and run again.

use std::process::Stdio;
use std::time::Duration;

use rand::Rng;
use tokio::io::AsyncReadExt;
use tokio::process::Command;
use tokio::time::Instant;

use super::*;

impl Workload {
    /// Runs the operation through real lbctl processes, killing some with SIGKILL after a random
    /// delay and running them again (with the same `--op-id` when protected) until one exits with a
    /// final code.
    pub(super) async fn via_lbctl(&self, op: &Op, index: u64) -> Outcome {
        let deadline = Instant::now() + self.config.op_max_elapsed;
        let op_id = format!("{}-op-{index}", self.config.run_tag);
        let mut kills = 0;
        for _ in 0..LBCTL_MAX_RUNS {
            let remaining = deadline.saturating_duration_since(Instant::now()).max(Duration::from_secs(1));
            let mut command = Command::new(&self.config.lbctl);
            let base = &self.config.endpoints[rand::rng().random_range(0..self.config.endpoints.len())];
            command.args(["--url", base, "--journal"]).arg(&self.config.journal);
            command.args(["--max-elapsed", &format!("{}ms", remaining.as_millis()), "-v"]);
            let token = match op {
                Op::Create { principal, index } => {
                    command.args(["workers", "create", "--image", "worker-base:2025.11", "--cpu", "2"]);
                    command.args(["--memory-gb", "4", "--label", &format!("faultline-op={index}")]);
                    &self.config.principals[*principal].token
                }
                Op::Reboot { principal, id } => {
                    command.args(["workers", "reboot", id.as_str()]);
                    &self.config.principals[*principal].token
                }
                Op::Delete { principal, id } => {
                    command.args(["workers", "delete", id.as_str()]);
                    &self.config.principals[*principal].token
                }
                Op::Flash { node, version } => {
                    // Forced, like the SDK's flashes (see `sdk::body`).
                    command.args(["firmware", "flash", node, "--version", version, "--force"]);
                    crate::cluster::ADMIN_TOKEN
                }
            };
            if self.config.kind == ClientKind::Protected {
                command.args(["--op-id", &op_id]);
            }
            command.env("LBCTL_TOKEN", token);
            command.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped()).kill_on_drop(true);
            let mut child = match command.spawn() {
                Ok(child) => child,
                Err(e) => return Outcome::Failed(format!("cannot start lbctl: {e}")),
            };
            add(&self.counters.lbctl_runs, 1);
            let stdout = drain(child.stdout.take());
            let stderr = drain(child.stderr.take());
            let kill_after = (kills < LBCTL_MAX_KILLS && rand::rng().random::<f64>() < self.config.kill_rate)
                .then(|| Duration::from_millis(rand::rng().random_range(LBCTL_KILL_WINDOW_MS)));
            let limit = remaining + Duration::from_secs(30);
            let status = tokio::select! {
                status = child.wait() => status,
                () = tokio::time::sleep(kill_after.unwrap_or(limit)) => match child.try_wait() {
                    Ok(Some(status)) => Ok(status),
                    _ => {
                        let _ = child.start_kill();
                        let _ = child.wait().await;
                        let err = stderr.await.unwrap_or_default();
                        add(&self.counters.attempts, count_attempts(&err));
                        if kill_after.is_none() {
                            return Outcome::Failed(format!("lbctl still running after {limit:?}"));
                        }
                        kills += 1;
                        add(&self.counters.lbctl_kills, 1);
                        continue;
                    }
                },
            };
            let out = stdout.await.unwrap_or_default();
            let err = stderr.await.unwrap_or_default();
            add(&self.counters.attempts, count_attempts(&err));
            let err_line = String::from_utf8_lossy(&err).lines().last().unwrap_or_default().to_owned();
            return match status.ok().and_then(|s| s.code()) {
                Some(0) => {
                    let err = String::from_utf8_lossy(&err);
                    if err.contains("(replayed)") {
                        add(&self.counters.replayed, 1);
                    }
                    match key_of(&err) {
                        Some(key) => self.acknowledged(op, key),
                        None => return Outcome::Failed("lbctl -v printed no key".into()),
                    }
                    decode(op, &out)
                }
                Some(3) => Outcome::Refused(format!("lbctl exit 3: {err_line}")),
                Some(code) => Outcome::Failed(format!("lbctl exit {code}: {err_line}")),
                None => Outcome::Failed(format!("lbctl ended by a signal it was not sent: {err_line}")),
            };
        }
        Outcome::Failed(format!("lbctl ran {LBCTL_MAX_RUNS} times without a final exit code"))
    }
}

pub(super) fn drain<R: tokio::io::AsyncRead + Unpin + Send + 'static>(
    pipe: Option<R>,
) -> tokio::task::JoinHandle<Vec<u8>> {
    tokio::spawn(async move {
        let mut buf = Vec::new();
        if let Some(mut pipe) = pipe {
            let _ = pipe.read_to_end(&mut buf).await;
        }
        buf
    })
}

/// The key lbctl `-v` names (`lbctl: key K (...)`, or `lbctl: op "ID" key K (journal ...)`).
pub(super) fn key_of(stderr: &str) -> Option<&str> {
    stderr
        .lines()
        .filter_map(|l| l.strip_prefix("lbctl: "))
        .filter(|l| l.starts_with("key ") || l.starts_with("op "))
        .find_map(|l| l.split_once("key ")?.1.split_whitespace().next())
}

/// lbctl `-v` prints one `lbctl: attempt N (...)` line per attempt.
pub(super) fn count_attempts(stderr: &[u8]) -> u64 {
    String::from_utf8_lossy(stderr).lines().filter(|l| l.starts_with("lbctl: attempt ")).count() as u64
}
