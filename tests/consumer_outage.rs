//! The consumer runner through an outage of its inbox's database longer than its whole
//! delivery budget: the deliveries the outage used up are not the message's failures, so one
//! ordinary handler failure afterwards does not dead-letter it.

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use pgbox::transport::{PgQueue, Publisher, conformance};
use pgbox::{CancellationToken, Consumer, Envelope, HandlerConnection, Inbox, Lease, RetryPolicy};
use sqlx::postgres::PgPoolOptions;
use support::TestDb;
use support::brokers::{self, Proxy};

/// An address where nothing listens (a port bound, then released).
fn nowhere() -> std::net::SocketAddr {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("free port")
}

async fn deliveries(queue_db: &TestDb) -> i32 {
    sqlx::query_scalar("SELECT coalesce(max(deliveries), 0) FROM pgbox.queue")
        .fetch_one(&queue_db.pool)
        .await
        .unwrap()
}

/// How the runner under test handles the message.
#[derive(Clone, Copy, PartialEq)]
enum Mode {
    /// `run`: the handler in the inbox's transaction.
    Transaction,
    /// `run_leased`: the handler under a lease.
    Lease,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deliveries_used_up_by_an_inbox_outage_do_not_count_against_the_message() {
    inbox_outage_then_one_failure(Mode::Transaction).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_lease_mode_an_inbox_outage_is_not_the_messages_failure() {
    inbox_outage_then_one_failure(Mode::Lease).await;
}

/// The inbox's database away for more deliveries than `max_deliveries` (the handler never
/// runs), then back: the handler fails once (an ordinary failure of the message), then
/// succeeds. Nothing is dead-lettered.
async fn inbox_outage_then_one_failure(mode: Mode) {
    support::init_tracing();
    let queue_db = TestDb::migrated().await;
    let inbox_db = TestDb::migrated().await;
    sqlx::query("CREATE TABLE effects (message_id uuid NOT NULL)")
        .execute(&inbox_db.pool)
        .await
        .unwrap();
    let server = brokers::address(&support::server_url().await);
    let proxy = Proxy::start(nowhere()).await;
    let inbox_pool = PgPoolOptions::new()
        .max_connections(2)
        .acquire_timeout(Duration::from_millis(500))
        .connect_lazy_with(
            inbox_db
                .options
                .clone()
                .host("127.0.0.1")
                .port(proxy.addr().port()),
        );

    let queue = PgQueue::new(queue_db.pool.clone());
    let topic = "outage.inbox";
    let sent = queue
        .publish(&[conformance::envelope(topic, "the message")])
        .await;
    assert!(sent[0].is_ok(), "{sent:?}");

    let max_deliveries = 3;
    let consumer = Consumer::builder(inbox_pool, queue, topic, Inbox::new("outage").unwrap())
        .max_deliveries(max_deliveries)
        .concurrency(1)
        .poll_interval(Duration::from_millis(10))
        .backoff(
            RetryPolicy::new()
                .base_delay(Duration::from_millis(1))
                .max_delay(Duration::from_millis(5)),
        )
        .build()
        .unwrap();
    // Fails once, the first time it runs, then succeeds (writing its effect in the inbox's
    // transaction when it has one).
    let calls = Arc::new(AtomicUsize::new(0));
    let shutdown = CancellationToken::new();
    let run = tokio::spawn({
        let shutdown = shutdown.clone();
        let calls = calls.clone();
        async move {
            let first = move || calls.fetch_add(1, Ordering::SeqCst) == 0;
            let failure =
                || pgbox::Error::InvalidConfig("an ordinary failure of the handler".into());
            match mode {
                Mode::Transaction => {
                    consumer
                        .run(
                            async move |msg: &Envelope, conn: &mut HandlerConnection<'_>| {
                                if first() {
                                    return Err(failure());
                                }
                                sqlx::query("INSERT INTO effects (message_id) VALUES ($1)")
                                    .bind(msg.id)
                                    .execute(&mut *conn)
                                    .await
                                    .map_err(pgbox::Error::from)?;
                                Ok::<(), pgbox::Error>(())
                            },
                            shutdown,
                        )
                        .await
                }
                Mode::Lease => {
                    consumer
                        .run_leased(
                            async move |_: &Envelope, _: &mut Lease| {
                                if first() {
                                    return Err(failure());
                                }
                                Ok::<(), pgbox::Error>(())
                            },
                            Duration::from_secs(30),
                            shutdown,
                        )
                        .await
                }
            }
        }
    });

    let count = async |sql: &'static str| -> i64 {
        sqlx::query_scalar(sql)
            .fetch_one(&queue_db.pool)
            .await
            .unwrap()
    };
    let left = "SELECT count(*) FROM pgbox.queue";
    let dead = "SELECT count(*) FROM pgbox.queue_dead_letters";

    // The inbox's database is away for more deliveries than the budget.
    let mut turns = 0;
    while deliveries(&queue_db).await <= max_deliveries + 2 && count(dead).await == 0 {
        turns += 1;
        assert!(
            turns <= 3_000,
            "the message was not redelivered while the inbox was away"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(
        count(dead).await,
        0,
        "dead-lettered while the inbox was away"
    );
    assert_eq!(
        calls.load(Ordering::SeqCst),
        0,
        "the handler ran while away"
    );

    // Back: one ordinary failure, then done (acked: gone from the queue).
    proxy.retarget(server);
    let mut turns = 0;
    while count(left).await > 0 {
        turns += 1;
        assert!(turns <= 3_000, "neither acked nor dead-lettered");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    shutdown.cancel();
    let stats = tokio::time::timeout(Duration::from_secs(30), run)
        .await
        .expect("the runner stops")
        .unwrap()
        .unwrap();
    assert_eq!(
        count(dead).await,
        0,
        "dead-lettered after one failure of its own: {stats:?}"
    );
    assert_eq!(calls.load(Ordering::SeqCst), 2, "{stats:?}");
    if mode == Mode::Transaction {
        let effects: i64 = sqlx::query_scalar("SELECT count(*) FROM effects")
            .fetch_one(&inbox_db.pool)
            .await
            .unwrap();
        assert_eq!(effects, 1, "{stats:?}");
    }
}
