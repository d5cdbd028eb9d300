//! What an application role needs on a pgbox schema: the grants `Migrator::grant_to` applies
//! and `pgbox doctor` checks (`Check::Grants`).
//!
//! The application role runs the inbox, the outbox, the relay, the built-in queue's consumers,
//! the janitor and the doctor; it never creates, alters or owns anything. The lists below are
//! the union of what those components run, and nothing more: no `CREATE` on the schema, no
//! `TRUNCATE`, `REFERENCES` or `TRIGGER`, no DDL function. A unit test fails when a migration
//! creates a table, sequence or function that is neither listed here nor in [`NOT_GRANTED`].

use crate::ident::Identifier;
use crate::migrate::HISTORY_TABLE;

/// Table privileges, per table: the table, the privileges, and the migration creating it.
pub(crate) const TABLES: &[(&str, &[&str], i32)] = &[
    // Claims insert, outcomes and leases update, the janitor and purges delete (with
    // `FOR UPDATE`, which needs UPDATE), lookups and status select.
    ("inbox", &["SELECT", "INSERT", "UPDATE", "DELETE"], 1),
    // In-order processing: read, insert and advance the watermark.
    ("sequence_watermarks", &["SELECT", "INSERT", "UPDATE"], 2),
    // Enqueue inserts; the relay claims (`FOR UPDATE`), marks, retries and deletes.
    ("outbox", &["SELECT", "INSERT", "UPDATE", "DELETE"], 3),
    // The relay inserts; replay and discard move and delete; the janitor deletes by age.
    (
        "outbox_dead_letters",
        &["SELECT", "INSERT", "UPDATE", "DELETE"],
        3,
    ),
    // The relay publishes (insert); consumers receive (update), ack (delete), nack (update).
    ("queue", &["SELECT", "INSERT", "UPDATE", "DELETE"], 3),
    (
        "queue_dead_letters",
        &["SELECT", "INSERT", "UPDATE", "DELETE"],
        3,
    ),
    // The partitioned inbox's settings: read by claims' callers, the janitor and the doctor.
    ("inbox_partitioning", &["SELECT"], 10),
    // Claims insert, outcomes update; expiry drops whole partitions (the owner's job).
    ("partitioned_inbox", &["SELECT", "INSERT", "UPDATE"], 10),
    // Scheduled enqueues insert (or replace: update), cancels delete, the relays promote
    // (`FOR UPDATE`, delete), status reads.
    (
        "outbox_scheduled",
        &["SELECT", "INSERT", "UPDATE", "DELETE"],
        16,
    ),
    // The archive: the relays insert; replay and `pgbox archive status` read. Rows are never
    // updated or deleted: expiry drops partitions (through outbox_archive_drop_expired).
    ("outbox_archive", &["SELECT", "INSERT"], 17),
    // Read by the janitor, replay and status; written through outbox_archive_configure.
    ("outbox_archive_settings", &["SELECT"], 17),
    // Fan-out: the router defers (insert; a payload row is touched under its lock: update),
    // drains (`FOR UPDATE`, delete), retries, dead-letters and redelivers (update), status
    // reads.
    (
        "outbox_fanout_messages",
        &["SELECT", "INSERT", "UPDATE", "DELETE"],
        18,
    ),
    (
        "outbox_fanout_deliveries",
        &["SELECT", "INSERT", "UPDATE", "DELETE"],
        18,
    ),
    // Consumer rate limits: a take inserts or updates its bucket; runners sweep full ones.
    ("rate_limits", &["SELECT", "INSERT", "UPDATE", "DELETE"], 19),
    // Consumer hand-backs: a hand-back inserts or updates its row, a runner about to
    // dead-letter reads it, a dead letter and the janitor delete.
    ("hand_backs", &["SELECT", "INSERT", "UPDATE", "DELETE"], 20),
];

