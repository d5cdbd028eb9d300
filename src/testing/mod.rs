//! Test support for services built on pgbox (feature `testing`): a throwaway database per
//! test, assertions on what a transaction enqueued, a relay and a consumer driven until idle,
//! and fault points that fail them where a crash would.
//!
//! - [`TestDatabase`]: a fresh, uniquely named database, migrated with pgbox's schema,
//!   dropped afterwards. The server comes from `PGBOX_TEST_DATABASE_URL`/`DATABASE_URL`, a
//!   local server on 127.0.0.1:5432, or a private cluster the kit starts from the
//!   distribution's PostgreSQL binaries: no Docker needed.
//! - [`OutboxProbe`]: the messages enqueued since it started, with
//!   [`assert_enqueued`](Enqueued::assert_enqueued),
//!   [`assert_nothing_enqueued`](Enqueued::assert_nothing_enqueued) and JSON decoding.
//! - [`run_until_idle`]: relays and consumes until nothing is left, bounded, then returns
//!   the counts.
//! - [`FaultPoints`]: make the relay fail after it published but before it marked the batch,
//!   or the runner after the handler's commit but before the ack, and see the inbox turn the
//!   redelivery into a duplicate.
//!
//! Also here: the transport [`conformance`](crate::transport::conformance) suite, for
//! transports' own tests.
//!
//! ```no_run
//! use std::time::Duration;
//! use pgbox::testing::{FaultPoint, FaultPoints, OutboxProbe, TestDatabase, run_until_idle};
//! use pgbox::transport::PgQueue;
//! use pgbox::{Consumer, Inbox, Message, Outbox, Relay};
//!
//! # async fn t() -> anyhow::Result<()> {
//! let db = TestDatabase::new().await?;
//! let pool = db.pool().clone();
//! sqlx::query("CREATE TABLE credits (account text PRIMARY KEY, total int NOT NULL)")
//!     .execute(&pool)
//!     .await?;
//!
//! // The code under test commits a message with its business write.
//! let probe = OutboxProbe::start(&pool).await?;
//! let mut tx = pool.begin().await?;
//! Outbox::new()
//!     .enqueue(&mut tx, Message::json("credits", &serde_json::json!({"account": "a", "amount": 5}))?)
//!     .await?;
//! tx.commit().await?;
//! probe.enqueued().await?.assert_enqueued("credits", None);
//!
//! // Deliver it, with a crash between the handler's commit and the ack.
//! let queue = PgQueue::new(pool.clone());
//! let relay = Relay::builder(pool.clone(), queue.clone()).build()?;
//! let consumer = Consumer::builder(pool.clone(), queue, "credits", Inbox::new("credits-svc")?)
//!     .poll_interval(Duration::from_millis(50))
//!     .build()?;
//! let faults = FaultPoints::new();
//! faults.arm(FaultPoint::ConsumerAfterHandlerCommitBeforeAck, 1);
//! let report = faults
//!     .scope(run_until_idle(&relay, &consumer, async |m: &pgbox::Envelope, conn: &mut pgbox::HandlerConnection<'_>| {
//!         let credit: serde_json::Value = m.json()?;
//!         sqlx::query("INSERT INTO credits VALUES ($1, $2) \
//!                      ON CONFLICT (account) DO UPDATE SET total = credits.total + $2")
//!             .bind(credit["account"].as_str())
//!             .bind(credit["amount"].as_i64().map(|a| a as i32))
//!             .execute(&mut **conn)
//!             .await?;
//!         Ok::<_, pgbox::Error>(())
//!     }))
//!     .await?;
//! assert_eq!((report.consumer.processed, report.consumer.duplicates), (1, 1));
//! let total: i32 = sqlx::query_scalar("SELECT total FROM credits").fetch_one(&pool).await?;
//! assert_eq!(total, 5); // redelivered, applied once
//! db.close().await?;
//! # Ok(()) }
//! ```

mod database;
mod error;
mod faults;
mod idle;
mod probe;
mod server;

pub use self::database::{TEST_DATABASE_PREFIX, TestDatabase};
pub use self::error::TestError;
pub use self::faults::{FaultPoint, FaultPoints};
pub use self::idle::{DEFAULT_IDLE_LIMIT, IdleReport, run_until_idle, run_until_idle_within};
pub use self::probe::{Enqueued, EnqueuedMessage, OutboxProbe};

pub(crate) use self::faults::{crash, hit};
