//! What waits: the notification queue, the time-partitioned inbox's partitions, leases,
//! dead letters, and the outbox's oldest unpublished message.

use super::format::*;
use super::*;

impl Doctor {
    pub(super) async fn check_notification_queue(
        &self,
        conn: &mut PgConnection,
    ) -> Result<Finding> {
        let usage: f64 = sqlx::query_scalar("SELECT pg_catalog.pg_notification_queue_usage()")
            .persistent(false)
            .fetch_one(&mut *conn)
            .await?;
        let severity = if usage >= self.notification_queue_critical {
            Severity::Critical
        } else if usage >= self.notification_queue_warn {
            Severity::Warning
        } else {
            Severity::Ok
        };
        let percent = usage * 100.0;
        let finding = if severity == Severity::Ok {
            Finding::new(
                severity,
                Code::NotificationQueueOk,
                format!("the notification queue is {percent:.1}% full"),
                "Nothing to do.".to_owned(),
            )
        } else {
            Finding::new(
                severity,
                Code::NotificationQueueFilling,
                format!(
                    "the notification queue is {percent:.1}% full: when it is full, every \
                     transaction that sends a NOTIFY (pgbox's wake-ups among them) fails at commit"
                ),
                "The queue is only freed up to the oldest notification some listening session \
                 has not read yet: a session that LISTENs and sits in a long transaction holds \
                 it (see the xmin_horizon findings, or pg_stat_activity for an old xact_start). \
                 End that transaction or session (pg_terminate_backend); the queue drains by \
                 itself afterwards."
                    .to_owned(),
            )
        };
        Ok(finding.details(json!({ "usage": usage })))
    }

    /// Partitions ahead of now, in a schema that uses the partitioned inbox (no finding
    /// otherwise).
    pub(super) async fn check_inbox_partitions(
        &self,
        conn: &mut PgConnection,
    ) -> Result<Option<Finding>> {
        let s = &self.schema;
        let row = sqlx::query(AssertSqlSafe(format!(
            "SELECT (SELECT ahead FROM {s}.inbox_partitioning), \
                    pg_catalog.count(*) FILTER (WHERE r_from > pg_catalog.now()), \
                    coalesce(pg_catalog.bool_or(pg_catalog.now() >= r_from AND pg_catalog.now() < r_to), false), \
                    pg_catalog.max(r_to) \
             FROM {s}.inbox_partitions()"
        )))
        .persistent(false)
        .fetch_one(&mut *conn)
        .await?;
        let Some(wanted): Option<i32> = row.try_get(0)? else {
            return Ok(None);
        };
        let ahead: i64 = row.try_get(1)?;
        let covers_now: bool = row.try_get(2)?;
        let until: Option<OffsetDateTime> = row.try_get(3)?;
        let until_text = until
            .and_then(|t| t.format(&Rfc3339).ok())
            .unwrap_or_else(|| "never".to_owned());
        let details = json!({ "ahead": ahead, "configured_ahead": wanted, "covers_now": covers_now, "until": until_text });
        let finding = if !covers_now {
            Finding::new(
                Severity::Critical,
                Code::InboxPartitionsRunningOut,
                format!("no partition of the partitioned inbox covers now (the last ends {until_text}): every claim fails"),
                "Create partitions now: `pgbox partitions create` (or InboxPartitions::create_ahead), \
                 then keep a Janitor running on some instance: it creates them ahead on every pass."
                    .to_owned(),
            )
        } else if ahead < 1 {
            Finding::new(
                Severity::Warning,
                Code::InboxPartitionsRunningOut,
                format!(
                    "the partitioned inbox has no partition after the current one (it ends {until_text})"
                ),
                "Run `pgbox partitions create`, and make sure a Janitor runs on some instance: \
                 when the current partition ends, every claim fails until the next exists."
                    .to_owned(),
            )
        } else {
            Finding::new(
                Severity::Ok,
                Code::InboxPartitionsOk,
                format!("{ahead} partition(s) ahead, until {until_text}"),
                "Nothing to do.".to_owned(),
            )
        };
        Ok(Some(finding.details(details)))
    }

