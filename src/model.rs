//! Building a model from the command line, shared by `generate` and `bench`: the model flags
//! ([`ModelArgs`]), checkpoint or synthetic loading, expert packs, residency, the chat template
//! to apply.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{bail, ensure, Context, Result};
use candle::{DType, Device};
use candle_qmoe::kernels::cpu::DecodeActivations;
use candle_qmoe::models::{
    self, AnyConfig, ExpertsBackend, ExpertsLoader, ModelConfig, ModelSpec, MoeForCausalLm,
    PackedExperts, QuantizeOptions,
};
use candle_qmoe::pack::{GroupSize, PackFile, ScaleSearch};
use candle_qmoe::plan::{self, ExpertStorage, FitOptions, Plan, PlanOptions, Target};
use candle_qmoe::residency::{
    HybridMode, PolicyKind, Residency, ResidencyOptions, ResidencyStats, Resident,
};
use candle_qmoe::synthetic::{SyntheticKind, SyntheticModel};
use clap::ValueEnum;
use serde_json::json;
use tokenizers::Tokenizer;

use crate::chat::{Chat, ChatArgs, ChatTemplate};

/// `--experts`: how the routed experts are stored and computed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Experts {
    /// INT4 weights with FP16 group scales, computed by the W4A16 kernels.
    Int4,
    /// Dense BF16 experts (the unquantized baseline).
    Bf16,
    /// Dense F32 experts.
    F32,
}

/// `--scale-search`: how the INT4 group scales are chosen when a pack is made.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum ScaleSearchArg {
    /// Minimum squared error over a grid of scales (the default).
    Mse,
    /// Round to nearest with absmax / 7.
    Rtn,
}

impl From<ScaleSearchArg> for ScaleSearch {
    fn from(arg: ScaleSearchArg) -> Self {
        match arg {
            ScaleSearchArg::Mse => Self::Mse,
            ScaleSearchArg::Rtn => Self::Rtn,
        }
    }
}

/// `--dense-weights` (alias `--dtype`): how the non-expert weights are stored and computed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum DenseWeights {
    /// 32-bit floats (twice the checkpoint's bytes; the reference path).
    F32,
    /// bfloat16, the checkpoint's own (the default; on the CPU computed with F32 activations).
    Bf16,
    /// IEEE half precision.
    F16,
    /// INT8 with an FP16 scale per 32 columns against 8-bit activations (CPU only): about half
    /// the bytes per token of bf16; routers, norms and embeddings stay bf16.
    Int8,
}

impl DenseWeights {
    /// The dtype the weights are loaded in (INT8 is requantized from BF16 after loading).
    pub fn dtype(self) -> DType {
        match self {
            Self::F32 => DType::F32,
            Self::Bf16 | Self::Int8 => DType::BF16,
            Self::F16 => DType::F16,
        }
    }
}

/// What a program runs at once, which the memory plan sizes the KV cache and the workspace for:
/// `generate` one sequence in prefill chunks of [`plan::DEFAULT_PREFILL_CHUNK`] tokens; the
/// server its slots, with a step of their decode tokens plus a prompt chunk.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Batching {
    /// Sequences held at once, each with a KV cache over the context.
    pub sequences: usize,
    /// Most tokens in one forward pass, all sequences together.
    pub step_tokens: usize,
}

impl Default for Batching {
    fn default() -> Self {
        Self {
            sequences: 1,
            step_tokens: plan::DEFAULT_PREFILL_CHUNK,
        }
    }
}

