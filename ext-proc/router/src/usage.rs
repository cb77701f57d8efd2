//! Closing the loop: what an engine served from its cache, against what
//! the decision predicted.
//!
//! Every OpenAI-compatible engine can say in an answer's `usage` how many
//! prompt tokens it read from its cache
//! (`prompt_tokens_details.cached_tokens`). The decision predicted that
//! number: the chosen replica's overlap, in blocks, or, when its engine
//! says its KV cache holds fewer blocks than the index, what an LRU of
//! the engine's size would hold of the prompt
//! ([`crate::warmth::LruBlocks::held_within`]: the index keeps affinity
//! beyond the engine's cache, the prediction does not). The router
//! compares the two, per replica
//! ([`crate::Router::record_usage`] takes the report):
//!
//! - **Bytes per token**: the fingerprint counts canonical prompt bytes and
//!   the engine counts tokens; each replica's ratio (`prompt_bytes /
//!   prompt_tokens`, a moving average) converts one into the other.
//! - **A miss** (feedback on): a continuing turn (its prompt was in the
//!   engine's cache: the engine read the previous turn in full) came back
//!   with less than half of the predicted blocks from cache. A few tail
//!   blocks short is the ordinary disagreement of two LRUs that count
//!   different things (output tokens, running requests' blocks), not a
//!   miss. Where the lost block sat in the index tells what the miss
//!   means; the decision noted the block's clock
//!   ([`crate::warmth::LruBlocks::stamp`]) and the depth is counted now:
//!   - *deep* (the blocks other prompts used since this conversation's
//!     previous turn are at least a quarter of what the index holds): the
//!     engine's cache is smaller than the index. The capacity shrinks to
//!     that depth, by at most a tenth per miss (an engine's room for
//!     paused conversations comes and goes with what it runs), never
//!     below [`MIN_WARMTH_BLOCKS`], dropping the least recent blocks;
//!   - *shallow*: the engine lost a recent conversation, which no cache
//!     size explains: counted (`recent_losses_total`), and nothing more.
//!     A restart, or a reset cache, is read only from the engine's own
//!     evidence (a new start time, a falling prompt-token counter:
//!     [`crate::Router::set_engine_signals`]), never from misses: one
//!     client can open any number of conversations and make their turns
//!     miss (a spelling the engine reads and the fingerprint does not, such
//!     as the order of a tool's keys). On an engine that shows neither,
//!     each conversation's next turn re-reads its prompt where it lands
//!     and the index holds it whole again; only what never comes back
//!     stays listed until the index's LRU drops it.
//!
//! Whether a turn missed is judged in its own units: its prompt's canonical
//! bytes over the engine's token count for it, so no other client's
//! prompts (whose bytes per token can be anything) move the judgment. The
//! replica's moving average of that ratio only converts held bytes into a
//! predicted token count.
//!
//! Shrinking is bounded in time too: within a minute a replica's index
//! shrinks to no less than [`SHRINK_FLOOR_PER_MINUTE`] of the blocks it
//! held at the minute's start (no burst of misses empties it at once), and
//! honest turns undo a shrink faster than misses make it: each turn served
//! beyond a full index's prediction grows it by a quarter, where a miss
//! takes at most a tenth. Answers to requests that partition or
//! bypass the engine's cache (`cache_salt`, `cache_prompt: false`, a
//! pinned slot) are counted but never compared ([`Prediction::compare`]),
//! and a report is matched with its decision by the sidecar's own ticket,
//! never by an id a client chose.
//! - **An under-prediction**: a turn served more than one block beyond the
//!   prediction while the index was full. The index forgot what the engine
//!   kept; its capacity grows by a quarter, up to `HEARTH_WARMTH_BLOCKS`
//!   (or what the engine says its cache holds).
//!   (Any turn counts: a conversation whose tail the index dropped no
//!   longer looks like a continuation.)
//!
//! The conversation's own chain is not cut back on a miss: the engine
//! re-reads what it missed while serving the turn, so when the answer
//! comes its cache holds the whole prompt again, as the index says. What a
//! miss tells about is everything older on that replica.

