//! Named scenarios: a workload, a fleet and an engine cost model, with the
//! agent counts a sweep runs by default. Every number is a default that a
//! flag can override; the report prints the values used.

use serde::Serialize;

use crate::engine::core::CostModel;
use crate::policies::HearthKnobs;
use crate::workload::{AgentSwarm, LongContext, SharedPrefix, Unique, Workload};

/// Engine settings of every replica in a scenario.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct EngineSpec {
    pub cost: CostModel,
    /// Tokens per KV block (vLLM's default 16).
    pub block_tokens: usize,
    /// KV cache capacity per replica, in tokens.
    pub cache_capacity_tokens: usize,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Scenario {
    pub name: String,
    pub workload: Workload,
    pub replicas: usize,
    pub agents: Vec<usize>,
    pub engine: EngineSpec,
    pub hearth: HearthKnobs,
    /// Engine seconds run before measuring, then measured.
    pub warmup_s: f64,
    pub duration_s: f64,
    /// Seconds into the measured window when the first replica's engine
    /// restarts (its cache is emptied; running requests carry on).
    pub restart_at_s: Option<f64>,
    /// Share of the agents whose traffic reaches the engines around Hearth
    /// (another gateway hashing their session onto a replica).
    pub bypass_share: f64,
    /// Seconds between the sidecar's scrapes of the engines' metrics
    /// (queue, running, KV use, prompt tokens since the engine started,
    /// its start time; no KV capacity, as llama.cpp); None: no scrapes, the
    /// sidecar sees only its own traffic.
    pub engine_metrics_s: Option<f64>,
}

pub const NAMES: [&str; 10] = [
    "cache-never-fills",
    "cache-runs-out",
    "undersized-kv",
    "engine-restart",
    "bypass",
    "fleet",
    "shared-prefix",
    "unique",
    "long-context",
    "long-lane",
];

/// The warmth index an operator would configure for a replica whose KV
/// cache holds `tokens` (4 bytes per token, 2 KiB fingerprint blocks).
pub fn warmth_blocks_for(tokens: usize) -> usize {
    (tokens * crate::workload::BYTES_PER_TOKEN / hearth_wire::DEFAULT_BLOCK_SIZE).max(1)
}

impl HearthKnobs {
    /// The sidecar's defaults, with `HEARTH_WARMTH_BLOCKS` sized to engines
    /// of `tokens` of KV cache each ([`warmth_blocks_for`]).
    pub fn sized_to(tokens: usize) -> HearthKnobs {
        let mut k = HearthKnobs::default();
        k.set([(
            "HEARTH_WARMTH_BLOCKS",
            warmth_blocks_for(tokens).to_string(),
        )])
        .expect("a warmth size of at least one block is valid");
        k
    }
}

impl Scenario {
    pub fn preset(name: &str) -> Option<Scenario> {
        let engine = |cache_tokens: usize| EngineSpec {
            cost: CostModel::default(),
            block_tokens: 16,
            cache_capacity_tokens: cache_tokens,
        };
        let scenario = |workload, replicas, agents: &[usize], cache_tokens| Scenario {
            name: name.to_string(),
            workload,
            replicas,
            agents: agents.to_vec(),
            engine: engine(cache_tokens),
            hearth: HearthKnobs::sized_to(cache_tokens),
            warmup_s: 60.0,
            duration_s: 300.0,
            restart_at_s: None,
            bypass_share: 0.0,
            engine_metrics_s: None,
        };
        let swarm = Workload::AgentSwarm(AgentSwarm::default());
        Some(match name {
            // Two replicas with ~4.9M cached tokens each: nothing is evicted.
            "cache-never-fills" => scenario(swarm, 2, &[16, 32, 64, 96], 4_900_000),
            // Eight replicas with 1M tokens each: a session's replica can keep
            // its share of conversations, but not everyone's.
            "cache-runs-out" => scenario(swarm, 8, &[48, 64, 96, 128], 1_000_000),
            // Eight replicas whose engines hold 300,000 tokens each (a few of
            // their eight conversations), with the sidecar at its default
            // warmth index (100,000 blocks, about 51M tokens a replica):
            // the index is 170 times too large.
            "undersized-kv" => {
                let mut s = scenario(swarm, 8, &[64], 300_000);
                s.hearth.unset("HEARTH_WARMTH_BLOCKS");
                s
            }
            // The same engines, the index sized to them, and the first
            // replica's engine restarting 60 s into the measured window.
            "engine-restart" => {
                let mut s = scenario(swarm, 8, &[64], 300_000);
                s.restart_at_s = Some(60.0);
                s.engine_metrics_s = Some(2.0);
                s
            }
            // The same engines and index, and a quarter of the agents
            // reaching the engines through another gateway (ring hash on
            // their session).
            "bypass" => {
                let mut s = scenario(swarm, 8, &[64], 300_000);
                s.bypass_share = 0.25;
                s
            }
            // Forty replicas, eight agents each.
            "fleet" => {
                let mut s = scenario(swarm, 40, &[320], 1_000_000);
                s.warmup_s = 60.0;
                s.duration_s = 120.0;
                s
            }
            "shared-prefix" => scenario(
                Workload::SharedPrefix(SharedPrefix::default()),
                4,
                &[16, 64],
                4_900_000,
            ),
            "unique" => scenario(Workload::Unique(Unique::default()), 4, &[16, 64], 4_900_000),
            "long-context" => scenario(
                Workload::LongContext(LongContext::default()),
                4,
                &[16, 64],
                4_900_000,
            ),
            // The long-context mix with the last of four replicas tagged
            // `long`: prompts over HEARTH_LONG_PROMPT_BYTES go only there,
            // short ones per HEARTH_LONG_LANE (`--set HEARTH_LONG_LANE=..`). Long
            // documents are 0.5% of requests, which one replica can read
            // (at 2%, 1.1 MB each, they are 40% of all prompt tokens and
            // swamp any lane smaller than half the fleet); 900 s measured
            // so that a few dozen of them finish.
            "long-lane" => {
                let mut s = scenario(
                    Workload::LongContext(LongContext {
                        long_share: 0.005,
                        ..LongContext::default()
                    }),
                    4,
                    &[16, 64],
                    4_900_000,
                );
                s.hearth.long_replicas = 1;
                s.duration_s = 900.0;
                s
            }
            _ => return None,
        })
    }
}
