//! What both services share: configuration, logs, metrics, health, shutdown.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::routing::get;
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use pgbox::cloudevents::CloudEvents;
use pgbox::{CancellationToken, Secret};
use sqlx::PgPool;

/// Configuration of one service, from flags or the environment. No `Debug`: the URLs may
/// hold passwords.
#[derive(clap::Args, Clone)]
pub struct ServiceArgs {
    /// The database (both services may share one; each keeps to its own schemas). Without a
    /// password in it, PGPASSWORD or the password file (PGPASSFILE, else ~/.pgpass) gives it;
    /// with the `tls` feature, `?sslmode=verify-full&sslrootcert=<CA file>` verifies the server.
    #[arg(long, env = "DATABASE_URL", hide_env_values = true)]
    pub database_url: String,
    /// Where the HTTP API listens (default: 127.0.0.1:8081 for payments, :8082 for points).
    #[arg(long, env = "LISTEN")]
    pub listen: Option<SocketAddr>,
    /// Where the messages go between the services.
    #[arg(long, env = "TRANSPORT", value_enum, default_value_t = TransportKind::Postgres)]
    pub transport: TransportKind,
    /// The broker's URL for rabbitmq/nats/kafka (default: RABBITMQ_URL / NATS_URL /
    /// KAFKA_BOOTSTRAP, else the local standard port).
    #[arg(long, env = "BROKER_URL", hide_env_values = true)]
    pub broker_url: Option<String>,
    /// The topic of PaymentSucceeded.
    #[arg(long, env = "TOPIC", default_value = "payment-succeeded")]
    pub topic: String,
    /// payments: the topic of the payment reminders it schedules for itself. It refuses to
    /// start while reminders wait under another topic.
    #[arg(long, env = "REMINDER_TOPIC", default_value = "payment-reminders")]
    pub reminder_topic: String,
    /// payments: how long after an order is created its payment reminder falls due, unless
    /// the order is paid first (by the database's clock), in seconds (fractions allowed).
    #[arg(long, env = "REMINDER_AFTER_SECS", default_value_t = 86_400.0)]
    pub reminder_after_secs: f64,
    /// payments: how many days the archive keeps what the relay published (for replays),
    /// recorded at start; its janitor drops what is older.
    #[arg(long, env = "ARCHIVE_DAYS", default_value_t = 7)]
    pub archive_days: u32,
    /// rabbitmq/nats: let the broker drop this service's queue or consumer after this many
    /// seconds unused (default: never; the demo's per-run topics use an hour).
    #[arg(long, env = "BROKER_EXPIRES_SECS")]
    pub broker_expires_secs: Option<u64>,
    /// On kafka: this replica's stable name in its consumer group (static membership; the
    /// points consumer's, or the payments service's reminders consumer's): restarted under
    /// the same name, it takes its partitions back at once instead of waiting for a
    /// rebalance. One running process per name.
    #[arg(long, env = "INSTANCE_ID")]
    pub instance_id: Option<String>,
    /// points: messages processed per transaction (`ConsumerBuilder::batch_size`): first
    /// deliveries share one transaction and one commit; 1 to 1,000.
    #[arg(long, env = "BATCH_SIZE", default_value_t = 1)]
    pub batch_size: usize,
    /// Database connections of this process.
    #[arg(long, env = "MAX_CONNECTIONS", default_value_t = 10)]
    pub max_connections: u32,
    /// points: how long a received message stays invisible to other consumers; a consumer
    /// killed with messages in hand gets them redelivered after this.
    #[arg(long, env = "VISIBILITY_TIMEOUT_MS", default_value_t = 5000)]
    pub visibility_timeout_ms: u64,
    /// payments, fault injection: the share of relayed messages published a second time
    /// (same message id), as a broker redelivering would.
    #[arg(long, env = "DUPLICATE_RATE", default_value_t = 0.0)]
    pub duplicate_rate: f64,
    /// payments, fault injection: the share of payments whose PaymentSucceeded is enqueued
    /// again, under a new message id, in a separate transaction after the first commit, as a
    /// producer retrying after a lost acknowledgement would.
    #[arg(long, env = "PRODUCER_RETRIES", default_value_t = 0.0)]
    pub producer_retries: f64,
}

