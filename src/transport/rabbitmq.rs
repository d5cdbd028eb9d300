//! The RabbitMQ transport (feature `rabbitmq`, on [`lapin`]).
//!
//! [`RabbitMq`] is both a [`Publisher`] for the relay and a [`Subscriber`] for the
//! [`Consumer`](crate::Consumer) runner. Clone it freely: clones share one AMQP connection,
//! opened on first use and reopened after it breaks.
//!
//! # TLS and credentials
//!
//! An `amqps://` URL (feature `tls`; without it, [`RabbitMqBuilder::build`] fails with
//! [`Error::Tls`] and [`TlsProblem::NotBuilt`]) verifies the broker's certificate against the
//! system's roots and the host name of the URL.
//! [`tls_root_certificates`](RabbitMqBuilder::tls_root_certificates) adds a private CA,
//! [`tls_client_certificate`](RabbitMqBuilder::tls_client_certificate) presents a client
//! certificate, and [`credentials`](RabbitMqBuilder::credentials) takes the password as a
//! [`Secret`] (from a file or the environment) instead of in the URL:
//!
//! ```no_run
//! # fn main() -> pgbox::Result<()> {
//! use pgbox::Secret;
//! use pgbox::transport::rabbitmq::RabbitMq;
//!
//! let transport = RabbitMq::builder("amqps://mq.internal.example:5671/%2f")
//!     .tls_root_certificates("/etc/pgbox/rabbitmq-ca.pem")
//!     .tls_client_certificate("/etc/pgbox/client.pem", "/etc/pgbox/client.key")
//!     .credentials("orders", Secret::from_file("/run/secrets/rabbitmq-password")?)
//!     .build()?;
//! # let _ = transport;
//! # Ok(())
//! # }
//! ```
//!
//! `build` refuses a password that would cross the network in clear text (an `amqp://` URL
//! to a host that is not loopback, with credentials in it or from `credentials`) with
//! [`Error::InsecureCredentials`], unless
//! [`allow_insecure_credentials`](RabbitMqBuilder::allow_insecure_credentials) says so. A URL
//! without credentials logs in as RabbitMQ's built-in `guest`/`guest` (lapin's default):
//! that password is public, and RabbitMQ accepts `guest` from loopback only, so it does not
//! count.
//!
//! Connecting ([`RabbitMq::connect`] at startup, or any first use) types its failures: a
//! TLS failure is [`Error::Tls`] (an untrusted or expired certificate, one for another host,
//! a port that speaks no TLS, a client certificate the broker refuses or misses), a refused
//! login (`ACCESS_REFUSED`) is [`Error::Authentication`]. They are logged at `error` level.
//! The relay still treats them as the broker being unavailable, and retries with backoff
//! (nothing is dropped, no attempt is counted): a rotated password or a renewed certificate
//! then takes effect without a restart (files are read again at each connection; a
//! [`Secret`] is not). A user that logs in but may not write to the exchange (the broker
//! closes the channel with 403 `ACCESS_REFUSED` on each publish) is treated alike: logged
//! at `error`, retried, no message dead-lettered for it. No message, log line or `Debug`
//! output of pgbox's shows a password or a key. One exception is lapin's own: at TRACE, its
//! target `lapin::io_loop` logs every frame it writes, the login frame
//! (`Connection.StartOk`, with the password as bytes) included. Keep that target at DEBUG or
//! above (`RUST_LOG=trace,lapin::io_loop=debug`).
//!
//! # Topology
//!
//! With [`RabbitMqBuilder::declare`] on (the default), pgbox declares, idempotently:
//! - a durable direct exchange (default `pgbox`); a message of topic `T` is published to it
//!   with routing key `T`;
//! - per topic, a durable **quorum** queue `<prefix>T` (default prefix `pgbox.`) bound with
//!   key `T`, with single active consumer on (so one consumer process at a time receives
//!   from it: see ordering) and dead-lettering to `<prefix>T.dead`;
//! - a durable dead-letter queue `<prefix>T.dead`;
//! - retry queues `<prefix>T.retry.<ms>ms` on demand (see delays).
//!
//! The queues are declared by the subscriber (on its first `receive`, or by
//! [`RabbitMq::declare_topic`]), not by the publisher: messages published to a topic that
//! has no queue yet are **unroutable**, and since every publish is `mandatory`, the relay
//! gets them back. A returned message is **unavailable**, not refused (the topology's state,
//! not the message's fault, as NATS treats a subject no stream takes): the relay counts no
//! attempt, never dead-letters it, and retries its topic with backoff until a queue is
//! bound; nothing is dropped. Turn `declare` off to
//! manage the topology yourself (same names and arguments).
//!
//! # Publishing
//!
//! Publisher confirms on, pipelined: a batch is written out, then its confirms are awaited
//! together. Messages are persistent (`delivery_mode` 2). The message id is the AMQP
//! `message_id`, the content type is `content_type`, headers are AMQP headers (long
//! strings); pgbox adds `x-pgbox-created-at` and `x-pgbox-ordering-key`. Header names
//! starting with `x-pgbox-`, and the broker's `x-death`, `x-delivery-count`,
//! `x-first-death-*` and `x-last-death-*`, are reserved. A message is `Ok` only when the
//! broker acked it and did not return it.
//!
//! # Receiving
//!
//! Manual acks with a prefetch (default 100) per topic. The `visibility` argument of
//! `receive` does not apply: RabbitMQ redelivers a message when the connection or channel
//! of the consumer holding it closes (or after the broker's `consumer_timeout`, 30 minutes
//! by default). `receive` waits up to [`RabbitMqBuilder::receive_wait`] for a first message.
//!
//! **Attempts**: the quorum queue counts redeliveries (`x-delivery-count`, which grows when
//! a consumer dies or a message is requeued); a message that went through a retry queue
//! carries the deliveries before it in `x-pgbox-deliveries`. The attempt is their sum plus
//! one.
//!
//! **Delays**: RabbitMQ has no per-message delay. A nack with a delay publishes a copy
//! (with publisher confirm) to a retry queue whose queue-level TTL is the delay rounded
//! **up** to a power of two milliseconds, and which dead-letters expired messages back to the
//! topic's queue; then it acks the original. So the redelivery comes no earlier than the
//! delay and at most about twice as late. Retry queues expire when unused. A nack with a
//! zero delay requeues the message in place (`basic.nack` with requeue), without a copy;
//! see order for what that does to its key.
//!
//! **Dead letters**: `dead_letter` publishes a copy to `<prefix>T.dead` with the error in
//! `x-pgbox-error`, then acks the original. Inspect them with [`RabbitMq::dead_letters`]
//! (or any AMQP tool). When publishing the copy fails, the message is requeued in place
//! instead (so is a message whose delayed nack could not publish its retry copy).
//!
//! **Order**: a quorum queue delivers in queue order, single active consumer gives one
//! consumer process the queue at a time, and `receive` hands out at most one message per
//! ordering key until it is settled (later ones wait in the prefetch buffer). A message
//! requeued in place (a nack with a zero delay, or a failed dead-letter or delayed nack)
//! comes back behind the messages the broker had already sent ahead, later ones of its key
//! among them: so its key stays held, and they keep waiting, until it is delivered again.
//! So messages of a key are handled one at a time in publication order, also across
//! requeues in place, **except**:
//! - around a nack with a delay: the retry copy re-enters the topic's queue at its tail,
//!   behind later messages of its key, which are handed out meanwhile;
//! - when a requeued message does not come back within the operation timeout
//!   ([`RabbitMqBuilder::operation_timeout`]; e.g. the broker dead-lettered it at a queue's
//!   delivery limit): the key is then let go, and a late return queues up behind the key's
//!   messages already received.
//!
//! A dead-lettered message lets the next message of its key out. Without single active
//! consumer no order is promised, and a key is not held for its requeued message (which
//! may go to another consumer). Use
//! [`Inbox::process_in_order`](crate::Inbox::process_in_order) where order must survive
//! delayed retries.

use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex as StdMutex};
use std::time::{Duration, Instant};

use futures_util::future::join_all;
use futures_util::{FutureExt, StreamExt};
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicGetOptions, BasicNackOptions, BasicPublishOptions,
    BasicQosOptions, ConfirmSelectOptions, ExchangeDeclareOptions, QueueBindOptions,
    QueueDeclareOptions,
};
use lapin::tcp::{OwnedIdentity, OwnedTLSConfig};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::uri::{AMQPScheme, AMQPUri, AMQPUserInfo};
use lapin::{
    BasicProperties, Channel, Confirmation, Connection, ConnectionProperties,
    DefaultConnectionBuilder, ExchangeKind,
};
use time::OffsetDateTime;
use time::format_description::well_known::Rfc3339;
use tokio::sync::Mutex;
use uuid::Uuid;

use super::{PublishError, Publisher, Subscriber, truncate};
use crate::cloudevents::{self, CloudEvents, ContentMode, STRUCTURED_CONTENT_TYPE};
use crate::error::{Error, Result, TlsProblem};
use crate::outbox::Envelope;
use crate::secret::{Secret, redact_url};

