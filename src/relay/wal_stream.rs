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
//! session. With the `tls` feature its rustls TLS follows the pool's `sslmode`, `sslrootcert`,
//! `sslcert` and `sslkey` (see `tls_config` for how they map, and where its roots come
//! from); without it a pool that asks for TLS is refused ([`Error::Tls`],
//! [`TlsProblem::NotBuilt`]) rather than connected in plain text.
//!
//! **What is held.** Decoded transactions wait in [`Stream::pending`] until the round that
//! reads them settles them: the reader stops taking events once they hold
//! `max_in_flight_bytes` of message content (a single transaction larger than that is
//! taken whole), and the client's queue holds at most [`QUEUE_EVENTS`] more decoded changes
//! (each at most one emit).
//!
//! **A connection that goes silent.** A path that stops carrying bytes without a reset (a
//! dropped NAT flow, a partition) breaks nothing the client can see: it has no receive
//! deadline, and a healthy idle session may be silent for as long as nothing is committed.
//! So the relay watches the session from its lock connection, at every lock check (at
//! least once a second while it reads; see [`Liveness`]):
//! - the slot's `active_pid` must stay the walsender that took the slot when this session
//!   started (read once the server accepted `START_REPLICATION`). NULL or another pid means
//!   the server ended ours (a silent client is ended after `wal_sender_timeout`): the
//!   session is given up ([`WalStreamProblem::Silent`]) and the next round reconnects;
//! - half-open (the server hears the client's status updates, so it never times it out, but
//!   its bytes do not arrive): the walsender's `sent_lsn` (`pg_stat_replication`) is ahead
//!   of the furthest position the client received (the `wal_end` of its last message, or
//!   what the relay confirmed) while the walsender waits idle (`WalSenderWaitForWAL` or
//!   `WalSenderMain`: an idle walsender owing the client a position sends it a keepalive at
//!   each wake-up), and the relay is not holding back (its last read waited with the
//!   client's queue empty), and that position does not move for [`HALF_OPEN_AFTER`]: given
//!   up the same way. A walsender busy decoding (a large transaction of other work) or
//!   writing into a full socket is never counted, nor a relay at its byte budget, nor a
//!   session whose received position moves at all: backpressure is not silence. Without
//!   the right to read its walsender's row in `pg_stat_replication` (another role's), only
//!   the first check applies.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use futures_util::FutureExt;
use pgwire_replication::{
    Lsn, PgWireError, ReplicationClient, ReplicationConfig, ReplicationEvent,
};
use sqlx::postgres::PgConnectOptions;
#[cfg(feature = "tls")]
use sqlx::postgres::PgSslMode;

use pgwire_replication::TlsConfig;

use crate::error::{Error, TlsProblem, WalStreamProblem};

use super::{SlotTransaction, TxAssembler};

/// Decoded changes the client's queue holds beyond what the reader took (each is one begin,
/// commit or emit): with 1 MiB emits, 64 MiB at most.
pub(super) const QUEUE_EVENTS: usize = 64;

/// How often the client tells the server the confirmed position (and that it is alive).
const STATUS_INTERVAL: Duration = Duration::from_millis(100);

/// How long the server may wait idle having sent WAL the client did not receive, while the
/// relay is not holding back, before the session is given up as half-open.
pub(super) const HALF_OPEN_AFTER: Duration = Duration::from_secs(8);

/// How long opening a session may wait for the server to accept `START_REPLICATION`.
const START_WAIT: Duration = Duration::from_secs(30);

/// What the lock connection sees of the slot's walsender (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct WalsenderSample {
    /// The slot's `active_pid`.
    pub(super) active_pid: Option<i32>,
    /// The walsender's `sent_lsn`, when this role may read it.
    pub(super) sent_lsn: Option<u64>,
    /// Whether the walsender waits idle (for WAL, or in its main loop), not decoding and not
    /// blocked writing into its socket.
    pub(super) idle: bool,
}

/// The liveness bookkeeping of one replication session: which walsender serves it, and
/// since when the server has been owed a position that does not arrive.
#[derive(Debug, Default)]
pub(super) struct Liveness {
    walsender: Option<i32>,
    /// The received position, and when it was first seen behind an idle server's `sent_lsn`
    /// while the relay was not holding back.
    behind_since: Option<(u64, Instant)>,
}

