//! Whatever SQL text a handler sends through its [`HandlerConnection`], the inbox's
//! transaction stays open: the statement is refused (by pgbox or by the server) or it runs
//! inside that transaction. A handler that then fails leaves nothing committed, and one that
//! returns `Ok` is never reported `Processed` over an ended transaction.
//!
//! The guarantee rests on the protocol, not on reading the text: every statement goes out
//! as one extended-protocol message, which the server refuses to hold a second statement, so
//! only the first keyword of one statement is left to read. The differential test sends
//! generated texts (quotes, `E''` escapes, `standard_conforming_strings = off`, Unicode
//! identifiers, dollar tags, comments, `U&` strings) and asks the server, for each one pgbox
//! let through, whether the transaction survived.

mod support;

use pgbox::{HandlerConnection, Inbox, Outcome};
use sqlx::{AssertSqlSafe, Connection, Executor, PgConnection, PgPool};
use support::TestDb;

/// The issue's inputs: the statement to set up (if any), then the text that smuggles a COMMIT.
const SMUGGLED: [(Option<&str>, &str); 4] = [
    (None, r"SELECT E'\''; COMMIT; SELECT 'x'"),
    (
        Some("SET LOCAL standard_conforming_strings = off"),
        r"SELECT '\''; COMMIT; SELECT 'x'",
    ),
    (None, "SELECT 1 AS é$$; COMMIT; SELECT 1 AS ê$$"),
    (None, "SELECT $é$'$é$; COMMIT; SELECT 'x'"),
];

async fn effects(pool: &PgPool, key: &str) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM effects WHERE key = $1")
        .bind(key)
        .fetch_one(pool)
        .await
        .unwrap()
}

async fn records(pool: &PgPool, key: &str) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM pgbox.inbox WHERE consumer = 'smuggler' AND key = $1")
        .bind(key)
        .fetch_one(pool)
        .await
        .unwrap()
}

/// The issue's handler: sends the text through its connection, ignoring what comes back,
/// writes an effect the same way, and fails or succeeds.
async fn smuggler(
    conn: &mut HandlerConnection<'_>,
    setup: Option<&str>,
    text: &str,
    key: &str,
    fail: bool,
) -> anyhow::Result<()> {
    if let Some(setup) = setup {
        sqlx::raw_sql(AssertSqlSafe(setup.to_owned()))
            .execute(&mut *conn)
            .await?;
    }
    let _ = sqlx::raw_sql(AssertSqlSafe(text.to_owned()))
        .execute(&mut *conn)
        .await;
    let _ = sqlx::query("INSERT INTO effects (key) VALUES ($1)")
        .bind(key)
        .execute(&mut *conn)
        .await;
    if fail {
        anyhow::bail!("the handler fails after its effect");
    }
    Ok(())
}

#[tokio::test]
async fn a_commit_hidden_in_the_text_never_ends_the_inbox_transaction() {
    support::init_tracing();
    let db = TestDb::migrated().await;
    db.pool
        .execute("CREATE TABLE effects (key text NOT NULL)")
        .await
        .unwrap();
    let inbox = Inbox::new("smuggler").unwrap();
    let mut problems = Vec::new();
    for (i, (setup, text)) in SMUGGLED.iter().enumerate() {
        for fail in [true, false] {
            let key = format!("k{i}-{fail}");
            let ctx = format!("{text:?} (setup {setup:?}), handler fails: {fail}");
            let mut tx = db.pool.begin().await.unwrap();
            let result = inbox
                .process(&mut tx, key.as_str(), async |conn| {
                    smuggler(conn, *setup, text, &key, fail).await
                })
                .await;
            // Whatever the handler did, the call must not report the message processed.
            if matches!(result, Ok(Outcome::Processed(()))) {
                problems.push(format!("{ctx}: reported Processed"));
            }
            let _ = tx.rollback().await;
            let (rows, done) = (records(&db.pool, &key).await, effects(&db.pool, &key).await);
            if (rows, done) != (0, 0) {
                problems.push(format!(
                    "{ctx}: after the rollback, {rows} inbox row(s) and {done} effect(s) committed"
                ));
            }
            // The redelivery runs the handler: the message was not lost.
            let mut tx = db.pool.begin().await.unwrap();
            let redelivery = inbox
                .process(&mut tx, key.as_str(), async |conn| {
                    sqlx::query("INSERT INTO effects (key) VALUES ($1)")
                        .bind(&key)
                        .execute(&mut *conn)
                        .await?;
                    Ok::<_, anyhow::Error>(())
                })
                .await
                .unwrap_or_else(|e| panic!("{ctx}: redelivery failed: {e:#}"));
            tx.commit().await.unwrap();
            if !redelivery.is_processed() {
                problems.push(format!("{ctx}: the redelivery is {redelivery:?}"));
            }
        }
    }
    assert!(problems.is_empty(), "\n{}", problems.join("\n"));
}

