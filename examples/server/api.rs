//! The OpenAI API's shapes: the request body of `/v1/chat/completions` and `/v1/completions`
//! (unknown fields ignored, as OpenAI does; known ones this server does not implement refused),
//! its checks, the prompt it becomes (the chat
//! template for `messages`), the responses and stream chunks, and the error body
//! `{"error": {"message", "type", "param", "code"}}`.

use std::time::{SystemTime, UNIX_EPOCH};

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use candle_qmoe_suite::chat::{ChatTemplate, Message, Variables};
use serde::Deserialize;
use serde_json::{json, Value};
use tokenizers::Tokenizer;

use crate::engine::{Finish, SamplingParams};

/// An error answered in OpenAI's shape.
#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    message: String,
    param: Option<String>,
    code: Option<&'static str>,
}

impl ApiError {
    /// 400 `invalid_request_error` about `param` (if one field is at fault).
    pub fn invalid(message: impl Into<String>, param: Option<&str>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            param: param.map(str::to_string),
            code: None,
        }
    }

    /// An `invalid_request_error` of another client status (an unknown route or model, a body
    /// too large).
    pub fn client(
        status: StatusCode,
        message: impl Into<String>,
        code: Option<&'static str>,
    ) -> Self {
        Self {
            status,
            message: message.into(),
            param: None,
            code,
        }
    }

    /// A server-side error (500, or 503 with `Retry-After` when the queue is full).
    pub fn server(status: StatusCode, message: impl Into<String>, code: &'static str) -> Self {
        Self {
            status,
            message: message.into(),
            param: None,
            code: Some(code),
        }
    }

    /// The `{"error": …}` body (also sent as an SSE event when a stream fails).
    pub fn body(&self) -> Value {
        let kind = if self.status.is_client_error() {
            "invalid_request_error"
        } else {
            "server_error"
        };
        json!({"error": {
            "message": self.message, "type": kind, "param": self.param, "code": self.code,
        }})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut response = (self.status, axum::Json(self.body())).into_response();
        if self.status == StatusCode::SERVICE_UNAVAILABLE {
            let headers = response.headers_mut();
            headers.insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
        response
    }
}

/// `stop`: one string or a list.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Stop {
    /// One stop string.
    One(String),
    /// Several.
    Many(Vec<String>),
}

/// The `prompt` of `/v1/completions`: a string or token ids, or a batch of one of them.
#[derive(Debug, Deserialize)]
#[serde(
    untagged,
    expecting = "a string, a list of token ids, or a list of one string or token-id list"
)]
pub enum Prompt {
    /// Text.
    Text(String),
    /// A batch of texts (one only).
    Texts(Vec<String>),
    /// Token ids.
    Tokens(Vec<u32>),
    /// A batch of token-id lists (one only).
    TokenLists(Vec<Vec<u32>>),
}

/// `response_format`: only `text` is supported.
#[derive(Debug, Deserialize)]
pub struct ResponseFormat {
    /// `text`, `json_object` or `json_schema`.
    #[serde(rename = "type")]
    pub kind: String,
}

/// A message's `content`: text or a list of parts (only `text` parts).
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Content {
    /// Plain text.
    Text(String),
    /// Content parts.
    Parts(Vec<ContentPart>),
}

/// One content part.
#[derive(Debug, Deserialize)]
pub struct ContentPart {
    /// `text` (other kinds are refused).
    #[serde(rename = "type")]
    pub kind: String,
    /// The text of a `text` part.
    pub text: Option<String>,
}

/// One message of `messages`.
#[derive(Debug, Deserialize)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant`, … (the chat template decides which it accepts).
    pub role: String,
    /// The text (null for an assistant turn without text).
    pub content: Option<Content>,
}

/// `stream_options`.
#[derive(Debug, Default, Deserialize)]
pub struct StreamOptions {
    /// Send a last chunk with the usage counts.
    #[serde(default)]
    pub include_usage: bool,
}

