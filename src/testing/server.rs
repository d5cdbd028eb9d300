//! Where the test databases live: a server named by the environment, a local one, or a
//! private cluster started from the distribution's binaries, once per test process.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use sqlx::Connection;

use super::TestError;

/// The variables read for a server URL, in order.
pub(crate) const URL_VARIABLES: [&str; 2] = ["PGBOX_TEST_DATABASE_URL", "DATABASE_URL"];

/// The conventional local server, with the `postgres` role and no password.
const LOCAL_URL: &str = "postgres://postgres@127.0.0.1:5432/postgres";

/// How long a connection attempt to a candidate server may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);

/// The server of this process's test databases: found (or started) once, then shared.
static SERVER: tokio::sync::OnceCell<Result<String, String>> = tokio::sync::OnceCell::const_new();

/// The URL of a server to create test databases on (its database is the one the kit
/// connects to for `CREATE DATABASE` and `DROP DATABASE`).
pub(crate) async fn server_url() -> Result<String, TestError> {
    SERVER
        .get_or_init(find)
        .await
        .clone()
        .map_err(|tried| TestError::NoServer { tried })
}

async fn find() -> Result<String, String> {
    let mut tried = String::new();
    for var in URL_VARIABLES {
        if let Ok(url) = std::env::var(var)
            && !url.trim().is_empty()
        {
            // Named by the user: used as it is, and a failure is reported, not worked around.
            return match reach(&url).await {
                Ok(()) => Ok(url),
                Err(e) => Err(format!("- {var} (set): cannot connect: {e}")),
            };
        }
        let _ = writeln!(tried, "- {var}: not set");
    }
    match reach(LOCAL_URL).await {
        Ok(()) => return Ok(LOCAL_URL.to_owned()),
        Err(e) => {
            let _ = writeln!(tried, "- {LOCAL_URL}: {e}");
        }
    }
    match tokio::task::spawn_blocking(start_private_cluster).await {
        Ok(Ok(url)) => match reach(&url).await {
            Ok(()) => {
                tracing::info!(%url, "pgbox test kit started a private PostgreSQL cluster");
                Ok(url)
            }
            Err(e) => Err(format!(
                "{tried}- a private cluster: started, but {url} does not answer: {e}"
            )),
        },
        Ok(Err(e)) => Err(format!("{tried}- a private cluster: {e}")),
        Err(e) => Err(format!("{tried}- a private cluster: {e}")),
    }
}

/// Connects once and closes, within [`CONNECT_TIMEOUT`].
async fn reach(url: &str) -> Result<(), String> {
    match tokio::time::timeout(CONNECT_TIMEOUT, sqlx::PgConnection::connect(url)).await {
        Ok(Ok(conn)) => {
            let _ = conn.close().await;
            Ok(())
        }
        Ok(Err(e)) => Err(e.to_string()),
        Err(_) => Err(format!("no answer within {CONNECT_TIMEOUT:?}")),
    }
}

/// The newest `/usr/lib/postgresql/<major>/bin` holding `initdb`, or `$PG_BIN`.
fn find_bindir() -> Result<PathBuf, String> {
    if let Some(dir) = std::env::var_os("PG_BIN") {
        let dir = PathBuf::from(dir);
        if !dir.join("initdb").exists() {
            return Err(format!("PG_BIN={}: no initdb there", dir.display()));
        }
        return Ok(dir);
    }
    let entries = std::fs::read_dir("/usr/lib/postgresql").map_err(|e| {
        format!(
            "no server binaries: /usr/lib/postgresql: {e} (install the `postgresql` package, \
             set PG_BIN to a directory holding initdb and pg_ctl, or set DATABASE_URL)"
        )
    })?;
    let newest = entries
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let major: u32 = e.file_name().to_str()?.parse().ok()?;
            let bin = e.path().join("bin");
            bin.join("initdb").exists().then_some((major, bin))
        })
        .max();
    newest.map(|(_, bin)| bin).ok_or_else(|| {
        "no initdb under /usr/lib/postgresql/*/bin (install the `postgresql` package, set \
         PG_BIN, or set DATABASE_URL)"
            .to_owned()
    })
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
}

