//! The `pgbox` command as a script sees it: `--json` covers every failure, argument errors
//! included; `doctor --json` always prints a report on stdout; inconsistent thresholds are
//! refused; refusals speak in the units the flags take.

mod support;

use std::process::{Command, Output};

use support::TestDb;

fn pgbox(url: Option<&str>, args: &[&str]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_pgbox"));
    cmd.args(args)
        .env_remove("DATABASE_URL")
        .env("NO_COLOR", "1");
    if let Some(url) = url {
        cmd.env("DATABASE_URL", url);
    }
    cmd.output().expect("run pgbox")
}

fn stderr_json(o: &Output) -> serde_json::Value {
    serde_json::from_slice(&o.stderr).unwrap_or_else(|e| {
        panic!(
            "stderr is not JSON ({e}): {}",
            String::from_utf8_lossy(&o.stderr)
        )
    })
}

#[test]
fn argument_errors_are_json_with_json() {
    for args in [
        &["--json", "frobnicate"][..],
        &["--json", "status", "--no-such-flag"][..],
        &["--json"][..],
        &["purge", "--older-than", "7 parsecs", "--json"][..],
    ] {
        let out = pgbox(None, args);
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        let err = stderr_json(&out);
        assert_eq!(err["exit_code"], 2, "{args:?}: {err}");
        assert!(
            err["error"].as_str().is_some_and(|e| !e.is_empty()),
            "{err}"
        );
    }
    // Without --json, clap's own text; --help still prints help.
    let out = pgbox(None, &["frobnicate"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("unrecognized subcommand"));
    let out = pgbox(None, &["--json", "--help"]);
    assert_eq!(out.status.code(), Some(0));
    assert!(String::from_utf8_lossy(&out.stdout).contains("Usage"));
}

#[tokio::test]
async fn doctor_json_on_an_unmigrated_schema_prints_a_report() {
    let db = TestDb::empty().await;
    let out = pgbox(Some(&db.url()), &["--json", "doctor"]);
    assert_eq!(out.status.code(), Some(4));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "no JSON report on stdout ({e}): {:?}",
            String::from_utf8_lossy(&out.stdout)
        )
    });
    assert_eq!(report["migrated"], false);
    assert_eq!(report["exit_code"], 4);
    assert_eq!(report["findings"][0]["code"], "not_migrated");
}

#[test]
fn a_warning_threshold_above_the_critical_one_is_refused() {
    let out = pgbox(
        None,
        &[
            "doctor",
            "--xmin-age-warn",
            "2h",
            "--xmin-age-critical",
            "1h",
        ],
    );
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--xmin-age-warn (2h)"), "{err}");
    assert!(err.contains("--xmin-age-critical (1h)"), "{err}");
}

#[test]
fn the_purge_refusal_speaks_in_the_flags_units() {
    let out = pgbox(None, &["purge", "--older-than", "1h"]);
    assert_eq!(out.status.code(), Some(6));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("younger than 1d"), "{err}");
    assert!(!err.contains("86400"), "{err}");
}