    /// Lease mode's invariants, which V7 enforced with CHECK constraints and V11 moved here
    /// (the constraints cost every claim): only rows under a lease can break them, and the
    /// partial index `inbox_leases_idx` holds exactly those, so this reads only them.
    pub(super) async fn check_inbox_leases(&self, conn: &mut PgConnection) -> Result<Finding> {
        let s = &self.schema;
        let row = sqlx::query(AssertSqlSafe(format!(
            "SELECT pg_catalog.count(*), pg_catalog.min(consumer || ' / ' || key) FROM {s}.inbox \
             WHERE lease_expires_at IS NOT NULL \
               AND (lease_token IS NULL OR outcome IS NOT NULL OR rejection IS NOT NULL)"
        )))
        .persistent(false)
        .fetch_one(&mut *conn)
        .await?;
        let broken: i64 = row.try_get(0)?;
        let example: Option<String> = row.try_get(1)?;
        let finding = if broken == 0 {
            Finding::new(
                Severity::Ok,
                Code::InboxLeasesConsistent,
                "every key under a lease has its token and no outcome".to_owned(),
                "Nothing to do.".to_owned(),
            )
        } else {
            Finding::new(
                Severity::Critical,
                Code::InboxLeaseInconsistent,
                format!(
                    "{broken} key(s) under a lease lack a token or already have an outcome or a \
                     rejection (e.g. {})",
                    example.as_deref().unwrap_or("?")
                ),
                "Only pgbox's lease statements should write lease_token, lease_expires_at, \
                 outcome and rejection. Find what else wrote these rows; a key stays in progress \
                 until its lease expires and is taken over."
                    .to_owned(),
            )
            .subject("inbox")
        };
        Ok(finding.details(json!({ "inconsistent": broken })))
    }

