//! Masking: every registered secret value is replaced with [`MASK`] in what the tool
//! prints, before the text leaves the runner.
//!
//! What is registered: credential values and sensitive variable values (automatically,
//! by [`crate::ToolEnv::with_secret_env`] and [`crate::ToolEnv::with_sensitive_variables`])
//! and every value the plan marks sensitive ([`Masker::add_plan_sensitive`]).
//!
//! How it matches: raw bytes, with Aho-Corasick over every registered form at once, in
//! overlapping mode. Overlapping or touching occurrences are merged into one region and
//! replaced by one `***`, so no byte of any occurrence is shown (leftmost-first matching
//! would let the tail of a second, overlapping secret through).
//!
//! Streams: a [`MaskStream`] keeps back the last `longest - 1` bytes of what it was given
//! (`longest` = the longest registered form), because a secret may be split across two
//! reads; nothing before that tail can still become part of a match. [`MaskStream::finish`]
//! flushes the tail. Held-back bytes never end inside a UTF-8 character.
//!
//! Choices, and why:
//! - Values shorter than [`MIN_SECRET_LEN`] (4) bytes are not registered. Masking `1`,
//!   `eu` or `dev` would replace fragments of almost every line and make the log useless,
//!   while a secret of three characters protects nothing anyway. Booleans from the plan are
//!   never registered (`true`/`false` are not secrets, and masking them would mangle
//!   every line that says so).
//! - Besides the value itself, its JSON-escaped form is registered (the tool prints
//!   strings quoted and escaped: a value with `"` or `\` or a newline appears escaped),
//!   and for a multi-line value each trimmed line of at least 4 bytes (the tool prints
//!   multi-line strings as indented heredocs, line by line).
//! - A value longer than [`MAX_SECRET_LEN`] is registered by its lines only, which bounds
//!   the bytes a stream holds back.
//! - If the matcher cannot be built (it can fail only on absurd sizes), the stream fails
//!   closed: it withholds everything and says so, rather than letting text through
//!   unmasked.

use std::collections::BTreeSet;
use std::fmt;
use std::sync::{Arc, RwLock};

use aho_corasick::{AhoCorasick, MatchKind};
use serde_json::Value;
use zeroize::Zeroize;

/// What a secret is replaced with.
pub const MASK: &str = "***";
/// Values shorter than this (in bytes) are not registered (see the module docs).
pub const MIN_SECRET_LEN: usize = 4;
/// Longest form registered as a whole; longer values are registered line by line.
pub const MAX_SECRET_LEN: usize = 64 * 1024;
/// Printed once, instead of the text, when the matcher could not be built.
const WITHHELD: &str = "[takosumi: output withheld: the masker could not be built]\n";

/// The set of secret values to mask. Cheap to clone; clones share the set, so a value
/// added through one clone (say, a sensitive plan value found after `plan`) is masked by
/// every stream started afterwards. Never prints its values.
#[derive(Clone, Default)]
pub struct Masker {
    inner: Arc<RwLock<Inner>>,
}

#[derive(Default)]
struct Inner {
    secrets: BTreeSet<Vec<u8>>,
    matcher: Option<Mode>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        for mut secret in std::mem::take(&mut self.secrets) {
            secret.zeroize();
        }
    }
}

#[derive(Clone)]
enum Mode {
    Mask(Arc<Matcher>),
    Withhold,
}

struct Matcher {
    ac: AhoCorasick,
    longest: usize,
    /// The longest registered form that contains a newline (0: none). Output that ends
    /// with a newline can only have a match running past its end through such a form, so
    /// a stream holds back this much less one instead of `longest` less one: a finished
    /// line is passed on at once, which is what lets logs be read while the tool works.
    longest_multiline: usize,
}

impl fmt::Debug for Masker {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Masker")
            .field("registered_forms", &self.len())
            .finish()
    }
}

