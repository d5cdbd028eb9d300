//! A private PgBouncer in transaction mode, in front of a private [`Cluster`], on a port of
//! its own: the pooler production puts between services and PostgreSQL. Debian's package
//! (1.18 on Debian 12) is installed with apt when it is missing and we are root; without it
//! the test fails with the reason (never skipped). Stopped on drop.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use super::cluster::Cluster;
use super::local_pg;

/// Where Debian installs it.
const PGBOUNCER: &str = "/usr/sbin/pgbouncer";

/// A running PgBouncer, started by [`PgBouncer::start`].
pub struct PgBouncer {
    dir: PathBuf,
    port: u16,
    child: Option<Child>,
}

impl PgBouncer {
    /// PgBouncer with `pool_mode = transaction` and `pool_size` server connections per
    /// database and user, in front of `cluster`.
    pub fn start(cluster: &Cluster, pool_size: u32) -> PgBouncer {
        ensure_installed();
        let dir =
            std::env::temp_dir().join(format!("pgbox-pgbouncer-{}", uuid::Uuid::now_v7().simple()));
        std::fs::create_dir_all(&dir).unwrap();
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let ini = format!(
            "[databases]\n\
             * = host=127.0.0.1 port={server_port}\n\
             [pgbouncer]\n\
             listen_addr = 127.0.0.1\n\
             listen_port = {port}\n\
             unix_socket_dir =\n\
             auth_type = trust\n\
             auth_file = {dir}/users.txt\n\
             pool_mode = transaction\n\
             default_pool_size = {pool_size}\n\
             max_client_conn = 500\n\
             ignore_startup_parameters = extra_float_digits\n\
             logfile = {dir}/pgbouncer.log\n\
             pidfile = {dir}/pgbouncer.pid\n\
             admin_users = postgres\n",
            server_port = cluster.port(),
            dir = dir.display(),
        );
        std::fs::write(dir.join("pgbouncer.ini"), ini).unwrap();
        std::fs::write(dir.join("users.txt"), "\"postgres\" \"\"\n").unwrap();
        if local_pg::is_root() {
            local_pg::run(
                Command::new("chown")
                    .arg("-R")
                    .arg("postgres:postgres")
                    .arg(&dir),
            )
            .unwrap();
        }
        let mut bouncer = PgBouncer {
            dir,
            port,
            child: None,
        };
        bouncer.spawn();
        bouncer
    }

    fn spawn(&mut self) {
        let mut command = Command::new(PGBOUNCER);
        if local_pg::is_root() {
            // PgBouncer refuses to run as root; `-u` makes it switch user itself, so the
            // child is PgBouncer (killable), not a wrapper.
            command.args(["-u", "postgres"]);
        }
        let child = command
            .arg(self.dir.join("pgbouncer.ini"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("start {PGBOUNCER}: {e}"));
        self.child = Some(child);
        for _ in 0..100 {
            if std::net::TcpStream::connect(("127.0.0.1", self.port)).is_ok() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!("PgBouncer did not listen on {}:\n{}", self.port, self.log());
    }

    /// A URL of `database` through the pooler.
    pub fn url(&self, database: &str) -> String {
        format!("postgres://postgres@127.0.0.1:{}/{database}", self.port)
    }

    /// The pooler's port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Kills the pooler with SIGKILL (every client and server connection through it is cut)
    /// and starts it again on the same port.
    pub fn kill_and_restart(&mut self) {
        self.kill();
        self.spawn();
    }

    fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// PgBouncer's log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("pgbouncer.log")).unwrap_or_default()
    }
}

impl Drop for PgBouncer {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Installs Debian's `pgbouncer` when it is missing (as root, once per machine, one apt at a
/// time across test binaries).
fn ensure_installed() {
    if std::path::Path::new(PGBOUNCER).exists() {
        return;
    }
    assert!(
        local_pg::is_root(),
        "{PGBOUNCER} is missing and only root can install it: apt-get install pgbouncer"
    );
    let lock_path = std::env::temp_dir().join("pgbox-apt.lock");
    let lock = std::fs::File::create(&lock_path).unwrap();
    lock.lock().unwrap();
    if std::path::Path::new(PGBOUNCER).exists() {
        return;
    }
    eprintln!("pgbox tests: installing Debian's pgbouncer with apt-get");
    let install = |update: bool| {
        if update {
            let _ = local_pg::run(Command::new("apt-get").args(["update", "-q"]));
        }
        local_pg::run(
            Command::new("apt-get")
                .env("DEBIAN_FRONTEND", "noninteractive")
                .args([
                    "install",
                    "-y",
                    "-q",
                    "--no-install-recommends",
                    "pgbouncer",
                ]),
        )
    };
    install(false)
        .or_else(|_| install(true))
        .unwrap_or_else(|e| panic!("apt-get install pgbouncer: {e}"));
    // Debian's package enables a service on 6432; the tests start their own.
    let _ = Command::new("service").args(["pgbouncer", "stop"]).output();
}