/// The flags that choose and build the model.
#[derive(clap::Args, Debug, Clone)]
pub struct ModelArgs {
    /// Hugging Face model id: allenai/OLMoE-1B-7B-0924(-Instruct), allenai/OLMoE-1B-7B-0125(-Instruct),
    /// Qwen/Qwen1.5-MoE-A2.7B(-Chat).
    #[arg(long, default_value = "allenai/OLMoE-1B-7B-0924-Instruct",
          conflicts_with_all = ["model_dir", "synthetic"])]
    pub model_id: String,
    /// Hub revision (branch, tag or commit).
    #[arg(long, conflicts_with_all = ["model_dir", "synthetic"])]
    pub revision: Option<String>,
    /// Local checkpoint folder (config.json, safetensors, tokenizer.json) instead of the hub.
    #[arg(long, conflicts_with = "synthetic")]
    pub model_dir: Option<PathBuf>,
    /// Offline model with random weights and real shapes: tiny, olmoe, qwen2moe, qwen3moe
    /// (Qwen3-30B-A3B) or mixtral (Mixtral-8x7B). The 30B-class kinds' expert pack (15 and 23
    /// GB) is written to a file once (--pack, by default in the cache folder) and memory-mapped.
    #[arg(long, value_parser = parse_arg::<SyntheticKind>)]
    pub synthetic: Option<SyntheticKind>,
    /// Seed of the synthetic model's weights.
    #[arg(long, default_value_t = 42, requires = "synthetic")]
    pub synthetic_seed: u64,
    /// Expert pack: loaded when the file exists (refused if made from another checkpoint),
    /// otherwise created from the checkpoint (or the --synthetic model) and written there.
    /// Without it, `--experts int4` quantizes in memory at every start; a qwen3moe or mixtral
    /// --synthetic model's pack goes to `$XDG_CACHE_HOME/candle-qmoe` (or `~/.cache/candle-qmoe`).
    #[arg(long)]
    pub pack: Option<PathBuf>,
    /// Verify every expert slab of --pack against its checksum at load, instead of each slab
    /// when it is first read.
    #[arg(long, requires = "pack")]
    pub verify: bool,
    /// Read --pack into this process's memory at load instead of memory-mapping it: decoding
    /// then streams the process's own pages (1.05–1.08× tokens/s on a 2-vCPU Xeon), for a load
    /// that reads the whole pack first.
    #[arg(long, requires = "pack")]
    pub pack_in_memory: bool,
    /// Activations of the INT4 experts in decode-sized calls on the CPU: i8 (the default, as
    /// prefill and llama.cpp: half the instructions per weight) or i16 (FP16's rounding, at
    /// twice the instructions). Process-wide; without it QMOE_DECODE_ACTS chooses.
    #[arg(long, value_parser = parse_arg::<DecodeActivations>)]
    pub decode_acts: Option<DecodeActivations>,
    /// Time each part of the forward passes while decoding (projections, attention, routers,
    /// routed experts, lm_head) and report per part the milliseconds and weight bytes per token
    /// and the bandwidth they reach (`generate` and `bench` print and record it; the server
    /// exports every forward pass's seconds and calls per part in `/metrics`). Process-wide;
    /// costs about a microsecond per part and layer.
    #[arg(long)]
    pub profile: bool,
    /// How the routed experts are stored and computed.
    #[arg(long, value_enum, default_value = "int4")]
    pub experts: Experts,
    /// INT4 group size (32, 64, 128, 256) when quantizing; default 128. An existing pack keeps
    /// its own and must match when this is given.
    #[arg(long)]
    pub group_size: Option<usize>,
    /// Non-expert weights (attention, routers, shared experts, dense MLPs, lm_head): default
    /// bf16, the checkpoint's. On the CPU, bf16 and int8 weights are computed with F32
    /// activations by our own kernels; int8 is CPU only.
    #[arg(long, value_enum, alias = "dtype")]
    pub dense_weights: Option<DenseWeights>,
    /// Run on the CPU even when a GPU is available.
    #[arg(long)]
    pub cpu: bool,
    /// INT4 experts kept resident per MoE layer: `all`, a number, or one number per layer
    /// (comma-separated). Without it every expert is resident and no cache runs. On the CPU the
    /// cache lives in host memory, so residency can be exercised and measured anywhere.
    #[arg(long, value_parser = parse_arg::<Resident>)]
    pub resident: Option<Resident>,
    /// Eviction policy of the expert cache: lru, lfu or lfru.
    #[arg(long, default_value = "lru", value_parser = parse_arg::<PolicyKind>)]
    pub policy: PolicyKind,
    /// Copy the next layer's likely experts while the current layer computes.
    #[arg(long)]
    pub prefetch: bool,
    /// Missed experts: `off` copies them into the cache, `always` computes them on the CPU from
    /// the host pack, `auto` chooses by a cost model (link bandwidth vs CPU time).
    #[arg(long, default_value = "off", value_parser = parse_arg::<HybridMode>)]
    pub hybrid: HybridMode,
    /// Memory budget of the device (e.g. 6GiB, 6000MB, or bytes; on the CPU the RAM): the expert
    /// cache gets the largest per-layer capacities that fit next to everything else (see the
    /// `plan` example); refused before anything is loaded when even top-k experts per layer do
    /// not fit. An alternative to --resident.
    #[arg(long, value_parser = parse_budget, conflicts_with = "resident")]
    pub vram_budget: Option<u64>,
    /// Context of a sequence (prompt + generated tokens): generation stops there, and
    /// --vram-budget must hold it; default: the model's maximum (the server's: at most 4096 per
    /// slot).
    #[arg(long)]
    pub ctx: Option<usize>,
    /// Let --vram-budget shorten the context when the model does not fit at the requested one.
    #[arg(long, requires = "vram_budget")]
    pub allow_ctx_reduction: bool,
    /// What runs at once (not a flag: set by the program).
    #[arg(skip)]
    pub batching: Batching,
}