/// The migration history: read by the doctor and by `Migrator::applied` (the CLI's check
/// that a schema is migrated). Written only by the migrator.
pub(crate) const HISTORY_PRIVILEGES: &[&str] = &["SELECT"];

/// Sequences: lease mode draws its fencing tokens with `nextval`. (Identity columns need no
/// grant on their sequence.)
pub(crate) const SEQUENCES: &[(&str, &[&str], i32)] = &[
    ("inbox_lease_token_seq", &["USAGE"], 7),
    // The archive's order: drawn by the relays' archive inserts (a column default).
    ("outbox_archive_seq", &["USAGE"], 17),
];

/// Functions the components call, by signature, with the migration creating them.
pub(crate) const FUNCTIONS: &[(&str, i32)] = &[
    ("inbox_claim_bounded(text, text, text, text)", 6),
    ("queue_receive(text, bigint, double precision)", 6),
    ("inbox_lease(text, text, text, bigint)", 7),
    ("partitioned_inbox_lock_id(text, text)", 10),
    ("partitioned_inbox_claim(text, text, text, text)", 10),
    ("partitioned_inbox_claim_batch(text, text[], text[])", 10),
    ("inbox_partitions()", 10),
    ("inbox_partitions_expired(interval)", 10),
    ("partitioned_inbox_check_isolation()", 12),
    // SECURITY DEFINER: the janitor creates partitions ahead through it.
    ("inbox_partitions_create_ahead()", 13),
    ("outbox_archive_partitions()", 17),
    // SECURITY DEFINER: the relays record the archive's retention and create partitions
    // ahead; the janitor creates them ahead and drops expired ones.
    (
        "outbox_archive_configure(interval, interval, integer, boolean)",
        17,
    ),
    ("outbox_archive_create_ahead()", 17),
    ("outbox_archive_drop_expired()", 17),
];

/// Objects the migrations create that the application role is deliberately not granted.
#[cfg_attr(not(test), allow(dead_code))]
pub(crate) const NOT_GRANTED: &[&str] = &[
    // Trigger functions: a trigger fires whoever inserts; EXECUTE is never checked.
    "queue_notify",
    "outbox_notify",
    "inbox_refuse_new_claims",
    // DDL, for the owner only (they create tables and triggers).
    "inbox_partitions_create",
    "enable_partitioned_inbox",
    "inbox_refuse_new_claims_install",
    // The archive's default partition: inserts go through outbox_archive (privileges are
    // checked on the parent only), so the partition needs none of its own.
    "outbox_archive_default",
    // DDL, for the owner only (reached through the SECURITY DEFINER functions above).
    "outbox_archive_partition_add",
    "outbox_archive_partitions_create",
];

/// Validates the name of the role to grant to: an identifier (see [`Identifier`]), and not
/// one PostgreSQL reads as a keyword in `GRANT ... TO` (`public` would grant to every role).
pub(crate) fn role(name: &str) -> crate::Result<Identifier> {
    let id = Identifier::new("role", name)?;
    if matches!(name, "public" | "none") {
        return Err(crate::Error::InvalidIdentifier {
            what: "role",
            name: name.to_owned(),
            reason: "PostgreSQL reads this name as a keyword in GRANT (\"public\" is every role)",
        });
    }
    Ok(id)
}