/// The transport between the two services.
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum TransportKind {
    /// The built-in queue (`PgQueue`), in schema `broker` of the same database.
    Postgres,
    /// RabbitMQ (`--broker-url` or RABBITMQ_URL).
    Rabbitmq,
    /// NATS JetStream (`--broker-url` or NATS_URL).
    Nats,
    /// Kafka (`--broker-url` or KAFKA_BOOTSTRAP: `host:port`).
    Kafka,
}

impl TransportKind {
    pub fn name(self) -> &'static str {
        match self {
            TransportKind::Postgres => "postgres",
            TransportKind::Rabbitmq => "rabbitmq",
            TransportKind::Nats => "nats",
            TransportKind::Kafka => "kafka",
        }
    }
}

impl ServiceArgs {
    pub fn broker_url(&self) -> String {
        if let Some(url) = &self.broker_url {
            return url.clone();
        }
        match self.transport {
            TransportKind::Postgres => String::new(),
            TransportKind::Rabbitmq => std::env::var("RABBITMQ_URL")
                .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into()),
            TransportKind::Nats => {
                std::env::var("NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".into())
            }
            TransportKind::Kafka => {
                std::env::var("KAFKA_BOOTSTRAP").unwrap_or_else(|_| "127.0.0.1:9092".into())
            }
        }
    }

    /// The RabbitMQ client; with `events`, it publishes CloudEvents (its subscriber reads
    /// both forms either way).
    pub fn rabbitmq(
        &self,
        events: Option<CloudEvents>,
    ) -> anyhow::Result<pgbox::transport::rabbitmq::RabbitMq> {
        let security = BrokerSecurity::from_env()?;
        let mut builder = pgbox::transport::rabbitmq::RabbitMq::builder(self.broker_url())
            .exchange("pgbox-services")
            .queue_prefix("pgbox-services.");
        if let Some(secs) = self.broker_expires_secs {
            builder = builder.queue_expires(Duration::from_secs(secs));
        }
        if let Some(events) = events {
            builder = builder.cloudevents(events);
        }
        Ok(security.apply_rabbitmq(builder)?.build()?)
    }

    /// The NATS client; `durable` names this service's consumers on the stream; with
    /// `events`, it publishes CloudEvents.
    #[cfg(feature = "nats")]
    pub fn nats(
        &self,
        durable: &str,
        events: Option<CloudEvents>,
    ) -> anyhow::Result<pgbox::transport::nats::Nats> {
        let security = BrokerSecurity::from_env()?;
        let mut builder = pgbox::transport::nats::Nats::builder(self.broker_url())
            .stream("PGBOX_SERVICES")
            .subject_prefix("pgbox-services")
            .durable(durable)
            .ack_wait(Duration::from_millis(self.visibility_timeout_ms));
        if let Some(secs) = self.broker_expires_secs {
            builder = builder
                .inactive_threshold(Duration::from_secs(secs))
                .max_age(Duration::from_secs(secs));
        }
        if let Some(events) = events {
            builder = builder.cloudevents(events);
        }
        Ok(security.apply_nats(builder)?.build()?)
    }

    /// The Kafka client; `group` is this service's consumer group; with `events`, it
    /// publishes CloudEvents.
    #[cfg(feature = "kafka")]
    pub fn kafka(
        &self,
        group: &str,
        events: Option<CloudEvents>,
    ) -> anyhow::Result<pgbox::transport::kafka::Kafka> {
        let security = BrokerSecurity::from_env()?;
        let mut builder = pgbox::transport::kafka::Kafka::builder(self.broker_url()).group(group);
        if let Some(events) = events {
            builder = builder.cloudevents(events);
        }
        if let Some(id) = &self.instance_id {
            builder = builder.instance_id(id);
        }
        // librdkafka settings, `name=value,name=value` (security, timeouts...).
        // An entry without `=` is named by its position only: it may be part of a password.
        if let Ok(settings) = std::env::var("KAFKA_SETTINGS") {
            for (n, pair) in settings.split(',').enumerate() {
                if pair.trim().is_empty() {
                    continue;
                }
                let (name, value) = pair.split_once('=').ok_or_else(|| {
                    anyhow::anyhow!("KAFKA_SETTINGS: entry {} is not name=value", n + 1)
                })?;
                builder = builder.set(name.trim(), value.trim());
            }
        }
        Ok(security.apply_kafka(builder)?.build()?)
    }

    /// `--reminder-after-secs` as a duration: refused unless 0 to 365 days.
    pub fn reminder_after(&self) -> anyhow::Result<Duration> {
        anyhow::ensure!(
            (0.0..=365.0 * 86_400.0).contains(&self.reminder_after_secs),
            "--reminder-after-secs must be between 0 and 31536000"
        );
        Ok(Duration::from_secs_f64(self.reminder_after_secs))
    }

    /// Refuses fault rates outside 0..=1.
    pub fn check_fault_rates(&self) -> anyhow::Result<()> {
        for (name, p) in [
            ("--duplicate-rate", self.duplicate_rate),
            ("--producer-retries", self.producer_retries),
        ] {
            anyhow::ensure!((0.0..=1.0).contains(&p), "{name} must be between 0 and 1");
        }
        Ok(())
    }

    pub async fn connect(&self) -> anyhow::Result<PgPool> {
        Ok(pgbox::connect(
            &self.database_url,
            sqlx::postgres::PgPoolOptions::new()
                .max_connections(self.max_connections)
                .acquire_timeout(Duration::from_secs(10)),
        )
        .await?)
    }
}

