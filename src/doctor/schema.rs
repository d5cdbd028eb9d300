//! The migrations and the tables and indexes they create: what `Check::Migrations` and
//! `Check::Indexes` compare the schema against.

use super::*;

impl Doctor {
    pub(super) async fn check_migrations(
        &self,
        conn: &mut PgConnection,
    ) -> Result<(Vec<Finding>, BTreeSet<i32>)> {
        let s = &self.schema;
        let rows = sqlx::query(AssertSqlSafe(format!(
            "SELECT version, name, checksum FROM {s}.\"{HISTORY_TABLE}\" ORDER BY version"
        )))
        .persistent(false)
        .fetch_all(&mut *conn)
        .await?;
        let mut applied = BTreeMap::new();
        for row in rows {
            let version: i32 = row.try_get(0)?;
            let name: Option<String> = row.try_get(1)?;
            let checksum: Option<String> = row.try_get(2)?;
            applied.insert(
                version,
                (name.unwrap_or_default(), checksum.unwrap_or_default()),
            );
        }
        let mut embedded: Vec<(i32, String, u64)> = embedded::migrations::runner()
            .get_migrations()
            .iter()
            .map(|m| (m.version(), m.name().to_owned(), m.checksum()))
            .collect();
        embedded.sort_by_key(|m| m.0);
        let versions: BTreeSet<i32> = applied.keys().copied().collect();
        let newest_applied = versions.last().copied().unwrap_or(0);
        let newest_known = embedded.last().map_or(0, |m| m.0);
        let label = |v: i32, name: &str| format!("V{v}__{name}");
        let schema = s.as_str();

        let mut findings = Vec::new();
        let mut diverged = Vec::new();
        let mut pending = Vec::new();
        for (version, name, checksum) in &embedded {
            match applied.get(version) {
                Some((applied_name, applied_checksum)) => {
                    if applied_name != name || *applied_checksum != checksum.to_string() {
                        diverged.push(format!(
                            "{} was applied as {} with checksum {}, this build has checksum {}",
                            label(*version, name),
                            label(*version, applied_name),
                            if applied_checksum.is_empty() {
                                "(none)"
                            } else {
                                applied_checksum
                            },
                            checksum
                        ));
                    }
                }
                None if *version < newest_applied => diverged.push(format!(
                    "{} was never applied, yet V{newest_applied} was",
                    label(*version, name)
                )),
                None => pending.push(label(*version, name)),
            }
        }
        let unknown: Vec<i32> = versions
            .iter()
            .copied()
            .filter(|v| !embedded.iter().any(|m| m.0 == *v))
            .collect();
        let (newer, missing_here): (Vec<i32>, Vec<i32>) =
            unknown.iter().partition(|v| **v > newest_known);
        for v in &missing_here {
            diverged.push(format!(
                "V{v}__{} is applied but this build has no V{v}",
                applied[v].0
            ));
        }

        if !diverged.is_empty() {
            findings.push(
                Finding::new(
                    Severity::Critical,
                    Code::MigrationDiverged,
                    format!(
                        "the migration history of schema {s} differs from this build's \
                         migrations: {}",
                        diverged.join("; ")
                    ),
                    "`pgbox migrate` and `pgbox::migrate` of this build refuse this schema, so \
                     services that migrate at start-up fail to start. Find out which pgbox \
                     release built the schema (its history is in the pgbox_migrations table) \
                     and run that release, or restore the migration files this build was \
                     changed from; never edit an applied migration."
                        .to_owned(),
                )
                .details(json!({ "problems": diverged })),
            );
        }
        if !pending.is_empty() {
            findings.push(
                Finding::new(
                    Severity::Critical,
                    Code::MigrationsPending,
                    format!(
                        "{} migration(s) of this build are not applied to schema {s} \
                         (newest applied: V{newest_applied}): {}",
                        pending.len(),
                        pending.join(", ")
                    ),
                    format!(
                        "Run `pgbox migrate --schema {schema}` with this build (or deploy a \
                         service that calls `pgbox::migrate` at start-up): code of this pgbox \
                         version uses what those migrations create. If your services run an \
                         older pgbox than this binary, run the doctor of their version instead."
                    ),
                )
                .subject(pending[0].clone())
                .details(json!({ "pending": pending, "newest_applied": newest_applied })),
            );
        }
        if !newer.is_empty() {
            let list: Vec<String> = newer.iter().map(|v| label(*v, &applied[v].0)).collect();
            findings.push(
                Finding::new(
                    Severity::Warning,
                    Code::SchemaNewerThanBinary,
                    format!(
                        "schema {s} has {} migration(s) newer than this build knows \
                         (this build's newest is V{newest_known}): {}",
                        list.len(),
                        list.join(", ")
                    ),
                    "This binary is older than the schema: upgrade it to the pgbox release of \
                     your newest service. Do not run `pgbox migrate` or start services that \
                     call `pgbox::migrate` with this build: its migrator refuses a history \
                     with migrations it does not have. The other checks still apply."
                        .to_owned(),
                )
                .subject(list[0].clone())
                .details(json!({ "newer": list, "newest_known": newest_known })),
            );
        }
        if findings.is_empty() {
            findings.push(
                Finding::new(
                    Severity::Ok,
                    Code::MigrationsCurrent,
                    format!(
                        "all {} migrations of this build are applied to schema {s} (newest \
                         V{newest_applied}, checksums match)",
                        embedded.len()
                    ),
                    "Nothing to do.".to_owned(),
                )
                .details(json!({ "applied": versions.len(), "newest": newest_applied })),
            );
        }
        Ok((findings, versions))
    }

