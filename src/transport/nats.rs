//! The NATS JetStream transport (feature `nats`, on [`async_nats`]).
//!
//! [`Nats`] is both a [`Publisher`] for the relay and a [`Subscriber`] for the
//! [`Consumer`](crate::Consumer) runner. Clone it freely: clones share one client, which
//! reconnects by itself after the connection breaks.
//!
//! # TLS and credentials
//!
//! TLS is on when a URL says `tls://`, or with [`NatsBuilder::require_tls`], or when a CA file
//! ([`NatsBuilder::tls_root_certificates`]) or a client certificate
//! ([`NatsBuilder::tls_client_certificate`]) is given; the server's certificate is then always
//! verified (against the given CA file, else the system's roots), host name included. A
//! server that requires TLS also gets it from a `nats://` URL: the client upgrades when the
//! server's greeting asks, before it sends anything else.
//!
//! Credentials: [`NatsBuilder::user_password`], [`NatsBuilder::token`] or
//! [`NatsBuilder::nkey`], each a [`Secret`], or in the URL (`nats://user:password@host`,
//! `nats://token@host`, both percent-decoded). An NKey's seed never leaves the client (it
//! signs the server's nonce). A password or token travels in the clear unless TLS is on, whatever the
//! server's greeting says (a greeting is easy to forge), so [`NatsBuilder::build`] refuses
//! them with [`Error::InsecureCredentials`] when TLS is off and a server is not on loopback,
//! unless [`NatsBuilder::allow_insecure_credentials`] says so. With TLS off and credentials
//! sent to loopback servers, the servers a cluster announces are not dialled (they may be
//! elsewhere). The credentials never appear in a log line, an error or `Debug` output.
//!
//! A certificate the client does not accept, or a client certificate the server refuses, is
//! [`Error::Tls`] with its [`TlsProblem`]; credentials the server refuses
//! are [`Error::Authentication`]. Both are returned by the first connection attempt (one try
//! per server, each bounded by a 10 s timeout), not retried in the background.
//!
//! ```no_run
//! # async fn demo() -> pgbox::Result<()> {
//! use pgbox::transport::nats::Nats;
//!
//! let nats = Nats::builder("tls://nats.internal:4222")
//!     .tls_root_certificates("/etc/pgbox/nats-ca.pem")
//!     .user_password("orders", pgbox::Secret::from_file("/run/secrets/nats-password")?)
//!     .build()?;
//! # let _ = nats; Ok(()) }
//! ```
//!
//! # Streams and subjects
//!
//! A message of topic `T` is published on subject `<prefix>.<token(T)>` (default prefix
//! `pgbox`), where `token` keeps ASCII letters, digits and `-` and writes every other byte
//! as `_` plus two hex digits (`orders.paid` → `orders_2epaid`), so any topic is one valid
//! subject token. With [`NatsBuilder::declare`] on (the default), pgbox creates, if missing:
//! - the stream (default `PGBOX`) on `<prefix>.>`, file storage, limits retention with
//!   [`NatsBuilder::max_age`] (default 7 days) and the duplicate window
//!   [`NatsBuilder::duplicate_window`] (default 2 minutes), and [`NatsBuilder::replicas`]
//!   copies (default 1; 3 on a cluster);
//! - the dead-letter stream `<stream>_DEAD` on `<prefix>-dead.>`;
//! - per topic, a durable pull consumer `<durable>_<token(T)>` (default durable `pgbox`)
//!   filtered on the topic's subject, explicit acks, `ack_wait` =
//!   [`NatsBuilder::ack_wait`], unlimited deliveries (the consumer runner decides when to
//!   dead-letter).
//!
//! An existing stream or consumer is used as it is (its settings are not changed). Turn
//! `declare` off to create them yourself.
//!
//! # Publishing
//!
//! Every message carries `Nats-Msg-Id` = the outbox message id, so a relay re-publish within
//! the stream's duplicate window is dropped by the server (and reported `Ok`). Acks are
//! awaited concurrently: a batch is sent, then its acks are collected. Headers: pgbox's
//! fields travel as JSON in `Pgbox-Meta` (content type, ordering key, creation time, and the
//! message headers, byte-exact whatever their names); `traceparent` and `tracestate` are
//! also set as plain NATS headers for other tools. Messages larger than the server's
//! `max_payload` (1 MiB by default) fail; raise it in the server configuration if needed.
//!
//! # Receiving
//!
//! `receive` pulls from the durable consumer and returns as soon as it has messages: first up
//! to `max` of those already there, without waiting; if there are none, it waits up to
//! [`NatsBuilder::receive_wait`] for one, then takes up to `max - 1` more of those there by
//! then, without waiting. So a receive returns at once with what there is, or when the first
//! message arrives, or with nothing after `receive_wait`. A pull whose reply does not come (a
//! connection cut with the request in flight) is given up 1 s past the server's own deadline;
//! messages the server had sent it come back after `ack_wait`.
//!
//! The `visibility` argument does not apply: the consumer's `ack_wait` is the visibility
//! timeout (a message not acked in time is redelivered). The attempt is JetStream's
//! `num_delivered`. A nack with a delay is a `NAK` with that delay (the server redelivers no
//! earlier). A dead letter is copied (with publish ack) to the dead-letter stream with the
//! error in `Pgbox-Error`, then terminated (`TERM`) so it is never redelivered; inspect them
//! with [`Nats::dead_letters`] or any NATS tool.
//!
//! **Order**: a stream keeps publication order per subject, but a pull consumer hands
//! messages to whoever pulls, and redeliveries come back later. pgbox does not claim
//! per-key order on NATS; use
//! [`Inbox::process_in_order`](crate::Inbox::process_in_order) where order matters.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::path::PathBuf;
use std::sync::{Arc, Mutex as StdMutex};
use std::time::Duration;

use async_nats::HeaderMap;
use async_nats::jetstream::{self, AckKind, Context};
use bytes::Bytes;
use futures_util::StreamExt;
use futures_util::future::join_all;
use serde::{Deserialize, Serialize};
use time::OffsetDateTime;
use tokio::sync::OnceCell;
use uuid::Uuid;

use super::{PublishError, Publisher, Subscriber, truncate};
use crate::cloudevents::{self, CloudEvents, ContentMode, STRUCTURED_CONTENT_TYPE};
use crate::error::{Error, Result, TlsProblem};
use crate::outbox::{Envelope, TRACEPARENT};
use crate::secret::Secret;

const TRANSPORT: &str = "nats";
const META: &str = "Pgbox-Meta";
const ERROR: &str = "Pgbox-Error";
const DELIVERIES: &str = "Pgbox-Deliveries";
const MSG_ID: &str = "Nats-Msg-Id";
/// The message id on dead-letter copies, whose `Nats-Msg-Id` also names the delivery.
const ID: &str = "Pgbox-Id";
const MAX_ERROR_BYTES: usize = 4096;
/// Acks awaited at once; bigger batches go in chunks of this size.
const ACK_CHUNK: usize = 1000;
/// How long past the server's own deadline a pull waits for its reply before it counts as
/// lost (see `Nats::pull`).
const LOST_PULL: Duration = Duration::from_secs(1);

