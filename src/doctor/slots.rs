//! `Check::WalSlots`: the logical replication slots of this database, which the WAL outbox
//! reads. A slot whose relay is down keeps every WAL segment from its restart position: the
//! disk fills, or, with `max_slot_wal_keep_size`, the server invalidates the slot and the
//! messages in the WAL it dropped are lost.
//!
//! And what becomes of the slot at a failover, per version: 15 and 16 keep logical slots on
//! the primary only; 17 synchronizes *failover* slots to standbys configured for it
//! ([`FailoverSetup`] reads both sides); 18 can invalidate a slot nobody reads
//! (`idle_replication_slot_timeout`).

use super::format::*;
use super::replication::FailoverSetup;
use super::*;
use crate::WalSlot;

/// How the WAL relay marks the publication of the slot it reads (the comment written by its
/// first reader: `pgbox WAL outbox of schema <schema>`), which a standby has too: it names
/// the slots a standby should hold.
const SLOT_CLAIM_PREFIX: &str = "pgbox WAL outbox of schema ";

/// One logical slot of this database, as `pg_replication_slots` shows it.
struct SlotRow {
    name: String,
    plugin: String,
    active: bool,
    retained: i64,
    wal_status: String,
    has_publication: bool,
    temporary: bool,
    /// The row as JSON: the columns differ between majors.
    row: Value,
}

impl SlotRow {
    fn failover(&self) -> Option<bool> {
        self.row.get("failover").and_then(Value::as_bool)
    }

    fn synced(&self) -> Option<bool> {
        self.row.get("synced").and_then(Value::as_bool)
    }

    /// Why it was invalidated, `None` while usable.
    fn invalidation(&self) -> Option<String> {
        match self.row.get("invalidation_reason") {
            Some(Value::String(reason)) => Some(reason.clone()),
            Some(_) => None,
            None if self.row.get("conflicting") == Some(&Value::Bool(true)) => {
                Some("recovery_conflict".to_owned())
            }
            None if self.wal_status == "lost" => Some("wal_removed".to_owned()),
            None => None,
        }
    }
}

