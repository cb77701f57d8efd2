//! The routing policies the benchmark compares, all behind one interface.
//!
//! - Envoy's built-in load balancers as a plain mesh offers them:
//!   `round_robin`, `random`, `least_request` (power of two choices over
//!   Envoy's own active-request counts), `ring_hash` on a session header.
//! - Hearth (`hearth_absolute`, `hearth_marginal`, `hearth_relative`): the
//!   sidecar's own [`hearth_ext_proc::Router`], fed the real fingerprint of
//!   each request body; its [`Decision`] is held for the request's life, so
//!   its load accounting is the sidecar's.
//! - `hearth_informed`: `hearth_relative` whose overlaps come from the
//!   engines' real caches instead of the sidecar's warmth index (the
//!   share of the prompt each engine holds, in the fingerprint's blocks,
//!   given to the router's simulation-only `Router::decide_knowing_at`):
//!   the same scoring with perfect knowledge, the yardstick for what the
//!   approximate index costs. Not a practical router.
//! - `oracle`: reads every engine's real prefix cache and sends each request
//!   where the most of its prompt is cached (ties: fewest requests, then
//!   round-robin). An upper bound for the cached fraction, not a practical
//!   router.
//! - Labelled emulations of two peers, from their published defaults:
//!   `gie_default_emulated` (Gateway API Inference Extension endpoint picker:
//!   prefix-cache scorer weight 3 over 64-character blocks, at most 256
//!   blocks, an LRU index per server; queue scorer weight 2; KV-utilisation
//!   scorer weight 2; highest total wins) and `sglang_cache_aware_emulated`
//!   (SGLang router: if `max_load - min_load > 64` and `max_load > 1.5 *
//!   min_load` go to the least loaded; else the worker with the longest
//!   prefix match if the match rate exceeds 0.3, else the worker with the
//!   smallest tree). Metrics they scrape are read instantly in the
//!   simulator (no scrape delay), which favours them slightly.

use std::collections::hash_map::DefaultHasher;
use std::hash::Hasher;
use std::sync::Arc;
use std::time::Instant;

use hearth_router::{AffinityBasis, Decision, RequestInfo, Router, RouterParams, UpstreamSpec};
use serde::Serialize;

use crate::engine::cache::{block_hashes, PrefixCache};
use crate::engine::core::EngineCore;
use crate::rng::Rng;

/// Every policy the benchmark knows.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum PolicyKind {
    RoundRobin,
    Random,
    LeastRequest,
    RingHash,
    HearthAbsolute,
    HearthMarginal,
    HearthRelative,
    HearthInformed,
    GieDefaultEmulated,
    SglangCacheAwareEmulated,
    Oracle,
}

impl PolicyKind {
    pub const ALL: [PolicyKind; 11] = [
        PolicyKind::RoundRobin,
        PolicyKind::Random,
        PolicyKind::LeastRequest,
        PolicyKind::RingHash,
        PolicyKind::HearthAbsolute,
        PolicyKind::HearthMarginal,
        PolicyKind::HearthRelative,
        PolicyKind::HearthInformed,
        PolicyKind::GieDefaultEmulated,
        PolicyKind::SglangCacheAwareEmulated,
        PolicyKind::Oracle,
    ];

    pub fn name(self) -> &'static str {
        match self {
            PolicyKind::RoundRobin => "round_robin",
            PolicyKind::Random => "random",
            PolicyKind::LeastRequest => "least_request",
            PolicyKind::RingHash => "ring_hash",
            PolicyKind::HearthAbsolute => "hearth_absolute",
            PolicyKind::HearthMarginal => "hearth_marginal",
            PolicyKind::HearthRelative => "hearth_relative",
            PolicyKind::HearthInformed => "hearth_informed",
            PolicyKind::GieDefaultEmulated => "gie_default_emulated",
            PolicyKind::SglangCacheAwareEmulated => "sglang_cache_aware_emulated",
            PolicyKind::Oracle => "oracle",
        }
    }

    pub fn parse(s: &str) -> Option<PolicyKind> {
        PolicyKind::ALL.into_iter().find(|p| p.name() == s)
    }

    /// The sidecar's credit basis, for the Hearth policies.
    pub fn hearth_basis(self) -> Option<AffinityBasis> {
        match self {
            PolicyKind::HearthAbsolute => Some(AffinityBasis::Absolute),
            PolicyKind::HearthMarginal => Some(AffinityBasis::Marginal),
            PolicyKind::HearthRelative | PolicyKind::HearthInformed => {
                Some(AffinityBasis::Relative)
            }
            _ => None,
        }
    }
}

