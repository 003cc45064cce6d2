//! One calibration run of the memory plan on the CPU, shared by the `calibrate` example and
//! `tests/calibration.rs`: a synthetic model with a given expert cache is loaded and fills its
//! KV cache to a given context, and the process's peak resident set size is compared with the
//! plan's predicted process RSS for the same configuration.
//!
//! The prompt (`ctx + 1 − new tokens` ids) goes through the model in one forward pass, as
//! [`generate`] does, so the plan is made with a prefill chunk of the prompt's length; the last
//! generated token's forward pass brings the KV cache to exactly `ctx` positions. Measure one
//! configuration per process: the peak RSS (`VmHWM`) covers the whole process.

use std::fmt;
use std::str::FromStr;
use std::time::Instant;

use anyhow::{bail, ensure, Context, Result};
use candle::Device;
use candle_qmoe::generation::{argmax, generate};
use candle_qmoe::pack::GroupSize;
use candle_qmoe::plan::{
    format_bytes, ByteRange, Component, ExpertStorage, Plan, PlanOptions, Target,
    DEFAULT_PREFILL_CHUNK, DEFAULT_STAGING_BUFFERS,
};
use candle_qmoe::residency::{ResidencyOptions, Resident};
use candle_qmoe::synthetic::{SyntheticKind, SyntheticModel};

/// Seed of the synthetic weights (the examples' default).
pub const SEED: u64 = 42;

/// How the INT4 experts are served.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Cache {
    /// No expert cache: the kernels read the pack in place.
    None,
    /// An expert cache holding every expert of a layer.
    All,
    /// An expert cache of this many slots per MoE layer.
    Slots(usize),
}

impl Cache {
    /// The runtime's residency for this cache (`None`: no cache).
    fn runtime(self) -> Option<Resident> {
        match self {
            Self::None => None,
            Self::All => Some(Resident::All),
            Self::Slots(n) => Some(Resident::Uniform(n)),
        }
    }

    /// The plan's residency for this cache: on the CPU [`Resident::All`] means no cache and an
    /// explicit count a cache of that many slots, even of all `num_experts`.
    fn planned(self, num_experts: usize) -> Resident {
        match self {
            Self::None => Resident::All,
            Self::All => Resident::Uniform(num_experts),
            Self::Slots(n) => Resident::Uniform(n),
        }
    }
}

impl FromStr for Cache {
    type Err = anyhow::Error;

    /// `none`, `all` or a number of slots per layer.
    fn from_str(s: &str) -> Result<Self> {
        Ok(match s {
            "none" => Self::None,
            "all" => Self::All,
            n => Self::Slots(n.parse().with_context(|| {
                format!("resident `{n}`: use none, all or a number of experts per layer")
            })?),
        })
    }
}

impl fmt::Display for Cache {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::None => f.write_str("none"),
            Self::All => f.write_str("all"),
            Self::Slots(n) => write!(f, "{n}"),
        }
    }
}

/// One configuration: model, expert cache, context and generated tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Config {
    /// The synthetic model.
    pub kind: SyntheticKind,
    /// The expert cache.
    pub cache: Cache,
    /// Positions in the KV cache at the end of the run (prompt plus generated tokens but the
    /// last, whose forward pass never runs).
    pub ctx: usize,
    /// Tokens generated after the prompt.
    pub new_tokens: usize,
}

impl Config {
    /// Checks the sizes against the model: `1 ≤ new tokens ≤ ctx < max_position_embeddings`
    /// (generation stops when prompt and generated tokens fill the model's positions, one
    /// more than the KV cache holds).
    pub fn new(kind: SyntheticKind, cache: Cache, ctx: usize, new_tokens: usize) -> Result<Self> {
        let max = kind.config_json()["max_position_embeddings"]
            .as_u64()
            .context("the synthetic config has no max_position_embeddings")?;
        ensure!(new_tokens >= 1, "generate at least one token");
        ensure!(
            !kind.large(),
            "calibration builds the expert pack in memory: use tiny, olmoe or qwen2moe, not {kind}"
        );
        ensure!(
            (new_tokens..max as usize).contains(&ctx),
            "ctx {ctx} must be at least the generated tokens ({new_tokens}) and below the \
             model's {max} positions"
        );
        Ok(Self {
            kind,
            cache,
            ctx,
            new_tokens,
        })
    }

    /// Tokens in the prompt: the KV cache ends at `prompt + new tokens − 1 = ctx`.
    pub fn prompt_len(&self) -> usize {
        self.ctx + 1 - self.new_tokens
    }