    pub(super) async fn check_indexes(
        &self,
        conn: &mut PgConnection,
        versions: &BTreeSet<i32>,
    ) -> Result<(Vec<Finding>, Vec<&'static str>)> {
        let s = &self.schema;
        let present_tables: BTreeSet<String> = sqlx::query_scalar(
            "SELECT c.relname::text FROM pg_catalog.pg_class c \
             JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace \
             WHERE n.nspname = $1 AND c.relkind IN ('r', 'p')",
        )
        .persistent(false)
        .bind(s.as_str())
        .fetch_all(&mut *conn)
        .await?
        .into_iter()
        .collect();
        let rows = sqlx::query(
            "SELECT ic.relname::text, t.relname::text, i.indisvalid, i.indisready \
             FROM pg_catalog.pg_index i \
             JOIN pg_catalog.pg_class ic ON ic.oid = i.indexrelid \
             JOIN pg_catalog.pg_class t ON t.oid = i.indrelid \
             JOIN pg_catalog.pg_namespace n ON n.oid = t.relnamespace \
             WHERE n.nspname = $1",
        )
        .persistent(false)
        .bind(s.as_str())
        .fetch_all(&mut *conn)
        .await?;
        // (index, table) -> (valid, ready)
        let mut present = BTreeMap::new();
        for row in rows {
            let index: String = row.try_get(0)?;
            let table: String = row.try_get(1)?;
            present.insert((index, table), (row.try_get(2)?, row.try_get(3)?));
        }

        let mut findings = Vec::new();
        let mut tables = Vec::new();
        for t in TABLES.iter().filter(|t| versions.contains(&t.since)) {
            if present_tables.contains(t.name) {
                tables.push(t.name);
                continue;
            }
            findings.push(
                Finding::new(
                    Severity::Critical,
                    Code::MissingTable,
                    format!(
                        "table {s}.{} is missing (created by migration V{}; its history says \
                         it is applied)",
                        t.name, t.since
                    ),
                    format!(
                        "The schema was changed outside pgbox's migrations. Restore the table \
                         from a backup, or recreate it with the statements of migration V{} and \
                         later ones (`pgbox migrate --print-sql --schema {}` shows them); \
                         `pgbox migrate` will not, as its history says it is applied.",
                        t.since,
                        s.as_str()
                    ),
                )
                .subject(t.name)
                .details(json!({ "table": t.name, "since": t.since })),
            );
        }

        let mut expected_count = 0;
        let mut expected_names = BTreeSet::new();
        for ix in INDEXES.iter().filter(|ix| ix.expected(versions)) {
            expected_names.insert(ix.name);
            if !tables.contains(&ix.table) {
                continue; // reported as a missing table
            }
            expected_count += 1;
            match present.get(&(ix.name.to_owned(), ix.table.to_owned())) {
                None => findings.push(
                    Finding::new(
                        Severity::Critical,
                        Code::MissingIndex,
                        format!(
                            "index {s}.{} on table {} is missing (created by migration V{}; \
                             it serves {}): those queries now scan the table",
                            ix.name, ix.table, ix.since, ix.serves
                        ),
                        ix.recreate_advice(s),
                    )
                    .subject(ix.name)
                    .details(json!({ "index": ix.name, "table": ix.table, "since": ix.since })),
                ),
                Some((valid, ready)) if !valid || !ready => findings.push(
                    Finding::new(
                        Severity::Critical,
                        Code::InvalidIndex,
                        invalid_message(s, ix.name, ix.table, *ready, Some(ix.serves)),
                        format!(
                            "Rebuild it without blocking writes: `REINDEX INDEX CONCURRENTLY \
                             {s}.{};`. A failed CREATE INDEX CONCURRENTLY or REINDEX \
                             CONCURRENTLY typically leaves such an index behind; if the rebuild \
                             fails too, its error says why (a unique index fails on duplicate \
                             rows).",
                            ix.name
                        ),
                    )
                    .subject(ix.name)
                    .details(json!({
                        "index": ix.name, "table": ix.table,
                        "indisvalid": valid, "indisready": ready,
                    })),
                ),
                Some(_) => {}
            }
        }
        // Other invalid indexes on pgbox's tables (leftovers such as `<name>_ccnew`) cost
        // every write and serve no read.
        for ((index, table), (valid, ready)) in &present {
            if (*valid && *ready)
                || expected_names.contains(index.as_str())
                || !tables.contains(&table.as_str())
            {
                continue;
            }
            findings.push(
                Finding::new(
                    Severity::Warning,
                    Code::InvalidIndex,
                    invalid_message(s, index, table, *ready, None),
                    format!(
                        "It is not one of pgbox's indexes: probably a leftover of a failed \
                         CREATE INDEX CONCURRENTLY or REINDEX CONCURRENTLY. If nobody is \
                         building it right now, drop it: `DROP INDEX CONCURRENTLY \
                         {s}.\"{index}\";`"
                    ),
                )
                .subject(index.clone())
                .details(json!({
                    "index": index, "table": table, "indisvalid": valid, "indisready": ready,
                })),
            );
        }
        if findings.is_empty() {
            findings.push(
                Finding::new(
                    Severity::Ok,
                    Code::IndexesValid,
                    format!(
                        "all {} tables and {expected_count} indexes the applied migrations \
                         create are present, valid and ready",
                        tables.len()
                    ),
                    "Nothing to do.".to_owned(),
                )
                .details(json!({ "tables": tables.len(), "indexes": expected_count })),
            );
        }
        Ok((findings, tables))
    }
}