/// What the Hearth policies run with: the sidecar's own settings
/// (`HEARTH_NAME=VALUE`, turned into the router's parameters by the
/// sidecar's parser, [`hearth_ext_proc::config::settings_from_pairs`]),
/// and the few things that are the benchmark's, not a sidecar's: which
/// replicas are tagged `long`, how many sidecars split the traffic and
/// how late their updates reach each other.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct HearthKnobs {
    /// The sidecar settings given, in order (a later one wins): the
    /// scenario's, then the command line's `--set`. Every other setting
    /// is at the sidecar's default.
    settings: Vec<(String, String)>,
    /// What the sidecar's parser makes of them.
    #[serde(serialize_with = "as_debug")]
    params: RouterParams,
    /// The last this many replicas are tagged `long`.
    pub long_replicas: usize,
    /// Sidecars behind a random split (each request reaches one).
    pub sidecars: usize,
    /// With several sidecars: each one's updates reach its peers this
    /// many milliseconds later (as the bus would carry them); None: they
    /// share nothing.
    pub peer_delay_ms: Option<f64>,
    /// The engines publish KV cache events and the sidecars read them
    /// (each replica listed with `kv_events=`; the simulator hands the
    /// batches to the routers directly, numbered per engine process).
    pub kv_events: bool,
}

fn as_debug<S: serde::Serializer>(p: &RouterParams, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&format!("{p:?}"))
}

impl Default for HearthKnobs {
    /// The sidecar's own defaults.
    fn default() -> Self {
        let params = crate::settings::parse(&[])
            .expect("the sidecar's defaults parse")
            .router_params();
        HearthKnobs {
            settings: Vec::new(),
            params,
            long_replicas: 0,
            sidecars: 1,
            peer_delay_ms: None,
            kv_events: false,
        }
    }
}

impl HearthKnobs {
    /// Adds sidecar settings (after those given before, so they win), and
    /// rebuilds the router's parameters from all of them with the
    /// sidecar's parser.
    pub fn set<I, K, V>(&mut self, pairs: I) -> anyhow::Result<()>
    where
        I: IntoIterator<Item = (K, V)>,
        K: Into<String>,
        V: Into<String>,
    {
        let mut settings = self.settings.clone();
        settings.extend(pairs.into_iter().map(|(k, v)| (k.into(), v.into())));
        self.params = crate::settings::parse(&settings)?.router_params();
        self.settings = settings;
        Ok(())
    }

    /// Drops every value given for `name` (back to the sidecar's default).
    pub fn unset(&mut self, name: &str) {
        let mut settings = std::mem::take(&mut self.settings);
        settings.retain(|(k, _)| k != name);
        self.settings = Vec::new();
        self.set(settings)
            .expect("settings that parsed still parse with one fewer");
    }

    /// The sidecar settings given, in order.
    pub fn settings(&self) -> &[(String, String)] {
        &self.settings
    }

    /// The router's parameters, as the sidecar would run with them.
    pub fn params(&self) -> &RouterParams {
        &self.params
    }

    /// The router's parameters under a policy's credit basis.
    pub fn params_for(&self, basis: AffinityBasis) -> RouterParams {
        let mut p = self.params;
        p.score.basis = basis;
        p
    }

