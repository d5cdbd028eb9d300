//! The command line of the services: `payments`, `points` and `demo`. Shared by the
//! `payment_services` example and by `payment_points`, which runs the demo when started
//! without arguments.

use std::ffi::OsString;

use clap::{Parser, Subcommand};

use crate::{demo, payments, points, service};

/// The payment/points services.
// No `Debug` here: the services' arguments hold URLs with passwords.
#[derive(Parser)]
#[command(version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// The payments service: orders API, outbox and relay.
    Payments(service::ServiceArgs),
    /// The points service: consumer of PaymentSucceeded, points API.
    Points(service::ServiceArgs),
    /// Starts both services as child processes, drives orders through them while killing
    /// them, and checks the invariants.
    Demo(demo::DemoArgs),
}

/// Runs the subcommand in `args` (the program name first); whether it succeeded.
pub(crate) async fn run(args: Vec<OsString>) -> bool {
    let cli = Cli::parse_from(args);
    service::init_tracing();
    let result = match cli.command {
        Command::Payments(args) => payments::run(args).await.map(|()| true),
        Command::Points(args) => points::run(args).await.map(|()| true),
        Command::Demo(args) => demo::run(args).await,
    };
    match result {
        Ok(ok) => ok,
        Err(e) => {
            tracing::error!("{e:#}");
            eprintln!("error: {e:#}");
            false
        }
    }
}