impl Doctor {
    pub(super) async fn check_wal_slots(&self, pool: &PgPool) -> Result<Vec<Finding>> {
        let mut tx = crate::pooler::begin(pool, None).await?;
        let setup = FailoverSetup::read(&mut tx).await?;
        // On a standby pg_current_wal_lsn() fails (recovery is in progress): its replay
        // position is where its slots stand against.
        let rows = sqlx::query(
            "SELECT s.slot_name::text, s.plugin::text, s.active, \
                    coalesce(pg_catalog.pg_wal_lsn_diff(CASE WHEN pg_catalog.pg_is_in_recovery() \
                        THEN pg_catalog.pg_last_wal_replay_lsn() \
                        ELSE pg_catalog.pg_current_wal_lsn() END, s.restart_lsn), 0)::int8, \
                    coalesce(s.wal_status, 'lost'), \
                    EXISTS (SELECT 1 FROM pg_catalog.pg_publication p WHERE p.pubname = s.slot_name), \
                    s.temporary, pg_catalog.to_jsonb(s) \
             FROM pg_catalog.pg_replication_slots s \
             WHERE s.slot_type = 'logical' AND s.database = pg_catalog.current_database() \
             ORDER BY 1",
        )
        .persistent(false)
        .fetch_all(&mut *tx)
        .await?
        .into_iter()
        .map(|r| {
            Ok(SlotRow {
                name: r.try_get(0)?,
                plugin: r.try_get(1)?,
                active: r.try_get(2)?,
                retained: r.try_get(3)?,
                wal_status: r.try_get(4)?,
                has_publication: r.try_get(5)?,
                temporary: r.try_get(6)?,
                row: r.try_get(7)?,
            })
        })
        .collect::<Result<Vec<_>>>()?;
        // The slots this schema's relay reads, by their publications (which a standby has,
        // whether or not it has the slot).
        // Also before the relay's first read has written that claim: a publication with no
        // tables (messages only) is what `WalSlot::create` makes, from the start.
        let claimed: Vec<String> = sqlx::query_scalar(
            "SELECT p.pubname::text FROM pg_catalog.pg_publication p \
             WHERE pg_catalog.obj_description(p.oid, 'pg_publication') = $1 \
                OR (NOT p.puballtables \
                    AND NOT EXISTS (SELECT 1 FROM pg_catalog.pg_publication_rel r \
                                    WHERE r.prpubid = p.oid) \
                    AND NOT EXISTS (SELECT 1 FROM pg_catalog.pg_publication_namespace n \
                                    WHERE n.pnpubid = p.oid)) \
             ORDER BY 1",
        )
        .persistent(false)
        .bind(format!("{SLOT_CLAIM_PREFIX}{}", self.schema.as_str()))
        .fetch_all(&mut *tx)
        .await?;
        let database: String = sqlx::query_scalar("SELECT pg_catalog.current_database()::text")
            .persistent(false)
            .fetch_one(&mut *tx)
            .await?;
        tx.commit().await?;

        // A failover slot's reads wait for the standbys synchronized_standby_slots names:
        // no peek while one of them cannot answer.
        let reads_wait = setup.synchronized_standby_slots.iter().any(|n| {
            !setup
                .physical_slots
                .iter()
                .any(|(p, active, status)| p == n && *active && status != "lost")
        });
        let mut findings = Vec::new();
        let mut fine = Vec::new();
        let mut oks = Vec::new();
        for slot in &rows {
            let name = &slot.name;
            let invalidation = slot.invalidation();
            // The oldest unpublished commit, read only from a slot nobody reads now (a peek
            // takes the slot for its duration): that is when it matters. Not on a standby
            // (a synchronized slot cannot be decoded there).
            let oldest_age = if !slot.active
                && !setup.in_recovery
                && slot.plugin == "pgoutput"
                && slot.has_publication
                && invalidation.is_none()
                && !(reads_wait && slot.failover() == Some(true))
            {
                oldest_commit_age(pool, name, self.statement_timeout)
                    .await
                    .ok()
                    .flatten()
            } else {
                None
            };
            let details = json!({
                "slot": name, "plugin": slot.plugin, "active": slot.active,
                "retained_bytes": slot.retained, "wal_status": slot.wal_status,
                "oldest_unpublished_commit_age_seconds": oldest_age,
                "invalidation_reason": invalidation,
                "failover": slot.failover(), "synced": slot.synced(),
                "temporary": slot.temporary,
            });
            let state = if slot.active {
                "read by a session"
            } else {
                "not read by anyone"
            };
            let age = oldest_age
                .map(|a| format!(", oldest unpublished commit {} old", human_duration(a)))
                .unwrap_or_default();
            if let Some(reason) = &invalidation {
                let why = match reason.as_str() {
                    "wal_removed" => "the WAL it needed was removed (it held more than \
                                      max_slot_wal_keep_size)"
                        .to_owned(),
                    "rows_removed" => "the primary removed catalog rows it needed (this \
                                       standby ran without hot_standby_feedback or without a \
                                       physical slot)"
                        .to_owned(),
                    "wal_level_insufficient" => {
                        "the primary's wal_level is no longer logical".to_owned()
                    }
                    "idle_timeout" => "no session read it for longer than \
                                       idle_replication_slot_timeout (the relay was down \
                                       that long)"
                        .to_owned(),
                    "recovery_conflict" => "a conflict with recovery on this standby".to_owned(),
                    other => format!("reason {other}"),
                };
                findings.push(
                    Finding::new(
                        Severity::Critical,
                        Code::WalSlotInvalidated,
                        format!(
                            "logical slot {name} was invalidated ({reason}): {why}; it never \
                             decodes again, and the WAL outbox messages it held are lost"
                        ),
                        format!(
                            "Drop and create it (`pgbox wal drop-slot --slot {name}`, then \
                             `create-slot`), and reconcile what producers committed since the \
                             relay last published (their business rows are there; the messages \
                             are not). Keep relays running, and bound what a slot may hold with \
                             max_slot_wal_keep_size rather than with a short \
                             idle_replication_slot_timeout."
                        ),
                    )
                    .subject(name.clone())
                    .details(details),
                );
                continue;
            }
            if slot.retained >= self.wal_slot_retained_warn
                || oldest_age.is_some_and(|a| a >= self.xmin_age_warn.as_secs_f64())
            {
                findings.push(
                    Finding::new(
                        Severity::Warning,
                        Code::WalSlotBehind,
                        format!(
                            "logical slot {name} ({state}) retains {} of WAL{age} \
                             (wal_status {})",
                            human_bytes(slot.retained),
                            slot.wal_status
                        ),
                        format!(
                            "Start (or fix) the WAL relay reading {name}: until it reads, the \
                             WAL is kept and the disk fills. A slot nobody will read again must \
                             be dropped (`pgbox wal drop-slot --slot {name}`). \
                             max_slot_wal_keep_size bounds what a slot keeps; past it the slot \
                             is invalidated and its messages are lost."
                        ),
                    )
                    .subject(name.clone())
                    .details(details.clone()),
                );
            } else {
                fine.push(format!("{name} ({}{age})", human_bytes(slot.retained)));
            }
            if !setup.in_recovery && setup.has_standbys() {
                if setup.major < WalSlot::FAILOVER_SLOTS_SINCE {
                    findings.push(lost_at_failover(&setup, name, false).details(details));
                } else if slot.failover() == Some(false) {
                    findings.push(
                        Finding::new(
                            Severity::Warning,
                            Code::WalSlotNotFailover,
                            format!(
                                "logical slot {name} has no failover: this slot is lost at \
                                 failover. {} standby(s) stream from this server ({}); a \
                                 promoted standby has no copy of it, and what producers \
                                 emitted after the relay's last confirmed position is never \
                                 published",
                                setup.standbys.len(),
                                standby_list(&setup)
                            ),
                            format!(
                                "{} Then set up the standbys for slot synchronization (the \
                                 doctor checks both sides).",
                                WalSlot::enable_failover_advice(name, &database)
                            ),
                        )
                        .subject(name.clone())
                        .details(details),
                    );
                }
            }
        }

        // A failover can only take the slot along if the servers are set up for it. On a
        // primary a slot's `synced` is what a promotion left: the slot is this server's own.
        let failover_slots: Vec<String> = rows
            .iter()
            .filter(|s| s.failover() == Some(true) && !s.temporary)
            .map(|s| s.name.clone())
            .collect();
        findings.extend(setup.primary_findings(&failover_slots));
        if setup.in_recovery {
            // The slots the primary's relay reads: their publications are here too.
            let mut names: Vec<String> = claimed.clone();
            for slot in &rows {
                if slot.has_publication && !names.contains(&slot.name) {
                    names.push(slot.name.clone());
                }
            }
            if !names.is_empty() {
                if setup.major < WalSlot::FAILOVER_SLOTS_SINCE {
                    for name in &names {
                        findings.push(
                            lost_at_failover(&setup, name, true)
                                .details(json!({ "slot": name, "major": setup.major })),
                        );
                    }
                } else {
                    let settings = setup.standby_settings_finding();
                    let syncing = settings.is_none();
                    findings.extend(settings);
                    for name in &names {
                        let slot = rows.iter().find(|s| &s.name == name);
                        match standby_slot_problem(slot, syncing) {
                            Some((problem, first)) => findings.push(
                                Finding::new(
                                    Severity::Warning,
                                    Code::WalSlotNotSynced,
                                    format!(
                                        "the WAL outbox's slot {name} {problem}: promoted now, \
                                         this standby would have no usable slot, and what \
                                         producers emitted after the relay's last confirmed \
                                         position would never be published"
                                    ),
                                    format!(
                                        "{first}On the primary, {name} must be a failover slot \
                                         (`pgbox doctor` there says so if it is not); here, \
                                         slot synchronization must run \
                                         (slot_sync_not_configured names what is missing). A \
                                         new synchronized slot stays temporary until the \
                                         primary's slot moves past the WAL this standby could \
                                         keep for it: let the relay read and confirm, or run \
                                         SELECT pg_sync_replication_slots() here, and check \
                                         again."
                                    ),
                                )
                                .subject(name.clone())
                                .details(json!({
                                    "slot": name, "problem": problem,
                                    "synced": slot.and_then(|s| s.synced()),
                                    "temporary": slot.map(|s| s.temporary),
                                })),
                            ),
                            None => oks.push(
                                Finding::new(
                                    Severity::Ok,
                                    Code::WalSlotFailoverReady,
                                    format!(
                                        "the WAL outbox's slot {name} is synchronized here \
                                         (synced, not temporary, not invalidated): promoted, \
                                         this standby's relay reads on from it"
                                    ),
                                    "Nothing to do. After a promotion, point the relay at \
                                     this server; it re-reads from the copy's position \
                                     (which may be a little behind the old primary's: the \
                                     consumers' inboxes absorb the copies)."
                                        .to_owned(),
                                )
                                .subject(name.clone())
                                .details(json!({ "slot": name })),
                            ),
                        }
                    }
                }
            }
        }
        if let Some(timeout) = setup.idle_slot_timeout_secs
            && timeout > 0
            && !rows.is_empty()
            && (timeout as u64) < self.wal_relay_outage_tolerance.as_secs()
        {
            findings.push(
                Finding::new(
                    Severity::Warning,
                    Code::IdleSlotTimeout,
                    format!(
                        "idle_replication_slot_timeout is {}: the server invalidates a slot no \
                         session has read for that long (at the next checkpoint). A WAL relay \
                         down longer loses its slot, and with it every message not yet \
                         published: below the {} relay outage this doctor is told to tolerate",
                        human_duration(timeout as f64),
                        human_duration(self.wal_relay_outage_tolerance.as_secs_f64())
                    ),
                    format!(
                        "Set it above the longest relay outage you would tolerate (ALTER SYSTEM \
                         SET idle_replication_slot_timeout = '{}'; SELECT pg_reload_conf()), or \
                         to 0 (off), and bound the WAL a slot keeps with max_slot_wal_keep_size \
                         instead. An invalidated slot is dropped and created again, and what it \
                         held is reconciled from the business rows. \
                         Doctor::wal_relay_outage_tolerance sets this bar.",
                        postgres_interval(self.wal_relay_outage_tolerance)
                    ),
                )
                .details(json!({
                    "idle_replication_slot_timeout_seconds": timeout,
                    "tolerated_outage_seconds": self.wal_relay_outage_tolerance.as_secs(),
                })),
            );
        }
        if findings.is_empty() {
            let message = if fine.is_empty() {
                "no logical replication slot in this database (the WAL outbox is not in use)"
                    .to_owned()
            } else {
                format!("logical slots within thresholds: {}", fine.join(", "))
            };
            findings.push(Finding::new(
                Severity::Ok,
                Code::WalSlotsOk,
                message,
                format!(
                    "Nothing to do. The doctor warns when a slot retains {} of WAL or more.",
                    human_bytes(self.wal_slot_retained_warn)
                ),
            ));
        }
        findings.extend(oks);
        Ok(findings)
    }
}

