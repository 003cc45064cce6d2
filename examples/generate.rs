//! Text generation with OLMoE or Qwen1.5-MoE whose routed experts run in INT4.
//!
//! ```text
//! # Offline, no download: a synthetic model with OLMoE-1B-7B's shapes and random weights.
//! cargo run --release --example generate -- --synthetic olmoe --cpu -n 32 --prompt "Hello"
//! # A real model from the Hugging Face hub; the expert pack is created once, then reused.
//! cargo run --release --example generate -- --model-id allenai/OLMoE-1B-7B-0924-Instruct \
//!     --pack olmoe-0924-instruct-g128.qmoe --prompt "What is a mixture of experts?"
//! ```
//!
//! Prints the completion as it is generated, then a stats line: prompt tokens and prefill rate,
//! generated tokens and decode rate ((generated − 1) / time after the first token), time to
//! first token, peak RSS. `--stats-json PATH` writes the same figures plus the generated ids.

mod common;

use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use candle::{DType, Device};
use candle_qmoe::generation::{generate, Generation};
use candle_qmoe::models::{
    self, AnyConfig, ExpertsBackend, ExpertsLoader, MoeForCausalLm, PackedExperts, QuantizeOptions,
};
use candle_qmoe::pack::{GroupSize, PackFile};
use candle_qmoe::synthetic::{SyntheticKind, SyntheticModel};
use candle_transformers::generation::LogitsProcessor;
use clap::{Parser, ValueEnum};
use serde_json::json;
use tokenizers::Tokenizer;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Experts {
    /// INT4 weights with FP16 group scales, computed by the W4A16 kernels.
    Int4,
    /// Dense BF16 experts (the unquantized baseline).
    Bf16,
    /// Dense F32 experts.
    F32,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum Dtype {
    /// 32-bit floats (the CPU default).
    F32,
    /// bfloat16 (the GPU default).
    Bf16,
    /// IEEE half precision.
    F16,
}

impl Dtype {
    fn dtype(self) -> DType {
        match self {
            Self::F32 => DType::F32,
            Self::Bf16 => DType::BF16,
            Self::F16 => DType::F16,
        }
    }
}

#[derive(Parser, Debug)]
#[command(about = "Generate text with a MoE model whose routed experts run in INT4")]
struct Args {
    /// Hugging Face model id: allenai/OLMoE-1B-7B-0924(-Instruct), allenai/OLMoE-1B-7B-0125(-Instruct),
    /// Qwen/Qwen1.5-MoE-A2.7B(-Chat).
    #[arg(long, default_value = "allenai/OLMoE-1B-7B-0924-Instruct")]
    model_id: String,
    /// Hub revision (branch, tag or commit).
    #[arg(long)]
    revision: Option<String>,
    /// Local checkpoint folder (config.json, safetensors, tokenizer.json) instead of the hub.
    #[arg(long, conflicts_with = "synthetic")]
    model_dir: Option<PathBuf>,
    /// Offline model with random weights and real shapes: tiny, olmoe or qwen2moe.
    #[arg(long, value_parser = parse_synthetic)]
    synthetic: Option<SyntheticKind>,
    /// Seed of the synthetic model's weights.
    #[arg(long, default_value_t = 42, requires = "synthetic")]
    synthetic_seed: u64,
    /// Expert pack: loaded when the file exists (refused if made from another checkpoint),
    /// otherwise created from the checkpoint and written there. Without it, `--experts int4`
    /// quantizes in memory at every start.
    #[arg(long, conflicts_with = "synthetic")]
    pack: Option<PathBuf>,
    /// How the routed experts are stored and computed.
    #[arg(long, value_enum, default_value = "int4")]
    experts: Experts,
    /// INT4 group size (32, 64, 128, 256) when quantizing; default 128. An existing pack keeps
    /// its own and must match when this is given.
    #[arg(long)]
    group_size: Option<usize>,
    /// Compute dtype of everything except the routed experts (default: f32 on the CPU, bf16 on
    /// a GPU).
    #[arg(long, value_enum)]
    dtype: Option<Dtype>,
    /// The prompt.
    #[arg(
        long,
        default_value = "Explain in two sentences what a mixture-of-experts model is."
    )]
    prompt: String,
    /// Tokens to generate at most.
    #[arg(short = 'n', long, default_value_t = 128)]
    sample_len: usize,
    /// Sampling temperature; absent or 0 = greedy.
    #[arg(long)]
    temperature: Option<f64>,
    /// Nucleus sampling probability cutoff.
    #[arg(long)]
    top_p: Option<f64>,
    /// Sampling seed.
    #[arg(long, default_value_t = 299792458)]
    seed: u64,
    /// Penalty for repeating tokens (1 = none).
    #[arg(long, default_value_t = 1.1)]
    repeat_penalty: f32,
    /// Context size the repeat penalty looks back over.
    #[arg(long, default_value_t = 64)]
    repeat_last_n: usize,
    /// Run on the CPU even when a GPU is available.
    #[arg(long)]
    cpu: bool,
    /// Send the prompt as raw text, without the chat template of Instruct/Chat models.
    #[arg(long, conflicts_with = "chat")]
    no_chat: bool,
    /// Apply the family's chat template even when the model id does not say Instruct/Chat.
    #[arg(long)]
    chat: bool,
    /// Write the stats and the generated token ids to this JSON file.
    #[arg(long)]
    stats_json: Option<PathBuf>,
}

