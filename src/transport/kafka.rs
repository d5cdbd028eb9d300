//! The Kafka transport (feature `kafka`, on [`rdkafka`] with a bundled librdkafka).
//!
//! [`Kafka`] is both a [`Publisher`] for the relay and a [`Subscriber`] for the
//! [`Consumer`](crate::Consumer) runner. Clone it freely: clones share one producer and one
//! group member per topic.
//!
//! # Topics and groups
//!
//! A pgbox topic is the Kafka topic of the same name (ASCII letters, digits, `.`, `_`, `-`;
//! at most 249 bytes). Its dead letters go to `<topic><suffix>` (default suffix `.dlq`,
//! [`KafkaBuilder::dead_letter_suffix`]). With [`KafkaBuilder::declare`] on (the default),
//! pgbox creates both topics when missing, with [`KafkaBuilder::partitions`] partitions
//! (default 8) and [`KafkaBuilder::replication_factor`] replicas (default 1: set 3 on a
//! production cluster). Each topic is consumed by its own consumer group,
//! `<group>.<topic>` ([`KafkaBuilder::group`], default `pgbox`), so that a service
//! consuming several topics does not rebalance all of them when one changes.
//!
//! # Publishing
//!
//! The producer is idempotent (`enable.idempotence`) with `acks=all`: a message is reported
//! `Ok` only once every in-sync replica has it, and librdkafka's own retries neither
//! duplicate nor reorder it within a partition. The ordering key is the Kafka message key,
//! so a key's messages land in one partition, in order. The message id (`pgbox-id`),
//! pgbox's fields (`pgbox-meta`, JSON: content type, creation time, the message headers
//! byte-exact) and `traceparent`/`tracestate` travel as Kafka headers. A relay that re-sends
//! a message after a lost acknowledgement makes a second copy in the topic (Kafka has no
//! message-id deduplication outside transactions, which pgbox does not use): the consumer's
//! inbox absorbs it. Messages whose payload is larger than
//! [`KafkaBuilder::message_max_bytes`] (default 1 MiB, the broker's usual limit), or whose
//! ordering key and headers take more than 3 KiB, are refused with a typed error before
//! they reach the producer; the producer's own limit is set above both (the broker's
//! `message.max.bytes` must allow it too).
//!
//! # Receiving
//!
//! Offsets are committed only after the runner acks, that is after the inbox transaction
//! committed (never auto-commit): a partition's committed offset is its lowest unsettled
//! message, so a crash or a rebalance redelivers what was not yet processed (the inbox
//! makes those duplicates harmless) and never skips anything. Commits are batched, at most
//! one per partition every [`KafkaBuilder::commit_interval`] (default 50 ms). Fetches wait
//! up to 100 ms for records (`fetch.wait.max.ms`; a broker answers as soon as records
//! arrive; tansu 0.6 waits the whole time, so set it lower there).
//!
//! **Order**: at most one message per ordering key is in hand at a time, and a key's
//! messages are handed out in partition order, also across a nack (the nacked message
//! comes back before the key's later messages). Messages without a key run concurrently.
//! During a rebalance a partition's in-hand messages may be delivered again to the new
//! owner while the old one finishes them; the inbox decides which one takes effect.
//!
//! **Attempts across consumers**: each commit carries, as the offset's metadata, how far
//! the partition was handed out and the attempt of the message at the committed offset
//! (sent, not waited for, whenever messages past the last such mark are handed out). A
//! consumer that takes the partition over counts a message delivered before as attempt 2
//! or more, so `max_deliveries` also stops a message that crashes its consumer. This needs
//! a broker that keeps offset-commit metadata, as Apache Kafka does; tansu 0.6 returns it
//! empty, and there attempts restart at 1 with each new owner (pgbox's tests show it).
//!
//! **Visibility timeout**: Kafka has none; pgbox keeps one in the consumer. A message in
//! hand longer than the `visibility` given to `receive` (the runner's visibility timeout)
//! is handed out again, as the next attempt, and the earlier hand-out's ack reports stale;
//! the inbox decides which one takes effect. A consumer that dies loses its partitions to
//! the group's other members after [`KafkaBuilder::session_timeout`] (or at once when it
//! leaves cleanly).
//!
//! A nack with a delay holds the message (and its key) in the consumer for the delay; a
//! dead letter is copied to the dead-letter topic (with `pgbox-error` and
//! `pgbox-deliveries` headers, acks=all) and then settled. A message that is not pgbox's
//! (no `pgbox-id`/`pgbox-meta` headers) is copied there as it is.
//!
//! # TLS and SASL
//!
//! [`KafkaBuilder::security_protocol`] picks plain TCP, TLS, or SASL over either; TLS needs
//! the `tls` feature (librdkafka with the system's OpenSSL). The brokers' certificates are
//! verified against the system's roots (OpenSSL's default paths) or
//! [`KafkaBuilder::tls_root_certificates`], host name included;
//! [`KafkaBuilder::tls_client_certificate`] answers brokers that ask for a client
//! certificate. [`KafkaBuilder::sasl`] takes PLAIN, SCRAM-SHA-256 or SCRAM-SHA-512 with a
//! [`Secret`] password. A managed cluster (Confluent Cloud, Amazon MSK with SASL/SCRAM):
//!
//! ```no_run
//! # fn main() -> pgbox::Result<()> {
//! use pgbox::Secret;
//! use pgbox::transport::kafka::{Kafka, SaslMechanism, SecurityProtocol};
//!
//! let kafka = Kafka::builder("b-1.example.kafka.eu-west-1.amazonaws.com:9096")
//!     .security_protocol(SecurityProtocol::SaslSsl)
//!     .sasl(SaslMechanism::ScramSha512, "orders", Secret::from_env("KAFKA_PASSWORD")?)
//!     .replication_factor(3)
//!     .build()?;
//! # drop(kafka);
//! # Ok(())
//! # }
//! ```
//!
//! (Confluent Cloud: `SaslMechanism::Plain`, the API key as user and its secret as
//! password.) librdkafka retries a refused password or an unverifiable certificate for
//! ever; pgbox watches its error reports and ends the operation waiting on the brokers
//! ([`Kafka::reachable`], declaring topics, a publish, a receive) with
//! [`Error::Authentication`] or [`Error::Tls`] (its [`TlsProblem`] says which), for 10 s
//! after each report (librdkafka reports again at each reconnection). SASL over plain TCP
//! to a broker off loopback is refused at [`build`](KafkaBuilder::build)
//! ([`Error::InsecureCredentials`]) unless
//! [`allow_insecure_credentials`](KafkaBuilder::allow_insecure_credentials). librdkafka's
//! own logs go to `tracing` (target `librdkafka`); librdkafka redacts its sensitive
//! settings even in its `debug=conf` dump, and the builder's `Debug` shows none.

use std::borrow::Cow;
use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::fmt;
use std::path::PathBuf;
use std::sync::{Arc, Mutex as StdMutex, OnceLock};
use std::time::{Duration, Instant};

use futures_util::FutureExt;
use futures_util::future::join_all;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{
    BaseConsumer, CommitMode, Consumer, ConsumerContext, RebalanceProtocol, StreamConsumer,
};
use rdkafka::error::RDKafkaErrorCode;
use rdkafka::message::{Header, Headers, Message, OwnedHeaders, OwnedMessage};
use rdkafka::producer::{FutureProducer, FutureRecord, Producer};
use rdkafka::types::RDKafkaRespErr;
use rdkafka::{ClientContext, Offset, TopicPartitionList};
use serde::{Deserialize, Serialize};
use time::OffsetDateTime;
use uuid::Uuid;

use super::{PublishError, Publisher, Subscriber, truncate};
use crate::Secret;
use crate::cloudevents::{self, CloudEvents, ContentMode, STRUCTURED_CONTENT_TYPE};
use crate::error::{Error, Result, TlsProblem};
use crate::outbox::{Envelope, TRACEPARENT};

const TRANSPORT: &str = "kafka";
const ID: &str = "pgbox-id";
const META: &str = "pgbox-meta";
const ERROR: &str = "pgbox-error";
const DELIVERIES: &str = "pgbox-deliveries";
/// The transport's own headers: a message's header of one of these names is refused in
/// CloudEvents mode (the native form carries every header inside `pgbox-meta`). Other
/// `pgbox-` headers (a replay's `pgbox-replay-id`, the router's `pgbox-destinations`) are a
/// message's own and travel as they are.
const RESERVED: [&str; 4] = [ID, META, ERROR, DELIVERIES];
const MAX_ERROR_BYTES: usize = 4096;
/// Bytes a published record may spend on its key and headers, beyond the payload limit.
const RECORD_EXTRA_BYTES: usize = 3072;
/// The offset metadata's prefix: `pgbox:1:<handed-out-through>:<head attempt>`.
const METADATA_PREFIX: &str = "pgbox:1:";
/// Bound on the broker calls made inside librdkafka's rebalance callback.
const REBALANCE_CALL: Duration = Duration::from_secs(10);
/// How long after a failed copy of not-pgbox records to the dead-letter topic the next
/// try waits.
const FOREIGN_RETRY: Duration = Duration::from_secs(1);
/// How long dropping a consumer waits for it to close (see `TopicConsumer`'s `Drop`).
const CLOSE_WAIT: Duration = Duration::from_secs(15);
/// What [`kafka_name`] accepts, for the builder's errors.
const KAFKA_NAME: &str = "1 to 249 ASCII letters, digits, '.', '_' and '-'";

fn broker_error(what: &str, e: impl fmt::Display) -> Error {
    Error::Transport {
        transport: TRANSPORT,
        message: format!("{what}: {e}"),
    }
}

/// How the clients talk to the brokers (librdkafka's `security.protocol`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum SecurityProtocol {
    /// Plain TCP, no credentials (the default).
    #[default]
    Plaintext,
    /// TLS (needs the `tls` feature); the server's certificate is verified, host name
    /// included.
    Ssl,
    /// SASL credentials over plain TCP: refused towards a broker that is not on loopback
    /// unless [`KafkaBuilder::allow_insecure_credentials`] says so.
    SaslPlaintext,
    /// SASL credentials inside TLS (needs the `tls` feature): what managed Kafka services use.
    SaslSsl,
}

impl SecurityProtocol {
    fn name(self) -> &'static str {
        match self {
            SecurityProtocol::Plaintext => "plaintext",
            SecurityProtocol::Ssl => "ssl",
            SecurityProtocol::SaslPlaintext => "sasl_plaintext",
            SecurityProtocol::SaslSsl => "sasl_ssl",
        }
    }

    fn tls(self) -> bool {
        matches!(self, SecurityProtocol::Ssl | SecurityProtocol::SaslSsl)
    }

    fn sasl(self) -> bool {
        matches!(
            self,
            SecurityProtocol::SaslPlaintext | SecurityProtocol::SaslSsl
        )
    }
}

/// A SASL mechanism ([`KafkaBuilder::sasl`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum SaslMechanism {
    /// `PLAIN`: the password itself goes to the broker (inside TLS with
    /// [`SecurityProtocol::SaslSsl`]).
    Plain,
    /// `SCRAM-SHA-256`: a challenge and response; the password does not travel.
    ScramSha256,
    /// `SCRAM-SHA-512`.
    ScramSha512,
}

impl SaslMechanism {
    fn name(self) -> &'static str {
        match self {
            SaslMechanism::Plain => "PLAIN",
            SaslMechanism::ScramSha256 => "SCRAM-SHA-256",
            SaslMechanism::ScramSha512 => "SCRAM-SHA-512",
        }
    }
}

/// The SASL user and password.
#[derive(Clone)]
struct SaslCredentials {
    mechanism: SaslMechanism,
    username: String,
    password: Secret,
}

/// Builder for [`Kafka`]. Its `Debug` shows no password: the SASL password is a
/// [`Secret`], and the values of [`set`](Self::set) settings that hold a credential
/// (librdkafka's sensitive ones: `*.password`, `ssl.key.pem`, `*.secret`, ...) print as `***`.
#[derive(Clone)]
pub struct KafkaBuilder {
    bootstrap: String,
    group: String,
    declare: bool,
    partitions: i32,
    replication_factor: i32,
    dead_letter_suffix: String,
    receive_wait: Duration,
    session_timeout: Duration,
    commit_interval: Duration,
    message_max_bytes: usize,
    linger: Duration,
    max_buffered: usize,
    instance_id: Option<String>,
    settings: BTreeMap<String, String>,
    security_protocol: SecurityProtocol,
    sasl: Option<SaslCredentials>,
    root_certificates: Option<PathBuf>,
    client_certificate: Option<(PathBuf, PathBuf)>,
    allow_insecure_credentials: bool,
    cloudevents: Option<CloudEvents>,
}

impl fmt::Debug for KafkaBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let settings: BTreeMap<&str, &str> = self
            .settings
            .iter()
            .map(|(k, v)| {
                let shown = if sensitive_setting(k) { "***" } else { v };
                (k.as_str(), shown)
            })
            .collect();
        f.debug_struct("KafkaBuilder")
            .field("bootstrap", &self.bootstrap)
            .field("group", &self.group)
            .field("declare", &self.declare)
            .field("partitions", &self.partitions)
            .field("replication_factor", &self.replication_factor)
            .field("dead_letter_suffix", &self.dead_letter_suffix)
            .field("receive_wait", &self.receive_wait)
            .field("session_timeout", &self.session_timeout)
            .field("commit_interval", &self.commit_interval)
            .field("message_max_bytes", &self.message_max_bytes)
            .field("linger", &self.linger)
            .field("max_buffered", &self.max_buffered)
            .field("instance_id", &self.instance_id)
            .field("security_protocol", &self.security_protocol)
            .field(
                "sasl",
                &self
                    .sasl
                    .as_ref()
                    .map(|s| (s.mechanism, &s.username, &s.password)),
            )
            .field("root_certificates", &self.root_certificates)
            .field(
                "client_certificate",
                &self.client_certificate.as_ref().map(|(cert, _)| cert),
            )
            .field(
                "allow_insecure_credentials",
                &self.allow_insecure_credentials,
            )
            .field("cloudevents", &self.cloudevents)
            .field("settings", &settings)
            .finish()
    }
}