/// The pause before connection attempt number `attempts` (from 1): none before the first,
/// then 100 ms more per failed attempt, up to 2 s.
fn reconnect_delay(attempts: usize) -> Duration {
    Duration::from_millis((attempts.saturating_sub(1) as u64 * 100).min(2000))
}

fn broker_error(what: &str, e: impl fmt::Display) -> Error {
    Error::Transport {
        transport: TRANSPORT,
        message: format!("{what}: {e}"),
    }
}

/// How to connect, worked out (and checked) by [`NatsBuilder::build`].
#[derive(Clone)]
struct ConnectPlan {
    /// The server URLs without their user-info.
    servers: Vec<String>,
    /// `nats at <servers>`: for errors and logs.
    target: String,
    /// TLS with every server, discovered ones included.
    tls: bool,
    credentials: Option<Credentials>,
    /// Credentials go without TLS to loopback servers: dial no others.
    ignore_discovered_servers: bool,
    /// The client's TLS settings when a CA file is given (on the ring provider, named
    /// explicitly: a build may hold two rustls providers, and then has no default).
    tls_config: Option<async_nats::rustls::ClientConfig>,
}

/// A rustls configuration trusting the CA file `ca` alone, presenting `client` (certificate
/// and key files) when given; [`TlsProblem::BadFile`] for a file without what it must hold.
fn tls_config(
    target: &str,
    ca: &std::path::Path,
    client: Option<&(PathBuf, PathBuf)>,
) -> Result<async_nats::rustls::ClientConfig> {
    use async_nats::rustls::pki_types::pem::PemObject;
    use async_nats::rustls::pki_types::{CertificateDer, PrivateKeyDer};
    use async_nats::rustls::{ClientConfig, RootCertStore, crypto::ring};
    let bad = |path: &std::path::Path, what: String| Error::Tls {
        target: target.to_owned(),
        problem: TlsProblem::BadFile,
        reason: format!("{}: {what}", path.display()),
    };
    let certificates = |path: &std::path::Path| {
        CertificateDer::pem_file_iter(path)
            .and_then(|certs| certs.collect::<std::result::Result<Vec<_>, _>>())
            .map_err(|e| bad(path, format!("no PEM certificates read: {e}")))
            .and_then(|certs| {
                if certs.is_empty() {
                    Err(bad(path, "no PEM certificate in the file".into()))
                } else {
                    Ok(certs)
                }
            })
    };
    let mut roots = RootCertStore::empty();
    for cert in certificates(ca)? {
        roots
            .add(cert)
            .map_err(|e| bad(ca, format!("not a CA certificate: {e}")))?;
    }
    let builder = ClientConfig::builder_with_provider(Arc::new(ring::default_provider()))
        .with_safe_default_protocol_versions()
        .map_err(|e| Error::Tls {
            target: target.to_owned(),
            problem: TlsProblem::Other,
            reason: e.to_string(),
        })?
        .with_root_certificates(roots);
    match client {
        None => Ok(builder.with_no_client_auth()),
        Some((cert, key)) => {
            let chain = certificates(cert)?;
            // The key's parse error names no key material.
            let key_der = PrivateKeyDer::from_pem_file(key)
                .map_err(|e| bad(key, format!("no PEM private key read: {e}")))?;
            builder
                .with_client_auth_cert(chain, key_der)
                .map_err(|e| bad(cert, format!("certificate and key do not fit: {e}")))
        }
    }
}

/// `url` without its user-info, and the user-info's two parts (still percent-encoded).
fn split_userinfo(url: &str) -> (String, Option<(String, Option<String>)>) {
    let Some((scheme, rest)) = url.split_once("://") else {
        return split_userinfo(&format!("nats://{url}"));
    };
    // The user-info ends at the last '@': a password or token may hold '/', '?' or '#'
    // unencoded (base64 secrets do), and NATS URLs have no path or query to hold an '@'.
    match rest.rfind('@') {
        None => (url.to_owned(), None),
        Some(at) => {
            let userinfo = &rest[..at];
            let host = &rest[at + 1..];
            let parts = match userinfo.split_once(':') {
                Some((user, password)) => (user.to_owned(), Some(password.to_owned())),
                None => (userinfo.to_owned(), None),
            };
            (format!("{scheme}://{host}"), Some(parts))
        }
    }
}

/// A URL's user-info part percent-decoded; `None` when the result is not UTF-8.
fn percent_decode(text: &str) -> Option<String> {
    String::from_utf8(crate::percent::decode(text, false)).ok()
}

/// A comma-separated URL list with every user-info part replaced: `user:***@` for a user and
/// password, `***@` for a token.
fn redact_urls(urls: &str) -> String {
    urls.split(',')
        .map(|url| {
            let url = url.trim();
            match split_userinfo(url) {
                (_, None) => url.to_owned(),
                (bare, Some((user, Some(_)))) => {
                    bare.replacen("://", &format!("://{user}:***@"), 1)
                }
                (bare, Some((_, None))) => bare.replacen("://", "://***@", 1),
            }
        })
        .collect::<Vec<_>>()
        .join(",")
}