fn parse_synthetic(s: &str) -> Result<SyntheticKind, String> {
    s.parse().map_err(|e: candle_qmoe::QmoeError| e.to_string())
}

/// The chat templates of the supported Instruct/Chat models.
#[derive(Clone, Copy, Debug)]
enum Template {
    /// OLMoE-Instruct (tulu): `<|endoftext|><|user|>\n{prompt}\n<|assistant|>\n`.
    Tulu,
    /// Qwen1.5-Chat (ChatML with the default system prompt).
    ChatMl,
}

impl Template {
    fn for_family(model_type: &str) -> Option<Self> {
        match model_type {
            "olmoe" => Some(Self::Tulu),
            "qwen2_moe" => Some(Self::ChatMl),
            _ => None,
        }
    }

    fn apply(self, prompt: &str) -> String {
        match self {
            Self::Tulu => format!("<|endoftext|><|user|>\n{prompt}\n<|assistant|>\n"),
            Self::ChatMl => format!(
                "<|im_start|>system\nYou are a helpful assistant<|im_end|>\n\
                 <|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n"
            ),
        }
    }

    /// Tokens that end an answer, besides the config's `eos_token_id`.
    fn stop_tokens(self) -> &'static [&'static str] {
        match self {
            Self::Tulu => &["<|endoftext|>"],
            Self::ChatMl => &["<|im_end|>", "<|endoftext|>"],
        }
    }
}

/// Everything `main` needs once the model is built.
struct Loaded {
    model: MoeForCausalLm,
    tokenizer: Tokenizer,
    model_id: String,
    revision: String,
    /// Instruct/Chat model (or synthetic): use the chat template unless `--no-chat`.
    instruct: bool,
    /// `eos_token_id`s from config.json and generation_config.json.
    eos: Vec<u32>,
    /// Group size of the INT4 experts.
    group_size: Option<usize>,
}

/// The `eos_token_id` (a number or a list) of a config JSON.
fn eos_ids(config: &serde_json::Value) -> Vec<u32> {
    match &config["eos_token_id"] {
        serde_json::Value::Number(n) => n.as_u64().map(|v| v as u32).into_iter().collect(),
        serde_json::Value::Array(a) => a
            .iter()
            .filter_map(|v| v.as_u64())
            .map(|v| v as u32)
            .collect(),
        _ => Vec::new(),
    }
}

fn read_json(path: &std::path::Path) -> Option<serde_json::Value> {
    serde_json::from_slice(&std::fs::read(path).ok()?).ok()
}

fn group_size(args: &Args) -> Result<GroupSize> {
    Ok(GroupSize::new(args.group_size.unwrap_or(128))?)
}

fn load_synthetic(
    args: &Args,
    kind: SyntheticKind,
    dtype: DType,
    device: &Device,
) -> Result<Loaded> {
    println!(
        "synthetic {kind} model: real shapes, deterministic RANDOM weights (seed {}) — the text \
         it generates is nonsense; it shows that everything runs and what speed and memory to \
         expect",
        args.synthetic_seed
    );
    let group = group_size(args)?;
    let synth = SyntheticModel::new(kind, args.synthetic_seed, group)?;
    let experts = match args.experts {
        Experts::Int4 => synth.int4_experts(),
        Experts::Bf16 | Experts::F32 => {
            let dt = if args.experts == Experts::Bf16 {
                DType::BF16
            } else {
                DType::F32
            };
            let need = synth.dense_expert_bytes(dt) as u64;
            if let Some(avail) = common::available_memory_bytes().filter(|&a| need > a) {
                bail!(
                    "dense {:?} experts of the synthetic {kind} model need {}, more than the {} \
                     of memory available; use --experts int4 or --synthetic tiny",
                    args.experts,
                    common::human_bytes(need),
                    common::human_bytes(avail)
                );
            }
            if need > 4 << 30 {
                eprintln!(
                    "warning: dense experts take {} of memory",
                    common::human_bytes(need)
                );
            }
            synth.dense_experts(dt)
        }
    };
    let model = synth.load(dtype, device, &experts)?;
    let model_type = synth.config().model_type();
    Ok(Loaded {
        model,
        tokenizer: common::bundled_tokenizer(model_type)?,
        model_id: format!("synthetic:{kind}"),
        revision: format!("seed {}", args.synthetic_seed),
        instruct: true,
        eos: eos_ids(&kind.config_json()),
        group_size: (args.experts == Experts::Int4).then_some(group.get()),
    })
}

