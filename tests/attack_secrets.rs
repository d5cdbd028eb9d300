//! Attacks on issue 40's promise that no password, token or key shows in an error message,
//! a `Debug` output or the `pgbox` command's output. Each secret is unique per run; the tests
//! fail naming where it appeared.
//!
//! The inputs are ones people write: a generated password pasted raw into a URL (base64 and
//! friends hold `/`, `+`, `=`; password managers add `#`, `?`, `,`), and a URL typed where the
//! command line expects something else.

#![cfg(all(feature = "rabbitmq", feature = "cli"))]

mod support;

use std::process::Command;

use pgbox::transport::rabbitmq::RabbitMq;

/// A secret unique to this run, with `tail` (characters a URL must encode) appended.
fn secret(tail: &str) -> String {
    format!("Sx{}{tail}", uuid::Uuid::now_v7().simple())
}

/// Fails naming each place in `places` where `needle` (or its longest part before the first
/// special character, which is a secret on its own) appears.
fn assert_absent(needle: &str, places: &[(&str, String)]) {
    let head: String = needle
        .chars()
        .take_while(|c| c.is_ascii_alphanumeric())
        .collect();
    let leaks: Vec<String> = places
        .iter()
        .filter(|(_, text)| text.contains(needle) || text.contains(&head))
        .map(|(place, text)| format!("{place}: {text}"))
        .collect();
    assert!(leaks.is_empty(), "the secret leaked:\n{}", leaks.join("\n"));
}

/// A password that holds a character ending a URL's authority (`/`, `?`, `#`), pasted
/// unencoded into an AMQP URL. The URL is wrong (lapin cannot read it), and saying so must
/// not quote the password: neither the builder's `Debug` nor the error.
#[test]
fn finding_rabbitmq_unencoded_password_with_slash_shows_in_debug_and_error() {
    for tail in ["/b64+x=", "?q", "#frag"] {
        let password = secret(tail);
        let url = format!("amqp://app:{password}@127.0.0.1:5672/%2f");
        let builder = RabbitMq::builder(url.clone());
        let debug = format!("{builder:?}");
        let error = match builder.build() {
            Ok(_) => "(built)".to_owned(),
            Err(e) => format!("{e} / {e:?}"),
        };
        assert_absent(
            &password,
            &[
                ("RabbitMqBuilder's Debug", debug),
                ("RabbitMqBuilder::build's error", error),
            ],
        );
    }
}

/// The well-formed counterpart holds: an encoded password and a raw `@` in it.
#[test]
fn rabbitmq_encoded_or_at_sign_passwords_stay_hidden() {
    for (raw, in_url) in [
        (secret("@x"), None),
        (secret("/y"), Some("%2Fy")),
        (secret(":z"), None),
    ] {
        let written = match in_url {
            Some(enc) => raw.replace(&raw[raw.len() - 2..], enc),
            None => raw.clone(),
        };
        let url = format!("amqp://app:{written}@127.0.0.1:5672/%2f");
        let builder = RabbitMq::builder(url).allow_insecure_credentials(true);
        let debug = format!("{builder:?}");
        let error = match builder.build() {
            Ok(t) => format!("{t:?}"),
            Err(e) => format!("{e} / {e:?}"),
        };
        assert_absent(
            &written,
            &[("builder Debug", debug), ("build result", error)],
        );
    }
}