#[tokio::test]
async fn one_statement_per_call_and_ordinary_statements_still_work() {
    let db = TestDb::migrated().await;
    let inbox = Inbox::new("ordinary").unwrap();
    let mut tx = db.pool.begin().await.unwrap();
    let outcome = inbox
        .process(&mut tx, "k", async |conn| {
            // Texts that look like transaction control but are not: all run.
            for sql in [
                "CREATE TEMP TABLE t (a text) ON COMMIT DROP",
                "INSERT INTO t VALUES ('COMMIT; ROLLBACK')",
                "SELECT 'x' AS \"commit\"",
                "SAVEPOINT s1",
                "ROLLBACK TO SAVEPOINT s1",
                "RELEASE s1",
                "SELECT $tag$ ; COMMIT $tag$",
                "/* COMMIT */ SELECT 1 -- ; COMMIT",
                "SELECT 1;",
                "",
            ] {
                sqlx::raw_sql(AssertSqlSafe(sql.to_owned()))
                    .execute(&mut *conn)
                    .await
                    .map_err(|e| anyhow::anyhow!("{sql:?}: {e}"))?;
            }
            // Two statements in one call are the server's to refuse.
            let two = sqlx::raw_sql("SELECT 1; SELECT 2")
                .execute(&mut *conn)
                .await
                .expect_err("two statements ran");
            anyhow::ensure!(
                two.as_database_error().and_then(|e| e.code()).as_deref() == Some("42601"),
                "two statements: {two}"
            );
            Ok::<_, anyhow::Error>(())
        })
        .await;
    // The refused pair aborted the transaction: reported, never processed.
    let e = outcome.expect_err("processed over an aborted transaction");
    assert!(
        matches!(
            e.downcast_ref::<pgbox::Error>(),
            Some(pgbox::Error::TransactionAbortedInHandler)
        ),
        "{e:#}"
    );
}

/// A small deterministic generator (xorshift64*), so a failure names a reproducible seed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    fn pick<'a>(&mut self, from: &[&'a str]) -> &'a str {
        from[self.below(from.len())]
    }
}

/// What may stand before a statement's first keyword.
const LEAD_INS: &[&str] = &[
    "",
    " ",
    "\t",
    "\n",
    "\r",
    "\x0c",
    "\x0b",
    ";",
    " ; ",
    ";;",
    "-- c\n",
    "-- c\r",
    "--\r\n",
    "-- ;COMMIT\n",
    "/* c */",
    "/* /* nested */ */",
    "/*/ x */",
    "/**/",
    "/* a */ /* b */",
    "/* ' */",
    "/* $$ */",
    "--é\n",
    "\u{a0}",
    "\u{feff}",
];

