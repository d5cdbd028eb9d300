//! The payment/points scenario as two real services, plus a driver that runs them.
//!
//! ```text
//! payment_services payments --listen 127.0.0.1:8081   # orders API, outbox, relay
//! payment_services points   --listen 127.0.0.1:8082   # consumer runner, points API
//! payment_services demo --orders 200 --kills 3        # starts both, drives them, checks
//! ```
//!
//! `payments` owns schemas `payments` (orders) and `payments_pgbox` (its outbox and the
//! inbox that makes `POST /orders/{id}/pay` idempotent by `Idempotency-Key`); `points` owns
//! `points` (ledger, accounts) and `points_pgbox` (its inbox). With `--transport postgres`
//! (the default) the messages go through the built-in queue in schema `broker`.
//! Both services serve `/health` and `/metrics` (Prometheus) and stop gracefully on SIGTERM
//! or Ctrl-C.

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

use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// The payment/points services.
#[derive(Parser, Debug)]
#[command(version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// The payments service: orders API, outbox and relay.
    Payments(service::ServiceArgs),
    /// The points service: consumer of PaymentSucceeded, points API.
    Points(service::ServiceArgs),
    /// Starts both services as child processes, drives orders through them while killing
    /// them, and checks the invariants.
    Demo(demo::DemoArgs),
}

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    service::init_tracing();
    let result = match cli.command {
        Command::Payments(args) => payments::run(args).await.map(|()| true),
        Command::Points(args) => points::run(args).await.map(|()| true),
        Command::Demo(args) => demo::run(args).await,
    };
    match result {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            tracing::error!("{e:#}");
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
