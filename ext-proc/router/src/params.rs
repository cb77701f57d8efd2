//! The router's parameters: plain numbers, built from the sidecar's
//! settings (`config.rs`) or directly by tests and the simulator.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use crate::health::HealthParams;

/// Everything a decision and the fleet state are tuned by. `Default` is
/// the sidecar's defaults (a test in the sidecar checks they agree).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RouterParams {
    /// The scoring rule's knobs.
    pub score: ScoreParams,
    /// Health: fencing, backoff, probing.
    pub health: HealthParams,
    /// Fingerprint block size in bytes (the filter's).
    pub block_size: usize,
    /// Warmth index capacity per replica, in blocks.
    pub warmth_blocks: usize,
    /// `warmth_blocks` is a default, not the operator's: an engine that
    /// reports its KV capacity sets its replica's instead.
    pub warmth_from_engine: bool,
    /// Uncached prompt bytes that weigh one extra load unit.
    pub load_unit_bytes: u64,
    /// In-flight requests per replica beyond which it takes no more (0: no
    /// limit).
    pub max_inflight: u32,
    /// Engine-reported queue length beyond which a replica takes no more
    /// (0: no limit).
    pub max_queue: u64,
    /// Fallback replicas listed after the chosen one.
    pub fallbacks: usize,
    /// Canonical prompt bytes from which a request is long.
    pub long_prompt_bytes: u64,
    /// Where short prompts may go when some replicas are tagged `long`.
    pub long_lane: LongLane,
    /// Output caps up to this many tokens prefer `profile=short-output`.
    pub short_output_tokens: u64,
    /// Engine figures older than this are ignored.
    pub engine_stale: Duration,
    /// Load units per request an engine reports queued, or running beyond
    /// this sidecar's own.
    pub engine_load_weight: f64,
    /// How long after its latest turn a conversation stays resident.
    pub resident_window: Duration,
    /// How long after its answer ended a first turn may wait for its
    /// second turn before it counts as one-shot (see [`crate::tips`]).
    pub sequel_horizon: Duration,
    /// Correct each replica's warmth from what its answers' usage says it
    /// served from cache (see [`crate::usage`]), and drop it when the
    /// engine's metrics show a restart.
    pub usage_feedback: bool,
    /// Load units a resident conversation (running or paused) adds for newcomers
    /// while some replica is idle (0: none).
    pub resident_load: f64,
    /// Mean load, in load units, of the candidates above which a later
    /// turn of a conversation weighs their load differences in
    /// proportion to that mean (scaled by this over the mean), while no
    /// candidate's engine has requests waiting and none runs more than
    /// `hotspot_ratio` times another's load; 0 = always as counted.
    pub relative_load_above: f64,
    /// How many times another candidate's load one candidate must run for
    /// a later turn to weigh load differences as counted (a hotspot),
    /// whatever `relative_load_above` says.
    pub hotspot_ratio: f64,
    /// For a prompt no candidate holds a block of: the load units each
    /// block of prompt still being read on a candidate weighs (0: those
    /// bytes weigh their `load_unit_bytes` units, as for every other
    /// request).
    pub cold_read_weight: f64,
    /// When a replica is saturated, for flow control.
    pub flow: FlowParams,
}

impl RouterParams {
    /// What `bytes` of prompt still to read weigh, in load units
    /// (`load_unit_bytes` each).
    pub fn load_units(&self, bytes: u64) -> f64 {
        bytes as f64 / self.load_unit_bytes as f64
    }
}

impl Default for RouterParams {
    fn default() -> Self {
        RouterParams {
            score: ScoreParams {
                basis: AffinityBasis::Relative,
                cap: 128,
                alpha: 1.0,
                first_turn_cap: 4,
            },
            health: HealthParams::default(),
            block_size: 2048,
            warmth_blocks: 100_000,
            warmth_from_engine: true,
            load_unit_bytes: 65_536,
            max_inflight: 0,
            max_queue: 0,
            fallbacks: 2,
            long_prompt_bytes: 400_000,
            long_lane: LongLane::Shared,
            short_output_tokens: 256,
            engine_stale: Duration::from_secs(10),
            engine_load_weight: 1.0,
            resident_window: Duration::from_secs(120),
            sequel_horizon: Duration::from_secs(15),
            resident_load: 5.0,
            relative_load_above: 8.0,
            hotspot_ratio: 8.0,
            cold_read_weight: 1.0,
            usage_feedback: true,
            flow: FlowParams::default(),
        }
    }
}

/// [`FlowParams::lower_prefill_share`]'s default.
pub const LOWER_PREFILL_SHARE: f64 = 0.1;