/// Quotes, escapes, identifiers and tags, each read differently by a naive lexer.
const LITERALS: &[&str] = &[
    "'a'",
    "'it''s'",
    r"E'\''",
    r"e'\\'",
    r"E'\\\''",
    r"'\'",
    r"'\''",
    r"U&'\0041'",
    r"U&'!0041' UESCAPE '!'",
    r#"U&"\0041""#,
    "\"q\"",
    "\"a\"\"b\"",
    "\"COMMIT\"",
    "$$x$$",
    "$$;COMMIT;$$",
    "$a$ ' $a$",
    "$é$'$é$",
    "$é$",
    "é$$",
    "ê$$",
    "x$$",
    "$1",
    "b'01'",
    "x'ff'",
    "é",
    "1e3",
    "'",
    "\"",
    "$$",
    "/*",
    "*/",
    "--",
];

/// Transaction control and the words around it.
const KEYWORDS: &[&str] = &[
    "COMMIT",
    "commit",
    "CoMmIt",
    "END",
    "ROLLBACK",
    "ABORT",
    "BEGIN",
    "START TRANSACTION",
    "COMMIT AND CHAIN",
    "ROLLBACK TO s1",
    "ROLLBACK /* c */ TO s1",
    "ROLLBACK TO SAVEPOINT s1",
    "ROLLBACK \"TO\" s1",
    "SAVEPOINT s1",
    "RELEASE s1",
    "PREPARE TRANSACTION 'p'",
    "PREPARE\nTRANSACTION 'p'",
    "PREPARE \"TRANSACTION\" AS SELECT 1",
    "COMMITé",
    "éCOMMIT",
    "COMMIT$",
    "END$",
    "SELECT",
    "SELECT 1",
    "SELECT 1 AS",
    "AS",
];

const SEPARATORS: &[&str] = &["", " ", "\n", ";", "; ", " ; "];

/// One generated text: an attack shape (`SELECT lit; COMMIT; SELECT lit`), a lone statement
/// behind a lead-in, or a random run of fragments.
fn generate(rng: &mut Rng) -> String {
    match rng.below(3) {
        0 => format!(
            "SELECT {}{}{}{}{}SELECT {}",
            rng.pick(LITERALS),
            rng.pick(SEPARATORS),
            rng.pick(LEAD_INS),
            rng.pick(KEYWORDS),
            rng.pick(SEPARATORS),
            rng.pick(LITERALS),
        ),
        1 => format!("{}{}", rng.pick(LEAD_INS), rng.pick(KEYWORDS)),
        _ => {
            let mut text = String::new();
            for _ in 0..1 + rng.below(8) {
                let part = match rng.below(3) {
                    0 => rng.pick(LEAD_INS),
                    1 => rng.pick(LITERALS),
                    _ => rng.pick(KEYWORDS),
                };
                text.push_str(part);
                text.push_str(rng.pick(SEPARATORS));
            }
            text
        }
    }
}

/// Whether the transaction of `xid` is over, probed behind the text on `conn`: a savepoint
/// taken before the text is gone (the transaction ended), or the connection runs in another
/// transaction (or none).
async fn ended(conn: &mut PgConnection, xid: &str) -> bool {
    if sqlx::raw_sql("ROLLBACK TO SAVEPOINT pgbox_probe")
        .execute(&mut *conn)
        .await
        .is_err()
    {
        return true;
    }
    let now: Option<String> =
        sqlx::query_scalar("SELECT pg_catalog.pg_current_xact_id_if_assigned()::text")
            .fetch_one(&mut *conn)
            .await
            .expect("probe the transaction");
    now.as_deref() != Some(xid)
}

/// The server's verdict without pgbox: the text sent as a script on a plain transaction.
async fn ends_unguarded(conn: &mut PgConnection, text: &str, conforming: bool) -> bool {
    sqlx::raw_sql("BEGIN").execute(&mut *conn).await.unwrap();
    if !conforming {
        sqlx::raw_sql("SET LOCAL standard_conforming_strings = off")
            .execute(&mut *conn)
            .await
            .unwrap();
    }
    let xid: String = sqlx::query_scalar("SELECT pg_catalog.pg_current_xact_id()::text")
        .fetch_one(&mut *conn)
        .await
        .unwrap();
    sqlx::raw_sql("SAVEPOINT pgbox_probe")
        .execute(&mut *conn)
        .await
        .unwrap();
    let _ = sqlx::raw_sql(AssertSqlSafe(text.to_owned()))
        .execute(&mut *conn)
        .await;
    let over = ended(conn, &xid).await;
    let _ = sqlx::raw_sql("ROLLBACK").execute(&mut *conn).await;
    over
}