/// The expert pack for `--experts int4`: `--pack` loaded or created, or quantized in memory.
fn int4_pack(args: &Args, ckpt: &common::Checkpoint) -> Result<PackFile> {
    let opts = QuantizeOptions {
        group_size: group_size(args)?,
        source_model: ckpt.model_id.clone(),
        source_revision: ckpt.revision.clone(),
        ..Default::default()
    };
    let Some(path) = &args.pack else {
        return common::quantize_with_progress(&ckpt.dir, &opts);
    };
    if !path.exists() {
        println!("creating the expert pack `{}`", path.display());
        common::quantize_with_progress(&ckpt.dir, &opts)?.save(path)?;
    }
    let pack = PackFile::open(path)?;
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

fn load_checkpoint(args: &Args, dtype: DType, device: &Device) -> Result<Loaded> {
    let ckpt = common::resolve_checkpoint(
        args.model_dir.as_deref(),
        &args.model_id,
        args.revision.as_deref(),
    )?;
    let config = AnyConfig::from_file(ckpt.dir.join("config.json"))?;
    let (experts, group): (Box<dyn ExpertsLoader>, _) = match args.experts {
        Experts::Int4 => {
            let pack = Arc::new(int4_pack(args, &ckpt)?);
            let group = pack.meta().layout.group_size.get();
            (
                Box::new(PackedExperts::for_checkpoint(pack, &ckpt.dir)?),
                Some(group),
            )
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
    let mut eos = eos_ids(&read_json(&ckpt.dir.join("config.json")).unwrap_or_default());
    eos.extend(eos_ids(
        &read_json(&ckpt.dir.join("generation_config.json")).unwrap_or_default(),
    ));
    let name = ckpt.model_id.to_lowercase();
    Ok(Loaded {
        model,
        tokenizer: common::load_tokenizer(&ckpt.dir, config.model_type())?,
        instruct: name.contains("instruct") || name.contains("chat"),
        model_id: ckpt.model_id,
        revision: ckpt.revision,
        eos,
        group_size: group,
    })
}

fn check_args(args: &Args) -> Result<()> {
    if args.prompt.trim().is_empty() {
        bail!("the prompt is empty");
    }
    if let Some(p) = args.top_p.filter(|p| !(*p > 0.0 && *p <= 1.0)) {
        bail!("--top-p {p} must be in (0, 1]");
    }
    if let Some(t) = args.temperature.filter(|t| !(t.is_finite() && *t >= 0.0)) {
        bail!("--temperature {t} must be ≥ 0");
    }
    if !(args.repeat_penalty.is_finite() && args.repeat_penalty > 0.0) {
        bail!("--repeat-penalty {} must be > 0", args.repeat_penalty);
    }
    if let Some(g) = args.group_size {
        GroupSize::new(g)?;
    }
    Ok(())
}

fn main() -> Result<()> {
    let args = Args::parse();
    check_args(&args)?;
    let device = if args.cpu {
        Device::Cpu
    } else {
        Device::cuda_if_available(0)?
    };
    let dtype = args.dtype.map(Dtype::dtype).unwrap_or(if device.is_cuda() {
        DType::BF16
    } else {
        DType::F32
    });
    let start = Instant::now();
    let mut loaded = match args.synthetic {
        Some(kind) => load_synthetic(&args, kind, dtype, &device)?,
        None => load_checkpoint(&args, dtype, &device)?,
    };
    let load_time = start.elapsed();
    let spec = loaded.model.spec().clone();
    println!(
        "{} ({}, revision {}): experts {:?}{}, other weights {dtype:?}, {:?}, loaded in {:.1} s",
        loaded.model_id,
        spec.model_type,
        loaded.revision,
        args.experts,
        loaded
            .group_size
            .map(|g| format!(" g{g}"))
            .unwrap_or_default(),
        device,
        load_time.as_secs_f64()
    );

    let template = Template::for_family(&spec.model_type)
        .filter(|_| !args.no_chat && (args.chat || loaded.instruct));
    let text = template.map_or_else(|| args.prompt.clone(), |t| t.apply(&args.prompt));
    let encoding = loaded
        .tokenizer
        .encode(text.as_str(), template.is_none())
        .map_err(anyhow::Error::msg)?;
    let prompt = encoding.get_ids().to_vec();
    let context = spec.max_position_embeddings;
    if prompt.len() >= context {
        bail!(
            "the prompt has {} tokens but the model's context is {context} tokens \
             (max_position_embeddings): no room to generate",
            prompt.len()
        );
    }
    let max_new = args.sample_len.min(context - prompt.len());
    if max_new < args.sample_len {
        eprintln!("note: the context holds only {max_new} more tokens after the prompt");
    }
    let mut eos = loaded.eos.clone();
    for tok in template.map_or(&[][..], |t| t.stop_tokens()) {
        eos.extend(loaded.tokenizer.token_to_id(tok));
    }

    println!("{}", args.prompt);
    let mut logits_processor = LogitsProcessor::new(args.seed, args.temperature, args.top_p);
    let mut stream = loaded.tokenizer.decode_stream(true);
    let mut stdout = std::io::stdout();
    let generation = generate(
        &mut loaded.model,
        &prompt,
        max_new,
        &eos,
        |logits, ctx| {
            let logits = if args.repeat_penalty == 1.0 {
                logits.clone()
            } else {
                let from = ctx.len().saturating_sub(args.repeat_last_n);
                candle_transformers::utils::apply_repeat_penalty(
                    logits,
                    args.repeat_penalty,
                    &ctx[from..],
                )?
            };
            logits_processor.sample(&logits)
        },
        |token| {
            if let Some(piece) = stream.step(token).map_err(candle::Error::msg)? {
                print!("{piece}");
                stdout.flush()?;
            }
            Ok(())
        },
    )?;
    println!();
    report(
        &args,
        &loaded,
        &generation,
        dtype,
        &device,
        load_time.as_secs_f64(),
    )
}

/// Prints the stats line and writes `--stats-json`.
fn report(
    args: &Args,
    loaded: &Loaded,
    g: &Generation,
    dtype: DType,
    device: &Device,
    load_s: f64,
) -> Result<()> {
    let rss = common::peak_rss_bytes();
    let decode = g.decode_tokens_per_s();
    println!(
        "stats: {} prompt tokens, {:.2} tok/s | {} generated tokens, {} decode | time to first \
         token {:.3} s | peak RSS {} | stop: {:?}",
        g.prompt_tokens,
        g.prompt_tokens_per_s(),
        g.tokens.len(),
        decode.map_or("n/a".to_string(), |d| format!("{d:.2} tok/s")),
        g.time_to_first_token.as_secs_f64(),
        rss.map_or("n/a".to_string(), common::human_bytes),
        g.stop
    );
    if let Some(path) = &args.stats_json {
        let stats = json!({
            "cpu": common::cpu_model(),
            "commit": common::git_commit(),
            "command": std::env::args().collect::<Vec<_>>().join(" "),
            "model_id": loaded.model_id,
            "revision": loaded.revision,
            "experts": format!("{:?}", args.experts).to_lowercase(),
            "group_size": loaded.group_size,
            "dtype": format!("{dtype:?}").to_lowercase(),
            "device": format!("{device:?}"),
            "load_time_s": load_s,
            "prompt_tokens": g.prompt_tokens,
            "prompt_tokens_per_s": g.prompt_tokens_per_s(),
            "generated_tokens": g.tokens.len(),
            "decode_tokens_per_s": decode,
            "time_to_first_token_s": g.time_to_first_token.as_secs_f64(),
            "decode_time_s": g.decode_time.as_secs_f64(),
            "peak_rss_bytes": rss,
            "stop_reason": g.stop,
            "seed": args.seed,
            "temperature": args.temperature,
            "top_p": args.top_p,
            "repeat_penalty": args.repeat_penalty,
            "token_ids": g.tokens,
        });
        std::fs::write(path, serde_json::to_string_pretty(&stats)? + "\n")
            .with_context(|| format!("cannot write `{}`", path.display()))?;
    }
    Ok(())
}
