//! A private PostgreSQL cluster for tests that crash or restart the server: a temporary
//! directory and a free port of its own, never the shared server the other tests use.
//! Stopped and removed on drop.
//!
//! [`Cluster::standby_of`] makes a streaming standby of a running cluster (`pg_basebackup -R`),
//! synchronous (`synchronous_standby_names` names it, `synchronous_commit = remote_apply`) or
//! not; [`Cluster::promote`] makes it a primary, [`Cluster::stop_immediate`] kills a server
//! the way a crash would.

use std::path::PathBuf;
use std::process::Command;

use super::local_pg;

/// A throwaway cluster, started by [`Cluster::start`].
pub struct Cluster {
    dir: PathBuf,
    bindir: PathBuf,
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

impl Cluster {
    /// initdb and start, on a free port, with durable commits (`fsync` off only matters to an
    /// operating-system crash, not to a server crash).
    pub fn start() -> Cluster {
        let bindir = local_pg::find_bindir()
            .expect("PostgreSQL's binaries (initdb, pg_ctl) under /usr/lib/postgresql or PG_BIN");
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
            port,
            root,
        };
        cluster.pg_ctl(&["start"]);
        cluster
    }

    /// [`start`](Self::start), then `wal_level = logical` (for logical decoding: the WAL
    /// outbox's slot) and a restart.
    pub fn start_logical() -> Cluster {
        let cluster = Cluster::start();
        cluster.psql("ALTER SYSTEM SET wal_level = logical");
        cluster.pg_ctl(&["-m", "fast", "restart"]);
        cluster
    }

    /// A streaming standby of `primary` (which must be running), started and streaming when
    /// this returns. With `sync`, the primary then waits for this standby to apply each commit
    /// before it answers it (`synchronous_standby_names` = this standby,
    /// `synchronous_commit = remote_apply`, set on the primary with `ALTER SYSTEM`, so the
    /// standby's own copy of the settings, taken before, has neither: once promoted, it does
    /// not wait for a standby it does not have).
    pub fn standby_of(primary: &Cluster, sync: bool) -> Cluster {
        Self::standby_via(primary, sync, primary.port)
    }

    /// Like [`standby_of`](Self::standby_of), streaming through `upstream_port` on 127.0.0.1
    /// (a proxy to the primary, which a test can cut to make the standby fall behind).
    pub fn standby_via(primary: &Cluster, sync: bool, upstream_port: u16) -> Cluster {
        let root = primary.root;
        let dir = new_dir(root);
        local_pg::run(
            local_pg::pg_command(root, &primary.bindir.join("pg_basebackup"))
                .arg("-D")
                .arg(dir.join("data"))
                .args(["-h", "127.0.0.1", "-p", &primary.port.to_string()])
                .args(["-U", "postgres", "-R", "-X", "stream", "-c", "fast"]),
        )
        .unwrap_or_else(|e| panic!("pg_basebackup: {e}"));
        let port = free_port();
        let name = format!("standby_{port}");
        // `-R` wrote a primary_conninfo; this later line wins, and names the standby.
        let conninfo = format!(
            "\nprimary_conninfo = 'host=127.0.0.1 port={upstream_port} user=postgres application_name={name}'\n"
        );
        let auto_conf = dir.join("data").join("postgresql.auto.conf");
        let mut text = std::fs::read_to_string(&auto_conf).unwrap();
        text.push_str(&conninfo);
        std::fs::write(&auto_conf, text).unwrap();
        let standby = Cluster {
            dir,
            bindir: primary.bindir.clone(),
            port,
            root,
        };
        standby.pg_ctl(&["start"]);
        let streaming = format!(
            "SELECT count(*) FROM pg_stat_replication \
             WHERE application_name = '{name}' AND state = 'streaming'"
        );
        primary.wait_for(&streaming, "1");
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
        let out = local_pg::pg_command(self.root, &self.bindir.join("psql"))
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