/// The broker's TLS settings and credentials, from the environment, apart from the broker's
/// URL (so that no password need sit in it, on a command line or in `ps`):
///
/// - `PGBOX_BROKER_CA_FILE`: the PEM file of the certificate authority that signed the
///   broker's certificate (else the system's roots);
/// - `PGBOX_BROKER_CERT_FILE` and `PGBOX_BROKER_KEY_FILE`: a client certificate and its key
///   (PEM), both or neither;
/// - `PGBOX_BROKER_USER` and `PGBOX_BROKER_PASSWORD_FILE`: a user and the file holding its
///   password (a mounted secret), both or neither;
/// - `PGBOX_BROKER_TOKEN_FILE` (NATS): the file holding a token;
/// - `PGBOX_BROKER_NKEY_FILE` (NATS): the file holding a user's NKey seed;
/// - `PGBOX_BROKER_CREDS_FILE` (NATS): a `.creds` file (a user JWT and its NKey seed);
/// - `PGBOX_KAFKA_SASL_MECHANISM` (Kafka): `PLAIN`, `SCRAM-SHA-256` or `SCRAM-SHA-512`, for the
///   user and password above.
///
/// Secrets are read when the service starts; their `Debug` shows `***`.
#[derive(Debug, Default)]
pub struct BrokerSecurity {
    pub ca_file: Option<PathBuf>,
    pub client_certificate: Option<(PathBuf, PathBuf)>,
    pub credentials: Option<(String, Secret)>,
    pub token: Option<Secret>,
    pub nkey: Option<Secret>,
    pub creds_file: Option<PathBuf>,
    pub kafka_sasl_mechanism: Option<String>,
}

impl BrokerSecurity {
    /// The settings of the process's environment.
    pub fn from_env() -> anyhow::Result<Self> {
        Self::from_lookup(|name| std::env::var(name).ok().filter(|v| !v.is_empty()))
    }

