//! Live output: a tool step's masked output handed to a [`LogTap`] as it arrives, so a
//! run's logs can be read while the tool still works.
//!
//! What is handed over is always an exact prefix of the step's final
//! [`crate::ToolOutput::output`], already masked by the run's stream masker; the caller
//! stores the rest (masked again with everything it learned since) when the step ends.
//!
//! `plan` is special: the values the plan itself marks sensitive are only known once
//! `show -json` has read the saved plan, after the tool ended, and terraform prints some
//! of them in clear (an attribute built from a value only an output marks sensitive). So
//! only the plan's leading progress lines (`<address>: Refreshing state... [id=…]`,
//! `Reading...`, `Read complete after 2s`, `Still reading... [10s elapsed]`, blank lines)
//! are handed over live; from the first other line on (the diff, a note about objects
//! changed outside, a diagnostic) nothing more is, and the step's caller stores that part
//! once the plan's sensitive values are in the masker. A progress line names an address
//! and the tool's id attribute only.

use std::sync::Arc;

use crate::Runner;

/// Receives a tool step's masked output while the step runs.
pub trait LogTap: Send + Sync + std::fmt::Debug {
    /// `step` (`get`, `init`, `plan`, `apply`) started: what follows is a new output.
    fn start(&self, step: &str);
    /// The next piece of `step`'s masked output. Must not block: it is called while the
    /// output is being read.
    fn chunk(&self, step: &str, text: &str);
}

impl Runner {
    /// This runner, handing the masked output of its logged tool steps (`get`, `init`,
    /// `plan`, `apply`) to `tap` as it arrives (see the module docs for `plan`).
    pub fn with_log_tap(&self, tap: Arc<dyn LogTap>) -> Runner {
        let mut runner = self.clone();
        runner.tap = Some(tap);
        runner
    }

