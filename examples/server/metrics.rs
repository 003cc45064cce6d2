//! `GET /metrics`: OpenMetrics text (prometheus-client) — requests by endpoint and status, prompt
//! and generated tokens, queue length, busy slots, decode tokens/s, KV bytes, the routed experts'
//! traffic (`MoeForCausalLm::expert_traffic`), with an expert cache its counters
//! (`residency_json`) and, with `--profile`, the time and calls of each part of the forward
//! passes (`candle_qmoe::profile`).

use std::collections::VecDeque;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use candle_qmoe::models::ExpertTraffic;
use candle_qmoe::profile::{self, Profile};
use candle_qmoe::residency::Residency;
use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

/// Labels of one series: `(name, value)` pairs.
type Labels = Vec<(String, String)>;

/// The Content-Type of [`Metrics::encode`]'s text.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Decode tokens per second over the steps of the last `RATE_WINDOW`.
const RATE_WINDOW: Duration = Duration::from_secs(10);

/// Every metric the server exports; counters and gauges are atomics shared with the engine.
pub struct Metrics {
    registry: Registry,
    requests: Family<Labels, Counter>,
    /// Prompt tokens admitted into slots.
    pub prompt_tokens: Counter,
    /// Tokens sampled.
    generated_tokens: Counter,
    /// Requests waiting for a slot.
    pub queue_length: Gauge,
    /// Slots holding a request.
    pub slots_busy: Gauge,
    /// Tokens sampled per second of engine steps over the last 10 s (set when encoded).
    decode_tokens_per_second: Gauge<f64, AtomicU64>,
    /// (end, duration, tokens sampled) of the engine's recent steps.
    steps: Mutex<VecDeque<(Instant, Duration, usize)>>,
    /// KV cache bytes the slots hold.
    pub kv_cache_bytes: Gauge,
    expert_calls: Counter,
    expert_tokens: Counter,
    experts_read: Counter,
    expert_bytes_read: Counter,
    expert_cache: Family<Labels, Gauge<f64, AtomicU64>>,
    residency: Option<Arc<Residency>>,
    /// With `--profile`: seconds and calls per part of the forward passes, and the tally as
    /// last exported (the counters advance by the difference).
    forward_seconds: Family<Labels, Counter<f64, AtomicU64>>,
    forward_calls: Family<Labels, Counter>,
    exported_profile: Option<Mutex<Profile>>,
}

impl Metrics {
    /// The registry for a server with `slots` slots and, if any, an expert cache.
    pub fn new(slots: usize, residency: Option<Arc<Residency>>) -> Self {
        let mut m = Self {
            registry: Registry::with_prefix("qmoe"),
            requests: Family::default(),
            prompt_tokens: Counter::default(),
            generated_tokens: Counter::default(),
            queue_length: Gauge::default(),
            slots_busy: Gauge::default(),
            decode_tokens_per_second: Gauge::default(),
            steps: Mutex::default(),
            kv_cache_bytes: Gauge::default(),
            expert_calls: Counter::default(),
            expert_tokens: Counter::default(),
            experts_read: Counter::default(),
            expert_bytes_read: Counter::default(),
            expert_cache: Family::default(),
            residency,
            forward_seconds: Family::default(),
            forward_calls: Family::default(),
            exported_profile: profile::enabled().then(|| Mutex::new(profile::snapshot())),
        };
        let r = &mut m.registry;
        r.register(
            "requests",
            "HTTP responses by endpoint and status",
            m.requests.clone(),
        );
        let counters = [
            ("prompt_tokens", "Prompt tokens admitted", &m.prompt_tokens),
            ("generated_tokens", "Tokens generated", &m.generated_tokens),
            ("expert_calls", "MoE block calls", &m.expert_calls),
            (
                "expert_tokens",
                "Tokens routed through MoE blocks",
                &m.expert_tokens,
            ),
            (
                "experts_read",
                "Distinct routed experts computed, summed over MoE calls",
                &m.experts_read,
            ),
            (
                "expert_bytes_read",
                "Routed-expert weight bytes read (each distinct expert once per MoE call)",
                &m.expert_bytes_read,
            ),
        ];
        for (name, help, counter) in counters {
            r.register(name, help, counter.clone());
        }
        let slots_total = Gauge::<i64>::default();
        slots_total.set(slots as i64);
        r.register("slots", "Slots (--parallel)", slots_total);
        let gauges = [
            (
                "queue_length",
                "Requests waiting for a slot",
                &m.queue_length,
            ),
            ("slots_busy", "Slots holding a request", &m.slots_busy),
            (
                "kv_cache_bytes",
                "KV cache bytes held by the slots",
                &m.kv_cache_bytes,
            ),
        ];
        for (name, help, gauge) in gauges {
            r.register(name, help, gauge.clone());
        }
        r.register(
            "decode_tokens_per_second",
            "Tokens generated per second of engine steps over the last 10 s",
            m.decode_tokens_per_second.clone(),
        );
        if m.residency.is_some() {
            r.register(
                "expert_cache",
                "Expert cache counters (residency_json: hits, misses, h2d_bytes, evictions, ...)",
                m.expert_cache.clone(),
            );
        }
        if m.exported_profile.is_some() {
            r.register(
                "forward_seconds",
                "Wall time per part of the forward passes, prefill and decode (--profile)",
                m.forward_seconds.clone(),
            );
            r.register(
                "forward_calls",
                "Calls per part of the forward passes, prefill and decode (--profile)",
                m.forward_calls.clone(),
            );
        }
        m
    }