pub(super) fn invalid_message(
    s: &Identifier,
    index: &str,
    table: &str,
    ready: bool,
    serves: Option<&str>,
) -> String {
    let state = if ready {
        "invalid (indisvalid = false): it is maintained on every write but never used to read"
    } else {
        "not ready (indisready = false): it is neither maintained nor used"
    };
    match serves {
        Some(serves) => format!(
            "index {s}.{index} on table {table} is {state}; it serves {serves}, so those \
             queries scan the table"
        ),
        None => format!("index {s}.\"{index}\" on table {table} is {state}"),
    }
}

/// A table pgbox's migrations create, from the version that creates it.
pub(super) struct ExpectedTable {
    name: &'static str,
    since: i32,
}

#[rustfmt::skip]
pub(super) const TABLES: &[ExpectedTable] = &[
    ExpectedTable { name: "inbox", since: 1 },
    ExpectedTable { name: "sequence_watermarks", since: 2 },
    ExpectedTable { name: "outbox", since: 3 },
    ExpectedTable { name: "outbox_dead_letters", since: 3 },
    ExpectedTable { name: "queue", since: 3 },
    ExpectedTable { name: "queue_dead_letters", since: 3 },
    ExpectedTable { name: "outbox_scheduled", since: 16 },
];

#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum IndexKind {
    PrimaryKey,
    Unique,
    Plain,
    /// A unique index that backs no constraint (a partial one cannot).
    UniqueIndex,
}

/// An index pgbox's migrations create: expected once migration `since` is applied, until
/// migration `dropped_in` (which drops or replaces it) is.
pub(super) struct ExpectedIndex {
    table: &'static str,
    name: &'static str,
    since: i32,
    dropped_in: Option<i32>,
    kind: IndexKind,
    /// Columns and predicate, as in the migration.
    definition: &'static str,
    /// What reads it (for the message).
    serves: &'static str,
}

impl ExpectedIndex {
    fn expected(&self, applied: &BTreeSet<i32>) -> bool {
        applied.contains(&self.since) && self.dropped_in.is_none_or(|v| !applied.contains(&v))
    }

