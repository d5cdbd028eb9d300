//! Batches: several first deliveries through the inbox in one transaction, with a fallback to
//! one transaction per message when anything in the batch fails.

use std::fmt;
use std::panic::AssertUnwindSafe;
use std::time::Duration;

use futures_util::FutureExt;
use sqlx::{Postgres, Transaction};
use tracing::Instrument;

use super::{
    Consumer, Failure, Handled, LIMITED, RunMetrics, Settled, database_away, handle_span, limits,
    panic_message,
};
use crate::error::{Error, Result};
use crate::inbox::{HandlerConnection, Key, Outcome, Verdict};
use crate::outbox::Envelope;
use crate::outbox::trace::{TRACEPARENT, with_incoming};
use crate::transport::Subscriber;

/// How one message of a batch went, before the batch commits.
enum Step {
    /// Processed, rejected or found a duplicate on the batch's transaction: acked once the
    /// batch has committed.
    Done(Settled),
    /// Held by another transaction or a lease: sent back whatever the batch does.
    InProgress,
    /// Waited its share of the visibility timeout for a limit (or its bucket's wait is
    /// long): sent back, uncounted, whatever the batch does, not to come back before this.
    Limited(Duration),
}

/// Why a batch stopped before its commit.
enum Stop {
    /// The handler failed or panicked on this message: it is settled as it would be alone.
    Message(String, bool),
    /// pgbox's own statement failed (the claim, the record, the batch's connection).
    Database(Error),
}

