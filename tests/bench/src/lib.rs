//! Takosumi's benchmarks. The Criterion benches (`benches/`) time in-process
//! work; the `takosumi-bench` binary drives the real API, RabbitMQ, Postgres, the S3
//! server and terraform through the e2e fixture (`takosumi_tests::Stack`) and prints each
//! figure beside its reference from the same run; `noop-terraform` is an
//! orchestration-only stand-in for the tool. Benchmarks print figures: nothing here fails
//! because something is slow, and nothing here is a timed assertion.

pub mod cgroup;
pub mod fig_http;
pub mod fig_memory;
pub mod fig_overhead;
pub mod fig_queue;
pub mod fig_relay;
pub mod fig_scale;
pub mod fig_seal;
pub mod fig_sweep;
pub mod fig_throughput;
pub mod fig_units;
pub mod harness;
pub mod machine;
pub mod noop;
pub mod parse;
pub mod procfs;
pub mod report;
pub mod stats;