    fn recreate_advice(&self, s: &Identifier) -> String {
        let (name, table) = (self.name, self.table);
        let def = self.definition;
        match self.kind {
            IndexKind::Plain => format!(
                "Recreate it without blocking writes: `CREATE INDEX CONCURRENTLY {name} ON \
                 {s}.{table} {def};`."
            ),
            IndexKind::UniqueIndex => format!(
                "Recreate it without blocking writes: `CREATE UNIQUE INDEX CONCURRENTLY {name} \
                 ON {s}.{table} {def};` (if it fails on duplicate rows, remove those first)."
            ),
            IndexKind::PrimaryKey | IndexKind::Unique => {
                let constraint = if self.kind == IndexKind::PrimaryKey {
                    "PRIMARY KEY"
                } else {
                    "UNIQUE"
                };
                format!(
                    "Recreate the index without blocking writes, then the constraint on it: \
                     `CREATE UNIQUE INDEX CONCURRENTLY {name} ON {s}.{table} {def};` then \
                     `ALTER TABLE {s}.{table} ADD CONSTRAINT {name} {constraint} USING INDEX \
                     {name};` (if the index fails on duplicate rows, remove those first)."
                )
            }
        }
    }
}

pub(super) const fn index(
    table: &'static str,
    name: &'static str,
    since: i32,
    kind: IndexKind,
    definition: &'static str,
    serves: &'static str,
) -> ExpectedIndex {
    ExpectedIndex {
        table,
        name,
        since,
        dropped_in: None,
        kind,
        definition,
        serves,
    }
}

pub(super) const fn until(mut ix: ExpectedIndex, dropped_in: i32) -> ExpectedIndex {
    ix.dropped_in = Some(dropped_in);
    ix
}

use IndexKind::{Plain, PrimaryKey, Unique, UniqueIndex};