/// The statements granting `role` what pgbox's components need on `schema`, all of them
/// idempotent (`GRANT` of a privilege already held changes nothing). Every object exists
/// once every migration is applied, which is when they run.
pub(crate) fn grant_sql(schema: &Identifier, role: &Identifier) -> String {
    let s = schema.quoted();
    let r = role.quoted();
    let mut out = format!(
        "-- pgbox: what the application role {r} needs (no CREATE, no ownership).\n\
         GRANT USAGE ON SCHEMA {s} TO {r};\n"
    );
    for (table, privileges, _) in TABLES {
        out.push_str(&format!(
            "GRANT {} ON TABLE {s}.\"{table}\" TO {r};\n",
            privileges.join(", ")
        ));
    }
    out.push_str(&format!(
        "GRANT {} ON TABLE {s}.\"{HISTORY_TABLE}\" TO {r};\n",
        HISTORY_PRIVILEGES.join(", ")
    ));
    for (sequence, privileges, _) in SEQUENCES {
        out.push_str(&format!(
            "GRANT {} ON SEQUENCE {s}.\"{sequence}\" TO {r};\n",
            privileges.join(", ")
        ));
    }
    for (function, _) in FUNCTIONS {
        out.push_str(&format!(
            "GRANT EXECUTE ON FUNCTION {s}.{function} TO {r};\n"
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::migrate::embedded;

    /// `CREATE [OR REPLACE] (TABLE|SEQUENCE|FUNCTION) name` outside dynamic SQL strings.
    fn created(sql: &str) -> Vec<(String, String)> {
        let mut out = Vec::new();
        for line in sql.lines() {
            let line = line.split("--").next().unwrap_or("").trim_start();
            let words: Vec<&str> = line.split_whitespace().collect();
            if words.first() != Some(&"CREATE") {
                continue;
            }
            let mut i = 1;
            if words.get(1..3) == Some(&["OR", "REPLACE"][..]) {
                i = 3;
            }
            let (Some(kind), Some(name)) = (words.get(i), words.get(i + 1)) else {
                continue;
            };
            if matches!(*kind, "TABLE" | "SEQUENCE" | "FUNCTION") {
                let name = name.split('(').next().unwrap_or("").to_owned();
                out.push((kind.to_string(), name));
            }
        }
        out
    }

    #[test]
    fn every_object_the_migrations_create_is_granted_or_excluded() {
        for m in embedded::migrations::runner().get_migrations() {
            for (kind, name) in created(m.sql().unwrap_or_default()) {
                let listed = match kind.as_str() {
                    "TABLE" => TABLES.iter().any(|t| t.0 == name),
                    "SEQUENCE" => SEQUENCES.iter().any(|t| t.0 == name),
                    _ => FUNCTIONS
                        .iter()
                        .any(|f| f.0.split('(').next() == Some(&name)),
                } || NOT_GRANTED.contains(&name.as_str());
                assert!(
                    listed,
                    "migration V{} creates {kind} {name}: list it in src/grants.rs (granted, \
                     or NOT_GRANTED with a reason)",
                    m.version()
                );
            }
        }
    }

    #[test]
    fn every_object_the_migrations_create_gets_the_migrate_hint() {
        // A relay or a consumer meeting a schema an older pgbox migrated must say "run the
        // migrations", whichever object is missing (V16's scheduled table once did not).
        for m in embedded::migrations::runner().get_migrations() {
            for (kind, name) in created(m.sql().unwrap_or_default()) {
                assert!(
                    crate::error::PGBOX_OBJECTS.contains(&name.as_str()),
                    "migration V{} creates {kind} {name}: list it in src/error.rs's \
                     PGBOX_OBJECTS, so that its absence says to migrate",
                    m.version()
                );
            }
        }
    }

    #[test]
    fn roles_are_validated_and_public_is_refused() {
        assert!(role("billing_app").is_ok());
        for bad in ["public", "none", "App", "a;b", "pg_monitor", ""] {
            assert!(role(bad).is_err(), "{bad}");
        }
        let sql = grant_sql(
            &Identifier::new("schema", "pgbox").unwrap(),
            &role("app").unwrap(),
        );
        assert!(sql.contains("GRANT USAGE ON SCHEMA \"pgbox\" TO \"app\";"));
        for line in sql.lines().filter(|l| l.starts_with("GRANT")) {
            for never in [
                "CREATE",
                "TRUNCATE",
                "ALL",
                "TRIGGER",
                "REFERENCES",
                "OPTION",
            ] {
                assert!(!line.contains(never), "{line}");
            }
        }
    }
}
