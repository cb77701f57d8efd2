//! Hearth's benchmark kit: a simulated OpenAI-compatible LLM engine whose
//! prefix cache is the ground truth routing quality is judged by, and the
//! drivers that run workloads against it.
//!
//! - [`engine`]: the simulated engine server (prefix cache, cost model).
//! - [`serve`]: the `hearth-bench serve` subcommand (a fleet of engines).
//! - [`conversation`]: agent-style conversations as request bodies.
//! - [`gateway`]: running the real Envoy (shared with the e2e tests).
//! - [`llama`]: running a real engine, llama.cpp's `llama-server`
//!   (shared with the e2e tests).
//! - [`demo`]: the `hearth-bench demo` subcommand.
//! - [`sidecar`]: the sidecar binary as a child process.
//! - [`settings`]: sidecar settings on the command line (`--set`),
//!   parsed by the sidecar's own parser.
//! - [`stack`]: engines, the sidecar and Envoy with a rendered config,
//!   assembled once for every driver and the end-to-end tests.
//! - [`soak`]: the `hearth-bench soak` subcommand (faults under load).
//! - [`live`]: a scenario through the real Envoy, filter and sidecar,
//!   beside the same cell simulated.
//! - [`tenants`]: tenant fairness and priority under overload (flow
//!   control against least_request and Hearth without it), live.
//! - [`peers`]: the peer routers as released (smg, vllm-router),
//!   started in front of given engines.
//! - [`real`]: plain Envoy (ring_hash, least_request) and Hearth side by
//!   side in front of real OpenAI-compatible engines.
//! - [`workload`] (seeded clients), [`scenario`] (presets), [`policies`]
//!   (every policy compared), [`sim`] (the discrete-event driver),
//!   [`report`] (table, JSON, SVG): the routing-quality benchmark.

pub mod conversation;
pub mod cpu;
pub mod demo;
pub mod engine;
pub mod gateway;
pub mod harness;
pub mod kv_forward;
pub mod live;
pub mod llama;
pub mod overhead;
pub mod peers;
pub mod policies;
pub mod pool;
pub mod process;
pub mod provenance;
pub mod real;
pub mod report;
pub mod rng;
pub mod scenario;
pub mod serve;
pub mod settings;
pub mod sidecar;
pub mod sim;
pub mod soak;
pub mod stack;
pub mod tenants;
pub mod vllm;
pub mod workload;
