//! Parsers for the reference tools' output: `openssl speed` and `wrk --latency`.

/// The throughput `openssl speed -evp … -bytes N` reports for its one block size, in bytes
/// per second (it prints thousands of bytes per second, e.g. `AES-256-GCM 4269387.22k`).
/// With several block sizes, the last (largest) column is taken.
pub fn openssl_speed(output: &str) -> Option<f64> {
    output
        .lines()
        .rev()
        .find(|l| l.to_ascii_lowercase().starts_with("aes-256-gcm"))
        .and_then(|l| l.split_whitespace().last())
        .and_then(|v| v.strip_suffix('k'))
        .and_then(|v| v.parse::<f64>().ok())
        .map(|k| k * 1000.0)
}

/// What `wrk --latency` measured.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct WrkResult {
    /// `Requests/sec:`.
    pub requests_per_sec: f64,
    /// The 50% line of the latency distribution, in milliseconds.
    pub p50_ms: f64,
    /// The 99% line of the latency distribution, in milliseconds.
    pub p99_ms: f64,
    /// Requests completed.
    pub requests: u64,
    /// `Non-2xx or 3xx responses:` (0 if absent).
    pub non_2xx: u64,
    /// Socket errors (connect, read, write, timeout), summed.
    pub socket_errors: u64,
}

/// wrk prints durations as `812.00us`, `1.23ms`, `2.00s` or `1.00m`.
fn wrk_duration_ms(v: &str) -> Option<f64> {
    let (num, factor) = if let Some(n) = v.strip_suffix("us") {
        (n, 0.001)
    } else if let Some(n) = v.strip_suffix("ms") {
        (n, 1.0)
    } else if let Some(n) = v.strip_suffix('s') {
        (n, 1000.0)
    } else if let Some(n) = v.strip_suffix('m') {
        (n, 60_000.0)
    } else {
        return None;
    };
    num.parse::<f64>().ok().map(|x| x * factor)
}

/// Parses the output of `wrk --latency`.
pub fn wrk(output: &str) -> Option<WrkResult> {
    let mut rps = None;
    let (mut p50, mut p99) = (None, None);
    let (mut requests, mut non_2xx, mut socket_errors) = (0u64, 0u64, 0u64);
    for line in output.lines().map(str::trim) {
        if let Some(v) = line.strip_prefix("Requests/sec:") {
            rps = v.trim().parse::<f64>().ok();
        } else if let Some(v) = line.strip_prefix("50%") {
            p50 = wrk_duration_ms(v.trim());
        } else if let Some(v) = line.strip_prefix("99%") {
            p99 = wrk_duration_ms(v.trim());
        } else if let Some(v) = line.strip_prefix("Non-2xx or 3xx responses:") {
            non_2xx = v.trim().parse().unwrap_or(0);
        } else if let Some(v) = line.strip_prefix("Socket errors:") {
            socket_errors = v
                .split(',')
                .filter_map(|p| p.split_whitespace().last()?.parse::<u64>().ok())
                .sum();
        } else if line.contains("requests in") {
            requests = line
                .split_whitespace()
                .next()
                .and_then(|n| n.parse().ok())
                .unwrap_or(0);
        }
    }
    Some(WrkResult {
        requests_per_sec: rps?,
        p50_ms: p50?,
        p99_ms: p99?,
        requests,
        non_2xx,
        socket_errors,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// openssl 3.0's table, one block size or the default six: thousands of bytes per second.
    #[test]
    fn parses_openssl_speed() {
        let one = "CPUINFO: OPENSSL_ia32cap=0x1\nThe 'numbers' are in 1000s of bytes per second processed.\ntype        1048576 bytes\nAES-256-GCM    4269387.22k\n";
        let close = |v: Option<f64>, want: f64| v.is_some_and(|v| (v - want).abs() < 1.0);
        assert!(close(openssl_speed(one), 4_269_387_220.0));
        let six = "type 16 bytes 64 bytes 256 bytes 1024 bytes 8192 bytes 16384 bytes\nAES-256-GCM 44920.56k 177553.55k 636094.68k 1768613.68k 3831398.40k 4136400.55k\n";
        assert!(close(openssl_speed(six), 4_136_400_550.0));
        assert_eq!(openssl_speed("nothing here"), None);
    }

    /// wrk 4.1's report with `--latency`, including errors and non-2xx lines.
    #[test]
    fn parses_wrk() {
        let out = "Running 5s test @ http://127.0.0.1:1/api/v1/runs/run_x
  2 threads and 32 connections
  Thread Stats   Avg      Stdev     Max   +/- Stdev
    Latency     3.10ms    1.20ms  20.00ms   80.00%
    Req/Sec     5.20k   300.00     6.00k    70.00%
  Latency Distribution
     50%  812.00us
     75%    2.50ms
     90%    4.00ms
     99%    1.02s
  51234 requests in 5.00s, 40.00MB read
  Socket errors: connect 0, read 2, write 0, timeout 3
  Non-2xx or 3xx responses: 7
Requests/sec:  10246.80
Transfer/sec:      8.00MB
";
        let r = wrk(out).unwrap();
        assert_eq!(r.requests_per_sec, 10246.80);
        assert!((r.p50_ms - 0.812).abs() < 1e-9);
        assert_eq!(r.p99_ms, 1020.0);
        assert_eq!((r.requests, r.non_2xx, r.socket_errors), (51234, 7, 5));
        assert_eq!(wrk("garbage"), None);
    }
}