/// The output of `pgbox args...` (stdout and stderr), with no DATABASE_URL inherited.
fn pgbox(args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_pgbox"))
        .args(args)
        .env_remove("DATABASE_URL")
        .env_remove("PGPASSWORD")
        .output()
        .expect("pgbox runs");
    format!(
        "exit {:?}\n{}{}",
        out.status.code(),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// The URL typed where the command line wanted something else: as a positional argument
/// (forgetting `--database-url`), before the subcommand, with a misspelt flag, or twice.
/// clap quotes the offending argument in its error; pgbox must not pass the password on.
#[test]
fn finding_cli_usage_errors_quote_a_url_with_its_password() {
    let password = secret("");
    let url = format!("postgres://app:{password}@127.0.0.1:1/orders");
    let flag_typo = format!("--databse-url={url}");
    let conninfo = format!("host=127.0.0.1 password={password}");
    let cases: Vec<(&str, Vec<&str>)> = vec![
        (
            "the URL as a positional after the subcommand",
            vec!["status", &url],
        ),
        ("the URL instead of the subcommand", vec![&url, "status"]),
        ("a misspelt --database-url=URL", vec![&flag_typo, "status"]),
        (
            "a misspelt --database-url URL",
            vec!["--databse-url", &url, "status"],
        ),
        (
            "the URL where an id belongs",
            vec!["dead-letters", "show", &url],
        ),
        (
            "a key=value string as a positional",
            vec!["status", &conninfo],
        ),
    ];
    let mut seen = Vec::new();
    for (what, args) in cases {
        for json in [false, true] {
            let mut args = args.clone();
            if json {
                args.push("--json");
            }
            seen.push((format!("{what} (json: {json})"), pgbox(&args)));
        }
    }
    let places: Vec<(&str, String)> = seen.iter().map(|(p, t)| (p.as_str(), t.clone())).collect();
    assert_absent(&password, &places);
}

/// A password with a `,` and a `/` pasted unencoded into a PostgreSQL URL: the URL cannot
/// be read, and the message must not quote the password.
#[test]
fn finding_connect_quotes_a_password_holding_comma_and_slash() {
    let password = secret(",k/q");
    let url = format!("postgres://app:{password}@127.0.0.1:1/orders");
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let error = runtime.block_on(async {
        match pgbox::connect(&url, sqlx::postgres::PgPoolOptions::new()).await {
            Ok(_) => "(connected)".to_owned(),
            Err(e) => format!("{e} / {e:?}"),
        }
    });
    assert_absent(&password, &[("pgbox::connect's error", error)]);
}

/// The same URL given to the CLI (which repeats the library's message): the CLI hides the
/// URL's password, also in pieces, whatever the message it passes on.
#[test]
fn cli_hides_a_password_holding_comma_and_slash() {
    let password = secret(",k/q");
    let url = format!("postgres://app:{password}@127.0.0.1:1/orders");
    let mut seen = vec![
        ("pgbox status", pgbox(&["--database-url", &url, "status"])),
        (
            "pgbox status --json",
            pgbox(&["--database-url", &url, "--json", "status"]),
        ),
    ];
    let env = Command::new(env!("CARGO_BIN_EXE_pgbox"))
        .args(["--json", "doctor"])
        .env("DATABASE_URL", &url)
        .output()
        .unwrap();
    seen.push((
        "pgbox doctor --json, the URL in DATABASE_URL",
        String::from_utf8_lossy(&env.stderr).into_owned(),
    ));
    // Before the library's fix the message was "several hosts (app:<password>)"; now the URL
    // is refused as unreadable. Either way: refused, and without the password.
    assert!(
        seen.iter().all(|(_, text)| text.contains("error")),
        "the CLI did not refuse the URL: {seen:?}"
    );
    assert_absent(&password, &seen);
}

/// Raw special characters that do not end the authority (`@`, `:`, `%`, `+`, `=`) in a
/// PostgreSQL URL pointing nowhere: the errors of the library and the CLI hold no password.
#[test]
fn connect_errors_hide_raw_passwords_that_keep_the_authority() {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    for tail in ["@at", ":co", "+p=", "%zz"] {
        let password = secret(tail);
        let url = format!("postgres://app:{password}@127.0.0.1:1/orders");
        let error = runtime.block_on(async {
            match pgbox::connect(&url, sqlx::postgres::PgPoolOptions::new()).await {
                Ok(_) => "(connected)".to_owned(),
                Err(e) => format!("{e} / {e:?}"),
            }
        });
        let cli = pgbox(&["--database-url", &url, "--json", "doctor"]);
        assert_absent(
            &password,
            &[
                ("pgbox::connect's error", error),
                ("pgbox doctor --json", cli),
            ],
        );
    }
}

/// `Secret::from_file` on a file that is not UTF-8 or not a file never quotes contents.
#[test]
fn secret_from_file_never_quotes_contents() {
    let dir = std::env::temp_dir().join(format!("pgbox-att-secret-{}", uuid::Uuid::now_v7()));
    std::fs::create_dir_all(&dir).unwrap();
    let password = secret("");
    let file = dir.join("pw");
    let mut bytes = password.clone().into_bytes();
    bytes.push(0xff);
    std::fs::write(&file, &bytes).unwrap();
    let not_utf8 = pgbox::Secret::from_file(&file).map(|s| format!("{s:?} {s}"));
    std::fs::write(&file, format!("{password}\n")).unwrap();
    let ok = pgbox::Secret::from_file(&file).map(|s| format!("{s:?} {s} {:?}", s.clone()));
    let as_dir = pgbox::Secret::from_file(&dir).map(|s| format!("{s:?}"));
    std::fs::remove_dir_all(&dir).unwrap();
    let show = |r: Result<String, pgbox::Error>| match r {
        Ok(s) => s,
        Err(e) => format!("{e} / {e:?}"),
    };
    assert_absent(
        &password,
        &[
            ("not UTF-8", show(not_utf8)),
            ("ok", show(ok)),
            ("a directory", show(as_dir)),
        ],
    );
}

/// The NATS transport's own URL redaction, with the same raw passwords and tokens: a `/`,
/// `?` or `#` in them, unencoded.
#[cfg(feature = "nats")]
#[test]
fn finding_nats_unencoded_password_or_token_shows_in_debug_and_error() {
    use pgbox::transport::nats::Nats;
    for (tail, with_user) in [
        ("/b64+x=", true),
        ("?q", true),
        ("#f", true),
        ("/tok", false),
    ] {
        let password = secret(tail);
        let url = if with_user {
            format!("nats://app:{password}@127.0.0.1:4222")
        } else {
            format!("nats://{password}@127.0.0.1:4222")
        };
        let builder = Nats::builder(url.clone());
        let debug = format!("{builder:?}");
        let error = match builder.build() {
            Ok(t) => format!("(built) {t:?}"),
            Err(e) => format!("{e} / {e:?}"),
        };
        assert_absent(
            &password,
            &[
                ("NatsBuilder's Debug", debug),
                ("NatsBuilder::build's result", error),
            ],
        );
    }
}

/// Kafka's SASL password is a librdkafka setting (`sasl.password`, also `ssl.key.password`,
/// `ssl.keystore.password`): the builder's and the transport's `Debug` must not show it, nor
/// must the error of a build or first use that fails.
#[cfg(feature = "kafka")]
#[test]
fn finding_kafka_builder_debug_shows_sasl_password() {
    use pgbox::transport::kafka::Kafka;
    let password = secret("");
    let key_password = secret("");
    let builder = Kafka::builder("127.0.0.1:1")
        .set("security.protocol", "SASL_PLAINTEXT")
        .set("sasl.mechanism", "SCRAM-SHA-256")
        .set("sasl.username", "app")
        .set("sasl.password", password.clone())
        .set("ssl.key.password", key_password.clone());
    let debug = format!("{builder:?}");
    let built = match builder.build() {
        Ok(k) => format!("{k:?}"),
        Err(e) => format!("{e} / {e:?}"),
    };
    for secret in [&password, &key_password] {
        assert_absent(
            secret,
            &[
                ("KafkaBuilder's Debug", debug.clone()),
                ("Kafka's Debug or build error", built.clone()),
            ],
        );
    }
}

/// A standby's `primary_conninfo` holds the replication password. The doctor reads that
/// setting (whether it names a dbname, for slot synchronization): neither the library's
/// report (`Debug`, text, JSON) nor `pgbox doctor` (text, `--json`, RUST_LOG=trace) may show
/// the password. A private primary and standby; the password is never checked (trust), only
/// read back.
#[test]
fn doctor_on_a_standby_never_shows_the_primary_conninfo_password() {
    use support::cluster::Cluster;
    let password = secret("");
    let primary = Cluster::start_logical();
    let url = primary.url("postgres");
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        let pool = pgbox::connect(&url, sqlx::postgres::PgPoolOptions::new())
            .await
            .unwrap();
        pgbox::Migrator::new().run(&pool).await.unwrap();
        pool.close().await;
    });
    let standby = Cluster::standby_of(&primary, false);
    let conninfo = standby.psql("SHOW primary_conninfo");
    let with_password = format!("{} password={password}", conninfo.trim());
    standby.psql(&format!(
        "ALTER SYSTEM SET primary_conninfo = '{}'",
        with_password.replace('\'', "''")
    ));
    standby.psql("SELECT pg_reload_conf()");
    standby.wait_for(
        &format!(
            "SELECT count(*) FROM pg_settings WHERE name = 'primary_conninfo' \
             AND setting LIKE '%{password}%'"
        ),
        "1",
    );
    let standby_url = standby.url("postgres");
    let mut seen: Vec<(String, String)> = Vec::new();
    runtime.block_on(async {
        let pool = pgbox::connect(&standby_url, sqlx::postgres::PgPoolOptions::new())
            .await
            .unwrap();
        let report = pgbox::doctor::check(&pool, pgbox::DEFAULT_SCHEMA).await;
        let shown = match &report {
            Ok(r) => format!("{r:#?}"),
            Err(e) => format!("{e} / {e:?}"),
        };
        seen.push(("the library's report".into(), shown));
        pool.close().await;
    });
    for json in [false, true] {
        let mut args = vec!["--database-url", standby_url.as_str(), "doctor"];
        if json {
            args.push("--json");
        }
        let out = Command::new(env!("CARGO_BIN_EXE_pgbox"))
            .args(&args)
            .env("RUST_LOG", "trace")
            .env_remove("DATABASE_URL")
            .output()
            .unwrap();
        let text = format!(
            "exit {:?}\n{}{}",
            out.status.code(),
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            text.contains("primary_conninfo") || text.contains("standby"),
            "the doctor did not look at the standby: {text}"
        );
        seen.push((format!("pgbox doctor (json: {json})"), text));
    }
    let places: Vec<(&str, String)> = seen.iter().map(|(p, t)| (p.as_str(), t.clone())).collect();
    assert_absent(&password, &places);
    drop(standby);
    drop(primary);
}

