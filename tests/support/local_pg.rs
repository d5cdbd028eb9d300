//! Finds a PostgreSQL server for the tests and examples, starting one if there is none.
//!
//! Order: `DATABASE_URL` when set; else a server on 127.0.0.1:5432 that accepts user
//! `postgres` without a password; else a throwaway cluster built from the distribution's
//! binaries (installing the `postgresql` package with apt when they are missing and we are
//! root). The throwaway cluster lives in `$PGBOX_LOCAL_PG_DIR` (default
//! `/tmp/pgbox-local-pg`) on port `$PGBOX_LOCAL_PG_PORT` (default 55432), runs with
//! durability off, and is left running for the next command to reuse. Stop it with
//! `runuser -u postgres -- <bindir>/pg_ctl -D /tmp/pgbox-local-pg/data stop` (or without
//! `runuser` when not root).
//!
//! The tests' version matrix (`PGBOX_TEST_PG_MAJOR`, `tests/support/mod.rs`) starts its own
//! throwaway cluster of another major with [`throwaway_url`].
//!
//! Shared by the test binaries (`tests/support/mod.rs`) and the examples (`#[path]`).

use std::fs::{self, File};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use sqlx::Connection;

const LOCAL_URL: &str = "postgres://postgres@127.0.0.1:5432/postgres";

/// A URL of a reachable server, as described in the module docs.
pub async fn database_url() -> Result<String, String> {
    if let Ok(url) = std::env::var("DATABASE_URL")
        && !url.is_empty()
    {
        return Ok(url);
    }
    if reachable(LOCAL_URL).await {
        return Ok(LOCAL_URL.to_owned());
    }
    let dir = PathBuf::from(
        std::env::var("PGBOX_LOCAL_PG_DIR").unwrap_or_else(|_| "/tmp/pgbox-local-pg".into()),
    );
    let port: u16 = std::env::var("PGBOX_LOCAL_PG_PORT")
        .ok()
        .and_then(|p| p.parse().ok())
        .unwrap_or(55432);
    throwaway_url(dir, port, None).await
}

/// The URL of the throwaway cluster in `dir` on `port`, started (under a lock, with the
/// binaries in `bindir`, else the distribution's) unless it already answers, and left
/// running for the next caller.
pub async fn throwaway_url(
    dir: PathBuf,
    port: u16,
    bindir: Option<PathBuf>,
) -> Result<String, String> {
    let url = format!("postgres://postgres@127.0.0.1:{port}/postgres");
    if reachable(&url).await {
        return Ok(url);
    }
    // Several test binaries (or nextest processes) may get here at once: one starts the
    // cluster, the others wait on the lock and then find it running.
    let lock_path = dir.with_extension("lock");
    let lock = File::create(&lock_path).map_err(|e| format!("create {lock_path:?}: {e}"))?;
    lock.lock()
        .map_err(|e| format!("lock {lock_path:?}: {e}"))?;
    if reachable(&url).await {
        return Ok(url);
    }
    eprintln!(
        "pgbox: no PostgreSQL reachable; starting a throwaway cluster in {dir:?} on port {port}"
    );
    let started = tokio::task::spawn_blocking(move || start_cluster(&dir, port, bindir))
        .await
        .map_err(|e| e.to_string())?;
    started?;
    for _ in 0..50 {
        if reachable(&url).await {
            return Ok(url);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Err(format!("started a cluster, but {url} does not answer"))
}

async fn reachable(url: &str) -> bool {
    match tokio::time::timeout(Duration::from_secs(3), sqlx::PgConnection::connect(url)).await {
        Ok(Ok(conn)) => {
            let _ = conn.close().await;
            true
        }
        _ => false,
    }
}

pub fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
        .unwrap_or(false)
}

pub fn find_bindir() -> Option<PathBuf> {
    if let Ok(dir) = std::env::var("PG_BIN") {
        return Some(PathBuf::from(dir));
    }
    let mut dirs: Vec<(u32, PathBuf)> = fs::read_dir("/usr/lib/postgresql")
        .ok()?
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let version = e.file_name().to_str()?.parse().ok()?;
            let bin = e.path().join("bin");
            bin.join("initdb").exists().then_some((version, bin))
        })
        .collect();
    dirs.sort();
    dirs.pop().map(|(_, bin)| bin)
}

pub fn run(cmd: &mut Command) -> Result<(), String> {
    let out = cmd.output().map_err(|e| format!("{cmd:?}: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "{cmd:?} failed ({}):\n{}{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ))
    }
}

/// `initdb` and `postgres` refuse to run as root: run them as the `postgres` user then.
pub fn pg_command(root: bool, program: &Path) -> Command {
    if root {
        let mut c = Command::new("runuser");
        c.args(["-u", "postgres", "--"]).arg(program);
        c
    } else {
        Command::new(program)
    }
}

fn start_cluster(dir: &Path, port: u16, bindir: Option<PathBuf>) -> Result<(), String> {
    let root = is_root();
    let bindir = match bindir.or_else(find_bindir) {
        Some(b) => b,
        None if root => {
            eprintln!("pgbox: installing the postgresql package with apt-get");
            run(Command::new("apt-get")
                .arg("update")
                .env("DEBIAN_FRONTEND", "noninteractive"))?;
            run(Command::new("apt-get")
                .args(["install", "-y", "--no-install-recommends", "postgresql"])
                .env("DEBIAN_FRONTEND", "noninteractive"))?;
            find_bindir().ok_or("postgresql installed, but no initdb under /usr/lib/postgresql")?
        }
        None => {
            return Err(
                "no PostgreSQL found: set DATABASE_URL, or install the `postgresql` \
                        package (e.g. `sudo apt-get install postgresql`)"
                    .into(),
            );
        }
    };
    fs::create_dir_all(dir).map_err(|e| format!("create {dir:?}: {e}"))?;
    if root {
        run(Command::new("chown")
            .arg("-R")
            .arg("postgres:postgres")
            .arg(dir))?;
    }
    let data = dir.join("data");
    if !data.join("PG_VERSION").exists() {
        let _ = fs::remove_dir_all(&data);
        run(pg_command(root, &bindir.join("initdb"))
            .arg("-D")
            .arg(&data)
            .args([
                "-U",
                "postgres",
                "-A",
                "trust",
                "-N",
                "-E",
                "UTF8",
                "--locale=C.UTF-8",
            ]))?;
    }
    let options = format!(
        "-c listen_addresses=127.0.0.1 -p {port} -k {} -c fsync=off -c synchronous_commit=off \
         -c full_page_writes=off -c max_connections=300",
        dir.display()
    );
    run(pg_command(root, &bindir.join("pg_ctl"))
        .arg("-D")
        .arg(&data)
        .arg("-l")
        .arg(dir.join("server.log"))
        .args(["-w", "-t", "60", "-o", &options, "start"]))
    .map_err(|e| {
        // A server of this directory that runs but does not answer on the port: started in
        // another network namespace or container, or listening elsewhere.
        if data.join("postmaster.pid").exists() {
            let stop = if root {
                format!("runuser -u postgres -- {}", bindir.join("pg_ctl").display())
            } else {
                bindir.join("pg_ctl").display().to_string()
            };
            format!(
                "{e}\na server of {dir:?} is running but 127.0.0.1:{port} does not answer from \
                 here (was it started in another network namespace or container?); stop it with \
                 `{stop} -D {} stop`, or set DATABASE_URL",
                data.display()
            )
        } else {
            e
        }
    })
}
