//! Named fault points: make the relay or the consumer runner fail at a chosen point, the way a
//! crash there would, so that a test can show what the redelivery does.

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex};

use crate::error::{DbErrorKind, Error};

/// A point in pgbox's data path where a test can make it fail as a crash would.
///
/// Each point is reached only inside a [`FaultPoints::scope`], and fails only while it is
/// armed ([`FaultPoints::arm`]). Without the `testing` feature the points do not exist: no
/// code is compiled for them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum FaultPoint {
    /// `relay.after_publish_before_mark`: a [`Relay`](crate::Relay) round published its batch
    /// (the transport confirmed it) but fails before it deletes or marks the rows, as if the
    /// relay died there. The round's transaction rolls back, the messages stay in the
    /// outbox, and the next round publishes them again: the consumer gets each twice, with
    /// the same message id. (Into the built-in queue in the relay's own database nothing went
    /// out yet, since the batch moves in the round's transaction: the round just runs again.)
    /// The round returns a connection-lost [`Error::Database`].
    RelayAfterPublishBeforeMark,
    /// `consumer.after_handler_commit_before_ack`: a [`Consumer`](crate::Consumer) settled a
    /// delivery in the inbox (the handler's transaction committed, or the inbox found a
    /// duplicate) but does not ack it, as if the runner died there. The delivery is handed
    /// back to the transport unacknowledged (a nack with no delay, which is what a broker
    /// does with the deliveries of a consumer whose connection died), so it comes again:
    /// the inbox reports the redelivery as a duplicate and the handler does not run.
    ConsumerAfterHandlerCommitBeforeAck,
}

impl FaultPoint {
    /// Every fault point.
    pub const ALL: [FaultPoint; 2] = [
        FaultPoint::RelayAfterPublishBeforeMark,
        FaultPoint::ConsumerAfterHandlerCommitBeforeAck,
    ];

    /// The point's name, e.g. `"relay.after_publish_before_mark"`.
    pub fn name(self) -> &'static str {
        match self {
            FaultPoint::RelayAfterPublishBeforeMark => "relay.after_publish_before_mark",
            FaultPoint::ConsumerAfterHandlerCommitBeforeAck => {
                "consumer.after_handler_commit_before_ack"
            }
        }
    }
}

impl fmt::Display for FaultPoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[derive(Debug, Default, Clone, Copy)]
struct Counts {
    armed: u32,
    fired: u32,
}

/// A set of armed fault points, shared by the futures run in its [`scope`](Self::scope).
///
/// Cheap to clone (the clones share their state). Fault points are per scope, not
/// process-wide, so tests running in parallel in one process do not trip each other's.
///
/// ```no_run
/// # async fn f(relay: pgbox::Relay<pgbox::transport::PgQueue>) -> Result<(), pgbox::Error> {
/// use pgbox::testing::{FaultPoint, FaultPoints};
/// let faults = FaultPoints::new();
/// faults.arm(FaultPoint::RelayAfterPublishBeforeMark, 1);
/// // The first round publishes, then fails before it deletes the rows.
/// assert!(faults.scope(relay.relay_once()).await.is_err());
/// assert_eq!(faults.fired(FaultPoint::RelayAfterPublishBeforeMark), 1);
/// // The next publishes the same messages again.
/// faults.scope(relay.drain()).await?;
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, Default)]
pub struct FaultPoints {
    counts: Arc<Mutex<HashMap<FaultPoint, Counts>>>,
}

tokio::task_local! {
    static CURRENT: FaultPoints;
}

impl FaultPoints {
    /// No point armed.
    pub fn new() -> Self {
        Self::default()
    }

    /// Makes `point` fail the next `times` times it is reached in this set's scope (added to
    /// what is armed already; 0 leaves it as it is).
    pub fn arm(&self, point: FaultPoint, times: u32) -> &Self {
        let mut counts = self.counts.lock().expect("fault points");
        let c = counts.entry(point).or_default();
        c.armed = c.armed.saturating_add(times);
        self
    }

    /// Disarms `point`: it no longer fails (what it fired stays counted).
    pub fn disarm(&self, point: FaultPoint) -> &Self {
        if let Some(c) = self.counts.lock().expect("fault points").get_mut(&point) {
            c.armed = 0;
        }
        self
    }

    /// How often `point` has failed so far.
    pub fn fired(&self, point: FaultPoint) -> u32 {
        self.counts
            .lock()
            .expect("fault points")
            .get(&point)
            .map_or(0, |c| c.fired)
    }

    /// How many more times `point` will fail.
    pub fn armed(&self, point: FaultPoint) -> u32 {
        self.counts
            .lock()
            .expect("fault points")
            .get(&point)
            .map_or(0, |c| c.armed)
    }

    /// Runs `future` with these fault points in effect: the relay's and the consumer's
    /// points reached while it runs (in its task, not in tasks it spawns) fail while armed.
    /// Wrap whatever drives pgbox: [`run_until_idle`](super::run_until_idle),
    /// [`Relay::drain`](crate::Relay::drain), [`Consumer::run`](crate::Consumer::run), or
    /// the body of a task you spawn for them.
    pub async fn scope<F: Future>(&self, future: F) -> F::Output {
        CURRENT.scope(self.clone(), future).await
    }

    /// Takes one shot at `point`: `true` (and counted as fired) when it was armed.
    fn take(&self, point: FaultPoint) -> bool {
        let mut counts = self.counts.lock().expect("fault points");
        match counts.get_mut(&point) {
            Some(c) if c.armed > 0 => {
                c.armed -= 1;
                c.fired = c.fired.saturating_add(1);
                true
            }
            _ => false,
        }
    }

    /// The set in effect for the current task, if any.
    pub(crate) fn current() -> Option<FaultPoints> {
        CURRENT.try_with(Clone::clone).ok()
    }
}

/// Called by the relay and the runner at `point`: `true` when it must fail there now (an
/// armed point in the current scope; counted as fired).
pub(crate) fn hit(point: FaultPoint) -> bool {
    CURRENT.try_with(|f| f.take(point)).unwrap_or(false)
}

/// The error a failing point returns: a lost connection, as a crash of the process (or of
/// its connection) there would look to the code above it.
pub(crate) fn crash(point: FaultPoint) -> Error {
    Error::Database {
        kind: DbErrorKind::ConnectionLost,
        source: sqlx::Error::Io(std::io::Error::new(
            std::io::ErrorKind::ConnectionAborted,
            format!("pgbox test fault point {point} fired"),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn an_armed_point_fires_as_often_as_armed_and_only_in_its_scope() {
        let faults = FaultPoints::new();
        faults.arm(FaultPoint::RelayAfterPublishBeforeMark, 2);
        assert!(
            !hit(FaultPoint::RelayAfterPublishBeforeMark),
            "outside the scope"
        );
        let shots = faults
            .scope(async {
                (0..3)
                    .map(|_| hit(FaultPoint::RelayAfterPublishBeforeMark))
                    .collect::<Vec<_>>()
            })
            .await;
        assert_eq!(shots, [true, true, false]);
        assert_eq!(faults.fired(FaultPoint::RelayAfterPublishBeforeMark), 2);
        assert_eq!(
            faults.fired(FaultPoint::ConsumerAfterHandlerCommitBeforeAck),
            0
        );
        let other = FaultPoints::new();
        faults.arm(FaultPoint::RelayAfterPublishBeforeMark, 1);
        assert!(
            !other
                .scope(async { hit(FaultPoint::RelayAfterPublishBeforeMark) })
                .await,
            "another set's scope does not see this set's points"
        );
    }
}