/// Whether the librdkafka setting `key` holds a credential (librdkafka's own list of
/// sensitive properties, by the words in their names): its value is never shown.
fn sensitive_setting(key: &str) -> bool {
    let k = key.to_ascii_lowercase();
    [
        "password",
        "secret",
        "pem",
        "ssl_key",
        "oauthbearer.config",
        "private.key",
        "keytab",
    ]
    .iter()
    .any(|w| k.contains(w))
}

impl KafkaBuilder {
    /// How the clients talk to the brokers (default [`SecurityProtocol::Plaintext`]).
    /// [`Ssl`](SecurityProtocol::Ssl) and [`SaslSsl`](SecurityProtocol::SaslSsl) need the
    /// `tls` feature: without it [`build`](Self::build) fails with [`Error::Tls`]
    /// ([`TlsProblem::NotBuilt`]). The SASL protocols need [`sasl`](Self::sasl), and
    /// credentials need a SASL protocol.
    pub fn security_protocol(mut self, protocol: SecurityProtocol) -> Self {
        self.security_protocol = protocol;
        self
    }

    /// The SASL mechanism, user and password (librdkafka's `sasl.mechanism`,
    /// `sasl.username`, `sasl.password`), for [`SecurityProtocol::SaslSsl`] (or
    /// `SaslPlaintext` on loopback). The password is a [`Secret`]: read it with
    /// [`Secret::from_env`] or [`Secret::from_file`] rather than writing it in the code.
    /// A password the broker refuses fails the first operation with
    /// [`Error::Authentication`] (not endless retries).
    pub fn sasl(
        mut self,
        mechanism: SaslMechanism,
        username: impl Into<String>,
        password: Secret,
    ) -> Self {
        self.sasl = Some(SaslCredentials {
            mechanism,
            username: username.into(),
            password,
        });
        self
    }

    /// Trust the certificate authorities in this PEM file (librdkafka's
    /// `ssl.ca.location`) instead of the system's roots (the default: OpenSSL's default
    /// certificate paths, `/etc/ssl/certs` on Debian). The brokers' certificates must also
    /// name the host dialled (`ssl.endpoint.identification.algorithm=https`, always on).
    pub fn tls_root_certificates(mut self, path: impl Into<PathBuf>) -> Self {
        self.root_certificates = Some(path.into());
        self
    }

    /// Present this client certificate and its private key (PEM files; librdkafka's
    /// `ssl.certificate.location` and `ssl.key.location`) to brokers that ask for one
    /// (mutual TLS). The key must not be encrypted (or give `ssl.key.password` with
    /// [`set`](Self::set): never shown by `Debug`).
    pub fn tls_client_certificate(
        mut self,
        certificate: impl Into<PathBuf>,
        key: impl Into<PathBuf>,
    ) -> Self {
        self.client_certificate = Some((certificate.into(), key.into()));
        self
    }

    /// Allow SASL credentials over plain TCP ([`SecurityProtocol::SaslPlaintext`]) to a
    /// broker that is not on loopback (default `false`: [`build`](Self::build) fails with
    /// [`Error::InsecureCredentials`]). PLAIN sends the password itself; SCRAM does not,
    /// but hands an eavesdropper what an offline password guess needs, and leaves the
    /// session after it open to reading and tampering. For a network you trust completely.
    pub fn allow_insecure_credentials(mut self, allow: bool) -> Self {
        self.allow_insecure_credentials = allow;
        self
    }

    /// Publishes every message as a CloudEvent ([`crate::cloudevents`]): in binary mode the
    /// attributes are headers `ce_<name>` and `datacontenttype` is `content-type` (the Kafka
    /// binding); the record key stays the ordering key (`partitionkey`). Receiving reads
    /// CloudEvents and native messages alike, with or without this.
    pub fn cloudevents(mut self, config: CloudEvents) -> Self {
        self.cloudevents = Some(config);
        self
    }

    /// The consumer group prefix (default `pgbox`): topic `T` is consumed by group
    /// `<group>.<T>`. Give each consuming service its own.
    pub fn group(mut self, group: impl Into<String>) -> Self {
        self.group = group.into();
        self
    }

    /// Create missing topics (and their dead-letter topics) on first use (default `true`).
    pub fn declare(mut self, declare: bool) -> Self {
        self.declare = declare;
        self
    }

    /// Partitions of the topics pgbox creates (default 8).
    pub fn partitions(mut self, n: i32) -> Self {
        self.partitions = n;
        self
    }

    /// Replicas of the topics pgbox creates (default 1; 3 on a production cluster).
    pub fn replication_factor(mut self, n: i32) -> Self {
        self.replication_factor = n;
        self
    }

    /// The dead-letter topic of `T` is `<T><suffix>` (default `.dlq`).
    pub fn dead_letter_suffix(mut self, suffix: impl Into<String>) -> Self {
        self.dead_letter_suffix = suffix.into();
        self
    }

    /// How long `receive` waits for messages before returning none (default 200 ms).
    pub fn receive_wait(mut self, wait: Duration) -> Self {
        self.receive_wait = wait;
        self
    }

    /// How long the group waits for a silent member before giving its partitions to
    /// others (default 10 s; Kafka's `session.timeout.ms`; at most `max.poll.interval.ms`,
    /// 5 min unless set).
    pub fn session_timeout(mut self, timeout: Duration) -> Self {
        self.session_timeout = timeout;
        self
    }

    /// At most one offset commit per partition this often (default 50 ms); a partition
    /// with nothing left in hand commits at once.
    pub fn commit_interval(mut self, interval: Duration) -> Self {
        self.commit_interval = interval;
        self
    }

    /// The largest message the producer sends (default 1 MiB); larger ones are refused.
    pub fn message_max_bytes(mut self, bytes: usize) -> Self {
        self.message_max_bytes = bytes;
        self
    }

    /// How long the producer waits to fill a request (default 2 ms; `linger.ms`).
    pub fn linger(mut self, linger: Duration) -> Self {
        self.linger = linger;
        self
    }

    /// Messages a consumer holds for the runner before it pauses fetching (default 10 000).
    pub fn max_buffered(mut self, n: usize) -> Self {
        self.max_buffered = n;
        self
    }

    /// Static group membership (Kafka's `group.instance.id`; default none): this process's
    /// stable name in its consumer groups, e.g. a pod's or a service replica's name.
    ///
    /// A consumer restarted under the same id takes its partitions back at once, without
    /// a rebalance of the group and without waiting for the dead process's session to time
    /// out (its in-hand messages come again, from the committed offsets, and the inbox
    /// absorbs what had taken effect). The price: a consumer that stops for good keeps its
    /// partitions until [`session_timeout`](Self::session_timeout) passes, since a static
    /// member does not leave its group on shutdown. At most one running process per id:
    /// the broker fences the older of two. On tansu 0.6 this is also what lets a restarted
    /// consumer take over from a SIGKILLed predecessor that led the group (see the guide's Kafka chapter).
    pub fn instance_id(mut self, id: impl Into<String>) -> Self {
        self.instance_id = Some(id.into());
        self
    }

    /// Any librdkafka setting for the producer and consumers (security, timeouts...):
    /// applied after pgbox's own. [`build`](Self::build) refuses, with an error naming the
    /// setting, those pgbox sets itself (`enable.idempotence`, `acks`,
    /// `enable.auto.commit`, `enable.auto.offset.store`, `message.timeout.ms`, `group.id`:
    /// use [`group`](Self::group); `group.instance.id`: use
    /// [`instance_id`](Self::instance_id); `linger.ms`: use [`linger`](Self::linger);
    /// `bootstrap.servers`: give them to [`Kafka::builder`]), values that void a guarantee
    /// (`auto.offset.reset` other than `earliest`, `partitioner=random`,
    /// `queuing.strategy=lifo`, `delivery.report.only.error=true`, `transactional.id`, more
    /// than 5 `max.in.flight.requests.per.connection`), and whatever librdkafka itself
    /// refuses when it creates the producer or a consumer (unknown settings, bad values,
    /// combinations), which would otherwise fail every publish.
    ///
    /// Every name is checked as librdkafka reads it: under its aliases (`request.required.acks`
    /// for `acks`, `delivery.timeout.ms` for `message.timeout.ms`, `queue.buffering.max.ms`
    /// for `linger.ms`, `max.in.flight` ...) and with a `topic.` prefix (librdkafka strips it
    /// and sets the default topic configuration's property: `topic.partitioner=random` is
    /// `partitioner=random`).
    pub fn set(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.settings.insert(key.into(), value.into());
        self
    }

    /// Validates the settings. Connects lazily, on first use.
    pub fn build(self) -> Result<Kafka> {
        let bad = |m: &str| Err(Error::InvalidConfig(format!("kafka: {m}")));
        if self.bootstrap.trim().is_empty() {
            return bad("bootstrap servers are empty");
        }
        if !kafka_name(&self.group) {
            return bad(&format!("group: {KAFKA_NAME}"));
        }
        if !kafka_name(&self.dead_letter_suffix) {
            return bad(&format!("dead-letter suffix: {KAFKA_NAME}"));
        }
        if self.partitions < 1 || self.replication_factor < 1 {
            return bad("partitions and replication factor must be at least 1");
        }
        if self.receive_wait < Duration::from_millis(10)
            || self.session_timeout < Duration::from_secs(1)
        {
            return bad("receive_wait must be at least 10 ms and session_timeout 1 s");
        }
        // librdkafka refuses a consumer whose session outlasts its poll interval.
        let poll_interval = self
            .setting("max.poll.interval.ms")
            .and_then(|ms| ms.trim().parse().ok())
            .map_or(Duration::from_secs(300), Duration::from_millis);
        if self.session_timeout > poll_interval {
            return bad(&format!(
                "session_timeout ({:?}) must not exceed max.poll.interval.ms ({poll_interval:?})",
                self.session_timeout
            ));
        }
        if self
            .instance_id
            .as_deref()
            .is_some_and(|id| !kafka_name(id))
        {
            return bad(&format!("instance id: {KAFKA_NAME}"));
        }
        if self.message_max_bytes < 1024 || self.max_buffered == 0 {
            return bad("message_max_bytes must be at least 1 KiB and max_buffered positive");
        }
        self.check_security()?;
        for (key, canonical) in self.canonical_settings() {
            if PGBOX_OWNS.contains(&canonical) {
                return Err(Error::InvalidConfig(format!(
                    "kafka: `{key}`{} is pgbox's to set (its delivery guarantees rest on it)",
                    also_known_as(key, canonical)
                )));
            }
            if let Some((_, how)) = SET_BY_BUILDER.iter().find(|(k, _)| *k == canonical) {
                return Err(Error::InvalidConfig(format!(
                    "kafka: `{key}`{}: {how}",
                    also_known_as(key, canonical)
                )));
            }
        }
        self.check_settings()?;
        Ok(Kafka {
            inner: Arc::new(Inner {
                config: self,
                producer: StdMutex::new(None),
                admin: OnceLock::new(),
                watch: Arc::new(SecurityWatch::default()),
                consumers: StdMutex::new(HashMap::new()),
                declared: StdMutex::new(HashSet::new()),
            }),
        })
    }
}

/// Settings that [`KafkaBuilder::set`] refuses because a guarantee of pgbox rests on their
/// value: the setting, the values allowed (none: pgbox's alone), and why.
const GUARDED_SETTINGS: &[(&str, &[&str], &str)] = &[
    (
        "auto.offset.reset",
        &["earliest", "smallest", "beginning"],
        "a new consumer group would skip what was published before it joined",
    ),
    (
        "partitioner",
        &[
            "consistent",
            "consistent_random",
            "murmur2",
            "murmur2_random",
            "fnv1a",
            "fnv1a_random",
        ],
        "a key's messages must go to one partition, or their order is lost",
    ),
    (
        "queuing.strategy",
        &["fifo"],
        "the producer must send a partition's messages in the order given",
    ),
    (
        "delivery.report.only.error",
        &["false"],
        "a publish is confirmed by its delivery report; without it none is ever confirmed",
    ),
    (
        "transactional.id",
        &[],
        "pgbox's producer is idempotent, not transactional; its publishes would all fail",
    ),
    (
        "group.id",
        &[],
        "each topic is consumed by its own group `<group>.<topic>`: set `group` instead",
    ),
    (
        "auto.commit.enable",
        &["false"],
        "offsets are committed only after the inbox transaction committed",
    ),
    (
        "ssl.endpoint.identification.algorithm",
        &["https"],
        "the broker's certificate must name the host dialled, or anyone with a certificate \
         from the same authority can stand in for the broker",
    ),
    (
        "enable.ssl.certificate.verification",
        &["true"],
        "an unverified broker certificate lets anyone on the path read and change the traffic",
    ),
];

/// Settings pgbox sets itself and the user may not (by their canonical names, see
/// [`canonical_setting`]).
const PGBOX_OWNS: &[&str] = &[
    "enable.idempotence",
    "request.required.acks",
    "enable.auto.commit",
    "enable.auto.offset.store",
    // Each publish waits for its delivery reports at most this long (30 s): an outage past
    // it is reported, and a message that outlived it in librdkafka's queue is not sent
    // after the relay published it again.
    "message.timeout.ms",
];

/// Settings pgbox sets from the builder (by their canonical names), and how to set them.
const SET_BY_BUILDER: &[(&str, &str)] = &[
    (
        "group.instance.id",
        "set it with `instance_id` (it is for consumers only)",
    ),
    ("queue.buffering.max.ms", "set it with `linger`"),
    (
        "metadata.broker.list",
        "give the bootstrap servers to `Kafka::builder`",
    ),
    ("security.protocol", "set it with `security_protocol`"),
    ("sasl.mechanisms", "set it with `sasl`"),
    ("sasl.username", "set it with `sasl`"),
    ("sasl.password", "set it with `sasl` (a `pgbox::Secret`)"),
];

/// librdkafka's aliases (`CONFIGURATION.md`: "Alias for ..."), alias first, by the name
/// left once a `topic.` prefix is stripped.
const ALIASES: &[(&str, &str)] = &[
    ("acks", "request.required.acks"),
    ("max.in.flight", "max.in.flight.requests.per.connection"),
    ("linger.ms", "queue.buffering.max.ms"),
    ("delivery.timeout.ms", "message.timeout.ms"),
    ("retries", "message.send.max.retries"),
    ("compression.type", "compression.codec"),
    ("bootstrap.servers", "metadata.broker.list"),
    ("sasl.mechanism", "sasl.mechanisms"),
    ("max.partition.fetch.bytes", "fetch.message.max.bytes"),
];

