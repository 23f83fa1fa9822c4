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
    pub(super) async fn via_lbctl(&self, op: &Op, index: u64, log: &mut OpLog) -> Outcome {
        let deadline = Instant::now() + self.config.op_max_elapsed;
        if self.config.kind == ClientKind::Protected {
            log.op_id = Some(format!("{}-op-{index}", self.config.run_tag));
        }
        let mut kills = 0;
        for _ in 0..LBCTL_MAX_RUNS {
            let remaining = deadline.saturating_duration_since(Instant::now()).max(Duration::from_secs(1));
            let replica = self.pick();
            let mut command = self.lbctl_command(op, replica, remaining, log.op_id.as_deref());
            let started = self.timeline.now();
            let mut child = match command.spawn() {
                Ok(child) => child,
                Err(e) => return Outcome::Failed(format!("cannot start lbctl: {e}")),
            };
            add(&self.counters.lbctl_runs, 1);
            let stdout = drain(child.stdout.take());
            let (keyed, named_key) = tokio::sync::oneshot::channel();
            let stderr = drain_watching_for_key(child.stderr.take(), keyed);
            let kill_after =
                (kills < LBCTL_MAX_KILLS && rand::rng().random::<f64>() < self.config.kill_rate).then(KillAt::plan);
            let limit = remaining + Duration::from_secs(30);
            let kill_time = async {
                match kill_after {
                    None => tokio::time::sleep(limit).await,
                    Some(KillAt::FromStart(after)) => tokio::time::sleep(after).await,
                    Some(KillAt::FromKey(after)) => match named_key.await {
                        Ok(()) => tokio::time::sleep(after).await,
                        // lbctl ended without naming a key: it exits on its own.
                        Err(_) => std::future::pending().await,
                    },
                }
            };
            let status = tokio::select! {
                status = child.wait() => status,
                () = kill_time => match child.try_wait() {
                    Ok(Some(status)) => Ok(status),
                    _ => {
                        let _ = child.start_kill();
                        let _ = child.wait().await;
                        let err = stderr.await.unwrap_or_default();
                        add(&self.counters.attempts, count_attempts(&err));
                        let ended =
                            if kill_after.is_none() { "still running: killed" } else { "killed (a planned fault)" };
                        note_run(log, started, replica, &err, Some(ended));
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
            note_run(log, started, replica, &err, None);
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

    /// An lbctl process for `op` on `replica`'s proxy with this retry budget, `-v` (each attempt
    /// on stderr) and, when given, `--op-id`; its output piped, killed when dropped.
    pub(super) fn lbctl_command(&self, op: &Op, replica: usize, budget: Duration, op_id: Option<&str>) -> Command {
        let mut command = Command::new(&self.config.lbctl);
        command.args(["--url", &self.config.endpoints[replica], "--journal"]).arg(&self.config.journal);
        command.args(["--max-elapsed", &format!("{}ms", budget.as_millis()), "-v"]);
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
        if let Some(op_id) = op_id {
            command.args(["--op-id", op_id]);
        }
        command.env("LBCTL_TOKEN", token);
        command.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped()).kill_on_drop(true);
        command
    }
}

/// Notes one lbctl process run in `log`: its attempts, the key it named, how faultline ended it.
fn note_run(log: &mut OpLog, started: Duration, replica: usize, stderr: &[u8], ended: Option<&str>) {
    let stderr = String::from_utf8_lossy(stderr);
    log.lbctl_run(started, replica, &stderr, ended);
    if log.key.is_none() {
        log.key = key_of(&stderr).map(str::to_owned);
    }
}

/// When a planned SIGKILL lands.
#[derive(Debug, Clone, Copy)]
enum KillAt {
    /// This long after the process started.
    FromStart(Duration),
    /// This long after lbctl named the operation's key.
    FromKey(Duration),
}

impl KillAt {
    fn plan() -> Self {
        let mut rng = rand::rng();
        if rng.random::<f64>() < LBCTL_EARLY_KILL_SHARE {
            Self::FromStart(Duration::from_millis(rng.random_range(LBCTL_KILL_WINDOW_MS)))
        } else {
            Self::FromKey(Duration::from_millis(rng.random_range(LBCTL_KEYED_KILL_WINDOW_MS)))
        }
    }
}

/// Reads lbctl's stderr to the end, like [`drain`], and says on `keyed` when the line naming the
/// operation's key (see [`key_of`]) has come.
fn drain_watching_for_key<R: tokio::io::AsyncRead + Unpin + Send + 'static>(
    pipe: Option<R>,
    keyed: tokio::sync::oneshot::Sender<()>,
) -> tokio::task::JoinHandle<Vec<u8>> {
    use tokio::io::AsyncBufReadExt;
    tokio::spawn(async move {
        let mut buf = Vec::new();
        let mut keyed = Some(keyed);
        if let Some(pipe) = pipe {
            let mut pipe = tokio::io::BufReader::new(pipe);
            loop {
                let start = buf.len();
                match pipe.read_until(b'\n', &mut buf).await {
                    Ok(0) | Err(_) => break,
                    Ok(_) => {
                        if keyed.is_some() && key_of(&String::from_utf8_lossy(&buf[start..])).is_some() {
                            let _ = keyed.take().map(|k| k.send(()));
                        }
                    }
                }
            }
        }
        buf
    })
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

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn the_key_line_is_signalled_and_every_byte_kept() {
        let stderr: &[u8] = b"lbctl: op \"run-op-1\" key 0193a3c2-7b7e-7000-8000-000000000001 (journal j.db)\nlbctl: attempt 1 (0.02s): 201\n";
        let (keyed, named) = tokio::sync::oneshot::channel();
        let all = drain_watching_for_key(Some(stderr), keyed).await.expect("drain");
        assert_eq!(all, stderr);
        named.await.expect("the key line was signalled");
    }

    #[tokio::test]
    async fn no_key_line_no_signal() {
        let stderr: &[u8] = b"lbctl: cannot open the journal: permission denied\n";
        let (keyed, named) = tokio::sync::oneshot::channel();
        drain_watching_for_key(Some(stderr), keyed).await.expect("drain");
        assert!(named.await.is_err(), "a line without a key was taken for the key line");
    }
}