impl NatsBuilder {
    /// Checks the URLs, files and credentials; see [`NatsBuilder::build`].
    fn plan(&self) -> Result<ConnectPlan> {
        let mut servers = Vec::new();
        let mut hosts = Vec::new();
        let mut from_urls: Option<Credentials> = None;
        let mut any_tls_scheme = false;
        for raw in self.url.split(',').map(str::trim) {
            let (bare, userinfo) = split_userinfo(raw);
            let addr: async_nats::ServerAddr = bare.parse().map_err(|e| {
                Error::InvalidConfig(format!("nats server URL {}: {e}", redact_urls(raw)))
            })?;
            if addr.is_websocket() {
                return Err(Error::InvalidConfig(format!(
                    "nats server URL {}: WebSocket URLs are not supported",
                    redact_urls(raw)
                )));
            }
            any_tls_scheme |= addr.tls_required();
            if let Some((user, password)) = userinfo {
                let decode = |part: &str, what: &str| {
                    percent_decode(part).ok_or_else(|| {
                        Error::InvalidConfig(format!(
                            "nats server URL {}: the {what} is not UTF-8 once percent-decoded",
                            redact_urls(raw)
                        ))
                    })
                };
                let found = match password {
                    Some(password) => Credentials::UserPassword {
                        user: decode(&user, "user")?,
                        password: Secret::new(decode(&password, "password")?),
                    },
                    None => Credentials::Token(Secret::new(decode(&user, "token")?)),
                };
                match &from_urls {
                    Some(earlier) if *earlier != found => {
                        return Err(Error::InvalidConfig(
                            "nats server URLs carry different credentials: one client logs in \
                             to every server alike"
                                .into(),
                        ));
                    }
                    _ => from_urls = Some(found),
                }
            }
            hosts.push((addr.host().to_owned(), redact_urls(&bare)));
            servers.push(bare);
        }
        let credentials = match (&self.credentials, from_urls) {
            (Some(_), Some(_)) => {
                return Err(Error::InvalidConfig(
                    "nats credentials both in the URL and set on the builder: give them once"
                        .into(),
                ));
            }
            (Some(c), None) => Some(c.clone()),
            (None, c) => c,
        };
        let target = format!("nats at {}", servers.join(","));
        for path in self
            .root_certificates
            .iter()
            .chain(self.client_certificate.iter().flat_map(|(c, k)| [c, k]))
        {
            if let Err(e) = std::fs::File::open(path) {
                return Err(Error::Tls {
                    target: target.clone(),
                    problem: TlsProblem::BadFile,
                    reason: format!("cannot read {}: {e}", path.display()),
                });
            }
        }
        let tls_config = match &self.root_certificates {
            Some(ca) => Some(tls_config(&target, ca, self.client_certificate.as_ref())?),
            None => None,
        };
        let tls = self.require_tls
            || any_tls_scheme
            || self.root_certificates.is_some()
            || self.client_certificate.is_some();
        let mut ignore_discovered_servers = false;
        if let Some(Credentials::NKey(seed)) = &credentials {
            let seed = seed.expose();
            let base32 = seed
                .bytes()
                .all(|b| b.is_ascii_uppercase() || (b'2'..=b'7').contains(&b));
            if !(seed.len() == 58 && seed.starts_with("SU") && base32) {
                return Err(Error::InvalidConfig(
                    "the NATS NKey is not a user seed (58 characters of base32, starting SU;                      give the seed, not the public key)"
                        .into(),
                ));
            }
        }
        let sent_as_is = credentials.as_ref().is_some_and(Credentials::sent_as_is);
        if sent_as_is && !tls && !self.allow_insecure_credentials {
            if let Some((_, url)) = hosts
                .iter()
                .find(|(host, _)| !crate::tls::is_loopback(host))
            {
                return Err(Error::InsecureCredentials {
                    transport: TRANSPORT,
                    setting: "allow_insecure_credentials",
                    reason: format!(
                        "{url} is not on loopback and TLS is off: use a tls:// URL or \
                         require_tls(true) (or allow_insecure_credentials(true) on a network \
                         you trust)"
                    ),
                });
            }
            ignore_discovered_servers = true;
        }
        Ok(ConnectPlan {
            servers,
            target,
            tls,
            credentials,
            ignore_discovered_servers,
            tls_config,
        })
    }
}

/// A failed first connection, typed: refused credentials, a TLS failure, or else an outage.
fn connect_error(target: &str, e: &async_nats::ConnectError) -> Error {
    use async_nats::ConnectErrorKind as Kind;
    match e.kind() {
        Kind::AuthorizationViolation => Error::Authentication {
            target: target.to_owned(),
            reason: "the server refused the credentials (authorization violation): a wrong \
                     user, password or token, or none where one is required"
                .into(),
        },
        Kind::Authentication => Error::Authentication {
            target: target.to_owned(),
            reason: format!("the client could not authenticate: {e}"),
        },
        _ => match crate::tls::classify(e) {
            Some(problem) => Error::Tls {
                target: target.to_owned(),
                problem,
                reason: format!("{problem}: {}", error_chain(e)),
            },
            None => broker_error(&format!("connect to {target}"), error_chain(e)),
        },
    }
}

/// An error and its sources, `: `-separated (bounded), without repeats.
fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut out = e.to_string();
    let mut current = e.source();
    for _ in 0..8 {
        let Some(source) = current else { break };
        let text = source.to_string();
        if !out.contains(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
        current = source.source();
    }
    out
}

/// Credentials that travel to the server as they are (so only over TLS, or to loopback).
#[derive(Clone, PartialEq, Eq)]
enum Credentials {
    UserPassword {
        user: String,
        password: Secret,
    },
    Token(Secret),
    /// An NKey seed: the client signs the server's nonce; the seed never leaves.
    NKey(Secret),
}

impl Credentials {
    /// Whether the secret itself travels to the server (and so needs TLS off loopback).
    fn sent_as_is(&self) -> bool {
        !matches!(self, Credentials::NKey(_))
    }
}

impl fmt::Debug for Credentials {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Credentials::UserPassword { user, .. } => f
                .debug_struct("UserPassword")
                .field("user", user)
                .field("password", &"***")
                .finish(),
            Credentials::Token(_) => f.write_str("Token(***)"),
            Credentials::NKey(_) => f.write_str("NKey(***)"),
        }
    }
}

/// Builder for [`Nats`]. Its `Debug` shows no credentials.
#[derive(Clone)]
pub struct NatsBuilder {
    url: String,
    require_tls: bool,
    root_certificates: Option<PathBuf>,
    client_certificate: Option<(PathBuf, PathBuf)>,
    credentials: Option<Credentials>,
    allow_insecure_credentials: bool,
    stream: String,
    subject_prefix: String,
    durable: String,
    declare: bool,
    ack_wait: Duration,
    max_ack_pending: i64,
    max_age: Duration,
    duplicate_window: Duration,
    replicas: usize,
    receive_wait: Duration,
    inactive_threshold: Option<Duration>,
    cloudevents: Option<CloudEvents>,
}

impl fmt::Debug for NatsBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NatsBuilder")
            .field("url", &redact_urls(&self.url))
            .field("require_tls", &self.require_tls)
            .field("root_certificates", &self.root_certificates)
            .field("client_certificate", &self.client_certificate)
            .field("credentials", &self.credentials)
            .field(
                "allow_insecure_credentials",
                &self.allow_insecure_credentials,
            )
            .field("stream", &self.stream)
            .field("subject_prefix", &self.subject_prefix)
            .field("durable", &self.durable)
            .field("declare", &self.declare)
            .finish_non_exhaustive()
    }
}

impl NatsBuilder {
    /// Use TLS with every server (default `false`, unless a URL says `tls://` or a CA file or
    /// client certificate is given): a server without TLS is then an error, never a
    /// clear-text fallback. The server's certificate is always verified.
    pub fn require_tls(mut self, required: bool) -> Self {
        self.require_tls = required;
        self
    }

    /// Trust the certificate authorities in this PEM file (instead of the system's) for the
    /// servers' certificates. Turns TLS on.
    pub fn tls_root_certificates(mut self, path: impl Into<PathBuf>) -> Self {
        self.root_certificates = Some(path.into());
        self
    }

    /// Present this client certificate (PEM) with its private key (PEM) to servers that ask
    /// for one (`verify: true` in the server's `tls` block). Turns TLS on.
    pub fn tls_client_certificate(
        mut self,
        certificate: impl Into<PathBuf>,
        key: impl Into<PathBuf>,
    ) -> Self {
        self.client_certificate = Some((certificate.into(), key.into()));
        self
    }