use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::params::RouterParams;
use crate::replica::ReplicaKey;
use crate::warmth::LruBlocks;

/// The smallest warmth capacity a replica's corrections shrink to.
pub const MIN_WARMTH_BLOCKS: usize = 64;

/// The deepest a missed block is looked for in the index (nodes walked
/// under the fleet's lock, per miss): a block deeper than this counts as
/// deep, and its depth as what the index holds (no shrink).
pub const MAX_DEPTH_WALK: usize = 1 << 16;

/// The share of its capacity a replica's warmth index keeps, at least,
/// over a minute of shrinking.
pub const SHRINK_FLOOR_PER_MINUTE: f64 = 0.5;

/// The window of [`SHRINK_FLOOR_PER_MINUTE`].
const SHRINK_WINDOW: Duration = Duration::from_secs(60);

/// How far one answer moves a replica's room scale
/// ([`UsageTally::engine_room`]): up by this share when the engine served
/// more than a prediction its size cut short, down when it served less.
pub const ROOM_STEP: f64 = 0.1;

/// The room scale stays within this factor of the engine's figure.
const ROOM_SCALE_MAX: f64 = 8.0;

/// Weight of each new report in the bytes-per-token average.
const BPT_WEIGHT: f64 = 0.05;

/// What a decision predicted for the replica it chose.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Prediction {
    /// The chosen replica's slot.
    pub replica: usize,
    /// Its address and rank (a reload may have reused the slot by the time
    /// the answer comes).
    pub key: ReplicaKey,
    /// Leading blocks of the prompt its engine holds: the overlap, or
    /// what an LRU of the engine's reported size holds of it.
    pub blocks: u32,
    /// Leading blocks of the prompt the warmth index holds (at least
    /// `blocks`).
    pub overlap: u32,
    /// `blocks` came from an LRU of the engine's size, smaller than the
    /// index: the answer tells whether that size was right.
    pub mirrored: bool,
    /// Prompt bytes it holds: its blocks, or, when it served the previous
    /// turn of the conversation, all of that turn's prompt (the partial
    /// last block too).
    pub held_bytes: u64,
    /// The same in the engine's tokens, when the previous turn's usage
    /// said how many it had.
    pub held_tokens: Option<u64>,
    /// This prompt's tip: its answer's usage tells the tips how many
    /// tokens the engine counted in it.
    pub tip: Option<u64>,
    /// Canonical prompt bytes.
    pub prompt_bytes: u64,
    /// Set when the prompt continues an earlier one (its previous turn, read
    /// in full by the engine that served it): the conversation's name, the
    /// same for all its turns (its first turn's tip, handed on turn to turn).
    pub conversation: Option<u64>,
    /// The answer may be compared with this prediction: the request was
    /// hashed and uses the engine's shared prompt cache (see
    /// [`hearth_wire::CacheUse`]).
    pub compare: bool,
    /// The replica's warmth clock when it last used the deepest block of
    /// the prediction ([`crate::warmth::LruBlocks::stamp`]).
    pub stamp: Option<u32>,
    /// When the decision was taken: the engine stored this prompt's
    /// blocks after it ([`crate::kv_chains`]).
    pub decided_at: Instant,
    /// The engine tip of the turn this prompt continues on the chosen
    /// replica, when its KV events showed it.
    pub previous_engine_tip: Option<u64>,
}

/// An answer's usage: prompt tokens, and the ones read from cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
}

impl From<hearth_wire::outcome::Usage> for Usage {
    fn from(u: hearth_wire::outcome::Usage) -> Usage {
        Usage {
            prompt_tokens: u.prompt_tokens,
            cached_tokens: u.cached_tokens,
        }
    }
}