    /// The plan of this configuration on the CPU: the default dtypes (BF16 weights, F32
    /// activations), INT4 experts in groups of 128,
    /// batch 1, prefill in the chunks `generate` uses, and the cache's residency with the
    /// runtime's default staging ring (no cache: full residency).
    pub fn plan(&self) -> Result<Plan> {
        let spec = self.kind.spec()?;
        let options = PlanOptions {
            dtype: Target::Cpu.default_dtype(),
            experts: ExpertStorage::Int4(GroupSize::default()),
            ctx: Some(self.ctx),
            batch: 1,
            prefill_chunk: self.prompt_len().min(DEFAULT_PREFILL_CHUNK),
            residency: self.cache.planned(spec.uniform_moe()?.num_experts),
            staging_buffers: DEFAULT_STAGING_BUFFERS,
            ..PlanOptions::new(Target::Cpu)
        };
        Ok(Plan::new(&spec, &options)?)
    }

    /// Builds the model, generates, and reads the peak RSS of this process.
    pub fn run(&self) -> Result<Measurement> {
        let start = Instant::now();
        let synth = SyntheticModel::new(self.kind, SEED, GroupSize::default())?;
        let experts = match self.cache.runtime() {
            None => synth.int4_experts(),
            Some(resident) => synth.int4_experts().with_residency(ResidencyOptions {
                resident,
                staging_buffers: DEFAULT_STAGING_BUFFERS,
                ..Default::default()
            }),
        };
        let mut model = synth.load(Target::Cpu.default_dtype(), &Device::Cpu, &experts)?;
        let load_s = start.elapsed().as_secs_f64();
        let vocab = synth.spec().vocab_size as u64;
        // Deterministic ids spread over the vocabulary.
        let prompt: Vec<u32> = (0..self.prompt_len() as u64)
            .map(|i| ((i * 7_919 + 13) % vocab) as u32)
            .collect();
        let generation = generate(
            &mut model,
            &prompt,
            self.new_tokens,
            &[],
            argmax,
            |_| Ok(()),
        )?;
        ensure!(
            generation.tokens.len() == self.new_tokens && model.cached_len() == self.ctx,
            "the run generated {} tokens and cached {} positions, expected {} and {}",
            generation.tokens.len(),
            model.cached_len(),
            self.new_tokens,
            self.ctx
        );
        let Some(peak_rss_bytes) = crate::system::peak_rss_bytes() else {
            bail!("the peak RSS cannot be read here (no /proc/self/status)");
        };
        Ok(Measurement {
            peak_rss_bytes,
            load_s,
            time_to_first_token_s: generation.time_to_first_token.as_secs_f64(),
            decode_s: generation.decode_time.as_secs_f64(),
        })
    }
}

impl FromStr for Config {
    type Err = anyhow::Error;

    /// The [`fmt::Display`] form: `model/resident/ctx/new tokens`, e.g. `tiny/2/256/4`.
    fn from_str(s: &str) -> Result<Self> {
        let parts: Vec<&str> = s.split('/').collect();
        let [kind, cache, ctx, new] = parts[..] else {
            bail!("calibration config `{s}`: expected model/resident/ctx/new-tokens");
        };
        Self::new(
            kind.parse()?,
            cache.parse()?,
            ctx.parse().context("ctx")?,
            new.parse().context("new tokens")?,
        )
    }
}

impl fmt::Display for Config {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}/{}/{}/{}",
            self.kind, self.cache, self.ctx, self.new_tokens
        )
    }
}

/// What one run measured.
#[derive(Clone, Copy, Debug)]
pub struct Measurement {
    /// Peak resident set size of the process (`VmHWM`).
    pub peak_rss_bytes: u64,
    /// Seconds to build the synthetic model and load it.
    pub load_s: f64,
    /// Seconds of the prefill (until the first token).
    pub time_to_first_token_s: f64,
    /// Seconds of the decode after the first token.
    pub decode_s: f64,
}

impl fmt::Display for Measurement {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "peak RSS {}, load {:.2} s, prefill {:.2} s, decode {:.2} s",
            format_bytes(self.peak_rss_bytes),
            self.load_s,
            self.time_to_first_token_s,
            self.decode_s
        )
    }
}

/// The predicted process RSS of `plan`.
pub fn process_rss(plan: &Plan) -> Result<ByteRange> {
    plan.host()
        .iter()
        .find(|c| c.component == Component::ProcessRss)
        .map(|c| c.bytes)
        .context("the plan has no process RSS")
}

/// Whether a measured peak of `bytes` lies inside the predicted `range`.
pub fn inside(range: ByteRange, bytes: u64) -> bool {
    (range.min..=range.max).contains(&bytes)
}
