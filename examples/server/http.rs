//! The HTTP side (axum): routes, handlers that check and tokenize a request and hand it to the
//! engine's bounded queue (full: 503 with `Retry-After`), answers streamed as server-sent events
//! (with keep-alive comments) or collected, every error in OpenAI's shape (unknown routes, wrong
//! methods and bodies too large included), and graceful shutdown on SIGINT/SIGTERM.

use std::future::IntoFuture;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{MatchedPath, Path, Request as HttpRequest, State};
use axum::http::{Method, StatusCode, Uri};
use axum::middleware::{self, Next};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures_util::stream::{self, Stream, StreamExt};
use serde_json::json;
use tokio::signal::unix::{signal, Signal, SignalKind};
use tokio::sync::{mpsc, oneshot};

use crate::api::{parse_request, unix_time, ApiError, Frontend, Kind, Reply};
use crate::engine::{Event, Request};
use crate::metrics::Metrics;
use crate::queue::{Queue, Refused};

/// What every handler shares.
pub struct AppState {
    /// Tokenizer, chat template, slot context.
    pub frontend: Frontend,
    /// The engine's queue.
    pub queue: Arc<Queue>,
    /// The metrics.
    pub metrics: Arc<Metrics>,
    /// Interval of SSE keep-alive comments.
    pub keep_alive: Duration,
    /// Start time (`created` of the model).
    pub started: u64,
    /// Numbers response ids.
    pub next_id: AtomicU64,
}

type Shared = Arc<AppState>;

/// The routes.
pub fn router(state: Shared) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(models))
        .route("/v1/models/{*id}", get(model))
        .route("/health", get(|| async { Json(json!({"status": "ok"})) }))
        .route("/metrics", get(metrics))
        .fallback(|method: Method, uri: Uri| async move {
            let message = format!("Invalid URL ({method} {})", uri.path());
            ApiError::client(StatusCode::NOT_FOUND, message, None)
        })
        .method_not_allowed_fallback(|method: Method, uri: Uri| async move {
            let message = format!("{method} is not allowed on {}", uri.path());
            ApiError::client(StatusCode::METHOD_NOT_ALLOWED, message, None)
        })
        .layer(middleware::from_fn_with_state(state.clone(), count))
        .with_state(state)
}

/// Counts every response by endpoint and status.
async fn count(State(s): State<Shared>, request: HttpRequest, next: Next) -> Response {
    let endpoint = request
        .extensions()
        .get::<MatchedPath>()
        .map_or("other".to_string(), |p| p.as_str().to_string());
    let response = next.run(request).await;
    s.metrics.request(&endpoint, response.status().as_u16());
    response
}

/// The model object of `/v1/models`.
fn model_card(s: &AppState) -> serde_json::Value {
    json!({
        "id": s.frontend.model_id, "object": "model", "created": s.started,
        "owned_by": "candle-qmoe",
    })
}

async fn models(State(s): State<Shared>) -> Json<serde_json::Value> {
    Json(json!({"object": "list", "data": [model_card(&s)]}))
}

async fn model(State(s): State<Shared>, Path(id): Path<String>) -> Response {
    if id == s.frontend.model_id {
        return Json(model_card(&s)).into_response();
    }
    let message = format!("The model `{id}` does not exist");
    ApiError::client(StatusCode::NOT_FOUND, message, Some("model_not_found")).into_response()
}

async fn metrics(State(s): State<Shared>) -> impl IntoResponse {
    s.metrics.queue_length.set(s.queue.waiting() as i64);
    (
        [("content-type", crate::metrics::CONTENT_TYPE)],
        s.metrics.encode(),
    )
}

async fn chat(State(s): State<Shared>, body: Result<Bytes, BytesRejection>) -> Response {
    answer(s, body, Kind::Chat).await
}

async fn completions(State(s): State<Shared>, body: Result<Bytes, BytesRejection>) -> Response {
    answer(s, body, Kind::Text).await
}

/// Checks, queues and answers one request (a body that could not be read, e.g. too large, is
/// refused with its status). Parsing and tokenizing run on tokio's blocking pool, so that long
/// prompts do not stall the other connections.
async fn answer(s: Shared, body: Result<Bytes, BytesRejection>, kind: Kind) -> Response {
    let body = match body {
        Ok(body) => body,
        Err(e) => return ApiError::client(e.status(), e.body_text(), None).into_response(),
    };
    let frontend = s.clone();
    let checked = tokio::task::spawn_blocking(move || {
        let chat = matches!(kind, Kind::Chat);
        parse_request(&body).and_then(|r| frontend.frontend.check(r, chat))
    })
    .await;
    let checked = match checked {
        Ok(Ok(c)) => c,
        Ok(Err(e)) => return e.into_response(),
        Err(e) => return failed(format!("checking the request failed: {e}")).into_response(),
    };
    let (events, rx) = mpsc::unbounded_channel();
    let request = Request {
        prompt: checked.prompt,
        params: checked.params,
        events,
    };
    if let Err(refused) = s.queue.push(request) {
        let message = match refused {
            Refused::Full => "the request queue is full: retry later",
            Refused::Closed => "the server is shutting down",
        };
        return ApiError::server(StatusCode::SERVICE_UNAVAILABLE, message, "overloaded")
            .into_response();
    }
    let n = s.next_id.fetch_add(1, Ordering::Relaxed);
    let reply = Reply {
        kind,
        id: match kind {
            Kind::Chat => format!("chatcmpl-{n}"),
            Kind::Text => format!("cmpl-{n}"),
        },
        created: unix_time(),
        model: s.frontend.model_id.clone(),
    };
    if checked.stream {
        let keep_alive = KeepAlive::new().interval(s.keep_alive);
        Sse::new(sse(rx, reply, checked.include_usage))
            .keep_alive(keep_alive)
            .into_response()
    } else {
        collect(rx, reply).await
    }
}