/// Every index of migrations/V1..V16. A new migration that creates or drops an index adds a
/// line here (the unit test below fails until it does).
#[rustfmt::skip]
pub(super) const INDEXES: &[ExpectedIndex] = &[
    // V1
    index("inbox", "inbox_pkey", 1, PrimaryKey, "(consumer, key)",
        "the inbox's dedup: every claim"),
    until(index("inbox", "inbox_processed_at_idx", 1, Plain, "(processed_at)",
        "retention purges by age"), 4),
    // V2
    index("sequence_watermarks", "sequence_watermarks_pkey", 2, PrimaryKey,
        "(consumer, entity)", "in-order processing's watermark per entity"),
    // V3
    index("outbox", "outbox_pkey", 3, PrimaryKey, "(seq)", "the relay's claims by seq"),
    index("outbox", "outbox_message_id_key", 3, Unique, "(message_id)",
        "message ids' uniqueness"),
    until(index("outbox", "outbox_key_idx", 3, Plain,
        "(topic, ordering_key, seq) WHERE published_at IS NULL",
        "the relay's head-of-key lookups"), 6),
    index("outbox", "outbox_pending_idx", 3, Plain, "(seq) WHERE published_at IS NULL",
        "the relay's scan of pending messages"),
    index("outbox", "outbox_topic_idx", 3, Plain, "(topic, seq) WHERE published_at IS NULL",
        "per-topic status"),
    index("outbox_dead_letters", "outbox_dead_letters_pkey", 3, PrimaryKey, "(seq)",
        "replays at the original position"),
    index("outbox_dead_letters", "outbox_dead_letters_message_id_key", 3, Unique,
        "(message_id)", "lookups of dead letters by message id"),
    index("outbox_dead_letters", "outbox_dead_letters_key_idx", 3, Plain,
        "(topic, ordering_key)", "holding back the later messages of a dead letter's key"),
    index("queue", "queue_pkey", 3, PrimaryKey, "(seq)", "acks and nacks by seq"),
    index("queue", "queue_topic_idx", 3, Plain, "(topic, seq)",
        "receive's walk of a topic in order"),
    until(index("queue", "queue_key_idx", 3, Plain, "(topic, ordering_key, seq)",
        "receive's head-of-key checks"), 15),
    index("queue_dead_letters", "queue_dead_letters_pkey", 3, PrimaryKey, "(seq)",
        "replays at the original position"),
    // V4
    index("inbox", "inbox_consumer_processed_at_idx", 4, Plain, "(consumer, processed_at)",
        "retention purges per consumer and status"),
    // V5
    index("queue_dead_letters", "queue_dead_letters_key_idx", 5, Plain,
        "(topic, ordering_key)", "receive's check that a key has no dead letter"),
    index("queue_dead_letters", "queue_dead_letters_message_id_idx", 5, Plain,
        "(message_id)", "lookups of dead letters by message id"),
    // V6
    index("outbox", "outbox_backoff_idx", 6, Plain,
        "(topic, ordering_key) WHERE attempts > 0 AND published_at IS NULL",
        "the relay's lookup of keys waiting out a backoff"),
    index("outbox", "outbox_unkeyed_idx", 6, Plain,
        "(seq) WHERE published_at IS NULL AND ordering_key IS NULL",
        "relays taking unkeyed messages"),
    index("outbox", "outbox_key_idx", 6, Plain,
        "(topic, ordering_key, seq) WHERE published_at IS NULL AND ordering_key IS NOT NULL",
        "the relay's head-of-key lookups"),
    // V7
    index("inbox", "inbox_leases_idx", 7, Plain,
        "(consumer, lease_expires_at) WHERE lease_expires_at IS NOT NULL",
        "status's lease counts"),
    // V8
    index("outbox", "outbox_published_idx", 8, Plain,
        "(published_at) WHERE published_at IS NOT NULL",
        "the janitor's purge of published rows kept in audit mode"),
    index("outbox_dead_letters", "outbox_dead_letters_dead_at_idx", 8, Plain, "(dead_at)",
        "the janitor's purge of dead letters by age"),
    index("queue_dead_letters", "queue_dead_letters_dead_at_idx", 8, Plain, "(dead_at)",
        "the janitor's purge of dead letters by age"),
    // V15
    index("queue", "queue_key_idx", 15, Plain,
        "(topic, ordering_key, seq) WHERE ordering_key IS NOT NULL",
        "receive's head-of-key checks"),
    // V16
    index("outbox_scheduled", "outbox_scheduled_pkey", 16, PrimaryKey, "(sched_seq)",
        "promotion and cancels of scheduled messages"),
    index("outbox_scheduled", "outbox_scheduled_due_idx", 16, Plain, "(due_at, sched_seq)",
        "the relays' promotion of due scheduled messages"),
    index("outbox_scheduled", "outbox_scheduled_key_idx", 16, UniqueIndex,
        "(topic, schedule_key) WHERE schedule_key IS NOT NULL",
        "one pending scheduled message per schedule key"),
    // V17
    index("outbox_archive", "outbox_archive_seq_idx", 17, Plain, "(seq)",
        "replay's walk of the archive in order"),
    index("outbox_archive", "outbox_archive_wal_message_idx", 17, Plain,
        "(message_id) WHERE source_seq IS NULL",
        "replay's look-up of a WAL message archived twice"),
    // V18
    index("outbox_fanout_messages", "outbox_fanout_messages_pkey", 18, PrimaryKey,
        "(message_id)", "the router's deferred payloads, one per message"),
    index("outbox_fanout_deliveries", "outbox_fanout_deliveries_pkey", 18, PrimaryKey, "(id)",
        "the router's settling of drained deliveries"),
    index("outbox_fanout_deliveries", "outbox_fanout_deliveries_destination_message_id_key", 18,
        Unique, "(destination, message_id)",
        "one deferred delivery per message and destination (a re-publish adds none)"),
    index("outbox_fanout_deliveries", "outbox_fanout_deliveries_key_idx", 18, Plain,
        "(destination, topic, ordering_key, id) WHERE ordering_key IS NOT NULL",
        "the router's per-batch look-up of held keys and the drain's head check"),
    index("outbox_fanout_deliveries", "outbox_fanout_deliveries_claim_idx", 18, Plain,
        "(destination, id)", "the router's drain, in id order per destination"),
    // V19
    index("rate_limits", "rate_limits_pkey", 19, PrimaryKey, "(name, prefix)",
        "consumer rate limits: one bucket per limit and prefix"),
    // V20
    index("hand_backs", "hand_backs_pkey", 20, PrimaryKey, "(consumer, message_id)",
        "consumer hand-backs: one count per consumer and message"),
    index("hand_backs", "hand_backs_at_idx", 20, Plain, "(at)",
        "the janitor's purge of hand-backs by age"),
];

#[cfg(test)]
mod tests {
    use super::super::bloat::{estimate_btree_bytes, estimate_heap_bytes};
    use super::super::format::*;
    use super::*;

