//! The payment/points scenario as two real services, plus a driver that runs them.
//!
//! ```text
//! payment_services payments --listen 127.0.0.1:8081   # orders API, outbox, relay
//! payment_services points   --listen 127.0.0.1:8082   # consumer runner, points API
//! payment_services demo --orders 200 --kills 3        # starts both, drives them, checks
//! ```
//!
//! `payments` owns schemas `svc_payments` (orders) and `svc_payments_pgbox` (its outbox and
//! the inbox that makes `POST /orders/{id}/pay` idempotent by `Idempotency-Key`); `points`
//! owns `svc_points` (ledger, accounts) and `svc_points_pgbox` (its inbox). With `--transport
//! postgres` (the default) the messages go through the built-in queue in schema `broker`.
//! (The one-process simulation, `payment_points` with flags, keeps to schemas of its own:
//! `payments`, `points`, ... with other tables.) A service creates its schemas when they are
//! missing, marked as the examples' own, so the demo may reset them later; a table of its
//! schemas with another layout stops it with a message naming the example that owns it.
//! Both services need `DATABASE_URL` (the demo finds or makes a database itself), serve
//! `/health/live` (200 while the process runs), `/health/ready` (503 naming what is down,
//! the database or the broker, until both answer; `/health` is the same) and `/metrics`
//! (Prometheus), start even when their broker is down (they retry it with backoff), and stop
//! gracefully on SIGTERM or Ctrl-C. Their logs go to stderr, coloured only on a terminal and
//! never with `NO_COLOR` set.
//!
//! Payments also uses three features of pgbox where a real service would: a payment reminder
//! scheduled when an order is created (`Message::deliver_after`, `--reminder-after-secs`),
//! cancelled by the payment (`Outbox::cancel_scheduled`), consumed once through its own inbox;
//! an archive of what its relay published (`RelayBuilder::archive`, `--archive-days`), from
//! which one user's events can be replayed (points answers Duplicate); and, on a broker,
//! CloudEvents in binary mode (source `/payments`), which points reads like the native
//! envelope. The demo checks all three (see `demo.rs`).

#[path = "../support/demo_db.rs"]
mod demo_db;
#[path = "../../tests/support/local_pg.rs"]
mod local_pg;

#[allow(dead_code)]
#[path = "../../tests/support/brokers.rs"]
mod brokers;

mod demo;
mod http;
mod payments;
mod points;
mod service;

mod cli;

/// What a transport left out of this build says: how to build it in.
#[cfg(not(all(feature = "nats", feature = "kafka")))]
pub(crate) fn needs_feature(feature: &str) -> String {
    format!(
        "this example was built without the `{feature}` transport; build it in with \
         `cargo run --features {feature} --example payment_services` ({})",
        if feature == "kafka" {
            "builds librdkafka: needs make and a C/C++ compiler"
        } else {
            "needs a C compiler for ring"
        }
    )
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    if cli::run(std::env::args_os().collect()).await {
        std::process::ExitCode::SUCCESS
    } else {
        std::process::ExitCode::FAILURE
    }
}
