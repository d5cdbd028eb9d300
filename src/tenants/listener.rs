//! One database's listener: a single connection that LISTENs on every tenant's channel of
//! that database and holds the asleep locks of the tenants that sleep.
//!
//! It runs as a task of its own, driven by commands from the scheduler, and reports
//! notifications, the outcome of each attempt to fall asleep, and the loss of its connection
//! (which releases every lock it held: the scheduler then wakes every tenant of the database).

use std::collections::HashSet;
use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgListener, PgPoolOptions};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::outbox::ASLEEP_LOCK_CLASS;

/// What the scheduler asks of a database's listener.
#[derive(Debug)]
pub(super) enum Command {
    /// LISTEN on the tenant's channel.
    Listen(String),
    /// Release the tenant's asleep lock if held, and UNLISTEN: the tenant is let go.
    Forget(String),
    /// Try to take the tenant's asleep lock (never waiting): answered with
    /// [`Event::Slept`].
    Sleep(String),
    /// Release the tenant's asleep lock: its producers stop notifying.
    Wake(String),
}

/// What a database's listener reports.
#[derive(Debug)]
pub(super) enum Event {
    /// A producer of `schema` committed while its tenant slept (`scheduled`: it scheduled
    /// a message rather than enqueued one).
    Woken {
        database: String,
        schema: String,
        scheduled: bool,
    },
    /// The outcome of [`Command::Sleep`].
    Slept {
        database: String,
        schema: String,
        asleep: Sleep,
    },
    /// The connection is made (again, after [`Event::Lost`]): its tenants may fall asleep.
    Connected { database: String },
    /// The connection was lost (or could not be made): no lock is held any more, and
    /// notifications may have been missed.
    Lost { database: String },
}

/// How an attempt to fall asleep went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Sleep {
    /// The lock is held on this listener's connection now.
    Held,
    /// Another session holds the lock exclusively: another relay sleeps on the tenant (its
    /// producers notify, and this listener hears them too).
    Elsewhere,
    /// Not taken: producers in flight hold it shared.
    Busy,
    /// Not taken: the listener is not connected ([`Event::Connected`] follows when it is).
    Away,
}

/// Takes the asleep lock if it is free; if not, tells whether another session holds it
/// exclusively (another relay asleep) from producers holding it shared. `pg_locks` is read
/// only when the lock is not taken.
const TRY_SLEEP: &str = "SELECT CASE \
       WHEN pg_catalog.pg_try_advisory_lock($1, pg_catalog.hashtext($2)) THEN 'held' \
       WHEN EXISTS (SELECT 1 FROM pg_catalog.pg_locks AS l \
         WHERE l.locktype = 'advisory' AND l.granted AND l.mode = 'ExclusiveLock' \
           AND l.objsubid = 2 \
           AND l.database = (SELECT d.oid FROM pg_catalog.pg_database AS d \
                             WHERE d.datname = pg_catalog.current_database()) \
           AND l.classid::bigint = $1::bigint \
           AND l.objid::bigint = (pg_catalog.hashtext($2)::bigint & 4294967295)) THEN 'elsewhere' \
       ELSE 'busy' END";

/// Runs a database's listener until `shutdown` is cancelled or the scheduler drops its
/// sender (the database was let go, or the relay's future was dropped). Dropping the
/// connection releases every lock it held.
pub(super) async fn run(
    database: String,
    options: PgConnectOptions,
    mut commands: mpsc::UnboundedReceiver<Command>,
    events: mpsc::UnboundedSender<Event>,
    shutdown: CancellationToken,
) {
    let mut channels: HashSet<String> = HashSet::new();
    let mut held: HashSet<String> = HashSet::new();
    let mut listener: Option<PgListener> = None;
    let mut failures: u32 = 0;
    let mut retry_at = tokio::time::Instant::now();
    loop {
        if listener.is_none() && tokio::time::Instant::now() >= retry_at {
            match connect(&options, &channels).await {
                Ok(l) => {
                    if failures > 0 {
                        tracing::info!(
                            database,
                            "pgbox tenant relay: the listener is connected again"
                        );
                    }
                    failures = 0;
                    held.clear();
                    listener = Some(l);
                    let _ = events.send(Event::Connected {
                        database: database.clone(),
                    });
                }
                Err(e) => {
                    if failures == 0 {
                        tracing::warn!(database, error = %e, "pgbox tenant relay cannot LISTEN; its tenants are polled meanwhile");
                    }
                    failures = failures.saturating_add(1);
                    retry_at = tokio::time::Instant::now()
                        + Duration::from_millis(250u64 << failures.min(7));
                    let _ = events.send(Event::Lost {
                        database: database.clone(),
                    });
                }
            }
        }
        let retry = tokio::time::sleep_until(retry_at.max(tokio::time::Instant::now()));
        let outcome = match listener.as_mut() {
            Some(l) => tokio::select! {
                _ = shutdown.cancelled() => return,
                command = commands.recv() => match command {
                    None => return,
                    Some(command) => obey(l, &database, command, &mut channels, &mut held, &events).await,
                },
                notice = l.try_recv() => match notice {
                    Ok(Some(n)) => {
                        if let Some(schema) = n.channel().strip_suffix(".outbox") {
                            let _ = events.send(Event::Woken {
                                database: database.clone(),
                                schema: schema.to_owned(),
                                scheduled: n.payload() == crate::outbox::scheduled::SCHEDULED_NOTICE,
                            });
                        }
                        Ok(())
                    }
                    Ok(None) => Err("the LISTEN connection closed".to_owned()),
                    Err(e) => Err(e.to_string()),
                },
            },
            None => tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = retry => Ok(()),
                command = commands.recv() => match command {
                    None => return,
                    Some(command) => {
                        // Not connected: remember what to LISTEN on, and stay awake.
                        match command {
                            Command::Listen(s) => { channels.insert(s); }
                            Command::Forget(s) => { channels.remove(&s); }
                            Command::Sleep(schema) => {
                                let _ = events.send(Event::Slept { database: database.clone(), schema, asleep: Sleep::Away });
                            }
                            Command::Wake(_) => {}
                        }
                        Ok(())
                    }
                },
            },
        };
        if let Err(error) = outcome {
            tracing::warn!(database, %error, "pgbox tenant relay lost its LISTEN connection; its tenants are woken");
            listener = None;
            held.clear();
            failures = 1;
            retry_at = tokio::time::Instant::now() + Duration::from_millis(250);
            let _ = events.send(Event::Lost {
                database: database.clone(),
            });
        }
    }
}