impl Masker {
    /// An empty masker (masks nothing until values are added).
    pub fn new() -> Self {
        Self::default()
    }

    /// Registers one secret value (and its escaped and per-line forms).
    pub fn add(&self, value: &str) {
        self.add_all([value]);
    }

    /// Registers several secret values at once (one rebuild of the matcher).
    pub fn add_all<'a>(&self, values: impl IntoIterator<Item = &'a str>) {
        let mut forms = Vec::new();
        for value in values {
            forms_of(value, &mut forms);
        }
        if forms.is_empty() {
            return;
        }
        let mut inner = self.inner.write().unwrap_or_else(|e| e.into_inner());
        let before = inner.secrets.len();
        for form in forms {
            let mut bytes = form.into_bytes();
            if inner.secrets.contains(&bytes) {
                bytes.zeroize();
            } else {
                inner.secrets.insert(bytes);
            }
        }
        if inner.secrets.len() != before {
            let mode = build(&inner.secrets);
            inner.matcher = Some(mode);
        }
    }

    /// Registers every value `show -json` of a saved plan marks sensitive: root variables
    /// declared `sensitive`, sensitive outputs (planned, prior and changed), and every
    /// leaf under a `before_sensitive` / `after_sensitive` / `sensitive_values` marker of
    /// resource changes, drift, planned values and prior state (modules included).
    /// Returns how many leaf values were found.
    pub fn add_plan_sensitive(&self, show_json: &Value) -> usize {
        let values = plan_sensitive_values(show_json);
        self.add_all(values.iter().map(String::as_str));
        values.len()
    }

    /// How many forms are registered.
    pub fn len(&self) -> usize {
        self.inner
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .secrets
            .len()
    }

    /// Whether nothing is registered.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// A stream filter over the values registered now.
    pub fn stream(&self) -> MaskStream {
        let mode = self
            .inner
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .matcher
            .clone();
        MaskStream {
            mode,
            buf: Vec::new(),
            emitted: 0,
            withheld_notice_sent: false,
        }
    }

    /// Masks every string inside a JSON value (keys included), in place. For what is
    /// stored on a Run from the tool's JSON (published outputs, the resource summary): a
    /// non-sensitive output built from a secret the configuration does not declare
    /// sensitive must not be published in clear.
    pub fn mask_json(&self, value: &mut Value) {
        if self.is_empty() {
            return;
        }
        match value {
            Value::String(s) => {
                let masked = self.mask(s);
                if masked != *s {
                    *s = masked;
                }
            }
            Value::Array(items) => items.iter_mut().for_each(|v| self.mask_json(v)),
            Value::Object(map) => {
                let entries = std::mem::take(map);
                for (k, mut v) in entries {
                    self.mask_json(&mut v);
                    map.insert(self.mask(&k), v);
                }
            }
            Value::Number(_) | Value::Bool(_) | Value::Null => {}
        }
    }

    /// Masks a whole text.
    pub fn mask(&self, text: &str) -> String {
        let mut stream = self.stream();
        let mut out = stream.push(text.as_bytes());
        out.push_str(&stream.finish());
        out
    }
}

/// A masking filter over one stream of output. Feed it chunks in order with
/// [`MaskStream::push`]; call [`MaskStream::finish`] at the end to flush what it held
/// back. Bytes that are not UTF-8 come out as U+FFFD.
pub struct MaskStream {
    mode: Option<Mode>,
    /// Context kept from earlier chunks plus what is not emitted yet.
    buf: Vec<u8>,
    /// How many leading bytes of `buf` were already emitted (masked or verbatim).
    emitted: usize,
    withheld_notice_sent: bool,
}

impl fmt::Debug for MaskStream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MaskStream")
            .field("held_bytes", &(self.buf.len() - self.emitted))
            .finish()
    }
}

impl Drop for MaskStream {
    fn drop(&mut self) {
        self.buf.zeroize();
    }
}