    /// The settings `lookup` (a variable's name to its non-empty value) gives.
    fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> anyhow::Result<Self> {
        let both = |a: &str, b: &str| -> anyhow::Result<Option<(String, String)>> {
            match (lookup(a), lookup(b)) {
                (Some(x), Some(y)) => Ok(Some((x, y))),
                (None, None) => Ok(None),
                (Some(_), None) => anyhow::bail!("{a} is set without {b}"),
                (None, Some(_)) => anyhow::bail!("{b} is set without {a}"),
            }
        };
        let client_certificate = both("PGBOX_BROKER_CERT_FILE", "PGBOX_BROKER_KEY_FILE")?
            .map(|(cert, key)| (PathBuf::from(cert), PathBuf::from(key)));
        let credentials = match both("PGBOX_BROKER_USER", "PGBOX_BROKER_PASSWORD_FILE")? {
            Some((user, file)) => Some((user, Secret::from_file(file)?)),
            None => None,
        };
        let token = lookup("PGBOX_BROKER_TOKEN_FILE")
            .map(Secret::from_file)
            .transpose()?;
        let nkey = lookup("PGBOX_BROKER_NKEY_FILE")
            .map(Secret::from_file)
            .transpose()?;
        let kafka_sasl_mechanism = lookup("PGBOX_KAFKA_SASL_MECHANISM");
        if let Some(mechanism) = &kafka_sasl_mechanism {
            anyhow::ensure!(
                ["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"].contains(&mechanism.as_str()),
                "PGBOX_KAFKA_SASL_MECHANISM is {mechanism:?}: PLAIN, SCRAM-SHA-256 or SCRAM-SHA-512"
            );
            anyhow::ensure!(
                credentials.is_some(),
                "PGBOX_KAFKA_SASL_MECHANISM needs PGBOX_BROKER_USER and PGBOX_BROKER_PASSWORD_FILE"
            );
        }
        Ok(BrokerSecurity {
            ca_file: lookup("PGBOX_BROKER_CA_FILE").map(PathBuf::from),
            client_certificate,
            credentials,
            token,
            nkey,
            creds_file: lookup("PGBOX_BROKER_CREDS_FILE").map(PathBuf::from),
            kafka_sasl_mechanism,
        })
    }

    /// The settings on a RabbitMQ builder: the CA file, the client certificate, the user
    /// and password. A token or a `.creds` file is NATS's and refused here.
    pub fn apply_rabbitmq(
        &self,
        mut builder: pgbox::transport::rabbitmq::RabbitMqBuilder,
    ) -> anyhow::Result<pgbox::transport::rabbitmq::RabbitMqBuilder> {
        self.refuse(&[
            ("PGBOX_BROKER_TOKEN_FILE", self.token.is_some()),
            ("PGBOX_BROKER_NKEY_FILE", self.nkey.is_some()),
            ("PGBOX_BROKER_CREDS_FILE", self.creds_file.is_some()),
            (
                "PGBOX_KAFKA_SASL_MECHANISM",
                self.kafka_sasl_mechanism.is_some(),
            ),
        ])?;
        if let Some(ca) = &self.ca_file {
            builder = builder.tls_root_certificates(ca);
        }
        if let Some((cert, key)) = &self.client_certificate {
            builder = builder.tls_client_certificate(cert, key);
        }
        if let Some((user, password)) = &self.credentials {
            builder = builder.credentials(user, password.clone());
        }
        Ok(builder)
    }

    /// The settings on a NATS builder: TLS files, a user and password or a token. A
    /// `.creds` file is refused: pgbox's NATS transport does not take one yet.
    #[cfg(feature = "nats")]
    pub fn apply_nats(
        &self,
        mut builder: pgbox::transport::nats::NatsBuilder,
    ) -> anyhow::Result<pgbox::transport::nats::NatsBuilder> {
        self.refuse(&[
            ("PGBOX_BROKER_CREDS_FILE", self.creds_file.is_some()),
            (
                "PGBOX_KAFKA_SASL_MECHANISM",
                self.kafka_sasl_mechanism.is_some(),
            ),
        ])?;
        if let Some(ca) = &self.ca_file {
            builder = builder.tls_root_certificates(ca);
        }
        if let Some((cert, key)) = &self.client_certificate {
            builder = builder.tls_client_certificate(cert, key);
        }
        if let Some((user, password)) = &self.credentials {
            builder = builder.user_password(user, password.clone());
        }
        if let Some(token) = &self.token {
            builder = builder.token(token.clone());
        }
        if let Some(seed) = &self.nkey {
            builder = builder.nkey(seed.clone());
        }
        Ok(builder)
    }

