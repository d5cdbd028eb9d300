//! The WAL relay's streaming reader: a logical replication connection to the slot
//! (`START_REPLICATION SLOT … LOGICAL` with `pgoutput`, `messages 'true'`), on the
//! [`pgwire_replication`] client.
//!
//! **Why this client.** `pgwire-replication` speaks the replication protocol on tokio with
//! trust, cleartext, MD5 and SCRAM-SHA-256 logins, TCP and Unix sockets; it hands logical
//! decoding messages through untouched (prefix, content and the position pgoutput gives
//! them), reports commits with their end position and keepalives with the server's
//! `wal_end`, and reports as flushed exactly the position its user raised
//! (`update_applied_lsn`), never one it made up. Its worker task answers the server's
//! keepalives and sends a status update every status interval even while its event queue is
//! full, so a slow publish or a long outage backoff never lets `wal_sender_timeout` end the
//! session. Its TLS (rustls) is not built: pgbox's sqlx is built without TLS too, and a
//! pool that asks for TLS (`sslmode` require, verify-ca, verify-full) is refused with
//! [`WalStreamProblem::UnsupportedOption`] rather than connecting in plain text.
//!
//! **What is held.** Decoded transactions wait in [`Stream::pending`] until the round that
//! reads them settles them: the reader stops taking events once they hold
//! `max_in_flight_bytes` of message content (a single transaction larger than that is
//! taken whole), and the client's queue holds at most [`QUEUE_EVENTS`] more decoded changes
//! (each at most one emit).

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use futures_util::FutureExt;
use pgwire_replication::{
    Lsn, PgWireError, ReplicationClient, ReplicationConfig, ReplicationEvent,
};
use sqlx::postgres::{PgConnectOptions, PgSslMode};

use crate::error::{Error, WalStreamProblem};

use super::{SlotTransaction, TxAssembler};

/// Decoded changes the client's queue holds beyond what the reader took (each is one begin,
/// commit or emit): with 1 MiB emits, 64 MiB at most.
pub(super) const QUEUE_EVENTS: usize = 64;

/// How often the client tells the server the confirmed position (and that it is alive).
const STATUS_INTERVAL: Duration = Duration::from_millis(100);

/// A replication session on the slot and what it decoded that no round has settled yet.
pub(super) struct Stream {
    client: ReplicationClient,
    /// Whole transactions received, in commit order, not yet settled.
    pending: VecDeque<SlotTransaction>,
    /// Message content held in `pending` and the transaction being received.
    pending_bytes: usize,
    /// The transaction being received (after its begin, before its commit).
    assembler: TxAssembler,
    /// The furthest `wal_end` of a keepalive: every commit before it has been received
    /// (events arrive in order), so once everything received before it is settled, the slot
    /// may move there.
    seen: u64,
    /// Transactions ending at or before this were settled by this relay already (a session
    /// restarted from the server's confirmed position, which lags, sends them again).
    settled_upto: u64,
    /// A round holds the pending transactions (taken, not yet given back).
    taken: bool,
}

impl Stream {
    /// Opens a replication session on `slot` with the pool's connection settings, starting at
    /// `from` (0: the slot's confirmed position).
    pub(super) async fn open(
        options: &PgConnectOptions,
        slot: &str,
        prefix: String,
        from: u64,
    ) -> Result<Stream, Error> {
        let config = config(options, slot, from)?;
        let client = ReplicationClient::connect(config)
            .await
            .map_err(|e| stream_error(slot, e))?;
        Ok(Stream {
            client,
            pending: VecDeque::new(),
            pending_bytes: 0,
            assembler: TxAssembler::new(prefix),
            seen: from,
            settled_upto: from,
            taken: false,
        })
    }

    /// The furthest keepalive position received.
    pub(super) fn seen(&self) -> u64 {
        self.seen
    }

    /// Takes whatever the client has received (without waiting), up to `max_messages`
    /// messages or `max_bytes` of content in whole transactions.
    fn take_ready(
        &mut self,
        slot: &str,
        max_messages: usize,
        max_bytes: usize,
    ) -> Result<(), Error> {
        loop {
            if self.full(max_messages, max_bytes) {
                return Ok(());
            }
            match self.client.recv().now_or_never() {
                None => return Ok(()),
                Some(event) => self.take(slot, event)?,
            }
        }
    }

    fn full(&self, max_messages: usize, max_bytes: usize) -> bool {
        let messages: usize = self.pending.iter().map(|t| t.messages.len()).sum();
        !self.pending.is_empty() && (messages >= max_messages || self.pending_bytes >= max_bytes)
    }