/// The body of either endpoint: `messages` for chat, `prompt` for completions.
#[derive(Debug, Deserialize)]
pub struct CompletionRequest {
    /// Conversation (chat).
    pub messages: Option<Vec<ChatMessage>>,
    /// Prompt (completions).
    pub prompt: Option<Prompt>,
    /// Most tokens to generate.
    pub max_tokens: Option<u32>,
    /// Chat's newer name for `max_tokens`.
    pub max_completion_tokens: Option<u32>,
    /// Sampling temperature in [0, 2] (default 1; 0 is greedy).
    pub temperature: Option<f64>,
    /// Nucleus cutoff in (0, 1].
    pub top_p: Option<f64>,
    /// Sampling seed.
    pub seed: Option<i64>,
    /// Stop strings.
    pub stop: Option<Stop>,
    /// Choices per request: only 1.
    pub n: Option<u32>,
    /// Stream server-sent events.
    pub stream: Option<bool>,
    /// Stream options.
    pub stream_options: Option<StreamOptions>,
    /// Extra chat-template variables (e.g. `{"enable_thinking": false}`), as vLLM takes them.
    pub chat_template_kwargs: Option<Variables>,
    /// Echo the prompt (completions): refused when true.
    pub echo: Option<bool>,
    /// Log probabilities (an integer for completions, a bool for chat): refused unless
    /// null or false.
    pub logprobs: Option<Value>,
    /// Most likely tokens per position (chat): refused above 0.
    pub top_logprobs: Option<u32>,
    /// Output format: refused unless `text`.
    pub response_format: Option<ResponseFormat>,
}

/// Most `stop` strings, as OpenAI allows.
pub const MAX_STOPS: usize = 4;

/// Parses a request body; a JSON or type error names the field (`param`) it is in.
pub fn parse_request(body: &[u8]) -> Result<CompletionRequest, ApiError> {
    let mut de = serde_json::Deserializer::from_slice(body);
    let request = serde_path_to_error::deserialize(&mut de).map_err(|e| {
        let path = e.path().to_string();
        // A value of the wrong type or range names its field; broken JSON names none.
        let data = e.inner().classify() == serde_json::error::Category::Data;
        let param = (data && path != ".").then_some(path);
        let message = match &param {
            Some(p) => format!("invalid request body at `{p}`: {}", e.inner()),
            None => format!("invalid request body: {}", e.inner()),
        };
        ApiError::invalid(message, param.as_deref())
    })?;
    de.end()
        .map_err(|e| ApiError::invalid(format!("invalid request body: {e}"), None))?;
    Ok(request)
}

/// What the tokenizer and chat template need: shared by the handlers.
pub struct Frontend {
    /// The model's name in responses and `/v1/models`.
    pub model_id: String,
    /// The tokenizer.
    pub tokenizer: Tokenizer,
    /// The chat template (`None`: `/v1/chat/completions` is refused).
    pub template: Option<ChatTemplate>,
    /// Tokens per slot.
    pub ctx: usize,
    /// Vocabulary size (token ids in a prompt must be below it).
    pub vocab_size: usize,
}

/// A checked request: the engine's part and how to answer.
pub struct Checked {
    /// Prompt ids.
    pub prompt: Vec<u32>,
    /// Sampling and stops.
    pub params: SamplingParams,
    /// Stream server-sent events.
    pub stream: bool,
    /// Add the usage chunk to the stream.
    pub include_usage: bool,
}

/// A seed for requests that give none.
fn fresh_seed() -> u64 {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default();
    now.as_nanos() as u64 ^ 0x9e37_79b9_7f4a_7c15
}

/// Seconds since the epoch (`created`).
pub fn unix_time() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs()
}