    /// The settings on a Kafka builder: TLS files, SASL with the user and password. The
    /// security protocol is `PGBOX_KAFKA_SECURITY_PROTOCOL` (`plaintext`, `ssl`,
    /// `sasl_plaintext`, `sasl_ssl`), else `sasl_ssl` with SASL, `ssl` with TLS files,
    /// `plaintext` with neither.
    #[cfg(feature = "kafka")]
    pub fn apply_kafka(
        &self,
        mut builder: pgbox::transport::kafka::KafkaBuilder,
    ) -> anyhow::Result<pgbox::transport::kafka::KafkaBuilder> {
        use pgbox::transport::kafka::{SaslMechanism, SecurityProtocol};
        self.refuse(&[
            ("PGBOX_BROKER_TOKEN_FILE", self.token.is_some()),
            ("PGBOX_BROKER_NKEY_FILE", self.nkey.is_some()),
            ("PGBOX_BROKER_CREDS_FILE", self.creds_file.is_some()),
        ])?;
        let tls_files = self.ca_file.is_some() || self.client_certificate.is_some();
        let protocol = match std::env::var("PGBOX_KAFKA_SECURITY_PROTOCOL")
            .ok()
            .as_deref()
        {
            Some("plaintext") => SecurityProtocol::Plaintext,
            Some("ssl") => SecurityProtocol::Ssl,
            Some("sasl_plaintext") => SecurityProtocol::SaslPlaintext,
            Some("sasl_ssl") => SecurityProtocol::SaslSsl,
            Some(other) => anyhow::bail!(
                "PGBOX_KAFKA_SECURITY_PROTOCOL is {other:?}: plaintext, ssl, sasl_plaintext or sasl_ssl"
            ),
            None if self.kafka_sasl_mechanism.is_some() => SecurityProtocol::SaslSsl,
            None if tls_files => SecurityProtocol::Ssl,
            None => SecurityProtocol::Plaintext,
        };
        builder = builder.security_protocol(protocol);
        if let Some(ca) = &self.ca_file {
            builder = builder.tls_root_certificates(ca);
        }
        if let Some((cert, key)) = &self.client_certificate {
            builder = builder.tls_client_certificate(cert, key);
        }
        if let (Some(mechanism), Some((user, password))) =
            (&self.kafka_sasl_mechanism, &self.credentials)
        {
            let mechanism = match mechanism.as_str() {
                "PLAIN" => SaslMechanism::Plain,
                "SCRAM-SHA-256" => SaslMechanism::ScramSha256,
                _ => SaslMechanism::ScramSha512,
            };
            builder = builder.sasl(mechanism, user, password.clone());
        } else if self.credentials.is_some() {
            anyhow::bail!("Kafka takes PGBOX_BROKER_USER only with PGBOX_KAFKA_SASL_MECHANISM");
        }
        Ok(builder)
    }

    /// Refuses the named variables that are set but mean nothing to this transport, rather
    /// than start without what they ask for.
    fn refuse(&self, settings: &[(&str, bool)]) -> anyhow::Result<()> {
        let set: Vec<&str> = settings
            .iter()
            .filter(|(_, is_set)| *is_set)
            .map(|(name, _)| *name)
            .collect();
        anyhow::ensure!(
            set.is_empty(),
            "{} set, but this transport does not take it",
            set.join(", ")
        );
        Ok(())
    }
}

/// Logs to stderr, filtered by `RUST_LOG` (default `info`). Colours only on a terminal, and
/// never with `NO_COLOR` set: a log file or a pipe gets plain text.
pub fn init_tracing() {
    use std::io::IsTerminal;
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let colour = std::io::stderr().is_terminal()
        && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty());
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(colour)
        .with_writer(std::io::stderr)
        .try_init();
}

/// Installs the Prometheus recorder (before the relay or consumer registers its metrics) and
/// describes pgbox's metrics.
pub fn install_metrics() -> anyhow::Result<PrometheusHandle> {
    let handle = PrometheusBuilder::new()
        .set_buckets_for_metric(
            metrics_exporter_prometheus::Matcher::Suffix("_seconds".into()),
            &[
                0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
            ],
        )?
        .install_recorder()?;
    pgbox::telemetry::describe_metrics();
    Ok(handle)
}