impl MaskStream {
    /// Masks what can be decided now and returns it; keeps back a tail that could still
    /// be the start of a secret.
    pub fn push(&mut self, chunk: &[u8]) -> String {
        self.buf.extend_from_slice(chunk);
        self.drain(false)
    }

    /// Masks and returns everything still held back.
    pub fn finish(mut self) -> String {
        self.drain(true)
    }

    fn drain(&mut self, last: bool) -> String {
        let matcher = match &self.mode {
            Some(Mode::Withhold) => {
                self.buf.zeroize();
                self.emitted = 0;
                if self.withheld_notice_sent {
                    return String::new();
                }
                self.withheld_notice_sent = true;
                return WITHHELD.to_owned();
            }
            Some(Mode::Mask(m)) => Some(m.clone()),
            None => None,
        };
        let longest = matcher.as_ref().map_or(1, |m| m.longest);
        let hold = match &matcher {
            Some(m) if self.buf.last() == Some(&b'\n') => m.longest_multiline.saturating_sub(1),
            _ => longest - 1,
        };
        let cut = if last {
            self.buf.len()
        } else {
            let cut = self.buf.len().saturating_sub(hold);
            char_boundary(&self.buf, cut, self.emitted)
        };
        if cut <= self.emitted {
            return String::new();
        }
        let mut out: Vec<u8> = Vec::with_capacity(cut - self.emitted);
        let mut p = self.emitted;
        if let Some(m) = &matcher {
            for (s, e) in covered_runs(&m.ac, &self.buf) {
                if e <= p {
                    continue;
                }
                if s >= cut {
                    break;
                }
                let start = s.max(p);
                out.extend_from_slice(&self.buf[p..start]);
                // A run that began before `p` was already shown as `***`: continue it.
                if s >= p {
                    out.extend_from_slice(MASK.as_bytes());
                }
                p = e.min(cut);
                if p >= cut {
                    break;
                }
            }
        }
        if p < cut {
            out.extend_from_slice(&self.buf[p..cut]);
        }
        self.emitted = cut;
        if last {
            self.buf.zeroize();
            self.emitted = 0;
        } else {
            // Keep `longest - 1` bytes of context before the unemitted part: a match that
            // reaches an unemitted byte starts no earlier than that.
            let keep_from = self.emitted.saturating_sub(longest - 1);
            if keep_from > 0 {
                self.buf[..keep_from].zeroize();
                self.buf.drain(..keep_from);
                self.emitted -= keep_from;
            }
        }
        let text = String::from_utf8_lossy(&out).into_owned();
        out.zeroize();
        text
    }
}

/// Every match (overlapping ones included), merged into sorted, disjoint, non-touching
/// byte ranges.
fn covered_runs(ac: &AhoCorasick, haystack: &[u8]) -> Vec<(usize, usize)> {
    let mut spans: Vec<(usize, usize)> = ac
        .find_overlapping_iter(haystack)
        .map(|m| (m.start(), m.end()))
        .collect();
    spans.sort_unstable();
    let mut runs: Vec<(usize, usize)> = Vec::with_capacity(spans.len());
    for (s, e) in spans {
        match runs.last_mut() {
            Some(last) if s <= last.1 => last.1 = last.1.max(e),
            _ => runs.push((s, e)),
        }
    }
    runs
}

fn is_continuation(b: u8) -> bool {
    b & 0b1100_0000 == 0b1000_0000
}

/// Moves `cut` back (never below `floor`) so it does not fall inside a UTF-8 character,
/// including one whose last bytes have not arrived yet.
fn char_boundary(buf: &[u8], cut: usize, floor: usize) -> usize {
    if cut < buf.len() {
        let mut cut = cut;
        let mut steps = 0;
        while cut > floor && steps < 3 && is_continuation(buf[cut]) {
            cut -= 1;
            steps += 1;
        }
        return cut;
    }
    let start = cut.saturating_sub(3).max(floor);
    for i in (start..cut).rev() {
        let b = buf[i];
        if !is_continuation(b) {
            let need = match b {
                0xC0..=0xDF => 2,
                0xE0..=0xEF => 3,
                0xF0..=0xF7 => 4,
                _ => 1,
            };
            return if i + need > cut { i } else { cut };
        }
    }
    cut
}

