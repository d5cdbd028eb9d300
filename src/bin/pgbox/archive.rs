//! `pgbox archive status` and `pgbox replay`: the archive of delivered messages.

use clap::{Args, Subcommand};
use serde_json::{Value, json};
use time::OffsetDateTime;
use time::format_description::well_known::Rfc3339;
use uuid::Uuid;

use super::{Failure, age_text, connect, ensure_schema, print, time_json, time_text};

#[derive(Subcommand, Debug)]
pub(crate) enum ArchiveAction {
    /// Retention, partitions (bounds, estimated rows), the default partition's rows, and the
    /// span archived.
    Status,
}

/// What `pgbox replay` selects and how it goes.
#[derive(Args, Debug)]
pub(crate) struct ReplayArgs {
    /// Only messages of this topic (a topic never archived is refused).
    #[arg(long)]
    topic: Option<String>,
    /// Only messages with this ordering key.
    #[arg(long)]
    key: Option<String>,
    /// Only messages whose type header has this value.
    #[arg(long = "type", value_name = "TYPE")]
    message_type: Option<String>,
    /// The header `--type` reads.
    #[arg(long, default_value = pgbox::Replay::DEFAULT_TYPE_HEADER)]
    type_header: String,
    /// Only messages published at or after this time (RFC 3339: 2026-11-27T10:00:00Z).
    #[arg(long, value_parser = parse_time)]
    since: Option<OffsetDateTime>,
    /// Only messages published before this time (RFC 3339).
    #[arg(long, value_parser = parse_time)]
    until: Option<OffsetDateTime>,
    /// Give the replayed messages fresh ids: consumers process them again. Without it they
    /// keep their ids and consumers' inboxes skip them as duplicates.
    #[arg(long)]
    new_ids: bool,
    /// At most this many messages per second.
    #[arg(long, value_name = "N")]
    rate: Option<u32>,
    /// Messages per transaction.
    #[arg(long, default_value_t = pgbox::Replay::DEFAULT_BATCH_SIZE)]
    batch_size: usize,
    /// Stop after this many messages (resume with --after).
    #[arg(long, value_name = "N")]
    limit: Option<u64>,
    /// Resume after this cursor (a previous run's `cursor`).
    #[arg(long, value_name = "CURSOR")]
    after: Option<i64>,
    /// The replay id to resume under (a previous run's `replay_id`).
    #[arg(long, value_name = "UUID")]
    replay_id: Option<Uuid>,
    /// Emit into the WAL outbox (for a schema published by `WalRelay`) instead of the table.
    #[arg(long)]
    wal: bool,
    /// Count what would be replayed; enqueue nothing.
    #[arg(long)]
    dry_run: bool,
}

fn parse_time(s: &str) -> Result<OffsetDateTime, String> {
    OffsetDateTime::parse(s.trim(), &Rfc3339)
        .map_err(|e| format!("{s:?}: expected an RFC 3339 time such as 2026-11-27T10:00:00Z ({e})"))
}

pub(crate) async fn status(
    url: Option<&str>,
    schema: &str,
    json_mode: bool,
) -> Result<(), Failure> {
    let pool = connect(url).await?;
    ensure_schema(&pool, schema).await?;
    let status = pgbox::Archive::new(pool)
        .with_schema(schema)?
        .status()
        .await?;
    let partitions: Vec<Value> = status
        .partitions
        .iter()
        .map(|p| {
            json!({
                "name": p.name,
                "from": time_json(Some(p.from)),
                "to": time_json(Some(p.to)),
                "rows_estimate": p.rows_estimate,
            })
        })
        .collect();
    let value = json!({
        "retention": status.retention.map(|r| age_text(r.retention())),
        "partition_width": status.retention.map(|r| age_text(r.width())),
        "partitions_ahead": status.retention.map(|r| r.partitions_ahead()),
        "partitions": partitions,
        "default_rows": status.default_rows,
        "oldest": time_json(status.oldest),
        "newest": time_json(status.newest),
        "last_cursor": status.last_seq,
    });
    print(json_mode, value, || {
        let mut text = match status.retention {
            Some(r) => format!(
                "retention {} in partitions of {} ({} ahead)\n",
                age_text(r.retention()),
                age_text(r.width()),
                r.partitions_ahead()
            ),
            None => "no retention recorded (no relay has archived yet)\n".to_owned(),
        };
        text.push_str(&format!(
            "archived {} .. {}, last cursor {}\ndefault partition: {} rows\n",
            time_text(status.oldest),
            time_text(status.newest),
            status
                .last_seq
                .map_or_else(|| "-".to_owned(), |n| n.to_string()),
            status.default_rows
        ));
        for p in &status.partitions {
            text.push_str(&format!(
                "{}  {} .. {}  rows ~{}\n",
                p.name,
                time_text(Some(p.from)),
                time_text(Some(p.to)),
                p.rows_estimate
                    .map_or_else(|| "?".to_owned(), |n| n.to_string())
            ));
        }
        text
    });
    Ok(())
}

pub(crate) async fn replay(
    url: Option<&str>,
    schema: &str,
    json_mode: bool,
    args: ReplayArgs,
) -> Result<(), Failure> {
    let pool = connect(url).await?;
    ensure_schema(&pool, schema).await?;
    let mut replay = pgbox::Archive::new(pool)
        .with_schema(schema)?
        .replay()
        .type_header(args.type_header)
        .new_ids(args.new_ids)
        .batch_size(args.batch_size);
    if let Some(topic) = args.topic {
        replay = replay.topic(topic);
    }
    if let Some(key) = args.key {
        replay = replay.ordering_key(key);
    }
    if let Some(t) = args.message_type {
        replay = replay.message_type(t);
    }
    if let Some(t) = args.since {
        replay = replay.since(t);
    }
    if let Some(t) = args.until {
        replay = replay.until(t);
    }
    if let Some(rate) = args.rate {
        replay = replay.rate(rate);
    }
    if let Some(n) = args.limit {
        replay = replay.max_messages(n);
    }
    if let Some(after) = args.after {
        replay = replay.resume_after(pgbox::ReplayCursor(after));
    }
    if let Some(id) = args.replay_id {
        replay = replay.replay_id(id);
    }
    if args.wal {
        replay = replay.mode(pgbox::OutboxMode::Wal);
    }
    if args.dry_run {
        let n = replay.count().await?;
        print(
            json_mode,
            json!({ "dry_run": true, "would_replay": n }),
            || format!("would replay {n} messages\n"),
        );
        return Ok(());
    }
    let report = replay.run().await?;
    let cursor = report.cursor.map(|c| c.0);
    print(
        json_mode,
        json!({
            "replay_id": report.replay_id,
            "replayed": report.replayed,
            "skipped": report.skipped,
            "chunks": report.chunks,
            "cursor": cursor,
            "complete": report.complete,
        }),
        || {
            let mut text = format!(
                "replayed {} messages (replay id {}), {} still pending skipped\n",
                report.replayed, report.replay_id, report.skipped
            );
            if !report.complete {
                text.push_str(&format!(
                    "stopped at cursor {}: resume with --after {} --replay-id {}\n",
                    cursor.unwrap_or(0),
                    cursor.unwrap_or(0),
                    report.replay_id
                ));
            }
            text
        },
    );
    Ok(())
}
