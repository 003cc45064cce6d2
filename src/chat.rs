//! Chat templates (docs/architecture.md §11): the checkpoint's own `chat_template` from
//! `tokenizer_config.json`, rendered with minijinja the way transformers' `apply_chat_template`
//! renders it with jinja2, or the built-in template of a family whose synthetic models ship
//! without one.

use std::collections::BTreeMap;
use std::path::Path;

use minijinja::syntax::SyntaxConfig;
use minijinja::value::Serde;
use minijinja::{AutoEscape, Environment, ErrorKind};
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// Extra template variables (`enable_thinking`, …), passed next to `messages`.
pub type Variables = serde_json::Map<String, Value>;

/// The special tokens transformers passes to a template (its `special_tokens_map`).
const SPECIAL_TOKENS: [&str; 7] = [
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
];

/// End-of-turn markers that stop an answer when the template writes them (besides its
/// `eos_token`).
const END_OF_TURN: [&str; 4] = ["<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>"];

/// OLMoE-1B-7B-0924-Instruct's published template (open-instruct's Tulu format of September 2024,
/// with the BOS token in front).
const TULU: &str = "{{ bos_token }}{% for message in messages %}\n{% if message['role'] == 'system' %}\n{{ '<|system|>\n' + message['content'] }}\n{% elif message['role'] == 'user' %}\n{{ '<|user|>\n' + message['content'] }}\n{% elif message['role'] == 'assistant' %}\n{{ '<|assistant|>\n'  + message['content'] + eos_token }}\n{% endif %}\n{% if loop.last and add_generation_prompt %}\n{{ '<|assistant|>' }}\n{% endif %}\n{% endfor %}";

/// Qwen1.5-MoE-A2.7B-Chat's published template (ChatML with a default system prompt).
const CHATML: &str = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

/// What goes wrong with a chat template; each names where the template came from.
#[derive(Debug, thiserror::Error)]
pub enum ChatError {
    /// `tokenizer_config.json` cannot be read, is not JSON, or its `chat_template` is not a
    /// string or a list of `{name, template}` with a `default`.
    #[error("`{path}`: {reason}")]
    Config {
        /// The file.
        path: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The template is not valid Jinja.
    #[error("the chat template of {origin} does not parse (template line {line}): {detail}")]
    Parse {
        /// The file (or built-in) the template came from.
        origin: String,
        /// The line within the template.
        line: usize,
        /// minijinja's message.
        detail: String,
    },
    /// Rendering failed (an unknown method or filter, an operation on the wrong type, …).
    #[error("the chat template of {origin} failed to render (template line {line}): {detail}")]
    Render {
        /// The file (or built-in) the template came from.
        origin: String,
        /// The line within the template.
        line: usize,
        /// minijinja's message.
        detail: String,
    },
    /// The template called `raise_exception`: it refuses this conversation (e.g. roles that do
    /// not alternate).
    #[error("the chat template of {origin} refuses the conversation: {message}")]
    Refused {
        /// The file (or built-in) the template came from.
        origin: String,
        /// The template's own message.
        message: String,
    },
    /// The template rendered the conversation as nothing but whitespace (it ignores `messages`,
    /// or every message is empty): there would be no prompt to answer.
    #[error("the chat template of {origin} renders the conversation as empty text")]
    Empty {
        /// The file (or built-in) the template came from.
        origin: String,
    },
}

/// The error `raise_exception` attaches, so that a refusal is told from other render errors.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
struct Raised(String);

/// One message of a conversation.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Message {
    /// `system`, `user`, `assistant`, … (the template decides which it accepts).
    pub role: String,
    /// The text.
    pub content: String,
}

impl Message {
    /// A `user` message.
    pub fn user(content: impl Into<String>) -> Self {
        Self {
            role: "user".into(),
            content: content.into(),
        }
    }
}

/// A compiled chat template with the special tokens it is rendered with.
#[derive(Debug)]
pub struct ChatTemplate {
    /// Where the template came from (a file path or `built-in <family>`); its name in `env`.
    origin: String,
    /// The Jinja text.
    source: String,
    env: Environment<'static>,
    /// `bos_token`, `eos_token`, … as transformers passes them (unset ones left out).
    special_tokens: BTreeMap<String, String>,
}

/// A special token of `tokenizer_config.json`: a string or an AddedToken object
/// (`{"content": ...}`); `None` when null or absent.
fn special_token(value: &Value) -> Option<String> {
    match value {
        Value::String(s) => Some(s.clone()),
        Value::Object(o) => o.get("content")?.as_str().map(str::to_string),
        _ => None,
    }
}