/// The saturation thresholds and the affinity wait (`HEARTH_FLOW_*`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct FlowParams {
    /// Requests waiting in the engine from which it is saturated (0: the
    /// engine's queue is not looked at).
    pub engine_waiting: f64,
    /// KV cache use (0..1) from which an engine with anything waiting is
    /// saturated (0: not looked at).
    pub kv_usage: f64,
    /// Uncached prompt bytes in flight on one replica (this sidecar's and
    /// its peers') beyond which it is saturated (0: no limit).
    pub uncached_bytes: u64,
    /// Seconds of prefill in flight on one replica, at its learnt prefill
    /// rate, beyond which it is saturated (0: not looked at; while no
    /// rate is learnt, only `uncached_bytes` counts). The smaller of the
    /// two limits holds.
    pub prefill_seconds: f64,
    /// How long a queued request waits for a saturated replica that holds
    /// more of its prompt than any free one, before it takes a free one.
    pub affinity_wait: Duration,
    /// How long a priority band's peak of requests in flight on a replica
    /// stays reserved: a lower band's request finds the replica saturated
    /// while its engine's batch has no slot beyond those (zero: no
    /// reserve).
    pub headroom: Duration,
    /// How long a flow's peak of requests in flight on a replica stays
    /// kept for it while the flow is under its fair share of the fleet's
    /// slots: a request of a flow of the same band over its share finds
    /// the replica saturated while its batch has no slot beyond those
    /// (zero: nothing kept between flows).
    pub fair_window: Duration,
    /// The share of a replica's prefill time (0 to 1) that bands below a
    /// higher band about there may take: a lower band's request sent there
    /// keeps the replica's slots from the lower bands for its unread
    /// prompt's prefill time (at the learnt rate) divided by this share,
    /// so a higher band's request seldom arrives behind a lower band's
    /// long prompt in the engine's first-come prefill (1: not paced).
    pub lower_prefill_share: f64,
    /// A sheddable request (negative priority) that finds the replicas'
    /// free slots kept for higher bands, but not every replica saturated,
    /// waits in the queue (behind every other band) instead of being
    /// refused at once; false: refused then too. While every replica is
    /// saturated it is refused either way.
    pub sheddable_waits: bool,
    /// Tag each request with its place in its engine's own queue
    /// ([`crate::fleet::EngineTags`], `HEARTH_ENGINE_PRIORITY` set);
    /// false: no tags kept, none given.
    pub engine_tags: bool,
}

impl Default for FlowParams {
    fn default() -> Self {
        FlowParams {
            engine_waiting: 5.0,
            kv_usage: 0.9,
            uncached_bytes: 8 << 20,
            prefill_seconds: 0.0,
            affinity_wait: Duration::from_secs(2),
            headroom: Duration::from_secs(30),
            fair_window: Duration::ZERO,
            lower_prefill_share: LOWER_PREFILL_SHARE,
            sheddable_waits: true,
            engine_tags: false,
        }
    }
}

/// Where short prompts may go when some replicas are tagged `long`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum LongLane {
    /// Like any replica.
    #[default]
    Shared,
    /// Never.
    Exclusive,
    /// Only when no other replica can take them.
    Avoid,
    /// Never, unless the session is cached there.
    AvoidUnlessWarm,
}

impl LongLane {
    pub const ALL: [LongLane; 4] = [
        LongLane::Shared,
        LongLane::Exclusive,
        LongLane::Avoid,
        LongLane::AvoidUnlessWarm,
    ];

    /// The value as `HEARTH_LONG_LANE` spells it.
    pub fn as_str(self) -> &'static str {
        match self {
            LongLane::Shared => "shared",
            LongLane::Exclusive => "exclusive",
            LongLane::Avoid => "avoid",
            LongLane::AvoidUnlessWarm => "avoid-unless-warm",
        }
    }
}

impl fmt::Display for LongLane {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for LongLane {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        LongLane::ALL
            .into_iter()
            .find(|l| l.as_str() == s)
            .ok_or_else(|| {
                format!("unknown long lane {s:?}: expected shared, exclusive, avoid or avoid-unless-warm")
            })
    }
}

/// How prefix overlap turns into credit.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum AffinityBasis {
    /// `min(overlap, cap)`: every matching block counts. Shared system
    /// prompts make every replica look equally warm.
    Absolute,
    /// `min(overlap - min_overlap, cap)`: only blocks beyond what the
    /// least-warm candidate also holds count.
    Marginal,
    /// `min(W, cap) - min(W - overlap, cap)`, `W` = the warmest candidate's
    /// overlap: credit measured against the warmest replica.
    #[default]
    Relative,
}

impl AffinityBasis {
    pub const ALL: [AffinityBasis; 3] = [
        AffinityBasis::Absolute,
        AffinityBasis::Marginal,
        AffinityBasis::Relative,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            AffinityBasis::Absolute => "absolute",
            AffinityBasis::Marginal => "marginal",
            AffinityBasis::Relative => "relative",
        }
    }
}

impl fmt::Display for AffinityBasis {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for AffinityBasis {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        AffinityBasis::ALL
            .into_iter()
            .find(|b| b.as_str().eq_ignore_ascii_case(s))
            .ok_or_else(|| {
                format!("unknown affinity basis {s:?}: expected absolute, marginal or relative")
            })
    }
}

/// The knobs of the scoring rule.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ScoreParams {
    pub basis: AffinityBasis,
    /// Credit is capped at this many blocks.
    pub cap: u32,
    /// Blocks of credit that one unit of load outweighs.
    pub alpha: f64,
    /// Credit cap, in blocks, for a request that continues no earlier
    /// prompt (the lower of this and `cap` applies).
    pub first_turn_cap: u32,
}

impl ScoreParams {
    /// The parameters for one request: `continues` is whether its prompt
    /// extends an earlier one (a later turn of a conversation). A first
    /// turn overlaps only with prefixes other conversations sent (harness
    /// and system prompts), which a replica reads once and then keeps, while
    /// the conversation's placement holds its load for its whole life.
    /// `sequel_share` is how many recent first turns went on to a second
    /// turn (0 to 1): the first-turn cap is divided by it, so one-shot
    /// traffic (no placement outlives its request) keeps the full cap (a
    /// first-turn cap of 0 stays 0).
    pub fn for_request(&self, continues: bool, sequel_share: f64) -> ScoreParams {
        if continues {
            *self
        } else {
            let share = sequel_share.clamp(0.0, 1.0);
            let first = if self.first_turn_cap == 0 {
                0
            } else if share * f64::from(self.cap) <= f64::from(self.first_turn_cap) {
                self.cap
            } else {
                (f64::from(self.first_turn_cap) / share).round() as u32
            };
            ScoreParams {
                cap: self.cap.min(first),
                ..*self
            }
        }
    }
}