/// The property librdkafka sets for `key`: it strips one `topic.` prefix from a name that
/// is not a global property (it then sets the default topic configuration's; no global
/// property pgbox guards starts with `topic.`), and resolves aliases. The topic-level
/// `enable.auto.commit` (reached only through the prefix) is an alias of the legacy
/// `auto.commit.enable`, unlike the global `enable.auto.commit`.
fn canonical_setting(key: &str) -> &str {
    let (prefixed, name) = match key.strip_prefix("topic.") {
        Some(rest) => (true, rest),
        None => (false, key),
    };
    if prefixed && name == "enable.auto.commit" {
        return "auto.commit.enable";
    }
    ALIASES
        .iter()
        .find(|(alias, _)| *alias == name)
        .map_or(name, |(_, canonical)| canonical)
}

/// ` (librdkafka's `canonical`)` when `key` is another name of it, for error messages.
fn also_known_as(key: &str, canonical: &str) -> String {
    if key == canonical {
        String::new()
    } else {
        format!(" (librdkafka's `{canonical}`)")
    }
}

/// The most requests in flight per connection an idempotent producer allows.
const MAX_IN_FLIGHT_IDEMPOTENT: u32 = 5;

impl KafkaBuilder {
    /// The user's settings with the property librdkafka sets for each.
    fn canonical_settings(&self) -> impl Iterator<Item = (&str, &str)> {
        self.settings
            .keys()
            .map(|k| (k.as_str(), canonical_setting(k)))
    }

    /// The user's value of the property `canonical`, under whichever of its names it was
    /// set.
    fn setting(&self, canonical: &str) -> Option<&str> {
        self.canonical_settings()
            .find(|(_, c)| *c == canonical)
            .map(|(k, _)| self.settings[k].as_str())
    }

    /// What every client starts from: the bootstrap servers, then the user's settings.
    fn client_config(&self) -> ClientConfig {
        let mut c = ClientConfig::new();
        c.set("bootstrap.servers", &self.bootstrap)
            .set("client.id", "pgbox")
            .set(
                "message.max.bytes",
                // Room for the key and headers, a dead letter's error header, and framing.
                (self.message_max_bytes + RECORD_EXTRA_BYTES + MAX_ERROR_BYTES + 1024).to_string(),
            );
        c.set("security.protocol", self.security_protocol.name());
        if let Some(sasl) = &self.sasl {
            c.set("sasl.mechanisms", sasl.mechanism.name())
                .set("sasl.username", &sasl.username)
                .set("sasl.password", sasl.password.expose());
        }
        if let Some(path) = &self.root_certificates {
            c.set("ssl.ca.location", path.to_string_lossy());
        }
        if let Some((cert, key)) = &self.client_certificate {
            c.set("ssl.certificate.location", cert.to_string_lossy())
                .set("ssl.key.location", key.to_string_lossy());
        }
        for (k, v) in &self.settings {
            c.set(k, v);
        }
        c
    }

    /// Where errors say the cluster is: the bootstrap servers (host:port, never a
    /// credential).
    fn target(&self) -> String {
        format!("kafka at {}", self.bootstrap)
    }

    /// Refuses security settings that cannot work or would expose credentials: TLS
    /// without the `tls` feature, SASL without credentials and credentials without SASL,
    /// certificates without TLS, unreadable certificate files, and SASL over plain TCP to
    /// a broker that is not on loopback (unless allowed).
    fn check_security(&self) -> Result<()> {
        let protocol = self.security_protocol;
        let bad = |m: String| Err(Error::InvalidConfig(format!("kafka: {m}")));
        if protocol.tls() && !cfg!(feature = "tls") {
            return Err(Error::Tls {
                target: self.target(),
                problem: TlsProblem::NotBuilt,
                reason: format!(
                    "security protocol {} needs pgbox's `tls` feature (librdkafka with OpenSSL)",
                    protocol.name()
                ),
            });
        }
        match (&self.sasl, protocol.sasl()) {
            (None, true) => {
                return bad(format!(
                    "security protocol {} needs SASL credentials: set them with `sasl`",
                    protocol.name()
                ));
            }
            (Some(_), false) => {
                return bad(format!(
                    "SASL credentials are set but the security protocol is {}: use sasl_ssl",
                    protocol.name()
                ));
            }
            _ => {}
        }
        if let Some(sasl) = &self.sasl {
            if sasl.username.is_empty() || sasl.password.expose().is_empty() {
                return bad("the SASL user name and password must not be empty".into());
            }
            if sasl.mechanism != SaslMechanism::Plain && !cfg!(feature = "tls") {
                return bad(format!(
                    "SASL {} needs pgbox's `tls` feature (librdkafka's SCRAM is built with \
                     OpenSSL)",
                    sasl.mechanism.name()
                ));
            }
        }
        if !protocol.tls()
            && (self.root_certificates.is_some() || self.client_certificate.is_some())
        {
            return bad(format!(
                "TLS certificates are set but the security protocol is {}: use ssl or sasl_ssl",
                protocol.name()
            ));
        }
        let files = self.root_certificates.iter().chain(
            self.client_certificate
                .iter()
                .flat_map(|(cert, key)| [cert, key]),
        );
        for path in files {
            if let Err(e) = std::fs::File::open(path) {
                return Err(Error::Tls {
                    target: self.target(),
                    problem: TlsProblem::BadFile,
                    reason: format!("cannot read {}: {e}", path.display()),
                });
            }
        }
        if protocol == SecurityProtocol::SaslPlaintext && !self.allow_insecure_credentials {
            let remote: Vec<&str> = bootstrap_hosts(&self.bootstrap)
                .filter(|h| !crate::tls::is_loopback(h))
                .collect();
            if !remote.is_empty() {
                return Err(Error::InsecureCredentials {
                    transport: TRANSPORT,
                    setting: "allow_insecure_credentials",
                    reason: format!(
                        "SASL over sasl_plaintext to {} (not loopback): use sasl_ssl, or \
                         allow_insecure_credentials(true) on a network you trust",
                        remote.join(", ")
                    ),
                });
            }
        }
        Ok(())
    }

    /// The producer's settings: pgbox's guarantees on top of the user's.
    fn producer_config(&self) -> ClientConfig {
        let mut c = self.client_config();
        c.set("enable.idempotence", "true")
            .set("acks", "all")
            .set("linger.ms", self.linger.as_millis().to_string())
            .set("message.timeout.ms", "30000");
        c
    }

    /// The settings of the consumer of `group`.
    fn consumer_config(&self, group: &str) -> ClientConfig {
        let mut c = self.client_config();
        c.set("group.id", group)
            .set("enable.auto.commit", "false")
            .set("enable.auto.offset.store", "false")
            .set("auto.offset.reset", "earliest")
            .set(
                "session.timeout.ms",
                self.session_timeout.as_millis().to_string(),
            )
            .set(
                "heartbeat.interval.ms",
                (self.session_timeout.as_millis() / 4).max(100).to_string(),
            )
            .set("fetch.wait.max.ms", "100");
        if let Some(id) = &self.instance_id {
            c.set("group.instance.id", id);
        }
        // The user's settings again, after pgbox's (those pgbox's guarantees rest on are
        // refused by `build`).
        for (k, v) in &self.settings {
            c.set(k, v);
        }
        c
    }

    /// Refuses, naming the setting, what voids a guarantee ([`GUARDED_SETTINGS`], too many
    /// requests in flight for idempotence) and what librdkafka would refuse when the
    /// producer or a consumer is created (unknown settings, bad values, combinations it
    /// rejects): created here with no broker to reach, and dropped, so that a configuration
    /// mistake fails `build` instead of every publish.
    fn check_settings(&self) -> Result<()> {
        for (key, canonical) in self.canonical_settings() {
            let value = &self.settings[key];
            let aka = also_known_as(key, canonical);
            if let Some((_, allowed, why)) =
                GUARDED_SETTINGS.iter().find(|(k, _, _)| *k == canonical)
                && !allowed.contains(&value.trim().to_ascii_lowercase().as_str())
            {
                return Err(Error::InvalidConfig(if allowed.is_empty() {
                    format!("kafka: `{key}`{aka} cannot be set ({why})")
                } else {
                    format!(
                        "kafka: `{key}`{aka} = {value:?} voids a guarantee ({why}); allowed: {}",
                        allowed.join(", ")
                    )
                }));
            }
            if canonical == "max.in.flight.requests.per.connection"
                && value
                    .trim()
                    .parse::<u32>()
                    .is_ok_and(|n| n > MAX_IN_FLIGHT_IDEMPOTENT)
            {
                return Err(Error::InvalidConfig(format!(
                    "kafka: `{key}`{aka} = {value:?}: the idempotent producer (per-partition order \
                     across retries) allows at most {MAX_IN_FLIGHT_IDEMPOTENT}"
                )));
            }
        }
        let offline = |mut c: ClientConfig| {
            c.set("bootstrap.servers", "")
                .set_log_level(rdkafka::config::RDKafkaLogLevel::Emerg);
            c
        };
        offline(self.producer_config())
            .create::<rdkafka::producer::BaseProducer>()
            .map_err(|e| self.refused("producer", &e))?;
        offline(self.consumer_config(&format!("{}.check", self.group)))
            .create::<rdkafka::consumer::BaseConsumer>()
            .map_err(|e| self.refused("consumer", &e))?;
        Ok(())
    }

    /// librdkafka's refusal of the `what` settings as an error that shows no credential:
    /// rdkafka's message for a refused setting carries its value, left out for sensitive
    /// ones. A TLS file librdkafka cannot load (it loads them when the client is made) is
    /// [`Error::Tls`] with [`TlsProblem::BadFile`].
    fn refused(&self, what: &str, e: &rdkafka::error::KafkaError) -> Error {
        let text = match e {
            rdkafka::error::KafkaError::ClientConfig(_, _, key, _) if sensitive_setting(key) => {
                format!("the value of the credential setting `{key}` is refused")
            }
            other => redact_credentials(&other.to_string(), self),
        };
        let lower = text.to_ascii_lowercase();
        if self.security_protocol.tls() && (lower.contains("ssl") || lower.contains("tls")) {
            return Error::Tls {
                target: self.target(),
                problem: TlsProblem::BadFile,
                reason: format!("librdkafka cannot set up TLS with these settings: {text}"),
            };
        }
        Error::InvalidConfig(format!(
            "kafka: librdkafka refuses the {what} settings: {text}"
        ))
    }
}

/// `text` with every credential the builder holds (the SASL password, sensitive
/// settings' values) replaced by `***`: for messages that echo configuration.
fn redact_credentials(text: &str, config: &KafkaBuilder) -> String {
    let mut out = text.to_owned();
    let secrets = config.sasl.iter().map(|s| s.password.expose()).chain(
        config
            .settings
            .iter()
            .filter(|(k, _)| sensitive_setting(k))
            .map(|(_, v)| v.as_str()),
    );
    for secret in secrets {
        if !secret.is_empty() {
            out = out.replace(secret, "***");
        }
    }
    out
}

/// The host of each bootstrap server (`host:port`, `[v6]:port`, an optional
/// `protocol://` prefix).
fn bootstrap_hosts(bootstrap: &str) -> impl Iterator<Item = &str> {
    bootstrap
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|server| {
            let server = server.split_once("://").map_or(server, |(_, rest)| rest);
            if let Some(rest) = server.strip_prefix('[') {
                rest.split_once(']').map_or(rest, |(host, _)| host)
            } else {
                match server.rsplit_once(':') {
                    // One colon: host:port. More: a bare IPv6 address.
                    Some((host, _)) if !host.contains(':') => host,
                    _ => server,
                }
            }
        })
}

/// What librdkafka reported about TLS or authentication, in its error callback: the
/// failures it otherwise retries for ever (a refused password, an unverifiable
/// certificate). Shared by all of a [`Kafka`]'s clients; the operations waiting on the
/// brokers end with it ([`Kafka::guarded`]).
#[derive(Default)]
struct SecurityWatch {
    last: StdMutex<Option<(Instant, SecurityFailure)>>,
    changed: tokio::sync::Notify,
}

#[derive(Clone, Debug)]
enum SecurityFailure {
    Tls(TlsProblem, String),
    Authentication(String),
}

/// How long a reported failure stands for the operations that start after it: librdkafka
/// reconnects with backoff up to `reconnect.backoff.max.ms` (10 s by default) and reports
/// again on each failure.
const FAILURE_STANDS: Duration = Duration::from_secs(10);

impl SecurityWatch {
    /// Files what librdkafka reported, if it is about TLS or authentication.
    fn report(&self, error: &rdkafka::error::KafkaError, reason: &str) {
        let Some(failure) = classify_failure(error, reason) else {
            return;
        };
        *self.last.lock().expect("security watch") = Some((Instant::now(), failure));
        self.changed.notify_waiters();
    }

    /// A failure reported within [`FAILURE_STANDS`].
    fn recent(&self) -> Option<SecurityFailure> {
        self.last
            .lock()
            .expect("security watch")
            .as_ref()
            .filter(|(at, _)| at.elapsed() < FAILURE_STANDS)
            .map(|(_, f)| f.clone())
    }

    /// Resolves with the next failure reported (or a recent one at once).
    async fn failed(&self) -> SecurityFailure {
        // Bounded: each pass waits for a report, and returns on a failure.
        loop {
            let next = self.changed.notified();
            if let Some(f) = self.recent() {
                return f;
            }
            next.await;
        }
    }
}

/// What an error reported by librdkafka's error callback says about TLS or authentication:
/// `_AUTHENTICATION` (SASL refused: a wrong password or user, an unsupported mechanism) or
/// a transport failure whose reason is about SSL (OpenSSL's words, classified by
/// [`crate::tls::classify_text`]).
fn classify_failure(error: &rdkafka::error::KafkaError, reason: &str) -> Option<SecurityFailure> {
    use RDKafkaErrorCode as C;
    let code = error.rdkafka_error_code();
    if matches!(code, Some(C::Authentication | C::SaslAuthenticationFailed)) {
        return Some(SecurityFailure::Authentication(reason.to_owned()));
    }
    let lower = reason.to_ascii_lowercase();
    if lower.contains("ssl") || lower.contains("certificate") {
        return crate::tls::classify_text(reason)
            .map(|problem| SecurityFailure::Tls(problem, reason.to_owned()));
    }
    None
}