    /// Waits at most `wait` for the client's next event, takes it and whatever follows it,
    /// until `done` says so (checked after each batch) or the time is up.
    pub(super) async fn read(
        &mut self,
        slot: &str,
        max_messages: usize,
        max_bytes: usize,
        wait: Duration,
        done: impl Fn(&Stream) -> bool,
    ) -> Result<(), Error> {
        let deadline = Instant::now() + wait;
        loop {
            self.take_ready(slot, max_messages, max_bytes)?;
            if !self.pending.is_empty() || done(self) {
                return Ok(());
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Ok(());
            }
            match tokio::time::timeout(left, self.client.recv()).await {
                Err(_) => return Ok(()),
                Ok(event) => self.take(slot, event)?,
            }
        }
    }

    fn take(
        &mut self,
        slot: &str,
        event: Result<Option<ReplicationEvent>, PgWireError>,
    ) -> Result<(), Error> {
        let event = event
            .map_err(|e| stream_error(slot, e))?
            .ok_or_else(|| Error::WalStream {
                slot: slot.to_owned(),
                problem: WalStreamProblem::Lost,
                reason: "the server ended the replication stream".into(),
            })?;
        let protocol = |reason: String| Error::WalSlot {
            slot: slot.to_owned(),
            reason: format!("unexpected pgoutput data: {reason}"),
        };
        match event {
            ReplicationEvent::KeepAlive { wal_end, .. } => {
                // Everything committed before it was sent before it: nothing is partly
                // received (a transaction is sent whole at its commit).
                if !self.assembler.in_transaction() {
                    self.seen = self.seen.max(wal_end.0);
                }
            }
            ReplicationEvent::Begin {
                commit_time_micros, ..
            } => self.assembler.begin(commit_time_micros).map_err(protocol)?,
            ReplicationEvent::Message {
                lsn,
                prefix,
                content,
                ..
            } => {
                self.pending_bytes += content.len();
                if let Some(t) = self
                    .assembler
                    .message(lsn.0, &prefix, &content)
                    .map_err(protocol)?
                {
                    self.push(t);
                }
            }
            ReplicationEvent::Commit { end_lsn, .. } => {
                if let Some(t) = self.assembler.commit(end_lsn.0) {
                    self.push(t);
                }
            }
            // Table changes: the publication has no tables. Nothing else is asked for.
            ReplicationEvent::XLogData { .. } | ReplicationEvent::StoppedAt { .. } => {}
        }
        Ok(())
    }

    fn push(&mut self, t: SlotTransaction) {
        if t.end_lsn <= self.settled_upto {
            self.pending_bytes = self.pending_bytes.saturating_sub(t.content_bytes());
            return;
        }
        self.pending.push_back(t);
    }

    /// Hands the pending transactions to a round.
    pub(super) fn take_pending(&mut self) -> Vec<SlotTransaction> {
        self.taken = true;
        self.pending.drain(..).collect()
    }

    /// Whether a round took the pending transactions and did not give them back (it was
    /// cancelled): what it held is no longer in memory.
    pub(super) fn taken(&self) -> bool {
        self.taken
    }

    /// Gives back what a round did not settle (it is offered again, from memory), and
    /// forgets what it did.
    pub(super) fn restore(&mut self, unsettled: Vec<SlotTransaction>, settled_bytes: usize) {
        self.taken = false;
        self.pending_bytes = self.pending_bytes.saturating_sub(settled_bytes);
        for t in unsettled.into_iter().rev() {
            self.pending.push_front(t);
        }
    }

    /// Tells the server (at the next status update) that everything before `lsn` is
    /// settled.
    pub(super) fn confirm(&mut self, lsn: u64) {
        self.settled_upto = self.settled_upto.max(lsn);
        self.client.update_applied_lsn(Lsn(lsn));
    }

