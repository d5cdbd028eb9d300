//! A server that only allows reads (a hot standby after a failover, or
//! `default_transaction_read_only`): every write path fails before any handler runs, with a
//! typed, retryable error. Never a handler run whose inbox row could not be written.

mod support;

use std::sync::atomic::{AtomicUsize, Ordering};

use pgbox::{DbErrorKind, Error, Inbox, Message, Outbox};
use sqlx::Executor;
use sqlx::postgres::PgPoolOptions;
use support::TestDb;

#[tokio::test]
async fn a_read_only_server_is_refused_before_the_handler_with_a_retryable_error() {
    let db = TestDb::migrated().await;
    db.pool
        .execute("CREATE TABLE effects (key text NOT NULL)")
        .await
        .unwrap();
    // Every new session of this database is read-only, as on a standby.
    db.pool
        .execute(sqlx::AssertSqlSafe(format!(
            "ALTER DATABASE \"{}\" SET default_transaction_read_only = on",
            db.name
        )))
        .await
        .unwrap();
    let pool = PgPoolOptions::new()
        .max_connections(2)
        .connect_with(db.options.clone())
        .await
        .unwrap();
    let inbox = Inbox::new("points").unwrap();
    let ran = AtomicUsize::new(0);
    let handler = async |conn: &mut pgbox::HandlerConnection<'_>| {
        ran.fetch_add(1, Ordering::SeqCst);
        sqlx::query("INSERT INTO effects VALUES ('k')")
            .execute(&mut *conn)
            .await?;
        Ok::<_, Error>(())
    };
    let check = |e: Error| {
        assert_eq!(e.db_kind(), Some(DbErrorKind::ReadOnly), "{e}");
        assert!(e.is_retryable(), "{e}");
        assert!(e.to_string().contains("read-only"), "{e}");
    };
    check(
        inbox
            .process_and_commit(&pool, "k", handler)
            .await
            .unwrap_err(),
    );
    let mut tx = pool.begin().await.unwrap();
    check(inbox.process(&mut tx, "k", handler).await.unwrap_err());
    drop(tx);
    assert_eq!(
        ran.load(Ordering::SeqCst),
        0,
        "a handler ran on a read-only server"
    );
    // The outbox refuses the same way.
    let mut tx = pool.begin().await.unwrap();
    check(
        Outbox::new()
            .enqueue(&mut tx, Message::bytes("t", "x"))
            .await
            .unwrap_err(),
    );
}