    /// Log in as `user` with `password`. Sent as it is: see the [module docs](self) on when
    /// it may go without TLS.
    pub fn user_password(mut self, user: impl Into<String>, password: Secret) -> Self {
        self.credentials = Some(Credentials::UserPassword {
            user: user.into(),
            password,
        });
        self
    }

    /// Log in with an authorization token. Sent as it is: see the [module docs](self) on
    /// when it may go without TLS.
    pub fn token(mut self, token: Secret) -> Self {
        self.credentials = Some(Credentials::Token(token));
        self
    }

    /// Log in with an NKey: `seed` is the user's seed (`SU…`), whose public key the server
    /// lists. The client signs the server's nonce with it; the seed itself is never sent, so
    /// an NKey needs no TLS to stay secret (the session is still readable without TLS).
    pub fn nkey(mut self, seed: Secret) -> Self {
        self.credentials = Some(Credentials::NKey(seed));
        self
    }

    /// Send a password or token to servers that are not on loopback without TLS (default
    /// `false`: [`build`](Self::build) refuses it with [`Error::InsecureCredentials`]).
    /// For a network you trust; anyone on the path can read them.
    pub fn allow_insecure_credentials(mut self, allow: bool) -> Self {
        self.allow_insecure_credentials = allow;
        self
    }

    /// The stream's name (default `PGBOX`); the dead letters go to `<stream>_DEAD`.
    pub fn stream(mut self, name: impl Into<String>) -> Self {
        self.stream = name.into();
        self
    }

    /// The subject prefix (default `pgbox`): topic `T` is `<prefix>.<token(T)>`.
    pub fn subject_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.subject_prefix = prefix.into();
        self
    }

    /// The durable consumer name's prefix (default `pgbox`). Consumers sharing it share the
    /// topic's messages; give each consuming service its own.
    pub fn durable(mut self, name: impl Into<String>) -> Self {
        self.durable = name.into();
        self
    }

    /// Create the streams and consumers when missing (default `true`).
    pub fn declare(mut self, declare: bool) -> Self {
        self.declare = declare;
        self
    }

    /// How long a delivered message may stay unacked before it is redelivered (default
    /// 30 s): the visibility timeout. Must exceed the handler's worst case.
    pub fn ack_wait(mut self, wait: Duration) -> Self {
        self.ack_wait = wait;
        self
    }

    /// Unacked messages per consumer (default 1000).
    pub fn max_ack_pending(mut self, n: i64) -> Self {
        self.max_ack_pending = n;
        self
    }

    /// How long the stream keeps messages, acked or not (default 7 days).
    pub fn max_age(mut self, age: Duration) -> Self {
        self.max_age = age;
        self
    }

    /// The stream's duplicate window for `Nats-Msg-Id` (default 2 minutes).
    pub fn duplicate_window(mut self, window: Duration) -> Self {
        self.duplicate_window = window;
        self
    }

    /// Copies of each stream kept on a JetStream cluster (default 1; 3 or 5 on a cluster of
    /// at least as many servers). Applies when pgbox creates the streams; their durable
    /// consumers get the stream's replicas.
    pub fn replicas(mut self, n: usize) -> Self {
        self.replicas = n;
        self
    }

    /// How long `receive` waits for a message when none is there (default 200 ms).
    pub fn receive_wait(mut self, wait: Duration) -> Self {
        self.receive_wait = wait;
        self
    }

    /// Delete a durable consumer after it has been idle this long (default: never). For
    /// tests and throwaway topics.
    pub fn inactive_threshold(mut self, idle: Duration) -> Self {
        self.inactive_threshold = Some(idle);
        self
    }

    /// Publishes every message as a CloudEvent ([`crate::cloudevents`]): in binary mode the
    /// attributes are headers `ce-<name>` and `datacontenttype` is `content-type` (the NATS
    /// binding's binary mode); `Nats-Msg-Id` stays the message id, so JetStream still drops
    /// re-publishes. Receiving reads CloudEvents and native messages alike, with or without
    /// this.
    pub fn cloudevents(mut self, config: CloudEvents) -> Self {
        self.cloudevents = Some(config);
        self
    }

    /// Validates the settings. Connects lazily, on first use.
    ///
    /// Errors: [`Error::InvalidConfig`] for a malformed URL or setting,
    /// [`Error::Tls`] ([`TlsProblem::BadFile`]) for an unreadable certificate or key file,
    /// [`Error::InsecureCredentials`] for a password or token that would cross the network
    /// in clear text (see the [module docs](self)). Nothing here touches the network.
    pub fn build(self) -> Result<Nats> {
        let plan = self.plan()?;
        let name_ok = |s: &str| {
            !s.is_empty()
                && s.chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
        };
        if !name_ok(&self.stream) || !name_ok(&self.durable) {
            return Err(Error::InvalidConfig(
                "nats stream and durable names: ASCII letters, digits, '-' and '_'".into(),
            ));
        }
        if self.subject_prefix.is_empty()
            || self
                .subject_prefix
                .split('.')
                .any(|t| t.is_empty() || t.contains(['*', '>', ' ']))
        {
            return Err(Error::InvalidConfig(
                "nats subject prefix must be dot-separated non-empty tokens without wildcards"
                    .into(),
            ));
        }
        if self.replicas == 0 {
            return Err(Error::InvalidConfig(
                "nats replicas must be at least 1".into(),
            ));
        }
        if self.receive_wait < Duration::from_millis(10) || self.ack_wait.is_zero() {
            return Err(Error::InvalidConfig(
                "nats receive_wait must be at least 10 ms and ack_wait positive".into(),
            ));
        }
        Ok(Nats {
            inner: Arc::new(Inner {
                plan,
                config: self,
                client: OnceCell::new(),
                consumers: StdMutex::new(HashMap::new()),
                streams: OnceCell::new(),
            }),
        })
    }
}

/// The NATS JetStream transport: see the [module docs](self). Cheap to clone.
#[derive(Clone)]
pub struct Nats {
    inner: Arc<Inner>,
}

impl fmt::Debug for Nats {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Nats")
            .field("stream", &self.inner.config.stream)
            .field("subject_prefix", &self.inner.config.subject_prefix)
            .finish_non_exhaustive()
    }
}

type PullConsumer = jetstream::consumer::Consumer<jetstream::consumer::pull::Config>;

struct Inner {
    config: NatsBuilder,
    plan: ConnectPlan,
    client: OnceCell<(async_nats::Client, Context)>,
    consumers: StdMutex<HashMap<String, PullConsumer>>,
    streams: OnceCell<()>,
}

/// A message received from [`Nats`]: settle it with `ack`, `nack` or `dead_letter`.
pub struct NatsDelivery {
    envelope: Envelope,
    attempt: i32,
    message: jetstream::Message,
}

impl fmt::Debug for NatsDelivery {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NatsDelivery")
            .field("message_id", &self.envelope.id)
            .field("attempt", &self.attempt)
            .finish_non_exhaustive()
    }
}