/// An engine failure as the API reports it.
fn failed(message: String) -> ApiError {
    ApiError::server(StatusCode::INTERNAL_SERVER_ERROR, message, "engine_error")
}

/// Waits for the whole answer. Dropping this future (client gone) closes the channel, which
/// frees the slot at the engine's next step.
async fn collect(mut rx: mpsc::UnboundedReceiver<Event>, reply: Reply) -> Response {
    let mut text = String::new();
    while let Some(event) = rx.recv().await {
        match event {
            Event::Text(t) => text.push_str(&t),
            Event::Done(finish) => return Json(reply.complete(&text, &finish)).into_response(),
            Event::Failed(message) => return failed(message).into_response(),
        }
    }
    failed("the engine stopped".into()).into_response()
}

/// The answer as server-sent events ending with `data: [DONE]`; dropping the stream (client
/// gone) closes the channel.
fn sse(
    rx: mpsc::UnboundedReceiver<Event>,
    reply: Reply,
    include_usage: bool,
) -> impl Stream<Item = Result<SseEvent, std::convert::Infallible>> {
    let data = |v: serde_json::Value| SseEvent::default().data(v.to_string());
    let done = || SseEvent::default().data("[DONE]");
    let events = stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|e| (e, rx)) });
    // Chat streams open with the assistant role, even when no text follows.
    let role = matches!(reply.kind, Kind::Chat).then(|| Ok(data(reply.role_chunk())));
    let chunks = events.flat_map(move |event| {
        let out = match event {
            Event::Text(t) => vec![data(reply.chunk(&t, None))],
            Event::Done(finish) => {
                let mut out = vec![data(reply.chunk("", Some(&finish)))];
                if include_usage {
                    out.push(data(reply.usage_chunk(&finish)));
                }
                out.push(done());
                out
            }
            Event::Failed(message) => vec![data(failed(message).body()), done()],
        };
        stream::iter(out.into_iter().map(Ok))
    });
    stream::iter(role).chain(chunks)
}

/// SIGINT and SIGTERM, listened to from start-up on: a signal that arrives between two waits
/// is kept for the next one.
struct Signals {
    interrupt: Signal,
    terminate: Signal,
}

impl Signals {
    fn new() -> Result<Self> {
        Ok(Self {
            interrupt: signal(SignalKind::interrupt()).context("cannot listen for SIGINT")?,
            terminate: signal(SignalKind::terminate()).context("cannot listen for SIGTERM")?,
        })
    }

    /// Resolves at the next SIGINT or SIGTERM.
    async fn next(&mut self) {
        tokio::select! {
            _ = self.interrupt.recv() => {}
            _ = self.terminate.recv() => {}
        }
    }
}

/// Serves `state` on `host:port` (0: a free port) until SIGINT/SIGTERM; then stops accepting,
/// lets requests in flight finish for `grace` (cut short by a second signal) and closes the
/// engine's queue, which fails the requests left and stops the engine. Connections still open
/// then (a client that never finished its request) get 2 s more; the runtime's end drops them.
pub async fn serve(state: Shared, host: &str, port: u16, grace: Duration) -> Result<()> {
    let listener = tokio::net::TcpListener::bind((host, port))
        .await
        .with_context(|| format!("cannot listen on {host}:{port}"))?;
    let addr = listener.local_addr()?;
    println!("listening on http://{addr}");
    std::io::Write::flush(&mut std::io::stdout())?;
    let mut signals = Signals::new()?;
    let queue = state.queue.clone();
    let (stop, stopped) = oneshot::channel::<()>();
    let server = axum::serve(listener, router(state))
        .with_graceful_shutdown(async {
            let _ = stopped.await;
        })
        .into_future();
    tokio::pin!(server);
    tokio::select! {
        r = &mut server => {
            // The server failed: stop the engine too.
            queue.close();
            return Ok(r?);
        }
        _ = signals.next() => {}
    }
    println!("shutting down: no new connections; requests in flight get {grace:?}");
    let _ = stop.send(());
    tokio::select! {
        r = &mut server => {
            // Every connection ended: nothing is left in flight.
            queue.close();
            return Ok(r?);
        }
        _ = tokio::time::sleep(grace) => {
            println!("grace period over: cancelling the requests still in flight");
        }
        _ = signals.next() => println!("second signal: cancelling the requests in flight"),
    }
    queue.close();
    let _ = tokio::time::timeout(Duration::from_secs(2), &mut server).await;
    Ok(())
}