/// What one answer's usage told, and what it changed.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Served {
    /// The replica that answered.
    pub replica: usize,
    pub usage: Usage,
    /// Cached tokens the decision predicted (its overlap in tokens, at the
    /// replica's bytes per token), when the answer is the predicted
    /// replica's.
    pub predicted_tokens: Option<u64>,
    pub correction: Option<Correction>,
}

/// A change to a replica's warmth made from its answers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Correction {
    /// Served less than predicted: the capacity shrank to this.
    Shrunk(usize),
    /// Served more than a full index predicted: the capacity grew to this.
    Grew(usize),
}

/// Each replica's running account of its answers' usage.
#[derive(Clone, Debug, Default)]
pub(crate) struct UsageTally {
    pub(crate) reports: u64,
    pub(crate) prompt_tokens: u64,
    pub(crate) cached_tokens: u64,
    /// Answers with a prediction to compare (the chosen replica answered),
    /// and their predicted and served cached tokens.
    pub(crate) compared: u64,
    pub(crate) predicted_tokens: u64,
    pub(crate) compared_cached_tokens: u64,
    /// Canonical prompt bytes per engine token (a moving average).
    pub(crate) bytes_per_token: Option<f64>,
    /// The greatest common divisor of the cached-token counts the engine
    /// reported, and how many: an engine that caches whole blocks reports
    /// multiples of its block size.
    pub(crate) granule_gcd: u64,
    pub(crate) granule_reports: u32,
    /// The block size the engine's metrics state, in tokens: the
    /// granularity from the first answer, for as long as every cached
    /// count it serves is a multiple of it.
    pub(crate) engine_granule: Option<u64>,
    pub(crate) shrinks: u64,
    pub(crate) growths: u64,
    pub(crate) restarts: u64,
    /// Continuing turns that lost what the index took in last (shallow
    /// misses): a restart's trace on an engine that does not tell its
    /// restarts, or a client's spelling; only counted.
    pub(crate) recent_losses: u64,
    /// What the engine's reported KV capacity holds of prompts, as the
    /// answers showed it, over what it holds in warmth blocks (see
    /// [`UsageTally::engine_room`]).
    pub(crate) room_scale: Option<f64>,
    /// The current shrink window's start, and the blocks held then.
    shrink_window: Option<(Instant, usize)>,
}

/// A replica's usage account on `/state`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct UsageSnapshot {
    /// Answers whose usage the sidecar read.
    pub reports_total: u64,
    pub prompt_tokens_total: u64,
    pub cached_tokens_total: u64,
    /// `cached / prompt` tokens (None before the first report).
    pub cache_hit_share: Option<f64>,
    /// Of those, answers from the replica the decision chose: what it
    /// predicted from cache, and what the engine served.
    pub compared_total: u64,
    pub predicted_cached_tokens_total: u64,
    pub compared_cached_tokens_total: u64,
    /// Canonical prompt bytes per engine token.
    pub bytes_per_token: Option<f64>,
    /// The engine's cache granularity, in tokens: the block size its
    /// metrics state while its answers bear it out, else learnt from its
    /// answers (None before [`GRANULE_REPORTS`] answers served from cache).
    pub cache_granularity_tokens: Option<u64>,
    /// What the engine's reported KV capacity held, in warmth blocks, per
    /// block it says it has, as its answers showed (1 until they say
    /// otherwise; `None` for an engine that reports no capacity).
    pub engine_room_scale: Option<f64>,
    /// Warmth corrections: capacity shrunk, capacity grown, restarts the
    /// engine's metrics showed.
    pub shrinks_total: u64,
    pub growths_total: u64,
    pub restarts_total: u64,
    /// Continuing turns that lost what the index took in last (counted,
    /// never acted on).
    #[serde(default)]
    pub recent_losses_total: u64,
}

