//! The engine's scheduler and cost model as a pure state machine over
//! engine time: both the HTTP server (which sleeps through each step,
//! time-scaled) and the discrete-event benchmark (which jumps to the end of
//! each step) run this same code.
//!
//! Model, per replica:
//! - a FIFO waiting queue and at most `max_running` running sequences;
//! - on admission a sequence looks its prompt up in the prefix cache (the
//!   leading cached blocks are not prefilled again) and pins its blocks, so
//!   blocks in use are never evicted;
//! - every step runs one decode token for each decoding sequence and fills
//!   the rest of a `max_batched_tokens` budget with prefill chunks, first
//!   come first served (chunked prefill shares steps with decode);
//! - a step lasts `step_base_us + step_per_seq_us * decoding +
//!   prefill_us_per_token * prefill_tokens`: decode steps grow with the
//!   batch, prefill costs per uncached token;
//! - the step that finishes a sequence's prefill yields its first token.

use std::collections::VecDeque;

use serde::{Deserialize, Serialize};

use super::cache::PrefixCache;

/// Cost-model and scheduler settings (engine microseconds).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CostModel {
    /// Sequences running at once; the rest wait in FIFO order (default 64).
    pub max_running: usize,
    /// Tokens per step (decode tokens + prefill chunk) (default 4096).
    pub max_batched_tokens: usize,
    /// Fixed cost of a step (default 2800 us).
    pub step_base_us: f64,
    /// Added per decoding sequence in the step (default 200 us).
    pub step_per_seq_us: f64,
    /// Prefill cost per uncached prompt token (default 100 us: 10k tok/s).
    pub prefill_us_per_token: f64,
}

impl Default for CostModel {
    fn default() -> Self {
        CostModel {
            max_running: 64,
            max_batched_tokens: 4096,
            step_base_us: 2800.0,
            step_per_seq_us: 200.0,
            prefill_us_per_token: 100.0,
        }
    }
}

impl CostModel {
    /// Every cost zero: answers as fast as the host can (for tests/demos).
    pub fn instant() -> Self {
        CostModel {
            step_base_us: 0.0,
            step_per_seq_us: 0.0,
            prefill_us_per_token: 0.0,
            ..CostModel::default()
        }
    }

    pub fn validate(&self) -> Result<(), String> {
        if self.max_running == 0 || self.max_batched_tokens == 0 {
            return Err("max_running and max_batched_tokens must be at least 1".into());
        }
        for (name, v) in [
            ("step_base_us", self.step_base_us),
            ("step_per_seq_us", self.step_per_seq_us),
            ("prefill_us_per_token", self.prefill_us_per_token),
        ] {
            if !v.is_finite() || v < 0.0 {
                return Err(format!("{name} must be a finite number >= 0 (got {v})"));
            }
        }
        Ok(())
    }
}

#[derive(Debug)]
struct Seq {
    id: u64,
    hashes: Vec<u64>,
    prompt_tokens: u32,
    cached_tokens: u32,
    prefill_left: u32,
    output_tokens: u32,
    produced: u32,
}

/// Something a step did to a sequence.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SeqEvent {
    /// The first output token is ready (prefill done).
    FirstToken {
        id: u64,
        prompt_tokens: u32,
        cached_tokens: u32,
    },
    /// One more output token (only when token tracking is on).
    Token { id: u64, index: u32 },
    /// The last output token is ready; the sequence has left the engine.
    Finished { id: u64, output_tokens: u32 },
}

/// One engine step: how long it takes and what it produces at its end.
#[derive(Clone, Debug, PartialEq)]
pub struct Step {
    pub duration_us: f64,
    pub events: Vec<SeqEvent>,
    pub prefill_tokens: u32,
    pub decode_tokens: u32,
}

/// Counters in the units vLLM reports.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct CoreCounters {
    pub admitted: u64,
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
    pub prefill_tokens: u64,
    pub output_tokens: u64,
    pub finished: u64,
}

/// One replica's scheduler, cache and counters.
#[derive(Debug)]
pub struct EngineCore {
    cost: CostModel,
    block_tokens: u32,
    cache: PrefixCache,
    waiting: VecDeque<Seq>,
    running: Vec<Seq>,
    track_tokens: bool,
    pub counters: CoreCounters,
}

impl EngineCore {
    /// `capacity_tokens` of KV cache in blocks of `block_tokens`.
    pub fn new(cost: CostModel, block_tokens: usize, capacity_tokens: usize) -> Self {
        EngineCore {
            cost,
            block_tokens: block_tokens.max(1) as u32,
            cache: PrefixCache::new(capacity_tokens / block_tokens.max(1)),
            waiting: VecDeque::new(),
            running: Vec::new(),
            track_tokens: false,
            counters: CoreCounters::default(),
        }
    }

    /// Also report every output token (the HTTP server streams them).
    pub fn with_token_events(mut self) -> Self {
        self.track_tokens = true;
        self
    }

    /// Logs the cache's changes as KV cache events
    /// ([`EngineCore::take_cache_events`]).
    pub fn with_cache_events(mut self) -> Self {
        self.cache = std::mem::replace(&mut self.cache, PrefixCache::new(0))
            .with_events(self.block_tokens as usize);
        self
    }