/// A listener on its own connection (not one of the rounds' pool), LISTENing on every
/// channel in `channels`.
async fn connect(
    options: &PgConnectOptions,
    channels: &HashSet<String>,
) -> crate::Result<PgListener> {
    let dedicated = PgPoolOptions::new()
        .max_connections(1)
        .min_connections(0)
        .idle_timeout(None)
        .max_lifetime(None)
        .acquire_timeout(Duration::from_secs(10))
        .connect_lazy_with(options.clone());
    let mut listener = PgListener::connect_with(&dedicated)
        .await
        .map_err(|e| crate::connect::session_connect_error(options, e))?;
    let names: Vec<String> = channels.iter().map(|s| channel(s)).collect();
    for chunk in names.chunks(500) {
        listener
            .listen_all(chunk.iter().map(String::as_str))
            .await?;
    }
    Ok(listener)
}

/// The tenant's notification channel (see [`Relay::channel`](crate::Relay::channel)).
fn channel(schema: &str) -> String {
    format!("{schema}.outbox")
}

/// Carries out one command on the connection. `Err`: the connection failed (every lock it
/// held is gone).
async fn obey(
    listener: &mut PgListener,
    database: &str,
    command: Command,
    channels: &mut HashSet<String>,
    held: &mut HashSet<String>,
    events: &mpsc::UnboundedSender<Event>,
) -> Result<(), String> {
    match command {
        Command::Listen(schema) => {
            if channels.insert(schema.clone()) {
                listener
                    .listen(&channel(&schema))
                    .await
                    .map_err(|e| e.to_string())?;
            }
        }
        Command::Forget(schema) => {
            if held.remove(&schema) {
                unlock(listener, &schema).await?;
            }
            if channels.remove(&schema) {
                listener
                    .unlisten(&channel(&schema))
                    .await
                    .map_err(|e| e.to_string())?;
            }
        }
        Command::Sleep(schema) => {
            // Never a blocking wait on the shared connection: a producer in flight holds the
            // lock shared until it commits, and its tenant stays awake (polled) meanwhile.
            let asleep = if held.contains(&schema) {
                Sleep::Held
            } else {
                let outcome = sqlx::query_scalar::<_, String>(TRY_SLEEP)
                    .bind(ASLEEP_LOCK_CLASS)
                    .bind(&schema)
                    .fetch_one(&mut *listener)
                    .await
                    .map_err(|e| e.to_string())?;
                match outcome.as_str() {
                    "held" => Sleep::Held,
                    "elsewhere" => Sleep::Elsewhere,
                    _ => Sleep::Busy,
                }
            };
            if asleep == Sleep::Held {
                held.insert(schema.clone());
            }
            let _ = events.send(Event::Slept {
                database: database.to_owned(),
                schema,
                asleep,
            });
        }
        Command::Wake(schema) => {
            if held.remove(&schema) {
                unlock(listener, &schema).await?;
            }
        }
    }
    Ok(())
}

async fn unlock(listener: &mut PgListener, schema: &str) -> Result<(), String> {
    sqlx::query("SELECT pg_catalog.pg_advisory_unlock($1, pg_catalog.hashtext($2))")
        .bind(ASLEEP_LOCK_CLASS)
        .bind(schema)
        .execute(&mut *listener)
        .await
        .map_err(|e| e.to_string())?;
    Ok(())
}
