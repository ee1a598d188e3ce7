//! The chunked sealed format (version 2) for artifacts too large to hold in memory: a plan
//! file the control node executes has no size limit, so it is sealed from its file into
//! another file (and unsealed the same way) one chunk at a time.
//!
//! ```text
//! "TKS2" | key-id length (1 byte) | key-id | nonce prefix (7 bytes) | chunk size (u32 BE)
//!        | chunk 0 | chunk 1 | … | last chunk
//! chunk = ciphertext (chunk size bytes; the last chunk shorter, possibly empty) + tag (16)
//! nonce of chunk i = nonce prefix | i (u32 BE) | 1 if last else 0
//! ```
//!
//! Every chunk is bound to the same associated data as a version 1 object (the header,
//! the purpose and the subject), its position by the counter and the end of the stream by
//! the last-chunk flag (the STREAM construction): chunks cannot be reordered, dropped or
//! moved to another object, and a stream cut at any point fails to open.

use std::io::{self, Read, Write};

use ring::aead::{Aad, Nonce};
use ring::rand::{SecureRandom, SystemRandom};
use sha2::{Digest, Sha256};
use zeroize::Zeroize;

use crate::{
    MAX_KEY_ID_LEN, Purpose, SealError, Sealer, TAG_LEN, associated_data, validate_key_id,
};

/// The magic bytes of a chunked sealed object (format version 2).
pub const MAGIC_V2: &[u8; 4] = b"TKS2";
/// Plaintext bytes per chunk.
pub const CHUNK_LEN: usize = 1 << 20;
const PREFIX_LEN: usize = 7;

/// What went through a streaming seal or unseal: the plaintext's length and SHA-256.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Streamed {
    /// Plaintext bytes.
    pub len: u64,
    /// SHA-256 of the plaintext.
    pub sha256: [u8; 32],
}

impl Streamed {
    /// The plaintext's SHA-256 as lowercase hex.
    pub fn sha256_hex(&self) -> String {
        self.sha256.iter().map(|b| format!("{b:02x}")).collect()
    }
}

fn nonce(prefix: &[u8; PREFIX_LEN], counter: u32, last: bool) -> Nonce {
    let mut n = [0u8; 12];
    n[..PREFIX_LEN].copy_from_slice(prefix);
    n[PREFIX_LEN..11].copy_from_slice(&counter.to_be_bytes());
    n[11] = u8::from(last);
    Nonce::assume_unique_for_key(n)
}

/// Reads until `buf` is full or the source ends; returns how much was read.
fn fill(src: &mut impl Read, buf: &mut [u8]) -> io::Result<usize> {
    let mut got = 0;
    fill_counting(src, buf, &mut got)?;
    Ok(got)
}