/// A clap value parser for any of the library's `FromStr` types (residency, policy, …).
pub fn parse_arg<T: std::str::FromStr<Err = candle_qmoe::QmoeError>>(s: &str) -> Result<T, String> {
    s.parse().map_err(|e: candle_qmoe::QmoeError| e.to_string())
}

/// Candle's sampler for `temperature` (absent or 0: greedy) and `top_p`, with `top_p` raised to
/// the smallest positive F32 (the sampler's precision): a smaller one rounds to 0, which would
/// keep no token, where the nucleus always keeps the most probable one.
pub fn sampler(
    seed: u64,
    temperature: Option<f64>,
    top_p: Option<f64>,
) -> candle_transformers::generation::LogitsProcessor {
    let top_p = top_p.map(|p| p.max(f32::MIN_POSITIVE.into()));
    candle_transformers::generation::LogitsProcessor::new(seed, temperature, top_p)
}

/// Gives SIGPIPE its default action back, as command-line tools written in C have it: the
/// process ends quietly when the reader of its output goes away (`generate … | head`). Rust
/// ignores the signal, so `println!` would panic on the broken pipe instead. For the examples
/// that print results, not for the server (a client that hangs up must not end it). Does
/// nothing off Unix.
pub fn end_quietly_on_broken_pipe() {
    // SAFETY: called first thing in `main`, before any other thread exists; `signal` with
    // `SIG_DFL` installs no handler code.
    #[cfg(unix)]
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
}

/// A clap value parser for a file the program writes: refused when the flags are read, not
/// after the work, if its folder does not exist or the path is a folder.
pub fn output_path(s: &str) -> Result<std::path::PathBuf, String> {
    let path = std::path::PathBuf::from(s);
    if s.is_empty() {
        return Err("the path is empty".into());
    }
    if path.is_dir() {
        return Err(format!("`{s}` is a folder; name a file"));
    }
    let folder = path
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(std::path::Path::new("."));
    if !folder.is_dir() {
        return Err(format!("folder `{}` does not exist", folder.display()));
    }
    Ok(path)
}

/// `--group-size`, or the library's default group size.
fn group_size_or_default(group_size: Option<usize>) -> Result<GroupSize> {
    Ok(group_size
        .map(GroupSize::new)
        .transpose()?
        .unwrap_or_default())
}

/// A clap value parser for memory sizes (`6GiB`, `6000MB`, bytes).
pub fn parse_budget(s: &str) -> Result<u64, String> {
    plan::parse_bytes(s).map_err(|e| e.to_string())
}

impl Experts {
    /// How the plan stores these experts (`group_size` for INT4, default [`GroupSize::default`]).
    pub fn storage(self, group_size: Option<usize>) -> Result<ExpertStorage> {
        Ok(match self {
            Self::Int4 => ExpertStorage::Int4(group_size_or_default(group_size)?),
            Self::Bf16 => ExpertStorage::Dense(DType::BF16),
            Self::F32 => ExpertStorage::Dense(DType::F32),
        })
    }
}

impl ModelArgs {
    /// The device: the first GPU unless `--cpu` (or no GPU).
    pub fn device(&self) -> Result<Device> {
        Ok(if self.cpu {
            Device::Cpu
        } else {
            Device::cuda_if_available(0)?
        })
    }

    /// The compute dtype of the non-expert weights on `device`.
    pub fn compute_dtype(&self, device: &Device) -> DType {
        self.dense_weights
            .map(DenseWeights::dtype)
            .unwrap_or(Target::of(device).default_dtype())
    }

    /// The residency profile for `resident` experts per layer (`None`: no cache).
    fn residency_options(&self, resident: Option<Resident>) -> Result<Option<ResidencyOptions>> {
        let Some(resident) = resident else {
            let cache_flags =
                self.prefetch || self.hybrid != HybridMode::Off || self.policy != PolicyKind::Lru;
            if cache_flags && self.vram_budget.is_some() {
                // The budget holds every expert: there is no cache for these flags to shape.
                eprintln!(
                    "note: every expert fits the budget, so no expert cache is made and \
                     --policy, --prefetch and --hybrid have no effect"
                );
            } else if cache_flags {
                bail!("--policy, --prefetch and --hybrid apply to an expert cache: add --resident N or --vram-budget");
            }
            return Ok(None);
        };
        if self.experts != Experts::Int4 {
            bail!("--resident applies to --experts int4 (dense experts are always all resident)");
        }
        Ok(Some(ResidencyOptions {
            resident,
            policy: self.policy,
            prefetch: self.prefetch,
            hybrid: self.hybrid,
            ..Default::default()
        }))
    }

    /// The checkpoint folder of `--model-dir`, or of `--model-id` from the hub (not for a
    /// synthetic model).
    fn checkpoint_dir(&self) -> Result<PathBuf> {
        let ckpt = crate::checkpoint::resolve_checkpoint(
            self.model_dir.as_deref(),
            &self.model_id,
            self.revision.as_deref(),
        )?;
        Ok(ckpt.dir)
    }