fn build(secrets: &BTreeSet<Vec<u8>>) -> Mode {
    let longest = secrets.iter().map(Vec::len).max().unwrap_or(1);
    let longest_multiline = secrets
        .iter()
        .filter(|s| s.contains(&b'\n'))
        .map(Vec::len)
        .max()
        .unwrap_or(0);
    match AhoCorasick::builder()
        .match_kind(MatchKind::Standard)
        .build(secrets.iter())
    {
        Ok(ac) => Mode::Mask(Arc::new(Matcher {
            ac,
            longest,
            longest_multiline,
        })),
        Err(e) => {
            tracing::error!(error = %e, patterns = secrets.len(), "the masker could not be built; tool output will be withheld");
            Mode::Withhold
        }
    }
}

/// The forms of one value that are registered (see the module docs).
fn forms_of(value: &str, out: &mut Vec<String>) {
    let mut push = |s: &str| {
        if (MIN_SECRET_LEN..=MAX_SECRET_LEN).contains(&s.len()) {
            out.push(s.to_owned());
        }
    };
    push(value);
    let trimmed = value.trim();
    if trimmed != value {
        push(trimmed);
    }
    if let Ok(json) = serde_json::to_string(value) {
        let escaped = &json[1..json.len() - 1];
        if escaped != value {
            push(escaped);
        }
    }
    if value.contains('\n') || value.len() > MAX_SECRET_LEN {
        for line in value.lines() {
            push(line.trim());
        }
    }
}

/// Every leaf value `show -json` marks sensitive, as text (strings as they are, numbers in
/// their JSON form; booleans and nulls are skipped). See [`Masker::add_plan_sensitive`].
pub fn plan_sensitive_values(show: &Value) -> Vec<String> {
    let mut out = Vec::new();
    // Root variables declared `sensitive = true` (the `variables` block carries no marker).
    if let (Some(decls), Some(vars)) = (
        show.pointer("/configuration/root_module/variables")
            .and_then(Value::as_object),
        show.get("variables").and_then(Value::as_object),
    ) {
        for (name, decl) in decls {
            if decl.get("sensitive").and_then(Value::as_bool) == Some(true)
                && let Some(value) = vars.get(name).and_then(|v| v.get("value"))
            {
                leaves(value, &mut out);
            }
        }
    }
    for outputs in [
        show.pointer("/planned_values/outputs"),
        show.pointer("/prior_state/values/outputs"),
    ]
    .into_iter()
    .flatten()
    .filter_map(Value::as_object)
    {
        for output in outputs.values() {
            if output.get("sensitive").and_then(Value::as_bool) == Some(true)
                && let Some(value) = output.get("value")
            {
                leaves(value, &mut out);
            }
        }
    }
    if let Some(changes) = show.get("output_changes").and_then(Value::as_object) {
        for change in changes.values() {
            marked_change(change, &mut out);
        }
    }
    for list in ["resource_changes", "resource_drift"] {
        if let Some(items) = show.get(list).and_then(Value::as_array) {
            for item in items {
                if let Some(change) = item.get("change") {
                    marked_change(change, &mut out);
                }
            }
        }
    }
    for module in [
        show.pointer("/planned_values/root_module"),
        show.pointer("/prior_state/values/root_module"),
    ]
    .into_iter()
    .flatten()
    {
        module_values(module, &mut out, 0);
    }
    out.sort();
    out.dedup();
    out
}

fn marked_change(change: &Value, out: &mut Vec<String>) {
    for (value, marks) in [("before", "before_sensitive"), ("after", "after_sensitive")] {
        if let (Some(v), Some(m)) = (change.get(value), change.get(marks)) {
            marked(v, m, out);
        }
    }
}

