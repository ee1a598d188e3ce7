//! The in-sandbox launcher: runs one step's tool commands inside a single sandbox (see
//! `takosumi_runner::launch`). Started by the runner, never by hand.

fn main() {
    std::process::exit(takosumi_runner::launch::serve());
}