impl UsageTally {
    pub(crate) fn snapshot(&self) -> UsageSnapshot {
        UsageSnapshot {
            reports_total: self.reports,
            prompt_tokens_total: self.prompt_tokens,
            cached_tokens_total: self.cached_tokens,
            cache_hit_share: (self.prompt_tokens > 0)
                .then(|| self.cached_tokens as f64 / self.prompt_tokens as f64),
            compared_total: self.compared,
            predicted_cached_tokens_total: self.predicted_tokens,
            compared_cached_tokens_total: self.compared_cached_tokens,
            bytes_per_token: self.bytes_per_token,
            cache_granularity_tokens: self.known_granule(),
            engine_room_scale: self.room_scale,
            shrinks_total: self.shrinks,
            growths_total: self.growths,
            restarts_total: self.restarts,
            recent_losses_total: self.recent_losses,
        }
    }
}

impl UsageTally {
    /// The blocks of this prompt's kind an engine whose KV capacity is
    /// `engine_blocks` warmth blocks holds: that figure counts a block of
    /// a prompt shared under a warmth block's size (a system prompt, a
    /// harness) once per conversation, where the engine holds it once, and
    /// counts nothing of a prompt's partial last block, which the engine
    /// holds; the answers tell which weighs more ([`ROOM_STEP`]).
    pub(crate) fn engine_room(&mut self, engine_blocks: usize) -> usize {
        let scale = *self.room_scale.get_or_insert(1.0);
        (engine_blocks as f64 * scale).round() as usize
    }

    /// The engine's cache granularity in tokens (1 until known).
    fn granule(&self) -> u64 {
        self.known_granule().unwrap_or(1)
    }

    /// The block size the engine's metrics state, unless a cached count it
    /// served is no multiple of it; else the greatest common divisor of its
    /// cached counts once [`GRANULE_REPORTS`] came. A divisor learnt from a
    /// few answers can be a multiple of the block (answers that all hit the
    /// same two-block shared prompt say 256 where blocks are 128), which
    /// the stated size avoids.
    fn known_granule(&self) -> Option<u64> {
        let stated = self
            .engine_granule
            .filter(|&b| b > 0 && self.granule_gcd.is_multiple_of(b));
        let learnt = (self.granule_reports >= GRANULE_REPORTS).then(|| self.granule_gcd.max(1));
        stated.or(learnt)
    }

    fn learn_granule(&mut self, cached_tokens: u64) {
        if cached_tokens > 0 {
            self.granule_gcd = gcd(self.granule_gcd, cached_tokens);
            self.granule_reports = self.granule_reports.saturating_add(1);
        }
    }