impl SecurityFailure {
    fn into_error(self, target: String) -> Error {
        match self {
            SecurityFailure::Tls(problem, reason) => Error::Tls {
                target,
                problem,
                reason,
            },
            SecurityFailure::Authentication(reason) => Error::Authentication { target, reason },
        }
    }
}

/// Connects once more to the bootstrap servers with TLS, verifying the certificate chain
/// but not the host name, without SASL credentials (nothing secret is sent to a broker
/// whose name was not verified): [`TlsProblem::HostnameMismatch`] when the handshake
/// passes, else [`TlsProblem::Other`]. Bounded by 5 s.
fn probe_verification(config: &KafkaBuilder) -> TlsProblem {
    let mut c = ClientConfig::new();
    c.set("bootstrap.servers", &config.bootstrap)
        .set("security.protocol", "ssl")
        .set("ssl.endpoint.identification.algorithm", "none")
        .set_log_level(rdkafka::config::RDKafkaLogLevel::Emerg);
    if let Some(path) = &config.root_certificates {
        c.set("ssl.ca.location", path.to_string_lossy());
    }
    if let Some((cert, key)) = &config.client_certificate {
        c.set("ssl.certificate.location", cert.to_string_lossy())
            .set("ssl.key.location", key.to_string_lossy());
    }
    for (k, v) in &config.settings {
        if k.starts_with("ssl.") && canonical_setting(k) != "ssl.endpoint.identification.algorithm"
        {
            c.set(k, v);
        }
    }
    let Ok(probe) = c.create_with_context::<_, rdkafka::producer::BaseProducer<ProbeContext>>(
        ProbeContext::default(),
    ) else {
        return TlsProblem::Other;
    };
    let start = Instant::now();
    // Bounded by time.
    while start.elapsed() < Duration::from_secs(5) {
        if probe
            .client()
            .fetch_metadata(None, Duration::from_millis(200))
            .is_ok()
        {
            return TlsProblem::HostnameMismatch;
        }
        probe.poll(Duration::from_millis(50));
        let seen = probe.context().reasons.lock().expect("probe");
        if seen.iter().any(|r| r.contains("certificate verify failed")) {
            return TlsProblem::Other;
        }
        // A failure after the handshake (the broker closed, refused the request): the
        // handshake passed.
        if seen.iter().any(|r| {
            r.contains("in state ")
                && ![
                    "in state CONNECT",
                    "in state SSL_HANDSHAKE",
                    "in state TRY_CONNECT",
                ]
                .iter()
                .any(|s| r.contains(s))
        }) {
            return TlsProblem::HostnameMismatch;
        }
    }
    TlsProblem::Other
}

/// The probe's context: every error reason librdkafka reports.
#[derive(Default)]
struct ProbeContext {
    reasons: StdMutex<Vec<String>>,
}

impl ClientContext for ProbeContext {
    fn error(&self, _error: rdkafka::error::KafkaError, reason: &str) {
        self.reasons.lock().expect("probe").push(reason.to_owned());
    }
}

impl rdkafka::producer::ProducerContext for ProbeContext {
    type DeliveryOpaque = ();
    fn delivery(&self, _: &rdkafka::message::DeliveryResult<'_>, _: Self::DeliveryOpaque) {}
}

/// The context of pgbox's producer, admin client and dead-letter reader: librdkafka's
/// errors go to the log as rdkafka's default does, and TLS and authentication failures to
/// the [`SecurityWatch`].
struct WatchContext {
    watch: Arc<SecurityWatch>,
}

impl ClientContext for WatchContext {
    fn error(&self, error: rdkafka::error::KafkaError, reason: &str) {
        self.watch.report(&error, reason);
        tracing::warn!(target: "librdkafka", error = %error, reason, "librdkafka error");
    }
}

impl ConsumerContext for WatchContext {}

/// The Kafka transport: see the [module docs](self). Cheap to clone.
#[derive(Clone)]
pub struct Kafka {
    inner: Arc<Inner>,
}

impl fmt::Debug for Kafka {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Kafka")
            .field("bootstrap", &self.inner.config.bootstrap)
            .field("group", &self.inner.config.group)
            .finish_non_exhaustive()
    }
}

struct Inner {
    config: KafkaBuilder,
    /// Made on first use, and made again after a fatal error (see [`Kafka::producer`]).
    producer: StdMutex<Option<FutureProducer<WatchContext>>>,
    admin: OnceLock<AdminClient<WatchContext>>,
    /// TLS and authentication failures librdkafka reported, from every client.
    watch: Arc<SecurityWatch>,
    consumers: StdMutex<HashMap<String, Arc<TopicConsumer>>>,
    declared: StdMutex<HashSet<String>>,
}

/// A message received from [`Kafka`]: settle it with `ack`, `nack` or `dead_letter`.
pub struct KafkaDelivery {
    envelope: Envelope,
    attempt: i32,
    partition: i32,
    offset: i64,
    /// Which hand-out of the message this is (unique in the consumer).
    lease: u64,
}

impl fmt::Debug for KafkaDelivery {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KafkaDelivery")
            .field("message_id", &self.envelope.id)
            .field("partition", &self.partition)
            .field("offset", &self.offset)
            .field("attempt", &self.attempt)
            .finish_non_exhaustive()
    }
}

impl KafkaDelivery {
    /// The message.
    pub fn envelope(&self) -> &Envelope {
        &self.envelope
    }

    /// 1 for a first delivery (counted across consumers: see the module docs).
    pub fn attempt(&self) -> i32 {
        self.attempt
    }

    /// The partition it came from.
    pub fn partition(&self) -> i32 {
        self.partition
    }

    /// Its offset in the partition.
    pub fn offset(&self) -> i64 {
        self.offset
    }
}

/// A dead-lettered message, as [`Kafka::dead_letters`] shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct KafkaDeadLetter {
    /// The message (for a message that was not pgbox's: its payload and key, with a nil id).
    pub envelope: Envelope,
    /// The error given when it was dead-lettered.
    pub error: Option<String>,
    /// Deliveries before it was dead-lettered.
    pub deliveries: i32,
    /// Its partition in the dead-letter topic.
    pub partition: i32,
    /// Its offset in that partition.
    pub offset: i64,
}

/// pgbox's fields, as JSON in one header: exact whatever the header names and values.
#[derive(Serialize, Deserialize)]
struct Meta {
    content_type: String,
    created_at: i128,
    #[serde(default)]
    headers: BTreeMap<String, String>,
}

/// Whether `name` is 1 to 249 of Kafka's name characters: ASCII letters, digits, `.`, `_`
/// and `-`.
fn kafka_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 249
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

/// Whether `name` is a valid Kafka topic name.
fn valid_topic(name: &str) -> bool {
    kafka_name(name) && name != "." && name != ".."
}

fn check_topic(topic: &str) -> Result<()> {
    if valid_topic(topic) {
        Ok(())
    } else {
        Err(Error::InvalidField {
            field: "kafka topic",
            reason: "1 to 249 ASCII letters, digits, '.', '_' or '-' (not '.' or '..')",
        })
    }
}

impl Kafka {
    /// A transport for the cluster at `bootstrap` (`host:port[,host:port...]`).
    pub fn builder(bootstrap: impl Into<String>) -> KafkaBuilder {
        KafkaBuilder {
            bootstrap: bootstrap.into(),
            group: "pgbox".into(),
            declare: true,
            partitions: 8,
            replication_factor: 1,
            dead_letter_suffix: ".dlq".into(),
            receive_wait: Duration::from_millis(200),
            session_timeout: Duration::from_secs(10),
            commit_interval: Duration::from_millis(50),
            message_max_bytes: 1 << 20,
            linger: Duration::from_millis(2),
            max_buffered: 10_000,
            instance_id: None,
            settings: BTreeMap::new(),
            security_protocol: SecurityProtocol::Plaintext,
            sasl: None,
            root_certificates: None,
            client_certificate: None,
            allow_insecure_credentials: false,
            cloudevents: None,
        }
    }

    /// The dead-letter topic of `topic`.
    pub fn dead_letter_topic(&self, topic: &str) -> String {
        format!("{topic}{}", self.inner.config.dead_letter_suffix)
    }

    /// The consumer group that consumes `topic`.
    pub fn group_of(&self, topic: &str) -> String {
        format!("{}.{topic}", self.inner.config.group)
    }

    fn client_config(&self) -> ClientConfig {
        self.inner.config.client_config()
    }

    /// The producer, made on first use and made again when librdkafka reports a fatal
    /// error on it. An idempotent producer's fatal error (a sequence desynchronization with
    /// the broker, a fenced or unauthorized producer id) leaves it failing every message
    /// from then on; a new producer starts a new idempotent session.
    fn producer(&self) -> Result<FutureProducer<WatchContext>> {
        let mut slot = self.inner.producer.lock().expect("producer");
        if let Some(p) = slot.as_ref() {
            match p.client().fatal_error() {
                None => return Ok(p.clone()),
                Some((code, reason)) => {
                    tracing::warn!(
                        ?code,
                        reason,
                        "pgbox kafka: the producer hit a fatal error; making a new one"
                    );
                }
            }
        }
        let producer: FutureProducer<WatchContext> = self
            .inner
            .config
            .producer_config()
            .create_with_context(self.watch_context())
            .map_err(|e| self.inner.config.refused("producer", &e))?;
        // The broken one goes when its last in-flight user lets go of it.
        *slot = Some(producer.clone());
        Ok(producer)
    }

    fn watch_context(&self) -> WatchContext {
        WatchContext {
            watch: self.inner.watch.clone(),
        }
    }

    /// `operation`'s outcome, or the TLS or authentication failure librdkafka reports while
    /// it runs (which librdkafka itself would retry for ever); an error of `operation`'s own
    /// is replaced by such a failure reported recently, which explains it.
    async fn guarded<T>(&self, operation: impl Future<Output = Result<T>>) -> Result<T> {
        let watch = &self.inner.watch;
        let target = || self.inner.config.target();
        let outcome = tokio::select! {
            outcome = operation => outcome,
            failure = watch.failed() => Err(self.explain(failure).await.into_error(target())),
        };
        match outcome {
            Ok(v) => {
                *watch.last.lock().expect("security watch") = None;
                Ok(v)
            }
            Err(e @ (Error::Tls { .. } | Error::Authentication { .. })) => Err(e),
            Err(e) => match watch.recent() {
                Some(f) => Err(self.explain(f).await.into_error(target())),
                None => Err(e),
            },
        }
    }

    /// `failure` made more precise where librdkafka's words are not: OpenSSL's
    /// "certificate verify failed" says nothing of why (librdkafka does not pass the
    /// verification result on). A second, credential-free TLS connection without the host
    /// name check tells a certificate for another host (it then passes) from one the
    /// authorities do not vouch for, or whose validity has ended or not begun (it fails
    /// again: librdkafka cannot tell those apart, so that stays [`TlsProblem::Other`]).
    async fn explain(&self, failure: SecurityFailure) -> SecurityFailure {
        match failure {
            SecurityFailure::Tls(TlsProblem::Other, reason)
                if reason.contains("certificate verify failed") =>
            {
                let config = self.inner.config.clone();
                let problem = tokio::task::spawn_blocking(move || probe_verification(&config))
                    .await
                    .unwrap_or(TlsProblem::Other);
                let reason = match problem {
                    TlsProblem::HostnameMismatch => {
                        format!("{reason} (the certificate is valid but not for the host dialled)")
                    }
                    _ => format!(
                        "{reason} (the certificate is signed by an authority not trusted here, \
                         or has expired or is not valid yet)"
                    ),
                };
                SecurityFailure::Tls(problem, reason)
            }
            other => other,
        }
    }

    fn admin(&self) -> Result<&AdminClient<WatchContext>> {
        if let Some(a) = self.inner.admin.get() {
            return Ok(a);
        }
        let admin: AdminClient<WatchContext> = self
            .client_config()
            .create_with_context(self.watch_context())
            .map_err(|e| self.inner.config.refused("admin client", &e))?;
        Ok(self.inner.admin.get_or_init(|| admin))
    }

    /// Creates `topic` and its dead-letter topic if missing (idempotent). Done on first use
    /// when [`KafkaBuilder::declare`] is on.
    pub async fn declare_topic(&self, topic: &str) -> Result<()> {
        check_topic(topic)?;
        if self
            .inner
            .declared
            .lock()
            .expect("declared")
            .contains(topic)
        {
            return Ok(());
        }
        let config = &self.inner.config;
        let dead = self.dead_letter_topic(topic);
        check_topic(&dead)?;
        let topics = [
            NewTopic::new(
                topic,
                config.partitions,
                TopicReplication::Fixed(config.replication_factor),
            ),
            NewTopic::new(
                &dead,
                config.partitions,
                TopicReplication::Fixed(config.replication_factor),
            ),
        ];
        let options = AdminOptions::new().operation_timeout(Some(Duration::from_secs(10)));
        // The producer first: its polled events report TLS and authentication failures
        // (the admin client's events are never polled), which end the wait below.
        let _producer = self.producer()?;
        let admin = self.admin()?;
        let results = self
            .guarded(async {
                tokio::time::timeout(
                    Duration::from_secs(30),
                    admin.create_topics(&topics, &options),
                )
                .await
                .map_err(|_| broker_error("create topics", "no answer within 30 s"))?
                .map_err(|e| broker_error("create topics", e))
            })
            .await?;
        for result in results {
            match result {
                Ok(_) | Err((_, RDKafkaErrorCode::TopicAlreadyExists)) => {}
                Err((name, code)) => {
                    return Err(broker_error(&format!("create topic {name}"), code));
                }
            }
        }
        // Wait (bounded) until the producer sees the topic with a leader for every
        // partition, so the first publish does not wait for metadata.
        let kafka = self.clone();
        let name = topic.to_owned();
        self.guarded(async {
            tokio::task::spawn_blocking(move || kafka.await_leaders(&name))
                .await
                .map_err(|e| broker_error("topic metadata", e))?
        })
        .await?;
        tracing::info!(topic, dead_letters = %dead, "pgbox kafka topics ready");
        self.inner
            .declared
            .lock()
            .expect("declared")
            .insert(topic.to_owned());
        Ok(())
    }

