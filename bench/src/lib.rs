//! Hearth's benchmark kit: a simulated OpenAI-compatible LLM engine whose
//! prefix cache is the ground truth routing quality is judged by, and the
//! drivers that run workloads against it.
//!
//! - [`engine`]: the simulated engine server (prefix cache, cost model).
//! - [`serve`]: the `hearth-bench serve` subcommand (a fleet of engines).
//! - [`conversation`]: agent-style conversations as request bodies.
//! - [`gateway`]: running the real Envoy (shared with the e2e tests).
//! - [`demo`]: the `hearth-bench demo` subcommand.

pub mod conversation;
pub mod demo;
pub mod engine;
pub mod gateway;
pub mod serve;