const TRANSPORT: &str = "rabbitmq";
const CREATED_AT: &str = "x-pgbox-created-at";
const ORDERING_KEY: &str = "x-pgbox-ordering-key";
const DELIVERIES: &str = "x-pgbox-deliveries";
const ERROR: &str = "x-pgbox-error";
const DELIVERY_COUNT: &str = "x-delivery-count";
const MAX_ERROR_BYTES: usize = 4096;
/// The CloudEvents AMQP binding's attribute prefix (JMS-compatible; the one pgbox writes).
const AMQP_PREFIX: &str = "cloudEvents_";
/// The binding's older prefix, still read.
const AMQP_PREFIX_COLON: &str = "cloudEvents:";

/// Awaits one broker operation for at most `limit`. lapin resolves an operation when its
/// frame is written, or its reply arrives, or the connection fails; a connection cut at the
/// wrong moment can leave one of them waiting forever, and a consumer shutting down waits
/// for its acks. Past the limit the operation counts as failed (and the connection is
/// replaced: see [`Conn::usable`]).
async fn bounded<T, E: fmt::Display>(
    bound: &Bound,
    what: &str,
    operation: impl Future<Output = std::result::Result<T, E>>,
) -> Result<T> {
    let limit = bound.limit;
    match tokio::time::timeout(limit, operation).await {
        Ok(Ok(value)) => Ok(value),
        Ok(Err(e)) => Err(broker_error(what, e)),
        Err(_) => {
            bound.suspect.store(true, Ordering::Relaxed);
            tracing::warn!(
                operation = what,
                ?limit,
                "pgbox rabbitmq operation timed out; the connection will be replaced"
            );
            Err(broker_error(
                what,
                format_args!("no answer within {limit:?}"),
            ))
        }
    }
}

/// The operation timeout, and the flag a timed-out operation raises so that the next
/// [`RabbitMq::conn`] replaces the connection instead of trusting its status.
#[derive(Clone)]
struct Bound {
    limit: Duration,
    suspect: Arc<AtomicBool>,
}

/// [`bounded`] as a method, so that a chain of lapin calls reads in order.
trait Within<T, E: fmt::Display>: Future<Output = std::result::Result<T, E>> + Sized {
    fn within(self, bound: &Bound, what: &str) -> impl Future<Output = Result<T>> {
        bounded(bound, what, self)
    }
}

impl<T, E: fmt::Display, F: Future<Output = std::result::Result<T, E>>> Within<T, E> for F {}

fn broker_error(what: &str, e: impl fmt::Display) -> Error {
    Error::Transport {
        transport: TRANSPORT,
        message: format!("{what}: {e}"),
    }
}

/// Builder for [`RabbitMq`].
///
/// Its `Debug` output shows the URL without its password, and no credential.
#[derive(Clone)]
pub struct RabbitMqBuilder {
    url: String,
    credentials: Option<(String, Secret)>,
    tls_roots: Option<PathBuf>,
    tls_identity: Option<(PathBuf, PathBuf)>,
    allow_insecure_credentials: bool,
    exchange: String,
    queue_prefix: String,
    declare: bool,
    single_active_consumer: bool,
    prefetch: u16,
    receive_wait: Duration,
    connect_timeout: Duration,
    confirm_timeout: Duration,
    operation_timeout: Duration,
    queue_expires: Option<Duration>,
    cloudevents: Option<CloudEvents>,
}

impl RabbitMqBuilder {
    /// Publishes every message as a CloudEvent ([`crate::cloudevents`]): in binary mode the
    /// attributes are headers `cloudEvents_<name>` (the AMQP binding's prefix; receiving
    /// takes `cloudEvents:` too), the content type is `datacontenttype`, the body the payload.
    /// Receiving reads CloudEvents and native messages alike, with or without this.
    pub fn cloudevents(mut self, config: CloudEvents) -> Self {
        self.cloudevents = Some(config);
        self
    }

    /// The exchange messages are published to (default `pgbox`).
    pub fn exchange(mut self, name: impl Into<String>) -> Self {
        self.exchange = name.into();
        self
    }

    /// The prefix of queue names (default `pgbox.`): topic `T` is queue `<prefix>T`.
    pub fn queue_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.queue_prefix = prefix.into();
        self
    }

    /// Declare the exchange and queues (default `true`); `false` leaves the topology to
    /// you.
    pub fn declare(mut self, declare: bool) -> Self {
        self.declare = declare;
        self
    }

    /// Declare topic queues with single active consumer (default `true`), which per-key
    /// order relies on. Without it, several consumer processes share a queue's messages.
    pub fn single_active_consumer(mut self, on: bool) -> Self {
        self.single_active_consumer = on;
        self
    }

    /// Unacked messages the broker sends ahead per topic (default 100).
    pub fn prefetch(mut self, n: u16) -> Self {
        self.prefetch = n;
        self
    }

    /// How long `receive` waits for a first message before returning none (default
    /// 200 ms).
    pub fn receive_wait(mut self, wait: Duration) -> Self {
        self.receive_wait = wait;
        self
    }

    /// Declare topic and dead-letter queues with an expiry (`x-expires`): the broker deletes
    /// them, messages included, after they go unused that long. For tests and throwaway
    /// topics only; default none.
    pub fn queue_expires(mut self, expires: Duration) -> Self {
        self.queue_expires = Some(expires);
        self
    }

    /// Bound on waiting for a batch's publisher confirms (default 30 s); messages not
    /// confirmed by then are reported failed (and retried by the relay).
    pub fn confirm_timeout(mut self, timeout: Duration) -> Self {
        self.confirm_timeout = timeout;
        self
    }

    /// Bound on opening a connection (default 10 s).
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// Bound on every other broker operation: opening a channel, declaring, acking,
    /// nacking, publishing a retry or dead-letter copy (default 10 s). An operation past it
    /// counts as failed and the connection is replaced, so that a connection that died
    /// without a clean close can never hang a consumer (or its shutdown). It also bounds
    /// how long an ordering key waits for its message requeued in place to come back (see
    /// the [module docs](self), order).
    pub fn operation_timeout(mut self, timeout: Duration) -> Self {
        self.operation_timeout = timeout;
        self
    }

    /// Log in as `user` with `password`, instead of the user and password in the URL (if
    /// any). The password can so come from a file or the environment
    /// ([`Secret::from_file`], [`Secret::from_env`]) rather than sit in the URL. Over a
    /// plain `amqp://` URL to a host that is not loopback, [`build`](Self::build) refuses
    /// it unless [`allow_insecure_credentials`](Self::allow_insecure_credentials) is on.
    pub fn credentials(mut self, user: impl Into<String>, password: Secret) -> Self {
        self.credentials = Some((user.into(), password));
        self
    }

    /// Trust the certificate authorities in the PEM file at `path` to sign the broker's
    /// certificate, **in addition to** the system's roots (which an `amqps://` URL trusts
    /// by default). For a private CA. Read (and checked) at [`build`](Self::build), and
    /// again at each connection, so a renewed file is picked up on reconnection. Only
    /// with an `amqps://` URL.
    pub fn tls_root_certificates(mut self, path: impl Into<PathBuf>) -> Self {
        self.tls_roots = Some(path.into());
        self
    }

    /// Present the client certificate in the PEM file `cert_pem` (with its chain, if any),
    /// whose private key is in the PEM file `key_pem` (PKCS#8, PKCS#1 or SEC1, not
    /// encrypted), to a broker that asks for one (`ssl_options.verify = verify_peer`).
    /// Read (and checked) at [`build`](Self::build), and again at each connection. Only
    /// with an `amqps://` URL. The key's contents never appear in a message.
    pub fn tls_client_certificate(
        mut self,
        cert_pem: impl Into<PathBuf>,
        key_pem: impl Into<PathBuf>,
    ) -> Self {
        self.tls_identity = Some((cert_pem.into(), key_pem.into()));
        self
    }

    /// Allow a password to cross the network in clear text: an `amqp://` URL (not
    /// `amqps://`) with credentials other than RabbitMQ's built-in `guest`/`guest`, to a
    /// host that is not loopback. Off by default: [`build`](Self::build) then fails with
    /// [`Error::InsecureCredentials`]. For a network you trust otherwise (a sidecar, a
    /// VPN); prefer `amqps://`.
    pub fn allow_insecure_credentials(mut self, allow: bool) -> Self {
        self.allow_insecure_credentials = allow;
        self
    }

    /// The URL lapin dials, with the credentials applied; and the TLS settings checked.
    fn endpoint(&self) -> Result<(AMQPUri, String)> {
        let mut uri: AMQPUri = self.url.parse().map_err(|e: String| {
            Error::InvalidConfig(format!(
                "rabbitmq URL {} is not valid: {}",
                redact_url(&self.url),
                // The parser's message quotes the URL: keep the password out.
                if e.contains(&self.url) {
                    "not an AMQP URL".to_owned()
                } else {
                    e
                }
            ))
        })?;
        // The URL parser keeps a host only when it is a name: an IP literal in brackets
        // comes back as `localhost`. Put the address given back (lapin dials it as it is).
        if let Some(v6) = bracketed_host(&self.url) {
            let address: std::net::Ipv6Addr = v6.parse().map_err(|_| {
                Error::InvalidConfig(format!(
                    "rabbitmq URL {}: the host [{v6}] is not an IPv6 address",
                    redact_url(&self.url)
                ))
            })?;
            uri.authority.host = address.to_string();
        }
        if let Some((user, password)) = &self.credentials {
            uri.authority.userinfo = AMQPUserInfo {
                username: user.clone(),
                password: password.expose().to_owned(),
            };
        }
        let target = if uri.authority.host.contains(':') {
            format!(
                "rabbitmq at [{}]:{}",
                uri.authority.host, uri.authority.port
            )
        } else {
            format!("rabbitmq at {}:{}", uri.authority.host, uri.authority.port)
        };
        let tls = uri.scheme == AMQPScheme::AMQPS;
        if tls && !cfg!(feature = "tls") {
            return Err(Error::Tls {
                target,
                problem: TlsProblem::NotBuilt,
                reason: "the URL is amqps:// and this pgbox is built without the `tls` feature"
                    .into(),
            });
        }
        if !tls && (self.tls_roots.is_some() || self.tls_identity.is_some()) {
            return Err(Error::InvalidConfig(format!(
                "rabbitmq: TLS settings (root certificates, client certificate) given for {}, \
                 which is not amqps://",
                redact_url(&self.url)
            )));
        }
        let default = AMQPUserInfo::default();
        let secret_credentials = uri.authority.userinfo.username != default.username
            || uri.authority.userinfo.password != default.password;
        if !tls
            && secret_credentials
            && !self.allow_insecure_credentials
            // A host starting with `/` or `@` (percent-encoded in the URL) is no Unix socket
            // here: AMQP goes over TCP, and such a name goes to the resolver.
            && (uri.authority.host.starts_with(['/', '@'])
                || !crate::tls::is_loopback(&uri.authority.host))
        {
            return Err(Error::InsecureCredentials {
                transport: TRANSPORT,
                setting: "allow_insecure_credentials",
                reason: format!(
                    "{target}: the password would be sent without TLS; use an amqps:// URL, \
                     or RabbitMqBuilder::allow_insecure_credentials(true) on a network you trust"
                ),
            });
        }
        Ok((uri, target))
    }

    /// The TLS settings for lapin, read from the files now.
    fn tls_config(&self, target: &str) -> Result<OwnedTLSConfig> {
        let read = |path: &Path, what: &str, marker: &str| -> Result<Vec<u8>> {
            let bad = |reason: String| Error::Tls {
                target: target.to_owned(),
                problem: TlsProblem::BadFile,
                reason,
            };
            let bytes = std::fs::read(path)
                .map_err(|e| bad(format!("cannot read the {what} {}: {e}", path.display())))?;
            // lapin skips what it cannot parse: refuse a file with nothing usable in it.
            if !String::from_utf8_lossy(&bytes).contains(marker) {
                return Err(bad(format!(
                    "the {what} {} holds no PEM `{marker}` block",
                    path.display()
                )));
            }
            Ok(bytes)
        };
        let mut config = OwnedTLSConfig::default();
        if let Some(path) = &self.tls_roots {
            let pem = read(path, "root certificate file", "BEGIN CERTIFICATE")?;
            config.cert_chain = Some(String::from_utf8_lossy(&pem).into_owned());
        }
        if let Some((cert, key)) = &self.tls_identity {
            config.identity = Some(OwnedIdentity::PKCS8 {
                pem: read(cert, "client certificate file", "BEGIN CERTIFICATE")?,
                key: read(key, "client key file", "PRIVATE KEY")?,
            });
        }
        Ok(config)
    }

    /// Validates the settings: the URL, the TLS files, and that no password would cross
    /// the network in clear text (see
    /// [`allow_insecure_credentials`](Self::allow_insecure_credentials)). An `amqps://` URL
    /// in a build without the `tls` feature is [`Error::Tls`] with
    /// [`TlsProblem::NotBuilt`]. Connects lazily, on first use (or
    /// [`RabbitMq::connect`]).
    pub fn build(self) -> Result<RabbitMq> {
        let (uri, target) = self.endpoint()?;
        self.tls_config(&target)?;
        if self.prefetch == 0 {
            return Err(Error::InvalidConfig(
                "rabbitmq prefetch must be at least 1".into(),
            ));
        }
        for (name, value) in [
            ("connect_timeout", self.connect_timeout),
            ("confirm_timeout", self.confirm_timeout),
            ("operation_timeout", self.operation_timeout),
        ] {
            if value.is_zero() || value > Duration::from_secs(24 * 3600) {
                return Err(Error::InvalidConfig(format!(
                    "rabbitmq {name} must be between 1 ns and 24 h, not {value:?}"
                )));
            }
        }
        if self.exchange.is_empty() || self.exchange.len() > 255 {
            return Err(Error::InvalidConfig(
                "rabbitmq exchange name must be 1..=255 bytes".into(),
            ));
        }
        if self.queue_prefix.len() > 128 {
            return Err(Error::InvalidConfig(
                "rabbitmq queue prefix must be at most 128 bytes".into(),
            ));
        }
        Ok(RabbitMq {
            inner: Arc::new(Inner {
                uri,
                target,
                bound: Bound {
                    limit: self.operation_timeout,
                    suspect: Arc::default(),
                },
                config: self,
                conn: Mutex::new(None),
                consumers: StdMutex::new(HashMap::new()),
            }),
        })
    }
}