impl<S: Subscriber> Consumer<S> {
    /// Settles a unit from the receive loop: one delivery alone, or a batch.
    pub(super) async fn handle_unit<F, E>(
        &self,
        unit: Vec<S::Delivery>,
        handler: F,
        metrics: &RunMetrics,
    ) -> Handled<'_>
    where
        F: AsyncFnOnce(&Envelope, &mut HandlerConnection<'_>) -> Result<Verdict<()>, E> + Clone,
        E: From<Error> + fmt::Display,
    {
        for delivery in &unit {
            metrics.received(
                self.source.envelope(delivery),
                self.source.attempt(delivery),
            );
        }
        let mut handled = Handled {
            settled: Vec::with_capacity(unit.len()),
            acks: Vec::new(),
        };
        // Redeliveries keep the one-message path: its duplicate check needs no transaction.
        let (first, again): (Vec<_>, Vec<_>) =
            unit.into_iter().partition(|d| self.source.attempt(d) <= 1);
        let alone = if first.len() > 1 {
            self.handle_batch(first, handler.clone(), metrics, &mut handled)
                .await
        } else {
            first
        };
        for delivery in alone.into_iter().chain(again) {
            let (settled, ack) = self.handle(delivery, handler.clone(), metrics).await;
            handled.settled.push(settled);
            handled.acks.extend(ack);
        }
        handled
    }

    /// Runs `batch` on one transaction and settles what it can; returns the deliveries to
    /// run again one per transaction (the batch was rolled back, or its commit failed).
    async fn handle_batch<'a, F, E>(
        &'a self,
        batch: Vec<S::Delivery>,
        handler: F,
        metrics: &RunMetrics,
        handled: &mut Handled<'a>,
    ) -> Vec<S::Delivery>
    where
        F: AsyncFnOnce(&Envelope, &mut HandlerConnection<'_>) -> Result<Verdict<()>, E> + Clone,
        E: From<Error> + fmt::Display,
    {
        let span = tracing::info_span!(
            "pgbox.consumer.batch",
            topic = %self.topic,
            messages = batch.len(),
        );
        let settled = &mut handled.settled;
        let mut tx = match crate::pooler::begin(&self.pool, None)
            .instrument(span.clone())
            .await
        {
            Ok(tx) => tx,
            Err(e) => {
                for delivery in &batch {
                    settled.push(self.retry_while_away(delivery, &e).await);
                }
                return Vec::new();
            }
        };
        let mut done: Vec<(S::Delivery, Settled)> = Vec::with_capacity(batch.len());
        let mut in_progress = Vec::new();
        let mut limited = Vec::new();
        let mut rest = batch.into_iter();
        let mut stopped = None;
        // The batch's slots: its messages of one prefix share one.
        let mut held = limits::Held::new();
        let deadline = self.limit_deadline();
        for delivery in rest.by_ref() {
            let step = self
                .batch_step(
                    &mut tx,
                    &delivery,
                    handler.clone(),
                    metrics,
                    (&mut held, deadline),
                )
                .instrument(span.clone())
                .await;
            match step {
                Ok(Step::Done(kind)) => done.push((delivery, kind)),
                Ok(Step::InProgress) => in_progress.push(delivery),
                Ok(Step::Limited(delay)) => limited.push((delivery, delay)),
                Err(stop) => {
                    stopped = Some((delivery, stop));
                    break;
                }
            }
        }
        for delivery in &in_progress {
            metrics.in_progress.increment(1);
            settled.push(
                self.retry_not_attempted(delivery, "in progress elsewhere", Duration::ZERO)
                    .await,
            );
        }
        for (delivery, delay) in &limited {
            settled.push(self.retry_not_attempted(delivery, LIMITED, *delay).await);
        }
        let Some((failed, stop)) = stopped else {
            return self.commit_batch(tx, done, handled).instrument(span).await;
        };
        let rest: Vec<S::Delivery> = rest.collect();
        // Nothing of the batch may commit: the handler's error left the transaction aborted.
        if let Err(e) = tx.rollback().await {
            tracing::warn!(parent: &span, error = %e, "pgbox rollback failed");
        }
        metrics.batch_rollbacks.increment(1);
        let mut again: Vec<S::Delivery> = done.into_iter().map(|(d, _)| d).collect();
        match stop {
            Stop::Message(error, panicked) => {
                tracing::warn!(parent: &span, message_id = %self.source.envelope(&failed).id, again = again.len() + rest.len(), "pgbox batch rolled back for one message; the others run again one per transaction");
                settled.push(if panicked {
                    self.panicked(&failed, error).await
                } else {
                    metrics.handler_errors.increment(1);
                    self.retry(&failed, &error).await
                });
            }
            Stop::Database(e) if database_away(&e) => {
                metrics.handler_errors.increment(1);
                for delivery in again.iter().chain([&failed]).chain(&rest) {
                    settled.push(self.retry_while_away(delivery, &e).await);
                }
                return Vec::new();
            }
            // A deadlock between batches, a serialization failure, a transaction ended in
            // the handler: each message finds out alone what it was.
            Stop::Database(e) => {
                tracing::warn!(parent: &span, error = %e, "pgbox batch rolled back; its messages run again one per transaction");
                again.push(failed);
            }
        }
        again.extend(rest);
        again
    }

    /// One message of a batch, on the batch's transaction.
    async fn batch_step<F, E>(
        &self,
        tx: &mut Transaction<'static, Postgres>,
        delivery: &S::Delivery,
        handler: F,
        metrics: &RunMetrics,
        (held, deadline): (&mut limits::Held, std::time::Instant),
    ) -> std::result::Result<Step, Stop>
    where
        F: AsyncFnOnce(&Envelope, &mut HandlerConnection<'_>) -> Result<Verdict<()>, E>,
        E: From<Error> + fmt::Display,
    {
        let envelope = self.source.envelope(delivery);
        let key = match self.key_of(envelope) {
            Ok(key) => key,
            Err(message) => return Err(Stop::Message(format!("key function: {message}"), true)),
        };
        if !self.limits.is_empty() {
            let prefixes = self.limits.prefixes(envelope, &key).map_err(|message| {
                Stop::Message(format!("limit prefix function: {message}"), true)
            })?;
            // A token on the pool (the batch's transaction holds no bucket row), then the
            // slots on the batch's transaction. A failed try-lock leaves it usable.
            let waits = &metrics.limit_waits;
            if self.limits.has_rates()
                && let limits::Waited::HandBack(delay) = self
                    .limits
                    .take_tokens(&self.pool, &prefixes, deadline, waits)
                    .await
                    .map_err(Stop::Database)?
            {
                return Ok(Step::Limited(delay));
            }
            if self.limits.has_slots()
                && let limits::Waited::HandBack(delay) = self
                    .limits
                    .take_slots(tx, &prefixes, held, deadline, waits)
                    .await
                    .map_err(Stop::Database)?
            {
                return Ok(Step::Limited(delay));
            }
        }
        let span = handle_span(envelope, self.source.attempt(delivery), "batch");
        let key = Key::new(key.as_str()).with_message_id(envelope.id.to_string());
        let incoming = envelope.headers.get(TRACEPARENT).cloned();
        let process = with_incoming(
            incoming,
            self.inbox
                .process_or_reject(tx, key, async |conn: &mut HandlerConnection<'_>| {
                    let _timer = metrics.time_handler();
                    handler(envelope, conn).await.map_err(Failure::Handler)
                }),
        );
        // A panic aborted the transaction before unwinding (see `run_handler`).
        match AssertUnwindSafe(process.instrument(span))
            .catch_unwind()
            .await
        {
            Ok(Ok(Outcome::Processed(()))) => Ok(Step::Done(Settled::Processed)),
            Ok(Ok(Outcome::Duplicate(_))) => Ok(Step::Done(Settled::Duplicate)),
            Ok(Ok(Outcome::Rejected(_))) => Ok(Step::Done(Settled::Rejected)),
            Ok(Ok(Outcome::InProgress)) => Ok(Step::InProgress),
            Ok(Err(Failure::Handler(e))) => Err(Stop::Message(e.to_string(), false)),
            Ok(Err(Failure::Database(e))) => Err(Stop::Database(e)),
            Ok(Err(Failure::Limited(delay))) => Ok(Step::Limited(delay)),
            Err(panic) => Err(Stop::Message(panic_message(panic.as_ref()), true)),
        }
    }

    /// Commits a batch that ran to its end and hands back the acks of what it settled;
    /// returns what must run again (the commit certainly failed).
    async fn commit_batch<'a>(
        &'a self,
        tx: Transaction<'static, Postgres>,
        done: Vec<(S::Delivery, Settled)>,
        handled: &mut Handled<'a>,
    ) -> Vec<S::Delivery> {
        let settled = &mut handled.settled;
        let wrote = done
            .iter()
            .any(|(_, s)| matches!(s, Settled::Processed | Settled::Rejected));
        let ended = if wrote {
            tx.commit()
                .instrument(tracing::debug_span!("pgbox.inbox.commit"))
                .await
        } else {
            // Nothing was written (duplicates only): no commit record, and nothing to lose.
            if let Err(e) = tx.rollback().await {
                tracing::debug!(error = %e, "pgbox rollback failed");
            }
            Ok(())
        };
        match ended.map_err(Error::from) {
            Ok(()) => {
                tracing::debug!(messages = done.len(), "pgbox batch committed");
                {
                    let mut away = self.away.lock().expect("away tally");
                    for (delivery, _) in &done {
                        away.forget(&self.source.envelope(delivery).id);
                    }
                }
                // The receive loop runs the acks side by side: a transport that groups acks
                // (the built-in queue) settles the batch in one or two statements instead of
                // one round trip per message.
                let span = tracing::Span::current();
                for (delivery, kind) in done {
                    settled.push(kind);
                    handled.acks.push(self.ack_later(delivery, span.clone()));
                }
                Vec::new()
            }
            // The commit may have happened: the redeliveries will tell.
            Err(e) if database_away(&e) => {
                for (delivery, _) in &done {
                    settled.push(self.retry_while_away(delivery, &e).await);
                }
                Vec::new()
            }
            Err(e) => {
                tracing::warn!(error = %e, "pgbox batch commit failed; its messages run again one per transaction");
                done.into_iter().map(|(d, _)| d).collect()
            }
        }
    }
}