impl Liveness {
    /// Judges one sample: `received` is the furthest position the client received (or the
    /// relay confirmed), `drained` whether the relay's last read waited with the client's
    /// queue empty. Errs with what is wrong when the session is to be given up.
    pub(super) fn check(
        &mut self,
        sample: WalsenderSample,
        received: u64,
        drained: bool,
        now: Instant,
    ) -> Result<(), String> {
        let Some(pid) = sample.active_pid else {
            return Err(match self.walsender {
                Some(ours) => format!(
                    "the server ended this relay's walsender (pid {ours}; the slot is not                      active): the replication connection went silent"
                ),
                None => "the slot is not active although the session started".into(),
            });
        };
        match self.walsender {
            None => self.walsender = Some(pid),
            Some(ours) if ours != pid => {
                return Err(format!(
                    "the slot is active for pid {pid}, not this relay's walsender (pid {ours}):                      the server ended this session"
                ));
            }
            Some(_) => {}
        }
        let owed = sample.idle && drained && sample.sent_lsn.is_some_and(|sent| sent > received);
        if !owed {
            self.behind_since = None;
            return Ok(());
        }
        match self.behind_since {
            Some((at, since)) if at == received => {
                if now.duration_since(since) >= HALF_OPEN_AFTER {
                    return Err(format!(
                        "the server sent WAL up to {} and waits, and this client received                          nothing past {} for {:?} while reading (a half-open connection)",
                        super::format_lsn(sample.sent_lsn.unwrap_or_default()),
                        super::format_lsn(received),
                        now.duration_since(since)
                    ));
                }
            }
            _ => self.behind_since = Some((received, now)),
        }
        Ok(())
    }
}

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
    /// The last read waited for the client's next event with its queue empty (the relay was
    /// not holding back).
    drained: bool,
    /// Whether the session still carries bytes (see the module docs).
    liveness: Liveness,
    /// The file of trusted authorities its client reads (removed when the session ends).
    _roots: Option<RootBundle>,
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
        let (config, roots) = config(options, slot, from)?;
        // The client reads its trusted authorities in its worker, during the handshake: the
        // bundle lives as long as the session.
        let mut client = ReplicationClient::connect(config)
            .await
            .map_err(|e| open_error(options, slot, e))?;
        // From then on the slot's walsender is this session's (see `Liveness`).
        match tokio::time::timeout(START_WAIT, client.wait_started()).await {
            Ok(started) => started.map_err(|e| open_error(options, slot, e))?,
            Err(_) => {
                client.abort();
                return Err(Error::WalStream {
                    slot: slot.to_owned(),
                    problem: WalStreamProblem::Lost,
                    reason: format!(
                        "the server did not start the replication session within {START_WAIT:?}"
                    ),
                });
            }
        }
        Ok(Stream {
            _roots: roots,
            client,
            pending: VecDeque::new(),
            pending_bytes: 0,
            assembler: TxAssembler::new(prefix),
            seen: from,
            settled_upto: from,
            taken: false,
            drained: false,
            liveness: Liveness::default(),
        })
    }

    /// Judges what the lock connection sees of the slot's walsender; an error ends the
    /// session (see the module docs).
    pub(super) fn check_alive(&mut self, slot: &str, sample: WalsenderSample) -> Result<(), Error> {
        let received = self
            .client
            .metrics()
            .last_wal_end()
            .0
            .max(self.seen)
            .max(self.settled_upto);
        self.liveness
            .check(sample, received, self.drained, Instant::now())
            .map_err(|reason| Error::WalStream {
                slot: slot.to_owned(),
                problem: WalStreamProblem::Silent,
                reason,
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
        self.drained = false;
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
                Err(_) => {
                    // Waited out with the queue empty: nothing of ours holds the client back.
                    self.drained = true;
                    return Ok(());
                }
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

impl Drop for Stream {
    /// A session dropped without [`close`](Stream::close) (a round failed, or its connection
    /// went silent) is cut at once: its worker's graceful stop would wait on a silent
    /// connection for good, keeping the socket (and, half-open, the walsender) alive.
    fn drop(&mut self) {
        self.client.abort();
    }
}

/// The replication session's settings, from the pool's: host or socket, port, user,
/// password, database, `options`, and TLS (see [`tls_config`]).
fn config(
    options: &PgConnectOptions,
    slot: &str,
    from: u64,
) -> Result<(ReplicationConfig, Option<RootBundle>), Error> {
    let (tls, roots) = tls_config(options, slot)?;
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
    config.tls = tls;
    if let Some(o) = options.get_options() {
        config = config.with_options(o.to_owned());
    }
    Ok((config, roots))
}

/// The pool's `sslmode` and certificate files as the replication client's TLS settings.
///
/// With the `tls` feature: `disable` and `allow` connect in plain text; `prefer` asks for
/// TLS and takes plain text when the server has none (a TLS handshake that fails is not
/// retried in plain text, unlike libpq); `require`, `verify-ca` and `verify-full` as in
/// libpq. The authorities trusted are the pool's: the system's store, plus the `sslrootcert`
/// file when one is given (`sslrootcert=system`: the store alone). The client takes them as
/// one PEM file only, so [`RootBundle`] writes them to a private file for the connection's
/// handshake. `verify-full` to an IP address checks the certificate's IP address entries.
/// `verify-ca` also checks the host name here (the client's chain-only verifier misses
/// rustls 0.23's name error): stricter than asked, never looser. Certificates given inline
/// (PEM text rather than a file) are refused: the client reads files only.
///
/// Without the feature, the modes that need TLS are refused ([`Error::Tls`] with
/// [`TlsProblem::NotBuilt`]), and `prefer` connects in plain text.
#[cfg(feature = "tls")]
fn tls_config(
    options: &PgConnectOptions,
    slot: &str,
) -> Result<(TlsConfig, Option<RootBundle>), Error> {
    let file = certificate_file(options, "ssl_root_cert", slot)?;
    let mode = options.get_ssl_mode();
    let bundle = match mode {
        PgSslMode::VerifyCa | PgSslMode::VerifyFull => {
            Some(RootBundle::write(file.as_deref(), options)?)
        }
        _ => None,
    };
    let root = bundle.as_ref().map(|b| b.0.clone());
    let mut tls = match mode {
        PgSslMode::Disable | PgSslMode::Allow => return Ok((TlsConfig::disabled(), None)),
        PgSslMode::Prefer => TlsConfig {
            mode: pgwire_replication::SslMode::Prefer,
            ..TlsConfig::default()
        },
        PgSslMode::Require => TlsConfig::require(),
        PgSslMode::VerifyCa => TlsConfig::verify_ca(root),
        PgSslMode::VerifyFull => {
            let tls = TlsConfig::verify_full(root);
            // The client refuses verify-full to an IP address unless told the name to check:
            // the address itself, which rustls matches against the certificate's IP entries.
            let host = options.get_host();
            if options.get_socket().is_none() && host.parse::<std::net::IpAddr>().is_ok() {
                tls.with_sni_hostname(host)
            } else {
                tls
            }
        }
    };
    let cert = certificate_file(options, "ssl_client_cert", slot)?;
    let key = certificate_file(options, "ssl_client_key", slot)?;
    match (cert, key) {
        (Some(cert), Some(key)) => tls = tls.with_client_cert(cert, key),
        (None, None) => {}
        _ => {
            return Err(Error::Tls {
                target: crate::connect::describe(options),
                problem: TlsProblem::BadFile,
                reason: "a client certificate needs both sslcert and sslkey".into(),
            });
        }
    }
    Ok((tls, bundle))
}

/// The authorities the replication connection trusts, as the one PEM file its client reads:
/// the system's store (as the pool's connections load it) and the `sslrootcert` file. A file
/// of this process's own, made with `create_new` (never one someone else placed there) and
/// removed once the connection has read it.
#[cfg(feature = "tls")]
#[derive(Debug)]
struct RootBundle(std::path::PathBuf);

#[cfg(not(feature = "tls"))]
#[derive(Debug)]
struct RootBundle;

#[cfg(feature = "tls")]
impl RootBundle {
    fn write(file: Option<&std::path::Path>, options: &PgConnectOptions) -> Result<Self, Error> {
        use std::io::Write;
        use std::os::unix::fs::OpenOptionsExt;
        let bad_file = |reason: String| Error::Tls {
            target: format!(
                "{} (the WAL relay's replication connection)",
                crate::connect::describe(options)
            ),
            problem: TlsProblem::BadFile,
            reason,
        };
        let mut pem = String::new();
        for cert in rustls_native_certs::load_native_certs().certs {
            pem.push_str(&pem_certificate(cert.as_ref()));
        }
        if let Some(file) = file {
            let text = std::fs::read_to_string(file).map_err(|e| {
                bad_file(format!("cannot read sslrootcert {}: {e}", file.display()))
            })?;
            pem.push_str(&text);
            pem.push('\n');
        }
        if pem.trim().is_empty() {
            return Err(bad_file(
                "no trusted authority: the system's certificate store is empty and no \
                 sslrootcert file is given"
                    .into(),
            ));
        }
        let path = std::env::temp_dir().join(format!(
            "pgbox-wal-roots-{}-{:016x}.pem",
            std::process::id(),
            fastrand::u64(..)
        ));
        let mut out = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&path)
            .map_err(|e| bad_file(format!("cannot write {}: {e}", path.display())))?;
        let bundle = RootBundle(path);
        out.write_all(pem.as_bytes())
            .map_err(|e| bad_file(format!("cannot write {}: {e}", bundle.0.display())))?;
        Ok(bundle)
    }
}

#[cfg(feature = "tls")]
impl Drop for RootBundle {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// One DER certificate as a PEM block.
#[cfg(feature = "tls")]
fn pem_certificate(der: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut encoded = String::with_capacity(der.len() * 4 / 3 + 4);
    for chunk in der.chunks(3) {
        let b = [
            chunk[0],
            *chunk.get(1).unwrap_or(&0),
            *chunk.get(2).unwrap_or(&0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for i in 0..4 {
            if i <= chunk.len() {
                encoded.push(ALPHABET[((n >> (18 - 6 * i)) & 63) as usize] as char);
            } else {
                encoded.push('=');
            }
        }
    }
    let mut pem = String::from("-----BEGIN CERTIFICATE-----\n");
    for line in encoded.as_bytes().chunks(64) {
        pem.push_str(std::str::from_utf8(line).expect("base64 is ASCII"));
        pem.push('\n');
    }
    pem.push_str("-----END CERTIFICATE-----\n");
    pem
}

#[cfg(not(feature = "tls"))]
fn tls_config(
    options: &PgConnectOptions,
    _slot: &str,
) -> Result<(TlsConfig, Option<RootBundle>), Error> {
    crate::connect::refuse_tls_not_built(options, " for the WAL relay's replication connection")?;
    Ok((TlsConfig::disabled(), None))
}

/// The file of one of the options' certificate fields (`ssl_root_cert`, `ssl_client_cert`,
/// `ssl_client_key`). sqlx has no getters for them: read from the options' `Debug` form
/// (`field: Some(File("…"))`, `Some(Inline([…]))` or `None`). An empty inline bundle (what
/// `sslrootcert=system` becomes) is no file; other inline PEM text is refused.
#[cfg(feature = "tls")]
fn certificate_file(
    options: &PgConnectOptions,
    field: &str,
    slot: &str,
) -> Result<Option<std::path::PathBuf>, Error> {
    let debug = format!("{options:?}");
    let Some(at) = debug.find(&format!("{field}: ")) else {
        return Ok(None);
    };
    let rest = &debug[at + field.len() + 2..];
    if let Some(file) = rest.strip_prefix("Some(File(") {
        return Ok(unescape_debug_str(file).map(std::path::PathBuf::from));
    }
    if rest.starts_with("Some(Inline([])") || rest.starts_with("None") {
        return Ok(None);
    }
    if rest.starts_with("Some(Inline(") {
        return Err(Error::WalStream {
            slot: slot.to_owned(),
            problem: WalStreamProblem::UnsupportedOption,
            reason: format!(
                "the pool's {field} is PEM text, and the replication client reads certificates \
                 and keys from files only: give a file path"
            ),
        });
    }
    Ok(None)
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

/// Opening a session failed: TLS failures (and a `cert` login without a valid client
/// certificate) as [`Error::Tls`] naming the server, the rest as [`stream_error`].
fn open_error(options: &PgConnectOptions, slot: &str, e: PgWireError) -> Error {
    let tls = |problem: TlsProblem, reason: String| Error::Tls {
        target: format!(
            "{} (the WAL relay's replication connection)",
            crate::connect::describe(options)
        ),
        problem,
        reason,
    };
    match &e {
        PgWireError::Tls(m) => tls(
            crate::tls::classify_text(m).unwrap_or(TlsProblem::Other),
            m.clone(),
        ),
        PgWireError::Server(m) if sqlstate(m) == Some("28000") && m.contains("certificate") => {
            tls(TlsProblem::ClientCertificate, m.clone())
        }
        _ => stream_error(slot, e),
    }
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
                Some("55006") => slot_error(format!("{} ({m})", super::SLOT_IN_USE)),
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
                    format!("{} ({m}): raise max_wal_senders", super::NO_FREE_WALSENDER),
                ),
                Some(c) if c.starts_with("57") || c.starts_with("08") => {
                    problem(WalStreamProblem::Lost, m.to_owned())
                }
                _ if m.contains("replication slot") => slot_error(m.to_owned()),
                _ => problem(WalStreamProblem::Refused, m.to_owned()),
            }
        }
        PgWireError::Auth(m) => problem(WalStreamProblem::Authentication, m.clone()),
        PgWireError::Tls(m) => Error::Tls {
            target: format!("the WAL relay's replication connection (slot {slot})"),
            problem: crate::tls::classify_text(m).unwrap_or(TlsProblem::Other),
            reason: m.clone(),
        },
        _ => problem(WalStreamProblem::Lost, e.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sqlx::postgres::PgSslMode;

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
            let (config, _) = config(&options, "s", 0).unwrap();
            assert_eq!(config.password, password);
            assert_eq!(config.host, "/tmp");
            assert_eq!(config.database, "d");
            assert_eq!(config.user, "u");
        }
    }

    #[cfg(not(feature = "tls"))]
    #[test]
    fn tls_without_the_feature_is_refused_typed() {
        for mode in [
            PgSslMode::Require,
            PgSslMode::VerifyCa,
            PgSslMode::VerifyFull,
        ] {
            let options = PgConnectOptions::new().ssl_mode(mode);
            let err = config(&options, "s", 0).unwrap_err();
            assert!(
                matches!(
                    &err,
                    Error::Tls {
                        problem: TlsProblem::NotBuilt,
                        reason,
                        ..
                    } if reason.contains("`tls` feature")
                ),
                "{err:?}"
            );
        }
        let options = PgConnectOptions::new().ssl_mode(PgSslMode::Prefer);
        assert!(config(&options, "s", 0).is_ok());
    }

    #[cfg(feature = "tls")]
    #[test]
    fn the_pools_tls_settings_become_the_clients() {
        use pgwire_replication::SslMode;
        let dir = std::env::temp_dir().join(format!("pgbox-wal-tls-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let ca_file = dir.join("ca \"q\".crt");
        let ca_text = "-----BEGIN CERTIFICATE-----\nTUFSS0VS\n-----END CERTIFICATE-----\n";
        std::fs::write(&ca_file, ca_text).unwrap();
        let base = || {
            PgConnectOptions::new()
                .host("127.0.0.1")
                .ssl_root_cert(&ca_file)
        };

        // verify-full: the bundle holds the sslrootcert file (beside the system's store),
        // lives while the session opens, and is gone after.
        let (full, bundle) = config(&base().ssl_mode(PgSslMode::VerifyFull), "s", 0).unwrap();
        assert_eq!(full.tls.mode, SslMode::VerifyFull);
        let bundle_path = full.tls.ca_pem_path.clone().unwrap();
        assert_ne!(bundle_path, ca_file);
        let bundled = std::fs::read_to_string(&bundle_path).unwrap();
        assert!(bundled.contains("TUFSS0VS"), "{bundled}");
        drop(bundle);
        assert!(!bundle_path.exists());
        assert_eq!(full.tls.sni_hostname.as_deref(), Some("127.0.0.1"));
        let named = base().host("db.internal").ssl_mode(PgSslMode::VerifyFull);
        assert_eq!(config(&named, "s", 0).unwrap().0.tls.sni_hostname, None);
        let (ca, _bundle) = config(&base().ssl_mode(PgSslMode::VerifyCa), "s", 0).unwrap();
        assert_eq!(ca.tls.mode, SslMode::VerifyCa);
        assert!(ca.tls.ca_pem_path.is_some());
        for (mode, expected) in [
            (PgSslMode::Disable, SslMode::Disable),
            (PgSslMode::Allow, SslMode::Disable),
            (PgSslMode::Prefer, SslMode::Prefer),
            (PgSslMode::Require, SslMode::Require),
        ] {
            let (config, bundle) = config(&base().ssl_mode(mode), "s", 0).unwrap();
            assert_eq!(config.tls.mode, expected);
            assert!(bundle.is_none(), "no certificate check, no bundle");
        }
        let mtls = base()
            .ssl_mode(PgSslMode::VerifyFull)
            .ssl_client_cert("/c.crt")
            .ssl_client_key("/c.key");
        let (mtls, _bundle) = config(&mtls, "s", 0).unwrap();
        assert_eq!(
            mtls.tls.client_cert_pem_path.as_deref(),
            Some(std::path::Path::new("/c.crt"))
        );
        assert_eq!(
            mtls.tls.client_key_pem_path.as_deref(),
            Some(std::path::Path::new("/c.key"))
        );
        let half = base()
            .ssl_mode(PgSslMode::Require)
            .ssl_client_cert("/c.crt");
        assert!(matches!(
            config(&half, "s", 0),
            Err(Error::Tls {
                problem: TlsProblem::BadFile,
                ..
            })
        ));
        let missing = base()
            .ssl_mode(PgSslMode::VerifyFull)
            .ssl_root_cert(dir.join("missing.crt"));
        assert!(matches!(
            config(&missing, "s", 0),
            Err(Error::Tls {
                problem: TlsProblem::BadFile,
                ..
            })
        ));
        // sslrootcert=system: the system's store alone (when the machine has one).
        let system = PgConnectOptions::new()
            .ssl_mode(PgSslMode::VerifyFull)
            .ssl_root_cert_from_pem(Vec::new());
        if let Ok((config, _bundle)) = config(&system, "s", 0) {
            let path = config.tls.ca_pem_path.unwrap();
            assert!(!std::fs::read_to_string(path).unwrap().contains("TUFSS0VS"));
        }
        let inline = PgConnectOptions::new()
            .ssl_mode(PgSslMode::VerifyFull)
            .ssl_root_cert_from_pem(b"-----BEGIN CERTIFICATE-----".to_vec());
        assert!(matches!(
            config(&inline, "s", 0),
            Err(Error::WalStream {
                problem: WalStreamProblem::UnsupportedOption,
                ..
            })
        ));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[cfg(feature = "tls")]
    #[test]
    fn pem_blocks_are_base64_of_the_der() {
        let pem = pem_certificate(b"any carnal pleas");
        assert_eq!(
            pem,
            "-----BEGIN CERTIFICATE-----\nYW55IGNhcm5hbCBwbGVhcw==\n-----END CERTIFICATE-----\n"
        );
        let long = pem_certificate(&[0xffu8; 100]);
        assert!(long.lines().all(|l| l.len() <= 64));
        assert!(pem_certificate(b"ab").contains("YWI=\n"));
    }

    #[test]
    fn tls_failures_of_the_replication_connection_are_typed() {
        let options = PgConnectOptions::new()
            .host("db.internal")
            .username("relay")
            .password("pw-never-shown")
            .database("orders");
        for (message, expected) in [
            (
                "TLS handshake failed: invalid peer certificate: UnknownIssuer",
                TlsProblem::UnknownIssuer,
            ),
            (
                "TLS handshake failed: invalid peer certificate: certificate expired: \
                 verification time 1795786155 (UNIX), but certificate is not valid after 1577923200",
                TlsProblem::Expired,
            ),
            (
                "server does not support TLS (SSLRequest rejected)",
                TlsProblem::NotOffered,
            ),
        ] {
            match open_error(&options, "s", PgWireError::Tls(message.into())) {
                Error::Tls {
                    problem, target, ..
                } => {
                    assert_eq!(problem, expected, "{message}");
                    assert!(
                        target.starts_with("relay@db.internal:5432/orders"),
                        "{target}"
                    );
                    assert!(!target.contains("pw-never-shown"));
                }
                other => panic!("{message}: {other:?}"),
            }
        }
        let refused = PgWireError::Server(
            "FATAL: connection requires a valid client certificate (SQLSTATE 28000)".into(),
        );
        assert!(matches!(
            open_error(&options, "s", refused),
            Error::Tls {
                problem: TlsProblem::ClientCertificate,
                ..
            }
        ));
        let wrong = PgWireError::Server(
            "FATAL: password authentication failed for user \"relay\" (SQLSTATE 28P01)".into(),
        );
        assert!(matches!(
            open_error(&options, "s", wrong),
            Error::WalStream {
                problem: WalStreamProblem::Authentication,
                ..
            }
        ));
    }

    fn sample(active_pid: Option<i32>, sent_lsn: u64, idle: bool) -> WalsenderSample {
        WalsenderSample {
            active_pid,
            sent_lsn: Some(sent_lsn),
            idle,
        }
    }

    #[test]
    fn a_walsender_gone_or_replaced_ends_the_session() {
        let now = Instant::now();
        let mut l = Liveness::default();
        assert!(l.check(sample(Some(7), 100, true), 100, true, now).is_ok());
        assert!(l.check(sample(None, 100, true), 100, true, now).is_err());
        let mut l = Liveness::default();
        assert!(l.check(sample(Some(7), 100, true), 100, true, now).is_ok());
        assert!(l.check(sample(Some(8), 100, true), 100, true, now).is_err());
    }

    #[test]
    fn an_idle_server_owed_a_position_that_never_arrives_ends_the_session_after_the_bound() {
        let t0 = Instant::now();
        let mut l = Liveness::default();
        let owed = sample(Some(7), 200, true);
        assert!(l.check(owed, 100, true, t0).is_ok());
        assert!(l.check(owed, 100, true, t0 + HALF_OPEN_AFTER / 2).is_ok());
        assert!(l.check(owed, 100, true, t0 + HALF_OPEN_AFTER).is_err());
    }

    #[test]
    fn backpressure_a_busy_server_and_progress_are_not_silence() {
        let t0 = Instant::now();
        let later = t0 + HALF_OPEN_AFTER * 3;
        // The relay holding back (its last read did not wait with the queue empty).
        let mut l = Liveness::default();
        assert!(l.check(sample(Some(7), 200, true), 100, false, t0).is_ok());
        assert!(
            l.check(sample(Some(7), 200, true), 100, false, later)
                .is_ok()
        );
        // The walsender busy (decoding, or writing into a full socket).
        let mut l = Liveness::default();
        assert!(l.check(sample(Some(7), 200, false), 100, true, t0).is_ok());
        assert!(
            l.check(sample(Some(7), 200, false), 100, true, later)
                .is_ok()
        );
        // The received position moves: the bound starts again.
        let mut l = Liveness::default();
        assert!(l.check(sample(Some(7), 900, true), 100, true, t0).is_ok());
        assert!(
            l.check(sample(Some(7), 900, true), 150, true, later)
                .is_ok()
        );
        assert!(
            l.check(
                sample(Some(7), 900, true),
                150,
                true,
                later + HALF_OPEN_AFTER / 2
            )
            .is_ok()
        );
        // Nothing owed, or sent_lsn not readable.
        let mut l = Liveness::default();
        assert!(l.check(sample(Some(7), 100, true), 100, true, t0).is_ok());
        assert!(
            l.check(sample(Some(7), 100, true), 100, true, later)
                .is_ok()
        );
        let hidden = WalsenderSample {
            active_pid: Some(7),
            sent_lsn: None,
            idle: true,
        };
        assert!(l.check(hidden, 100, true, t0).is_ok());
        assert!(l.check(hidden, 100, true, later).is_ok());
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