/// The host of an AMQP URL when it is an IP literal in brackets (`[2001:db8::1]`), without
/// the brackets: the authority is what follows `://` up to `/`, `?` or `#`, the host what
/// follows its last `@`.
fn bracketed_host(url: &str) -> Option<&str> {
    let rest = url.split_once("://")?.1;
    let authority = &rest[..rest.find(['/', '?', '#']).unwrap_or(rest.len())];
    let host = authority.rsplit_once('@').map_or(authority, |(_, h)| h);
    host.strip_prefix('[')?.split_once(']').map(|(v6, _)| v6)
}

/// The RabbitMQ transport: see the [module docs](self). Cheap to clone.
#[derive(Clone)]
pub struct RabbitMq {
    inner: Arc<Inner>,
}

impl fmt::Debug for RabbitMq {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RabbitMq")
            .field("target", &self.inner.target)
            .field("exchange", &self.inner.config.exchange)
            .field("queue_prefix", &self.inner.config.queue_prefix)
            .finish_non_exhaustive()
    }
}

impl fmt::Debug for RabbitMqBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RabbitMqBuilder")
            .field("url", &redact_url(&self.url))
            .field(
                "credentials",
                &self
                    .credentials
                    .as_ref()
                    .map(|(user, secret)| (user, secret)),
            )
            .field("tls_root_certificates", &self.tls_roots)
            .field("tls_client_certificate", &self.tls_identity)
            .field(
                "allow_insecure_credentials",
                &self.allow_insecure_credentials,
            )
            .field("exchange", &self.exchange)
            .field("queue_prefix", &self.queue_prefix)
            .field("declare", &self.declare)
            .field("single_active_consumer", &self.single_active_consumer)
            .field("prefetch", &self.prefetch)
            .field("receive_wait", &self.receive_wait)
            .field("connect_timeout", &self.connect_timeout)
            .field("confirm_timeout", &self.confirm_timeout)
            .field("operation_timeout", &self.operation_timeout)
            .field("queue_expires", &self.queue_expires)
            .field("cloudevents", &self.cloudevents)
            .finish()
    }
}

struct Inner {
    config: RabbitMqBuilder,
    /// What lapin dials, credentials applied: never shown.
    uri: AMQPUri,
    /// `rabbitmq at host:port`, for messages.
    target: String,
    bound: Bound,
    conn: Mutex<Option<Conn>>,
    consumers: StdMutex<HashMap<String, Arc<Mutex<Option<TopicConsumer>>>>>,
}

#[derive(Clone)]
struct Conn {
    connection: Arc<Connection>,
    /// Confirm-mode channel for publishing (relay batches, retry and dead-letter copies).
    publish: Channel,
    generation: u64,
    /// Retry queues declared on this connection, and when. Re-declared every minute: a
    /// declaration resets the queue's expiry, and publishing does not.
    retry_queues: Arc<StdMutex<HashMap<String, Instant>>>,
}

impl Conn {
    fn usable(&self) -> bool {
        self.connection.status().connected() && self.publish.status().connected()
    }
}

struct TopicConsumer {
    channel: Channel,
    /// The generation of the connection the channel belongs to.
    generation: u64,
    consumer: lapin::Consumer,
    /// Received, but its key is held (see [`Holder`]).
    held: VecDeque<RabbitDelivery>,
    gate: Gate,
}

/// The held ordering keys: later messages of a key in here wait.
type Gate = Arc<StdMutex<HashMap<String, Holder>>>;

/// Why an ordering key is held.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Holder {
    /// A delivery of the key is in hand (handed out, not settled), by its tag.
    InHand(u64),
    /// The message `id` was requeued in place and is on its way back: the broker sends it
    /// behind the messages it had already sent ahead, later messages of its key among them,
    /// so these must wait for it. Until `until` only: a message the broker dead-letters
    /// instead (at a delivery limit) never comes back.
    Requeued { id: Uuid, until: Instant },
}

/// Tags deliveries, so that only the holder of a key releases it.
static NEXT_TAG: AtomicU64 = AtomicU64::new(1);

/// A message received from [`RabbitMq`]: settle it with `ack`, `nack` or `dead_letter`.
/// Dropping it unsettled lets the next message of its key out; the message itself comes
/// back when the channel closes.
pub struct RabbitDelivery {
    envelope: Envelope,
    attempt: i32,
    queue: String,
    acker: lapin::Acker,
    properties: BasicProperties,
    gate: Gate,
    tag: u64,
    /// The transport's operation bound, for settling.
    bound: Bound,
    /// Whether a requeue in place holds the key until the message is back: only with single
    /// active consumer, which sends it back to this consumer (otherwise any consumer of the
    /// queue may get it, and no order is promised).
    hold_requeued: bool,
}