impl NatsDelivery {
    /// The message.
    pub fn envelope(&self) -> &Envelope {
        &self.envelope
    }

    /// JetStream's delivery count: 1 for a first delivery.
    pub fn attempt(&self) -> i32 {
        self.attempt
    }
}

/// A dead-lettered message, as [`Nats::dead_letters`] shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct NatsDeadLetter {
    /// The message.
    pub envelope: Envelope,
    /// The error given when it was dead-lettered.
    pub error: Option<String>,
    /// Deliveries before it was dead-lettered.
    pub deliveries: i32,
    /// Its sequence number in the dead-letter stream.
    pub sequence: u64,
}

/// pgbox's fields, as JSON in one header: exact whatever the header names and values.
#[derive(Serialize, Deserialize)]
struct Meta {
    content_type: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    ordering_key: Option<String>,
    created_at: i128,
    #[serde(default)]
    headers: BTreeMap<String, String>,
}

/// One subject token (and consumer-name part) for any topic, reversible and collision-free.
pub fn token(topic: &str) -> String {
    let mut out = String::with_capacity(topic.len());
    for b in topic.bytes() {
        if b.is_ascii_alphanumeric() || b == b'-' {
            out.push(b as char);
        } else {
            out.push_str(&format!("_{b:02x}"));
        }
    }
    out
}

impl Nats {
    /// A transport for the server at `url` (`nats://host:port`), or for any server of a
    /// cluster given as a comma-separated list (`nats://a:4222,nats://b:4222`): the client
    /// connects to one of them and fails over to the others (and to the servers the
    /// cluster announces).
    pub fn builder(url: impl Into<String>) -> NatsBuilder {
        NatsBuilder {
            url: url.into(),
            require_tls: false,
            root_certificates: None,
            client_certificate: None,
            credentials: None,
            allow_insecure_credentials: false,
            stream: "PGBOX".into(),
            subject_prefix: "pgbox".into(),
            durable: "pgbox".into(),
            declare: true,
            ack_wait: Duration::from_secs(30),
            max_ack_pending: 1000,
            max_age: Duration::from_secs(7 * 24 * 3600),
            duplicate_window: Duration::from_secs(120),
            replicas: 1,
            receive_wait: Duration::from_millis(200),
            inactive_threshold: None,
            cloudevents: None,
        }
    }

    /// The subject of `topic`.
    pub fn subject(&self, topic: &str) -> String {
        format!("{}.{}", self.inner.config.subject_prefix, token(topic))
    }

    /// The dead-letter subject of `topic`.
    pub fn dead_letter_subject(&self, topic: &str) -> String {
        format!("{}-dead.{}", self.inner.config.subject_prefix, token(topic))
    }

    fn dead_stream(&self) -> String {
        format!("{}_DEAD", self.inner.config.stream)
    }

    async fn context(&self) -> Result<&Context> {
        let (_, context) = self
            .inner
            .client
            .get_or_try_init(|| async {
                let plan = &self.inner.plan;
                let mut options = async_nats::ConnectOptions::new()
                    .connection_timeout(Duration::from_secs(10))
                    // `attempts` counts the attempt about to be made, from 1: the first
                    // connect and the first try after a break go at once.
                    .reconnect_delay_callback(reconnect_delay)
                    .event_callback(|event| async move {
                        tracing::info!(%event, "pgbox nats connection event");
                    });
                if plan.tls {
                    options = options.require_tls(true);
                }
                match &plan.tls_config {
                    Some(config) => options = options.tls_client_config(config.clone()),
                    None => {
                        crate::tls::ensure_crypto_provider();
                        if let Some((cert, key)) = &self.inner.config.client_certificate {
                            options = options.add_client_certificate(cert.clone(), key.clone());
                        }
                    }
                }
                match &plan.credentials {
                    Some(Credentials::UserPassword { user, password }) => {
                        options =
                            options.user_and_password(user.clone(), password.expose().to_owned());
                    }
                    Some(Credentials::Token(token)) => {
                        options = options.token(token.expose().to_owned());
                    }
                    Some(Credentials::NKey(seed)) => {
                        options = options.nkey(seed.expose().to_owned());
                    }
                    None => {}
                }
                if plan.ignore_discovered_servers {
                    options = options.ignore_discovered_servers();
                }
                let client = options
                    .connect(plan.servers.clone())
                    .await
                    .map_err(|e| connect_error(&plan.target, &e))?;
                tracing::info!(target = %plan.target, tls = plan.tls, "pgbox nats connected");
                let context = jetstream::new(client.clone());
                Ok::<_, Error>((client, context))
            })
            .await?;
        if self.inner.config.declare {
            self.inner
                .streams
                .get_or_try_init(|| self.declare_streams(context))
                .await?;
        }
        Ok(context)
    }

    async fn declare_streams(&self, context: &Context) -> Result<()> {
        let config = &self.inner.config;
        for (name, subjects) in [
            (
                config.stream.clone(),
                format!("{}.>", config.subject_prefix),
            ),
            (
                self.dead_stream(),
                format!("{}-dead.>", config.subject_prefix),
            ),
        ] {
            context
                .get_or_create_stream(jetstream::stream::Config {
                    name: name.clone(),
                    subjects: vec![subjects],
                    max_age: config.max_age,
                    duplicate_window: config.duplicate_window,
                    storage: jetstream::stream::StorageType::File,
                    allow_direct: true,
                    num_replicas: config.replicas,
                    ..Default::default()
                })
                .await
                .map_err(|e| broker_error(&format!("create stream {name}"), e))?;
        }
        tracing::debug!(stream = %config.stream, "pgbox nats streams ready");
        Ok(())
    }

    /// The largest payload the server takes, once connected.
    pub async fn max_payload(&self) -> Result<usize> {
        self.context().await?;
        let (client, _) = self.inner.client.get().expect("connected");
        Ok(client.server_info().max_payload)
    }

    /// Creates the topic's durable consumer if missing (idempotent), so that messages
    /// published from now on are kept for it even before the first `receive`.
    pub async fn declare_topic(&self, topic: &str) -> Result<()> {
        self.consumer(topic).await.map(drop)
    }

    async fn consumer(&self, topic: &str) -> Result<PullConsumer> {
        if let Some(c) = self.inner.consumers.lock().expect("consumers").get(topic) {
            return Ok(c.clone());
        }
        let context = self.context().await?;
        let config = &self.inner.config;
        let name = format!("{}_{}", config.durable, token(topic));
        let stream = context
            .get_stream(&config.stream)
            .await
            .map_err(|e| broker_error("get stream", e))?;
        let consumer_config = jetstream::consumer::pull::Config {
            durable_name: Some(name.clone()),
            ack_policy: jetstream::consumer::AckPolicy::Explicit,
            ack_wait: config.ack_wait,
            max_deliver: -1,
            max_ack_pending: config.max_ack_pending,
            filter_subject: self.subject(topic),
            inactive_threshold: config.inactive_threshold.unwrap_or_default(),
            ..Default::default()
        };
        let consumer: PullConsumer = if config.declare {
            stream
                .get_or_create_consumer(&name, consumer_config)
                .await
                .map_err(|e| broker_error(&format!("create consumer {name}"), e))?
        } else {
            stream
                .get_consumer(&name)
                .await
                .map_err(|e| broker_error(&format!("get consumer {name}"), e))?
        };
        tracing::info!(topic, consumer = %name, "pgbox nats consumer ready");
        self.inner
            .consumers
            .lock()
            .expect("consumers")
            .insert(topic.to_owned(), consumer.clone());
        Ok(consumer)
    }