/// Refreshes pgbox's gauges of `schemas` every second until `shutdown`.
pub fn spawn_gauges(
    pool: PgPool,
    schemas: Vec<&'static str>,
    shutdown: CancellationToken,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        loop {
            for schema in &schemas {
                if let Err(e) = pgbox::telemetry::refresh_gauges(&pool, schema).await {
                    tracing::warn!(schema, error = %e, "cannot refresh pgbox gauges");
                }
            }
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tokio::time::sleep(Duration::from_secs(1)) => {}
            }
        }
    })
}

#[derive(Clone)]
struct OpsState {
    pool: PgPool,
    metrics: PrometheusHandle,
    broker: BrokerReady,
}

/// How often a ready service checks its broker again (declaring its topic, idempotent).
pub const RECHECK: Duration = Duration::from_secs(5);

/// Whether the service's broker is reachable (its topic declared): set by
/// [`BrokerReady::watch`]; always true on the built-in queue, whose broker is the database.
#[derive(Clone, Default)]
pub struct BrokerReady(Arc<AtomicBool>);

impl BrokerReady {
    /// Ready from the start (the built-in queue).
    pub fn ready() -> Self {
        let ready = BrokerReady::default();
        ready.0.store(true, Ordering::Relaxed);
        ready
    }

    /// Declares the topic until it works, with exponential backoff (250 ms to 30 s, jittered)
    /// and one warning per failure streak; then marks the broker ready, and checks again
    /// every [`RECHECK`]: a later outage makes the service unready again (503 on
    /// `/health/ready`, one warning) until the broker is back (one line). The service starts
    /// and serves `/health/live` meanwhile.
    pub fn watch<F, Fut>(declare: F, shutdown: CancellationToken) -> Self
    where
        F: Fn() -> Fut + Send + 'static,
        Fut: std::future::Future<Output = pgbox::Result<()>> + Send,
    {
        let ready = BrokerReady::default();
        let flag = ready.0.clone();
        tokio::spawn(async move {
            let mut failures = 0u32;
            let mut ever_ready = false;
            loop {
                let delay = match declare().await {
                    Ok(()) => {
                        // One line per change of state: unreachable (the warning below), then
                        // ready.
                        if failures > 0 {
                            tracing::info!(failures, "broker reachable again; ready");
                        } else if !ever_ready {
                            tracing::info!("broker reachable; ready");
                        }
                        failures = 0;
                        ever_ready = true;
                        flag.store(true, Ordering::Relaxed);
                        RECHECK
                    }
                    Err(e) => {
                        failures += 1;
                        flag.store(false, Ordering::Relaxed);
                        if failures == 1 {
                            tracing::warn!(error = %e, "broker unreachable; not ready, retrying with backoff");
                        } else {
                            tracing::debug!(error = %e, failures, "broker still unreachable");
                        }
                        Duration::from_millis(250)
                            .saturating_mul(1 << failures.min(7))
                            .min(Duration::from_secs(30))
                            .mul_f64(0.5 + fastrand::f64() / 2.0)
                    }
                };
                tokio::select! {
                    _ = tokio::time::sleep(delay) => {}
                    _ = shutdown.cancelled() => return,
                }
            }
        });
        ready
    }

    /// [`watch`](Self::watch) declaring `topic` on `broker`.
    pub fn watch_topic<B: DeclareTopic>(
        broker: &B,
        topic: &str,
        shutdown: CancellationToken,
    ) -> Self {
        Self::watch_topics(broker, &[topic], shutdown)
    }

    /// [`watch`](Self::watch) declaring each of `topics` on `broker`.
    pub fn watch_topics<B: DeclareTopic>(
        broker: &B,
        topics: &[&str],
        shutdown: CancellationToken,
    ) -> Self {
        let broker = broker.clone();
        let topics: Vec<String> = topics.iter().map(|t| (*t).to_owned()).collect();
        Self::watch(
            move || {
                let (broker, topics) = (broker.clone(), topics.clone());
                async move {
                    for topic in &topics {
                        broker.declare(topic).await?;
                    }
                    Ok(())
                }
            },
            shutdown,
        )
    }