    /// Counts one response of `endpoint` with `status`.
    pub fn request(&self, endpoint: &str, status: u16) {
        self.requests
            .get_or_create(&vec![
                ("endpoint".into(), endpoint.into()),
                ("status".into(), status.to_string()),
            ])
            .inc();
    }

    /// Counts an engine step that took `busy` and sampled `sampled` tokens.
    pub fn step(&self, busy: Duration, sampled: usize) {
        self.generated_tokens.inc_by(sampled as u64);
        let mut steps = self.recent_steps();
        steps.push_back((Instant::now(), busy, sampled));
    }

    /// The steps that ended in the last `RATE_WINDOW`; older ones are forgotten (at every step,
    /// so that a server nobody scrapes keeps a window's worth).
    fn recent_steps(&self) -> MutexGuard<'_, VecDeque<(Instant, Duration, usize)>> {
        let mut steps = self.steps.lock().unwrap_or_else(|e| e.into_inner());
        let now = Instant::now();
        while steps
            .front()
            .is_some_and(|&(end, _, _)| now - end > RATE_WINDOW)
        {
            steps.pop_front();
        }
        steps
    }

    /// Tokens sampled per second of the steps that ended in the last `RATE_WINDOW` (0 when
    /// idle).
    fn decode_rate(&self) -> f64 {
        let steps = self.recent_steps();
        let busy: f64 = steps.iter().map(|s| s.1.as_secs_f64()).sum();
        let tokens: usize = steps.iter().map(|s| s.2).sum();
        if busy > 0.0 {
            tokens as f64 / busy
        } else {
            0.0
        }
    }

    /// Adds the expert traffic between two cumulative readings.
    pub fn add_traffic(&self, before: &ExpertTraffic, now: &ExpertTraffic) {
        self.expert_calls
            .inc_by(now.calls.saturating_sub(before.calls));
        self.expert_tokens
            .inc_by(now.tokens.saturating_sub(before.tokens));
        self.experts_read
            .inc_by(now.experts_read.saturating_sub(before.experts_read));
        self.expert_bytes_read
            .inc_by(now.bytes_read.saturating_sub(before.bytes_read));
    }

    /// The OpenMetrics text of every metric now.
    pub fn encode(&self) -> String {
        self.decode_tokens_per_second.set(self.decode_rate());
        if let Some(r) = &self.residency {
            let stats = candle_qmoe_suite::model::residency_json(Some(r));
            for (name, value) in stats.as_object().into_iter().flatten() {
                if let Some(v) = value.as_f64() {
                    self.expert_cache
                        .get_or_create(&vec![("stat".into(), name.clone())])
                        .set(v);
                }
            }
        }
        if let Some(exported) = &self.exported_profile {
            let now = profile::snapshot();
            let mut exported = exported.lock().unwrap_or_else(|e| e.into_inner());
            for (part, time, calls) in now.since(&exported).parts() {
                let labels = vec![("part".to_string(), part.name().to_string())];
                self.forward_seconds
                    .get_or_create(&labels)
                    .inc_by(time.as_secs_f64());
                self.forward_calls.get_or_create(&labels).inc_by(calls);
            }
            *exported = now;
        }
        let mut text = String::new();
        encode(&mut text, &self.registry).expect("writing to a String cannot fail");
        text
    }
}
