//! `noop-terraform`: an orchestration-only stand-in for terraform, for benchmarks. It answers
//! the calls Takosumi makes instantly and applies nothing; see `takosumi_bench::noop`.

use std::io::Write;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let cwd = std::env::current_dir().unwrap_or_else(|_| ".".into());
    let plan_bytes = std::env::var(takosumi_bench::noop::PLAN_BYTES_VAR).ok();
    let answer = takosumi_bench::noop::run(&args, &cwd, plan_bytes.as_deref());
    let _ = std::io::stdout().write_all(&answer.stdout);
    let _ = std::io::stderr().write_all(&answer.stderr);
    std::process::exit(answer.code);
}
