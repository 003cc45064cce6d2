//! The engine: one thread that owns the model and runs continuous batching
//! (docs/architecture.md §12).
//!
//! Requests arrive tokenized and validated through a bounded queue; each holds a channel back to
//! its HTTP handler. Every step admits queued requests into free slots, then runs the next token
//! of every decoding slot as one `forward_sequences` batch (so each expert's bytes serve all of
//! them) and at most `prefill_chunk` prompt tokens of the prefilling slots, oldest first, as a
//! second one (decode and prompt tokens are kept apart so that a request's arithmetic does not
//! depend on its neighbours). A slot whose prompt is
//! complete samples its next token with its own `LogitsProcessor`; text is detokenized
//! incrementally and stop strings are cut out before anything is sent. A request whose handler
//! went away (client disconnected) is dropped at the next step; one whose forward fails is
//! failed alone and its cache dropped, the others go on.

use std::sync::Arc;
use std::time::Instant;

use candle::Tensor;
use candle_qmoe::error::message_without_backtrace;
use candle_qmoe::generation::check_logits;
use candle_qmoe::kernels::cpu::W4A8_MIN_TOKENS;
use candle_qmoe::models::{ExpertTraffic, MoeForCausalLm, SequenceCache, SequenceInput};
use candle_qmoe_suite::model::sampler;
use candle_transformers::generation::LogitsProcessor;
use serde::Serialize;
use tokenizers::{
    DecodeStream, DecoderWrapper, ModelWrapper, NormalizerWrapper, PostProcessorWrapper,
    PreTokenizerWrapper, Tokenizer,
};
use tokio::sync::mpsc;

use crate::metrics::Metrics;
use crate::queue::Queue;

/// How a request samples and when it stops.
#[derive(Clone, Debug)]
pub struct SamplingParams {
    /// Most tokens to generate (`None`: until the slot's context is full).
    pub max_tokens: Option<usize>,
    /// Softmax temperature; 0 is greedy.
    pub temperature: f64,
    /// Nucleus cutoff (`None`: the whole distribution).
    pub top_p: Option<f64>,
    /// Sampling seed.
    pub seed: u64,
    /// Strings that end the answer (not included in it).
    pub stop: Vec<String>,
}

/// Why an answer ended, as OpenAI names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// An end-of-sequence token or a stop string.
    Stop,
    /// `max_tokens`, or the slot's context is full.
    Length,
}

/// A finished answer's counts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Finish {
    /// Why it ended.
    pub reason: FinishReason,
    /// Tokens of the prompt.
    pub prompt_tokens: usize,
    /// Tokens generated (an end-of-sequence token included).
    pub completion_tokens: usize,
}

/// What the engine sends back to a request's handler: text pieces, then one `Done` or `Failed`.
#[derive(Clone, Debug, PartialEq)]
pub enum Event {
    /// The next piece of the answer.
    Text(String),
    /// The answer is complete.
    Done(Finish),
    /// The request failed inside the engine (or the server is shutting down).
    Failed(String),
}

/// One request as the engine takes it.
#[derive(Debug)]
pub struct Request {
    /// The prompt's token ids (non-empty, shorter than the slot context).
    pub prompt: Vec<u32>,
    /// Sampling and stop conditions.
    pub params: SamplingParams,
    /// Where events go; closed when the client went away.
    pub events: mpsc::UnboundedSender<Event>,
}

/// The engine's fixed settings.
#[derive(Clone, Debug)]
pub struct EngineConfig {
    /// Slots: sequences in flight at once.
    pub slots: usize,
    /// Tokens per slot (prompt + generated).
    pub ctx: usize,
    /// Most prompt tokens per step.
    pub prefill_chunk: usize,
    /// Token ids that end an answer.
    pub stop_ids: Vec<u32>,
}

type Detokenizer<'t> = DecodeStream<
    't,
    ModelWrapper,
    NormalizerWrapper,
    PreTokenizerWrapper,
    PostProcessorWrapper,
    DecoderWrapper,
>;

/// Holds back text that may be the start of a stop string, and cuts the answer at the first one.
#[derive(Debug, Default)]
pub struct StopText {
    stops: Vec<String>,
    held: String,
}