    /// The cache's events since the last call.
    pub fn take_cache_events(&mut self) -> Vec<hearth_wire::kv_events::Event> {
        self.cache.take_events()
    }

    /// Drops the cache's blocks that no running sequence uses (a restart of
    /// the engine's cache; its running requests carry on).
    pub fn flush_cache(&mut self) {
        self.cache.flush();
    }

    pub fn cost(&self) -> &CostModel {
        &self.cost
    }

    /// The prefix cache (the oracle policy reads it).
    pub fn cache(&self) -> &PrefixCache {
        &self.cache
    }

    /// The share of a prompt (its engine block hashes) cached here.
    pub fn cached_share(&self, hashes: &[u64]) -> f64 {
        if hashes.is_empty() {
            return 0.0;
        }
        self.cache.matched_blocks(hashes) as f64 / hashes.len() as f64
    }

    /// Leading prompt tokens of `hashes` the cache holds now.
    pub fn cached_tokens_for(&self, hashes: &[u64]) -> u64 {
        self.cache.matched_blocks(hashes) as u64 * u64::from(self.block_tokens)
    }

    pub fn running(&self) -> usize {
        self.running.len()
    }

    pub fn waiting(&self) -> usize {
        self.waiting.len()
    }

    pub fn is_idle(&self) -> bool {
        self.running.is_empty() && self.waiting.is_empty()
    }

    /// Share of KV blocks held by running sequences (vLLM's
    /// `kv_cache_usage_perc`, 0..=1).
    pub fn kv_usage(&self) -> f64 {
        let cap = self.cache.capacity_blocks();
        if cap == 0 {
            0.0
        } else {
            (self.cache.pinned_blocks() as f64 / cap as f64).min(1.0)
        }
    }

    /// Blocks held by the cache now, and its capacity.
    pub fn cache_blocks(&self) -> (usize, usize) {
        (self.cache.len(), self.cache.capacity_blocks())
    }

    /// Queues a request: `hashes` are the prompt's block hashes (see
    /// [`super::cache::block_hashes`]), `prompt_tokens` its length.
    pub fn submit(&mut self, id: u64, hashes: Vec<u64>, prompt_tokens: u32, output_tokens: u32) {
        self.waiting.push_back(Seq {
            id,
            hashes,
            prompt_tokens: prompt_tokens.max(1),
            cached_tokens: 0,
            prefill_left: 0,
            output_tokens: output_tokens.max(1),
            produced: 0,
        });
    }

    /// Drops a request wherever it is (its client went away).
    pub fn cancel(&mut self, id: u64) {
        if let Some(i) = self.waiting.iter().position(|s| s.id == id) {
            self.waiting.remove(i);
        }
        if let Some(i) = self.running.iter().position(|s| s.id == id) {
            let seq = self.running.remove(i);
            self.cache.unpin(&seq.hashes);
        }
    }

    fn admit(&mut self) {
        while self.running.len() < self.cost.max_running {
            let Some(mut seq) = self.waiting.pop_front() else {
                break;
            };
            let matched = self.cache.admit(&seq.hashes) as u32;
            // At least the last prompt token is computed, as engines do.
            seq.cached_tokens = (matched * self.block_tokens).min(seq.prompt_tokens - 1);
            seq.prefill_left = seq.prompt_tokens - seq.cached_tokens;
            self.cache.pin(&seq.hashes);
            self.counters.admitted += 1;
            self.counters.prompt_tokens += u64::from(seq.prompt_tokens);
            self.counters.cached_tokens += u64::from(seq.cached_tokens);
            self.running.push(seq);
        }
    }