    fn is_ready(&self) -> bool {
        self.0.load(Ordering::Relaxed)
    }
}

/// A broker client that can declare a topic (the readiness probe of the services).
pub trait DeclareTopic: Clone + Send + Sync + 'static {
    /// Declares `topic` (idempotent).
    fn declare(&self, topic: &str) -> impl std::future::Future<Output = pgbox::Result<()>> + Send;
}

impl DeclareTopic for pgbox::transport::rabbitmq::RabbitMq {
    async fn declare(&self, topic: &str) -> pgbox::Result<()> {
        self.declare_topic(topic).await
    }
}

#[cfg(feature = "nats")]
impl DeclareTopic for pgbox::transport::nats::Nats {
    async fn declare(&self, topic: &str) -> pgbox::Result<()> {
        self.declare_topic(topic).await
    }
}

#[cfg(feature = "kafka")]
impl DeclareTopic for pgbox::transport::kafka::Kafka {
    async fn declare(&self, topic: &str) -> pgbox::Result<()> {
        // Declared once; the readiness probe asks the cluster each time.
        self.declare_topic(topic).await?;
        self.reachable().await
    }
}

/// `/health/live` (the process runs: 200), `/health/ready` (the database answers and the
/// broker is reachable: 200, else 503 with a JSON body naming what is down), `/health` (the
/// same as ready) and `/metrics` (Prometheus text format). As Kubernetes probes expect: a
/// dead broker makes the service unready (no traffic), never dead (no restart loop).
pub fn ops_routes<S: Clone + Send + Sync + 'static>(
    pool: PgPool,
    metrics: PrometheusHandle,
    broker: BrokerReady,
) -> Router<S> {
    Router::new()
        .route("/health", get(ready))
        .route("/health/ready", get(ready))
        .route("/health/live", get(live))
        .route("/metrics", get(render_metrics))
        .with_state(OpsState {
            pool,
            metrics,
            broker,
        })
}

async fn live() -> impl IntoResponse {
    (
        StatusCode::OK,
        axum::Json(serde_json::json!({ "live": true })),
    )
}

/// How long `/health/ready` waits for the database: below the usual probe timeouts (a
/// Kubernetes probe gives up after 1 s by default, plus its period), so a database that does
/// not answer reads as down rather than as a probe that hangs for the pool's 10 s.
const READY_DATABASE_TIMEOUT: Duration = Duration::from_millis(900);

async fn ready(State(ops): State<OpsState>) -> impl IntoResponse {
    let mut down = serde_json::Map::new();
    let answered = tokio::time::timeout(
        READY_DATABASE_TIMEOUT,
        sqlx::query("SELECT 1").execute(&ops.pool),
    )
    .await;
    let database = match answered {
        Ok(Ok(_)) => None,
        Ok(Err(e)) => Some(e.to_string()),
        Err(_) => Some(format!("no answer within {READY_DATABASE_TIMEOUT:?}")),
    };
    if let Some(error) = database {
        down.insert("database".into(), serde_json::Value::String(error));
    }
    if !ops.broker.is_ready() {
        down.insert(
            "broker".into(),
            serde_json::Value::String("unreachable (retrying)".into()),
        );
    }
    if down.is_empty() {
        (
            StatusCode::OK,
            axum::Json(serde_json::json!({ "ready": true })),
        )
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            axum::Json(serde_json::json!({ "ready": false, "down": down })),
        )
    }
}

async fn render_metrics(State(ops): State<OpsState>) -> impl IntoResponse {
    (
        [("content-type", "text/plain; version=0.0.4")],
        ops.metrics.render(),
    )
}

/// Cancels `shutdown` on SIGTERM or Ctrl-C.
pub fn cancel_on_signal(shutdown: CancellationToken) {
    tokio::spawn(async move {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .expect("install the SIGTERM handler");
        tokio::select! {
            _ = term.recv() => tracing::info!("SIGTERM: shutting down"),
            _ = tokio::signal::ctrl_c() => tracing::info!("Ctrl-C: shutting down"),
            _ = shutdown.cancelled() => {}
        }
        shutdown.cancel();
    });
}