    /// The tap state for one tool step, if its output is logged and a tap is set.
    pub(crate) fn tap_for(&self, step: &'static str) -> Option<TapState> {
        let tap = self.tap.clone()?;
        let gate = match step {
            "plan" => Gate::ProgressOnly,
            "get" | "init" | "apply" => Gate::All,
            _ => return None,
        };
        tap.start(step);
        Some(TapState {
            tap,
            step,
            gate,
            pending: String::new(),
            closed: false,
        })
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Gate {
    /// Everything, as it arrives.
    All,
    /// Whole lines from the start, while they are progress lines.
    ProgressOnly,
}

/// One tool step's tap: fed with exactly the masked text appended to the step's output.
pub(crate) struct TapState {
    tap: Arc<dyn LogTap>,
    step: &'static str,
    gate: Gate,
    /// A progress-only step's text not yet ending in a newline.
    pending: String,
    /// A progress-only step saw a line that is not progress: nothing more goes live.
    closed: bool,
}

impl TapState {
    /// `text` was just appended to the step's output.
    pub(crate) fn feed(&mut self, text: &str) {
        if text.is_empty() || self.closed {
            return;
        }
        if self.gate == Gate::All {
            self.tap.chunk(self.step, text);
            return;
        }
        self.pending.push_str(text);
        let mut ready = 0;
        while let Some(nl) = self.pending[ready..].find('\n') {
            let end = ready + nl + 1;
            if !is_progress_line(&self.pending[ready..end]) {
                self.closed = true;
                break;
            }
            ready = end;
        }
        if ready > 0 {
            self.tap.chunk(self.step, &self.pending[..ready]);
        }
        if self.closed {
            self.pending = String::new();
        } else {
            self.pending.drain(..ready);
        }
    }
}

/// Whether a line of `plan -no-color` output only reports progress: blank, or
/// `<address>: <progress>` where the address has no spaces outside `["…"]` keys.
pub(crate) fn is_progress_line(line: &str) -> bool {
    let line = line.trim_end_matches(['\n', '\r']);
    if line.trim().is_empty() {
        return true;
    }
    let Some((address, rest)) = line.split_once(": ") else {
        return false;
    };
    if address.is_empty() || address.starts_with(' ') || !plausible_address(address) {
        return false;
    }
    let without_id = |s: &str| -> Option<bool> {
        if s.is_empty() {
            return Some(true);
        }
        let id = s.strip_prefix(" [id=")?.strip_suffix(']')?;
        Some(!id.contains(']'))
    };
    if let Some(tail) = rest.strip_prefix("Refreshing state...") {
        return without_id(tail) == Some(true);
    }
    if let Some(tail) = rest.strip_prefix("Reading...") {
        return without_id(tail) == Some(true);
    }
    if let Some(tail) = rest.strip_prefix("Read complete after ") {
        let (elapsed, id) = tail.split_once(' ').map_or((tail, ""), |(e, i)| (e, i));
        let id = if id.is_empty() {
            String::new()
        } else {
            format!(" {id}")
        };
        return is_elapsed(elapsed) && without_id(&id) == Some(true);
    }
    if let Some(tail) = rest.strip_prefix("Still reading... [") {
        return tail.strip_suffix(" elapsed]").is_some_and(is_elapsed);
    }
    false
}

/// `2s`, `1m30s`: digits and unit letters only.
fn is_elapsed(s: &str) -> bool {
    !s.is_empty()
        && s.chars().next().is_some_and(|c| c.is_ascii_digit())
        && s.chars()
            .all(|c| c.is_ascii_digit() || matches!(c, 'h' | 'm' | 's'))
}

/// A resource address: identifiers, dots, `[0]` and `["key"]` (whose key may hold spaces).
fn plausible_address(address: &str) -> bool {
    let mut in_key = false;
    for c in address.chars() {
        match c {
            '"' => in_key = !in_key,
            _ if in_key => {}
            c if c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.' | '[' | ']') => {}
            _ => return false,
        }
    }
    !in_key
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use super::*;
    use crate::Masker;

    #[derive(Debug, Default)]
    struct Recorder(Mutex<Vec<(String, String)>>);

    impl LogTap for Recorder {
        fn start(&self, step: &str) {
            self.0
                .lock()
                .unwrap()
                .push((step.to_owned(), "<start>".into()));
        }
        fn chunk(&self, step: &str, text: &str) {
            self.0
                .lock()
                .unwrap()
                .push((step.to_owned(), text.to_owned()));
        }
    }

    fn tapped(step: &'static str) -> (Arc<Recorder>, TapState) {
        let rec = Arc::new(Recorder::default());
        let runner =
            Runner::new(crate::RunnerConfig::new("/bin/false", "/tmp")).with_log_tap(rec.clone());
        let state = runner.tap_for(step).expect("a logged step");
        (rec, state)
    }

    fn text_of(rec: &Recorder) -> String {
        rec.0
            .lock()
            .unwrap()
            .iter()
            .filter(|(_, t)| t != "<start>")
            .map(|(_, t)| t.as_str())
            .collect()
    }

    /// Progress lines are recognised; anything that could carry a value is not.
    #[test]
    fn progress_lines() {
        for ok in [
            "\n",
            "null_resource.slow: Refreshing state... [id=4792498392]\n",
            "data.terraform_remote_state.input: Reading...\n",
            "data.terraform_remote_state.input: Read complete after 0s\n",
            "data.x.y: Read complete after 1m2s [id=abc]\n",
            "module.a.null_resource.b[\"a key\"]: Still reading... [10s elapsed]\n",
        ] {
            assert!(is_progress_line(ok), "{ok:?}");
        }
        for no in [
            "Terraform used the selected providers to generate the following execution\n",
            "  # null_resource.x must be replaced\n",
            "      ~ \"derived\" = \"canary\" -> \"other\"\n",
            "Note: Objects have changed outside of Terraform\n",
            "│ Error: Invalid value\n",
            "null_resource.x: Refreshing state... [id=a] extra\n",
            "a b: Reading...\n",
        ] {
            assert!(!is_progress_line(no), "{no:?}");
        }
    }

    /// A plan hands over its leading progress lines and nothing from the first other line
    /// on, even progress lines after it; what it hands over is a prefix of its output.
    #[test]
    fn plan_stops_at_the_first_line_that_is_not_progress() {
        let (rec, mut tap) = tapped("plan");
        let output = [
            "null_resource.a: Refreshing ",
            "state... [id=1]\n",
            "\n",
            "Terraform will perform the following actions:\n",
            "null_resource.b: Refreshing state... [id=2]\n",
        ];
        for piece in output {
            tap.feed(piece);
        }
        let live = text_of(&rec);
        assert_eq!(live, "null_resource.a: Refreshing state... [id=1]\n\n");
        assert!(output.concat().starts_with(&live));
    }

    /// An apply hands over everything; a secret split across two reads reaches the tap
    /// masked, because the tap gets the stream masker's output.
    #[test]
    fn apply_streams_masked_text_across_reads() {
        let masker = Masker::new();
        masker.add("canary-split-secret");
        let mut stream = masker.stream();
        let (rec, mut tap) = tapped("apply");
        let mut output = String::new();
        for read in [&b"x (local-exec): k=canary-sp"[..], b"lit-secret done\n"] {
            let text = stream.push(read);
            output.push_str(&text);
            tap.feed(&text);
        }
        let rest = stream.finish();
        output.push_str(&rest);
        tap.feed(&rest);
        let live = text_of(&rec);
        assert!(!live.contains("canary-split-secret"), "{live}");
        assert!(!live.contains("canary-sp"), "{live}");
        assert!(live.contains(crate::MASK), "{live}");
        assert_eq!(live, output);
        assert_eq!(rec.0.lock().unwrap()[0], ("apply".into(), "<start>".into()));
    }

    /// Steps whose output is not logged (`show`, `version`, `output`) are never tapped.
    #[test]
    fn data_steps_are_not_tapped() {
        let runner = Runner::new(crate::RunnerConfig::new("/bin/false", "/tmp"))
            .with_log_tap(Arc::new(Recorder::default()));
        for step in ["show", "version", "output"] {
            assert!(runner.tap_for(step).is_none());
        }
    }
}

#[cfg(test)]
mod hold_back {
    use crate::{MASK, Masker};

    /// A finished line goes out at once however long the registered secrets are, so a
    /// tool's last line is readable while it keeps working; a secret split across two
    /// reads is still masked, and one with a newline in it is held back across lines.
    #[test]
    fn finished_lines_are_not_held_back() {
        let masker = Masker::new();
        masker.add(&"long-secret-".repeat(20));
        masker.add("short-secret");
        let mut stream = masker.stream();
        assert_eq!(stream.push(b"working...\n"), "working...\n");
        let a = stream.push(b"k=short-se");
        let b = stream.push(b"cret end\n");
        assert_eq!(format!("{a}{b}"), format!("k={MASK} end\n"));

        let masker = Masker::new();
        masker.add("first-line-of-it\nsecond-line-of-it");
        let mut stream = masker.stream();
        let a = stream.push(b"pem: first-line-of-it\n");
        let b = stream.push(b"second-line-of-it\n");
        let all = format!("{a}{b}{}", stream.finish());
        assert!(!all.contains("first-line-of-it"), "{all}");
        assert!(all.contains(MASK), "{all}");
    }
}