impl StopText {
    /// A scanner for `stops` (empty strings are ignored).
    pub fn new(stops: &[String]) -> Self {
        Self {
            stops: stops.iter().filter(|s| !s.is_empty()).cloned().collect(),
            held: String::new(),
        }
    }

    /// Adds `piece`; returns the text that is safe to send and whether a stop string was found
    /// (the text before it is returned, the rest dropped).
    pub fn push(&mut self, piece: &str) -> (String, bool) {
        self.held.push_str(piece);
        let first = self.stops.iter().filter_map(|s| self.held.find(s)).min();
        if let Some(at) = first {
            let text = self.held[..at].to_string();
            self.held.clear();
            return (text, true);
        }
        // The longest tail of `held` that begins some stop string stays held.
        let keep = self
            .held
            .char_indices()
            .map(|(i, _)| i)
            .find(|&i| {
                let tail = &self.held[i..];
                self.stops.iter().any(|s| s.starts_with(tail))
            })
            .unwrap_or(self.held.len());
        let rest = self.held.split_off(keep);
        (std::mem::replace(&mut self.held, rest), false)
    }

    /// The held text, at the end of an answer that no stop string ended.
    pub fn flush(&mut self) -> String {
        std::mem::take(&mut self.held)
    }
}

/// A request in a slot.
struct Slot<'t> {
    request: Request,
    /// Prompt then generated tokens; the cache holds all but (while decoding) the last.
    tokens: Vec<u32>,
    cache: SequenceCache,
    sampler: LogitsProcessor,
    tokenizer: &'t Tokenizer,
    detokenizer: Detokenizer<'t>,
    /// `tokens[..decoded]` are text; the detokenizer holds `tokens[decoded..fed]` (the start of
    /// a character).
    decoded: usize,
    fed: usize,
    text: StopText,
    /// Tokens this slot may generate (max_tokens within the context).
    limit: usize,
}

impl Slot<'_> {
    fn prompt_len(&self) -> usize {
        self.request.prompt.len()
    }

    fn generated(&self) -> usize {
        self.tokens.len() - self.prompt_len()
    }

    /// Whether the whole prompt is in the cache (the slot feeds its sampled tokens).
    fn decoding(&self) -> bool {
        self.cache.len() >= self.prompt_len()
    }

    /// The next prompt tokens to feed within `budget`.
    fn prompt_chunk(&self, budget: usize) -> usize {
        (self.prompt_len() - self.cache.len()).min(budget)
    }

    fn send(&self, event: Event) {
        // A closed channel (client gone) is noticed at the next step.
        let _ = self.request.events.send(event);
    }

    /// The text of the tokens the detokenizer holds, as decoding the whole answer gives it (an
    /// incomplete UTF-8 sequence is U+FFFD).
    fn held_text(&self) -> String {
        if self.fed == self.decoded {
            return String::new();
        }
        let start = self.prompt_len();
        let decode = |end| self.tokenizer.decode(&self.tokens[start..end], true);
        match (decode(self.fed), decode(self.decoded)) {
            (Ok(all), Ok(sent)) => all.strip_prefix(&sent).unwrap_or_default().to_string(),
            _ => String::new(),
        }
    }

    /// Sends the held text (none after a stop string) and the end of the answer.
    fn finish(&mut self, reason: FinishReason) {
        let (mut rest, stopped) = self.text.push(&self.held_text());
        if !stopped {
            rest.push_str(&self.text.flush());
        }
        if !rest.is_empty() {
            self.send(Event::Text(rest));
        }
        self.send(Event::Done(Finish {
            reason: if stopped { FinishReason::Stop } else { reason },
            prompt_tokens: self.prompt_len(),
            completion_tokens: self.generated(),
        }));
    }

    /// Samples the next token from `logits` and sends its text; `Some` when the answer ended.
    fn sample(
        &mut self,
        logits: &Tensor,
        config: &EngineConfig,
    ) -> Result<Option<FinishReason>, String> {
        // `tokens` holds the prompt and every token generated: the logits are of its last.
        check_logits(logits, self.tokens.len() - 1).map_err(|e| message_without_backtrace(&e))?;
        let token = self
            .sampler
            .sample(logits)
            .map_err(|e| message_without_backtrace(&e))?;
        self.tokens.push(token);
        if config.stop_ids.contains(&token) {
            return Ok(Some(FinishReason::Stop));
        }
        let piece = self.detokenizer.step(token).map_err(|e| e.to_string())?;
        self.fed = self.tokens.len();
        if let Some(piece) = piece {
            self.decoded = self.fed;
            let (text, stopped) = self.text.push(&piece);
            if !text.is_empty() {
                self.send(Event::Text(text));
            }
            if stopped {
                return Ok(Some(FinishReason::Stop));
            }
        }
        Ok((self.generated() >= self.limit).then_some(FinishReason::Length))
    }
}