    /// Blocks until the producer's metadata shows `topic` with a leader for each partition
    /// (at most 10 s; a topic that exists but shows no leaders by then is left to the
    /// producer's own retries).
    fn await_leaders(&self, topic: &str) -> Result<()> {
        let producer = self.producer()?;
        let start = Instant::now();
        // Bounded by time.
        loop {
            let metadata = producer
                .client()
                .fetch_metadata(Some(topic), Duration::from_secs(5))
                .map_err(|e| broker_error("topic metadata", e))?;
            let ready = metadata.topics().iter().any(|t| {
                t.name() == topic
                    && t.error().is_none()
                    && !t.partitions().is_empty()
                    && t.partitions().iter().all(|p| p.leader() >= 0)
            });
            if ready || start.elapsed() > Duration::from_secs(10) {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Asks the cluster for its metadata (bounded by 5 s): `Ok` if a broker answered.
    /// A TLS failure is [`Error::Tls`] (which [`TlsProblem`]), refused credentials
    /// [`Error::Authentication`].
    pub async fn reachable(&self) -> Result<()> {
        let kafka = self.clone();
        self.guarded(async {
            // The producer's client: its events (errors included) are polled by rdkafka's
            // thread, so TLS and authentication failures reach the watch; the admin
            // client's are never polled.
            tokio::task::spawn_blocking(move || {
                kafka
                    .producer()?
                    .client()
                    .fetch_metadata(None, Duration::from_secs(5))
                    .map(drop)
                    .map_err(|e| broker_error("cluster metadata", e))
            })
            .await
            .map_err(|e| broker_error("cluster metadata", e))?
        })
        .await
    }

    async fn consumer(&self, topic: &str) -> Result<Arc<TopicConsumer>> {
        if let Some(c) = self.inner.consumers.lock().expect("consumers").get(topic) {
            return Ok(c.clone());
        }
        check_topic(topic)?;
        if self.inner.config.declare {
            self.declare_topic(topic).await?;
        }
        let config = &self.inner.config;
        let state = Arc::new(StdMutex::new(State::default()));
        let context = GroupContext {
            topic: topic.to_owned(),
            state: state.clone(),
            watch: self.inner.watch.clone(),
        };
        let consumer: StreamConsumer<GroupContext> = config
            .consumer_config(&self.group_of(topic))
            .create_with_context(context)
            .map_err(|e| config.refused("consumer", &e))?;
        consumer
            .subscribe(&[topic])
            .map_err(|e| broker_error("subscribe", e))?;
        tracing::info!(topic, group = %self.group_of(topic), "pgbox kafka consumer joined");
        let made = Arc::new(TopicConsumer {
            topic: topic.to_owned(),
            consumer: Some(consumer),
            state,
        });
        let mut consumers = self.inner.consumers.lock().expect("consumers");
        Ok(consumers.entry(topic.to_owned()).or_insert(made).clone())
    }

    /// Up to `max` dead letters of `topic`, oldest first per partition (read from the
    /// dead-letter topic, which keeps them).
    pub async fn dead_letters(&self, topic: &str, max: usize) -> Result<Vec<KafkaDeadLetter>> {
        check_topic(topic)?;
        let dead = self.dead_letter_topic(topic);
        let mut c = self.client_config();
        c.set(
            "group.id",
            format!("pgbox-dead-letter-reader-{}", Uuid::now_v7()),
        )
        .set("enable.auto.commit", "false")
        .set("enable.auto.offset.store", "false");
        let consumer: BaseConsumer<WatchContext> = c
            .create_with_context(self.watch_context())
            .map_err(|e| self.inner.config.refused("dead-letter reader", &e))?;
        let topic = topic.to_owned();
        self.guarded(async {
            tokio::task::spawn_blocking(move || read_dead_letters(&consumer, &topic, &dead, max))
                .await
                .map_err(|e| broker_error("dead-letter reader", e))?
        })
        .await
    }

    /// Copies a message to `topic`'s dead-letter topic and waits for the broker's ack.
    async fn send_dead_letter(
        &self,
        topic: &str,
        key: Option<&[u8]>,
        payload: &[u8],
        headers: OwnedHeaders,
    ) -> Result<()> {
        let dead = self.dead_letter_topic(topic);
        let mut record = FutureRecord::to(&dead).payload(payload).headers(headers);
        if let Some(key) = key {
            record = record.key(key);
        }
        let future = self
            .producer()?
            .send_result(record)
            .map_err(|(e, _)| broker_error("publish dead letter", e))?;
        match future.await {
            Ok(Ok(_)) => Ok(()),
            Ok(Err((e, _))) => Err(broker_error("dead letter publish ack", e)),
            Err(_) => Err(broker_error("dead letter publish ack", "producer gone")),
        }
    }
}

fn read_dead_letters(
    consumer: &BaseConsumer<WatchContext>,
    topic: &str,
    dead: &str,
    max: usize,
) -> Result<Vec<KafkaDeadLetter>> {
    let timeout = Duration::from_secs(10);
    let metadata = consumer
        .fetch_metadata(Some(dead), timeout)
        .map_err(|e| broker_error("dead-letter topic metadata", e))?;
    let mut tpl = TopicPartitionList::new();
    let mut ends: HashMap<i32, i64> = HashMap::new();
    for t in metadata.topics() {
        for p in t.partitions() {
            let (low, high) = consumer
                .fetch_watermarks(dead, p.id(), timeout)
                .map_err(|e| broker_error("dead-letter watermarks", e))?;
            if high > low {
                tpl.add_partition_offset(dead, p.id(), Offset::Offset(low))
                    .map_err(|e| broker_error("dead-letter assignment", e))?;
                ends.insert(p.id(), high);
            }
        }
    }
    let mut out = Vec::new();
    if ends.is_empty() {
        return Ok(out);
    }
    consumer
        .assign(&tpl)
        .map_err(|e| broker_error("dead-letter assignment", e))?;
    let start = Instant::now();
    // Bounded by the partitions' end offsets and by time.
    while !ends.is_empty() && out.len() < max && start.elapsed() < Duration::from_secs(20) {
        let Some(next) = consumer.poll(Duration::from_millis(200)) else {
            continue;
        };
        let m = next.map_err(|e| broker_error("read dead letters", e))?;
        if m.offset() + 1 >= ends.get(&m.partition()).copied().unwrap_or(0) {
            ends.remove(&m.partition());
        }
        let header = |name: &str| header_str(m.headers(), name);
        let envelope = decode(topic, &m).unwrap_or_else(|_| Envelope {
            seq: 0,
            id: Uuid::nil(),
            topic: topic.to_owned(),
            ordering_key: m.key().map(|k| String::from_utf8_lossy(k).into_owned()),
            payload: m.payload().unwrap_or_default().to_vec(),
            content_type: "application/octet-stream".into(),
            headers: BTreeMap::new(),
            created_at: OffsetDateTime::UNIX_EPOCH,
            attempts: 0,
        });
        out.push(KafkaDeadLetter {
            envelope,
            error: header(ERROR),
            deliveries: header(DELIVERIES).and_then(|v| v.parse().ok()).unwrap_or(0),
            partition: m.partition(),
            offset: m.offset(),
        });
    }
    Ok(out)
}

fn header_str<H: Headers>(headers: Option<&H>, name: &str) -> Option<String> {
    let headers = headers?;
    headers
        .iter()
        .find(|h| h.key == name)
        .and_then(|h| h.value)
        .and_then(|v| std::str::from_utf8(v).ok())
        .map(str::to_owned)
}

fn headers(envelope: &Envelope) -> Result<OwnedHeaders, PublishError> {
    let meta = Meta {
        content_type: envelope.content_type.clone(),
        created_at: envelope.created_at.unix_timestamp_nanos(),
        headers: envelope.headers.clone(),
    };
    let json = serde_json::to_string(&meta)
        .map_err(|e| PublishError::refused(format!("message {}: {e}", envelope.id)))?;
    let id = envelope.id.to_string();
    let mut map = OwnedHeaders::new()
        .insert(Header {
            key: ID,
            value: Some(id.as_str()),
        })
        .insert(Header {
            key: META,
            value: Some(json.as_str()),
        });
    for name in [TRACEPARENT, "tracestate"] {
        if let Some(v) = envelope.headers.get(name) {
            map = map.insert(Header {
                key: name,
                value: Some(v.as_str()),
            });
        }
    }
    Ok(map)
}

/// `headers`, if the envelope's ordering key and they fit in [`RECORD_EXTRA_BYTES`]: the
/// room a record has beside its payload under the producer's limit (see `client_config`).
fn within_record_extra(
    envelope: &Envelope,
    headers: OwnedHeaders,
) -> Result<OwnedHeaders, PublishError> {
    let extra = envelope.ordering_key.as_ref().map_or(0, String::len)
        + headers
            .iter()
            .map(|h| h.key.len() + h.value.map_or(0, <[u8]>::len))
            .sum::<usize>();
    if extra > RECORD_EXTRA_BYTES {
        return Err(PublishError::refused(format!(
            "the ordering key and headers of message {} take {extra} bytes, \
             over the {RECORD_EXTRA_BYTES} a Kafka record has for them",
            envelope.id
        )));
    }
    Ok(headers)
}

/// The CloudEvents Kafka binding's attribute prefix.
const CE_PREFIX: &str = "ce_";
/// The binding's content type header.
const CONTENT_TYPE: &str = "content-type";

/// The headers and payload of `envelope`: native, or a CloudEvent when configured.
fn wire<'e>(
    cloudevents: Option<&CloudEvents>,
    envelope: &'e Envelope,
) -> Result<(OwnedHeaders, Cow<'e, [u8]>), PublishError> {
    let Some(ce) = cloudevents else {
        return headers(envelope).map(|h| (h, Cow::Borrowed(&envelope.payload[..])));
    };
    let bad = |e: Error| PublishError::refused(format!("message {}: {e}", envelope.id));
    let attributes = ce.attributes(envelope).map_err(bad)?;
    let mut map = OwnedHeaders::new();
    for (name, value) in &attributes.transport {
        if RESERVED.contains(&name.as_str()) || name == CONTENT_TYPE {
            return Err(PublishError::refused(format!(
                "message {}: header name {name} is reserved",
                envelope.id
            )));
        }
        map = map.insert(Header {
            key: name,
            value: Some(value.as_str()),
        });
    }
    let body = match ce.content_mode() {
        ContentMode::Structured => {
            map = map.insert(Header {
                key: CONTENT_TYPE,
                value: Some(STRUCTURED_CONTENT_TYPE),
            });
            Cow::Owned(ce.to_json(envelope).map_err(bad)?)
        }
        _ => {
            for (name, value) in &attributes.attrs {
                map = map.insert(Header {
                    key: &format!("{CE_PREFIX}{name}"),
                    value: Some(value.as_str()),
                });
            }
            map = map.insert(Header {
                key: CONTENT_TYPE,
                value: Some(envelope.content_type.as_str()),
            });
            Cow::Borrowed(&envelope.payload[..])
        }
    };
    Ok((map, body))
}

/// A CloudEvent's envelope, when the record is one (binary: a `ce_specversion` header;
/// structured: its content type). The record key is `partitionkey` when the event has none.
fn decode_cloudevent<M: Message>(topic: &str, message: &M) -> Option<Result<Envelope>> {
    let mut attrs = BTreeMap::new();
    let mut others = BTreeMap::new();
    let mut content_type = None;
    for h in message.headers()?.iter() {
        let Some(value) = h.value.and_then(|v| std::str::from_utf8(v).ok()) else {
            continue;
        };
        if h.key.eq_ignore_ascii_case(CONTENT_TYPE) {
            content_type = Some(value.to_owned());
        } else if let Some(attr) = h.key.strip_prefix(CE_PREFIX) {
            attrs.insert(attr.to_owned(), value.to_owned());
        } else if !RESERVED.contains(&h.key) {
            others.insert(h.key.to_owned(), value.to_owned());
        }
    }
    let payload = message.payload().unwrap_or_default();
    let key = message
        .key()
        .and_then(|k| std::str::from_utf8(k).ok())
        .map(str::to_owned);
    let mut event = if attrs.contains_key("specversion") {
        cloudevents::decode_binary(topic, attrs, content_type, others, payload)
    } else if content_type
        .as_deref()
        .is_some_and(cloudevents::is_structured)
    {
        cloudevents::decode_structured(topic, payload, others)
    } else {
        return None;
    };
    if let Ok(e) = &mut event
        && e.ordering_key.is_none()
    {
        e.ordering_key = key;
    }
    Some(event)
}

fn decode<M: Message>(topic: &str, message: &M) -> Result<Envelope> {
    if let Some(event) = decode_cloudevent(topic, message) {
        return event;
    }
    let bad = |reason| Error::InvalidField {
        field: "kafka message",
        reason,
    };
    let headers = message.headers();
    let id = header_str(headers, ID)
        .and_then(|v| Uuid::parse_str(&v).ok())
        .ok_or(bad("no pgbox-id header, or not a UUID"))?;
    let meta: Meta = header_str(headers, META)
        .and_then(|v| serde_json::from_str(&v).ok())
        .ok_or(bad("no pgbox-meta header"))?;
    let ordering_key = match message.key() {
        None => None,
        Some(k) => {
            Some(String::from_utf8(k.to_vec()).map_err(|_| bad("the message key is not UTF-8"))?)
        }
    };
    Ok(Envelope {
        seq: 0,
        id,
        topic: topic.to_owned(),
        ordering_key,
        payload: message.payload().unwrap_or_default().to_vec(),
        content_type: meta.content_type,
        headers: meta.headers,
        created_at: OffsetDateTime::from_unix_timestamp_nanos(meta.created_at)
            .map_err(|_| bad("creation time out of range"))?,
        attempts: 0,
    })
}

/// A failed produce, by whose fault. librdkafka's own transport and timeout errors (the
/// broker down or unreachable: `message.timeout.ms` expired, all brokers down, the local
/// queue full), and the broker's retriable errors (no leader, not enough replicas, request
/// timed out, storage error) are an outage; what the broker or librdkafka says about this
/// message (too large, invalid, an unknown or unauthorized topic) refuses it. A fatal error
/// of the producer is an outage whatever the message reports (see [`Kafka::producer`]; the
/// publish checks the producer after its acks).
fn kafka_publish_error(what: &str, e: &rdkafka::error::KafkaError) -> PublishError {
    let message = format!("{what}: {e}");
    if e.rdkafka_error_code().is_some_and(is_outage) {
        PublishError::unavailable(message)
    } else {
        PublishError::refused(message)
    }
}

/// The producer's session is broken, not the message: fenced by a newer producer, or its
/// id or sequence lost or refused by the broker. Reported on an ack, possibly without
/// librdkafka marking the producer fatal: the producer is made again (see the publish).
fn is_producer_session_error(code: RDKafkaErrorCode) -> bool {
    use RDKafkaErrorCode as C;
    matches!(
        code,
        C::ProducerFenced
            | C::InvalidProducerEpoch
            | C::InvalidProducerIdMapping
            | C::UnknownProducerId
            | C::OutOfOrderSequenceNumber
    )
}

fn is_outage(code: RDKafkaErrorCode) -> bool {
    if is_producer_session_error(code) {
        return true;
    }
    use RDKafkaErrorCode as C;
    matches!(
        code,
        C::BrokerDestroy
            // The producer is broken (see `Kafka::producer`), not the message.
            | C::Fatal
            | C::BrokerTransportFailure
            | C::Resolve
            | C::MessageTimedOut
            | C::AllBrokersDown
            | C::OperationTimedOut
            | C::QueueFull
            | C::TimedOutQueue
            | C::PurgeQueue
            | C::PurgeInflight
            | C::DestroyBroker
            | C::UnknownTopicOrPartition
            | C::LeaderNotAvailable
            | C::NotLeaderForPartition
            | C::RequestTimedOut
            | C::BrokerNotAvailable
            | C::ReplicaNotAvailable
            | C::NetworkException
            | C::CoordinatorLoadInProgress
            | C::CoordinatorNotAvailable
            | C::NotCoordinator
            | C::NotEnoughReplicas
            | C::NotEnoughReplicasAfterAppend
            | C::KafkaStorageError
    )
}

impl Publisher for Kafka {
    async fn publish(&self, batch: &[Envelope]) -> Vec<Result<(), PublishError>> {
        // Not the messages' fault (the producer cannot be made, the topics not declared): an
        // outage.
        let fail_all =
            |e: &dyn fmt::Display| vec![Err(PublishError::unavailable(e.to_string())); batch.len()];
        let producer = match self.producer() {
            Ok(p) => p,
            Err(e) => return fail_all(&e),
        };
        if self.inner.config.declare {
            let topics: BTreeSet<&str> = batch.iter().map(|e| e.topic.as_str()).collect();
            for topic in topics {
                if valid_topic(topic)
                    && let Err(e) = self.declare_topic(topic).await
                {
                    tracing::debug!(topic, error = %e, "pgbox kafka publish: cannot declare");
                    return fail_all(&e);
                }
            }
        }
        let max = self.inner.config.message_max_bytes;
        let mut pending = Vec::with_capacity(batch.len());
        for envelope in batch {
            let sent = if !valid_topic(&envelope.topic) {
                Err(PublishError::refused(format!(
                    "{:?} is not a valid Kafka topic name",
                    envelope.topic
                )))
            } else if envelope.payload.len() > max {
                Err(PublishError::refused(format!(
                    "message of {} bytes is over the limit of {max} (message_max_bytes)",
                    envelope.payload.len()
                )))
            } else {
                match wire(self.inner.config.cloudevents.as_ref(), envelope)
                    .and_then(|(h, body)| Ok((within_record_extra(envelope, h)?, body)))
                {
                    Ok((h, body)) => {
                        let mut record = FutureRecord::to(&envelope.topic)
                            .payload(&body[..])
                            .headers(h);
                        if let Some(key) = &envelope.ordering_key {
                            record = record.key(key.as_bytes());
                        }
                        producer
                            .send_result(record)
                            .map_err(|(e, _)| kafka_publish_error("publish failed", &e))
                    }
                    Err(e) => Err(e),
                }
            };
            pending.push(sent);
        }
        let session_lost = std::sync::atomic::AtomicBool::new(false);
        let session_lost = &session_lost;
        let acks = join_all(pending.into_iter().map(|p| async move {
            match p {
                Ok(future) => match future.await {
                    Ok(Ok(delivery)) => Ok((delivery.partition, delivery.offset)),
                    Ok(Err((e, _))) => {
                        if e.rdkafka_error_code()
                            .is_some_and(is_producer_session_error)
                        {
                            session_lost.store(true, std::sync::atomic::Ordering::Relaxed);
                        }
                        Err(kafka_publish_error("publish ack", &e))
                    }
                    Err(_) => Err(PublishError::unavailable("publish ack: producer gone")),
                },
                Err(e) => Err(e),
            }
        }));
        // A TLS or authentication failure while waiting (librdkafka would retry until the
        // message times out) fails the batch as an outage, with the typed error's words.
        let mut acks = match self.guarded(acks.map(Ok)).await {
            Ok(acks) => acks,
            Err(e) => return fail_all(&e),
        };
        // A producer whose session the broker ended is made again at the next publish.
        if session_lost.load(std::sync::atomic::Ordering::Relaxed) {
            tracing::warn!(
                "pgbox kafka: the producer's session was ended by the broker (fenced, or its id or sequence refused); making a new one"
            );
            let mut slot = self.inner.producer.lock().expect("producer");
            if slot
                .as_ref()
                .is_some_and(|p| p.client().native_ptr() == producer.client().native_ptr())
            {
                *slot = None;
            }
        }
        // A fatal error of the producer fails what it held, whatever the error each message
        // reports (`_FATAL`, or the broker's answer that caused it): not the messages'
        // fault. An outage until the next publish, which makes a new producer.
        if let Some((code, reason)) = producer.client().fatal_error() {
            for ack in &mut acks {
                if let Err(e) = ack {
                    *e = PublishError::unavailable(format!(
                        "{e} (the producer hit a fatal error, {code:?}: {reason}; a new one \
                         is made at the next publish)"
                    ));
                }
            }
        }
        batch
            .iter()
            .zip(acks)
            .map(|(envelope, ack)| match ack {
                Ok((partition, offset)) => {
                    tracing::debug!(message_id = %envelope.id, topic = %envelope.topic, partition, offset, "pgbox kafka published");
                    Ok(())
                }
                Err(e) => {
                    tracing::debug!(message_id = %envelope.id, topic = %envelope.topic, error = %e, "pgbox kafka publish failed");
                    Err(e)
                }
            })
            .collect()
    }
}

/// One topic's group member and what it holds.
struct TopicConsumer {
    topic: String,
    /// `Some` until dropped (see `Drop`); reached through [`TopicConsumer::client`].
    consumer: Option<StreamConsumer<GroupContext>>,
    state: Arc<StdMutex<State>>,
}

impl TopicConsumer {
    fn client(&self) -> &StreamConsumer<GroupContext> {
        self.consumer
            .as_ref()
            .expect("a consumer is taken only when dropped")
    }
}

impl Drop for TopicConsumer {
    /// rdkafka closes a consumer when it is dropped (revoke, last commits, leaving the group)
    /// and polls until librdkafka reports it closed, with no bound: a broker that never
    /// answers, or a connection whose proxy runs on the runtime being shut down, would hold
    /// the dropping thread (often a tokio worker) for ever. The close runs on a thread of its
    /// own; this waits for it at most `CLOSE_WAIT`, then leaves it to finish in the background.
    fn drop(&mut self) {
        let Some(consumer) = self.consumer.take() else {
            return;
        };
        let (closed, done) = std::sync::mpsc::channel::<()>();
        let close = std::thread::Builder::new()
            .name("pgbox-kafka-close".into())
            .spawn(move || {
                drop(consumer);
                let _ = closed.send(());
            });
        if let Err(e) = close {
            // The closure, consumer included, was dropped here, unbounded as rdkafka does.
            tracing::warn!(topic = %self.topic, error = %e, "pgbox kafka: no thread to close the consumer on");
        } else if done.recv_timeout(CLOSE_WAIT).is_err() {
            tracing::warn!(topic = %self.topic, wait = ?CLOSE_WAIT, "pgbox kafka consumer not closed in time; it goes on closing in the background");
        }
    }
}

#[derive(Default)]
struct State {
    partitions: HashMap<i32, Partition>,
    /// Ordering keys in hand: (partition, key) → the lease of the delivery.
    busy: HashMap<(i32, String), u64>,
    /// Messages received and not yet handed out, all partitions.
    buffered: usize,
    /// Partitions this member paused (its buffer was full) and has not resumed.
    paused: HashSet<i32>,
    next_generation: u64,
    next_lease: u64,
    /// Messages that are not pgbox's, to copy to the dead-letter topic.
    foreign: Vec<(u64, OwnedMessage)>,
    /// No copy of them is tried before this (a copy failed).
    foreign_retry_at: Option<Instant>,
}

/// What a previous owner of a partition left in its committed offset's metadata.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Prior {
    committed: i64,
    handed_through: i64,
    head_attempt: i32,
}

impl Prior {
    fn parse(committed: i64, metadata: &str) -> Prior {
        let mut parts = metadata
            .strip_prefix(METADATA_PREFIX)
            .unwrap_or("")
            .split(':');
        let handed_through = parts.next().and_then(|v| v.parse().ok()).unwrap_or(-1);
        let head_attempt = parts.next().and_then(|v| v.parse().ok()).unwrap_or(0);
        Prior {
            committed,
            handed_through,
            head_attempt,
        }
    }