    /// The model's spec as its checkpoint runs it, read without loading any weights: a head
    /// stored beside `tie_word_embeddings: true` is loaded, so it is counted (the checkpoint
    /// folder is resolved once).
    pub fn spec(&self) -> Result<ModelSpec> {
        if self.synthetic.is_some() {
            return Ok(self.config()?.spec()?);
        }
        let dir = self.checkpoint_dir()?;
        let mut spec = AnyConfig::from_file(dir.join("config.json"))?.spec()?;
        models::untie_if_stored_head(&mut spec, &dir)?;
        Ok(spec)
    }

    /// The model's config, read without loading any weights.
    pub fn config(&self) -> Result<AnyConfig> {
        Ok(match self.synthetic {
            Some(kind) => AnyConfig::from_json_str(&kind.config_json().to_string())?,
            None => AnyConfig::from_file(self.checkpoint_dir()?.join("config.json"))?,
        })
    }

    /// `--vram-budget`: fits `plan` (these flags' [`Self::plan`]) to the budget and returns the
    /// experts per layer to keep resident (`None` when all fit: no cache needed) and the
    /// context limit, or refuses with the plan's breakdown before anything is loaded. Without a
    /// budget: `--resident` and `--ctx`.
    fn fit_budget(&self, plan: &Plan) -> Result<(Option<Resident>, Option<usize>)> {
        let Some(budget) = self.vram_budget else {
            return Ok((self.resident.clone(), self.ctx));
        };
        let fit = plan
            .fit(
                budget,
                &FitOptions {
                    allow_ctx_reduction: self.allow_ctx_reduction,
                    ..Default::default()
                },
            )
            .with_context(|| format!("--vram-budget {}", plan::format_bytes(budget)))?;
        println!(
            "memory plan for {}: {}",
            plan::format_bytes(budget),
            fit.plan.summary()
        );
        print!("{}", fit.plan.table(Some(budget)));
        if fit.ctx_reduced() {
            println!(
                "note: context reduced from {} to {} tokens to fit the budget",
                fit.requested_ctx,
                fit.plan.ctx()
            );
        }
        let resident = fit.plan.expert_cache();
        Ok((resident, Some(fit.plan.ctx())))
    }

    /// The memory plan of these flags (no weights are read): `--ctx` (default the model's) for
    /// each of [`Self::batching`]'s sequences, the `--resident` experts (all without it).
    pub fn plan(&self, dtype: DType, device: &Device) -> Result<Plan> {
        let spec = self.spec()?;
        let options = PlanOptions {
            dtype,
            dense_int8: self.dense_weights == Some(DenseWeights::Int8),
            experts: self.experts.storage(self.group_size)?,
            ctx: self.ctx,
            // The plan's workspace is for `batch × prefill_chunk` tokens.
            batch: self.batching.sequences,
            prefill_chunk: self.batching.step_tokens.div_ceil(self.batching.sequences),
            residency: self.resident.clone().unwrap_or(Resident::All),
            ..PlanOptions::new(Target::of(device))
        };
        Ok(Plan::new(&spec, &options)?)
    }

    /// Refuses, before any weights are read, flags the model cannot run with: `--ctx` outside
    /// `2..=` the model's maximum context (a prompt token and a generated one), and through the
    /// memory plan `--resident` above the model's experts or below its top-k, or a per-layer list
    /// whose length is not the number of MoE layers.
    /// Returns that plan ([`Self::plan`]).
    pub fn check(&self, dtype: DType, device: &Device) -> Result<Plan> {
        if self.group_size.is_some() && self.experts != Experts::Int4 {
            bail!(
                "--group-size is the INT4 experts' group size; it does not apply to --experts {}",
                format!("{:?}", self.experts).to_lowercase()
            );
        }
        let max = self.spec()?.max_position_embeddings;
        if let Some(ctx) = self.ctx.filter(|c| !(2..=max).contains(c)) {
            bail!("--ctx {ctx} must be in 2..={max} (the model's maximum context, max_position_embeddings)");
        }
        self.plan(dtype, device)
    }

    /// How `--pack` is opened: read into memory with `--pack-in-memory`, memory-mapped
    /// otherwise.
    pub fn pack_opener(&self) -> fn(&std::path::Path) -> candle_qmoe::Result<PackFile> {
        match self.pack_in_memory {
            true => PackFile::open_in_memory,
            false => PackFile::open,
        }
    }

    /// Builds the model (synthetic or from a checkpoint) on `device`, after [`Self::check`].
    pub fn load(&self, dtype: DType, device: &Device) -> Result<Loaded> {
        let plan = self.check(dtype, device)?;
        self.load_checked(&plan, dtype, device)
    }