/// Serves `app` on `addr` until `shutdown`, then lets requests in flight finish.
pub async fn serve(
    addr: SocketAddr,
    app: Router,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    let listener = tokio::net::TcpListener::bind(addr).await?;
    tracing::info!(addr = %listener.local_addr()?, "listening");
    axum::serve(listener, app)
        .with_graceful_shutdown(shutdown.cancelled_owned())
        .await?;
    Ok(())
}

/// A JSON error body.
pub fn error_body(message: impl Into<String>) -> serde_json::Value {
    serde_json::json!({ "error": message.into() })
}

/// A handler error: logged, answered with 500.
pub struct AppError(anyhow::Error);

impl<E: Into<anyhow::Error>> From<E> for AppError {
    fn from(e: E) -> Self {
        AppError(e.into())
    }
}

impl IntoResponse for AppError {
    fn into_response(self) -> axum::response::Response {
        tracing::error!(error = %format!("{:#}", self.0), "request failed");
        (
            StatusCode::INTERNAL_SERVER_ERROR,
            axum::Json(error_body(format!("{:#}", self.0))),
        )
            .into_response()
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::BrokerSecurity;

    fn security(vars: &[(&str, &str)]) -> anyhow::Result<BrokerSecurity> {
        let vars: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        BrokerSecurity::from_lookup(|name| vars.get(name).cloned())
    }

    #[test]
    fn broker_settings_come_in_pairs_and_hide_their_secrets() {
        let dir = std::env::temp_dir().join(format!("pgbox-broker-env-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let password = dir.join("password");
        std::fs::write(&password, "s3cret-broker-pw\n").unwrap();
        let password = password.to_str().unwrap();

        let none = security(&[]).unwrap();
        assert!(none.ca_file.is_none() && none.credentials.is_none() && none.token.is_none());
        none.refuse(&[("X", false)]).unwrap();

        let all = security(&[
            ("PGBOX_BROKER_CA_FILE", "/ca.pem"),
            ("PGBOX_BROKER_CERT_FILE", "/client.pem"),
            ("PGBOX_BROKER_KEY_FILE", "/client.key"),
            ("PGBOX_BROKER_USER", "app"),
            ("PGBOX_BROKER_PASSWORD_FILE", password),
            ("PGBOX_KAFKA_SASL_MECHANISM", "SCRAM-SHA-512"),
        ])
        .unwrap();
        let (user, secret) = all.credentials.as_ref().unwrap();
        assert_eq!(
            (user.as_str(), secret.expose()),
            ("app", "s3cret-broker-pw")
        );
        let debug = format!("{all:?}");
        assert!(!debug.contains("s3cret"), "{debug}");
        let refused = all
            .apply_rabbitmq(pgbox::transport::rabbitmq::RabbitMq::builder(
                "amqps://mq.example",
            ))
            .unwrap_err()
            .to_string();
        assert!(refused.contains("PGBOX_KAFKA_SASL_MECHANISM"), "{refused}");
        assert!(!refused.contains("s3cret"), "{refused}");

        for (vars, expected) in [
            (
                &[("PGBOX_BROKER_CERT_FILE", "/client.pem")][..],
                "without PGBOX_BROKER_KEY_FILE",
            ),
            (
                &[("PGBOX_BROKER_PASSWORD_FILE", password)],
                "without PGBOX_BROKER_USER",
            ),
            (
                &[("PGBOX_KAFKA_SASL_MECHANISM", "GSSAPI")],
                "SCRAM-SHA-256 or SCRAM-SHA-512",
            ),
            (
                &[("PGBOX_KAFKA_SASL_MECHANISM", "PLAIN")],
                "needs PGBOX_BROKER_USER",
            ),
        ] {
            let err = security(vars).unwrap_err().to_string();
            assert!(err.contains(expected), "{vars:?}: {err}");
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