impl Drop for RabbitDelivery {
    fn drop(&mut self) {
        self.release_key();
    }
}

impl fmt::Debug for RabbitDelivery {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RabbitDelivery")
            .field("message_id", &self.envelope.id)
            .field("attempt", &self.attempt)
            .field("queue", &self.queue)
            .finish_non_exhaustive()
    }
}

impl RabbitDelivery {
    /// The message.
    pub fn envelope(&self) -> &Envelope {
        &self.envelope
    }

    /// 1 for a first delivery, then one more per redelivery.
    pub fn attempt(&self) -> i32 {
        self.attempt
    }

    /// Lets the next message of this delivery's key out.
    fn release_key(&self) {
        if let Some(key) = &self.envelope.ordering_key {
            let mut gate = self.gate.lock().expect("gate");
            if gate.get(key) == Some(&Holder::InHand(self.tag)) {
                gate.remove(key);
            }
        }
    }

    /// After a requeue in place: the key stays held for this message's return (bounded by
    /// the operation timeout), instead of letting out a later message of the key that the
    /// broker had already sent ahead.
    fn await_return(&self) {
        if let Some(key) = &self.envelope.ordering_key
            && self.hold_requeued
        {
            let mut gate = self.gate.lock().expect("gate");
            if let Some(holder) = gate.get_mut(key)
                && *holder == Holder::InHand(self.tag)
            {
                *holder = Holder::Requeued {
                    id: self.envelope.id,
                    until: Instant::now() + self.bound.limit,
                };
            }
        }
    }
}

/// A dead-lettered message, as [`RabbitMq::dead_letters`] shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct RabbitDeadLetter {
    /// The message.
    pub envelope: Envelope,
    /// The error given when it was dead-lettered (absent for messages the broker
    /// dead-lettered itself).
    pub error: Option<String>,
    /// Deliveries before it was dead-lettered.
    pub deliveries: i32,
}

impl RabbitMq {
    /// A transport for the broker at `url` (`amqp://user:pass@host:port/vhost`).
    pub fn builder(url: impl Into<String>) -> RabbitMqBuilder {
        RabbitMqBuilder {
            url: url.into(),
            exchange: "pgbox".into(),
            queue_prefix: "pgbox.".into(),
            declare: true,
            single_active_consumer: true,
            prefetch: 100,
            receive_wait: Duration::from_millis(200),
            connect_timeout: Duration::from_secs(10),
            confirm_timeout: Duration::from_secs(30),
            operation_timeout: Duration::from_secs(10),
            queue_expires: None,
            cloudevents: None,
            credentials: None,
            tls_roots: None,
            tls_identity: None,
            allow_insecure_credentials: false,
        }
    }

    /// The queue of `topic`.
    pub fn queue_name(&self, topic: &str) -> String {
        format!("{}{topic}", self.inner.config.queue_prefix)
    }

    /// The dead-letter queue of `topic`.
    pub fn dead_letter_queue(&self, topic: &str) -> String {
        format!("{}.dead", self.queue_name(topic))
    }

    /// Closes the connection (and so every consumer channel: unacked messages go back to
    /// their queues). The next call opens a new one.
    pub async fn close(&self) {
        self.inner.consumers.lock().expect("consumers").clear();
        if let Some(conn) = self.inner.conn.lock().await.take() {
            let _ = conn
                .connection
                .close(200, "closed".into())
                .within(&self.inner.bound, "close")
                .await;
            tracing::info!("pgbox rabbitmq connection closed");
        }
    }

    async fn conn(&self) -> Result<Conn> {
        let mut slot = self.inner.conn.lock().await;
        let suspect = self.inner.bound.suspect.swap(false, Ordering::Relaxed);
        if let Some(conn) = slot.as_ref()
            && conn.usable()
            && !suspect
        {
            return Ok(conn.clone());
        }
        let generation = slot.as_ref().map_or(0, |c| c.generation) + 1;
        if generation > 1 {
            tracing::warn!(generation, "pgbox rabbitmq connection lost; reconnecting");
        }
        if let Some(old) = slot.take() {
            // Close what is left of it without waiting here.
            let bound = self.inner.bound.clone();
            tokio::spawn(async move {
                let _ = old
                    .connection
                    .close(200, "replaced".into())
                    .within(&bound, "close")
                    .await;
            });
        }
        let config = &self.inner.config;
        let connection = self.open().await.inspect_err(|e| {
            if matches!(e, Error::Authentication { .. } | Error::Tls { .. }) {
                // A configuration problem, not an outage: loud. Still retried (by the relay,
                // the consumer), since a rotated password or renewed certificate fixes it.
                tracing::error!(error = %e, "pgbox rabbitmq cannot connect");
            }
        })?;
        let publish = connection
            .create_channel()
            .within(&self.inner.bound, "open channel")
            .await?;
        publish
            .confirm_select(ConfirmSelectOptions::default())
            .within(&self.inner.bound, "confirm.select")
            .await?;
        if config.declare {
            publish
                .exchange_declare(
                    short(&config.exchange)?,
                    ExchangeKind::Direct,
                    ExchangeDeclareOptions {
                        durable: true,
                        ..Default::default()
                    },
                    FieldTable::default(),
                )
                .within(&self.inner.bound, "declare exchange")
                .await?;
        }
        tracing::info!(generation, "pgbox rabbitmq connected");
        let conn = Conn {
            connection: Arc::new(connection),
            publish,
            generation,
            retry_queues: Arc::default(),
        };
        *slot = Some(conn.clone());
        Ok(conn)
    }

    /// Opens a connection with lapin, bounded by the connect timeout, and types its failure.
    async fn open(&self) -> Result<Connection> {
        let inner = &self.inner;
        let tls = inner.uri.scheme == AMQPScheme::AMQPS;
        let tls_config = if tls {
            inner.config.tls_config(&inner.target)?
        } else {
            OwnedTLSConfig::default()
        };
        let builder = DefaultConnectionBuilder::new()
            .map_err(|e| broker_error("connect", e))?
            .with_uri(inner.uri.clone())
            .with_properties(ConnectionProperties::default())
            .with_tls_config(tls_config);
        match tokio::time::timeout(inner.config.connect_timeout, builder.connect()).await {
            Ok(Ok(connection)) => Ok(connection),
            Ok(Err(e)) => Err(self.connect_error(&e, tls)),
            Err(_) => Err(broker_error(
                "connect",
                format_args!(
                    "{}: no connection within {:?}",
                    inner.target, inner.config.connect_timeout
                ),
            )),
        }
    }

    /// A failed connection attempt as a typed error: a refused login is
    /// [`Error::Authentication`], a TLS failure [`Error::Tls`], anything else (the broker is
    /// away) [`Error::Transport`]. No credential appears in any of them.
    fn connect_error(&self, e: &lapin::Error, tls: bool) -> Error {
        let target = self.inner.target.clone();
        let text = self.scrub(&e.to_string());
        if let lapin::ErrorKind::ProtocolError(amqp) = e.kind()
            && amqp.get_id() == 403
        {
            return Error::Authentication {
                target,
                reason: format!(
                    "{} (wrong user or password, or a user without access to the vhost)",
                    self.scrub(amqp.get_message().as_str())
                ),
            };
        }
        if tls {
            // A plain-text AMQP port answers a TLS hello with its protocol header, which
            // rustls reads as a record of no TLS type.
            let problem = crate::tls::classify(e).or_else(|| {
                text.contains("InvalidContentType")
                    .then_some(TlsProblem::NotOffered)
            });
            if let Some(problem) = problem {
                return Error::Tls {
                    target,
                    problem,
                    reason: text,
                };
            }
            // With TLS 1.3 the client's side of the handshake is done before the broker has
            // checked the client certificate: a broker refusing it (or its absence) sends an
            // alert and closes, and when the AMQP header the client sent meanwhile arrives
            // after the close, the reset can overtake the alert. So a connection reset or cut
            // after the handshake and before the broker's first AMQP frame is typed too.
            if let lapin::ErrorKind::IOError(io) = e.kind()
                && matches!(
                    io.kind(),
                    std::io::ErrorKind::ConnectionReset
                        | std::io::ErrorKind::ConnectionAborted
                        | std::io::ErrorKind::UnexpectedEof
                        | std::io::ErrorKind::BrokenPipe
                )
            {
                let given = if self.inner.config.tls_identity.is_some() {
                    "refused the client certificate"
                } else {
                    "requires a client certificate (none is configured: \
                     RabbitMqBuilder::tls_client_certificate)"
                };
                return Error::Tls {
                    target,
                    problem: TlsProblem::ClientCertificate,
                    reason: format!(
                        "{text}: the broker closed the connection during the TLS or AMQP \
                         handshake; most likely it {given} (its log says)"
                    ),
                };
            }
        }
        broker_error("connect", format_args!("{target}: {text}"))
    }

    /// `text` with the password replaced, should a client library ever quote it.
    fn scrub(&self, text: &str) -> String {
        let password = &self.inner.uri.authority.userinfo.password;
        if password.len() >= 4 && text.contains(password.as_str()) {
            text.replace(password.as_str(), "***")
        } else {
            text.to_owned()
        }
    }

    /// Connects now (else the first publish or receive does): a wrong password, an
    /// untrusted certificate or an unreachable broker shows at startup, as
    /// [`Error::Authentication`], [`Error::Tls`] or [`Error::Transport`]. A no-op when
    /// connected.
    pub async fn connect(&self) -> Result<()> {
        self.conn().await.map(|_| ())
    }