    /// [`Self::load`] for a caller that has run [`Self::check`] itself with these flags, `dtype`
    /// and `device` (the server, which also checks the plan against the device's memory): the
    /// plan is not built again.
    pub fn load_checked(&self, plan: &Plan, dtype: DType, device: &Device) -> Result<Loaded> {
        let (resident, context_limit) = self.fit_budget(plan)?;
        let residency = self.residency_options(resident)?;
        let mut loaded = match self.synthetic {
            Some(kind) => load_synthetic(self, kind, residency, dtype, device)?,
            None => load_checkpoint(self, residency, dtype, device)?,
        };
        loaded.context_limit = context_limit;
        let (ids, vocab) = (
            loaded.tokenizer.get_vocab_size(true),
            loaded.model.spec().vocab_size,
        );
        if ids > vocab {
            eprintln!(
                "note: the tokenizer knows {ids} ids but the model's vocab_size is {vocab}: a \
                 prompt holding ids ≥ {vocab} will be refused (give the model's own tokenizer.json)"
            );
        }
        if self.dense_weights == Some(DenseWeights::Int8) {
            loaded.model.quantize_dense_int8()?;
        }
        if let Some(acts) = self.decode_acts {
            acts.set_current();
        }
        if self.profile {
            candle_qmoe::profile::enable(true);
        }
        if self.prefetch {
            loaded.model.enable_prefetch();
        }
        Ok(loaded)
    }
}

/// Applies a residency profile (if any) to INT4 experts from a pack.
fn with_residency(residency: Option<ResidencyOptions>, experts: PackedExperts) -> PackedExperts {
    match residency {
        Some(opts) => experts.with_residency(opts),
        None => experts,
    }
}

/// The residency figures of a run for a JSON evidence file (`null`s without a cache).
pub fn residency_json(residency: Option<&Arc<Residency>>) -> serde_json::Value {
    let Some(r) = residency else {
        return json!({
            "resident_per_layer": null, "hits": null, "misses": null, "hit_rate": null,
            "h2d_bytes": null, "evictions": null, "prefetch_used": null, "prefetch_wasted": null,
        });
    };
    let s = r.stats();
    let mut v = serde_json::to_value(&s).unwrap_or_default();
    v["hit_rate"] = json!(s.hit_rate());
    v["resident_per_layer"] = json!(r.capacities());
    v["policy"] = json!(format!("{:?}", r.options().policy).to_lowercase());
    v["prefetch"] = json!(r.options().prefetch);
    v["hybrid"] = json!(format!("{:?}", r.options().hybrid).to_lowercase());
    v["peak_device_bytes"] = json!(r.peak_device_bytes());
    v
}

/// One line of residency counters for a stats print-out.
pub fn residency_line(s: &ResidencyStats, capacities: &[usize]) -> String {
    let caps = match capacities.iter().min().zip(capacities.iter().max()) {
        Some((lo, hi)) if lo == hi => format!("{lo}/layer"),
        Some((lo, hi)) => format!("{lo}..{hi}/layer"),
        None => "-".into(),
    };
    format!(
        "resident {caps} | hits {} misses {} (hit rate {}) | evictions {} | h2d {:.1} MB | \
         prefetch used {} wasted {} | cpu-computed misses {} | stall {:.3} s",
        s.hits,
        s.misses,
        s.hit_rate()
            .map_or("n/a".into(), |r| format!("{:.1}%", 100.0 * r)),
        s.evictions,
        s.h2d_bytes as f64 / 1e6,
        s.prefetch_used,
        s.prefetch_wasted,
        s.hybrid_cpu_experts,
        s.stall_s
    )
}

/// Everything `main` needs once the model is built.
pub struct Loaded {
    /// The model.
    pub model: MoeForCausalLm,
    /// Its tokenizer.
    pub tokenizer: Tokenizer,
    /// Hub id, folder or `synthetic:<kind>`.
    pub model_id: String,
    /// Hub commit, `local` or the synthetic seed.
    pub revision: String,
    /// Instruct/Chat model (or synthetic): use the chat template unless `--no-chat`.
    pub instruct: bool,
    /// The checkpoint's chat template, or the family's built-in one when it ships none.
    pub chat_template: Option<ChatTemplate>,
    /// `eos_token_id`s from config.json and generation_config.json.
    pub eos: Vec<u32>,
    /// Group size of the INT4 experts.
    pub group_size: Option<usize>,
    /// The expert cache, when `--resident` or `--vram-budget` asks for one.
    pub residency: Option<Arc<Residency>>,
    /// `--ctx`, or the context `--vram-budget` fitted (generation must stay within it).
    pub context_limit: Option<usize>,
}

