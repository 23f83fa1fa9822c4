//! Starting a server process and waiting for its address: [`Launch`] spawns it and waits for its
//! `listening on http://ADDR` line on stdout; the [`Proc`] it gives keeps the log (stderr), sends
//! signals, and kills the process when dropped.

use std::ffi::OsStr;
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStderr, ChildStdout, Command, Stdio};
use std::sync::mpsc::Receiver;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::binaries::LEASEBROKER;

/// How long a server has to print its address, and a test to see an awaited log line.
const WITHIN: Duration = Duration::from_secs(60);

/// What a started server prints on stdout once it accepts connections.
const LISTENING: &str = "listening on http://";

/// The environment variable whose value every started process gets as `RUST_LOG` (default
/// `warn`), unless the test sets `RUST_LOG` itself.
pub const TEST_LOG: &str = "LEASEBROKER_TEST_LOG";

type Text = Arc<Mutex<String>>;

/// How a test starts a server: its program, arguments and environment. The one place that spawns
/// one and waits for its `listening on http://ADDR` line.
#[derive(Debug)]
pub struct Launch {
    command: Command,
    name: String,
    log_file: Option<PathBuf>,
}

impl Launch {
    /// `leasebroker ARGS`.
    pub fn new(args: &[&str]) -> Self {
        Self::of(LEASEBROKER, args)
    }

    /// `PROGRAM ARGS`: a [`Binary`](crate::Binary), an [example](crate::example) or any path.
    pub fn of(program: impl AsRef<OsStr>, args: &[&str]) -> Self {
        let program = program.as_ref();
        let name = Path::new(program).file_name().unwrap_or(program).to_string_lossy().into_owned();
        let mut command = Command::new(program);
        let log = std::env::var(TEST_LOG).unwrap_or_else(|_| "warn".into());
        command.args(args).env("RUST_LOG", log);
        Self { command, name, log_file: None }
    }

    /// Sets an environment variable.
    pub fn env(mut self, name: &str, value: &str) -> Self {
        self.command.env(name, value);
        self
    }

    /// Also writes its log to `file`, line by line, for a test that reads it from there.
    pub fn log_to(mut self, file: &Path) -> Self {
        self.log_file = Some(file.to_path_buf());
        self
    }

    /// Starts it and waits (up to a minute) for its address; its log when it exits or stays
    /// silent instead.
    pub fn try_start(mut self) -> Result<Proc, String> {
        let mut child = self
            .command
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {}: {e}", self.name));
        let log = Text::default();
        let file = self
            .log_file
            .as_deref()
            .map(|f| std::fs::File::create(f).unwrap_or_else(|e| panic!("cannot write the log {}: {e}", f.display())));
        let logger = keep_log(child.stderr.take().expect("stderr"), &self.name, log.clone(), file);
        let stdout = Text::default();
        let address = watch_stdout(child.stdout.take().expect("stdout"), stdout.clone());
        match address.recv_timeout(WITHIN) {
            Ok(url) => Ok(Proc { child, url, log, logger: Some(logger), stdout }),
            Err(_) => {
                let _ = child.kill();
                let _ = child.wait();
                let _ = logger.join();
                Err(log.lock().expect("log").clone())
            }
        }
    }

    /// [`Launch::try_start`], or the test fails with the process's log.
    pub fn start(self) -> Proc {
        let name = self.name.clone();
        self.try_start().unwrap_or_else(|log| panic!("{name} did not report its address; its log:\n{log}"))
    }
}

/// Keeps each line of `stderr` in `log` (and `file`), echoed into the test's output prefixed
/// with `[name]`.
fn keep_log(stderr: ChildStderr, name: &str, log: Text, mut file: Option<std::fs::File>) -> JoinHandle<()> {
    let prefix = format!("[{name}]");
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            eprintln!("{prefix} {line}");
            if let Some(f) = file.as_mut() {
                let _ = writeln!(f, "{line}");
            }
            let mut s = log.lock().expect("log");
            s.push_str(&line);
            s.push('\n');
        }
    })
}

/// Keeps what it prints on stdout in `printed`; the address of its `listening on` line arrives
/// on the receiver.
fn watch_stdout(stdout: ChildStdout, printed: Text) -> Receiver<String> {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            {
                let mut s = printed.lock().expect("stdout");
                s.push_str(&line);
                s.push('\n');
            }
            if let Some(i) = line.find(LISTENING) {
                let _ = tx.send(line[i + "listening on ".len()..].trim().to_owned());
            }
        }
    });
    rx
}

