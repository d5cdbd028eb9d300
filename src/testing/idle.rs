//! Drive a relay and a consumer until there is nothing left for them to do.

use std::fmt;
use std::time::Duration;

use sqlx::AssertSqlSafe;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::{FaultPoint, FaultPoints, TestError};
use crate::error::Error;
use crate::inbox::HandlerConnection;
use crate::outbox::Envelope;
use crate::transport::PgQueue;
use crate::transport::Publisher;
use crate::{Consumer, ConsumerStats, Relay};

/// How long [`run_until_idle`] waits for idle.
pub const DEFAULT_IDLE_LIMIT: Duration = Duration::from_secs(30);

/// How often the queue is looked at while the consumer works.
const LOOK_EVERY: Duration = Duration::from_millis(10);

/// What [`run_until_idle`] saw the relay and the consumer do.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct IdleReport {
    /// Messages the relay published and settled. A round that failed at a fault point
    /// settled nothing and is not counted; its messages count when a later round publishes
    /// them again.
    pub published: usize,
    /// Relay rounds that failed at an armed [`FaultPoint`] (and were run again).
    pub relay_faults: usize,
    /// What the consumer's run did: processed, duplicates, retried, dead-lettered...
    pub consumer: ConsumerStats,
}

/// Runs `relay` and `consumer` (with `handler`) until both are idle, for at most
/// [`DEFAULT_IDLE_LIMIT`]; see [`run_until_idle_within`].
pub async fn run_until_idle<P, F, E>(
    relay: &Relay<P>,
    consumer: &Consumer<PgQueue>,
    handler: F,
) -> Result<IdleReport, TestError>
where
    P: Publisher,
    F: AsyncFnOnce(&Envelope, &mut HandlerConnection<'_>) -> Result<(), E> + Clone,
    E: From<Error> + fmt::Display,
{
    run_until_idle_within(DEFAULT_IDLE_LIMIT, relay, consumer, handler).await
}

/// Runs `relay` and `consumer` (with `handler`) until both are idle, then stops the consumer
/// and returns what they did: for a test that enqueues, then checks the handler's effects.
///
/// `consumer` reads the built-in queue ([`PgQueue`]) that `relay` publishes into (in the same
/// database or another). Idle means: the relay's outbox has nothing left to publish (what a
/// dead letter holds back aside, as [`Relay::drain`] counts it), no message of the
/// consumer's topic is left in the queue (each was acked or dead-lettered), and no handler
/// enqueued anything since. Messages the handler enqueues are relayed too, so a chain of
/// handlers on the same queue runs to its end (each topic needs its own consumer, though:
/// only `consumer`'s topic is waited for).
///
/// Inside a [`FaultPoints::scope`], a relay round that fails at an armed fault point is run
/// again (counted in [`IdleReport::relay_faults`]); any other relay error is returned. A
/// nacked message waits out the consumer's backoff, and a message the runner holds waits out
/// its visibility timeout: keep both short in tests.
///
/// # Errors
/// [`TestError::NotIdle`] after `limit` (with what was still pending), or the relay's or the
/// consumer's error.
pub async fn run_until_idle_within<P, F, E>(
    limit: Duration,
    relay: &Relay<P>,
    consumer: &Consumer<PgQueue>,
    handler: F,
) -> Result<IdleReport, TestError>
where
    P: Publisher,
    F: AsyncFnOnce(&Envelope, &mut HandlerConnection<'_>) -> Result<(), E> + Clone,
    E: From<Error> + fmt::Display,
{
    let started = Instant::now();
    let deadline = started + limit;
    let stop_consumer = CancellationToken::new();
    let consumer_ended = CancellationToken::new();
    let run = async {
        let stats = consumer.run(handler, stop_consumer.clone()).await;
        consumer_ended.cancel();
        stats
    };
    let watch = async {
        let watched = watch(relay, consumer, started, deadline, &consumer_ended).await;
        stop_consumer.cancel();
        watched
    };
    // The consumer finishes the deliveries in hand once stopped: a handler that never
    // returns must not hold the test forever either.
    let both = tokio::time::timeout(limit + Duration::from_secs(10), async {
        tokio::join!(run, watch)
    });
    let Ok((stats, watched)) = both.await else {
        return Err(TestError::NotIdle {
            waited: started.elapsed(),
            state: "the consumer did not stop: a handler has not returned".into(),
        });
    };
    let consumer_stats = stats?;
    let mut report = watched?;
    report.consumer = consumer_stats;
    Ok(report)
}

/// Relays and looks at the queue until idle; see [`run_until_idle_within`].
async fn watch<P: Publisher>(
    relay: &Relay<P>,
    consumer: &Consumer<PgQueue>,
    started: Instant,
    deadline: Instant,
    consumer_ended: &CancellationToken,
) -> Result<IdleReport, TestError> {
    let queue = consumer.source();
    let count = format!(
        "SELECT pg_catalog.count(*) FROM {}.queue WHERE topic = $1",
        queue.schema_identifier()
    );
    let faults = FaultPoints::current();
    let mut report = IdleReport::default();
    // What kept it from idle at the last look, for the error at the deadline.
    let mut pending = Pending::Nothing;
    loop {
        if consumer_ended.is_cancelled() {
            // The run ended on its own, with an error that the caller gets.
            return Ok(report);
        }
        let not_idle = |pending: &Pending, report: &IdleReport| TestError::NotIdle {
            waited: started.elapsed(),
            state: pending.describe(consumer.topic(), report),
        };
        if Instant::now() >= deadline {
            return Err(not_idle(&pending, &report));
        }
        // A drain waits for every message it could not publish yet (a transport away, a
        // publish failing until its last attempt): bounded by the deadline too.
        let Ok(drained) =
            tokio::time::timeout_at(deadline, drain(relay, faults.as_ref(), &mut report)).await
        else {
            return Err(not_idle(&pending.cut_in_drain(), &report));
        };
        if drained?.is_none() {
            pending = Pending::RelayFaulted;
            continue;
        }
        let left: i64 = sqlx::query_scalar(AssertSqlSafe(count.clone()))
            .bind(consumer.topic())
            .fetch_one(queue.pool())
            .await?;
        pending = Pending::InQueue(left);
        if left == 0 {
            // Every delivery was settled before that look, so whatever its handler enqueued
            // had committed by then: a drain that finds nothing now means nothing is left.
            let Ok(drained) =
                tokio::time::timeout_at(deadline, drain(relay, faults.as_ref(), &mut report)).await
            else {
                return Err(not_idle(&pending.cut_in_drain(), &report));
            };
            match drained? {
                Some(0) => return Ok(report),
                Some(_) => pending = Pending::HandlersEnqueueing,
                None => pending = Pending::RelayFaulted,
            }
            continue;
        }
        tokio::time::sleep(LOOK_EVERY).await;
    }
}

/// What was not idle yet at the last look, for [`TestError::NotIdle`]'s state.
#[derive(Debug, Clone, Copy)]
enum Pending {
    /// Nothing looked at yet.
    Nothing,
    /// The relay's last round failed at an armed fault point.
    RelayFaulted,
    /// The relay's drain had not finished at the deadline.
    RelayDraining,
    /// Messages of the consumer's topic left in the queue.
    InQueue(i64),
    /// The queue was empty, but the relay found more to publish (what handlers enqueued).
    HandlersEnqueueing,
}

impl Pending {
    /// What to say when the deadline came during a drain: messages seen in the queue at the
    /// last look are the news; otherwise the drain itself is what did not end.
    fn cut_in_drain(self) -> Pending {
        match self {
            Pending::InQueue(left) if left > 0 => self,
            _ => Pending::RelayDraining,
        }
    }

    fn describe(&self, topic: &str, report: &IdleReport) -> String {
        match self {
            Pending::Nothing => "nothing was looked at before the limit".into(),
            Pending::RelayFaulted => format!(
                "the relay's rounds kept failing at the armed fault point {} ({} so far): \
                 their messages are still in the outbox",
                FaultPoint::RelayAfterPublishBeforeMark,
                report.relay_faults
            ),
            Pending::RelayDraining => "the relay was still draining its outbox (a message it \
                 could not publish yet: a transport away, a publish failing until its last \
                 attempt, or another relay holding its messages)"
                .into(),
            Pending::InQueue(left) => format!(
                "{left} message(s) of topic {topic:?} still in the queue (not yet acked or \
                 dead-lettered)"
            ),
            Pending::HandlersEnqueueing => format!(
                "the queue of topic {topic:?} was empty, but the relay kept finding more to \
                 publish (handlers enqueueing as fast as it relays?)"
            ),
        }
    }
}

/// One [`Relay::drain`]: `Some(published)`, or `None` when a round failed at an armed fault
/// point (counted in the report).
async fn drain<P: Publisher>(
    relay: &Relay<P>,
    faults: Option<&FaultPoints>,
    report: &mut IdleReport,
) -> Result<Option<usize>, TestError> {
    let fired = |f: &FaultPoints| f.fired(FaultPoint::RelayAfterPublishBeforeMark);
    let before = faults.map(fired);
    match relay.drain().await {
        Ok(drained) => {
            report.published += drained.published;
            Ok(Some(
                drained.published + drained.dead_lettered + drained.retried,
            ))
        }
        Err(_) if faults.map(fired) > before => {
            report.relay_faults += 1;
            Ok(None)
        }
        Err(e) => Err(e.into()),
    }
}