impl Loaded {
    /// How prompts become chat turns under `args`: none with `--no-chat`; the model's template
    /// for Instruct/Chat (and synthetic) models or with `--chat` (refused when it has none),
    /// with `args`' variables.
    pub fn chat(&self, args: &ChatArgs) -> Result<Option<Chat<'_>>> {
        if args.no_chat || !(args.chat || self.instruct) {
            return Ok(None);
        }
        let Some(template) = &self.chat_template else {
            if args.chat {
                bail!(
                    "--chat: {} has no chat template (no `chat_template` in its \
                     tokenizer_config.json, and no built-in one for `{}`)",
                    self.model_id,
                    self.model.spec().model_type
                );
            }
            return Ok(None);
        };
        if args.no_think && !template.mentions("enable_thinking") {
            eprintln!(
                "note: --no-think has no effect: the chat template of {} does not read \
                 `enable_thinking`",
                template.origin()
            );
        }
        Ok(Some(Chat {
            template,
            variables: args.variables(),
        }))
    }

    /// `prompt` as one user turn of `chat` and tokenized (the tokenizer's special tokens are
    /// added only without a template, which brings its own).
    pub fn encode(&self, prompt: &str, chat: Option<&Chat>) -> Result<Vec<u32>> {
        let text = match chat {
            Some(chat) => chat.prompt(prompt)?,
            None => prompt.to_string(),
        };
        Ok(self
            .tokenizer
            .encode(text.as_str(), chat.is_none())
            .map_err(anyhow::Error::msg)?
            .get_ids()
            .to_vec())
    }

    /// The ids that end an answer: the configs' `eos_token_id`s and `template`'s stop tokens
    /// (its `eos_token` and end-of-turn markers), sorted and deduplicated.
    pub fn stop_ids(&self, template: Option<&ChatTemplate>) -> Vec<u32> {
        let mut ids = self.eos.clone();
        for tok in template.map(ChatTemplate::stop_tokens).unwrap_or_default() {
            ids.extend(self.tokenizer.token_to_id(tok));
        }
        ids.sort_unstable();
        ids.dedup();
        ids
    }

    /// The context generation must fit: the model's, or the shorter one of `--ctx` and what
    /// `--vram-budget` fitted.
    pub fn context(&self) -> usize {
        let max = self.model.spec().max_position_embeddings;
        self.context_limit.map_or(max, |c| c.min(max))
    }
}

/// The EOS ids a checkpoint file lists in `eos_token_id`: none when the file is absent; an
/// error naming the file when it is not JSON or an id is not in the model's `vocab` (a silently
/// lost EOS would run every reply to `--sample-len`).
fn eos_ids_of_file(path: &std::path::Path, vocab: usize) -> Result<Vec<u32>> {
    let bytes = match std::fs::read(path) {
        Ok(bytes) => bytes,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e).with_context(|| format!("cannot read `{}`", path.display())),
    };
    let json: serde_json::Value = serde_json::from_slice(&bytes)
        .with_context(|| format!("`{}` is not valid JSON", path.display()))?;
    eos_ids(&json, &format!("`{}`", path.display()), vocab)
}

/// The ids of a config's `eos_token_id` (one id, a list, or none), each a token id below
/// `vocab` (the model could never generate another), or an error naming `source`.
fn eos_ids(config: &serde_json::Value, source: &str, vocab: usize) -> Result<Vec<u32>> {
    let ids = match &config["eos_token_id"] {
        serde_json::Value::Null => return Ok(Vec::new()),
        serde_json::Value::Array(a) => a.as_slice(),
        one => std::slice::from_ref(one),
    };
    ids.iter()
        .map(|v| {
            v.as_u64()
                .and_then(|id| u32::try_from(id).ok())
                .with_context(|| {
                    format!(
                        "{source}: eos_token_id {v} is not a token id (a whole number, or a \
                         list of them)"
                    )
                })
                .and_then(|id| {
                    ensure!(
                        (id as usize) < vocab,
                        "{source}: eos_token_id {id} is beyond the model's vocabulary \
                         (vocab_size {vocab}): it could never be generated"
                    );
                    Ok(id)
                })
        })
        .collect()
}

