//! The HTTP engine driven by the engine scheduler ([`EngineCore`]) in real
//! time: one task per engine plans each step, sleeps through it
//! (time-scaled) and then hands each request the step's events. The
//! discrete-event simulator runs the same scheduler, so a live run and a
//! simulated one share the cost model, batching and the prefix cache's
//! behaviour, not just the routing.
//!
//! Used when [`super::EngineConfig::scheduler`] is set; requests then join
//! at the next step, queue FIFO beyond `max_running`, share step time with
//! the batch, and give their KV blocks back when they end or are cancelled
//! (a client that goes away cancels its request).

use std::collections::{HashMap, VecDeque};
use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::http::header;
use axum::response::{IntoResponse, Response};
use axum::Json;
use tokio::sync::mpsc;

use super::cache::block_hashes;
use super::core::{CostModel, EngineCore, SeqEvent};
use super::{Admission, Engine, Generation, InFlight, DONE_EVENT};

enum Command {
    Submit {
        id: u64,
        hashes: Vec<u64>,
        prompt_tokens: u32,
        output_tokens: u32,
        events: mpsc::UnboundedSender<SeqEvent>,
    },
    Cancel(u64),
}

/// One engine's scheduler task, as the request handlers see it.
#[derive(Debug)]
pub struct Scheduler {
    commands: mpsc::UnboundedSender<Command>,
    /// The scheduler's own figures after its latest step (for `/stats`
    /// and `/metrics`).
    pub running: AtomicU64,
    pub waiting: AtomicU64,
    pub cache_blocks: AtomicU64,
    pub cache_capacity_blocks: u64,
}

impl Scheduler {
    /// Starts the task (it ends when the scheduler is dropped).
    pub fn start(
        cost: CostModel,
        block_tokens: usize,
        capacity_tokens: usize,
        time_scale: f64,
        kv_events: Option<EventSink>,
    ) -> Arc<Scheduler> {
        let mut core = EngineCore::new(cost, block_tokens, capacity_tokens).with_token_events();
        if kv_events.is_some() {
            core = core.with_cache_events();
        }
        let (commands, rx) = mpsc::unbounded_channel();
        let scheduler = Arc::new(Scheduler {
            commands,
            running: AtomicU64::new(0),
            waiting: AtomicU64::new(0),
            cache_blocks: AtomicU64::new(0),
            cache_capacity_blocks: core.cache_blocks().1 as u64,
        });
        tokio::spawn(run(
            core,
            rx,
            Arc::downgrade(&scheduler),
            time_scale,
            kv_events,
        ));
        scheduler
    }

    /// Queues a request; its events arrive on the returned ticket.
    fn submit(
        self: &Arc<Self>,
        id: u64,
        hashes: Vec<u64>,
        prompt_tokens: u32,
        output_tokens: u32,
    ) -> Ticket {
        let (events, rx) = mpsc::unbounded_channel();
        let _ = self.commands.send(Command::Submit {
            id,
            hashes,
            prompt_tokens,
            output_tokens,
            events,
        });
        Ticket {
            id,
            events: rx,
            commands: self.commands.clone(),
            finished: false,
        }
    }
}

/// A request inside the scheduler. Dropping it before the request finished
/// cancels the request (its blocks are unpinned, its slot freed).
struct Ticket {
    id: u64,
    events: mpsc::UnboundedReceiver<SeqEvent>,
    commands: mpsc::UnboundedSender<Command>,
    finished: bool,
}

impl Ticket {
    /// The request's next event; `None` if the scheduler stopped.
    async fn next(&mut self) -> Option<SeqEvent> {
        let event = self.events.recv().await;
        if matches!(event, Some(SeqEvent::Finished { .. })) {
            self.finished = true;
        }
        event
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        if !self.finished {
            let _ = self.commands.send(Command::Cancel(self.id));
        }
    }
}

/// Where a scheduler hands each step's KV cache events.
pub type EventSink = Box<dyn Fn(Vec<hearth_wire::kv_events::Event>) + Send + Sync>;

async fn run(
    mut core: EngineCore,
    mut commands: mpsc::UnboundedReceiver<Command>,
    figures: std::sync::Weak<Scheduler>,
    time_scale: f64,
    kv_events: Option<EventSink>,
) {
    let report = |core: &mut EngineCore| {
        publish(core, &figures);
        if let Some(sink) = &kv_events {
            sink(core.take_cache_events());
        }
    };
    let mut listeners: HashMap<u64, mpsc::UnboundedSender<SeqEvent>> = HashMap::new();
    // When the current busy period's latest step ends, in wall time. Steps
    // are timed against this running sum, not slept one by one: a timer
    // only resolves milliseconds, and a time-scaled step is often shorter,
    // so a step that woke late is made up by the next ones.
    let mut clock: Option<tokio::time::Instant> = None;
    loop {
        // Requests that arrived during the last step join this one.
        loop {
            match commands.try_recv() {
                Ok(command) => apply(&mut core, &mut listeners, command),
                Err(mpsc::error::TryRecvError::Empty) => break,
                Err(mpsc::error::TryRecvError::Disconnected) => return,
            }
        }
        let Some(step) = core.step() else {
            clock = None;
            report(&mut core);
            // Idle: wait for the next request.
            match commands.recv().await {
                Some(command) => apply(&mut core, &mut listeners, command),
                None => return,
            }
            continue;
        };
        report(&mut core);
        let wall = Duration::try_from_secs_f64(step.duration_us / 1e6 / time_scale)
            .unwrap_or(Duration::ZERO);
        let due = clock.unwrap_or_else(tokio::time::Instant::now) + wall;
        tokio::time::sleep_until(due).await;
        clock = Some(due);
        for event in step.events {
            let id = match event {
                SeqEvent::FirstToken { id, .. }
                | SeqEvent::Token { id, .. }
                | SeqEvent::Finished { id, .. } => id,
            };
            let done = matches!(event, SeqEvent::Finished { .. });
            let listener = if done {
                listeners.remove(&id)
            } else {
                listeners.get(&id).cloned()
            };
            if let Some(l) = listener {
                let _ = l.send(event);
            }
        }
    }
}