    /// Counts an answer's usage and, with the decision's prediction (the
    /// predicted replica answered), compares the two and corrects `warmth`
    /// (with `usage_feedback` on) within `limit`, its largest size: `None`
    /// while the replica's KV events are exact, which say what its engine
    /// evicted better than answers can (no correction then). Returns the
    /// predicted cached tokens and the correction.
    pub(crate) fn record(
        &mut self,
        warmth: &mut LruBlocks,
        limit: Option<usize>,
        p: &RouterParams,
        prediction: Option<&Prediction>,
        usage: Usage,
        now: Instant,
    ) -> (Option<u64>, Option<Correction>) {
        self.reports += 1;
        self.prompt_tokens += usage.prompt_tokens;
        self.cached_tokens += usage.cached_tokens;
        let Some(pr) = prediction.filter(|p| p.compare) else {
            return (None, None);
        };
        // This turn's own bytes per token, where both counts are known.
        let own_ratio = (pr.prompt_bytes > 0 && usage.prompt_tokens > 0)
            .then(|| (pr.prompt_bytes as f64 / usage.prompt_tokens as f64).clamp(0.5, 64.0));
        if let Some(ratio) = own_ratio {
            self.bytes_per_token = Some(match self.bytes_per_token {
                Some(b) => b + BPT_WEIGHT * (ratio - b),
                None => ratio,
            });
        }
        let bpt = self.bytes_per_token.unwrap_or(DEFAULT_BYTES_PER_TOKEN);
        let block = p.block_size as f64;
        // In the engine's units: what it holds, never the whole prompt (an
        // engine computes at least the last token), in whole cache blocks.
        let held = pr
            .held_tokens
            .unwrap_or_else(|| (pr.held_bytes as f64 / bpt).round() as u64);
        let granule = self.granule();
        let predicted = held.min(usage.prompt_tokens.saturating_sub(1)) / granule * granule;
        self.learn_granule(usage.cached_tokens);
        if pr.mirrored {
            // More than a block (of either kind) off: the engine's room
            // was larger than the mirror's when it served more than a
            // mirror-cut prediction, smaller when it served less.
            let slack = granule.max((block / bpt).round() as u64);
            let scale = self.room_scale.get_or_insert(1.0);
            if usage.cached_tokens >= predicted + slack && pr.blocks < pr.overlap {
                *scale = (*scale * (1.0 + ROOM_STEP)).min(ROOM_SCALE_MAX);
            } else if usage.cached_tokens + slack <= predicted {
                *scale = (*scale / (1.0 + ROOM_STEP)).max(1.0 / ROOM_SCALE_MAX);
            }
        }
        self.compared += 1;
        self.predicted_tokens += predicted;
        self.compared_cached_tokens += usage.cached_tokens;
        // Served blocks in this turn's own bytes per token (what its prompt
        // is made of, not what other clients' prompts were).
        let served_blocks =
            (usage.cached_tokens as f64 * own_ratio.unwrap_or(bpt) / block).floor() as u64;
        let predicted_blocks = u64::from(pr.blocks);
        // A miss: a continuing turn (its prompt was in the engine's cache:
        // it read the previous turn in full) for which the engine lost
        // most of what the index holds. A few tail blocks short is the
        // ordinary disagreement of two LRUs that count different things.
        let missed = pr.conversation.is_some() && served_blocks * 2 < predicted_blocks;
        let under = served_blocks > predicted_blocks + 1;
        // How deep the lost block sat in the index. Shallow (the blocks
        // other prompts used since this conversation's previous turn are
        // under a quarter of what the index holds): the engine lost a
        // recent conversation, which no cache size explains. Deeper: its
        // cache is smaller than the index.
        // The walk that tells runs under the fleet's lock, so it stops at
        // MAX_DEPTH_WALK blocks: a block at least that deep is deep.
        let held = warmth.len().min(warmth.capacity());
        let walked = pr
            .stamp
            .filter(|_| missed)
            .map(|s| warmth.newer_than_up_to(s, MAX_DEPTH_WALK));
        let shallow = missed
            && walked.is_none_or(|d| {
                d < MAX_DEPTH_WALK && (d as u64).saturating_sub(predicted_blocks) * 4 < held as u64
            });
        if shallow {
            self.recent_losses += 1;
        }
        let Some(limit) = limit.filter(|_| p.usage_feedback) else {
            return (Some(predicted), None);
        };
        let correction = if let Some(walked) = walked.filter(|_| missed && !shallow) {
            // Past the walk, how deep is unknown: no shrink below what the
            // index holds.
            let depth = if walked >= MAX_DEPTH_WALK {
                held
            } else {
                walked
            };
            // The engine lost a block that sat `depth` blocks deep in the
            // index: its cache held fewer than that, then. An engine's room
            // for paused conversations comes and goes with what it runs,
            // so one miss takes at most a tenth off, and a minute at most
            // half.
            let (since, before) = match self.shrink_window {
                Some((at, c)) if now.saturating_duration_since(at) < SHRINK_WINDOW => (at, c),
                // What it held, not its capacity: an index larger than
                // what it holds gives up nothing by shrinking to it.
                _ => (now, held),
            };
            self.shrink_window = Some((since, before));
            let floor = (before as f64 * SHRINK_FLOOR_PER_MINUTE).ceil() as usize;
            let capacity = depth.max(held * 9 / 10).max(MIN_WARMTH_BLOCKS).max(floor);
            (capacity < warmth.capacity()).then(|| {
                warmth.set_capacity(capacity);
                self.shrinks += 1;
                Correction::Shrunk(capacity)
            })
        } else if under && warmth.len() >= warmth.capacity() && warmth.capacity() < limit {
            let capacity = (warmth.capacity() + warmth.capacity() / 4 + 1).min(limit);
            warmth.set_capacity(capacity);
            self.growths += 1;
            Some(Correction::Grew(capacity))
        } else {
            None
        };
        (Some(predicted), correction)
    }
}

