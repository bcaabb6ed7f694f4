use clap::{Parser, Subcommand};

use megainfer::cli;

/// Batch-1 Llama-family inference; the whole forward pass as one persistent GPU kernel.
#[derive(Parser)]
#[command(name = "megainfer", version)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Generate text from a prompt, streaming it to stdout.
    Run(cli::run::RunArgs),
    /// Compare the GPU decode paths on one model in one process.
    Bench(cli::bench::BenchArgs),
    /// Build and summarise the megakernel's instruction streams for a model shape.
    Schedule(cli::schedule::ScheduleArgs),
}

fn main() {
    let cli = Cli::parse();
    let result = match &cli.command {
        Command::Run(a) => cli::run::run(a),
        Command::Bench(a) => cli::bench::run(a),
        Command::Schedule(a) => cli::schedule::run(a),
    };
    if let Err(e) = result {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}