fn load_synthetic(
    args: &ModelArgs,
    kind: SyntheticKind,
    residency: Option<ResidencyOptions>,
    dtype: DType,
    device: &Device,
) -> Result<Loaded> {
    println!(
        "synthetic {kind} model: real shapes, deterministic RANDOM weights (seed {}) — the text \
         it generates is nonsense; it shows that everything runs and what speed and memory to \
         expect",
        args.synthetic_seed
    );
    let group = group_size_or_default(args.group_size)?;
    let synth = match synthetic_pack_path(args, kind, group)? {
        Some(path) => synthetic_with_pack_file(args, kind, group, &path)?,
        None => SyntheticModel::new(kind, args.synthetic_seed, group)?,
    };
    if args.verify {
        verify_pack(synth.pack())?;
    }
    let (tokenizer, note) = crate::tokenizer::synthetic_tokenizer(kind)?;
    if let Some(note) = note {
        println!("note: {note}");
    }
    let family = crate::tokenizer::synthetic_tokenizer_family(kind);
    let experts = match args.experts {
        Experts::Int4 => with_residency(residency, synth.int4_experts()),
        Experts::Bf16 | Experts::F32 => {
            let dt = if args.experts == Experts::Bf16 {
                DType::BF16
            } else {
                DType::F32
            };
            let need = synth.dense_expert_bytes(dt) as u64;
            if let Some(avail) = crate::system::available_memory_bytes().filter(|&a| need > a) {
                bail!(
                    "dense {:?} experts of the synthetic {kind} model need {}, more than the {} \
                     of memory available; use --experts int4 or --synthetic tiny",
                    args.experts,
                    plan::format_bytes(need),
                    plan::format_bytes(avail)
                );
            }
            if need > 4 << 30 {
                eprintln!(
                    "warning: dense experts take {} of memory",
                    plan::format_bytes(need)
                );
            }
            synth.dense_experts(dt)
        }
    };
    let model = synth.load(dtype, device, &experts)?;
    let eos = eos_ids(
        &kind.config_json(),
        "the synthetic config",
        model.spec().vocab_size,
    )?;
    Ok(Loaded {
        model,
        tokenizer,
        model_id: format!("synthetic:{kind}"),
        revision: format!("seed {}", args.synthetic_seed),
        instruct: true,
        chat_template: family.and_then(ChatTemplate::builtin),
        eos,
        group_size: (args.experts == Experts::Int4).then_some(group.get()),
        residency: experts.residency().cloned(),
        context_limit: None,
    })
}

/// `--verify`: checks every slab of `pack` against its checksum now.
fn verify_pack(pack: &PackFile) -> Result<()> {
    let start = std::time::Instant::now();
    pack.verify()?;
    println!(
        "verified the {} of expert slabs in {:.2} s",
        plan::format_bytes(pack.total_bytes() as u64),
        start.elapsed().as_secs_f64()
    );
    Ok(())
}

/// Where the expert pack of a synthetic model goes: `--pack`, or for the
/// [`SyntheticKind::large`] kinds `synthetic-<kind>-seed<N>-g<G>.qmoe` in the cache folder
/// (`$XDG_CACHE_HOME/candle-qmoe`, else `$HOME/.cache/candle-qmoe`); `None`: built in memory.
fn synthetic_pack_path(
    args: &ModelArgs,
    kind: SyntheticKind,
    group: GroupSize,
) -> Result<Option<PathBuf>> {
    if args.pack.is_some() || !kind.large() {
        return Ok(args.pack.clone());
    }
    let cache = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .context(
            "neither XDG_CACHE_HOME nor HOME is set: pass --pack FILE for the synthetic pack",
        )?;
    let name = format!(
        "synthetic-{kind}-seed{}-g{}.qmoe",
        args.synthetic_seed,
        group.get()
    );
    Ok(Some(cache.join("candle-qmoe").join(name)))
}

/// The synthetic model with its experts memory-mapped from the pack at `path`, written first
/// (one MoE layer at a time, with a progress bar) when it does not exist, after checking that
/// its folder's disk has room for it.
fn synthetic_with_pack_file(
    args: &ModelArgs,
    kind: SyntheticKind,
    group: GroupSize,
    path: &std::path::Path,
) -> Result<SyntheticModel> {
    let seed = args.synthetic_seed;
    let bar = if path.exists() {
        println!(
            "expert pack `{}` (synthetic {kind}, seed {seed})",
            path.display()
        );
        indicatif::ProgressBar::hidden()
    } else {
        let dir = path.parent().filter(|d| !d.as_os_str().is_empty());
        let dir = dir.unwrap_or(std::path::Path::new("."));
        std::fs::create_dir_all(dir)
            .with_context(|| format!("cannot create the folder `{}`", dir.display()))?;
        let need = kind.pack_bytes(group)?;
        let free = fs2::available_space(dir)
            .with_context(|| format!("cannot read the free space of `{}`", dir.display()))?;
        if free < need {
            bail!(
                "the synthetic {kind} expert pack needs {} on disk but `{}` has {} free: free \
                 some space or pass --pack FILE on another disk",
                plan::format_bytes(need),
                dir.display(),
                plan::format_bytes(free)
            );
        }
        println!(
            "creating the synthetic expert pack `{}`: {} of INT4 experts, one MoE layer at a \
             time (later runs memory-map it)",
            path.display(),
            plan::format_bytes(need)
        );
        indicatif::ProgressBar::new(0).with_style(indicatif::ProgressStyle::with_template(
            "writing experts [{elapsed_precise}] {wide_bar} MoE layer {pos}/{len} ({eta} left)",
        )?)
    };
    let open = args.pack_opener();
    let synth = SyntheticModel::with_pack_file(kind, seed, group, path, open, &|done, total| {
        bar.set_length(total as u64);
        bar.set_position(done as u64);
    });
    bar.finish();
    Ok(synth?)
}