/// `chat_template` of a tokenizer config: a string, or the template named `default` of a list of
/// `{name, template}`; `None` when absent or null.
fn template_text(config: &Value) -> Result<Option<String>, String> {
    match &config["chat_template"] {
        Value::Null => Ok(None),
        Value::String(s) => Ok(Some(s.clone())),
        Value::Array(list) => list
            .iter()
            .find(|t| t["name"] == "default")
            .and_then(|t| t["template"].as_str())
            .map(|s| Some(s.to_string()))
            .ok_or_else(|| {
                let names: Vec<&str> = list.iter().filter_map(|t| t["name"].as_str()).collect();
                format!(
                    "`chat_template` is a list without a `default` template (it has: {})",
                    names.join(", ")
                )
            }),
        other => Err(format!(
            "`chat_template` must be a string or a list of {{name, template}}, not {other}"
        )),
    }
}

impl ChatTemplate {
    /// Compiles `source` (Jinja) from `origin` with the special tokens it is rendered with; a
    /// template that does not parse is a [`ChatError::Parse`] naming `origin`.
    pub fn new(
        origin: impl Into<String>,
        source: impl Into<String>,
        special_tokens: BTreeMap<String, String>,
    ) -> Result<Self, ChatError> {
        let origin = origin.into();
        let source = source.into();
        // transformers' environment: trim_blocks, lstrip_blocks, loop controls (a feature),
        // `raise_exception`; Python's string and dict methods from minijinja-contrib.
        let mut env = Environment::new();
        let syntax = SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .expect("the default delimiters are valid");
        env.set_syntax(syntax);
        // The name is a file path that may end in `.json`: no escaping whatever it ends with.
        env.set_auto_escape_callback(|_| AutoEscape::None);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |message: String| -> Result<(), _> {
            Err(
                minijinja::Error::new(ErrorKind::InvalidOperation, message.clone())
                    .with_source(Raised(message)),
            )
        });
        env.add_template_owned(origin.clone(), source.clone())
            .map_err(|e| ChatError::Parse {
                origin: origin.clone(),
                line: e.line().unwrap_or(0),
                detail: detail(&e),
            })?;
        Ok(Self {
            origin,
            source,
            env,
            special_tokens,
        })
    }

    /// The `chat_template` of a `tokenizer_config.json` (a string, or the `default` of a list of
    /// `{name, template}`) with its special tokens; `None` when it has none.
    pub fn from_tokenizer_config(path: &Path) -> Result<Option<Self>, ChatError> {
        let config_error = |reason: String| ChatError::Config {
            path: path.display().to_string(),
            reason,
        };
        let bytes = std::fs::read(path).map_err(|e| config_error(e.to_string()))?;
        let config: Value = serde_json::from_slice(&bytes)
            .map_err(|e| config_error(format!("not valid JSON: {e}")))?;
        let Some(source) = template_text(&config).map_err(config_error)? else {
            return Ok(None);
        };
        let special_tokens = SPECIAL_TOKENS
            .iter()
            .filter_map(|&k| Some((k.to_string(), special_token(&config[k])?)))
            .collect();
        Self::new(path.display().to_string(), source, special_tokens).map(Some)
    }

    /// The template of a checkpoint folder: its `tokenizer_config.json`'s, if the file exists
    /// and has one.
    pub fn from_checkpoint(dir: &Path) -> Result<Option<Self>, ChatError> {
        let path = dir.join("tokenizer_config.json");
        if !path.is_file() {
            return Ok(None);
        }
        Self::from_tokenizer_config(&path)
    }

    /// The built-in template of a family (`model_type`) whose synthetic models ship without one:
    /// OLMoE-1B-7B-0924-Instruct's for `olmoe`, Qwen1.5-MoE-A2.7B-Chat's for `qwen2_moe`.
    pub fn builtin(model_type: &str) -> Option<Self> {
        let (source, bos, eos) = match model_type {
            "olmoe" => (TULU, Some("<|endoftext|>"), "<|endoftext|>"),
            "qwen2_moe" => (CHATML, None, "<|im_end|>"),
            _ => return None,
        };
        let special_tokens = [("bos_token", bos), ("eos_token", Some(eos))]
            .into_iter()
            .filter_map(|(k, v)| Some((k.to_string(), v?.to_string())))
            .collect();
        let template = Self::new(format!("built-in {model_type}"), source, special_tokens)
            .expect("the built-in templates parse (tested)");
        Some(template)
    }

    /// Where the template came from: a file path or `built-in <family>`.
    pub fn origin(&self) -> &str {
        &self.origin
    }

    /// The template's Jinja text.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Whether the template reads the variable `name` (e.g. `enable_thinking`).
    pub fn mentions(&self, name: &str) -> bool {
        self.source().contains(name)
    }

    /// Tokens that end an answer: the `eos_token` and the end-of-turn markers the template
    /// writes (`<|im_end|>`, …).
    pub fn stop_tokens(&self) -> Vec<&str> {
        let source = &self.source;
        let mut stops: Vec<&str> = self
            .special_tokens
            .get("eos_token")
            .map(String::as_str)
            .into_iter()
            .chain(END_OF_TURN.into_iter().filter(|m| source.contains(m)))
            .collect();
        stops.sort_unstable();
        stops.dedup();
        stops
    }

    /// Renders `messages` as transformers' `apply_chat_template(messages, tokenize=False,
    /// add_generation_prompt=…, **variables)` does: the template sees `messages`,
    /// `add_generation_prompt`, `tools` and `documents` (none), the special tokens, and
    /// `variables` (which override the rest). Messages rendered as empty text are an error.
    pub fn render(
        &self,
        messages: &[Message],
        add_generation_prompt: bool,
        variables: &Variables,
    ) -> Result<String, ChatError> {
        let mut context = serde_json::Map::new();
        context.insert("messages".into(), serde_json::json!(messages));
        context.insert("add_generation_prompt".into(), add_generation_prompt.into());
        context.insert("tools".into(), Value::Null);
        context.insert("documents".into(), Value::Null);
        for (k, v) in &self.special_tokens {
            context.insert(k.clone(), v.clone().into());
        }
        context.extend(variables.iter().map(|(k, v)| (k.clone(), v.clone())));
        let template = self
            .env
            .get_template(&self.origin)
            .expect("the environment holds the template under its origin");
        let text = template
            .render(minijinja::Value::from(Serde(&context)))
            .map_err(|e| match raised(&e) {
                Some(message) => ChatError::Refused {
                    origin: self.origin.clone(),
                    message,
                },
                None => ChatError::Render {
                    origin: self.origin.clone(),
                    line: e.line().unwrap_or(0),
                    detail: detail(&e),
                },
            })?;
        if text.trim().is_empty() && !messages.is_empty() {
            return Err(ChatError::Empty {
                origin: self.origin.clone(),
            });
        }
        Ok(text)
    }
}