/// `program`, run as the `postgres` user when we are root (initdb and postgres refuse root).
fn as_server_user(root: bool, program: &Path) -> Command {
    if root {
        let mut c = Command::new("runuser");
        c.args(["-u", "postgres", "--"]).arg(program);
        c
    } else {
        Command::new(program)
    }
}

fn run(cmd: &mut Command) -> Result<(), String> {
    let out = cmd.output().map_err(|e| format!("{cmd:?}: {e}"))?;
    if out.status.success() {
        return Ok(());
    }
    Err(format!(
        "{cmd:?} failed ({}): {}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout).trim(),
        String::from_utf8_lossy(&out.stderr).trim()
    ))
}

/// initdb and start a cluster in a new temporary directory on a free port, with durability
/// off (a test database is thrown away), and a watchdog that stops it and removes the
/// directory once this process has exited. Returns its URL.
fn start_private_cluster() -> Result<String, String> {
    let bindir = find_bindir()?;
    let root = is_root();
    let dir = std::env::temp_dir().join(format!(
        "pgbox-test-kit-{}-{}",
        std::process::id(),
        uuid::Uuid::now_v7().simple()
    ));
    std::fs::create_dir_all(&dir).map_err(|e| format!("create {dir:?}: {e}"))?;
    let started = start_in(&bindir, root, &dir);
    if started.is_err() {
        // Nothing of it runs: leave no directory behind.
        let _ = std::fs::remove_dir_all(&dir);
    }
    started
}

fn start_in(bindir: &Path, root: bool, dir: &Path) -> Result<String, String> {
    if root {
        run(Command::new("chown").arg("postgres:postgres").arg(dir))?;
    }
    let data = dir.join("data");
    run(as_server_user(root, &bindir.join("initdb"))
        .arg("-D")
        .arg(&data)
        .args([
            "-U",
            "postgres",
            "-A",
            "trust",
            "-E",
            "UTF8",
            "--no-locale",
            "-N",
        ]))?;
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map_err(|e| format!("find a free port: {e}"))?
        .port();
    let options = format!(
        "-c listen_addresses=127.0.0.1 -p {port} -k {} -c fsync=off -c synchronous_commit=off \
         -c full_page_writes=off -c max_connections=200",
        dir.display()
    );
    let pg_ctl = bindir.join("pg_ctl");
    run(as_server_user(root, &pg_ctl)
        .arg("-D")
        .arg(&data)
        .arg("-l")
        .arg(dir.join("server.log"))
        .args(["-w", "-t", "60", "-o", &options, "start"]))?;
    watch_over(root, &pg_ctl, dir);
    Ok(format!("postgres://postgres@127.0.0.1:{port}/postgres"))
}

/// A shell that waits for this process to end (it looks once a second), then stops the
/// cluster and removes its directory. Rust runs no code at exit, and a test process may end
/// by a panic or a signal; the watchdog sees all of them. Without it (it could not start) the
/// cluster stays until the machine's temporary files are cleaned.
fn watch_over(root: bool, pg_ctl: &Path, dir: &Path) {
    let stop = if root {
        "runuser -u postgres -- \"$2\" -D \"$3/data\" -m immediate stop"
    } else {
        "\"$2\" -D \"$3/data\" -m immediate stop"
    };
    let script = format!(
        "while kill -0 \"$1\" 2>/dev/null; do sleep 1; done; {stop} >/dev/null 2>&1; rm -rf \"$3\""
    );
    let started = Command::new("sh")
        .arg("-c")
        .arg(script)
        .arg("pgbox-test-kit-watchdog")
        .arg(std::process::id().to_string())
        .arg(pg_ctl)
        .arg(dir)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn();
    if let Err(e) = started {
        tracing::warn!(error = %e, dir = %dir.display(), "pgbox test kit: no watchdog; the private cluster will outlive this process");
    }
}