/// A running server (leasebroker, a simulator, an example): killed when dropped; its log
/// (stderr) kept and echoed, prefixed, into the test's output.
#[derive(Debug)]
pub struct Proc {
    /// The process.
    pub child: Child,
    /// Its address, `http://HOST:PORT`, as it printed it.
    pub url: String,
    log: Text,
    logger: Option<JoinHandle<()>>,
    stdout: Text,
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Proc {
    /// Starts `leasebroker ARGS` with `env` (`RUST_LOG` among it).
    pub fn start(args: &[&str], env: &[(&str, &str)]) -> Self {
        env.iter().fold(Launch::new(args), |l, (k, v)| l.env(k, v)).start()
    }

    /// Kills it with SIGKILL and reaps it; its log is whole after this.
    pub fn sigkill(&mut self) {
        self.child.kill().expect("kill");
        self.child.wait().expect("wait");
        self.log_complete();
    }

    /// Waits for the log's last line (the process has exited).
    fn log_complete(&mut self) {
        if let Some(logger) = self.logger.take() {
            let _ = logger.join();
        }
    }

    /// Sends SIGTERM (a graceful shutdown), without waiting.
    pub fn sigterm(&self) {
        self.signal(rustix::process::Signal::TERM);
    }

    /// Stops it (SIGSTOP), as a frozen VM or a long pause would: it keeps its connections and
    /// answers nothing until [`Proc::sigcont`].
    pub fn sigstop(&self) {
        self.signal(rustix::process::Signal::STOP);
    }

    /// Resumes it after [`Proc::sigstop`].
    pub fn sigcont(&self) {
        self.signal(rustix::process::Signal::CONT);
    }

    fn signal(&self, signal: rustix::process::Signal) {
        let pid = rustix::process::Pid::from_raw(i32::try_from(self.child.id()).expect("a pid")).expect("a pid");
        rustix::process::kill_process(pid, signal).unwrap_or_else(|e| panic!("{signal:?}: {e}"));
    }

    /// Sends SIGTERM and waits (up to two minutes) for the exit code.
    pub fn sigterm_and_wait(&mut self) -> Option<i32> {
        self.sigterm();
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            if let Some(status) = self.child.try_wait().expect("try_wait") {
                self.log_complete();
                return status.code();
            }
            assert!(Instant::now() < deadline, "the server did not exit after SIGTERM");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// What it printed on stdout up to now (its address, a generated token).
    pub fn stdout(&self) -> String {
        self.stdout.lock().expect("stdout").clone()
    }

    /// The log so far.
    pub fn log(&self) -> String {
        self.log.lock().expect("log").clone()
    }

    /// Waits (up to a minute) for a log line holding every one of `parts`; returns it.
    pub fn wait_for_line(&self, parts: &[&str]) -> String {
        let deadline = Instant::now() + WITHIN;
        loop {
            let log = self.log();
            if let Some(line) = log.lines().find(|l| parts.iter().all(|p| l.contains(p))) {
                return line.to_owned();
            }
            assert!(Instant::now() < deadline, "no log line with {parts:?} in:\n{log}");
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A stand-in server: prints its log line and its address, then waits to be killed.
    fn stand_in(address: &str) -> Launch {
        let script = format!("echo 'starting' >&2; echo 'listening on {address}'; echo 'ready' >&2; exec sleep 600");
        Launch::of("sh", &["-c", &script])
    }

    #[test]
    fn a_started_process_gives_its_address_and_its_log_and_is_killed_on_drop() {
        let dir = tempfile::tempdir().expect("tempdir");
        let file = dir.path().join("server.log");
        let proc = stand_in("http://127.0.0.1:7").log_to(&file).start();
        assert_eq!(proc.url, "http://127.0.0.1:7");
        assert!(proc.stdout().contains("listening on http://127.0.0.1:7"), "{}", proc.stdout());
        assert_eq!(proc.wait_for_line(&["rea", "dy"]), "ready");
        assert_eq!(std::fs::read_to_string(&file).expect("the log file"), "starting\nready\n");
        let pid = rustix::process::Pid::from_raw(i32::try_from(proc.child.id()).expect("pid")).expect("pid");
        drop(proc);
        // Reaped: no process has the pid any more (or another one got it, which is not ours).
        assert!(rustix::process::test_kill_process(pid).is_err(), "still running after the drop");
    }

    #[test]
    fn a_process_that_exits_before_its_address_gives_its_log() {
        let log = Launch::of("sh", &["-c", "echo 'cannot bind' >&2; exit 3"]).try_start().expect_err("no address");
        assert_eq!(log, "cannot bind\n");
    }

    #[test]
    fn signals_stop_resume_and_end_it() {
        let mut proc = stand_in("http://127.0.0.1:8").start();
        proc.sigstop();
        proc.sigcont();
        assert!(proc.child.try_wait().expect("try_wait").is_none(), "SIGSTOP and SIGCONT do not end it");
        // `sleep` ends on SIGTERM by the signal: no exit code.
        assert_eq!(proc.sigterm_and_wait(), None);
        let mut proc = stand_in("http://127.0.0.1:9").start();
        proc.sigkill();
        assert!(proc.child.try_wait().expect("try_wait").is_some());
    }
}