/// The classic mix-up of `*_FILE` variables: the password itself where its file's path (or
/// its variable's name) belongs, e.g. `PGBOX_BROKER_PASSWORD_FILE=<the password>`. The
/// error must not quote it back.
#[test]
fn finding_secret_from_file_or_env_quotes_a_secret_given_in_place_of_its_name() {
    let mut seen = Vec::new();
    for tail in ["", "+x=", "/b64+x="] {
        let password = secret(tail);
        let from_file = match pgbox::Secret::from_file(&password) {
            Ok(s) => format!("{s:?}"),
            Err(e) => format!("{e} / {e:?}"),
        };
        let from_env = match pgbox::Secret::from_env(&password) {
            Ok(s) => format!("{s:?}"),
            Err(e) => format!("{e} / {e:?}"),
        };
        seen.push((password, from_file, from_env));
    }
    for (password, from_file, from_env) in seen {
        assert_absent(
            &password,
            &[
                ("Secret::from_file(<the secret>)", from_file),
                ("Secret::from_env(<the secret>)", from_env),
            ],
        );
    }
    // What a real path or variable name gets: named, so the mistake can be found.
    let missing = std::env::temp_dir().join(format!("pgbox-no-such-{}", secret("")));
    let e = pgbox::Secret::from_file(&missing).unwrap_err().to_string();
    assert!(e.contains(&*missing.to_string_lossy()), "{e}");
    let e = pgbox::Secret::from_env("PGBOX_ATTACK_SURELY_UNSET_VARIABLE")
        .unwrap_err()
        .to_string();
    assert!(e.contains("PGBOX_ATTACK_SURELY_UNSET_VARIABLE"), "{e}");
}
