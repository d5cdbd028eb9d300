//! The `pgbox` command as a script or a newcomer sees it: `--json` covers every failure,
//! argument errors included, with the whole message; `doctor` always prints a report on
//! stdout, an unmigrated schema included; inconsistent thresholds are refused; refusals speak
//! in words ("1 day"), not seconds; `migrate` through a pipe is plain text, each migration
//! once.

mod support;

use std::process::{Command, Output};

use support::TestDb;

fn pgbox(url: Option<&str>, args: &[&str]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_pgbox"));
    cmd.args(args).env_remove("DATABASE_URL");
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

fn stdout_json(o: &Output) -> serde_json::Value {
    serde_json::from_slice(&o.stdout).unwrap_or_else(|e| {
        panic!(
            "no JSON on stdout ({e}): {:?} / stderr {:?}",
            String::from_utf8_lossy(&o.stdout),
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
        &["--json=yes", "status"][..],
    ] {
        let out = pgbox(None, args);
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        assert!(out.stdout.is_empty(), "{args:?}: stdout {:?}", out.stdout);
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

#[test]
fn json_argument_errors_carry_the_whole_message_and_the_usage() {
    // clap writes the missing arguments on the lines after its message: they are the point.
    let out = pgbox(None, &["dead-letters", "--json", "replay"]);
    assert_eq!(out.status.code(), Some(2));
    let err = stderr_json(&out);
    let message = err["error"].as_str().unwrap();
    assert!(message.contains("<IDS>"), "{err}");
    assert!(
        err["usage"]
            .as_str()
            .is_some_and(|u| u.starts_with("pgbox dead-letters replay")),
        "{err}"
    );

    // A command without its subcommand: clap shows that command's help, whose first line is
    // its description; the JSON says what is missing instead.
    let out = pgbox(None, &["--json", "dead-letters"]);
    assert_eq!(out.status.code(), Some(2));
    let err = stderr_json(&out);
    assert_eq!(
        err["error"], "'pgbox dead-letters' requires a subcommand but none was provided",
        "{err}"
    );

    // A typo gets clap's suggestion.
    let err = stderr_json(&pgbox(None, &["--json", "statsu"]));
    assert!(
        err["tip"].as_str().is_some_and(|t| t.contains("'status'")),
        "{err}"
    );
}

#[tokio::test]
async fn doctor_on_an_unmigrated_schema_prints_a_report() {
    let db = TestDb::empty().await;
    let out = pgbox(Some(&db.url()), &["--json", "doctor"]);
    assert_eq!(out.status.code(), Some(4));
    let report = stdout_json(&out);
    assert_eq!(report["migrated"], false);
    assert_eq!(report["exit_code"], 4);
    // The same shape as any other doctor report, advice included.
    assert_eq!(report["status"], "critical", "{report}");
    assert_eq!(report["schema"], "pgbox");
    assert!(report["taken_at"].is_string(), "{report}");
    let findings = report["findings"].as_array().unwrap();
    assert_eq!(findings.len(), 1, "{report}");
    assert_eq!(findings[0]["code"], "not_migrated");
    assert!(
        findings[0]["advice"]
            .as_str()
            .is_some_and(|a| a.contains("pgbox migrate")),
        "{report}"
    );
    let err = stderr_json(&out);
    assert_eq!(err["exit_code"], 4, "{err}");

    // And as text, on stdout too, with the hint on stderr.
    let out = pgbox(Some(&db.url()), &["doctor"]);
    assert_eq!(out.status.code(), Some(4));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("not_migrated"), "{text}");
    assert!(String::from_utf8_lossy(&out.stderr).contains("run `pgbox migrate`"));

    // Once migrated, the same command says so (exit 0 or a finding, never 4).
    assert!(pgbox(Some(&db.url()), &["migrate"]).status.success());
    let out = pgbox(Some(&db.url()), &["--json", "doctor"]);
    assert_ne!(out.status.code(), Some(4));
    assert_eq!(stdout_json(&out)["migrated"], true);
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
    // Refused before connecting: no database was needed to say so.
    assert!(!err.contains("DATABASE_URL"), "{err}");
}

#[test]
fn the_purge_refusal_speaks_in_words() {
    let out = pgbox(None, &["purge", "--older-than", "90m"]);
    assert_eq!(out.status.code(), Some(6));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("younger than 1 day (the retention floor"),
        "{err}"
    );
    assert!(err.contains("--older-than 1 hour 30 minutes"), "{err}");
    assert!(err.contains("--force"), "{err}");
    assert!(!err.contains("86400") && !err.contains("5400"), "{err}");

    let out = pgbox(
        None,
        &[
            "--json",
            "purge",
            "--older-than",
            "12h",
            "--min-retention",
            "2d",
        ],
    );
    assert_eq!(out.status.code(), Some(6));
    let err = stderr_json(&out);
    assert!(
        err["error"]
            .as_str()
            .is_some_and(|e| e.contains("younger than 2 days")),
        "{err}"
    );
}

#[tokio::test]
async fn migrate_through_a_pipe_is_plain_and_names_each_migration_once() {
    let db = TestDb::empty().await;
    let out = pgbox(Some(&db.url()), &["migrate"]);
    assert!(out.status.success(), "{out:?}");
    let all = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!all.contains("\u{1b}["), "colour codes in a pipe: {all:?}");
    assert!(!all.contains("skipping"), "NOTICEs: {all}");
    for name in ["V1__inbox", "V3__outbox", "V12__partitioned_claims_agree"] {
        assert_eq!(all.matches(name).count(), 1, "{name} in: {all}");
    }

    // A second run applies nothing and says so, without NOTICEs from the idempotent DDL.
    let out = pgbox(Some(&db.url()), &["migrate"]);
    assert!(out.status.success(), "{out:?}");
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        "schema \"pgbox\" is up to date\n"
    );
    assert!(out.stderr.is_empty(), "{out:?}");
}