fn module_values(module: &Value, out: &mut Vec<String>, depth: usize) {
    if depth > 64 {
        return;
    }
    if let Some(resources) = module.get("resources").and_then(Value::as_array) {
        for r in resources {
            if let (Some(v), Some(m)) = (r.get("values"), r.get("sensitive_values")) {
                marked(v, m, out);
            }
        }
    }
    if let Some(children) = module.get("child_modules").and_then(Value::as_array) {
        for child in children {
            module_values(child, out, depth + 1);
        }
    }
}

/// Walks `value` and its sensitivity structure `marks` side by side: `true` marks the
/// whole subtree, an object or array marks its members.
fn marked(value: &Value, marks: &Value, out: &mut Vec<String>) {
    match marks {
        Value::Bool(true) => leaves(value, out),
        Value::Object(m) => {
            if let Value::Object(v) = value {
                for (k, mk) in m {
                    if let Some(x) = v.get(k) {
                        marked(x, mk, out);
                    }
                }
            }
        }
        Value::Array(m) => {
            if let Value::Array(v) = value {
                for (x, mk) in v.iter().zip(m) {
                    marked(x, mk, out);
                }
            }
        }
        _ => {}
    }
}

fn leaves(value: &Value, out: &mut Vec<String>) {
    match value {
        Value::String(s) => out.push(s.clone()),
        Value::Number(n) => out.push(n.to_string()),
        Value::Array(items) => items.iter().for_each(|v| leaves(v, out)),
        Value::Object(map) => map.values().for_each(|v| leaves(v, out)),
        Value::Bool(_) | Value::Null => {}
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn masker(values: &[&str]) -> Masker {
        let m = Masker::new();
        m.add_all(values.iter().copied());
        m
    }

    /// Feeds `text` in pieces cut at `cuts` and returns the whole masked output.
    fn streamed(m: &Masker, text: &str, cuts: &[usize]) -> String {
        let bytes = text.as_bytes();
        let mut s = m.stream();
        let mut out = String::new();
        let mut at = 0;
        for &c in cuts {
            out.push_str(&s.push(&bytes[at..c]));
            at = c;
        }
        out.push_str(&s.push(&bytes[at..]));
        out.push_str(&s.finish());
        out
    }

    #[test]
    fn whole_text_is_masked() {
        let m = masker(&["hunter22", "s3cr3t-token"]);
        assert_eq!(
            m.mask("password=hunter22 token=s3cr3t-token end"),
            "password=*** token=*** end"
        );
        assert_eq!(m.mask("nothing here"), "nothing here");
        assert_eq!(m.mask("hunter22hunter22"), "***");
        assert_eq!(m.mask(""), "");
    }

    #[test]
    fn a_secret_split_across_reads_is_masked_at_every_split_point() {
        let secret = "canary-5f3a9b";
        let m = masker(&[secret]);
        let text = format!("before {secret} middle {secret}\nafter\n");
        let want = "before *** middle ***\nafter\n";
        for i in 0..=text.len() {
            assert_eq!(streamed(&m, &text, &[i]), want, "cut at {i}");
            for j in i..=text.len() {
                assert_eq!(streamed(&m, &text, &[i, j]), want, "cuts at {i}, {j}");
            }
        }
        // One byte at a time.
        let every: Vec<usize> = (1..text.len()).collect();
        assert_eq!(streamed(&m, &text, &every), want);
    }

    #[test]
    fn nothing_is_emitted_that_could_still_be_a_secret() {
        let m = masker(&["abcdefgh"]);
        let mut s = m.stream();
        // "abcd" could be the start of the secret: held back.
        assert_eq!(s.push(b"xyz abcd"), "x");
        assert_eq!(s.push(b"efgh tail"), "yz ***");
        assert_eq!(s.finish(), " tail");
    }

    #[test]
    fn overlapping_and_nested_secrets_leave_no_byte_visible() {
        let m = masker(&["abcdef", "defghi", "cdefgh", "efgh"]);
        assert_eq!(m.mask("[abcdefghi]"), "[***]");
        assert_eq!(m.mask("[efgh]"), "[***]");
        assert_eq!(m.mask("[abcdef][defghi]"), "[***][***]");
        // Touching occurrences are one region.
        assert_eq!(m.mask("abcdefdefghi"), "***");
        // The same in a stream, split everywhere.
        let text = "x abcdefghi y defghi z";
        for i in 0..=text.len() {
            assert_eq!(streamed(&m, text, &[i]), "x *** y *** z", "cut at {i}");
        }
        // A secret containing another: the longer one wins, nothing leaks.
        let m = masker(&["token", "token-extended"]);
        assert_eq!(m.mask("a token-extended b token c"), "a *** b *** c");
    }

    #[test]
    fn utf8_secrets_and_text_survive_any_split() {
        let secret = "pässwörd-日本語-🔑";
        let m = masker(&[secret]);
        let text = format!("ключ: {secret} — ok ✓\n");
        let want = "ключ: *** — ok ✓\n";
        for i in 0..=text.len() {
            assert_eq!(streamed(&m, &text, &[i]), want, "cut at {i}");
        }
        let every: Vec<usize> = (1..text.len()).collect();
        assert_eq!(streamed(&m, &text, &every), want);
        // No secrets at all: multi-byte characters split across reads stay intact.
        let empty = Masker::new();
        let plain = "日本語 ✓ 🔑\n";
        for i in 0..=plain.len() {
            assert_eq!(streamed(&empty, plain, &[i]), plain, "cut at {i}");
        }
        // Invalid bytes become U+FFFD, never a panic.
        let mut s = m.stream();
        let mut out = s.push(b"\xff\xfe ok ");
        out.push_str(&s.finish());
        assert_eq!(out, "\u{fffd}\u{fffd} ok ");
    }

    #[test]
    fn short_values_booleans_and_escaped_forms() {
        let m = masker(&["abc", "", "eu"]);
        assert!(m.is_empty(), "values under 4 bytes are not registered");
        assert_eq!(m.mask("abc eu"), "abc eu");

        let m = masker(&["quote\"back\\slash"]);
        assert_eq!(
            m.mask(r#"value = "quote\"back\\slash""#),
            r#"value = "***""#
        );
        assert_eq!(m.mask("raw quote\"back\\slash"), "raw ***");

        let pem = "-----BEGIN KEY-----\nAAAAB3NzaC1yc2E\nZZZZ9876\n-----END KEY-----\n";
        let m = masker(&[pem]);
        assert_eq!(m.mask(pem), "***");
        assert_eq!(
            m.mask("      AAAAB3NzaC1yc2E\n      ZZZZ9876\n"),
            "      ***\n      ***\n"
        );
        assert!(!format!("{m:?}").contains("AAAA"));
    }

    #[test]
    fn json_values_are_masked_in_place() {
        let m = masker(&["canary-json-1"]);
        let mut v = json!({
            "plain": "ok",
            "out": "prefix-canary-json-1",
            "list": [1, true, null, "canary-json-1"],
            "canary-json-1": {"nested": "canary-json-1"}
        });
        m.mask_json(&mut v);
        assert_eq!(
            v,
            json!({
                "plain": "ok",
                "out": "prefix-***",
                "list": [1, true, null, "***"],
                "***": {"nested": "***"}
            })
        );
    }

    #[test]
    fn values_added_later_reach_later_streams_through_clones() {
        let m = Masker::new();
        let clone = m.clone();
        let mut early = m.stream();
        clone.add("late-secret");
        assert_eq!(m.mask("a late-secret"), "a ***");
        let mut out = early.push(b"a late-secret");
        out.push_str(&early.finish());
        assert_eq!(
            out, "a late-secret",
            "a stream masks what was known at its start"
        );
    }

    /// `show -json` of terraform 1.0.3 for a configuration with a sensitive variable used
    /// in a trigger and in a sensitive output, a plain variable, a sensitive number and a
    /// module resource, with prior state.
    fn show_json() -> Value {
        json!({
            "format_version": "0.2",
            "variables": {
                "secret": {"value": "canary-sens-123"},
                "plain": {"value": "plainval"},
                "list": {"value": ["a-list-item", "b"]},
                "creds": {"value": {"user": "admin-user", "pass": "p4ss-w0rd"}}
            },
            "planned_values": {
                "outputs": {
                    "hash": {"sensitive": false, "value": "989b8cbc"},
                    "secret_out": {"sensitive": true, "value": "out-canary-sens-123"},
                    "flag": {"sensitive": true, "value": true}
                },
                "root_module": {
                    "resources": [{
                        "address": "null_resource.r",
                        "values": {"triggers": {"h": "hash-of-secret", "p": "plainval", "s": "canary-sens-123"}},
                        "sensitive_values": {"triggers": {"h": true, "s": true}}
                    }],
                    "child_modules": [{
                        "resources": [{
                            "values": {"port": 54321, "tags": ["tag-one", "tag-two"], "name": "visible"},
                            "sensitive_values": {"port": true, "tags": [false, true]}
                        }]
                    }]
                }
            },
            "resource_changes": [{
                "address": "null_resource.r",
                "change": {
                    "actions": ["update"],
                    "before": {"triggers": {"s": "old-secret-value", "p": "plainval"}},
                    "after": {"triggers": {"s": "canary-sens-123", "p": "plainval"}},
                    "before_sensitive": {"triggers": {"s": true}},
                    "after_sensitive": {"triggers": {"s": true}}
                }
            }],
            "resource_drift": [{
                "change": {"before": "drifted-secret", "before_sensitive": true, "after": null, "after_sensitive": false}
            }],
            "output_changes": {
                "secret_out": {"before": "prior-out-secret", "after": "out-canary-sens-123", "before_sensitive": true, "after_sensitive": true},
                "hash": {"before": null, "after": "989b8cbc", "before_sensitive": false, "after_sensitive": false}
            },
            "prior_state": {"values": {
                "outputs": {"old_out": {"sensitive": true, "value": "prior-state-out"}},
                "root_module": {"resources": [{"values": {"id": "1234", "key": "prior-resource-secret"}, "sensitive_values": {"key": true}}]}
            }},
            "configuration": {"root_module": {"variables": {
                "secret": {"sensitive": true}, "plain": {}, "list": {}, "creds": {"sensitive": true}
            }}}
        })
    }

    #[test]
    fn plan_sensitive_markers_are_followed() {
        let found = plan_sensitive_values(&show_json());
        for want in [
            "canary-sens-123",
            "out-canary-sens-123",
            "hash-of-secret",
            "54321",
            "tag-two",
            "old-secret-value",
            "drifted-secret",
            "prior-out-secret",
            "prior-state-out",
            "prior-resource-secret",
            "admin-user",
            "p4ss-w0rd",
        ] {
            assert!(found.iter().any(|f| f == want), "{want} missing: {found:?}");
        }
        for not in [
            "plainval",
            "989b8cbc",
            "visible",
            "tag-one",
            "a-list-item",
            "1234",
            "true",
        ] {
            assert!(!found.iter().any(|f| f == not), "{not} is not sensitive");
        }
        let m = Masker::new();
        assert!(m.add_plan_sensitive(&show_json()) >= 12);
        assert_eq!(
            m.mask("s = canary-sens-123, p = plainval"),
            "s = ***, p = plainval"
        );
        // A provider-free plan without resource_changes has nothing to add.
        assert_eq!(
            Masker::new().add_plan_sensitive(&json!({"format_version": "0.2"})),
            0
        );
    }
}