/// A template and the variables it is rendered with: how a prompt becomes a chat turn.
#[derive(Debug)]
pub struct Chat<'a> {
    /// The template.
    pub template: &'a ChatTemplate,
    /// Extra variables (`enable_thinking`, …).
    pub variables: Variables,
}

impl Chat<'_> {
    /// One user `prompt` followed by the assistant's turn (`add_generation_prompt`).
    pub fn prompt(&self, prompt: &str) -> Result<String, ChatError> {
        self.template
            .render(&[Message::user(prompt)], true, &self.variables)
    }
}

/// minijinja's error without the template name and line (the [`ChatError`] carries them).
fn detail(e: &minijinja::Error) -> String {
    match e.detail() {
        Some(d) => format!("{}: {d}", e.kind()),
        None => e.kind().to_string(),
    }
}

/// The message of a `raise_exception` call, if that is what failed.
fn raised(e: &minijinja::Error) -> Option<String> {
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        if let Some(Raised(message)) = s.downcast_ref::<Raised>() {
            return Some(message.clone());
        }
        source = s.source();
    }
    None
}

/// The chat flags of `generate`.
#[derive(clap::Args, Debug, Clone, Default)]
pub struct ChatArgs {
    /// Send the prompt as raw text, without the chat template of Instruct/Chat models.
    #[arg(long, conflicts_with_all = ["chat", "no_think"])]
    pub no_chat: bool,
    /// Apply the chat template even when the model id does not say Instruct/Chat.
    #[arg(long)]
    pub chat: bool,
    /// Pass `enable_thinking=false` to the chat template (Qwen3: answer without a thinking
    /// block).
    #[arg(long)]
    pub no_think: bool,
}

impl ChatArgs {
    /// The extra template variables these flags set.
    pub fn variables(&self) -> Variables {
        let mut vars = Variables::new();
        if self.no_think {
            vars.insert("enable_thinking".into(), false.into());
        }
        vars
    }
}