    /// One pull of up to `max` messages of `topic` into `out`: without waiting (`wait`
    /// `None`: the server answers at once with what it has) or for up to `wait`. Every step
    /// is bounded: a reply lost with a cut connection (the client reconnects and
    /// resubscribes, but nothing answers a request sent before the cut; a no-wait pull has no
    /// timer of its own) ends the pull after [`LOST_PULL`] past the server's own deadline.
    /// Messages the server sent to a pull given up on come back after `ack_wait`.
    async fn pull(
        &self,
        topic: &str,
        consumer: &PullConsumer,
        max: usize,
        wait: Option<Duration>,
        out: &mut Vec<NatsDelivery>,
    ) -> Result<()> {
        let started = match wait {
            None => {
                tokio::time::timeout(LOST_PULL, consumer.fetch().max_messages(max).messages()).await
            }
            Some(wait) => {
                tokio::time::timeout(
                    LOST_PULL,
                    consumer.batch().max_messages(max).expires(wait).messages(),
                )
                .await
            }
        };
        let mut batch = match started {
            Ok(Ok(b)) => b,
            Ok(Err(e)) => {
                // The consumer may be gone (deleted, or expired while idle): look it up
                // again next time.
                self.inner
                    .consumers
                    .lock()
                    .expect("consumers")
                    .remove(topic);
                return Err(broker_error("pull", e));
            }
            Err(_) => return Err(broker_error("pull", "request not sent in time")),
        };
        // Bounded: at most `max` messages, each within `wait` + LOST_PULL.
        let patience = wait.unwrap_or_default() + LOST_PULL;
        loop {
            let message = match tokio::time::timeout(patience, batch.next()).await {
                Ok(Some(Ok(m))) => m,
                Ok(None) => return Ok(()),
                Ok(Some(Err(e))) => return Err(broker_error("pull", e)),
                Err(_) => {
                    return Err(broker_error(
                        "pull",
                        format!("no reply within {patience:?} (connection lost?)"),
                    ));
                }
            };
            let attempt = message.info().map(|i| i.delivered).unwrap_or(1);
            let empty = HeaderMap::new();
            let headers = message.headers.as_ref().unwrap_or(&empty);
            match decode(topic, headers, &message.payload) {
                Ok(envelope) => out.push(NatsDelivery {
                    envelope,
                    attempt: i32::try_from(attempt).unwrap_or(i32::MAX),
                    message,
                }),
                Err(e) => {
                    // Not a pgbox message: never redeliver it.
                    tracing::warn!(topic, error = %e, "pgbox nats: undecodable message terminated");
                    let _ = tokio::time::timeout(LOST_PULL, message.ack_with(AckKind::Term)).await;
                }
            }
        }
    }

    /// Up to `max` dead letters of `topic`, oldest first (read from the dead-letter stream,
    /// which keeps them).
    pub async fn dead_letters(&self, topic: &str, max: usize) -> Result<Vec<NatsDeadLetter>> {
        let context = self.context().await?;
        let mut stream = context
            .get_stream(self.dead_stream())
            .await
            .map_err(|e| broker_error("get dead-letter stream", e))?;
        let state = stream
            .info()
            .await
            .map_err(|e| broker_error("dead-letter stream info", e))?
            .state
            .clone();
        let subject = self.dead_letter_subject(topic);
        let mut out = Vec::new();
        let mut seq = state.first_sequence.max(1);
        // Bounded: one lookup per matching message, at most `max`.
        while out.len() < max && seq <= state.last_sequence {
            let found = stream
                .direct_get_next_for_subject(&subject, Some(seq))
                .await;
            let Ok(message) = found else { break };
            seq = message.sequence + 1;
            let envelope = decode(topic, &message.headers, &message.payload)?;
            out.push(NatsDeadLetter {
                envelope,
                error: message.headers.get(ERROR).map(|v| v.as_str().to_owned()),
                deliveries: message
                    .headers
                    .get(DELIVERIES)
                    .and_then(|v| v.as_str().parse().ok())
                    .unwrap_or(0),
                sequence: message.sequence,
            });
        }
        Ok(out)
    }
}

fn headers(envelope: &Envelope) -> Result<HeaderMap, PublishError> {
    let meta = Meta {
        content_type: envelope.content_type.clone(),
        ordering_key: envelope.ordering_key.clone(),
        created_at: envelope.created_at.unix_timestamp_nanos(),
        headers: envelope.headers.clone(),
    };
    let json = serde_json::to_string(&meta)
        .map_err(|e| PublishError::refused(format!("message {}: {e}", envelope.id)))?;
    let mut map = HeaderMap::new();
    map.insert(MSG_ID, envelope.id.to_string().as_str());
    map.insert(META, json.as_str());
    for name in [TRACEPARENT, "tracestate"] {
        if let Some(v) = envelope.headers.get(name)
            && !v.contains(['\r', '\n'])
        {
            map.insert(name, v.as_str());
        }
    }
    Ok(map)
}

/// A failed JetStream publish, by whose fault. The server's answer about this message (over
/// `max_payload`, an API error from the stream) refuses it; no answer in time, a broken
/// connection, the client's in-flight limit, and "no responders" are an outage.
///
/// "No responders" (`StreamNotFound`) means that nothing took the subject at that moment:
/// no stream captures it, or the stream has no leader (a JetStream cluster electing one,
/// JetStream restarting). The two cannot be told apart from the publish, and neither is the
/// message's fault: pgbox's one stream takes every topic's subject, so a missing stream (a
/// deleted stream, `declare(false)` without creating it) stops every topic alike. It is an
/// outage: the relay backs off and reports it (metrics, a log line per round) and nothing is
/// dead-lettered; create the stream and the messages flow.
///
/// JetStream's own answer is read by its status: a 5xx (503 "JetStream system temporarily
/// unavailable" while a cluster has no quorum or the stream no leader, "insufficient
/// resources", JetStream not enabled) says the server cannot take messages now, whatever
/// the message; it is an outage too. A 4xx is about this message, and refuses it.
fn nats_publish_error(what: &str, e: &jetstream::context::PublishError) -> PublishError {
    use jetstream::context::PublishErrorKind as Kind;
    let message = format!("{what}: {e}");
    match e.kind() {
        Kind::TimedOut | Kind::BrokenPipe | Kind::MaxAckPending | Kind::StreamNotFound => {
            PublishError::unavailable(message)
        }
        Kind::Other if api_error(e).is_some_and(|api| api.code() >= 500) => {
            PublishError::unavailable(message)
        }
        _ => PublishError::refused(message),
    }
}