    pub(super) async fn check_dead_letters(
        &self,
        conn: &mut PgConnection,
        tables: &[&'static str],
    ) -> Result<Vec<Finding>> {
        let s = &self.schema;
        let schema = s.as_str();
        let mut findings = Vec::new();
        let mut checked = Vec::new();
        for (table, code, what, flag) in [
            (
                "outbox_dead_letters",
                Code::OutboxDeadLetters,
                "outbox dead letters (messages the relay gave up publishing)",
                "",
            ),
            (
                "queue_dead_letters",
                Code::QueueDeadLetters,
                "dead letters in the built-in queue (messages consumers gave up on)",
                " --queue",
            ),
        ] {
            if !tables.contains(&table) {
                continue;
            }
            checked.push(table);
            let row = sqlx::query(AssertSqlSafe(format!(
                "SELECT (SELECT pg_catalog.count(*) FROM (SELECT 1 FROM {s}.{table} LIMIT $1) d)::int8, \
                        (SELECT extract(epoch FROM pg_catalog.clock_timestamp() - dead_at)::float8 \
                           FROM {s}.{table} ORDER BY seq LIMIT 1), \
                        (SELECT topic FROM {s}.{table} ORDER BY seq LIMIT 1)"
            )))
            .persistent(false)
            .bind(DEAD_LETTER_COUNT_CAP)
            .fetch_one(&mut *conn)
            .await?;
            let n: i64 = row.try_get(0)?;
            if n == 0 {
                continue;
            }
            let first_age: Option<f64> = row.try_get(1)?;
            let first_topic: Option<String> = row.try_get(2)?;
            let count = if n >= DEAD_LETTER_COUNT_CAP {
                format!("{}+", group_digits(n))
            } else {
                group_digits(n)
            };
            findings.push(
                Finding::new(
                    Severity::Warning,
                    code,
                    format!(
                        "{count} {what} are waiting; the earliest enqueued (topic \"{}\") died {} \
                         ago. Each holds back the later messages of its ordering key",
                        first_topic.as_deref().unwrap_or("?"),
                        first_age.map_or_else(|| "?".to_owned(), human_duration),
                    ),
                    format!(
                        "Look at them with `pgbox dead-letters{flag} list --schema {schema}` \
                         (and `show ID`), fix the cause (the last_error column), then \
                         `pgbox dead-letters{flag} replay ID…` (or `replay --all`) to send them \
                         again in their original order, or `discard ID…` to drop them for good."
                    ),
                )
                .subject(table)
                .details(
                    json!({ "table": table, "count": n, "capped": n >= DEAD_LETTER_COUNT_CAP }),
                ),
            );
        }
        if findings.is_empty() {
            findings.push(
                Finding::new(
                    Severity::Ok,
                    Code::NoDeadLetters,
                    format!("no dead letters in {}", checked.join(" or ")),
                    "Nothing to do.".to_owned(),
                )
                .details(json!({ "tables": checked })),
            );
        }
        Ok(findings)
    }

    /// The oldest unpublished message of the table outbox, when it is older than
    /// `outbox_age_warn`. Reads the head of `outbox_pending_idx` (and counts the pending
    /// messages up to [`DEAD_LETTER_COUNT_CAP`]), never the whole table.
    pub(super) async fn check_outbox_backlog(
        &self,
        conn: &mut PgConnection,
    ) -> Result<Option<Finding>> {
        let s = &self.schema;
        let row = sqlx::query(AssertSqlSafe(format!(
            "SELECT extract(epoch FROM pg_catalog.clock_timestamp() - o.created_at)::float8, \
                    o.topic, o.ordering_key, o.attempts, o.last_error, \
                    (SELECT pg_catalog.count(*) FROM (SELECT 1 FROM {s}.outbox \
                       WHERE published_at IS NULL LIMIT $1) p)::int8 \
             FROM {s}.outbox AS o WHERE o.published_at IS NULL ORDER BY o.seq LIMIT 1"
        )))
        .persistent(false)
        .bind(DEAD_LETTER_COUNT_CAP)
        .fetch_optional(&mut *conn)
        .await?;
        let Some(row) = row else {
            return Ok(None);
        };
        let age: f64 = row.try_get(0)?;
        let critical = age >= self.outbox_age_critical.as_secs_f64();
        if !critical && age < self.outbox_age_warn.as_secs_f64() {
            return Ok(None);
        }
        let topic: String = row.try_get(1)?;
        let ordering_key: Option<String> = row.try_get(2)?;
        let attempts: i32 = row.try_get(3)?;
        let last_error: Option<String> = row.try_get(4)?;
        let pending: i64 = row.try_get(5)?;
        let count = if pending >= DEAD_LETTER_COUNT_CAP {
            format!("{}+", group_digits(pending))
        } else {
            group_digits(pending)
        };
        let why = match (&last_error, attempts) {
            (Some(error), n) if n > 0 => format!(
                "the transport refused it {n} time(s) (last error: {error}); it is retried with \
                 backoff and dead-lettered after the relay's max_attempts"
            ),
            _ => "it was never refused: no relay publishes this topic, or the relay's transport \
                  is unavailable"
                .to_owned(),
        };
        let schema = s.as_str();
        Ok(Some(
            Finding::new(
                if critical {
                    Severity::Critical
                } else {
                    Severity::Warning
                },
                Code::OutboxStalled,
                format!(
                    "the oldest unpublished outbox message (topic \"{topic}\") was enqueued {} \
                     ago, and {count} message(s) wait: {why}",
                    human_duration(age)
                ),
                format!(
                    "Check that a relay runs for schema {schema}. A transport outage counts no \
                     attempt and dead-letters nothing: the messages wait here while the relay \
                     logs `pgbox relay: transport unavailable` once per round and sets \
                     pgbox_relay_transport_unavailable{{topic}} to 1; bring the broker back (or \
                     the relay's route to it) and they flow. A message of an ordering key with \
                     a dead letter waits behind it: see the dead_letters findings."
                ),
            )
            .subject(topic.clone())
            .details(json!({
                "age_seconds": age,
                "topic": topic,
                "ordering_key": ordering_key,
                "attempts": attempts,
                "last_error": last_error,
                "pending": pending,
                "capped": pending >= DEAD_LETTER_COUNT_CAP,
            })),
        ))
    }
}
