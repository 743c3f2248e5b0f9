//! The `dpuflow` command line.

use clap::{Parser, Subcommand, ValueEnum};
use dpuflow::lang::{self, Severity};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

#[derive(Parser, Debug)]
#[command(name = "dpuflow", version = dpuflow::VERSION, about = "Packet pipelines for NVIDIA BlueField DPUs", long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Check pipeline files and report errors and warnings.
    ///
    /// Exits 0 when every file is valid (warnings allowed), 1 when any has an error,
    /// 2 when a file cannot be read.
    #[command(
        after_help = "Example:\n  dpuflow check pipelines/*.pipe\n  dpuflow check --format json pipelines/stateful-firewall.pipe"
    )]
    Check {
        /// Pipeline files.
        #[arg(required = true)]
        files: Vec<PathBuf>,
        /// How to print diagnostics: rustc-style text on stderr, or JSON lines on stdout.
        #[arg(long, value_enum, default_value_t = Format::Human)]
        format: Format,
    },
    /// Print a pipeline's ports, pipes, rules and their edges as a Graphviz DOT graph.
    #[command(
        after_help = "Example:\n  dpuflow graph pipelines/vxlan-gateway.pipe | dot -Tsvg > vxlan-gateway.svg"
    )]
    Graph {
        /// Pipeline file.
        file: PathBuf,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Format {
    Human,
    Json,
}

/// Exit statuses shared by the subcommands.
const EXIT_INVALID: u8 = 1;
const EXIT_USAGE: u8 = 2;

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Check { files, format } => check(&files, format),
        Command::Graph { file } => graph(&file),
    }
}

fn check(files: &[PathBuf], format: Format) -> ExitCode {
    let mut status = ExitCode::SUCCESS;
    let mut unreadable = false;
    for path in files {
        let checked = match lang::check_file(path) {
            Ok(c) => c,
            Err(e) => {
                eprintln!("{}: error: cannot read file: {e}", path.display());
                unreadable = true;
                continue;
            }
        };
        match format {
            Format::Human => {
                eprint!("{}", checked.render());
                let warnings = checked
                    .diagnostics
                    .iter()
                    .filter(|d| d.severity == Severity::Warning)
                    .count();
                let errors = checked.diagnostics.len() - warnings;
                match &checked.program {
                    Some(p) => println!(
                        "{}: ok: pipeline {}, {} ports, {} pipes, {} rules and entries, {warnings} warnings",
                        path.display(),
                        p.name,
                        p.ports.len(),
                        p.pipes.len(),
                        p.entry_count()
                    ),
                    None => eprintln!("{}: {errors} errors, {warnings} warnings", path.display()),
                }
            }
            Format::Json => {
                for d in &checked.diagnostics {
                    match serde_json::to_string(&checked.sources.json(d)) {
                        Ok(line) => println!("{line}"),
                        Err(e) => eprintln!("error: cannot encode a diagnostic: {e}"),
                    }
                }
            }
        }
        if checked.has_errors() {
            status = ExitCode::from(EXIT_INVALID);
        }
    }
    if unreadable {
        return ExitCode::from(EXIT_USAGE);
    }
    status
}

fn graph(path: &Path) -> ExitCode {
    let checked = match lang::check_file(path) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("{}: error: cannot read file: {e}", path.display());
            return ExitCode::from(EXIT_USAGE);
        }
    };
    eprint!("{}", checked.render());
    match &checked.program {
        Some(p) => {
            print!("{}", dpuflow::graph::to_dot(p));
            ExitCode::SUCCESS
        }
        None => ExitCode::from(EXIT_INVALID),
    }
}