    /// Declares the exchange, the topic's queue, its binding and its dead-letter queue
    /// (idempotent; a no-op when `declare` is off).
    pub async fn declare_topic(&self, topic: &str) -> Result<()> {
        let conn = self.conn().await?;
        let channel = conn
            .connection
            .create_channel()
            .within(&self.inner.bound, "open channel")
            .await?;
        let result = self.declare_on(&channel, topic).await;
        let _ = channel
            .close(200, "declared".into())
            .within(&self.inner.bound, "close channel")
            .await;
        result
    }

    async fn declare_on(&self, channel: &Channel, topic: &str) -> Result<()> {
        let config = &self.inner.config;
        if !config.declare {
            return Ok(());
        }
        let durable = QueueDeclareOptions {
            durable: true,
            ..Default::default()
        };
        let queue = self.queue_name(topic);
        let dead = self.dead_letter_queue(topic);
        let mut args_expiry = None;
        channel
            .exchange_declare(
                short(&config.exchange)?,
                ExchangeKind::Direct,
                ExchangeDeclareOptions {
                    durable: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .within(&self.inner.bound, "declare exchange")
            .await?;
        let mut dead_args = FieldTable::default();
        if let Some(expires) = config.queue_expires {
            let ms = AMQPValue::LongLongInt(expires.as_millis().min(u32::MAX.into()) as i64);
            dead_args.insert("x-expires".into(), ms.clone());
            args_expiry = Some(ms);
        }
        channel
            .queue_declare(short(&dead)?, durable, dead_args)
            .within(&self.inner.bound, "declare dead-letter queue")
            .await?;
        let mut args = FieldTable::default();
        args.insert("x-queue-type".into(), long_value("quorum"));
        args.insert("x-dead-letter-exchange".into(), long_value(""));
        args.insert("x-dead-letter-routing-key".into(), long_value(&dead));
        if let Some(ms) = args_expiry {
            args.insert("x-expires".into(), ms);
        }
        if config.single_active_consumer {
            args.insert("x-single-active-consumer".into(), AMQPValue::Boolean(true));
        }
        channel
            .queue_declare(short(&queue)?, durable, args)
            .within(&self.inner.bound, "declare queue")
            .await?;
        channel
            .queue_bind(
                short(&queue)?,
                short(&config.exchange)?,
                short(topic)?,
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .within(&self.inner.bound, "bind queue")
            .await?;
        tracing::debug!(topic, queue, "pgbox rabbitmq topology declared");
        Ok(())
    }

    /// Up to `max` dead letters of `topic`, oldest first, left in their queue (they are
    /// read on a channel that is then closed, which puts them back).
    pub async fn dead_letters(&self, topic: &str, max: usize) -> Result<Vec<RabbitDeadLetter>> {
        let conn = self.conn().await?;
        let channel = conn
            .connection
            .create_channel()
            .within(&self.inner.bound, "open channel")
            .await?;
        let queue = self.dead_letter_queue(topic);
        let mut out = Vec::new();
        while out.len() < max {
            let got = channel
                .basic_get(short(&queue)?, BasicGetOptions { no_ack: false })
                .within(&self.inner.bound, "basic.get")
                .await?;
            let Some(message) = got else { break };
            let d = &message.delivery;
            let headers = d.properties.headers().clone().unwrap_or_default();
            // A message that could not be decoded (how it got here) is shown as it is.
            let (envelope, undecodable) = match decode(topic, &d.properties, &d.data) {
                Ok(e) => (e, None),
                Err(e) => (
                    undecodable_envelope(topic, &d.properties, &d.data),
                    Some(e.to_string()),
                ),
            };
            out.push(RabbitDeadLetter {
                envelope,
                error: header_text(&headers, ERROR).or(undecodable),
                deliveries: header_int(&headers, DELIVERIES).unwrap_or(0) as i32,
            });
        }
        let _ = channel
            .close(200, "inspected".into())
            .within(&self.inner.bound, "close channel")
            .await;
        Ok(out)
    }

    /// Publishes `properties`/`payload` to `queue` through the default exchange and awaits
    /// the confirm.
    async fn publish_copy(
        &self,
        conn: &Conn,
        queue: &str,
        properties: BasicProperties,
        payload: &[u8],
    ) -> Result<()> {
        let confirm = conn
            .publish
            .basic_publish(
                "".into(),
                short(queue)?,
                BasicPublishOptions {
                    mandatory: true,
                    ..Default::default()
                },
                payload,
                properties,
            )
            .within(&self.inner.bound, "publish")
            .await?
            .within(&self.inner.bound, "publish confirm")
            .await?;
        confirmed(confirm).map_err(|e| broker_error("publish", e.to_string()))
    }

    /// A copy of a delivery's message with the redelivery bookkeeping headers.
    fn copy_properties(delivery: &RabbitDelivery, error: &str) -> BasicProperties {
        let mut headers = delivery.properties.headers().clone().unwrap_or_default();
        let mut clean = FieldTable::default();
        for (k, v) in headers.inner() {
            if !is_broker_header(k.as_str()) && k.as_str() != DELIVERIES && k.as_str() != ERROR {
                clean.insert(k.clone(), v.clone());
            }
        }
        headers = clean;
        headers.insert(
            DELIVERIES.into(),
            AMQPValue::LongLongInt(i64::from(delivery.attempt)),
        );
        headers.insert(ERROR.into(), long_value(truncate(error, MAX_ERROR_BYTES)));
        delivery.properties.clone().with_headers(headers)
    }

    async fn consumer_slot(&self, topic: &str) -> Arc<Mutex<Option<TopicConsumer>>> {
        self.inner
            .consumers
            .lock()
            .expect("consumers")
            .entry(topic.to_owned())
            .or_default()
            .clone()
    }

    async fn open_consumer(&self, topic: &str) -> Result<TopicConsumer> {
        let conn = self.conn().await?;
        let channel = conn
            .connection
            .create_channel()
            .within(&self.inner.bound, "open channel")
            .await?;
        channel
            .basic_qos(self.inner.config.prefetch, BasicQosOptions::default())
            .within(&self.inner.bound, "basic.qos")
            .await?;
        self.declare_on(&channel, topic).await?;
        let consumer = channel
            .basic_consume(
                short(&self.queue_name(topic))?,
                "".into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .within(&self.inner.bound, "basic.consume")
            .await?;
        tracing::info!(topic, "pgbox rabbitmq consumer started");
        Ok(TopicConsumer {
            channel,
            generation: conn.generation,
            consumer,
            held: VecDeque::new(),
            gate: Arc::default(),
        })
    }
}

/// Whether the broker set this header (never copied, never shown as a message header).
fn is_broker_header(name: &str) -> bool {
    name == "x-death"
        || name == DELIVERY_COUNT
        || name.starts_with("x-first-death-")
        || name.starts_with("x-last-death-")
}

fn short(s: &str) -> Result<ShortString> {
    ShortString::try_new(s).map_err(|_| Error::InvalidField {
        field: "rabbitmq name",
        reason: "longer than 255 bytes",
    })
}

fn long_value(s: &str) -> AMQPValue {
    AMQPValue::LongString(LongString::from(s.as_bytes()))
}

fn value_text(v: &AMQPValue) -> Option<String> {
    Some(match v {
        AMQPValue::LongString(s) => String::from_utf8_lossy(s.as_bytes()).into_owned(),
        AMQPValue::ShortString(s) => s.as_str().to_owned(),
        AMQPValue::Boolean(b) => b.to_string(),
        AMQPValue::ShortShortInt(n) => n.to_string(),
        AMQPValue::ShortShortUInt(n) => n.to_string(),
        AMQPValue::ShortInt(n) => n.to_string(),
        AMQPValue::ShortUInt(n) => n.to_string(),
        AMQPValue::LongInt(n) => n.to_string(),
        AMQPValue::LongUInt(n) => n.to_string(),
        AMQPValue::LongLongInt(n) => n.to_string(),
        AMQPValue::Timestamp(n) => n.to_string(),
        _ => return None,
    })
}

fn header_text(headers: &FieldTable, name: &str) -> Option<String> {
    headers.inner().get(name).and_then(value_text)
}

fn header_int(headers: &FieldTable, name: &str) -> Option<i64> {
    header_text(headers, name).and_then(|s| s.parse().ok())
}

fn properties(envelope: &Envelope) -> Result<BasicProperties, PublishError> {
    let bad = |what: &str| PublishError::refused(format!("message {}: {what}", envelope.id));
    let mut headers = FieldTable::default();
    for (k, v) in &envelope.headers {
        let name = ShortString::try_new(k.as_str())
            .map_err(|_| bad("header name longer than 255 bytes"))?;
        if k.starts_with("x-pgbox-") || is_broker_header(k) {
            return Err(bad("header name is reserved"));
        }
        headers.insert(name, long_value(v));
    }
    let created_at = envelope
        .created_at
        .format(&Rfc3339)
        .map_err(|_| bad("creation time out of range"))?;
    headers.insert(CREATED_AT.into(), long_value(&created_at));
    if let Some(key) = &envelope.ordering_key {
        headers.insert(ORDERING_KEY.into(), long_value(key));
    }
    let content_type = ShortString::try_new(envelope.content_type.as_str())
        .map_err(|_| bad("content type longer than 255 bytes"))?;
    Ok(BasicProperties::default()
        .with_message_id(envelope.id.to_string().into())
        .with_content_type(content_type)
        .with_delivery_mode(2)
        .with_timestamp(envelope.created_at.unix_timestamp().max(0) as u64)
        .with_headers(headers))
}

/// The properties and body of `envelope`: native, or a CloudEvent when configured.
fn wire<'e>(
    cloudevents: Option<&CloudEvents>,
    envelope: &'e Envelope,
) -> Result<(BasicProperties, Cow<'e, [u8]>), PublishError> {
    let Some(ce) = cloudevents else {
        return properties(envelope).map(|p| (p, Cow::Borrowed(&envelope.payload[..])));
    };
    let bad = |e: Error| PublishError::refused(format!("message {}: {e}", envelope.id));
    let attributes = ce.attributes(envelope).map_err(bad)?;
    let mut headers = FieldTable::default();
    for (k, v) in &attributes.transport {
        let name = ShortString::try_new(k.as_str()).map_err(|_| {
            PublishError::refused(format!(
                "message {}: header name longer than 255 bytes",
                envelope.id
            ))
        })?;
        if k.starts_with("x-pgbox-") || is_broker_header(k) {
            return Err(PublishError::refused(format!(
                "message {}: header name is reserved",
                envelope.id
            )));
        }
        headers.insert(name, long_value(v));
    }
    let base = BasicProperties::default()
        .with_message_id(envelope.id.to_string().into())
        .with_delivery_mode(2)
        .with_timestamp(envelope.created_at.unix_timestamp().max(0) as u64);
    let (content_type, body) = match ce.content_mode() {
        ContentMode::Structured => (
            STRUCTURED_CONTENT_TYPE.to_owned(),
            Cow::Owned(ce.to_json(envelope).map_err(bad)?),
        ),
        _ => {
            for (name, value) in &attributes.attrs {
                headers.insert(format!("{AMQP_PREFIX}{name}").into(), long_value(value));
            }
            (
                envelope.content_type.clone(),
                Cow::Borrowed(&envelope.payload[..]),
            )
        }
    };
    let content_type = ShortString::try_new(content_type).map_err(|_| {
        PublishError::refused(format!(
            "message {}: content type longer than 255 bytes",
            envelope.id
        ))
    })?;
    Ok((
        base.with_content_type(content_type).with_headers(headers),
        body,
    ))
}

/// A CloudEvent's envelope, when the message is one (binary: a `specversion` header with
/// either of the AMQP binding's prefixes; structured: its content type).
fn decode_cloudevent(
    topic: &str,
    properties: &BasicProperties,
    data: &[u8],
) -> Option<Result<Envelope>> {
    let table = properties.headers().clone().unwrap_or_default();
    // pgbox's native form (its creation-time header, never sent with an event) is native,
    // whatever headers of a binding's naming the message's producer added.
    if table.inner().contains_key(CREATED_AT) {
        return None;
    }
    let content_type = properties.content_type().as_ref().map(|c| c.to_string());
    let mut attrs = BTreeMap::new();
    let mut others = BTreeMap::new();
    for (k, v) in table.inner() {
        let k = k.as_str();
        if k.starts_with("x-pgbox-") || is_broker_header(k) {
            continue;
        }
        let Some(text) = value_text(v) else { continue };
        match k
            .strip_prefix(AMQP_PREFIX)
            .or_else(|| k.strip_prefix(AMQP_PREFIX_COLON))
        {
            // The AMQP binding maps the Timestamp type to the protocol's timestamp (seconds
            // since the epoch in AMQP 0-9-1's field tables): the attribute is its RFC 3339.
            Some("time") => {
                let time = match v {
                    AMQPValue::Timestamp(t) => i64::try_from(*t)
                        .ok()
                        .and_then(|t| OffsetDateTime::from_unix_timestamp(t).ok())
                        .and_then(|t| t.format(&Rfc3339).ok())
                        .unwrap_or(text),
                    _ => text,
                };
                attrs.insert("time".to_owned(), time)
            }
            Some(name) => attrs.insert(name.to_owned(), text),
            None => others.insert(k.to_owned(), text),
        };
    }
    if attrs.contains_key("specversion") {
        Some(cloudevents::decode_binary(
            topic,
            attrs,
            content_type,
            others,
            data,
        ))
    } else if content_type
        .as_deref()
        .is_some_and(cloudevents::is_structured)
    {
        Some(cloudevents::decode_structured(topic, data, others))
    } else {
        None
    }
}

/// A dead letter that does not decode, as far as it can be read: its message id when that
/// is a UUID (else nil), its payload, content type and text headers.
fn undecodable_envelope(topic: &str, properties: &BasicProperties, data: &[u8]) -> Envelope {
    let id = properties
        .message_id()
        .as_ref()
        .and_then(|id| Uuid::parse_str(id.as_str()).ok())
        .unwrap_or(Uuid::nil());
    let mut envelope = Envelope::new(id, topic, data.to_vec());
    if let Some(ct) = properties.content_type() {
        envelope.content_type = ct.to_string();
    }
    for (k, v) in properties.headers().clone().unwrap_or_default().inner() {
        if let Some(text) = value_text(v) {
            envelope.headers.insert(k.as_str().to_owned(), text);
        }
    }
    envelope
}

fn decode(topic: &str, properties: &BasicProperties, data: &[u8]) -> Result<Envelope> {
    if let Some(event) = decode_cloudevent(topic, properties, data) {
        return event;
    }
    let bad = |reason| Error::InvalidField {
        field: "rabbitmq message",
        reason,
    };
    let id = properties
        .message_id()
        .as_ref()
        .and_then(|id| Uuid::parse_str(id.as_str()).ok())
        .ok_or(bad("no message id, or not a UUID"))?;
    let table = properties.headers().clone().unwrap_or_default();
    let mut headers = BTreeMap::new();
    for (k, v) in table.inner() {
        let k = k.as_str();
        if k.starts_with("x-pgbox-") || is_broker_header(k) {
            continue;
        }
        if let Some(text) = value_text(v) {
            headers.insert(k.to_owned(), text);
        }
    }
    let created_at = header_text(&table, CREATED_AT)
        .and_then(|s| OffsetDateTime::parse(&s, &Rfc3339).ok())
        .or_else(|| {
            properties
                .timestamp()
                .and_then(|t| OffsetDateTime::from_unix_timestamp(t as i64).ok())
        })
        .unwrap_or_else(OffsetDateTime::now_utc);
    Ok(Envelope {
        seq: 0,
        id,
        topic: topic.to_owned(),
        ordering_key: header_text(&table, ORDERING_KEY),
        payload: data.to_vec(),
        content_type: properties
            .content_type()
            .as_ref()
            .map_or_else(|| "application/octet-stream".to_owned(), |c| c.to_string()),
        headers,
        created_at,
        attempts: 0,
    })
}

fn confirmed(confirmation: Confirmation) -> Result<(), PublishError> {
    match confirmation {
        Confirmation::Ack(None) => Ok(()),
        // Returned (312 NO_ROUTE: no queue is bound to the topic yet, or it was deleted and
        // is about to be declared again): the topology's state, not the message's fault,
        // like NATS with no stream for a subject. An outage: never counted as an attempt,
        // never dead-lettered; the relay backs the topic off until a queue takes it.
        Confirmation::Ack(Some(returned)) => Err(PublishError::unavailable(format!(
            "unroutable: returned by the broker ({} {}); is the topic's queue declared?",
            returned.reply_code, returned.reply_text
        ))),
        Confirmation::Nack(_) => Err(PublishError::refused("nacked by the broker")),
        Confirmation::NotRequested => Err(PublishError::refused("publisher confirms are off")),
    }
}

/// A lapin failure of a publish or its confirm, by whose fault. The broker closing the
/// channel over what was sent (a soft AMQP error: 406 message over `max_message_size`, 404
/// exchange not found) refuses the message; everything else (I/O, a connection or channel
/// already closed, a connection-level error such as 320 when the broker shuts down, a
/// missed heartbeat) is an outage. So is 403 ACCESS_REFUSED: the user may not write to the
/// exchange, which holds for every message alike (an account to fix, like a refused login,
/// logged at error), not a fault of this one. The close fails every publish pending on the
/// channel alike: [`RabbitMq::publish`] finds the one it was over.
fn lapin_publish_error(what: &str, e: &lapin::Error) -> PublishError {
    let message = format!("{what}: {e}");
    if let lapin::ErrorKind::ProtocolError(amqp) = e.kind()
        && amqp.get_id() == 403
    {
        tracing::error!(error = %message, "pgbox rabbitmq: the broker refuses this user's publishes");
        PublishError::unavailable(message)
    } else if e.is_amqp_soft_error() {
        PublishError::refused(message)
    } else {
        PublishError::unavailable(message)
    }
}

/// The TTL bucket of a delay: milliseconds rounded up to a power of two (1 ms ..= 2^31 ms).
fn delay_bucket(delay: Duration) -> u64 {
    let ms = delay.as_nanos().div_ceil(1_000_000).clamp(1, 1 << 31) as u64;
    ms.next_power_of_two()
}

impl Publisher for RabbitMq {
    /// Publishes the batch pipelined (its confirms awaited together); then, when the broker
    /// closed the channel with several confirms pending, finds the message it was over.
    ///
    /// A channel closed by the broker (a soft AMQP error: 406 over `max_message_size`, say)
    /// fails every confirm still pending on it with the same error, and the close does not
    /// say which publish it was over. So the messages that got it are published again one
    /// at a time, in order, each on a channel of its own: the one the broker closes the
    /// channel over again is refused (an attempt of that message), the others get their own
    /// answer. A message acked before the close may so be published twice (the relay's
    /// delivery is at least once anyway). Only one such message: it is the one.
    ///
    /// A message the broker returns (unroutable: no queue bound to its topic yet) is
    /// unavailable, not refused: see the module's Topology section.
    async fn publish(&self, batch: &[Envelope]) -> Vec<Result<(), PublishError>> {
        let (mut results, closed_over) = self.publish_pipelined(batch).await;
        let shared: Vec<usize> = (0..batch.len()).filter(|&i| closed_over[i]).collect();
        if shared.len() < 2 {
            return results;
        }
        tracing::debug!(
            messages = shared.len(),
            "pgbox rabbitmq: the broker closed the publishing channel with several confirms pending; publishing them one at a time to find the message at fault"
        );
        let mut outage: Option<PublishError> = None;
        for i in shared {
            results[i] = match &outage {
                Some(error) => Err(error.clone()),
                None => {
                    let (mut one, _) = self
                        .publish_pipelined(std::slice::from_ref(&batch[i]))
                        .await;
                    let result = one.pop().expect("one result per message");
                    if let Err(error) = &result
                        && error.is_unavailable()
                    {
                        outage = Some(error.clone());
                    }
                    result
                }
            };
        }
        results
    }
}

impl RabbitMq {
    /// Publishes `batch` on the publishing channel, pipelined, and awaits its confirms.
    /// Beside each result: whether it failed because the broker closed the channel (a soft
    /// AMQP error, which every publish pending on the channel shares, whichever message
    /// it was over).
    async fn publish_pipelined(
        &self,
        batch: &[Envelope],
    ) -> (Vec<Result<(), PublishError>>, Vec<bool>) {
        let no_close = vec![false; batch.len()];
        let conn = match self.conn().await {
            Ok(c) => c,
            Err(e) => {
                // Not the messages' fault, whatever failed on the way (connect, the publish
                // channel, the exchange's declaration): an outage.
                tracing::debug!(error = %e, "pgbox rabbitmq publish: no connection");
                return (
                    vec![Err(PublishError::unavailable(e.to_string())); batch.len()],
                    no_close,
                );
            }
        };
        let exchange = match short(&self.inner.config.exchange) {
            Ok(x) => x,
            Err(e) => {
                return (
                    vec![Err(PublishError::refused(e.to_string())); batch.len()],
                    no_close,
                );
            }
        };
        // Write the whole batch out, then await the confirms: one round trip per batch.
        // The publishes run concurrently: each waits for lapin's I/O loop to write its
        // frames, and awaiting them one by one would cost a hand-off per message. Each
        // enqueues its frames (and takes its delivery tag) on its first poll, which
        // `join_all` does in order, so frames go out in batch order.
        let publish_channel = &conn.publish;
        let bound = &self.inner.bound;
        let sends = batch.iter().map(|envelope| {
            let prepared =
                wire(self.inner.config.cloudevents.as_ref(), envelope).and_then(|(p, body)| {
                    short(&envelope.topic)
                        .map(|k| (p, body, k))
                        .map_err(|e| PublishError::refused(e.to_string()))
                });
            let exchange = exchange.clone();
            async move {
                let (props, body, routing_key) = prepared.map_err(|e| (e, false))?;
                let publish = publish_channel.basic_publish(
                    exchange,
                    routing_key,
                    BasicPublishOptions {
                        mandatory: true,
                        ..Default::default()
                    },
                    &body,
                    props,
                );
                match tokio::time::timeout(bound.limit, publish).await {
                    Ok(Ok(confirm)) => Ok(confirm),
                    Ok(Err(e)) => Err((lapin_publish_error("publish", &e), e.is_amqp_soft_error())),
                    Err(_) => {
                        bound.suspect.store(true, Ordering::Relaxed);
                        Err((
                            PublishError::unavailable(format!(
                                "publish: no answer within {:?}",
                                bound.limit
                            )),
                            false,
                        ))
                    }
                }
            }
        });
        let pending = join_all(sends).await;
        let mut results = Vec::with_capacity(batch.len());
        let mut closed_over = Vec::with_capacity(batch.len());
        let deadline = tokio::time::Instant::now() + self.inner.config.confirm_timeout;
        for (envelope, p) in batch.iter().zip(pending) {
            let mut closed = false;
            let result = match p {
                Ok(confirm) => match tokio::time::timeout_at(deadline, confirm).await {
                    Ok(Ok(c)) => confirmed(c),
                    Ok(Err(e)) => {
                        closed = e.is_amqp_soft_error();
                        Err(lapin_publish_error("confirm failed", &e))
                    }
                    Err(_) => {
                        // The broker (or the way to it) is silent: replace the connection.
                        bound.suspect.store(true, Ordering::Relaxed);
                        Err(PublishError::unavailable(
                            "no confirm within the confirm timeout",
                        ))
                    }
                },
                Err((e, soft)) => {
                    closed = soft;
                    Err(e)
                }
            };
            closed_over.push(closed);
            match &result {
                Ok(()) => {
                    tracing::debug!(message_id = %envelope.id, topic = %envelope.topic, "pgbox rabbitmq published")
                }
                Err(e) => {
                    tracing::debug!(message_id = %envelope.id, topic = %envelope.topic, error = %e, "pgbox rabbitmq publish failed")
                }
            }
            results.push(result);
        }
        (results, closed_over)
    }
}

impl Subscriber for RabbitMq {
    type Delivery = RabbitDelivery;

    async fn receive(
        &self,
        topic: &str,
        max: usize,
        _visibility: Duration,
    ) -> Result<Vec<RabbitDelivery>> {
        let slot = self.consumer_slot(topic).await;
        let mut slot = slot.lock().await;
        // A channel of a replaced connection is stale even if it looks connected (the
        // connection was replaced because an operation on it hung).
        let generation = self.conn().await?.generation;
        if slot
            .as_ref()
            .is_some_and(|c| !c.channel.status().connected() || c.generation != generation)
        {
            tracing::warn!(topic, "pgbox rabbitmq consumer channel lost; reopening");
            *slot = None;
        }
        if slot.is_none() {
            *slot = Some(self.open_consumer(topic).await?);
        }
        let state = slot.as_mut().expect("just set");
        let mut out = Vec::new();
        // Held messages first, in arrival order, one per key (a key waiting for its requeued
        // message lets only that message out: see `admit`).
        let mut still_held = VecDeque::new();
        while let Some(d) = state.held.pop_front() {
            if out.len() < max && admit(&state.gate, &d) {
                out.push(d);
            } else {
                still_held.push_back(d);
            }
        }
        state.held = still_held;
        // Keys with a message still held: a later message of such a key pulled below waits
        // behind it even if the key is released meanwhile (an ack made while this receive
        // waits), or it would overtake the held one.
        let mut held_keys: HashSet<String> = state
            .held
            .iter()
            .filter_map(|d| d.envelope.ordering_key.clone())
            .collect();
        let mut waited = false;
        // Bounded: each turn takes one message off the prefetch buffer.
        for _ in 0..(max + usize::from(self.inner.config.prefetch)) {
            if out.len() >= max {
                break;
            }
            let next = if out.is_empty() && !waited {
                waited = true;
                match tokio::time::timeout(self.inner.config.receive_wait, state.consumer.next())
                    .await
                {
                    Ok(n) => n,
                    Err(_) => break,
                }
            } else {
                match state.consumer.next().now_or_never() {
                    Some(n) => n,
                    None => break,
                }
            };
            let delivery = match next {
                Some(Ok(d)) => d,
                Some(Err(e)) => {
                    *slot = None;
                    if out.is_empty() {
                        return Err(broker_error("consume", e));
                    }
                    tracing::warn!(topic, error = %e, "pgbox rabbitmq consumer failed");
                    return Ok(out);
                }
                None => {
                    *slot = None;
                    tracing::warn!(topic, "pgbox rabbitmq consumer cancelled");
                    return Ok(out);
                }
            };
            let envelope = match decode(topic, &delivery.properties, &delivery.data) {
                Ok(e) => e,
                Err(e) => {
                    // Not a pgbox message: straight to the dead letters (through the
                    // queue's dead-letter exchange).
                    tracing::warn!(topic, error = %e, "pgbox rabbitmq: undecodable message dead-lettered");
                    let _ = delivery
                        .acker
                        .nack(BasicNackOptions {
                            requeue: false,
                            ..Default::default()
                        })
                        .within(&self.inner.bound, "nack")
                        .await;
                    continue;
                }
            };
            let table = delivery.properties.headers().clone().unwrap_or_default();
            let before = header_int(&table, DELIVERIES).unwrap_or(0)
                + header_int(&table, DELIVERY_COUNT).unwrap_or(0);
            let d = RabbitDelivery {
                envelope,
                attempt: i32::try_from(before + 1).unwrap_or(i32::MAX),
                queue: self.queue_name(topic),
                acker: delivery.acker,
                properties: delivery.properties,
                gate: state.gate.clone(),
                tag: NEXT_TAG.fetch_add(1, Ordering::Relaxed),
                bound: self.inner.bound.clone(),
                hold_requeued: self.inner.config.single_active_consumer,
            };
            let behind_held = d
                .envelope
                .ordering_key
                .as_ref()
                .is_some_and(|k| held_keys.contains(k));
            if !behind_held && admit(&state.gate, &d) {
                out.push(d);
            } else {
                if let Some(k) = &d.envelope.ordering_key {
                    held_keys.insert(k.clone());
                }
                state.held.push_back(d);
            }
        }
        Ok(out)
    }

    fn envelope<'d>(&self, delivery: &'d RabbitDelivery) -> &'d Envelope {
        &delivery.envelope
    }

    fn attempt(&self, delivery: &RabbitDelivery) -> i32 {
        delivery.attempt
    }

    async fn ack(&self, delivery: &RabbitDelivery) -> Result<bool> {
        let result = delivery
            .acker
            .ack(BasicAckOptions::default())
            .within(&delivery.bound, "ack")
            .await;
        delivery.release_key();
        match result {
            Ok(done) => {
                tracing::debug!(message_id = %delivery.envelope.id, "pgbox rabbitmq ack");
                Ok(done)
            }
            // The channel is gone: the broker redelivers it.
            Err(e) => {
                tracing::warn!(message_id = %delivery.envelope.id, error = %e, "pgbox rabbitmq ack failed; it will be redelivered");
                Ok(false)
            }
        }
    }

    async fn nack(&self, delivery: &RabbitDelivery, delay: Duration, error: &str) -> Result<bool> {
        let result = self.nack_inner(delivery, delay, error).await;
        // A no-op after a requeue in place, which keeps the key held for the message.
        delivery.release_key();
        result
    }

    async fn dead_letter(&self, delivery: &RabbitDelivery, error: &str) -> Result<bool> {
        let result = async {
            let conn = self.conn().await?;
            let dead = format!("{}.dead", delivery.queue);
            self.publish_copy(
                &conn,
                &dead,
                Self::copy_properties(delivery, error),
                &delivery.envelope.payload,
            )
            .await?;
            ack_original(delivery).await
        }
        .await;
        match &result {
            Ok(_) => {
                tracing::warn!(message_id = %delivery.envelope.id, attempt = delivery.attempt, error, "pgbox rabbitmq message dead-lettered")
            }
            Err(e) => {
                tracing::warn!(message_id = %delivery.envelope.id, error = %e, "pgbox rabbitmq dead-letter failed; requeued");
                requeue(delivery).await;
            }
        }
        // After the requeue, which keeps the key held for the message's return.
        delivery.release_key();
        result
    }
}

/// Whether `d` may be handed out now (its key is not held, or held for `d` itself as the
/// return of a requeued message, or held past the bound for a return that did not come);
/// marks its key in hand.
fn admit(gate: &Gate, d: &RabbitDelivery) -> bool {
    let Some(key) = &d.envelope.ordering_key else {
        return true;
    };
    let mut gate = gate.lock().expect("gate");
    match gate.get(key) {
        None => {}
        Some(Holder::InHand(_)) => return false,
        Some(Holder::Requeued { id, .. }) if *id == d.envelope.id => {}
        Some(Holder::Requeued { id, until }) => {
            if Instant::now() < *until {
                return false;
            }
            tracing::warn!(
                message_id = %id,
                ordering_key = key.as_str(),
                "pgbox rabbitmq: a message requeued in place did not come back within the operation timeout (dead-lettered at a delivery limit?); letting the next message of its key out"
            );
        }
    }
    gate.insert(key.clone(), Holder::InHand(d.tag));
    true
}

async fn ack_original(delivery: &RabbitDelivery) -> Result<bool> {
    delivery
        .acker
        .ack(BasicAckOptions::default())
        .within(&delivery.bound, "ack")
        .await
        .or_else(|e| {
            tracing::warn!(message_id = %delivery.envelope.id, error = %e, "pgbox rabbitmq ack of the original failed; a duplicate will follow");
            Ok(false)
        })
}

/// Puts the message back in its queue (`basic.nack` with requeue), keeping its key held
/// until it is back. `false` when the nack was not sent or not answered in time (the
/// channel is gone, the connection is replaced, or the delivery was settled already): then
/// the key is let go, since a message whose channel is gone comes back to the consumer that
/// reopens it, with a fresh gate.
async fn requeue(delivery: &RabbitDelivery) -> bool {
    let done = delivery
        .acker
        .nack(BasicNackOptions {
            requeue: true,
            ..Default::default()
        })
        .within(&delivery.bound, "nack")
        .await
        .unwrap_or(false);
    if done {
        delivery.await_return();
    }
    done
}

impl RabbitMq {
    async fn nack_inner(
        &self,
        delivery: &RabbitDelivery,
        delay: Duration,
        error: &str,
    ) -> Result<bool> {
        if delay.is_zero() {
            let done = requeue(delivery).await;
            tracing::info!(message_id = %delivery.envelope.id, error, "pgbox rabbitmq nack; requeued");
            return Ok(done);
        }
        let bucket = delay_bucket(delay);
        let retry_queue = format!("{}.retry.{bucket}ms", delivery.queue);
        let result = async {
            let conn = self.conn().await?;
            let declared = conn
                .retry_queues
                .lock()
                .expect("retry queues")
                .get(&retry_queue)
                .is_some_and(|at| at.elapsed() < Duration::from_secs(60));
            if !declared {
                let mut args = FieldTable::default();
                args.insert(
                    "x-message-ttl".into(),
                    AMQPValue::LongLongInt(bucket as i64),
                );
                args.insert("x-dead-letter-exchange".into(), long_value(""));
                args.insert(
                    "x-dead-letter-routing-key".into(),
                    long_value(&delivery.queue),
                );
                // Unused retry queues go away; messages waiting do not count as use, so
                // the expiry must outlast the TTL (each nack re-declares and resets it).
                let expires = (bucket * 2 + 600_000).min(u64::from(u32::MAX));
                args.insert("x-expires".into(), AMQPValue::LongLongInt(expires as i64));
                conn.publish
                    .queue_declare(
                        short(&retry_queue)?,
                        QueueDeclareOptions {
                            durable: true,
                            ..Default::default()
                        },
                        args,
                    )
                    .within(&self.inner.bound, "declare retry queue")
                    .await?;
                conn.retry_queues
                    .lock()
                    .expect("retry queues")
                    .insert(retry_queue.clone(), Instant::now());
            }
            self.publish_copy(
                &conn,
                &retry_queue,
                Self::copy_properties(delivery, error),
                &delivery.envelope.payload,
            )
            .await?;
            ack_original(delivery).await
        }
        .await;
        match &result {
            Ok(_) => {
                tracing::info!(message_id = %delivery.envelope.id, ?delay, ttl_ms = bucket, error, "pgbox rabbitmq nack; will redeliver")
            }
            Err(e) => {
                tracing::warn!(message_id = %delivery.envelope.id, error = %e, "pgbox rabbitmq delayed nack failed; requeued now");
                requeue(delivery).await;
            }
        }
        result
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[cfg(not(feature = "tls"))]
    fn amqps_without_the_tls_feature_is_refused_at_build() {
        let e = RabbitMq::builder("amqps://app:pw-1234@mq.example.invalid/%2f")
            .build()
            .unwrap_err();
        assert!(
            matches!(
                e,
                Error::Tls {
                    problem: TlsProblem::NotBuilt,
                    ..
                }
            ),
            "{e:?}"
        );
        assert!(!format!("{e} {e:?}").contains("pw-1234"));
    }

    #[test]
    fn invalid_urls_do_not_show_their_password() {
        let e = RabbitMq::builder("amqp://app:pw-1234@[bad/%2f")
            .build()
            .unwrap_err();
        assert!(matches!(e, Error::InvalidConfig(_)), "{e:?}");
        assert!(!format!("{e} {e:?}").contains("pw-1234"), "{e:?}");
    }

    #[test]
    fn delays_round_up_to_a_power_of_two_milliseconds() {
        assert_eq!(delay_bucket(Duration::ZERO), 1);
        assert_eq!(delay_bucket(Duration::from_micros(1)), 1);
        assert_eq!(delay_bucket(Duration::from_millis(10)), 16);
        assert_eq!(delay_bucket(Duration::from_millis(16)), 16);
        assert_eq!(delay_bucket(Duration::from_millis(1500)), 2048);
        assert_eq!(delay_bucket(Duration::from_secs(1 << 40)), 1 << 31);
        for ms in [1u64, 3, 999, 1001, 65_537] {
            let b = delay_bucket(Duration::from_millis(ms));
            assert!(b >= ms && b < 2 * ms, "{ms} ms -> {b} ms");
        }
    }

    #[test]
    #[cfg(feature = "testing")]
    fn reserved_headers_are_refused_and_not_shown() {
        let mut e = crate::transport::conformance::envelope("t", "x");
        e.headers.insert("x-pgbox-mine".into(), "v".into());
        assert!(properties(&e).is_err());
        e.headers.clear();
        e.headers.insert("x-death".into(), "v".into());
        assert!(properties(&e).is_err());
        e.headers.clear();
        e.headers.insert("ok".into(), "v".into());
        e.ordering_key = Some("k".into());
        let p = properties(&e).unwrap();
        let back = decode("t", &p, b"x").unwrap();
        assert_eq!(back.headers, e.headers);
        assert_eq!(back.ordering_key, e.ordering_key);
        assert_eq!(back.created_at, e.created_at);
        assert_eq!(back.id, e.id);
    }
}
