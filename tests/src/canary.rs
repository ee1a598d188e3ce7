//! The canary finder every secrecy test uses: a value is "found" in a haystack when it is
//! there raw, base64- or base64url-encoded at any of the three byte alignments (the stable
//! middle of the encoding, so a canary embedded in a longer blob is found wherever it
//! sits), hex-encoded (lower or upper case, as Postgres prints `bytea`), URL-encoded
//! (any mix of percent-escapes, form encoding's `+` for a space) or JSON-escaped (`\"`,
//! `\\`, `\u0026` as Go's encoder writes `&`, …). URL and JSON are found by decoding the
//! haystack, so every partial escaping is caught, not only the one a given encoder makes.

use std::collections::BTreeMap;

use base64::Engine as _;
use base64::engine::general_purpose::{STANDARD_NO_PAD, URL_SAFE_NO_PAD};

/// What a canary looks like once encoded: `(encoding, bytes)`, the raw value first. The
/// base64 patterns are the part of the encoding that depends on the canary alone, for
/// each of the three alignments it can have in a longer encoded blob.
pub fn patterns(value: &[u8]) -> Vec<(&'static str, Vec<u8>)> {
    const B64: [&str; 3] = [
        "base64 (offset 0)",
        "base64 (offset 1)",
        "base64 (offset 2)",
    ];
    const B64URL: [&str; 3] = [
        "base64url (offset 0)",
        "base64url (offset 1)",
        "base64url (offset 2)",
    ];
    let mut out: Vec<(&'static str, Vec<u8>)> = vec![("raw", value.to_vec())];
    for offset in 0..3 {
        // After `offset` bytes of anything, the canary's first byte that starts a 3-byte
        // group is its `(3 - offset) % 3`th; the whole groups from there encode the same
        // whatever came before or comes after.
        let start = (3 - offset) % 3;
        if value.len() < start + 3 {
            continue;
        }
        let whole = (value.len() - start) / 3 * 3;
        let middle = &value[start..start + whole];
        let (b64, url) = (
            STANDARD_NO_PAD.encode(middle),
            URL_SAFE_NO_PAD.encode(middle),
        );
        // the same text when the canary's encoding has no `+` or `/`: one check
        if url != b64 {
            out.push((B64URL[offset], url.into_bytes()));
        }
        out.push((B64[offset], b64.into_bytes()));
    }
    out.push(("hex", hex::encode(value).into_bytes()));
    out.push(("HEX", hex::encode_upper(value).into_bytes()));
    out
}

/// The haystack as each decoder sees it: `(how, text)`, the haystack itself first.
fn decodings(haystack: &[u8]) -> Vec<(&'static str, Vec<u8>)> {
    let mut out = vec![("", haystack.to_vec())];
    if haystack.contains(&b'%') {
        out.push(("URL-encoded, ", percent_decode(haystack, false)));
    }
    if haystack.contains(&b'%') || haystack.contains(&b'+') {
        out.push(("form-encoded, ", percent_decode(haystack, true)));
    }
    if haystack.contains(&b'\\') {
        out.push(("JSON-escaped, ", json_unescape(haystack)));
    }
    out
}

fn hex_val(b: u8) -> Option<u8> {
    match b {
        b'0'..=b'9' => Some(b - b'0'),
        b'a'..=b'f' => Some(b - b'a' + 10),
        b'A'..=b'F' => Some(b - b'A' + 10),
        _ => None,
    }
}

/// Every `%XX` decoded (and `+` as a space when `form`); anything else kept as it is.
fn percent_decode(s: &[u8], form: bool) -> Vec<u8> {
    let mut out = Vec::with_capacity(s.len());
    let mut i = 0;
    while i < s.len() {
        match s[i] {
            b'%' if i + 2 < s.len() => match (hex_val(s[i + 1]), hex_val(s[i + 2])) {
                (Some(h), Some(l)) => {
                    out.push(h << 4 | l);
                    i += 3;
                    continue;
                }
                _ => out.push(b'%'),
            },
            b'+' if form => out.push(b' '),
            b => out.push(b),
        }
        i += 1;
    }
    out
}

/// Every JSON string escape decoded wherever it is (`\uXXXX`, surrogate pairs too);
/// anything else kept as it is.
fn json_unescape(s: &[u8]) -> Vec<u8> {
    let unit = |at: usize| -> Option<u32> {
        let h = s.get(at..at + 4)?;
        h.iter()
            .try_fold(0u32, |acc, &b| Some(acc << 4 | u32::from(hex_val(b)?)))
    };
    let mut out = Vec::with_capacity(s.len());
    let mut i = 0;
    while i < s.len() {
        if s[i] == b'\\' && i + 1 < s.len() {
            let simple = match s[i + 1] {
                b'"' => Some(b'"'),
                b'\\' => Some(b'\\'),
                b'/' => Some(b'/'),
                b'n' => Some(b'\n'),
                b't' => Some(b'\t'),
                b'r' => Some(b'\r'),
                b'b' => Some(8),
                b'f' => Some(12),
                _ => None,
            };
            if let Some(b) = simple {
                out.push(b);
                i += 2;
                continue;
            }
            if s[i + 1] == b'u'
                && let Some(u) = unit(i + 2)
            {
                let (c, used) = if (0xD800..0xDC00).contains(&u)
                    && s.get(i + 6..i + 8) == Some(b"\\u")
                    && let Some(lo) = unit(i + 8).filter(|lo| (0xDC00..0xE000).contains(lo))
                {
                    (
                        char::from_u32(0x10000 + ((u - 0xD800) << 10) + (lo - 0xDC00)),
                        12,
                    )
                } else {
                    (char::from_u32(u), 6)
                };
                if let Some(c) = c {
                    let mut buf = [0u8; 4];
                    out.extend_from_slice(c.encode_utf8(&mut buf).as_bytes());
                    i += used;
                    continue;
                }
            }
        }
        out.push(s[i]);
        i += 1;
    }
    out
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    !needle.is_empty()
        && haystack.len() >= needle.len()
        && haystack.windows(needle.len()).any(|w| w == needle)
}

/// How `value` is in `haystack` (`"raw"`, `"base64 (offset 1)"`, `"URL-encoded, raw"`, …),
/// or `None` when it is in none of the encodings this module knows.
pub fn find(haystack: &[u8], value: &[u8]) -> Option<String> {
    let pats = patterns(value);
    decodings(haystack)
        .iter()
        .find_map(|(how, text)| find_in(text, &pats).map(|enc| format!("{how}{enc}")))
}

fn find_in(text: &[u8], pats: &[(&'static str, Vec<u8>)]) -> Option<&'static str> {
    pats.iter()
        .find(|(_, p)| contains(text, p))
        .map(|(enc, _)| *enc)
}

/// Panics naming `place`, the canary and the encoding when any of `canaries` is in
/// `haystack`.
pub fn assert_absent<C: AsRef<[u8]>>(place: &str, haystack: &[u8], canaries: &[C]) {
    for c in canaries {
        if let Some(how) = find(haystack, c.as_ref()) {
            panic!(
                "canary {:?} found in {place} ({how})",
                String::from_utf8_lossy(c.as_ref())
            );
        }
    }
}

/// One canary of a sweep: its name, its value and its [`patterns`].
type Entry = (String, Vec<u8>, Vec<(&'static str, Vec<u8>)>);

/// A sweep: named canaries searched in every place a test hands it; it counts the places
/// by kind and collects every leak rather than stopping at the first.
#[derive(Debug, Default)]
pub struct Sweep {
    canaries: Vec<Entry>,
    places: BTreeMap<String, usize>,
    bytes: usize,
    leaks: Vec<String>,
}

impl Sweep {
    /// An empty sweep.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a canary `name` (at least 8 bytes: a shorter one would be found by chance).
    pub fn add(&mut self, name: &str, value: impl AsRef<[u8]>) {
        let value = value.as_ref().to_vec();
        assert!(value.len() >= 8, "{name} is too short to be a canary");
        let pats = patterns(&value);
        self.canaries.push((name.to_owned(), value, pats));
    }

    /// The canaries' names.
    pub fn names(&self) -> Vec<&str> {
        self.canaries.iter().map(|(n, _, _)| n.as_str()).collect()
    }

    /// Searches `haystack` (one `what` of the kind of place `kind`) for every canary.
    pub fn check(&mut self, kind: &str, what: &str, haystack: &[u8]) {
        self.check_except(kind, what, haystack, &[]);
    }

    /// Like [`Sweep::check`], leaving out the canaries named in `allowed` (a place that
    /// legitimately holds them).
    pub fn check_except(&mut self, kind: &str, what: &str, haystack: &[u8], allowed: &[&str]) {
        *self.places.entry(kind.to_owned()).or_default() += 1;
        self.bytes += haystack.len();
        let decoded = decodings(haystack);
        for (name, _, pats) in &self.canaries {
            if allowed.contains(&name.as_str()) {
                continue;
            }
            if let Some((how, enc)) = decoded
                .iter()
                .find_map(|(how, text)| find_in(text, pats).map(|enc| (how, enc)))
            {
                self.leaks
                    .push(format!("{name} in {kind} {what} ({how}{enc})"));
            }
        }
    }

    /// How many places of each kind were searched.
    pub fn places(&self) -> &BTreeMap<String, usize> {
        &self.places
    }

    /// How many bytes were searched.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Every leak found: `"<canary> in <kind> <what> (<encoding>)"`.
    pub fn leaks(&self) -> &[String] {
        &self.leaks
    }

    /// How many canaries.
    pub fn len(&self) -> usize {
        self.canaries.len()
    }

    /// Whether there is no canary.
    pub fn is_empty(&self) -> bool {
        self.canaries.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use base64::engine::general_purpose::{STANDARD, URL_SAFE};

    /// A canary with bytes every encoding treats specially (`+ / & = " \ < >`, a space,
    /// non-ASCII; `??????` puts a `/` in its base64 at every alignment), so that each
    /// encoding's pattern differs from the raw value and from the
    /// others: a planted leak is found by that encoding's check, not by another's.
    const CANARY: &str = "Canary-9f3k+/&=x \"q\\<é>~z_Ω7??????";

    fn leak(enc: &str) -> Vec<u8> {
        leak_of(CANARY, enc)
    }

    /// `value` leaked the way `enc` names, inside some realistic surrounding text.
    fn leak_of(value: &str, enc: &str) -> Vec<u8> {
        let c = value.as_bytes();
        let embed = |prefix: usize| -> Vec<u8> {
            let mut v: Vec<u8> = (0..prefix as u8).map(|i| i.wrapping_mul(37)).collect();
            v.extend_from_slice(c);
            v.extend_from_slice(b"\x00\xfftail");
            v
        };
        let wrap = |s: String| format!("{{\"blob\":\"{s}\",\"n\":1}}").into_bytes();
        match enc {
            "raw" => [b"log line: ".as_slice(), c, b" end"].concat(),
            "base64 0" => wrap(STANDARD.encode(embed(3))),
            "base64 1" => wrap(STANDARD.encode(embed(4))),
            "base64 2" => wrap(STANDARD.encode(embed(5))),
            "base64url 0" => wrap(URL_SAFE.encode(embed(0))),
            "base64url 1" => wrap(URL_SAFE.encode(embed(1))),
            "base64url 2" => wrap(URL_SAFE.encode(embed(2))),
            "hex" => format!("{{\"data\":\"\\\\x{}\"}}", hex::encode(embed(1))).into_bytes(),
            "HEX" => format!("0x{}", hex::encode_upper(embed(2))).into_bytes(),
            "url" => {
                let mut u = reqwest::Url::parse("https://example.test/cb").unwrap();
                u.query_pairs_mut().append_pair("token", value);
                u.to_string().into_bytes()
            }
            "url path" => {
                let mut u = reqwest::Url::parse("https://example.test/").unwrap();
                u.path_segments_mut().unwrap().push(value);
                u.to_string().into_bytes()
            }
            "url every byte" => c
                .iter()
                .map(|b| format!("%{b:02x}"))
                .collect::<String>()
                .into_bytes(),
            "json" => serde_json::json!({ "v": value }).to_string().into_bytes(),
            "json ascii" => {
                // as Go writes it: `&`, `<`, `>` and every non-ASCII character escaped
                let mut s = String::from("{\"v\":\"");
                for ch in value.chars() {
                    match ch {
                        '"' => s.push_str("\\\""),
                        '\\' => s.push_str("\\\\"),
                        '&' | '<' | '>' => s.push_str(&format!("\\u{:04x}", ch as u32)),
                        c if !c.is_ascii() => {
                            let mut buf = [0u16; 2];
                            for u in c.encode_utf16(&mut buf) {
                                s.push_str(&format!("\\u{u:04x}"));
                            }
                        }
                        c => s.push(c),
                    }
                }
                s.push_str("\"}");
                s.into_bytes()
            }
            other => panic!("no such encoding {other}"),
        }
    }

    const ENCODINGS: [(&str, &str); 14] = [
        ("raw", "raw"),
        ("base64 0", "base64 (offset 0)"),
        ("base64 1", "base64 (offset 1)"),
        ("base64 2", "base64 (offset 2)"),
        ("base64url 0", "base64url (offset 0)"),
        ("base64url 1", "base64url (offset 1)"),
        ("base64url 2", "base64url (offset 2)"),
        ("hex", "hex"),
        ("HEX", "HEX"),
        ("url", "form-encoded, raw"),
        ("url path", "URL-encoded, raw"),
        ("url every byte", "URL-encoded, raw"),
        ("json", "JSON-escaped, raw"),
        ("json ascii", "JSON-escaped, raw"),
    ];

    #[test]
    fn each_encoding_of_a_planted_leak_is_found_and_named() {
        for (enc, want) in ENCODINGS {
            let hay = leak(enc);
            // Not found by accident: the planted text does not hold the canary raw
            // (except for the raw case itself).
            if enc != "raw" {
                assert!(
                    !contains(&hay, CANARY.as_bytes()),
                    "{enc}: the planted text holds the raw canary, the case proves nothing"
                );
            }
            assert_eq!(
                find(&hay, CANARY.as_bytes()).as_deref(),
                Some(want),
                "{enc}"
            );
            let mut sweep = Sweep::new();
            sweep.add("c", CANARY);
            sweep.check("place", enc, &hay);
            assert_eq!(sweep.leaks().len(), 1, "{enc}: {:?}", sweep.leaks());
            let caught = std::panic::catch_unwind(|| assert_absent("p", &hay, &[CANARY]));
            assert!(caught.is_err(), "{enc}: assert_absent let it through");
        }
    }

    #[test]
    fn base64_is_found_at_every_alignment_and_every_prefix_length() {
        for prefix in 0..12 {
            let mut data = vec![b'#'; prefix];
            data.extend_from_slice(CANARY.as_bytes());
            for engine in [STANDARD, URL_SAFE] {
                let hay = engine.encode(&data);
                let how = find(hay.as_bytes(), CANARY.as_bytes());
                assert!(how.is_some(), "prefix {prefix}: {hay}");
                assert!(
                    how.unwrap().contains(&format!("offset {}", prefix % 3)),
                    "prefix {prefix}"
                );
            }
        }
    }

    #[test]
    fn each_alignment_is_its_own_check() {
        // The offset-1 pattern alone does not match an offset-0 or offset-2 blob: all three
        // are needed.
        let pats = patterns(CANARY.as_bytes());
        let b64: Vec<&Vec<u8>> = pats
            .iter()
            .filter(|(e, _)| e.starts_with("base64 ("))
            .map(|(_, p)| p)
            .collect();
        assert_eq!(b64.len(), 3);
        for offset in 0..3 {
            let mut data = vec![b'#'; offset];
            data.extend_from_slice(CANARY.as_bytes());
            let hay = STANDARD.encode(&data).into_bytes();
            for (i, p) in b64.iter().enumerate() {
                assert_eq!(
                    contains(&hay, p),
                    i == offset,
                    "offset {offset}, pattern {i}"
                );
            }
        }
        // and every pattern differs from every other one
        for (i, (a, pa)) in pats.iter().enumerate() {
            for (b, pb) in &pats[i + 1..] {
                assert_ne!(pa, pb, "{a} = {b}");
            }
        }
    }

    #[test]
    fn a_near_miss_is_not_a_leak() {
        // Every encoding of a value one byte away from the canary: no false alarm, so a
        // found leak is the canary.
        let near = CANARY.replace('9', "8");
        for (enc, _) in ENCODINGS {
            let hay = leak_of(&near, enc);
            assert!(find(&hay, near.as_bytes()).is_some(), "{enc}");
            assert_eq!(find(&hay, CANARY.as_bytes()), None, "{enc}");
        }
        for engine in [STANDARD, URL_SAFE] {
            for prefix in 0..3 {
                let mut data = vec![b'#'; prefix];
                data.extend_from_slice(near.as_bytes());
                let hay = engine.encode(&data);
                assert_eq!(find(hay.as_bytes(), CANARY.as_bytes()), None);
            }
        }
        assert_eq!(find(b"", CANARY.as_bytes()), None);
    }

    #[test]
    fn binary_canaries_are_found_too() {
        let key: Vec<u8> = (0u8..32)
            .map(|i| i.wrapping_mul(97).wrapping_add(13))
            .collect();
        let mut sealed = b"TKS1\x06test-1".to_vec();
        sealed.extend_from_slice(&key);
        assert_eq!(find(&sealed, &key).as_deref(), Some("raw"));
        let env = format!("TAKOSUMI_SEAL_KEY={}", STANDARD.encode(&key));
        assert!(find(env.as_bytes(), &key).unwrap().starts_with("base64"));
        let bytea = format!("\\\\x{}", hex::encode(&sealed));
        assert_eq!(find(bytea.as_bytes(), &key).as_deref(), Some("hex"));
    }

    #[test]
    fn a_sweep_counts_places_and_honours_allowed_places() {
        let mut sweep = Sweep::new();
        sweep.add("a", "canary-aaaaaaaa");
        sweep.add("b", "canary-bbbbbbbb");
        sweep.check("log", "api", b"nothing here");
        sweep.check_except("row", "tokens", b"canary-aaaaaaaa", &["a"]);
        sweep.check("row", "runs", b"x canary-bbbbbbbb y");
        assert_eq!(sweep.places().get("log"), Some(&1));
        assert_eq!(sweep.places().get("row"), Some(&2));
        assert_eq!(sweep.leaks(), ["b in row runs (raw)"]);
        assert_eq!(sweep.len(), 2);
    }
}