    /// `CREATE [UNIQUE] INDEX [CONCURRENTLY] [IF NOT EXISTS] name` and `DROP INDEX [IF
    /// EXISTS] name` in a migration, in order.
    fn index_statements(sql: &str) -> Vec<(bool, String)> {
        let words: Vec<String> = sql
            .lines()
            .map(|l| l.split("--").next().unwrap_or(""))
            .flat_map(|l| l.split_whitespace())
            .map(|w| w.trim_end_matches(';').to_ascii_lowercase())
            .collect();
        let mut out = Vec::new();
        for i in 0..words.len() {
            let create = words[i] == "create";
            if !(create || words[i] == "drop") {
                continue;
            }
            let mut j = i + 1;
            if create && words.get(j).map(String::as_str) == Some("unique") {
                j += 1;
            }
            if words.get(j).map(String::as_str) != Some("index") {
                continue;
            }
            j += 1;
            while matches!(
                words.get(j).map(String::as_str),
                Some("concurrently" | "if" | "not" | "exists")
            ) {
                j += 1;
            }
            if let Some(name) = words.get(j) {
                out.push((create, name.clone()));
            }
        }
        out
    }

    #[test]
    fn the_expected_indexes_match_the_migrations() {
        for m in embedded::migrations::runner().get_migrations() {
            let v = m.version();
            for (create, name) in index_statements(m.sql().unwrap_or_default()) {
                let listed = if create {
                    INDEXES.iter().any(|ix| ix.name == name && ix.since == v)
                } else {
                    INDEXES
                        .iter()
                        .any(|ix| ix.name == name && ix.dropped_in == Some(v))
                };
                assert!(
                    listed,
                    "migration V{v} {} index {name}: add it to INDEXES in src/doctor.rs",
                    if create { "creates" } else { "drops" }
                );
            }
        }
        for ix in INDEXES.iter().filter(|ix| ix.kind == Plain) {
            let Some(m) = embedded::migrations::runner()
                .get_migrations()
                .iter()
                .find(|m| m.version() == ix.since)
                .cloned()
            else {
                continue; // a migration this build does not have
            };
            assert!(
                index_statements(m.sql().unwrap_or_default()).contains(&(true, ix.name.into())),
                "INDEXES lists {} as created by V{}, which does not create it",
                ix.name,
                ix.since
            );
        }
    }

    #[test]
    fn expected_indexes_follow_the_applied_versions() {
        let upto = |n: i32| (1..=n).collect::<BTreeSet<i32>>();
        let names = |n: i32| -> Vec<&str> {
            INDEXES
                .iter()
                .filter(|ix| ix.expected(&upto(n)))
                .map(|ix| ix.name)
                .collect()
        };
        assert!(names(3).contains(&"inbox_processed_at_idx"));
        assert!(!names(4).contains(&"inbox_processed_at_idx"));
        assert_eq!(
            names(7).iter().filter(|n| **n == "outbox_key_idx").count(),
            1
        );
        assert_eq!(names(7).len(), 20);
        assert!(!names(7).contains(&"outbox_published_idx"));
        assert!(names(8).contains(&"outbox_published_idx"));
        assert_eq!(names(8).len(), 23);
    }

    #[test]
    fn estimates_and_formatting() {
        assert_eq!(estimate_heap_bytes(0, None, 10, 8192, 100), Some(0));
        assert_eq!(estimate_heap_bytes(10, None, 10, 8192, 100), None);
        // 100 rows of 40 bytes + 24 header + 4 pointer fit one page.
        assert_eq!(estimate_heap_bytes(100, Some(40), 6, 8192, 100), Some(8192));
        // Filled half full (the queue), the same rows need two pages.
        assert_eq!(
            estimate_heap_bytes(100, Some(40), 6, 8192, 50),
            Some(2 * 8192)
        );
        assert_eq!(estimate_btree_bytes(-1.0, 8, 8192), None);
        assert!(estimate_btree_bytes(1_000_000.0, 8, 8192).unwrap() > 20 << 20);
        assert_eq!(group_digits(1_234_567), "1,234,567");
        assert_eq!(group_digits(-12), "-12");
        assert_eq!(human_duration(3725.0), "1h 02m");
        assert_eq!(human_bytes(3 << 20), "3.0 MiB");
        assert!(Severity::Critical > Severity::Warning && Severity::Warning > Severity::Ok);
    }
}