/// A handler's command, applied between steps.
fn apply(
    core: &mut EngineCore,
    listeners: &mut HashMap<u64, mpsc::UnboundedSender<SeqEvent>>,
    command: Command,
) {
    match command {
        Command::Submit {
            id,
            hashes,
            prompt_tokens,
            output_tokens,
            events,
        } => {
            core.submit(id, hashes, prompt_tokens, output_tokens);
            listeners.insert(id, events);
        }
        Command::Cancel(id) => {
            core.cancel(id);
            listeners.remove(&id);
        }
    }
}

fn publish(core: &EngineCore, figures: &std::sync::Weak<Scheduler>) {
    if let Some(f) = figures.upgrade() {
        f.running.store(core.running() as u64, Ordering::Relaxed);
        f.waiting.store(core.waiting() as u64, Ordering::Relaxed);
        f.cache_blocks
            .store(core.cache_blocks().0 as u64, Ordering::Relaxed);
    }
}

/// Runs an admitted request through the scheduler and answers it (JSON,
/// or SSE as the tokens come).
pub(super) async fn respond(
    engine: Arc<Engine>,
    scheduler: Arc<Scheduler>,
    id: u64,
    mut gen: Generation,
    prompt: &[u8],
    stream: bool,
) -> Response {
    let config = &engine.config;
    let hashes = block_hashes(prompt, config.block_tokens * config.bytes_per_token);
    let prompt_tokens = u32::try_from(gen.admission.prompt_tokens).unwrap_or(u32::MAX);
    let output_tokens = u32::try_from(gen.output_tokens).unwrap_or(u32::MAX);
    let guard = InFlight::start(Arc::clone(&engine)).await;
    engine.requests_total.fetch_add(1, Ordering::Relaxed);
    let ticket = scheduler.submit(id, hashes, prompt_tokens, output_tokens);
    if stream {
        let state = Streaming {
            gen,
            ticket,
            guard,
            engine,
            pending: VecDeque::new(),
            done: false,
        };
        let events = futures::stream::unfold(state, next_chunk);
        return (
            [
                (header::CONTENT_TYPE, "text/event-stream"),
                (header::CACHE_CONTROL, "no-cache"),
            ],
            Body::from_stream(events),
        )
            .into_response();
    }
    // If the client goes away, hyper drops this future: the ticket cancels
    // the request and the guard counts it as aborted.
    let (mut ticket, mut guard) = (ticket, guard);
    while let Some(event) = ticket.next().await {
        match event {
            SeqEvent::FirstToken {
                prompt_tokens,
                cached_tokens,
                ..
            } => admitted(&engine, &mut gen, prompt_tokens, cached_tokens),
            SeqEvent::Token { .. } => {}
            SeqEvent::Finished { .. } => {
                guard.completed = true;
                return Json(gen.full_response()).into_response();
            }
        }
    }
    super::error_response(
        axum::http::StatusCode::SERVICE_UNAVAILABLE,
        "server_error",
        "the engine stopped",
    )
}

/// The scheduler admitted the request: its cache hit is known.
fn admitted(engine: &Engine, gen: &mut Generation, prompt_tokens: u32, cached_tokens: u32) {
    gen.admission = Admission {
        prompt_tokens: prompt_tokens as usize,
        cached_tokens: cached_tokens as usize,
    };
    engine
        .prompt_tokens_total
        .fetch_add(u64::from(prompt_tokens), Ordering::Relaxed);
    engine
        .cached_tokens_total
        .fetch_add(u64::from(cached_tokens), Ordering::Relaxed);
}

struct Streaming {
    gen: Generation,
    ticket: Ticket,
    guard: InFlight,
    engine: Arc<Engine>,
    /// Events produced and not yet sent.
    pending: VecDeque<Bytes>,
    done: bool,
}

async fn next_chunk(mut s: Streaming) -> Option<(Result<Bytes, Infallible>, Streaming)> {
    loop {
        if let Some(chunk) = s.pending.pop_front() {
            return Some((Ok(chunk), s));
        }
        if s.done {
            return None;
        }
        // A stopped scheduler ends the stream without its [DONE].
        let event = s.ticket.next().await?;
        let words = s.gen.output_tokens;
        match event {
            SeqEvent::FirstToken {
                prompt_tokens,
                cached_tokens,
                ..
            } => {
                admitted(&s.engine, &mut s.gen, prompt_tokens, cached_tokens);
                s.pending.extend(s.gen.role_event());
                if words > 0 {
                    s.pending.push_back(s.gen.token_event(0));
                }
            }
            SeqEvent::Token { index, .. } => {
                if (index as usize) < words {
                    s.pending.push_back(s.gen.token_event(index as usize));
                }
            }
            SeqEvent::Finished { .. } => {
                if words > 1 {
                    s.pending.push_back(s.gen.token_event(words - 1));
                }
                s.pending.push_back(s.gen.finish_event());
                s.pending.push_back(s.gen.usage_event());
                s.pending.push_back(Bytes::from_static(DONE_EVENT));
                s.guard.completed = true;
                s.done = true;
            }
        }
    }
}
