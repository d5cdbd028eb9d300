//! `Check::Bloat`: dead rows, and table and index sizes against what their live rows need
//! (estimates from the catalog and the statistics, no extension).

use super::format::*;
use super::*;

impl Doctor {
    pub(super) async fn check_bloat(
        &self,
        conn: &mut PgConnection,
        tables: &[&'static str],
        horizon_held: bool,
    ) -> Result<Vec<Finding>> {
        let s = &self.schema;
        let names: Vec<String> = tables.iter().map(|t| (*t).to_owned()).collect();
        let table_rows = sqlx::query(
            "SELECT c.relname::text, pg_catalog.pg_relation_size(c.oid)::int8, \
                    coalesce(st.n_live_tup, 0)::int8, coalesce(st.n_dead_tup, 0)::int8, \
                    extract(epoch FROM pg_catalog.clock_timestamp() \
                        - greatest(st.last_autovacuum, st.last_vacuum))::float8, \
                    (SELECT pg_catalog.sum(ps.avg_width)::int8 FROM pg_catalog.pg_stats ps \
                       WHERE ps.schemaname = n.nspname AND ps.tablename = c.relname \
                         AND NOT ps.inherited), \
                    (SELECT pg_catalog.count(*) FROM pg_catalog.pg_attribute a \
                       WHERE a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped)::int8, \
                    pg_catalog.current_setting('block_size')::int8, \
                    coalesce((SELECT pg_catalog.round(o.option_value::numeric)::int8 \
                                FROM pg_catalog.pg_options_to_table(c.reloptions) AS o \
                               WHERE o.option_name = 'fillfactor' \
                                 AND o.option_value ~ '^[0-9]{1,3}(\\.[0-9]*)?$'), 100) \
             FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace \
             LEFT JOIN pg_catalog.pg_stat_user_tables st ON st.relid = c.oid \
             WHERE n.nspname = $1 AND c.relname = ANY($2) AND c.relkind IN ('r', 'p') \
             ORDER BY 1",
        )
        .persistent(false)
        .bind(s.as_str())
        .bind(&names)
        .fetch_all(&mut *conn)
        .await?;
        let index_rows = sqlx::query(
            "SELECT ic.relname::text, t.relname::text, pg_catalog.pg_relation_size(ic.oid)::int8, \
                    ic.reltuples::float8, \
                    (SELECT pg_catalog.sum(coalesce(ps.avg_width, \
                                CASE WHEN a.attlen > 0 THEN a.attlen ELSE 16 END))::int8 \
                       FROM pg_catalog.unnest(i.indkey::int2[]) AS k(attnum) \
                       JOIN pg_catalog.pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum \
                       LEFT JOIN pg_catalog.pg_stats ps ON ps.schemaname = n.nspname \
                            AND ps.tablename = t.relname AND ps.attname = a.attname \
                            AND NOT ps.inherited), \
                    pg_catalog.current_setting('block_size')::int8 \
             FROM pg_catalog.pg_index i \
             JOIN pg_catalog.pg_class ic ON ic.oid = i.indexrelid \
             JOIN pg_catalog.pg_class t ON t.oid = i.indrelid \
             JOIN pg_catalog.pg_namespace n ON n.oid = t.relnamespace \
             JOIN pg_catalog.pg_am am ON am.oid = ic.relam \
             WHERE n.nspname = $1 AND t.relname = ANY($2) AND am.amname = 'btree' \
               AND i.indisvalid \
             ORDER BY 2, 1",
        )
        .persistent(false)
        .bind(s.as_str())
        .bind(&names)
        .fetch_all(&mut *conn)
        .await?;

        let horizon_note = if horizon_held {
            "First deal with what holds back the xmin horizon (the xmin_horizon findings): \
             VACUUM cannot remove these rows while it lasts. "
        } else {
            ""
        };
        let mut findings = Vec::new();
        let (mut live_total, mut dead_total, mut heap_bytes, mut index_bytes) = (0, 0, 0, 0);
        let mut unestimated = Vec::new();
        for row in &table_rows {
            let table: String = row.try_get(0)?;
            let bytes: i64 = row.try_get(1)?;
            let live: i64 = row.try_get(2)?;
            let dead: i64 = row.try_get(3)?;
            let since_vacuum: Option<f64> = row.try_get(4)?;
            let width: Option<i64> = row.try_get(5)?;
            let columns: i64 = row.try_get(6)?;
            let block: i64 = row.try_get(7)?;
            let fillfactor: i64 = row.try_get(8)?;
            live_total += live;
            dead_total += dead;
            heap_bytes += bytes;
            let vacuumed = since_vacuum.map_or_else(
                || "never vacuumed since statistics were reset".to_owned(),
                |s| format!("last vacuumed {} ago", human_duration(s)),
            );
            let dead_ratio = if live + dead > 0 {
                dead as f64 / (live + dead) as f64
            } else {
                0.0
            };
            if dead >= self.dead_rows_warn && dead > 0 && dead_ratio >= self.dead_ratio_warn {
                findings.push(
                    Finding::new(
                        Severity::Warning,
                        Code::DeadTuples,
                        format!(
                            "table {s}.{table} has ~{} dead rows against ~{} live ({:.0}% dead; \
                             {vacuumed}; estimates from pg_stat_user_tables)",
                            group_digits(dead),
                            group_digits(live),
                            dead_ratio * 100.0
                        ),
                        format!(
                            "{horizon_note}Otherwise autovacuum is not keeping up with this \
                             queue-like table: `VACUUM (VERBOSE) {s}.{table};` now, and let \
                             autovacuum start sooner: `ALTER TABLE {s}.{table} SET \
                             (autovacuum_vacuum_scale_factor = 0, \
                             autovacuum_vacuum_threshold = 10000, \
                             autovacuum_vacuum_cost_delay = 0);`."
                        ),
                    )
                    .subject(table.clone())
                    .details(json!({
                        "table": table, "live_rows": live, "dead_rows": dead,
                        "dead_ratio": dead_ratio, "seconds_since_vacuum": since_vacuum,
                    })),
                );
            }
            if bytes < self.bloat_min_bytes.max(1) {
                continue;
            }
            let Some(expected) = estimate_heap_bytes(live, width, columns, block, fillfactor)
            else {
                unestimated.push(table.clone());
                continue;
            };
            let waste = (bytes - expected).max(0) as f64 / bytes as f64;
            if waste >= self.bloat_ratio_warn {
                findings.push(
                    Finding::new(
                        Severity::Warning,
                        Code::TableBloat,
                        format!(
                            "table {s}.{table} takes {} where its ~{} live rows need about {} \
                             (~{:.0}% free or dead space; an estimate from pg_class and pg_stats, \
                             not a pgstattuple measurement)",
                            human_bytes(bytes),
                            group_digits(live),
                            human_bytes(expected),
                            waste * 100.0
                        ),
                        format!(
                            "{horizon_note}VACUUM makes that space reusable but does not shrink \
                             the file, and a queue table usually grows back into it. If it \
                             stays this large after `VACUUM {s}.{table};` and the space is \
                             needed, rewrite it online with pg_repack, or with `VACUUM FULL \
                             {s}.{table};` in a maintenance window (it locks the table for its \
                             duration)."
                        ),
                    )
                    .subject(table.clone())
                    .details(json!({
                        "table": table, "bytes": bytes, "estimated_bytes": expected,
                        "estimated_waste_ratio": waste, "live_rows": live,
                    })),
                );
            }
        }
        for row in &index_rows {
            let index: String = row.try_get(0)?;
            let table: String = row.try_get(1)?;
            let bytes: i64 = row.try_get(2)?;
            let entries: f64 = row.try_get(3)?;
            let width: Option<i64> = row.try_get(4)?;
            let block: i64 = row.try_get(5)?;
            index_bytes += bytes;
            if bytes < self.bloat_min_bytes.max(1) {
                continue;
            }
            let Some(expected) = estimate_btree_bytes(entries, width.unwrap_or(16), block) else {
                unestimated.push(index.clone());
                continue;
            };
            let waste = (bytes - expected).max(0) as f64 / bytes as f64;
            if waste >= self.bloat_ratio_warn {
                findings.push(
                    Finding::new(
                        Severity::Warning,
                        Code::IndexBloat,
                        format!(
                            "index {s}.{index} on {table} takes {} where its ~{} entries need \
                             about {} (~{:.0}% wasted; an estimate from pg_class and pg_stats)",
                            human_bytes(bytes),
                            group_digits(entries as i64),
                            human_bytes(expected),
                            waste * 100.0
                        ),
                        format!(
                            "{horizon_note}Rebuild it without blocking writes: `REINDEX INDEX \
                             CONCURRENTLY {s}.{index};`."
                        ),
                    )
                    .subject(index.clone())
                    .details(json!({
                        "index": index, "table": table, "bytes": bytes,
                        "estimated_bytes": expected, "estimated_waste_ratio": waste,
                        "entries": entries,
                    })),
                );
            }
        }
        if findings.is_empty() {
            let mut message = format!(
                "pgbox's {} tables hold ~{} live and ~{} dead rows in {} (indexes {}); none is \
                 over the bloat thresholds (estimates from pg_stat_user_tables, pg_class and \
                 pg_stats, not pgstattuple measurements)",
                table_rows.len(),
                group_digits(live_total),
                group_digits(dead_total),
                human_bytes(heap_bytes),
                human_bytes(index_bytes)
            );
            let mut advice = "Nothing to do.".to_owned();
            if !unestimated.is_empty() {
                message.push_str(&format!(
                    "; no size estimate for {} (no statistics yet)",
                    unestimated.join(", ")
                ));
                advice = format!(
                    "For size estimates, let autovacuum analyze them, or run ANALYZE on {s}'s \
                     tables."
                );
            }
            findings.push(
                Finding::new(Severity::Ok, Code::BloatLow, message, advice).details(json!({
                    "tables": table_rows.len(), "live_rows": live_total, "dead_rows": dead_total,
                    "table_bytes": heap_bytes, "index_bytes": index_bytes,
                    "not_estimated": unestimated,
                })),
            );
        }
        Ok(findings)
    }
}

/// What a table's live rows need, heap main fork: tuple header (23 bytes and a null bitmap,
/// aligned), data (the analyzed average widths, aligned), a 4-byte line pointer, in pages of
/// `block - 24` usable bytes filled to the table's `fillfactor` (percent; an operator may
/// leave room on each page for HOT updates). `None` without statistics for a
/// non-empty table.
pub(super) fn estimate_heap_bytes(
    live: i64,
    width: Option<i64>,
    columns: i64,
    block: i64,
    fillfactor: i64,
) -> Option<i64> {
    if live <= 0 {
        return Some(0);
    }
    let width = width?;
    let header = maxalign(23 + (columns + 7) / 8);
    let row = header + maxalign(width) + 4;
    let per_page = ((block - 24) * fillfactor.clamp(10, 100) / 100 / row).max(1);
    let pages = (live + per_page - 1) / per_page;
    Some(pages * block)
}

/// What a B-tree's entries need: an 8-byte index tuple header plus the aligned key, a 4-byte
/// line pointer, leaf pages filled to the default fillfactor of 90%, about 1% of internal
/// pages, and the metapage. Deduplication (PostgreSQL 13+) only makes real indexes smaller.
/// `None` when the entry count is unknown (`reltuples` = -1: never vacuumed or analyzed).
pub(super) fn estimate_btree_bytes(entries: f64, width: i64, block: i64) -> Option<i64> {
    if entries < 0.0 {
        return None;
    }
    if entries == 0.0 {
        return Some(block); // the metapage
    }
    let entry = (8 + maxalign(width) + 4) as f64;
    let usable = (block - 24 - 16) as f64 * 0.9;
    let leaves = (entries * entry / usable).ceil().max(1.0);
    let pages = (leaves * 1.01).ceil() as i64 + 1;
    Some(pages * block)
}

pub(super) fn maxalign(n: i64) -> i64 {
    (n + 7) / 8 * 8
}