    /// Waits (at most `wait`) until the client has sent the server a status update with the
    /// confirmed position, then ends the session: CopyDone, after that update.
    pub(super) async fn close(mut self, wait: Duration) {
        let deadline = Instant::now() + wait;
        while self.client.metrics().last_applied_lsn().0 < self.settled_upto
            && Instant::now() < deadline
        {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let left = deadline.saturating_duration_since(Instant::now()) + Duration::from_secs(1);
        if tokio::time::timeout(left, self.client.shutdown())
            .await
            .is_err()
        {
            self.client.abort();
        }
    }
}

/// The replication session's settings, from the pool's: host or socket, port, user,
/// password, database, `options`. TLS is not available to it: `sslmode` require, verify-ca
/// and verify-full are refused (allow and prefer connect in plain text, as the pool's own
/// connections do without TLS support).
fn config(options: &PgConnectOptions, slot: &str, from: u64) -> Result<ReplicationConfig, Error> {
    if matches!(
        options.get_ssl_mode(),
        PgSslMode::Require | PgSslMode::VerifyCa | PgSslMode::VerifyFull
    ) {
        return Err(Error::WalStream {
            slot: slot.to_owned(),
            problem: WalStreamProblem::UnsupportedOption,
            reason: format!(
                "the pool asks for sslmode={:?}, and the streaming reader has no TLS: connect \
                 in plain text (a private network, a Unix socket) or use WalReader::SqlFunctions",
                options.get_ssl_mode()
            ),
        });
    }
    let password = password_of(options).unwrap_or_default();
    let database = options
        .get_database()
        .unwrap_or(options.get_username())
        .to_owned();
    let user = options.get_username().to_owned();
    let host = match options.get_socket() {
        Some(socket) => {
            // sqlx takes the socket's directory or the socket file itself.
            let dir = match socket.file_name().and_then(|n| n.to_str()) {
                Some(name) if name.starts_with(".s.PGSQL.") => {
                    socket.parent().map(|p| p.to_path_buf()).unwrap_or_default()
                }
                _ => socket.clone(),
            };
            dir.to_string_lossy().into_owned()
        }
        None => options.get_host().to_owned(),
    };
    let mut config = ReplicationConfig::new(host, user, password, database, slot, slot)
        .with_port(options.get_port())
        .with_start_lsn(Lsn(from))
        .with_status_interval(STATUS_INTERVAL)
        .with_wakeup_interval(Duration::from_secs(1))
        .with_buffer_size(QUEUE_EVENTS)
        .with_application_name(
            options
                .get_application_name()
                .unwrap_or("pgbox WAL relay")
                .to_owned(),
        );
    config.tls = pgwire_replication::TlsConfig::disabled();
    if let Some(o) = options.get_options() {
        config = config.with_options(o.to_owned());
    }
    Ok(config)
}

/// The pool's password. sqlx has no getter for it, and its URL form panics for a Unix
/// socket: read it from the options' `Debug` form, which prints the fields in order
/// (`username: "…", password: Some("…")`), as Rust string literals.
fn password_of(options: &PgConnectOptions) -> Option<String> {
    let debug = format!("{options:?}");
    let field = format!("username: {:?}, password: Some(", options.get_username());
    let at = debug.find(&field)? + field.len();
    unescape_debug_str(&debug[at..])
}

/// The string a Rust `Debug` string literal at the start of `s` denotes.
fn unescape_debug_str(s: &str) -> Option<String> {
    let mut chars = s.strip_prefix('"')?.chars();
    let mut out = String::new();
    loop {
        match chars.next()? {
            '"' => return Some(out),
            '\\' => match chars.next()? {
                'n' => out.push('\n'),
                'r' => out.push('\r'),
                't' => out.push('\t'),
                '0' => out.push('\0'),
                'u' => {
                    if chars.next()? != '{' {
                        return None;
                    }
                    let hex: String = chars.by_ref().take_while(|&c| c != '}').collect();
                    out.push(char::from_u32(u32::from_str_radix(&hex, 16).ok()?)?);
                }
                c => out.push(c),
            },
            c => out.push(c),
        }
    }
}

/// The SQLSTATE in a server error's text (`… (SQLSTATE 42704)`).
fn sqlstate(message: &str) -> Option<&str> {
    let at = message.rfind("(SQLSTATE ")?;
    message.get(at + 10..at + 15)
}

/// A replication session's failure in words: the slot's state, or why the server refused
/// the session.
pub(super) fn stream_error(slot: &str, e: PgWireError) -> Error {
    let slot_error = |reason: String| Error::WalSlot {
        slot: slot.to_owned(),
        reason,
    };
    let problem = |problem: WalStreamProblem, reason: String| Error::WalStream {
        slot: slot.to_owned(),
        problem,
        reason,
    };
    match &e {
        PgWireError::Server(message) => {
            let m = message.as_str();
            match sqlstate(m) {
                Some("42704") if m.contains("publication") => problem(
                    WalStreamProblem::Refused,
                    format!("its publication is missing ({m}); create it with WalSlot::create"),
                ),
                Some("42704") => slot_error(format!(
                    "it does not exist ({m}); create it with WalSlot::create or `pgbox wal create-slot`"
                )),
                Some("55006") => slot_error(format!("another session reads it ({m})")),
                Some("55000")
                    if m.contains("can no longer get changes")
                        // PostgreSQL 18: "can no longer access replication slot".
                        || m.contains("can no longer access")
                        || m.contains("invalidated")
                        || m.contains("cannot read from logical replication slot") =>
                {
                    slot_error(format!(
                        "it was invalidated ({m}): the WAL it needed was removed \
                         (max_slot_wal_keep_size), and the messages in it are lost; drop and \
                         create the slot, and reconcile what producers committed since its \
                         last confirmed position"
                    ))
                }
                Some("55000") if m.contains("wal_level") => problem(
                    WalStreamProblem::Refused,
                    format!("logical decoding needs wal_level = logical ({m})"),
                ),
                Some("42501") => problem(
                    WalStreamProblem::NoReplicationPrivilege,
                    format!(
                        "the role may not open a replication connection ({m}): grant it \
                         REPLICATION (ALTER ROLE … REPLICATION), or use WalReader::SqlFunctions"
                    ),
                ),
                Some("28000") => problem(
                    WalStreamProblem::Refused,
                    format!(
                        "the server refuses replication connections from here ({m}): add a \
                         pg_hba.conf line for this database and role (a logical replication \
                         connection matches the database's name, not the `replication` \
                         keyword), or use WalReader::SqlFunctions"
                    ),
                ),
                Some("28P01") => problem(WalStreamProblem::Authentication, m.to_owned()),
                Some("53300") => problem(
                    WalStreamProblem::Refused,
                    format!("no walsender is free ({m}): raise max_wal_senders"),
                ),
                Some(c) if c.starts_with("57") || c.starts_with("08") => {
                    problem(WalStreamProblem::Lost, m.to_owned())
                }
                _ if m.contains("replication slot") => slot_error(m.to_owned()),
                _ => problem(WalStreamProblem::Refused, m.to_owned()),
            }
        }
        PgWireError::Auth(m) => problem(WalStreamProblem::Authentication, m.clone()),
        PgWireError::Tls(m) => problem(WalStreamProblem::UnsupportedOption, m.clone()),
        _ => problem(WalStreamProblem::Lost, e.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_password_comes_back_whole_also_with_a_unix_socket() {
        for password in [
            "plain",
            "p@ss:w/rd%20?#",
            "ünï cødé",
            "",
            "q\"uo\\te, password: Some(\"x\")",
            "tab\tnl\n\u{7f}\u{200b}",
        ] {
            let options = PgConnectOptions::new()
                .socket("/tmp")
                .username("u")
                .password(password)
                .database("d");
            let config = config(&options, "s", 0).unwrap();
            assert_eq!(config.password, password);
            assert_eq!(config.host, "/tmp");
            assert_eq!(config.database, "d");
            assert_eq!(config.user, "u");
        }
    }

    #[test]
    fn tls_the_client_cannot_give_is_refused_typed() {
        for mode in [
            PgSslMode::Require,
            PgSslMode::VerifyCa,
            PgSslMode::VerifyFull,
        ] {
            let options = PgConnectOptions::new().ssl_mode(mode);
            let err = config(&options, "s", 0).unwrap_err();
            assert!(
                matches!(
                    err,
                    Error::WalStream {
                        problem: WalStreamProblem::UnsupportedOption,
                        ..
                    }
                ),
                "{err:?}"
            );
        }
        let options = PgConnectOptions::new().ssl_mode(PgSslMode::Prefer);
        assert!(config(&options, "s", 0).is_ok());
    }

    #[test]
    fn server_errors_map_to_slot_states() {
        let e = |m: &str| stream_error("s", PgWireError::Server(m.into()));
        for invalidated in [
            "can no longer get changes from replication slot \"s\" (SQLSTATE 55000)",
            "can no longer access replication slot \"s\" (SQLSTATE 55000)",
        ] {
            let err = e(invalidated);
            assert!(
                matches!(&err, Error::WalSlot { reason, .. } if reason.contains("invalidated")),
                "{err:?}"
            );
        }
        assert!(
            matches!(e("replication slot \"s\" does not exist (SQLSTATE 42704)"), Error::WalSlot { reason, .. } if reason.contains("does not exist"))
        );
        assert!(
            matches!(e("replication slot \"s\" is active for PID 7 (SQLSTATE 55006)"), Error::WalSlot { reason, .. } if reason.contains("another session"))
        );
        assert!(matches!(
            e("must be superuser or replication role to start walsender (SQLSTATE 42501)"),
            Error::WalStream {
                problem: WalStreamProblem::NoReplicationPrivilege,
                ..
            }
        ));
        assert!(matches!(
            e("no pg_hba.conf entry for replication connection (SQLSTATE 28000)"),
            Error::WalStream {
                problem: WalStreamProblem::Refused,
                ..
            }
        ));
    }
}