    /// Deliveries of `offset` before this owner got the partition.
    fn deliveries(&self, offset: i64) -> i32 {
        if offset >= self.handed_through {
            0
        } else if offset == self.committed {
            self.head_attempt.max(1)
        } else {
            1
        }
    }
}

struct Pending {
    envelope: Envelope,
    /// Deliveries so far.
    deliveries: i32,
    not_before: Option<Instant>,
}

/// A message handed out and not settled.
struct InHand {
    attempt: i32,
    lease: u64,
    /// When it is handed out again if still unsettled (the visibility timeout).
    expires: Instant,
    envelope: Envelope,
}

#[derive(Default)]
struct Partition {
    assigned: bool,
    generation: u64,
    prior: Prior,
    /// Received, not handed out (or nacked), by offset.
    buffer: BTreeMap<i64, Pending>,
    /// Handed out and not settled: offset → attempt.
    in_hand: BTreeMap<i64, InHand>,
    /// Received and not settled (buffer ∪ in hand ∪ foreign).
    open: BTreeSet<i64>,
    /// One past the highest offset received in this generation.
    received_through: Option<i64>,
    /// One past the highest offset ever handed out (or the prior owner's).
    handed_through: i64,
    /// `handed_through` as last sent in a commit's metadata.
    durable_through: i64,
    /// The head offset and its delivery count as last sent in a commit's metadata.
    marked_head: (i64, i32),
    /// The offset last committed.
    committed: i64,
    last_commit: Option<Instant>,
}

impl Partition {
    /// A partition just assigned to this member, where `prior` left it.
    fn assigned(generation: u64, prior: Prior) -> Partition {
        Partition {
            assigned: true,
            generation,
            prior,
            handed_through: prior.handed_through,
            durable_through: prior.handed_through,
            marked_head: (prior.committed, prior.head_attempt),
            committed: prior.committed,
            ..Partition::default()
        }
    }

    /// Where the group's committed offset should be: the lowest unsettled message.
    fn frontier(&self) -> Option<i64> {
        self.open.first().copied().or(self.received_through)
    }

    /// Deliveries so far of the message at `frontier`.
    fn head_deliveries(&self, frontier: i64) -> i32 {
        self.in_hand
            .get(&frontier)
            .map(|h| h.attempt)
            .or_else(|| self.buffer.get(&frontier).map(|p| p.deliveries))
            .unwrap_or_else(|| self.prior.deliveries(frontier))
    }

    /// Whether the attempt counts of what is in hand are ahead of what the last commit's
    /// metadata says: a new offset handed out, or the head handed out again (a redelivery
    /// the next owner must count).
    fn mark_behind(&self, frontier: i64) -> bool {
        if self.handed_through > self.durable_through {
            return true;
        }
        let (offset, deliveries) = self.marked_head;
        self.in_hand
            .get(&frontier)
            .is_some_and(|h| h.attempt > 1 && (offset != frontier || deliveries < h.attempt))
    }