/// The JetStream API error inside a publish error, if the server answered with one.
fn api_error(e: &jetstream::context::PublishError) -> Option<&jetstream::Error> {
    std::error::Error::source(e)?.downcast_ref::<jetstream::Error>()
}

/// The CloudEvents NATS binding's attribute prefix.
const CE_PREFIX: &str = "ce-";
/// The content type header of the binding.
const CONTENT_TYPE: &str = "content-type";

/// The headers and payload of `envelope`: native, or a CloudEvent when configured.
fn wire(
    cloudevents: Option<&CloudEvents>,
    envelope: &Envelope,
) -> Result<(HeaderMap, Bytes), PublishError> {
    let Some(ce) = cloudevents else {
        return headers(envelope).map(|h| (h, Bytes::copy_from_slice(&envelope.payload)));
    };
    let bad = |e: Error| PublishError::refused(format!("message {}: {e}", envelope.id));
    let attributes = ce.attributes(envelope).map_err(bad)?;
    let mut map = HeaderMap::new();
    map.insert(MSG_ID, envelope.id.to_string().as_str());
    for (name, value) in &attributes.transport {
        if name.starts_with("Pgbox-") || name.starts_with("Nats-") || name == CONTENT_TYPE {
            return Err(PublishError::refused(format!(
                "message {}: header name {name} is reserved",
                envelope.id
            )));
        }
        insert_checked(&mut map, name, value, envelope)?;
    }
    let payload = match ce.content_mode() {
        ContentMode::Structured => {
            map.insert(CONTENT_TYPE, STRUCTURED_CONTENT_TYPE);
            Bytes::from(ce.to_json(envelope).map_err(bad)?)
        }
        _ => {
            for (name, value) in &attributes.attrs {
                insert_checked(&mut map, &format!("{CE_PREFIX}{name}"), value, envelope)?;
            }
            map.insert(CONTENT_TYPE, envelope.content_type.as_str());
            Bytes::copy_from_slice(&envelope.payload)
        }
    };
    Ok((map, payload))
}

/// Inserts a header of a CloudEvent, refusing the message when NATS cannot carry it (a name
/// with non-ASCII, a control or ':'; a value with CR or LF: the outbox accepts both, the
/// native form carries them inside `Pgbox-Meta`, and async-nats panics on them).
fn insert_checked(
    map: &mut HeaderMap,
    name: &str,
    value: &str,
    envelope: &Envelope,
) -> Result<(), PublishError> {
    let name: async_nats::header::HeaderName = name.parse().map_err(|_| {
        PublishError::refused(format!(
            "message {}: header name {name:?} is not one NATS can carry (non-ASCII, a control or ':')",
            envelope.id
        ))
    })?;
    let value: async_nats::HeaderValue = value.parse().map_err(|_| {
        PublishError::refused(format!(
            "message {}: the value of {name} holds CR or LF, which a NATS header cannot carry",
            envelope.id
        ))
    })?;
    map.insert(name, value);
    Ok(())
}

/// A CloudEvent's envelope, when the message is one (binary: a `ce-specversion` header;
/// structured: its content type).
fn decode_cloudevent(topic: &str, headers: &HeaderMap, payload: &[u8]) -> Option<Result<Envelope>> {
    let mut attrs = BTreeMap::new();
    let mut others = BTreeMap::new();
    let mut content_type = None;
    for (name, values) in headers.iter() {
        let name: &str = name.as_ref();
        let Some(value) = values.first() else {
            continue;
        };
        let value = value.as_str().to_owned();
        let lower = name.to_ascii_lowercase();
        if lower == CONTENT_TYPE {
            content_type = Some(value);
        } else if let Some(attr) = lower.strip_prefix(CE_PREFIX) {
            attrs.insert(attr.to_owned(), value);
        } else if !name.starts_with("Nats-") && !name.starts_with("Pgbox-") {
            others.insert(name.to_owned(), value);
        }
    }
    if attrs.contains_key("specversion") {
        Some(cloudevents::decode_binary(
            topic,
            attrs,
            content_type,
            others,
            payload,
        ))
    } else if content_type
        .as_deref()
        .is_some_and(cloudevents::is_structured)
        || (headers.get(META).is_none()
            && payload.first() == Some(&b'{')
            && looks_structured(payload))
    {
        Some(cloudevents::decode_structured(topic, payload, others))
    } else {
        None
    }
}

/// Whether a payload without pgbox's headers is a structured event (the NATS binding's
/// structured mode sets no content type): a JSON object with a `specversion` member.
fn looks_structured(payload: &[u8]) -> bool {
    serde_json::from_slice::<serde_json::Map<String, serde_json::Value>>(payload)
        .is_ok_and(|doc| doc.contains_key("specversion"))
}

fn decode(topic: &str, headers: &HeaderMap, payload: &[u8]) -> Result<Envelope> {
    if let Some(event) = decode_cloudevent(topic, headers, payload) {
        return event;
    }
    let bad = |reason| Error::InvalidField {
        field: "nats message",
        reason,
    };
    let id = headers
        .get(ID)
        .or_else(|| headers.get(MSG_ID))
        .and_then(|v| Uuid::parse_str(v.as_str()).ok())
        .ok_or(bad("no Nats-Msg-Id, or not a UUID"))?;
    let meta: Meta = headers
        .get(META)
        .and_then(|v| serde_json::from_str(v.as_str()).ok())
        .ok_or(bad("no Pgbox-Meta header"))?;
    Ok(Envelope {
        seq: 0,
        id,
        topic: topic.to_owned(),
        ordering_key: meta.ordering_key,
        payload: payload.to_vec(),
        content_type: meta.content_type,
        headers: meta.headers,
        created_at: OffsetDateTime::from_unix_timestamp_nanos(meta.created_at)
            .map_err(|_| bad("creation time out of range"))?,
        attempts: 0,
    })
}