/// The scheduler and its model, run by [`Engine::run`] on its own thread.
pub struct Engine<'t> {
    model: MoeForCausalLm,
    tokenizer: &'t Tokenizer,
    config: EngineConfig,
    queue: Arc<Queue>,
    metrics: Arc<Metrics>,
    slots: Vec<Slot<'t>>,
    traffic: ExpertTraffic,
}

impl<'t> Engine<'t> {
    /// An engine over `model` taking requests from `queue`; closing the queue ends every request
    /// and stops it (shutdown).
    pub fn new(
        model: MoeForCausalLm,
        tokenizer: &'t Tokenizer,
        config: EngineConfig,
        queue: Arc<Queue>,
        metrics: Arc<Metrics>,
    ) -> Self {
        let traffic = model.expert_traffic();
        Self {
            model,
            tokenizer,
            config,
            queue,
            metrics,
            slots: Vec::new(),
            traffic,
        }
    }

    /// Runs until the queue is closed, then fails the requests left.
    pub fn run(mut self) {
        loop {
            if self.queue.is_closed() {
                self.cancel_all();
                return;
            }
            self.slots.retain(|s| !s.request.events.is_closed());
            // Before `admit`, which waits when every slot is idle (the gauges then read 0), and
            // after it, with the slots it filled.
            self.publish_slots();
            self.admit();
            self.publish_slots();
            if !self.slots.is_empty() {
                self.step();
            }
        }
    }

    /// Sets the gauges of the slots: busy ones and their KV bytes.
    fn publish_slots(&self) {
        self.metrics.slots_busy.set(self.slots.len() as i64);
        let kv: usize = self.slots.iter().map(|s| s.cache.allocated_bytes()).sum();
        self.metrics.kv_cache_bytes.set(kv as i64);
    }

    /// Fails every request in a slot or in the queue.
    fn cancel_all(&mut self) {
        let failed = Event::Failed("the server is shutting down".into());
        for slot in self.slots.drain(..) {
            slot.send(failed.clone());
        }
        for request in self.queue.drain() {
            let _ = request.events.send(failed.clone());
        }
        self.publish_slots();
    }

    /// Moves queued requests into free slots, waiting for one (or for the queue to close) when
    /// all slots are idle.
    fn admit(&mut self) {
        while self.slots.len() < self.config.slots {
            let Some(request) = self.queue.pop(self.slots.is_empty()) else {
                break;
            };
            let p = &request.params;
            let sampler = sampler(p.seed, Some(p.temperature), p.top_p);
            let room = self.config.ctx.saturating_sub(request.prompt.len());
            let limit = p.max_tokens.unwrap_or(room).min(room);
            self.metrics
                .prompt_tokens
                .inc_by(request.prompt.len() as u64);
            self.slots.push(Slot {
                tokens: request.prompt.clone(),
                cache: self.model.new_sequence(),
                sampler,
                tokenizer: self.tokenizer,
                detokenizer: self.tokenizer.decode_stream(true),
                decoded: request.prompt.len(),
                fed: request.prompt.len(),
                text: StopText::new(&p.stop),
                limit,
                request,
            });
        }
    }