    /// The commit metadata for `frontier`, remembered as the latest mark.
    fn metadata(&mut self, frontier: i64) -> String {
        let head = self.head_deliveries(frontier);
        self.durable_through = self.durable_through.max(self.handed_through);
        self.marked_head = (frontier, head);
        format!("{METADATA_PREFIX}{}:{head}", self.handed_through)
    }
}

/// An offset commit to make once the state lock is released.
struct Commit {
    topic: String,
    partition: i32,
    offset: i64,
    metadata: String,
}

impl Commit {
    fn list(commits: &[Commit]) -> Option<TopicPartitionList> {
        if commits.is_empty() {
            return None;
        }
        let mut tpl = TopicPartitionList::new();
        for c in commits {
            tpl.add_partition_offset(&c.topic, c.partition, Offset::Offset(c.offset))
                .ok()?;
            if let Some(mut elem) = tpl.find_partition(&c.topic, c.partition) {
                elem.set_metadata(c.metadata.clone());
            }
        }
        Some(tpl)
    }
}

struct GroupContext {
    topic: String,
    state: Arc<StdMutex<State>>,
    watch: Arc<SecurityWatch>,
}

impl ClientContext for GroupContext {
    fn error(&self, error: rdkafka::error::KafkaError, reason: &str) {
        self.watch.report(&error, reason);
        tracing::warn!(target: "librdkafka", topic = %self.topic, error = %error, reason, "librdkafka error");
    }
}

impl ConsumerContext for GroupContext {
    /// Replaces librdkafka's default handling so that a partition is always (re)started
    /// at its committed offset, explicitly: messages fetched before a revocation and
    /// dropped with it are fetched again.
    fn rebalance(
        &self,
        consumer: &BaseConsumer<Self>,
        err: RDKafkaRespErr,
        tpl: &mut TopicPartitionList,
    ) {
        let cooperative = matches!(
            consumer.rebalance_protocol(),
            RebalanceProtocol::Cooperative
        );
        match err {
            RDKafkaRespErr::RD_KAFKA_RESP_ERR__ASSIGN_PARTITIONS => {
                let priors = self.start_at_committed(consumer, tpl);
                let assigned = if cooperative {
                    consumer.incremental_assign(tpl)
                } else {
                    consumer.assign(tpl)
                };
                if let Err(e) = assigned {
                    tracing::warn!(topic = %self.topic, error = %e, "pgbox kafka: assign failed");
                    return;
                }
                self.assigned(tpl, &priors);
            }
            RDKafkaRespErr::RD_KAFKA_RESP_ERR__REVOKE_PARTITIONS => {
                self.revoke(consumer, tpl);
                let unassigned = if cooperative {
                    consumer.incremental_unassign(tpl)
                } else {
                    consumer.unassign()
                };
                if let Err(e) = unassigned {
                    tracing::warn!(topic = %self.topic, error = %e, "pgbox kafka: unassign failed");
                }
            }
            other => {
                tracing::warn!(topic = %self.topic, error = ?other, "pgbox kafka rebalance error; giving up the assignment");
                self.revoke(consumer, tpl);
                if let Err(e) = consumer.unassign() {
                    tracing::warn!(topic = %self.topic, error = %e, "pgbox kafka: unassign failed");
                }
            }
        }
    }
}

impl GroupContext {
    /// Reads the committed offsets (and what the previous owners left in their metadata)
    /// and sets them as the partitions' start positions in `tpl`.
    fn start_at_committed(
        &self,
        consumer: &BaseConsumer<Self>,
        tpl: &mut TopicPartitionList,
    ) -> HashMap<i32, Prior> {
        let mut priors = HashMap::new();
        match consumer.committed_offsets(tpl.clone(), REBALANCE_CALL) {
            Ok(committed) => {
                for elem in committed.elements_for_topic(&self.topic) {
                    tracing::debug!(topic = %self.topic, partition = elem.partition(), offset = ?elem.offset(), "pgbox kafka: committed offset of an assigned partition");
                    if let Offset::Offset(o) = elem.offset() {
                        priors.insert(elem.partition(), Prior::parse(o, elem.metadata()));
                        if let Err(e) = tpl.set_partition_offset(
                            &self.topic,
                            elem.partition(),
                            Offset::Offset(o),
                        ) {
                            tracing::warn!(topic = %self.topic, error = %e, "pgbox kafka: cannot set a start offset");
                        }
                    }
                }
            }
            Err(e) => {
                // librdkafka then starts at the committed offsets it reads itself.
                tracing::warn!(topic = %self.topic, error = %e, "pgbox kafka: cannot read committed offsets; attempts restart at 1");
            }
        }
        priors
    }

    fn assigned(&self, list: &TopicPartitionList, priors: &HashMap<i32, Prior>) {
        let mut state = self.state.lock().expect("kafka state");
        let state = &mut *state;
        for elem in list.elements_for_topic(&self.topic) {
            state.next_generation += 1;
            let prior = priors.get(&elem.partition()).copied().unwrap_or(Prior {
                committed: -1,
                handed_through: -1,
                head_attempt: 0,
            });
            let part = state.partitions.entry(elem.partition()).or_default();
            state.buffered -= part.buffer.len();
            *part = Partition::assigned(state.next_generation, prior);
        }
        // A partition assigned (again) starts fetching unpaused. Under incremental
        // (cooperative) rebalancing the partitions this member keeps are not assigned again
        // and stay paused if they were: they stay in `paused`, to be resumed when the
        // buffer is low.
        for elem in list.elements_for_topic(&self.topic) {
            state.paused.remove(&elem.partition());
        }
        tracing::info!(topic = %self.topic, partitions = list.count(), "pgbox kafka partitions assigned");
    }

    /// Commits the revoked partitions' progress and forgets what this member held of them.
    fn revoke(&self, consumer: &BaseConsumer<Self>, list: &TopicPartitionList) {
        let mut commits = Vec::new();
        {
            let mut state = self.state.lock().expect("kafka state");
            let state = &mut *state;
            let revoked: HashSet<i32> = list
                .elements_for_topic(&self.topic)
                .iter()
                .map(|e| e.partition())
                .collect();
            for elem in list.elements_for_topic(&self.topic) {
                let Some(part) = state.partitions.get_mut(&elem.partition()) else {
                    continue;
                };
                if part.assigned
                    && let Some(frontier) = part.frontier()
                    && frontier > part.committed
                {
                    commits.push(Commit {
                        topic: self.topic.clone(),
                        partition: elem.partition(),
                        offset: frontier,
                        metadata: part.metadata(frontier),
                    });
                }
                state.buffered -= part.buffer.len();
                part.buffer.clear();
                part.in_hand.clear();
                part.open.clear();
                part.assigned = false;
                part.received_through = None;
                part.generation = u64::MAX;
            }
            // Under cooperative rebalancing the other partitions stay this member's.
            state
                .foreign
                .retain(|(_, m)| !revoked.contains(&m.partition()));
            state.paused.retain(|p| !revoked.contains(p));
        }
        if let Some(tpl) = Commit::list(&commits) {
            // Hand the partitions over with their progress; a failure only means more
            // redeliveries for the next owner. Not waited for: a synchronous broker call
            // inside librdkafka's callback can stall the group's rebalance.
            if let Err(e) = consumer.commit(&tpl, CommitMode::Async) {
                tracing::info!(topic = %self.topic, error = %e, "pgbox kafka: commit on revoke failed");
            }
        }
        tracing::info!(topic = %self.topic, partitions = list.count(), "pgbox kafka partitions revoked");
    }
}

impl TopicConsumer {
    /// Files a message fetched from the broker.
    fn file(&self, message: OwnedMessage) {
        let mut state = self.state.lock().expect("kafka state");
        let state = &mut *state;
        let Some(part) = state.partitions.get_mut(&message.partition()) else {
            return;
        };
        if !part.assigned {
            return;
        }
        let offset = message.offset();
        if part.open.contains(&offset) {
            // Fetched again while still held (librdkafka re-fetching after a connection
            // loss, or a broker answering from an earlier offset). Filing it twice would
            // hand one offset out twice at once. A settled offset fetched again is filed:
            // the inbox absorbs it, and nothing is skipped on a broker's word.
            tracing::debug!(topic = %self.topic, partition = message.partition(), offset, "pgbox kafka: a record fetched again; ignored");
            return;
        }
        if part.received_through.is_none()
            && part.prior.committed >= 0
            && offset != part.prior.committed
        {
            tracing::warn!(topic = %self.topic, partition = message.partition(), offset, committed = part.prior.committed, "pgbox kafka: the broker returned a partition from a later offset than the committed one (compacted topic, or a broker that skips records)");
        }
        tracing::trace!(topic = %self.topic, partition = message.partition(), offset, "pgbox kafka filed");
        part.received_through = Some(part.received_through.unwrap_or(0).max(offset + 1));
        part.open.insert(offset);
        match decode(&self.topic, &message) {
            Ok(envelope) => {
                let deliveries = part.prior.deliveries(offset);
                part.buffer.insert(
                    offset,
                    Pending {
                        envelope,
                        deliveries,
                        not_before: None,
                    },
                );
                state.buffered += 1;
            }
            Err(e) => {
                tracing::warn!(topic = %self.topic, partition = message.partition(), offset, error = %e, "pgbox kafka: not a pgbox message; it goes to the dead-letter topic");
                state.foreign.push((part.generation, message));
            }
        }
    }

    /// Hands out up to `max` messages whose key is free; returns them and when the next
    /// delayed message becomes ready.
    fn take_ready(
        &self,
        max: usize,
        visibility: Duration,
    ) -> (Vec<KafkaDelivery>, Option<Instant>) {
        let now = Instant::now();
        let mut out = Vec::new();
        let mut wake: Option<Instant> = None;
        let mut state = self.state.lock().expect("kafka state");
        let state = &mut *state;
        // Messages in hand past their visibility timeout go back to the front of their
        // partition (a lost delivery, or a handler slower than the timeout): their key is
        // free again, and the old hand-out's settle reports stale.
        for (&id, part) in state.partitions.iter_mut() {
            let expired: Vec<i64> = part
                .in_hand
                .iter()
                .filter(|(_, h)| h.expires <= now)
                .map(|(&o, _)| o)
                .collect();
            for offset in expired {
                let h = part.in_hand.remove(&offset).expect("in hand");
                tracing::info!(topic = %self.topic, partition = id, offset, attempt = h.attempt, "pgbox kafka: visibility timeout passed; the message is handed out again");
                if let Some(k) = &h.envelope.ordering_key
                    && state.busy.get(&(id, k.clone())) == Some(&h.lease)
                {
                    state.busy.remove(&(id, k.clone()));
                }
                part.buffer.insert(
                    offset,
                    Pending {
                        envelope: h.envelope,
                        deliveries: h.attempt,
                        not_before: None,
                    },
                );
                state.buffered += 1;
            }
            if let Some(first) = part.in_hand.values().map(|h| h.expires).min() {
                wake = Some(wake.map_or(first, |w| w.min(first)));
            }
        }
        let mut ids: Vec<i32> = state.partitions.keys().copied().collect();
        // Start at a different partition each time, so none is starved by a small `max`.
        if !ids.is_empty() {
            ids.sort_unstable();
            let shift = fastrand::usize(..ids.len());
            ids.rotate_left(shift);
        }
        for id in ids {
            if out.len() >= max {
                break;
            }
            let part = state.partitions.get_mut(&id).expect("partition");
            if !part.assigned {
                continue;
            }
            let mut blocked: HashSet<&str> = HashSet::new();
            let mut taken = Vec::new();
            for (&offset, pending) in &part.buffer {
                if out.len() + taken.len() >= max {
                    break;
                }
                let key = pending.envelope.ordering_key.as_deref();
                if let Some(k) = key
                    && (blocked.contains(k) || state.busy.contains_key(&(id, k.to_owned())))
                {
                    blocked.insert(k);
                    continue;
                }
                if let Some(at) = pending.not_before
                    && at > now
                {
                    wake = Some(wake.map_or(at, |w| w.min(at)));
                    if let Some(k) = key {
                        blocked.insert(k);
                    }
                    continue;
                }
                if let Some(k) = key {
                    blocked.insert(k);
                }
                taken.push(offset);
            }
            for offset in taken {
                let pending = part.buffer.remove(&offset).expect("buffered");
                state.buffered -= 1;
                let attempt = pending.deliveries + 1;
                state.next_lease += 1;
                let lease = state.next_lease;
                part.in_hand.insert(
                    offset,
                    InHand {
                        attempt,
                        lease,
                        expires: now + visibility,
                        envelope: pending.envelope.clone(),
                    },
                );
                part.handed_through = part.handed_through.max(offset + 1);
                if let Some(k) = &pending.envelope.ordering_key {
                    state.busy.insert((id, k.clone()), lease);
                }
                out.push(KafkaDelivery {
                    envelope: pending.envelope,
                    attempt,
                    partition: id,
                    offset,
                    lease,
                });
            }
        }
        (out, wake)
    }

    /// Commits that must be durable before messages are handed out (their attempt
    /// counts), or that are due (settled messages, at most one per commit interval).
    fn due_commits(&self, durable: bool, interval: Duration) -> Vec<Commit> {
        let now = Instant::now();
        let mut state = self.state.lock().expect("kafka state");
        let mut commits = Vec::new();
        for (&id, part) in state.partitions.iter_mut() {
            if !part.assigned {
                continue;
            }
            let Some(frontier) = part.frontier() else {
                continue;
            };
            let wanted = if durable {
                part.mark_behind(frontier)
            } else {
                frontier > part.committed
                    && (part.in_hand.is_empty()
                        || part.last_commit.is_none_or(|t| now - t >= interval))
            };
            if wanted {
                commits.push(Commit {
                    topic: self.topic.clone(),
                    partition: id,
                    offset: frontier,
                    metadata: part.metadata(frontier),
                });
                part.committed = part.committed.max(frontier);
                part.last_commit = Some(now);
            }
        }
        commits
    }

    fn commit_async(&self, commits: &[Commit]) {
        if let Some(tpl) = Commit::list(commits)
            && let Err(e) = self.client().commit(&tpl, CommitMode::Async)
        {
            tracing::debug!(topic = %self.topic, error = %e, "pgbox kafka: offset commit failed; redelivery covers it");
        }
    }

    /// Settles a delivery: `true` if it was still this consumer's.
    fn settle(&self, delivery: &KafkaDelivery, requeue: Option<Duration>) -> bool {
        let mut state = self.state.lock().expect("kafka state");
        let state = &mut *state;
        if let Some(k) = &delivery.envelope.ordering_key {
            let slot = (delivery.partition, k.clone());
            if state.busy.get(&slot) == Some(&delivery.lease) {
                state.busy.remove(&slot);
            }
        }
        let Some(part) = state.partitions.get_mut(&delivery.partition) else {
            return false;
        };
        if !part.assigned
            || part
                .in_hand
                .get(&delivery.offset)
                .is_none_or(|h| h.lease != delivery.lease)
        {
            return false;
        }
        let held = part.in_hand.remove(&delivery.offset).expect("in hand");
        if let Some(delay) = requeue {
            part.buffer.insert(
                delivery.offset,
                Pending {
                    envelope: held.envelope,
                    deliveries: delivery.attempt,
                    not_before: (!delay.is_zero()).then(|| Instant::now() + delay),
                },
            );
            state.buffered += 1;
            return true;
        }
        part.open.remove(&delivery.offset);
        true
    }

