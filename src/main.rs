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
    // Negative numbers are values, so `--temperature -1` reaches the range check and gets its
    // error instead of being read as an unknown flag.
    /// Generate text from a prompt, streaming it to stdout.
    #[command(allow_negative_numbers = true)]
    Run(cli::run::RunArgs),
    /// Multi-turn chat on stdin/stdout in the model's chat template; the KV cache carries over
    /// between turns. /reset clears the conversation, /exit or EOF ends it.
    #[command(allow_negative_numbers = true)]
    Chat(cli::chat::ChatArgs),
    /// Compare the GPU decode paths on one model in one process.
    #[command(allow_negative_numbers = true)]
    Bench(cli::bench::BenchArgs),
    /// Build and summarise the megakernel's instruction streams for a model shape.
    #[command(allow_negative_numbers = true)]
    Schedule(cli::schedule::ScheduleArgs),
    /// Long greedy run on the megakernel and another GPU path, comparing every token.
    #[command(allow_negative_numbers = true)]
    Soak(cli::soak::SoakArgs),
}

fn main() {
    let cli = Cli::parse();
    let result = match &cli.command {
        Command::Run(a) => {
            megainfer::interrupt::install();
            cli::run::run(a).map(|()| {
                if megainfer::interrupt::was_interrupted() {
                    std::process::exit(130);
                }
            })
        }
        Command::Chat(a) => {
            megainfer::interrupt::install();
            cli::chat::run(a)
        }
        Command::Bench(a) => cli::bench::run(a),
        Command::Schedule(a) => cli::schedule::run(a),
        Command::Soak(a) => cli::soak::run(a),
    };
    if let Err(e) = result {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}