    /// The address the sidecar knows replica `i` by.
    pub fn replica_addr(&self, i: usize) -> std::net::SocketAddr {
        ([127, 0, 0, 1], 20_000 + i as u16).into()
    }

    /// `replicas` engines (`engine-N`), the last `long_replicas` tagged
    /// `long`.
    pub fn upstreams(&self, replicas: usize) -> Vec<UpstreamSpec> {
        (0..replicas)
            .map(|i| UpstreamSpec {
                addr: self.replica_addr(i),
                id: Some(format!("engine-{i}")),
                models: Vec::new(),
                long: i + self.long_replicas >= replicas,
                dp_ranks: 1,
                short_output: false,
                tls: false,
                kv_events: self.kv_events.then(|| {
                    hearth_router::EventEndpoint::Tcp(([127, 0, 0, 1], 30_000 + i as u16).into())
                }),
                kv_events_replay: None,
            })
            .collect()
    }

    /// A router over `replicas` engines under `basis`.
    pub fn router(&self, basis: AffinityBasis, replicas: usize) -> Arc<Router> {
        Router::new(self.params_for(basis), &self.upstreams(replicas))
    }
}

/// What a policy may look at for one request.
pub struct RouteInput<'a> {
    /// The prompt as the engine renders it.
    pub prompt: &'a [u8],
    /// The engine's block hashes of that prompt.
    pub engine_hashes: &'a [u64],
    /// Hearth's fingerprint of the body (as the wasm filter computes it).
    pub fingerprint: Option<&'a hearth_wire::Fingerprint>,
    pub session: u64,
}

/// A routing decision, held until the request ends.
pub struct Routed {
    pub replica: usize,
    /// The sidecar's decision: dropping it releases its load reservation.
    pub hearth: Option<Decision>,
    /// Which of several sidecars decided.
    pub sidecar: Option<usize>,
}

/// One policy instance for one run.
pub enum Policy {
    RoundRobin(usize),
    Random(Rng),
    LeastRequest(Rng),
    RingHash(Vec<(u64, usize)>),
    /// The sidecar's router; `true`: told the engines' real overlaps
    /// (`hearth_informed`).
    Hearth(Arc<Router>, bool),
    /// Several sidecars (`--sidecars`), each request reaching one at random;
    /// they share what they learn when `--peer-delay-ms` is set.
    HearthSplit(Vec<Arc<Router>>, Rng),
    Oracle(usize),
    Gie(GieState),
    Sglang(SglangState),
}

pub struct GieState {
    index: Vec<PrefixCache>,
    rng: Rng,
}

pub struct SglangState {
    trees: Vec<PrefixCache>,
}

/// GIE prefix scorer: 64-character blocks, at most 256 of them.
const GIE_BLOCK_CHARS: usize = 64;
const GIE_MAX_BLOCKS: usize = 256;
const GIE_LRU_PER_SERVER: usize = 31_250;
/// SGLang router defaults.
const SGLANG_CACHE_THRESHOLD: f64 = 0.3;
const SGLANG_BALANCE_ABS: f64 = 64.0;
const SGLANG_BALANCE_REL: f64 = 1.5;
/// SGLang's default max_tree_size (2^26 characters), in 64-byte blocks.
const SGLANG_TREE_BLOCKS: usize = (1 << 26) / 64;
/// Envoy ring_hash default minimum ring size.
const RING_SIZE: usize = 1024;

fn hash64(a: u64, b: u64) -> u64 {
    let mut h = DefaultHasher::new();
    h.write_u64(a);
    h.write_u64(b);
    h.finish()
}

impl Policy {
    /// The sidecars behind a Hearth policy (none for the others).
    pub fn routers(&self) -> Vec<Arc<Router>> {
        match self {
            Policy::Hearth(r, _) => vec![Arc::clone(r)],
            Policy::HearthSplit(rs, _) => rs.clone(),
            _ => Vec::new(),
        }
    }