    /// One batch: every decoding slot's next token and up to `prefill_chunk` prompt tokens.
    fn step(&mut self) {
        let start = Instant::now();
        // Every decoding slot feeds its next token; prompts, oldest first, share the budget.
        let mut feed = vec![0; self.slots.len()];
        let (mut decode, mut prompt) = (Vec::new(), Vec::new());
        let mut budget = self.config.prefill_chunk;
        for (i, slot) in self.slots.iter().enumerate() {
            if slot.decoding() {
                feed[i] = 1;
                decode.push(i);
            } else if budget > 0 {
                feed[i] = slot.prompt_chunk(budget);
                budget -= feed[i];
                prompt.push(i);
            }
        }
        // Decode tokens and prompt chunks run as separate forwards, decode tokens in forwards
        // of fewer than W4A8_MIN_TOKENS: the INT4 kernel then keeps its decode activations
        // (8-bit, or 16-bit with --decode-acts i16) for every decode token, and a prompt chunk
        // is computed as it would be alone, so a request's tokens do not depend on what it is
        // batched with (its kernels are batch-invariant, tests/routed_experts.rs).
        let mut results: Vec<Option<Result<Tensor, String>>> = vec![None; self.slots.len()];
        let parts = decode
            .chunks(W4A8_MIN_TOKENS - 1)
            .chain(std::iter::once(&prompt[..]))
            .filter(|part| !part.is_empty());
        for part in parts {
            let mut part_feed = vec![0; self.slots.len()];
            for &i in part {
                part_feed[i] = feed[i];
            }
            for (&i, result) in part.iter().zip(self.forward(&part_feed)) {
                results[i] = Some(result);
            }
        }
        let mut sampled = 0;
        let mut done = vec![None; self.slots.len()];
        for (i, result) in results.into_iter().enumerate() {
            let Some(result) = result else {
                continue;
            };
            let slot = &mut self.slots[i];
            let outcome = match result {
                Err(e) => Err(e),
                // A prompt not yet complete: nothing to sample.
                Ok(_) if slot.cache.len() < slot.tokens.len() => continue,
                Ok(logits) => {
                    sampled += 1;
                    slot.sample(&logits, &self.config)
                }
            };
            done[i] = match outcome {
                Ok(None) => continue,
                Ok(Some(reason)) => Some(Ok(reason)),
                Err(e) => Some(Err(e)),
            };
        }
        let mut i = 0;
        self.slots.retain_mut(|slot| {
            let end = done[i].take();
            i += 1;
            match end {
                None => true,
                Some(Ok(reason)) => {
                    slot.finish(reason);
                    false
                }
                Some(Err(e)) => {
                    eprintln!("request failed in the engine: {e}");
                    slot.send(Event::Failed(e));
                    false
                }
            }
        });
        self.record(start, sampled);
    }

    /// Runs the batch `feed` (tokens per slot, 0 = not in this step); when the batch fails, each
    /// item alone, so that only the failing requests fail (a failed forward changes no cache).
    fn forward(&mut self, feed: &[usize]) -> Vec<Result<Tensor, String>> {
        let mut batch: Vec<SequenceInput<'_>> = self
            .slots
            .iter_mut()
            .zip(feed)
            .filter(|(_, n)| **n > 0)
            .map(|(slot, &n)| {
                let at = slot.cache.len();
                SequenceInput {
                    cache: &mut slot.cache,
                    tokens: &slot.tokens[at..at + n],
                }
            })
            .collect();
        match self.model.forward_sequences(&mut batch) {
            Ok(logits) => logits.into_iter().map(Ok).collect(),
            Err(_) if batch.len() > 1 => batch
                .iter_mut()
                .map(|item| {
                    let mut one = [SequenceInput {
                        cache: &mut *item.cache,
                        tokens: item.tokens,
                    }];
                    let logits = self.model.forward_sequences(&mut one);
                    logits
                        .map(|mut l| l.remove(0))
                        .map_err(|e| message_without_backtrace(&e))
                })
                .collect(),
            Err(e) => vec![Err(message_without_backtrace(&e))],
        }
    }

