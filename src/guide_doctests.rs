//! The guide's and the README's Rust snippets, compiled and run by `cargo test --doc`.
//!
//! Each item below carries one chapter as its documentation, only when rustdoc collects
//! doctests (`cfg(doctest)`): nothing here is part of the library. A chapter whose snippets
//! need an optional feature is included only with that feature, so `cargo test --doc` without
//! it skips exactly those chapters and no others.

/// `README.md`
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct Readme;

/// Defines one doctest-only item per chapter of `guide/src/`.
macro_rules! chapters {
    ($($(#[$gate:meta])* $name:ident => $file:literal,)*) => {
        $(
            #[cfg(doctest)]
            $(#[$gate])*
            #[doc = include_str!(concat!("../guide/src/", $file))]
            struct $name;
        )*
    };
}

chapters! {
    Introduction => "introduction.md",
    GettingStarted => "getting-started.md",
    Concepts => "concepts.md",
    Choosing => "choosing.md",
    #[cfg(feature = "axum")]
    IdempotencyKey => "idempotency-key.md",
    Leases => "leases.md",
    Outbox => "outbox.md",
    WalOutbox => "wal-outbox.md",
    Scheduled => "scheduled.md",
    Archive => "archive.md",
    Fanout => "fanout.md",
    Consumer => "consumer.md",
    Tenants => "tenants.md",
    Transports => "transports.md",
    #[cfg(feature = "rabbitmq")]
    RabbitMq => "rabbitmq.md",
    #[cfg(feature = "nats")]
    Nats => "nats.md",
    #[cfg(feature = "kafka")]
    Kafka => "kafka.md",
    #[cfg(feature = "rabbitmq")]
    CloudEvents => "cloudevents.md",
    // The test kit's chapter may show `pgbox::testing`.
    #[cfg(feature = "testing")]
    Testing => "testing.md",
    Guarantees => "guarantees.md",
    Costs => "costs.md",
    BadInput => "bad-input.md",
    Configuration => "configuration.md",
    Cli => "cli.md",
    Operations => "operations.md",
    PartitionedInbox => "partitioned-inbox.md",
    Metrics => "metrics.md",
    #[cfg(feature = "opentelemetry")]
    OpenTelemetry => "opentelemetry.md",
    Dashboards => "dashboards.md",
    Production => "production.md",
    Pooler => "pooler.md",
    Failover => "failover.md",
    LeastPrivilege => "least-privilege.md",
    // Snippets for every broker: CI runs them with --all-features.
    #[cfg(all(feature = "rabbitmq", feature = "nats", feature = "kafka"))]
    ManagedServices => "managed-services.md",
    Contributing => "contributing.md",
}