impl Frontend {
    /// The checks and prompt of a chat (`chat`) or completions request.
    pub fn check(&self, r: CompletionRequest, chat: bool) -> Result<Checked, ApiError> {
        if let Some(n) = r.n.filter(|&n| n != 1) {
            return Err(ApiError::invalid(
                format!("n = {n}: this server generates one choice per request (n = 1)"),
                Some("n"),
            ));
        }
        let unsupported = [
            ("echo", r.echo == Some(true)),
            (
                "logprobs",
                r.logprobs.is_some_and(|v| v != Value::Bool(false)),
            ),
            ("top_logprobs", r.top_logprobs.is_some_and(|n| n > 0)),
            (
                "response_format",
                r.response_format.is_some_and(|f| f.kind != "text"),
            ),
        ];
        if let Some((field, _)) = unsupported.iter().find(|(_, given)| *given) {
            return Err(ApiError::invalid(
                format!("`{field}` is not supported by this server"),
                Some(field),
            ));
        }
        let temperature = r.temperature.unwrap_or(1.0);
        if !(0.0..=2.0).contains(&temperature) {
            return Err(ApiError::invalid(
                format!("temperature {temperature} must be in [0, 2]"),
                Some("temperature"),
            ));
        }
        if let Some(p) = r.top_p.filter(|p| !(*p > 0.0 && *p <= 1.0)) {
            return Err(ApiError::invalid(
                format!("top_p {p} must be in (0, 1]"),
                Some("top_p"),
            ));
        }
        let (max_tokens, max_name) = match (r.max_completion_tokens, r.max_tokens) {
            (Some(m), _) if chat => (Some(m), "max_completion_tokens"),
            (_, m) => (m, "max_tokens"),
        };
        if max_tokens == Some(0) {
            return Err(ApiError::invalid(
                format!("{max_name} must be at least 1"),
                Some(max_name),
            ));
        }
        let prompt = if chat {
            self.chat_prompt(r.messages, r.chat_template_kwargs.unwrap_or_default())?
        } else {
            self.text_prompt(r.prompt)?
        };
        let param = if chat { "messages" } else { "prompt" };
        if prompt.is_empty() {
            return Err(ApiError::invalid("the prompt is empty", Some(param)));
        }
        if prompt.len() >= self.ctx {
            return Err(ApiError::invalid(
                format!(
                    "the prompt has {} tokens but a slot holds {} (--ctx): no room to generate",
                    prompt.len(),
                    self.ctx
                ),
                Some(param),
            ));
        }
        let stop = match r.stop {
            None => vec![],
            Some(Stop::One(s)) => vec![s],
            Some(Stop::Many(v)) => v,
        };
        if stop.len() > MAX_STOPS {
            return Err(ApiError::invalid(
                format!("{} stop strings: at most {MAX_STOPS}", stop.len()),
                Some("stop"),
            ));
        }
        Ok(Checked {
            prompt,
            params: SamplingParams {
                max_tokens: max_tokens.map(|m| m as usize),
                temperature,
                top_p: r.top_p.filter(|&p| p < 1.0),
                seed: r.seed.map_or_else(fresh_seed, |s| s as u64),
                stop,
            },
            stream: r.stream.unwrap_or(false),
            include_usage: r.stream_options.unwrap_or_default().include_usage,
        })
    }

    fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, ApiError> {
        let encoding = self
            .tokenizer
            .encode(text, add_special_tokens)
            .map_err(|e| ApiError::invalid(format!("cannot tokenize: {e}"), None))?;
        Ok(encoding.get_ids().to_vec())
    }

    /// `messages` rendered with the chat template and tokenized (the template brings its own
    /// special tokens).
    fn chat_prompt(
        &self,
        messages: Option<Vec<ChatMessage>>,
        variables: Variables,
    ) -> Result<Vec<u32>, ApiError> {
        let Some(template) = &self.template else {
            return Err(ApiError::invalid(
                format!(
                    "{} has no chat template: use /v1/completions",
                    self.model_id
                ),
                None,
            ));
        };
        let messages = messages
            .ok_or_else(|| ApiError::invalid("`messages` is required", Some("messages")))?;
        if messages.is_empty() {
            return Err(ApiError::invalid("`messages` is empty", Some("messages")));
        }
        let messages = messages
            .into_iter()
            .enumerate()
            .map(|(i, m)| {
                let content = match m.content {
                    None => String::new(),
                    Some(Content::Text(t)) => t,
                    Some(Content::Parts(parts)) => parts
                        .into_iter()
                        .map(|p| match (p.kind.as_str(), p.text) {
                            ("text", Some(t)) => Ok(t),
                            (kind, _) => Err(ApiError::invalid(
                                format!(
                                    "content part of type `{kind}`: only text parts are supported"
                                ),
                                Some(format!("messages[{i}].content").as_str()),
                            )),
                        })
                        .collect::<Result<String, _>>()?,
                };
                Ok(Message {
                    role: m.role,
                    content,
                })
            })
            .collect::<Result<Vec<_>, ApiError>>()?;
        let text = template
            .render(&messages, true, &variables)
            .map_err(|e| ApiError::invalid(e.to_string(), Some("messages")))?;
        self.encode(&text, false)
    }

