//! A private PostgreSQL cluster for tests that crash or restart the server: a temporary
//! directory and a free port of its own, never the shared server the other tests use.
//! Stopped and removed on drop.

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

impl Cluster {
    /// initdb and start, on a free port, with durable commits (`fsync` off only matters to an
    /// operating-system crash, not to a server crash).
    pub fn start() -> Cluster {
        let bindir = local_pg::find_bindir()
            .expect("PostgreSQL's binaries (initdb, pg_ctl) under /usr/lib/postgresql or PG_BIN");
        let root = local_pg::is_root();
        let dir =
            std::env::temp_dir().join(format!("pgbox-cluster-{}", uuid::Uuid::now_v7().simple()));
        std::fs::create_dir_all(&dir).unwrap();
        if root {
            local_pg::run(Command::new("chown").arg("postgres:postgres").arg(&dir)).unwrap();
        }
        local_pg::run(
            local_pg::pg_command(root, &bindir.join("initdb"))
                .arg("-D")
                .arg(dir.join("data"))
                .args(["-U", "postgres", "-A", "trust", "-E", "UTF8"])
                .arg("--locale=C.UTF-8"),
        )
        .unwrap();
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let cluster = Cluster {
            dir,
            bindir,
            port,
            root,
        };
        cluster.pg_ctl(&["start"]);
        cluster
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