/// The standbys streaming from this server, for messages.
fn standby_list(setup: &FailoverSetup) -> String {
    if setup.standbys.is_empty() {
        return format!(
            "none streams now; physical slots: {}",
            setup
                .physical_slots
                .iter()
                .map(|(n, _, _)| n.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    setup
        .standbys
        .iter()
        .map(|(app, slot)| match slot {
            Some(slot) => format!("{app} through slot {slot}"),
            None => format!("{app} without a slot"),
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// 15 and 16: logical slots live on the primary only.
fn lost_at_failover(setup: &FailoverSetup, name: &str, on_standby: bool) -> Finding {
    let major = setup.major;
    let message = if on_standby {
        format!(
            "PostgreSQL {major} keeps logical slots on the primary only: this standby has no \
             copy of the WAL outbox's slot {name}; promoted, it has no slot, and what producers \
             emitted after the relay's last confirmed position is never published"
        )
    } else {
        format!(
            "PostgreSQL {major} keeps logical slots on the primary only: a failover to one of \
             this server's standbys ({}) loses slot {name}, and what producers emitted after \
             the relay's last confirmed position is never published",
            standby_list(setup)
        )
    };
    Finding::new(
        Severity::Warning,
        Code::WalSlotLostAtFailover,
        message,
        format!(
            "PostgreSQL 17 synchronizes failover slots to standbys (upgrade, then `pgbox wal \
             create-slot --slot {name}` makes one). Until then, after a failover: create the \
             slot on the new primary (`pgbox wal create-slot --slot {name}`) before producers \
             write there, and reconcile what they committed since the relay's last confirmed \
             position from the business rows (the messages are not in any slot)."
        ),
    )
    .subject(name.to_owned())
}

/// What keeps a standby's copy of `slot` from surviving a promotion as a current copy, `None`
/// if nothing, with the first thing to do about it (may be empty). `syncing`: slot
/// synchronization is configured and running here, as far as the doctor can tell.
fn standby_slot_problem(slot: Option<&SlotRow>, syncing: bool) -> Option<(String, String)> {
    let Some(slot) = slot else {
        return Some(("is not on this standby".to_owned(), String::new()));
    };
    if let Some(reason) = slot.invalidation() {
        return Some((format!("is invalidated here ({reason})"), String::new()));
    }
    if slot.synced() != Some(true) {
        return Some((
            "is a local slot of this standby, not a synchronized copy (created here, not by \
             slot synchronization, which refuses to replace it)"
                .to_owned(),
            format!(
                "Drop it here (SELECT pg_drop_replication_slot('{}'); while no session reads \
                 it): a slot of the primary's name on a standby blocks synchronization of the \
                 primary's slot, and promoted, it starts where it was created, not where the \
                 relay stopped. ",
                slot.name
            ),
        ));
    }
    if slot.temporary {
        return Some((
            "is still temporary here (synchronization has not made it persistent yet; a \
             promotion drops it)"
                .to_owned(),
            String::new(),
        ));
    }
    if !syncing {
        return Some((
            "is a synchronized copy, but slot synchronization is not known to run here \
             (slot_sync_not_configured says why): the copy may have stopped following the \
             primary's slot, and promoted, the relay would publish again everything since \
             it stopped"
                .to_owned(),
            String::new(),
        ));
    }
    None
}

/// Seconds since the commit of the first transaction `slot` holds, `None` if it holds none.
/// Bounded by `timeout`: a failover slot's read waits for the standbys
/// `synchronized_standby_slots` names.
async fn oldest_commit_age(pool: &PgPool, slot: &str, timeout: Duration) -> Result<Option<f64>> {
    let mut tx = crate::pooler::begin(pool, None).await?;
    let ms = timeout.as_millis().min(i32::MAX as u128);
    sqlx::raw_sql(AssertSqlSafe(format!("SET LOCAL statement_timeout = {ms}")))
        .execute(&mut *tx)
        .await?;
    let row = sqlx::query(
        "SELECT data FROM pg_catalog.pg_logical_slot_peek_binary_changes($1, NULL, 1, \
           'proto_version', '1', 'publication_names', $1, 'messages', 'true') LIMIT 1",
    )
    .persistent(false)
    .bind(slot)
    .fetch_optional(&mut *tx)
    .await?;
    tx.commit().await?;
    let Some(row) = row else { return Ok(None) };
    let data: Vec<u8> = row.try_get(0)?;
    Ok(crate::relay::wal::begin_commit_time(&data).map(|commit| {
        (OffsetDateTime::now_utc() - commit)
            .as_seconds_f64()
            .max(0.0)
    }))
}