    /// Pauses fetching when the buffer is full; resumes what it paused once the buffer is
    /// half empty. Only partitions this member paused are ever resumed: librdkafka's resume
    /// of a partition that is not paused still starts a new version of it, which drops the
    /// records already fetched for it without fetching them again.
    fn pause_or_resume(&self, max_buffered: usize) {
        let mut state = self.state.lock().expect("kafka state");
        let pause = if state.paused.is_empty() && state.buffered >= max_buffered {
            true
        } else if !state.paused.is_empty() && state.buffered <= max_buffered / 2 {
            false
        } else {
            return;
        };
        let Ok(assignment) = self.client().assignment() else {
            return;
        };
        let partitions: Vec<i32> = assignment
            .elements_for_topic(&self.topic)
            .iter()
            .map(|e| e.partition())
            .filter(|p| pause || state.paused.contains(p))
            .collect();
        if pause {
            state.paused = partitions.iter().copied().collect();
        } else {
            state.paused.clear();
        }
        drop(state);
        if partitions.is_empty() {
            return;
        }
        let mut list = TopicPartitionList::new();
        for p in partitions {
            list.add_partition(&self.topic, p);
        }
        let result = if pause {
            self.client().pause(&list)
        } else {
            self.client().resume(&list)
        };
        if let Err(e) = result {
            tracing::debug!(topic = %self.topic, pause, error = %e, "pgbox kafka: pause/resume failed");
        }
    }
}

impl Kafka {
    /// Copies the messages that are not pgbox's to the dead-letter topic, all at once, then
    /// settles them. After a failed copy the next try waits [`FOREIGN_RETRY`]: a dead-letter
    /// topic that cannot be written does not slow every receive down.
    async fn forward_foreign(&self, tc: &TopicConsumer) {
        let foreign = {
            let mut state = tc.state.lock().expect("kafka state");
            if state.foreign_retry_at.is_some_and(|at| Instant::now() < at) {
                return;
            }
            std::mem::take(&mut state.foreign)
        };
        let sent = join_all(foreign.into_iter().map(|(generation, m)| async move {
            let headers = m
                .headers()
                .map(|h| h.as_borrowed().detach())
                .unwrap_or_default()
                .insert(Header {
                    key: ERROR,
                    value: Some("not a pgbox message (no pgbox-id/pgbox-meta headers)"),
                });
            let sent = self
                .send_dead_letter(&tc.topic, m.key(), m.payload().unwrap_or_default(), headers)
                .await;
            (generation, m, sent)
        }))
        .await;
        let mut state = tc.state.lock().expect("kafka state");
        let mut failed = false;
        for (generation, m, sent) in sent {
            match sent {
                Ok(()) => {
                    if let Some(part) = state.partitions.get_mut(&m.partition())
                        && part.generation == generation
                    {
                        part.open.remove(&m.offset());
                    }
                }
                Err(e) => {
                    tracing::warn!(topic = %tc.topic, error = %e, "pgbox kafka: cannot dead-letter a foreign message yet");
                    failed = true;
                    state.foreign.push((generation, m));
                }
            }
        }
        state.foreign_retry_at = failed.then(|| Instant::now() + FOREIGN_RETRY);
    }
}

impl Subscriber for Kafka {
    type Delivery = KafkaDelivery;

    async fn receive(
        &self,
        topic: &str,
        max: usize,
        visibility: Duration,
    ) -> Result<Vec<KafkaDelivery>> {
        let tc = self.consumer(topic).await?;
        let config = &self.inner.config;
        if let Some(failure) = self.inner.watch.recent() {
            return Err(failure.into_error(config.target()));
        }
        let deadline = Instant::now() + config.receive_wait;
        let max = max.max(1);
        if !tc.state.lock().expect("kafka state").foreign.is_empty() {
            self.forward_foreign(&tc).await;
        }
        let due = tc.due_commits(false, config.commit_interval);
        tc.commit_async(&due);
        // Bounded by the deadline: every wait below ends by it.
        loop {
            let (out, wake) = tc.take_ready(max, visibility);
            if !out.is_empty() {
                // The attempt counts of what is handed out should survive this consumer:
                // the mark is sent now, ahead of the handlers' database work (not waited
                // for: a synchronous commit per receive cost ~35 ms of latency).
                let durable = tc.due_commits(true, config.commit_interval);
                tc.commit_async(&durable);
                for d in &out {
                    tracing::debug!(topic, message_id = %d.envelope.id, partition = d.partition, offset = d.offset, attempt = d.attempt, "pgbox kafka received");
                }
                return Ok(out);
            }
            let now = Instant::now();
            let until = wake.map_or(deadline, |w| w.min(deadline));
            if now >= deadline {
                tc.pause_or_resume(config.max_buffered);
                return Ok(Vec::new());
            }
            let wait = until.saturating_duration_since(now);
            match tokio::time::timeout(wait, tc.client().recv()).await {
                Ok(Ok(m)) => {
                    tc.file(m.detach());
                    // Take what else is already fetched, without waiting.
                    for _ in 0..max.saturating_mul(4).min(10_000) {
                        match tc.client().recv().now_or_never() {
                            Some(Ok(m)) => tc.file(m.detach()),
                            Some(Err(e)) => {
                                tracing::debug!(topic, error = %e, "pgbox kafka fetch error");
                                break;
                            }
                            None => break,
                        }
                    }
                    tc.pause_or_resume(config.max_buffered);
                    if !tc.state.lock().expect("kafka state").foreign.is_empty() {
                        self.forward_foreign(&tc).await;
                    }
                }
                Ok(Err(e)) => {
                    tracing::debug!(topic, error = %e, "pgbox kafka fetch error");
                    tokio::time::sleep(Duration::from_millis(20).min(wait)).await;
                }
                Err(_) => {}
            }
        }
    }

    fn envelope<'d>(&self, delivery: &'d KafkaDelivery) -> &'d Envelope {
        &delivery.envelope
    }

    fn attempt(&self, delivery: &KafkaDelivery) -> i32 {
        delivery.attempt
    }

    async fn ack(&self, delivery: &KafkaDelivery) -> Result<bool> {
        let tc = self.consumer(&delivery.envelope.topic).await?;
        let fresh = tc.settle(delivery, None);
        if fresh {
            let due = tc.due_commits(false, self.inner.config.commit_interval);
            tc.commit_async(&due);
        }
        tracing::debug!(message_id = %delivery.envelope.id, partition = delivery.partition, offset = delivery.offset, fresh, "pgbox kafka ack");
        Ok(fresh)
    }

    async fn nack(&self, delivery: &KafkaDelivery, delay: Duration, error: &str) -> Result<bool> {
        let tc = self.consumer(&delivery.envelope.topic).await?;
        let fresh = tc.settle(delivery, Some(delay));
        tracing::info!(message_id = %delivery.envelope.id, ?delay, error, fresh, "pgbox kafka nack; will redeliver");
        Ok(fresh)
    }

    async fn dead_letter(&self, delivery: &KafkaDelivery, error: &str) -> Result<bool> {
        let tc = self.consumer(&delivery.envelope.topic).await?;
        let envelope = &delivery.envelope;
        let error_text = truncate(&error.replace(['\r', '\n'], " "), MAX_ERROR_BYTES).to_owned();
        let attempt = delivery.attempt.to_string();
        let map = headers(envelope)
            .map_err(|e| broker_error("dead letter", e.to_string()))?
            .insert(Header {
                key: ERROR,
                value: Some(error_text.as_str()),
            })
            .insert(Header {
                key: DELIVERIES,
                value: Some(attempt.as_str()),
            });
        self.send_dead_letter(
            &envelope.topic,
            envelope.ordering_key.as_deref().map(str::as_bytes),
            &envelope.payload,
            map,
        )
        .await?;
        let fresh = tc.settle(delivery, None);
        if fresh {
            let due = tc.due_commits(false, self.inner.config.commit_interval);
            tc.commit_async(&due);
        }
        tracing::warn!(message_id = %envelope.id, attempt = delivery.attempt, error, "pgbox kafka message dead-lettered");
        Ok(fresh)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bootstrap_hosts_are_parsed() {
        let hosts: Vec<&str> =
            bootstrap_hosts("a.example:9092, 127.0.0.1:9093,[::1]:9094,SASL_SSL://b:1,::1,c")
                .collect();
        assert_eq!(hosts, ["a.example", "127.0.0.1", "::1", "b", "::1", "c"]);
    }

    #[test]
    fn security_failures_are_classified() {
        use rdkafka::error::KafkaError;
        let auth = classify_failure(
            &KafkaError::Global(RDKafkaErrorCode::Authentication),
            "SASL authentication error: Authentication failed",
        );
        assert!(matches!(auth, Some(SecurityFailure::Authentication(_))));
        let tls = classify_failure(
            &KafkaError::Global(RDKafkaErrorCode::BrokerTransportFailure),
            "ssl://127.0.0.1:1/bootstrap: SSL handshake failed: error:0A000086:SSL routines::certificate verify failed: broker certificate could not be verified, verify that ssl.ca.location is correctly configured or root CA certificates are installed (install ca-certificates package) (after 2ms in state SSL_HANDSHAKE)",
        );
        assert!(matches!(tls, Some(SecurityFailure::Tls(..))), "{tls:?}");
        let down = classify_failure(
            &KafkaError::Global(RDKafkaErrorCode::AllBrokersDown),
            "1/1 brokers are down",
        );
        assert!(down.is_none());
    }

    /// Without the `tls` feature, TLS is refused at `build` as not built.
    #[cfg(not(feature = "tls"))]
    #[test]
    fn tls_without_the_feature_is_not_built() {
        for protocol in [SecurityProtocol::Ssl, SecurityProtocol::SaslSsl] {
            let err = Kafka::builder("127.0.0.1:9092")
                .security_protocol(protocol)
                .sasl(SaslMechanism::Plain, "u", Secret::new("p"))
                .build()
                .unwrap_err();
            assert!(
                matches!(
                    err,
                    Error::Tls {
                        problem: TlsProblem::NotBuilt,
                        ..
                    }
                ),
                "{err:?}"
            );
        }
    }

    #[test]
    fn topic_names() {
        assert!(valid_topic("orders.paid-v2_x"));
        assert!(!valid_topic(""));
        assert!(!valid_topic("."));
        assert!(!valid_topic(".."));
        assert!(!valid_topic("a b"));
        assert!(!valid_topic("ü"));
        assert!(!valid_topic(&"a".repeat(250)));
        assert!(valid_topic(&"a".repeat(249)));
    }

    #[test]
    fn prior_deliveries_from_metadata() {
        let p = Prior::parse(10, "pgbox:1:13:3");
        assert_eq!(p.deliveries(10), 3, "the head was delivered 3 times");
        assert_eq!(p.deliveries(12), 1, "handed out once before");
        assert_eq!(p.deliveries(13), 0, "never handed out");
        let none = Prior::parse(10, "");
        assert_eq!(none.deliveries(10), 0);
        let foreign = Prior::parse(10, "something else");
        assert_eq!(foreign.deliveries(10), 0);
    }

    fn envelope(offset: i64) -> Envelope {
        crate::transport::conformance::envelope("t", format!("m{offset}"))
    }

    /// A new owner that hands the committed head out again must send the new count, or
    /// a message that kills every consumer it reaches would restart its count each time.
    #[test]
    fn a_new_owner_marks_the_head_it_hands_out_again() {
        let prior = Prior::parse(10, "pgbox:1:13:2");
        let mut part = Partition::assigned(1, prior);
        part.open.insert(10);
        assert!(!part.mark_behind(10), "nothing handed out yet");
        part.in_hand.insert(
            10,
            InHand {
                attempt: prior.deliveries(10) + 1,
                lease: 1,
                expires: Instant::now(),
                envelope: envelope(10),
            },
        );
        assert!(
            part.mark_behind(10),
            "the head's third delivery is not marked"
        );
        assert_eq!(part.metadata(10), "pgbox:1:13:3");
        assert!(!part.mark_behind(10), "marked");
        // Settled: the next offset was handed out once before, by the previous owner.
        part.in_hand.clear();
        part.open.remove(&10);
        part.open.insert(11);
        part.in_hand.insert(
            11,
            InHand {
                attempt: prior.deliveries(11) + 1,
                lease: 2,
                expires: Instant::now(),
                envelope: envelope(11),
            },
        );
        assert!(part.mark_behind(11), "its second delivery is not marked");
        assert_eq!(part.metadata(11), "pgbox:1:13:2");
        // A first delivery past what was handed out moves `handed_through`.
        part.handed_through = 14;
        assert!(part.mark_behind(11));
        assert_eq!(part.metadata(11), "pgbox:1:14:2");
        assert!(!part.mark_behind(11));
    }

    #[test]
    fn builder_refuses_settings_pgbox_owns() {
        for key in ["enable.auto.commit", "acks", "enable.idempotence"] {
            let err = Kafka::builder("127.0.0.1:9092")
                .set(key, "x")
                .build()
                .unwrap_err();
            assert!(matches!(err, Error::InvalidConfig(_)), "{key}");
        }
        assert!(Kafka::builder("127.0.0.1:9092").build().is_ok());
        assert!(Kafka::builder(" ").build().is_err());
        assert!(Kafka::builder("x:1").group("a b").build().is_err());
    }

    #[test]
    fn builder_checks_the_instance_id() {
        let build = |id: &str| Kafka::builder("x:1").instance_id(id).build();
        assert!(build("points-1").is_ok());
        assert!(build("pod_7.eu-west").is_ok());
        for bad in ["", "a b", "ü", "a/b", &"x".repeat(250)] {
            let err = build(bad).unwrap_err();
            assert!(matches!(err, Error::InvalidConfig(_)), "{bad:?}: {err}");
        }
        // Only through `instance_id`, which keeps it off the producer.
        let err = Kafka::builder("x:1")
            .set("group.instance.id", "points-1")
            .build()
            .unwrap_err();
        assert!(err.to_string().contains("instance_id"), "{err}");
    }

    #[test]
    fn builder_keeps_the_session_within_the_poll_interval() {
        let session = |secs| Kafka::builder("x:1").session_timeout(Duration::from_secs(secs));
        assert!(session(300).build().is_ok());
        let err = session(600).build().unwrap_err();
        assert!(err.to_string().contains("max.poll.interval.ms"), "{err}");
        assert!(
            session(600)
                .set("max.poll.interval.ms", "900000")
                .build()
                .is_ok()
        );
    }
}