    pub fn new(kind: PolicyKind, replicas: usize, seed: u64, knobs: &HearthKnobs) -> Policy {
        let rng = Rng::derive(seed, 0x9011C7);
        if let Some(basis) = kind.hearth_basis() {
            // The informed yardstick is one router that knows everything.
            if knobs.sidecars > 1 && kind != PolicyKind::HearthInformed {
                let routers: Vec<Arc<Router>> = (0..knobs.sidecars)
                    .map(|_| knobs.router(basis, replicas))
                    .collect();
                if knobs.peer_delay_ms.is_some() {
                    routers.iter().for_each(|r| r.enable_peers());
                }
                return Policy::HearthSplit(routers, rng);
            }
            return Policy::Hearth(
                knobs.router(basis, replicas),
                kind == PolicyKind::HearthInformed,
            );
        }
        match kind {
            PolicyKind::RoundRobin => Policy::RoundRobin(0),
            PolicyKind::Random => Policy::Random(rng),
            PolicyKind::LeastRequest => Policy::LeastRequest(rng),
            PolicyKind::RingHash => {
                let per = RING_SIZE.div_ceil(replicas.max(1));
                let mut ring: Vec<(u64, usize)> = (0..replicas)
                    .flat_map(|r| (0..per).map(move |i| (hash64(r as u64, i as u64), r)))
                    .collect();
                ring.sort_unstable();
                Policy::RingHash(ring)
            }
            PolicyKind::Oracle => Policy::Oracle(0),
            PolicyKind::GieDefaultEmulated => Policy::Gie(GieState {
                index: (0..replicas)
                    .map(|_| PrefixCache::new(GIE_LRU_PER_SERVER))
                    .collect(),
                rng,
            }),
            PolicyKind::SglangCacheAwareEmulated => Policy::Sglang(SglangState {
                trees: (0..replicas)
                    .map(|_| PrefixCache::new(SGLANG_TREE_BLOCKS))
                    .collect(),
            }),
            _ => unreachable!("Hearth policies are handled above"),
        }
    }