    /// Updates the metrics after a step that sampled `sampled` tokens (the slots' gauges are set
    /// at the next turn of [`Self::run`]).
    fn record(&mut self, start: Instant, sampled: usize) {
        self.metrics.step(start.elapsed(), sampled);
        let traffic = self.model.expert_traffic();
        self.metrics.add_traffic(&self.traffic, &traffic);
        self.traffic = traffic;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle::DType;
    use candle_qmoe::pack::GroupSize;
    use candle_qmoe::synthetic::{SyntheticKind, SyntheticModel};

    #[test]
    fn stop_text_cuts_at_the_first_stop_string_across_pieces() {
        let mut t = StopText::new(&["END".into(), "xy".into(), String::new()]);
        assert_eq!(t.push("hello E"), ("hello ".into(), false));
        assert_eq!(t.push("N"), (String::new(), false));
        assert_eq!(t.push("Dnot sent"), (String::new(), true));
        let mut t = StopText::new(&["END".into()]);
        assert_eq!(t.push("a E"), ("a ".into(), false));
        assert_eq!(t.push("x"), ("Ex".into(), false));
        assert_eq!(t.push("é E"), ("é ".into(), false));
        assert_eq!(t.flush(), "E");
        let mut none = StopText::new(&[]);
        assert_eq!(none.push("E"), ("E".into(), false));
    }

    struct Harness {
        queue: Arc<Queue>,
        thread: std::thread::JoinHandle<()>,
    }

    /// An engine on the synthetic tiny model (F32, INT4 experts) on its own thread.
    fn start(slots: usize, ctx: usize, prefill_chunk: usize) -> Harness {
        let synth = SyntheticModel::new(SyntheticKind::Tiny, 42, GroupSize::default()).unwrap();
        let model = synth
            .load(DType::F32, &candle::Device::Cpu, &synth.int4_experts())
            .unwrap();
        let queue = Arc::new(Queue::new(64));
        let engine_queue = queue.clone();
        let thread = std::thread::spawn(move || {
            let (tokenizer, _) =
                candle_qmoe_suite::tokenizer::synthetic_tokenizer(SyntheticKind::Tiny).unwrap();
            let config = EngineConfig {
                slots,
                ctx,
                prefill_chunk,
                stop_ids: vec![],
            };
            let metrics = Arc::new(Metrics::new(slots, None));
            Engine::new(model, &tokenizer, config, engine_queue, metrics).run();
        });
        Harness { queue, thread }
    }

    fn greedy(max_tokens: usize) -> SamplingParams {
        SamplingParams {
            max_tokens: Some(max_tokens),
            temperature: 0.0,
            top_p: None,
            seed: 1,
            stop: vec![],
        }
    }

    fn submit(
        h: &Harness,
        prompt: Vec<u32>,
        params: SamplingParams,
    ) -> mpsc::UnboundedReceiver<Event> {
        let (events, rx) = mpsc::unbounded_channel();
        h.queue
            .push(Request {
                prompt,
                params,
                events,
            })
            .unwrap();
        rx
    }

    /// The text and the last event of an answer.
    fn collect(mut rx: mpsc::UnboundedReceiver<Event>) -> (String, Event) {
        let mut text = String::new();
        loop {
            match rx.blocking_recv().expect("a final event") {
                Event::Text(t) => text.push_str(&t),
                end => return (text, end),
            }
        }
    }

    fn prompts() -> Vec<Vec<u32>> {
        (0..5u32)
            .map(|i| (0..3 + 7 * i).map(|j| 100 + 37 * j + 1000 * i).collect())
            .collect()
    }

    #[test]
    fn batched_greedy_answers_equal_solo_ones_and_failures_stay_alone() {
        // Solo: one slot, each prompt alone.
        let solo = start(1, 64, 4);
        let alone: Vec<(String, Event)> = prompts()
            .into_iter()
            .map(|p| collect(submit(&solo, p, greedy(6))))
            .collect();
        solo.queue.close();
        solo.thread.join().unwrap();
        for (_, end) in &alone {
            assert!(matches!(
                end,
                Event::Done(Finish {
                    reason: FinishReason::Length,
                    completion_tokens: 6,
                    ..
                })
            ));
        }

        // Batched: 3 slots, prefill chunks of 4 tokens shared by the prompts, all submitted at
        // once with a request that fails (a token outside the vocabulary) and one cancelled.
        let h = start(3, 64, 4);
        let bad = submit(&h, vec![1, 2, u32::MAX], greedy(4));
        drop(submit(&h, vec![5; 20], greedy(40)));
        let rxs: Vec<_> = prompts()
            .into_iter()
            .map(|p| submit(&h, p, greedy(6)))
            .collect();
        let batched: Vec<_> = rxs.into_iter().map(collect).collect();
        assert!(matches!(collect(bad).1, Event::Failed(_)));
        assert_eq!(batched, alone);

        // The context ends an answer: 30 + 34 = 64 tokens.
        let (_, end) = collect(submit(&h, vec![7; 30], greedy(100)));
        assert_eq!(
            end,
            Event::Done(Finish {
                reason: FinishReason::Length,
                prompt_tokens: 30,
                completion_tokens: 34
            })
        );
        h.queue.close();
        h.thread.join().unwrap();
    }
}