impl Publisher for Nats {
    async fn publish(&self, batch: &[Envelope]) -> Vec<Result<(), PublishError>> {
        let context = match self.context().await {
            Ok(c) => c,
            Err(e) => {
                // Not the messages' fault (connect, the streams' declaration): an outage.
                tracing::debug!(error = %e, "pgbox nats publish: not connected");
                return vec![Err(PublishError::unavailable(e.to_string())); batch.len()];
            }
        };
        let mut results = Vec::with_capacity(batch.len());
        for chunk in batch.chunks(ACK_CHUNK) {
            // Send the chunk, then await its acks together.
            let mut pending = Vec::with_capacity(chunk.len());
            for envelope in chunk {
                let sent = match wire(self.inner.config.cloudevents.as_ref(), envelope) {
                    Ok((h, payload)) => context
                        .send_publish(
                            self.subject(&envelope.topic),
                            jetstream::message::PublishMessage::build()
                                .payload(payload)
                                .headers(h),
                        )
                        .await
                        .map_err(|e| nats_publish_error("publish failed", &e)),
                    Err(e) => Err(e),
                };
                pending.push(sent);
            }
            let acks = join_all(pending.into_iter().map(|p| async move {
                match p {
                    Ok(ack) => ack.await.map_err(|e| nats_publish_error("publish ack", &e)),
                    Err(e) => Err(e),
                }
            }))
            .await;
            for (envelope, ack) in chunk.iter().zip(acks) {
                let result = match ack {
                    Ok(ack) => {
                        tracing::debug!(message_id = %envelope.id, topic = %envelope.topic, stream_seq = ack.sequence, duplicate = ack.duplicate, "pgbox nats published");
                        Ok(())
                    }
                    Err(e) => {
                        tracing::debug!(message_id = %envelope.id, topic = %envelope.topic, error = %e, "pgbox nats publish failed");
                        Err(e)
                    }
                };
                results.push(result);
            }
        }
        results
    }
}

impl Subscriber for Nats {
    type Delivery = NatsDelivery;

    async fn receive(
        &self,
        topic: &str,
        max: usize,
        _visibility: Duration,
    ) -> Result<Vec<NatsDelivery>> {
        let consumer = self.consumer(topic).await?;
        let max = max.max(1);
        let mut out = Vec::new();
        // What is there now, without waiting. An error here (the consumer at its
        // `max_ack_pending`, say) is left to the waiting pull below to report.
        match self.pull(topic, &consumer, max, None, &mut out).await {
            Ok(()) if !out.is_empty() => return Ok(out),
            Ok(()) => {}
            Err(e) if out.is_empty() => {
                tracing::debug!(topic, error = %e, "pgbox nats no-wait pull failed; waiting pull next");
            }
            Err(e) => {
                tracing::warn!(topic, error = %e, "pgbox nats pull ended early");
                return Ok(out);
            }
        }
        // Nothing yet: wait for one message, which ends the pull as soon as it comes (a
        // pull for more would hold it until the rest came or the pull expired).
        let wait = self.inner.config.receive_wait;
        if let Err(e) = self.pull(topic, &consumer, 1, Some(wait), &mut out).await {
            if out.is_empty() {
                return Err(e);
            }
            tracing::warn!(topic, error = %e, "pgbox nats pull ended early");
        }
        // Then whatever came with it, without waiting.
        if out.len() == 1
            && max > 1
            && let Err(e) = self.pull(topic, &consumer, max - 1, None, &mut out).await
        {
            tracing::debug!(topic, error = %e, "pgbox nats no-wait pull after a wait failed");
        }
        Ok(out)
    }

    fn envelope<'d>(&self, delivery: &'d NatsDelivery) -> &'d Envelope {
        &delivery.envelope
    }

    fn attempt(&self, delivery: &NatsDelivery) -> i32 {
        delivery.attempt
    }

    async fn ack(&self, delivery: &NatsDelivery) -> Result<bool> {
        delivery
            .message
            .ack()
            .await
            .map_err(|e| broker_error("ack", e))?;
        tracing::debug!(message_id = %delivery.envelope.id, "pgbox nats ack");
        Ok(true)
    }

    async fn nack(&self, delivery: &NatsDelivery, delay: Duration, error: &str) -> Result<bool> {
        let delay = (!delay.is_zero()).then_some(delay);
        delivery
            .message
            .ack_with(AckKind::Nak(delay))
            .await
            .map_err(|e| broker_error("nak", e))?;
        tracing::info!(message_id = %delivery.envelope.id, ?delay, error, "pgbox nats nak; will redeliver");
        Ok(true)
    }

    async fn dead_letter(&self, delivery: &NatsDelivery, error: &str) -> Result<bool> {
        let context = self.context().await?;
        let envelope = &delivery.envelope;
        let mut map = headers(envelope).map_err(|e| broker_error("dead letter", e.to_string()))?;
        map.insert(
            ERROR,
            truncate(&error.replace(['\r', '\n'], " "), MAX_ERROR_BYTES),
        );
        map.insert(DELIVERIES, delivery.attempt.to_string().as_str());
        // Deduplicated per delivery, not per message: a message dead-lettered again after a
        // replay must not be dropped as a duplicate of its first dead letter.
        map.insert(ID, envelope.id.to_string().as_str());
        map.insert(
            MSG_ID,
            format!("{}-dead-{}", envelope.id, delivery.attempt).as_str(),
        );
        context
            .send_publish(
                self.dead_letter_subject(&envelope.topic),
                jetstream::message::PublishMessage::build()
                    .payload(Bytes::copy_from_slice(&envelope.payload))
                    .headers(map),
            )
            .await
            .map_err(|e| broker_error("publish dead letter", e))?
            .await
            .map_err(|e| broker_error("dead letter publish ack", e))?;
        delivery
            .message
            .ack_with(AckKind::Term)
            .await
            .map_err(|e| broker_error("term", e))?;
        tracing::warn!(message_id = %envelope.id, attempt = delivery.attempt, error, "pgbox nats message dead-lettered");
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_connect_attempt_does_not_wait() {
        assert_eq!(reconnect_delay(1), Duration::ZERO);
        assert_eq!(reconnect_delay(2), Duration::from_millis(100));
        assert_eq!(reconnect_delay(100), Duration::from_secs(2));
    }

    #[test]
    fn url_credentials_are_split_decoded_and_redacted() {
        assert_eq!(
            split_userinfo("tls://u:p%40ss@h:4222"),
            (
                "tls://h:4222".to_owned(),
                Some(("u".to_owned(), Some("p%40ss".to_owned())))
            )
        );
        assert_eq!(
            split_userinfo("tok@h"),
            ("nats://h".to_owned(), Some(("tok".to_owned(), None)))
        );
        assert_eq!(
            split_userinfo("nats://h:1"),
            ("nats://h:1".to_owned(), None)
        );
        assert_eq!(
            percent_decode("p%40ss%20w%zz%4").as_deref(),
            Some("p@ss w%zz%4")
        );
        assert_eq!(percent_decode("%ff"), None);
        assert_eq!(
            redact_urls("nats://u:pw@a:1, tok@b:2,nats://c:3"),
            "nats://u:***@a:1,nats://***@b:2,nats://c:3"
        );
    }

    #[test]
    fn tokens_are_subject_safe_and_distinct() {
        assert_eq!(token("orders"), "orders");
        assert_eq!(token("orders.paid"), "orders_2epaid");
        assert_eq!(token("a_b"), "a_5fb");
        assert_eq!(token("a b*>"), "a_20b_2a_3e");
        assert_eq!(token("ü"), "_c3_bc");
        // `_` is escaped too, so an escape cannot be forged by a topic.
        assert_ne!(token("a.b"), token("a_2eb"));
    }
}