/// [`fill`], keeping the count in `got` so a caller knows what reached `buf` also when a
/// read fails midway.
fn fill_counting(src: &mut impl Read, buf: &mut [u8], got: &mut usize) -> io::Result<()> {
    while *got < buf.len() {
        match src.read(&mut buf[*got..]) {
            Ok(0) => break,
            Ok(n) => *got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// One chunk's buffer (a chunk and its tag). On drop it wipes the bytes any chunk reached,
/// not the whole buffer: most objects are far smaller than a chunk (a plan of a few
/// kilobytes), and wiping the whole megabyte, byte by byte, cost each seal and unseal
/// ~0.3 ms, more than the cipher (BENCHMARKS.md, session 36).
struct ChunkBuf {
    buf: Vec<u8>,
    reached: usize,
}

impl ChunkBuf {
    fn new(len: usize) -> Self {
        Self {
            buf: vec![0u8; len],
            reached: 0,
        }
    }

    /// Reads from `src` into the first `len` bytes until they are full or the source ends;
    /// returns how much was read.
    fn fill_from(&mut self, src: &mut impl Read, len: usize) -> io::Result<usize> {
        let mut got = 0;
        let read = fill_counting(src, &mut self.buf[..len], &mut got);
        self.reached = self.reached.max(got);
        read.map(|()| got)
    }

    /// The first `len` bytes, to be written (a tag after the chunk): counted as reached.
    fn upto(&mut self, len: usize) -> &mut [u8] {
        self.reached = self.reached.max(len);
        &mut self.buf[..len]
    }

    /// Zeroes every byte reached so far.
    fn wipe(&mut self) {
        self.buf[..self.reached].zeroize();
        self.reached = 0;
    }
}

impl Drop for ChunkBuf {
    fn drop(&mut self) {
        self.wipe();
    }
}

fn io_err(what: &'static str) -> impl FnOnce(io::Error) -> SealError {
    move |e| SealError::Io {
        what,
        kind: e.kind(),
    }
}

impl Sealer {
    /// Seals everything `src` yields into `dst` in the chunked format, with the current
    /// key. Memory use is one chunk, whatever the size.
    pub fn seal_stream(
        &self,
        purpose: Purpose,
        subject: &str,
        mut src: impl Read,
        mut dst: impl Write,
    ) -> Result<Streamed, SealError> {
        let key = &self.keys[0];
        let mut prefix = [0u8; PREFIX_LEN];
        SystemRandom::new()
            .fill(&mut prefix)
            .map_err(|_| SealError::Randomness)?;
        let mut header = Vec::with_capacity(4 + 1 + key.id.len() + PREFIX_LEN + 4);
        header.extend_from_slice(MAGIC_V2);
        header.push(key.id.len() as u8);
        header.extend_from_slice(key.id.as_bytes());
        header.extend_from_slice(&prefix);
        header.extend_from_slice(&(CHUNK_LEN as u32).to_be_bytes());
        let aad = associated_data(&header, purpose, subject);
        dst.write_all(&header)
            .map_err(io_err("writing the sealed object"))?;

        let cipher = key.cipher();
        let mut hash = Sha256::new();
        let mut len = 0u64;
        let mut chunk = ChunkBuf::new(CHUNK_LEN + TAG_LEN);
        let mut counter: u32 = 0;
        loop {
            let n = chunk
                .fill_from(&mut src, CHUNK_LEN)
                .map_err(io_err("reading the plaintext"))?;
            // A full chunk is never the last one: the stream always ends with a shorter
            // (possibly empty) chunk, so a reader knows the end by length alone.
            let last = n < CHUNK_LEN;
            let buf = chunk.upto(n + TAG_LEN);
            hash.update(&buf[..n]);
            len += n as u64;
            let tag = cipher
                .seal_in_place_separate_tag(
                    nonce(&prefix, counter, last),
                    Aad::from(&aad),
                    &mut buf[..n],
                )
                .map_err(|_| SealError::TooLarge)?;
            buf[n..].copy_from_slice(tag.as_ref());
            dst.write_all(buf)
                .map_err(io_err("writing the sealed object"))?;
            if last {
                break;
            }
            counter = counter.checked_add(1).ok_or(SealError::TooLarge)?;
        }
        dst.flush().map_err(io_err("writing the sealed object"))?;
        Ok(Streamed {
            len,
            sha256: hash.finalize().into(),
        })
    }

    /// Opens a chunked object from `src` into `dst`, with the current or a previous key.
    ///
    /// Each chunk is authenticated before it is written, but whether the stream is whole is
    /// known only at its end: on an error, whatever reached `dst` must be discarded.
    pub fn unseal_stream(
        &self,
        purpose: Purpose,
        subject: &str,
        mut src: impl Read,
        mut dst: impl Write,
    ) -> Result<Streamed, SealError> {
        let mut fixed = [0u8; 5];
        if fill(&mut src, &mut fixed).map_err(io_err("reading the sealed object"))? != 5
            || &fixed[..4] != MAGIC_V2
        {
            return Err(SealError::Malformed);
        }
        let id_len = usize::from(fixed[4]);
        if id_len == 0 || id_len > MAX_KEY_ID_LEN {
            return Err(SealError::Malformed);
        }
        let mut rest = vec![0u8; id_len + PREFIX_LEN + 4];
        if fill(&mut src, &mut rest).map_err(io_err("reading the sealed object"))? != rest.len() {
            return Err(SealError::Malformed);
        }
        let key_id = std::str::from_utf8(&rest[..id_len]).map_err(|_| SealError::Malformed)?;
        validate_key_id(key_id).map_err(|_| SealError::Malformed)?;
        let mut prefix = [0u8; PREFIX_LEN];
        prefix.copy_from_slice(&rest[id_len..id_len + PREFIX_LEN]);
        let chunk_len =
            u32::from_be_bytes(rest[id_len + PREFIX_LEN..].try_into().expect("4 bytes"));
        let chunk_len = usize::try_from(chunk_len).map_err(|_| SealError::Malformed)?;
        // Only sizes this crate writes are read, so a header cannot ask for a huge buffer.
        if chunk_len != CHUNK_LEN {
            return Err(SealError::Malformed);
        }
        let key =
            self.keys
                .iter()
                .find(|k| k.id == key_id)
                .ok_or_else(|| SealError::UnknownKey {
                    key_id: key_id.to_owned(),
                })?;
        let mut header = fixed.to_vec();
        header.extend_from_slice(&rest);
        let aad = associated_data(&header, purpose, subject);

        let cipher = key.cipher();
        let mut hash = Sha256::new();
        let mut len = 0u64;
        let mut chunk = ChunkBuf::new(chunk_len + TAG_LEN);
        let mut counter: u32 = 0;
        loop {
            let n = chunk
                .fill_from(&mut src, chunk_len + TAG_LEN)
                .map_err(io_err("reading the sealed object"))?;
            if n < TAG_LEN {
                return Err(SealError::Malformed);
            }
            let last = n < chunk_len + TAG_LEN;
            let plain = cipher
                .open_in_place(
                    nonce(&prefix, counter, last),
                    Aad::from(&aad),
                    chunk.upto(n),
                )
                .map_err(|_| SealError::Tampered)?;
            hash.update(&*plain);
            len += plain.len() as u64;
            dst.write_all(plain)
                .map_err(io_err("writing the plaintext"))?;
            if last {
                break;
            }
            counter = counter.checked_add(1).ok_or(SealError::Malformed)?;
        }
        dst.flush().map_err(io_err("writing the plaintext"))?;
        Ok(Streamed {
            len,
            sha256: hash.finalize().into(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use takosumi_core::Secret;

    fn sealer(id: &str, byte: u8) -> Sealer {
        Sealer::new(id, &Secret::new(vec![byte; 32])).unwrap()
    }

    fn data(n: usize) -> Vec<u8> {
        (0..n).map(|i| (i * 31 % 251) as u8).collect()
    }

    fn seal(s: &Sealer, plain: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        s.seal_stream(Purpose::Plan, "run-1", plain, &mut out)
            .unwrap();
        out
    }

    /// What any read or write reached is wiped, also a read that failed midway; nothing
    /// beyond it is touched.
    #[test]
    fn a_chunk_buffer_wipes_what_reads_and_writes_reached() {
        struct ThenFails<'a>(&'a [u8]);
        impl Read for ThenFails<'_> {
            fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
                if self.0.is_empty() {
                    return Err(io::Error::other("gone"));
                }
                let n = self.0.len().min(buf.len()).min(3);
                buf[..n].copy_from_slice(&self.0[..n]);
                self.0 = &self.0[n..];
                Ok(n)
            }
        }
        let mut chunk = ChunkBuf::new(64);
        assert!(chunk.fill_from(&mut ThenFails(&[9; 7]), 32).is_err());
        assert_eq!(chunk.reached, 7);
        assert_eq!(&chunk.buf[..8], &[9, 9, 9, 9, 9, 9, 9, 0]);
        chunk.upto(20)[10..20].fill(5);
        assert_eq!(chunk.reached, 20);
        assert_eq!(chunk.fill_from(&mut &[1u8, 2][..], 32).unwrap(), 2);
        assert_eq!(
            chunk.reached, 20,
            "a shorter read does not shrink what is wiped"
        );
        chunk.buf[40] = 1; // beyond anything reached: left as it is
        chunk.wipe();
        assert!(chunk.buf[..20].iter().all(|b| *b == 0));
        assert_eq!(chunk.buf[40], 1);
        assert_eq!(chunk.reached, 0);
    }

    #[test]
    fn round_trips_at_every_chunk_boundary() {
        let s = sealer("k1", 1);
        for n in [0, 1, CHUNK_LEN - 1, CHUNK_LEN, CHUNK_LEN + 1, 3 * CHUNK_LEN] {
            let plain = data(n);
            let mut sealed = Vec::new();
            let put = s
                .seal_stream(Purpose::Plan, "run-1", &plain[..], &mut sealed)
                .unwrap();
            assert_eq!(put.len, n as u64);
            assert_eq!(put.sha256, <[u8; 32]>::from(Sha256::digest(&plain)));
            let mut back = Vec::new();
            let got = s
                .unseal_stream(Purpose::Plan, "run-1", &sealed[..], &mut back)
                .unwrap();
            assert_eq!(back, plain, "{n} bytes");
            assert_eq!(got, put);
            // The whole-object unseal reads the chunked format too.
            assert_eq!(s.unseal(Purpose::Plan, "run-1", &sealed).unwrap(), plain);
        }
    }

    #[test]
    fn a_cut_reordered_altered_or_moved_stream_fails_to_open() {
        let s = sealer("k1", 1);
        let plain = data(2 * CHUNK_LEN + 10);
        let sealed = seal(&s, &plain);
        let header = 4 + 1 + 2 + PREFIX_LEN + 4;
        let chunk = CHUNK_LEN + TAG_LEN;
        let open = |bytes: &[u8], subject: &str| {
            s.unseal_stream(Purpose::Plan, subject, bytes, io::sink())
        };
        // Cut at a chunk boundary (a whole stream's worth of full chunks, no last chunk).
        assert!(open(&sealed[..header + 2 * chunk], "run-1").is_err());
        // Cut inside a chunk.
        assert!(matches!(
            open(&sealed[..header + chunk + 100], "run-1"),
            Err(SealError::Tampered)
        ));
        // Two full chunks swapped.
        let mut swapped = sealed[..header].to_vec();
        swapped.extend_from_slice(&sealed[header + chunk..header + 2 * chunk]);
        swapped.extend_from_slice(&sealed[header..header + chunk]);
        swapped.extend_from_slice(&sealed[header + 2 * chunk..]);
        assert!(matches!(open(&swapped, "run-1"), Err(SealError::Tampered)));
        // One bit flipped in the last chunk.
        let mut flipped = sealed.clone();
        *flipped.last_mut().unwrap() ^= 1;
        assert!(matches!(open(&flipped, "run-1"), Err(SealError::Tampered)));
        // Another subject, another purpose.
        assert!(matches!(open(&sealed, "run-2"), Err(SealError::Tampered)));
        assert!(matches!(
            s.unseal_stream(Purpose::State, "run-1", &sealed[..], io::sink()),
            Err(SealError::Tampered)
        ));
        // Extra bytes after the last chunk make it a full chunk that does not authenticate.
        let mut longer = seal(&s, &data(10));
        longer.extend_from_slice(&[0u8; 8]);
        assert!(open(&longer, "run-1").is_err());
        // A version 1 object is not a stream.
        let v1 = s.seal(Purpose::Plan, "run-1", b"x").unwrap();
        assert!(matches!(open(&v1, "run-1"), Err(SealError::Malformed)));
    }

    #[test]
    fn a_rotated_out_key_still_opens_and_an_unknown_one_is_named() {
        let old = sealer("old", 1);
        let sealed = seal(&old, &data(5000));
        let rotated = sealer("new", 2)
            .with_previous_key("old", &Secret::new(vec![1; 32]))
            .unwrap();
        let mut back = Vec::new();
        rotated
            .unseal_stream(Purpose::Plan, "run-1", &sealed[..], &mut back)
            .unwrap();
        assert_eq!(back, data(5000));
        let stranger = sealer("other", 3);
        assert!(matches!(
            stranger.unseal_stream(Purpose::Plan, "run-1", &sealed[..], io::sink()),
            Err(SealError::UnknownKey { key_id }) if key_id == "old"
        ));
    }
}