    /// The completions `prompt`, tokenized with the tokenizer's special tokens, or its ids.
    fn text_prompt(&self, prompt: Option<Prompt>) -> Result<Vec<u32>, ApiError> {
        match prompt {
            None => Err(ApiError::invalid("`prompt` is required", Some("prompt"))),
            Some(Prompt::Text(text)) => self.encode(&text, true),
            Some(Prompt::Texts(texts)) => self.encode(&one_prompt(texts)?, true),
            Some(Prompt::Tokens(ids)) => self.token_prompt(ids),
            Some(Prompt::TokenLists(lists)) => self.token_prompt(one_prompt(lists)?),
        }
    }

    /// Token ids given as the prompt, checked against the vocabulary.
    fn token_prompt(&self, ids: Vec<u32>) -> Result<Vec<u32>, ApiError> {
        match ids.iter().find(|&&t| t as usize >= self.vocab_size) {
            Some(t) => Err(ApiError::invalid(
                format!(
                    "token id {t} is outside the vocabulary ({})",
                    self.vocab_size
                ),
                Some("prompt"),
            )),
            None => Ok(ids),
        }
    }
}

/// The prompt of a batch of one (this server answers one prompt per request).
fn one_prompt<T>(batch: Vec<T>) -> Result<T, ApiError> {
    let n = batch.len();
    <[T; 1]>::try_from(batch).map(|[p]| p).map_err(|_| {
        ApiError::invalid(
            format!("{n} prompts: this server takes one per request"),
            Some("prompt"),
        )
    })
}

/// `usage` of a finished answer.
pub fn usage(f: &Finish) -> Value {
    json!({
        "prompt_tokens": f.prompt_tokens,
        "completion_tokens": f.completion_tokens,
        "total_tokens": f.prompt_tokens + f.completion_tokens,
    })
}

/// What differs between the two endpoints' responses.
#[derive(Clone, Copy, Debug)]
pub enum Kind {
    /// `/v1/chat/completions`.
    Chat,
    /// `/v1/completions`.
    Text,
}

/// One response's identity: endpoint, id, creation time and model.
pub struct Reply {
    /// Which endpoint.
    pub kind: Kind,
    /// `chatcmpl-N` or `cmpl-N`.
    pub id: String,
    /// Seconds since the epoch.
    pub created: u64,
    /// The model's name.
    pub model: String,
}

impl Reply {
    /// The complete (non-streamed) response.
    pub fn complete(&self, text: &str, finish: &Finish) -> Value {
        let choice = match self.kind {
            Kind::Chat => json!({
                "index": 0, "logprobs": null, "finish_reason": finish.reason,
                "message": {"role": "assistant", "content": text},
            }),
            Kind::Text => json!({
                "index": 0, "logprobs": null, "finish_reason": finish.reason, "text": text,
            }),
        };
        let object = match self.kind {
            Kind::Chat => "chat.completion",
            Kind::Text => "text_completion",
        };
        json!({
            "id": self.id, "object": object, "created": self.created, "model": self.model,
            "choices": [choice], "usage": usage(finish),
        })
    }

    /// Chat's first stream chunk, before any text: the assistant role.
    pub fn role_chunk(&self) -> Value {
        let delta = json!({"role": "assistant", "content": ""});
        let choice = json!({"index": 0, "delta": delta, "logprobs": null, "finish_reason": null});
        self.chunk_with(vec![choice], Value::Null)
    }

    /// A stream chunk: `text`, or the final chunk with its finish reason.
    pub fn chunk(&self, text: &str, finish: Option<&Finish>) -> Value {
        let reason = finish.map(|f| f.reason);
        let choice = match self.kind {
            Kind::Chat => {
                let delta = match finish {
                    Some(_) => json!({}),
                    None => json!({"content": text}),
                };
                json!({"index": 0, "delta": delta, "logprobs": null, "finish_reason": reason})
            }
            Kind::Text => {
                json!({"index": 0, "text": text, "logprobs": null, "finish_reason": reason})
            }
        };
        self.chunk_with(vec![choice], Value::Null)
    }

    /// The usage chunk (`stream_options.include_usage`): no choices.
    pub fn usage_chunk(&self, finish: &Finish) -> Value {
        self.chunk_with(vec![], usage(finish))
    }

    fn chunk_with(&self, choices: Vec<Value>, usage: Value) -> Value {
        let object = match self.kind {
            Kind::Chat => "chat.completion.chunk",
            Kind::Text => "text_completion",
        };
        json!({
            "id": self.id, "object": object, "created": self.created, "model": self.model,
            "choices": choices, "usage": usage,
        })
    }
}