/// Sends the text through the handler's connection; returns (let through, transaction ended).
async fn through_pgbox(
    conn: &mut PgConnection,
    inbox: &Inbox,
    key: &str,
    text: &str,
    conforming: bool,
) -> (bool, bool) {
    let mut seen = (false, false);
    let mut tx = conn.begin().await.unwrap();
    let _ = inbox
        .process(&mut tx, key, async |c: &mut HandlerConnection<'_>| {
            if !conforming {
                sqlx::raw_sql("SET LOCAL standard_conforming_strings = off")
                    .execute(&mut *c)
                    .await?;
            }
            let xid: String = sqlx::query_scalar("SELECT pg_catalog.pg_current_xact_id()::text")
                .fetch_one(&mut *c)
                .await?;
            sqlx::raw_sql("SAVEPOINT pgbox_probe")
                .execute(&mut **c)
                .await?;
            let sent = sqlx::raw_sql(AssertSqlSafe(text.to_owned()))
                .execute(&mut *c)
                .await;
            let refused_by_pgbox = matches!(
                &sent,
                Err(sqlx::Error::InvalidArgument(m)) if m.starts_with("pgbox:")
            );
            seen = (!refused_by_pgbox, ended(c, &xid).await);
            Ok::<_, anyhow::Error>(())
        })
        .await;
    let _ = tx.rollback().await;
    // Whatever the text left behind (a transaction it began), the next case starts clean.
    let _ = sqlx::raw_sql("ROLLBACK").execute(&mut *conn).await;
    seen
}

#[tokio::test]
async fn nothing_the_handler_connection_lets_through_ends_the_transaction() {
    let db = TestDb::migrated().await;
    let seed = std::env::var("PGBOX_DIFFERENTIAL_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0x5EED_0034_u64);
    let cases: usize = std::env::var("PGBOX_DIFFERENTIAL_CASES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1500);
    let mut rng = Rng(seed);
    let inbox = Inbox::new("differential").unwrap();
    let mut guarded = db.connect().await;
    let mut unguarded = db.connect().await;
    let (mut ending, mut passed, mut refused) = (0usize, 0usize, 0usize);
    let mut escaped = Vec::new();
    for i in 0..cases {
        let text = generate(&mut rng);
        let conforming = rng.below(2) == 0;
        if ends_unguarded(&mut unguarded, &text, conforming).await {
            ending += 1;
        }
        let (let_through, over) =
            through_pgbox(&mut guarded, &inbox, &format!("d{i}"), &text, conforming).await;
        if let_through {
            passed += 1;
        } else {
            refused += 1;
        }
        if let_through && over {
            escaped.push(format!(
                "{text:?} (standard_conforming_strings {})",
                if conforming { "on" } else { "off" }
            ));
        }
    }
    eprintln!(
        "seed {seed:#x}: {cases} texts, {ending} end a transaction sent as a script, \
         {passed} let through by pgbox, {refused} refused by pgbox"
    );
    // The generator must produce texts that end a transaction, or this test proves nothing.
    assert!(
        ending * 10 >= cases,
        "only {ending} of {cases} texts end a transaction"
    );
    assert!(
        passed * 10 >= cases,
        "only {passed} of {cases} texts let through"
    );
    assert!(
        escaped.is_empty(),
        "seed {seed:#x}: {} texts let through ended the transaction, e.g.\n{}",
        escaped.len(),
        escaped
            .iter()
            .take(15)
            .cloned()
            .collect::<Vec<_>>()
            .join("\n")
    );
    let leaked: i64 =
        sqlx::query_scalar("SELECT count(*) FROM pgbox.inbox WHERE consumer = 'differential'")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(leaked, 0, "inbox rows committed by texts pgbox let through");
}