    /// Plans and applies the next step; `None` when there is nothing to do.
    /// The step's events happen `duration_us` after it starts.
    pub fn step(&mut self) -> Option<Step> {
        self.admit();
        if self.running.is_empty() {
            return None;
        }
        let mut events = Vec::new();
        let decoding = self.running.iter().filter(|s| s.prefill_left == 0).count() as u32;
        let mut budget = (self.cost.max_batched_tokens as u32).saturating_sub(decoding);
        let mut prefill = 0u32;
        for seq in &mut self.running {
            if seq.prefill_left == 0 {
                seq.produced += 1;
                if self.track_tokens && seq.produced < seq.output_tokens {
                    events.push(SeqEvent::Token {
                        id: seq.id,
                        index: seq.produced - 1,
                    });
                }
            } else if budget > 0 {
                let chunk = seq.prefill_left.min(budget);
                budget -= chunk;
                prefill += chunk;
                seq.prefill_left -= chunk;
                if seq.prefill_left == 0 {
                    seq.produced = 1;
                    events.push(SeqEvent::FirstToken {
                        id: seq.id,
                        prompt_tokens: seq.prompt_tokens,
                        cached_tokens: seq.cached_tokens,
                    });
                }
            }
        }
        let mut i = 0;
        while i < self.running.len() {
            let s = &self.running[i];
            if s.prefill_left == 0 && s.produced >= s.output_tokens {
                let seq = self.running.swap_remove(i);
                self.cache.unpin(&seq.hashes);
                self.counters.finished += 1;
                events.push(SeqEvent::Finished {
                    id: seq.id,
                    output_tokens: seq.output_tokens,
                });
            } else {
                i += 1;
            }
        }
        let decode_tokens = decoding;
        self.counters.prefill_tokens += u64::from(prefill);
        self.counters.output_tokens += u64::from(decode_tokens)
            + events
                .iter()
                .filter(|e| matches!(e, SeqEvent::FirstToken { .. }))
                .count() as u64;
        let duration_us = self.cost.step_base_us
            + self.cost.step_per_seq_us * f64::from(decoding)
            + self.cost.prefill_us_per_token * f64::from(prefill);
        Some(Step {
            duration_us,
            events,
            prefill_tokens: prefill,
            decode_tokens,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn core(max_running: usize) -> EngineCore {
        EngineCore::new(
            CostModel {
                max_running,
                max_batched_tokens: 100,
                step_base_us: 1000.0,
                step_per_seq_us: 10.0,
                prefill_us_per_token: 2.0,
            },
            16,
            16 * 100,
        )
    }

    fn run(core: &mut EngineCore) -> Vec<(f64, SeqEvent)> {
        let mut t = 0.0;
        let mut out = Vec::new();
        for _ in 0..10_000 {
            let Some(step) = core.step() else { break };
            t += step.duration_us;
            out.extend(step.events.into_iter().map(|e| (t, e)));
        }
        out
    }

    #[test]
    fn prefill_is_chunked_and_costs_per_uncached_token() {
        let mut c = core(8);
        // 250 prompt tokens, 3 output tokens: prefill chunks of 100, 100, 50.
        c.submit(1, (0..15).collect(), 250, 3);
        let ev = run(&mut c);
        let first = ev
            .iter()
            .find(|(_, e)| matches!(e, SeqEvent::FirstToken { .. }))
            .unwrap();
        assert_eq!(first.0, 3.0 * 1000.0 + 250.0 * 2.0);
        // Two more decode steps with one sequence each.
        let (t_end, last) = ev.last().unwrap();
        assert_eq!(*t_end, first.0 + 2.0 * 1010.0);
        assert_eq!(
            *last,
            SeqEvent::Finished {
                id: 1,
                output_tokens: 3
            }
        );
        assert!(c.is_idle());
        assert_eq!(c.counters.prefill_tokens, 250);
    }

    #[test]
    fn a_cached_prefix_is_not_prefilled_again() {
        let mut c = core(8);
        c.submit(1, (0..10).collect(), 170, 1);
        run(&mut c);
        // Same first 10 blocks (160 tokens) plus more: only the rest is read.
        c.submit(2, (0..12).collect(), 200, 1);
        let ev = run(&mut c);
        assert_eq!(
            ev[0].1,
            SeqEvent::FirstToken {
                id: 2,
                prompt_tokens: 200,
                cached_tokens: 160
            }
        );
        assert_eq!(c.counters.prefill_tokens, 170 + 40);
        // A fully cached prompt still computes its last token.
        c.submit(3, (0..10).collect(), 160, 1);
        let ev = run(&mut c);
        assert!(matches!(
            ev[0].1,
            SeqEvent::FirstToken {
                cached_tokens: 159,
                ..
            }
        ));
    }

    #[test]
    fn decode_steps_grow_with_the_batch_and_extra_requests_queue() {
        let mut c = core(2);
        for id in 0..3 {
            c.submit(id, vec![100 + id], 10, 5);
        }
        let step = c.step().unwrap();
        assert_eq!(c.running(), 2);
        assert_eq!(c.waiting(), 1);
        assert_eq!(step.prefill_tokens, 20);
        let step = c.step().unwrap();
        assert_eq!(step.decode_tokens, 2);
        assert_eq!(step.duration_us, 1000.0 + 2.0 * 10.0);
        let ev = run(&mut c);
        // FIFO: request 2 starts only after 0 and 1 finish.
        let pos = |want: SeqEvent| ev.iter().position(|(_, e)| *e == want).unwrap();
        let done0 = pos(SeqEvent::Finished {
            id: 0,
            output_tokens: 5,
        });
        let first2 = ev
            .iter()
            .position(|(_, e)| matches!(e, SeqEvent::FirstToken { id: 2, .. }))
            .unwrap();
        assert!(first2 > done0);
    }

    #[test]
    fn running_blocks_are_pinned_and_kv_usage_reports_them() {
        let mut c = core(4);
        // Capacity 100 blocks; a running 80-block prompt stays cached even
        // when another 80-block prompt arrives.
        c.submit(1, (0..80).collect(), 80 * 16, 50);
        c.step();
        assert!((c.kv_usage() - 0.8).abs() < 1e-9);
        c.submit(2, (1000..1080).collect(), 80 * 16, 1);
        c.step();
        assert_eq!(c.cache().matched_blocks(&(0..80).collect::<Vec<_>>()), 80);
        run(&mut c);
        assert_eq!(c.kv_usage(), 0.0);
        c.cancel(99);
    }
}