/// Blocks of the warmth index that `kv_tokens` tokens of an engine's KV
/// cache hold, at `bytes_per_token` (shared by `ranks` routing targets).
pub fn blocks_for_tokens(
    kv_tokens: f64,
    bytes_per_token: f64,
    block_size: usize,
    ranks: f64,
) -> usize {
    engine_blocks(kv_tokens, bytes_per_token, block_size, ranks).max(MIN_WARMTH_BLOCKS)
}

/// The warmth blocks `kv_tokens` tokens of an engine's KV cache hold
/// (shared by `ranks` routing targets), without the index's floor.
pub fn engine_blocks(kv_tokens: f64, bytes_per_token: f64, block_size: usize, ranks: f64) -> usize {
    (kv_tokens / ranks.max(1.0) * bytes_per_token / block_size.max(1) as f64) as usize
}

/// Answers served from cache before a replica's granularity is used: one
/// count is its own divisor, a few agree only on the block size.
pub const GRANULE_REPORTS: u32 = 4;

fn gcd(a: u64, b: u64) -> u64 {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

/// Bytes per token before a replica's first report (English text and code
/// run about four).
pub const DEFAULT_BYTES_PER_TOKEN: f64 = 4.0;

#[cfg(test)]
mod tests {
    use super::*;

    /// A continuing turn of conversation `k` whose prediction's deepest
    /// block sits halfway down the index, served nothing from cache.
    fn deep_miss(
        tally: &mut UsageTally,
        warmth: &mut LruBlocks,
        k: u64,
        now: Instant,
    ) -> Option<Correction> {
        let held = warmth.len();
        let middle = warmth.oldest_first().nth(held / 2).unwrap();
        let prediction = Prediction {
            replica: 0,
            key: ("127.0.0.1:1".parse().unwrap(), None),
            blocks: 10,
            overlap: 10,
            mirrored: false,
            held_bytes: 10 * 2048,
            held_tokens: None,
            tip: None,
            prompt_bytes: 10 * 2048,
            conversation: Some(k),
            compare: true,
            stamp: warmth.stamp(middle),
            decided_at: now,
            previous_engine_tip: None,
        };
        let usage = Usage {
            prompt_tokens: 10 * 512,
            cached_tokens: 0,
        };
        let p = RouterParams::default();
        tally
            .record(warmth, Some(100_000), &p, Some(&prediction), usage, now)
            .1
    }

    #[test]
    fn a_burst_of_deep_misses_takes_at_most_half_the_index_a_minute() {
        let mut warmth = LruBlocks::new(100_000);
        warmth.record_prompt(&(1..=10_000).collect::<Vec<u64>>());
        let mut tally = UsageTally::default();
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        let mut shrunk = 0;
        for k in 0..40 {
            if let Some(Correction::Shrunk(_)) = deep_miss(&mut tally, &mut warmth, k, t0 + ms(k)) {
                shrunk += 1;
            }
        }
        // Each miss is worth a tenth: unbounded, forty would leave a
        // hundredth; within the minute the index keeps half.
        assert!(shrunk >= 5, "{shrunk}");
        assert_eq!(warmth.capacity(), 5_000);
        assert_eq!(warmth.len(), 5_000);
        // The next minute may take half of that.
        let later = t0 + SHRINK_WINDOW;
        for k in 0..40 {
            deep_miss(&mut tally, &mut warmth, 100 + k, later + ms(k));
        }
        assert_eq!(warmth.capacity(), 2_500);
    }
}