/// The expert pack for `--experts int4`: `--pack` loaded or created, or quantized in memory.
fn int4_pack(args: &ModelArgs, ckpt: &crate::checkpoint::Checkpoint) -> Result<PackFile> {
    let opts = QuantizeOptions {
        group_size: group_size_or_default(args.group_size)?,
        source_model: ckpt.model_id.clone(),
        source_revision: ckpt.revision.clone(),
        ..Default::default()
    };
    let Some(path) = &args.pack else {
        return crate::checkpoint::quantize_with_progress(&ckpt.dir, &opts);
    };
    if !path.exists() {
        println!("creating the expert pack `{}`", path.display());
        crate::checkpoint::quantize_to_file_with_progress(&ckpt.dir, path, &opts)?;
    }
    let pack = args.pack_opener()(path)?;
    if args.verify {
        verify_pack(&pack)?;
    }
    let m = pack.meta();
    if let Some(g) = args.group_size.filter(|&g| g != m.layout.group_size.get()) {
        bail!(
            "`{}` has group size {}, not the requested {g}; drop --group-size or use another --pack",
            path.display(),
            m.layout.group_size.get()
        );
    }
    println!(
        "expert pack `{}`: group size {}, made from {} (revision {})",
        path.display(),
        m.layout.group_size.get(),
        m.source_model,
        m.source_revision
    );
    Ok(pack)
}

fn load_checkpoint(
    args: &ModelArgs,
    residency: Option<ResidencyOptions>,
    dtype: DType,
    device: &Device,
) -> Result<Loaded> {
    let ckpt = crate::checkpoint::resolve_checkpoint(
        args.model_dir.as_deref(),
        &args.model_id,
        args.revision.as_deref(),
    )?;
    let config = AnyConfig::from_file(ckpt.dir.join("config.json"))?;
    // Before the weights: a missing tokenizer or a damaged generation config fails fast.
    let tokenizer = crate::tokenizer::load_tokenizer(&ckpt.dir, config.model_type())?;
    let spec = config.spec()?;
    let (stored, layers) = (models::stored_decoder_layers(&ckpt.dir)?, spec.num_layers());
    if stored > layers {
        eprintln!(
            "note: the checkpoint stores {stored} decoder layers but config.json's \
             num_hidden_layers is {layers}: the model runs the first {layers} only"
        );
    }
    let vocab = spec.vocab_size;
    let mut eos = eos_ids_of_file(&ckpt.dir.join("config.json"), vocab)?;
    eos.extend(eos_ids_of_file(
        &ckpt.dir.join("generation_config.json"),
        vocab,
    )?);
    let mut cache = None;
    let (experts, group): (Box<dyn ExpertsLoader>, _) = match args.experts {
        Experts::Int4 => {
            let pack = Arc::new(int4_pack(args, &ckpt)?);
            let group = pack.meta().layout.group_size.get();
            let experts =
                with_residency(residency, PackedExperts::for_checkpoint(pack, &ckpt.dir)?);
            cache = experts.residency().cloned();
            (Box::new(experts), Some(group))
        }
        Experts::Bf16 | Experts::F32 if args.pack.is_some() => {
            bail!("--pack holds INT4 experts; it only applies to --experts int4")
        }
        Experts::Bf16 => (Box::new(ExpertsBackend::DenseAs(DType::BF16)), None),
        Experts::F32 => (Box::new(ExpertsBackend::DenseAs(DType::F32)), None),
    };
    // SAFETY: the checkpoint files are not modified while the model is alive.
    let vb = unsafe { models::mmap_checkpoint(&ckpt.dir, dtype, device)? };
    let model =
        MoeForCausalLm::new(&config, vb, experts.as_ref()).with_context(|| match &args.pack {
            Some(p) => format!(
                "cannot build the model with the expert pack `{}` (delete it or pass another \
                 --pack path to re-create it from this checkpoint)",
                p.display()
            ),
            None => "cannot build the model".to_string(),
        })?;
    let name = ckpt.model_id.to_lowercase();
    let chat_template = ChatTemplate::from_checkpoint(&ckpt.dir)?
        .or_else(|| ChatTemplate::builtin(config.model_type()));
    Ok(Loaded {
        model,
        tokenizer,
        instruct: name.contains("instruct") || name.contains("chat"),
        chat_template,
        model_id: ckpt.model_id,
        revision: ckpt.revision,
        eos,
        group_size: group,
        residency: cache,
        context_limit: None,
    })
}