    /// Picks a replica. `inflight[r]` is the proxy's count of requests in
    /// flight to replica `r` (what Envoy's least_request and SGLang's
    /// router count); `engines` are the replicas' real states; `now` is
    /// the engine time the request arrives at.
    pub fn route(
        &mut self,
        req: &RouteInput,
        inflight: &[u32],
        engines: &[EngineCore],
        now: Instant,
    ) -> Routed {
        let n = inflight.len();
        let replica = match self {
            Policy::RoundRobin(next) => {
                let r = *next % n;
                *next += 1;
                r
            }
            Policy::Random(rng) => rng.below(n),
            Policy::LeastRequest(rng) => {
                let a = rng.below(n);
                if n == 1 {
                    a
                } else {
                    let b = (a + 1 + rng.below(n - 1)) % n;
                    if inflight[b] < inflight[a] {
                        b
                    } else {
                        a
                    }
                }
            }
            Policy::RingHash(ring) => {
                let h = hash64(0x5E55_1011, req.session);
                let i = ring.partition_point(|(p, _)| *p < h);
                ring[i % ring.len()].1
            }
            Policy::Hearth(..) | Policy::HearthSplit(..) => {
                let (router, sidecar, informed) = match self {
                    Policy::Hearth(router, informed) => (Arc::clone(router), None, *informed),
                    Policy::HearthSplit(routers, rng) => {
                        let k = rng.below(routers.len());
                        (Arc::clone(&routers[k]), Some(k), false)
                    }
                    _ => unreachable!("matched above"),
                };
                let info = match req.fingerprint {
                    Some(fp) => RequestInfo {
                        hashes: fp.hashes.clone(),
                        prompt_bytes: fp.prompt_bytes,
                        model: Some(fp.model.clone()),
                        max_output_tokens: fp.max_output_tokens,
                        cache: fp.cache,
                        priority: 0,
                        flow: 0,
                    },
                    None => RequestInfo::default(),
                };
                // The informed yardstick is told each engine's real
                // cached share of the prompt, in the fingerprint's blocks.
                let known: Option<Vec<usize>> = match req.fingerprint {
                    Some(fp) if informed => {
                        let blocks = fp.prompt_bytes as f64 / f64::from(fp.block_size.max(1));
                        Some(
                            engines
                                .iter()
                                .map(|e| match e.cached_share(req.engine_hashes) {
                                    // The whole prompt, its last partial block too.
                                    share if share >= 1.0 => fp.hashes.len(),
                                    share => (share * blocks) as usize,
                                })
                                .collect(),
                        )
                    }
                    _ => None,
                };
                let decision = match &known {
                    Some(overlaps) => router.decide_knowing_at(&info, overlaps, now),
                    None => router.decide_at(&info, now),
                }
                .expect("every simulated replica serves every model");
                return Routed {
                    replica: decision.primary(),
                    hearth: Some(decision),
                    sidecar,
                };
            }
            Policy::Oracle(rr) => {
                *rr += 1;
                let start = *rr % n;
                (0..n)
                    .map(|k| (k, (start + k) % n))
                    .max_by_key(|&(k, r)| {
                        let cached = engines[r].cached_tokens_for(req.engine_hashes);
                        let busy = engines[r].running() + engines[r].waiting();
                        // Deepest cache first, then fewest requests, then
                        // the earliest in round-robin order.
                        (cached, std::cmp::Reverse(busy), std::cmp::Reverse(k))
                    })
                    .map_or(0, |(_, r)| r)
            }
            Policy::Gie(state) => {
                let head = &req.prompt[..req.prompt.len().min(GIE_BLOCK_CHARS * GIE_MAX_BLOCKS)];
                let mut blocks = block_hashes(head, GIE_BLOCK_CHARS);
                if blocks.is_empty() {
                    blocks.push(hash64(0x61E, head.len() as u64));
                }
                let queues: Vec<f64> = engines.iter().map(|e| e.waiting() as f64).collect();
                let (qmin, qmax) = queues
                    .iter()
                    .fold((f64::MAX, f64::MIN), |(lo, hi), &q| (lo.min(q), hi.max(q)));
                let scores: Vec<f64> = (0..n)
                    .map(|r| {
                        let prefix =
                            state.index[r].matched_blocks(&blocks) as f64 / blocks.len() as f64;
                        let queue = if qmax > qmin {
                            (qmax - queues[r]) / (qmax - qmin)
                        } else {
                            1.0
                        };
                        let kv = 1.0 - engines[r].kv_usage();
                        3.0 * prefix + 2.0 * queue + 2.0 * kv
                    })
                    .collect();
                let best = scores.iter().copied().fold(f64::MIN, f64::max);
                let ties: Vec<usize> = (0..n).filter(|&r| scores[r] >= best - 1e-12).collect();
                let r = ties[state.rng.below(ties.len())];
                state.index[r].admit(&blocks);
                r
            }
            Policy::Sglang(state) => {
                let loads: Vec<f64> = inflight.iter().map(|&x| f64::from(x)).collect();
                let (min_load, max_load) = loads
                    .iter()
                    .fold((f64::MAX, f64::MIN), |(lo, hi), &l| (lo.min(l), hi.max(l)));
                let least = (0..n)
                    .min_by(|&a, &b| loads[a].total_cmp(&loads[b]))
                    .unwrap_or(0);
                let imbalanced = max_load - min_load > SGLANG_BALANCE_ABS
                    && max_load > min_load * SGLANG_BALANCE_REL;
                let r = if imbalanced {
                    least
                } else {
                    let matched: Vec<usize> = state
                        .trees
                        .iter()
                        .map(|t| t.matched_blocks(req.engine_hashes))
                        .collect();
                    let best = (0..n).max_by_key(|&r| (matched[r], n - r)).unwrap_or(0);
                    let rate = (matched[best] * 64) as f64 / req.prompt.len().max(1) as f64;
                    if rate > SGLANG_CACHE_THRESHOLD {
                        best
                    } else {
                        (0..n)
                            .min_by_key(|&r| (state.trees[r].len(), r))
                            .unwrap_or(0)
                    }
                };
                state.trees[r].admit(req.engine_hashes);
                r
            }
        };
        Routed {
            replica,
            hearth: None,
            sidecar: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::core::CostModel;

    fn engines(n: usize) -> Vec<EngineCore> {
        (0..n)
            .map(|_| EngineCore::new(CostModel::instant(), 16, 1 << 20))
            .collect()
    }

    fn input<'a>(prompt: &'a [u8], hashes: &'a [u64], session: u64) -> RouteInput<'a> {
        RouteInput {
            prompt,
            engine_hashes: hashes,
            fingerprint: None,
            session,
        }
    }

    fn pick(p: &mut Policy, req: &RouteInput, inflight: &[u32], e: &[EngineCore]) -> usize {
        p.route(req, inflight, e, Instant::now()).replica
    }

    #[test]
    fn round_robin_cycles_and_random_covers() {
        let e = engines(3);
        let mut p = Policy::new(PolicyKind::RoundRobin, 3, 1, &HearthKnobs::default());
        let req = input(b"x", &[], 0);
        let got: Vec<usize> = (0..6).map(|_| pick(&mut p, &req, &[0; 3], &e)).collect();
        assert_eq!(got, [0, 1, 2, 0, 1, 2]);
        let mut p = Policy::new(PolicyKind::Random, 3, 1, &HearthKnobs::default());
        let mut seen = [false; 3];
        for _ in 0..100 {
            seen[pick(&mut p, &req, &[0; 3], &e)] = true;
        }
        assert!(seen.iter().all(|s| *s));
    }

    #[test]
    fn least_request_avoids_the_busier_of_two() {
        let e = engines(2);
        let mut p = Policy::new(PolicyKind::LeastRequest, 2, 1, &HearthKnobs::default());
        let req = input(b"x", &[], 0);
        for _ in 0..20 {
            assert_eq!(pick(&mut p, &req, &[5, 1], &e), 1);
        }
    }

    #[test]
    fn ring_hash_is_sticky_per_session_and_spreads_sessions() {
        let e = engines(4);
        let mut p = Policy::new(PolicyKind::RingHash, 4, 1, &HearthKnobs::default());
        let mut used = std::collections::HashSet::new();
        for s in 0..64 {
            let req = input(b"x", &[], s);
            let r = pick(&mut p, &req, &[0; 4], &e);
            assert_eq!(pick(&mut p, &req, &[9, 9, 9, 9], &e), r);
            used.insert(r);
        }
        assert_eq!(used.len(), 4);
    }

    #[test]
    fn oracle_follows_the_real_cache() {
        let mut e = engines(3);
        e[2].submit(1, vec![1, 2, 3], 48, 1);
        while e[2].step().is_some() {}
        let mut p = Policy::new(PolicyKind::Oracle, 3, 1, &HearthKnobs::default());
        let hashes = [1, 2, 3, 4];
        assert_eq!(pick(&mut p, &input(b"x", &hashes, 0), &[0; 3], &e), 2);
    }

    #[test]
    fn hearth_policy_runs_the_sidecar_router_on_fingerprints() {
        let e = engines(2);
        let mut p = Policy::new(PolicyKind::HearthRelative, 2, 1, &HearthKnobs::default());
        let body = br#"{"model":"m","messages":[{"role":"user","content":"hello there"}]}"#;
        let fp = hearth_wire::fingerprint(
            hearth_wire::Endpoint::ChatCompletions,
            body,
            &hearth_wire::Params::default(),
        )
        .unwrap();
        let req = RouteInput {
            prompt: b"x",
            engine_hashes: &[],
            fingerprint: Some(&fp),
            session: 0,
        };
        let first = p.route(&req, &[0, 0], &e, Instant::now());
        let home = first.replica;
        assert!(first.hearth.is_some());
        drop(first);
        for _ in 0..5 {
            assert_eq!(p.route(&req, &[0, 0], &e, Instant::now()).replica, home);
        }
    }

    #[test]
    fn hearth_informed_follows_the_engines_caches_not_its_index() {
        let mut e = engines(3);
        let words = "lorem ipsum dolor ".repeat(1200);
        let body = format!(r#"{{"model":"m","messages":[{{"role":"user","content":"{words}"}}]}}"#);
        let fp = hearth_wire::fingerprint(
            hearth_wire::Endpoint::ChatCompletions,
            body.as_bytes(),
            &hearth_wire::Params::default(),
        )
        .unwrap();
        assert!(fp.hashes.len() >= 8, "{} blocks", fp.hashes.len());
        let engine_hashes: Vec<u64> = (1..=10).collect();
        let req = RouteInput {
            prompt: b"x",
            engine_hashes: &engine_hashes,
            fingerprint: Some(&fp),
            session: 0,
        };
        let warm = |e: &mut EngineCore| {
            e.submit(1, engine_hashes.clone(), 160, 1);
            while e.step().is_some() {}
        };
        warm(&mut e[2]);
        let mut p = Policy::new(PolicyKind::HearthInformed, 3, 1, &HearthKnobs::default());
        for _ in 0..3 {
            let routed = p.route(&req, &[0; 3], &e, Instant::now());
            assert_eq!(routed.replica, 2);
            assert_eq!(
                routed.hearth.as_ref().unwrap().overlap as usize,
                fp.hashes.len()
            );
        }
        // Replica 2 restarts and replica 0 reads the prompt: its index
        // still says 2, the engines say 0.
        e[2].flush_cache();
        warm(&mut e[0]);
        assert_eq!(p.route(&req, &[0; 3], &e, Instant::now()).replica, 0);
        // The plain policy, on the same engines, follows its index.
        let mut plain = Policy::new(PolicyKind::HearthRelative, 3, 1, &HearthKnobs::default());
        let home = plain.route(&req, &[0; 3], &e, Instant::now()).replica;
        for _ in 0..3 {
            assert_eq!(plain.route(&req, &[0; 3], &e, Instant::now()).replica, home);
        }
    }

    #[test]
    fn gie_prefers_its_prefix_index_unless_queues_differ() {
        let e = engines(2);
        let mut p = Policy::new(
            PolicyKind::GieDefaultEmulated,
            2,
            1,
            &HearthKnobs::default(),
        );
        let prompt = vec![b'a'; 64 * 10];
        let req = input(&prompt, &[], 0);
        let first = pick(&mut p, &req, &[0, 0], &e);
        for _ in 0..5 {
            assert_eq!(pick(&mut p, &req, &[0, 0], &e), first);
        }
    }

    #[test]
    fn sglang_matches_above_threshold_and_balances_when_skewed() {
        let e = engines(2);
        let mut p = Policy::new(
            PolicyKind::SglangCacheAwareEmulated,
            2,
            1,
            &HearthKnobs::default(),
        );
        let prompt = vec![b'a'; 64 * 4];
        let hashes = [11, 12, 13, 14];
        let req = input(&prompt, &hashes, 0);
        let first = pick(&mut p, &req, &[0, 0], &e);
        assert_eq!(
            pick(&mut p, &req, &[3, 0], &e),
            first,
            "cache beats mild load"
        );
        // A new prompt goes to the smaller tree.
        let other = [21, 22];
        let r = pick(&mut p, &input(&prompt[..128], &other, 1), &[0, 0], &e);
        assert_ne!(r, first);
        // Beyond both balance thresholds, load wins.
        let mut skew = [0u32; 2];
        skew[first] = 200;
        assert_ne!(pick(&mut p, &req, &skew, &e), first);
    }
}
