//! Chat templates rendered with minijinja against what transformers' `apply_chat_template`
//! (jinja2) renders for the published templates of OLMoE-1B-7B-0924-Instruct,
//! Qwen1.5-MoE-A2.7B-Chat, Qwen3-30B-A3B and Mixtral-8x7B-Instruct-v0.1
//! (`tests/fixtures/chat_templates`: the templates in tokenizer_config.json shape, and
//! `expected.json` written by `expected.py` there); built-in templates, flags and bad input.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use candle::{DType, Device};
use candle_qmoe_suite::chat::{ChatArgs, ChatError, ChatTemplate, Message, Variables};
use candle_qmoe_suite::model::ModelArgs;
use candle_qmoe_suite::testing::fixture_dir;
use clap::Parser;
use serde::Deserialize;

/// One case of `expected.json`: the conversation and what transformers rendered (or raised).
#[derive(Deserialize)]
struct Case {
    fixture: String,
    case: String,
    messages: Vec<Message>,
    add_generation_prompt: bool,
    variables: Variables,
    expected: Option<String>,
    error: Option<String>,
}

#[derive(Deserialize)]
struct Expected {
    cases: Vec<Case>,
}

fn templates_dir() -> PathBuf {
    fixture_dir("chat_templates")
}

fn expected_cases() -> Vec<Case> {
    let path = templates_dir().join("expected.json");
    let expected: Expected = serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap();
    expected.cases
}

fn fixture(name: &str) -> ChatTemplate {
    ChatTemplate::from_tokenizer_config(&templates_dir().join(name))
        .unwrap()
        .unwrap_or_else(|| panic!("{name} has a chat_template"))
}

/// Checks `template` on every case of `fixture` in expected.json; returns how many it checked.
fn check_cases(template: &ChatTemplate, fixture: &str) -> usize {
    let cases: Vec<Case> = expected_cases()
        .into_iter()
        .filter(|c| c.fixture == fixture)
        .collect();
    for c in &cases {
        let what = format!("{} / {}", c.fixture, c.case);
        let got = template.render(&c.messages, c.add_generation_prompt, &c.variables);
        match (&c.expected, &c.error) {
            (Some(expected), None) => assert_eq!(&got.expect(&what), expected, "{what}"),
            (None, Some(error)) => match got {
                Err(ChatError::Refused { origin, message }) => {
                    assert_eq!(&message, error, "{what}");
                    assert_eq!(origin, template.origin(), "{what}");
                }
                other => panic!("{what}: expected the template's refusal, got {other:?}"),
            },
            _ => panic!("{what}: a case has either `expected` or `error`"),
        }
    }
    cases.len()
}

#[test]
fn published_templates_render_as_transformers_does() {
    let fixtures = [
        "olmoe-1b-7b-0924-instruct.json",
        "qwen1.5-moe-a2.7b-chat.json",
        "qwen3-30b-a3b.json",
        "mixtral-8x7b-instruct-v0.1.json",
    ];
    let mut checked = 0;
    for name in fixtures {
        checked += check_cases(&fixture(name), name);
    }
    assert_eq!(
        checked,
        expected_cases().len(),
        "a case names an unknown fixture"
    );
    assert!(checked >= 25, "expected.json lost cases: {checked}");
}

#[test]
fn refusal_names_the_template_file() {
    let template = fixture("mixtral-8x7b-instruct-v0.1.json");
    let err = template
        .render(
            &[Message::user("Hello"), Message::user("Hello again")],
            true,
            &Variables::new(),
        )
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("mixtral-8x7b-instruct-v0.1.json")
            && err.contains("conversation roles must alternate"),
        "{err}"
    );
}

#[test]
fn builtin_templates_are_the_published_ones() {
    for (family, name) in [
        ("olmoe", "olmoe-1b-7b-0924-instruct.json"),
        ("qwen2_moe", "qwen1.5-moe-a2.7b-chat.json"),
    ] {
        let builtin = ChatTemplate::builtin(family).unwrap();
        assert_eq!(builtin.source(), fixture(name).source(), "{family}");
        assert!(check_cases(&builtin, name) >= 5, "{family}");
        assert_eq!(builtin.origin(), format!("built-in {family}"));
    }
    assert!(ChatTemplate::builtin("mixtral").is_none());
}

#[test]
fn stop_tokens_are_eos_and_end_of_turn() {
    let stops = |name: &str| -> Vec<String> {
        let t = fixture(name);
        t.stop_tokens().into_iter().map(String::from).collect()
    };
    assert_eq!(stops("olmoe-1b-7b-0924-instruct.json"), ["<|endoftext|>"]);
    assert_eq!(stops("qwen3-30b-a3b.json"), ["<|im_end|>"]);
    assert_eq!(stops("mixtral-8x7b-instruct-v0.1.json"), ["</s>"]);
    let builtin = ChatTemplate::builtin("qwen2_moe").unwrap();
    assert_eq!(builtin.stop_tokens(), ["<|im_end|>"]);
}

#[test]
fn added_token_objects_are_read_by_their_content() {
    // Older tokenizer_config.json files write special tokens as AddedToken objects.
    let dir = scratch("added");
    let added = |content: &str| {
        serde_json::json!({
            "__type": "AddedToken", "content": content, "lstrip": false,
            "normalized": false, "rstrip": false, "single_word": false,
        })
    };
    let config = serde_json::json!({
        "bos_token": added("<s>"),
        "eos_token": added("</s>"),
        "chat_template": "{{ bos_token }}{{ messages[0]['content'] }}{{ eos_token }}",
    });
    let template = ChatTemplate::from_tokenizer_config(&write_config(&dir, &config))
        .unwrap()
        .unwrap();
    assert_eq!(template.stop_tokens(), ["</s>"]);
    let text = template.render(&[Message::user("hi")], false, &Variables::new());
    assert_eq!(text.unwrap(), "<s>hi</s>");
    std::fs::remove_dir_all(dir).unwrap();
}

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    chat: ChatArgs,
    #[command(flatten)]
    model: ModelArgs,
}

#[test]
fn no_think_flag_turns_qwen3_thinking_off() {
    let qwen3 = fixture("qwen3-30b-a3b.json");
    let cases = expected_cases();
    let expected = |case: &str| {
        let c = cases
            .iter()
            .find(|c| c.fixture == "qwen3-30b-a3b.json" && c.case == case)
            .unwrap();
        (c.messages.clone(), c.expected.clone().unwrap())
    };
    for (flags, case) in [
        (&[][..], "single"),
        (&["--no-think"][..], "single-thinking-off"),
    ] {
        let cli = Cli::parse_from(std::iter::once("test").chain(flags.iter().copied()));
        let (messages, text) = expected(case);
        assert_eq!(
            qwen3
                .render(&messages, true, &cli.chat.variables())
                .unwrap(),
            text
        );
    }
    let err = Cli::try_parse_from(["test", "--no-chat", "--no-think"]).err();
    assert_eq!(
        err.map(|e| e.kind()),
        Some(clap::error::ErrorKind::ArgumentConflict)
    );
}

/// A scratch folder for this test process.
fn scratch(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("qmoe-chat-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn write_config(dir: &Path, config: &serde_json::Value) -> PathBuf {
    let path = dir.join("tokenizer_config.json");
    std::fs::write(&path, serde_json::to_vec_pretty(config).unwrap()).unwrap();
    path
}

#[test]
fn a_list_of_templates_takes_the_default() {
    let dir = scratch("list");
    let qwen = fixture("qwen1.5-moe-a2.7b-chat.json");
    let list = serde_json::json!({
        "eos_token": "<|im_end|>",
        "chat_template": [
            {"name": "tool_use", "template": "{% if tools %}not parsed{% endfor %}"},
            {"name": "default", "template": qwen.source()},
        ],
    });
    let template = ChatTemplate::from_tokenizer_config(&write_config(&dir, &list))
        .unwrap()
        .unwrap();
    assert_eq!(check_cases(&template, "qwen1.5-moe-a2.7b-chat.json"), 6);

    let no_default = serde_json::json!({
        "chat_template": [{"name": "tool_use", "template": "{{ messages }}"}],
    });
    let err = ChatTemplate::from_tokenizer_config(&write_config(&dir, &no_default)).unwrap_err();
    assert!(
        matches!(&err, ChatError::Config { path, reason }
            if path.ends_with("tokenizer_config.json") && reason.contains("tool_use")),
        "{err}"
    );
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn a_checkpoint_without_a_template_has_none() {
    let dir = scratch("none");
    assert!(ChatTemplate::from_checkpoint(&dir).unwrap().is_none());
    write_config(&dir, &serde_json::json!({"eos_token": "<|endoftext|>"}));
    assert!(ChatTemplate::from_checkpoint(&dir).unwrap().is_none());
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn bad_templates_are_errors_naming_the_file() {
    let dir = scratch("bad");
    let load = |config: serde_json::Value| {
        ChatTemplate::from_tokenizer_config(&write_config(&dir, &config)).map(|t| t.unwrap())
    };
    let names_file = |e: &ChatError| e.to_string().contains("tokenizer_config.json");

    // Does not parse: an unclosed block.
    let err = load(serde_json::json!({
        "chat_template": "{% for message in messages %}\n{{ message['content'] }}",
    }))
    .unwrap_err();
    assert!(
        matches!(err, ChatError::Parse { line: 2, .. }) && names_file(&err),
        "{err}"
    );

    // Parses, fails to render: a method strings do not have.
    let template = load(serde_json::json!({
        "chat_template": "{{ messages[0]['content'].no_such_method() }}",
    }))
    .unwrap();
    let err = template
        .render(&[Message::user("hi")], true, &Variables::new())
        .unwrap_err();
    assert!(
        matches!(err, ChatError::Render { line: 1, .. }) && names_file(&err),
        "{err}"
    );

    // Renders, but not the messages: no prompt is left to answer.
    let template = load(serde_json::json!({"chat_template": "{# no messages #}  \n"})).unwrap();
    let err = template
        .render(&[Message::user("hi")], true, &Variables::new())
        .unwrap_err();
    assert!(
        matches!(err, ChatError::Empty { .. }) && names_file(&err),
        "{err}"
    );

    // Not JSON; a chat_template of the wrong type.
    std::fs::write(dir.join("tokenizer_config.json"), "{\"chat_template\": ").unwrap();
    let err = ChatTemplate::from_checkpoint(&dir).unwrap_err();
    assert!(
        matches!(&err, ChatError::Config { reason, .. } if reason.contains("JSON")),
        "{err}"
    );
    let err = load(serde_json::json!({"chat_template": 42})).unwrap_err();
    assert!(
        matches!(&err, ChatError::Config { reason, .. }
            if reason.contains("must be a string or a list of {name, template}, not 42"))
            && names_file(&err),
        "{err}"
    );
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn variables_override_special_tokens_and_nothing_is_escaped() {
    // The template's name is a `.json` path: minijinja must not JSON-escape by its extension.
    let tokens = BTreeMap::from([("bos_token".to_string(), "<s>".to_string())]);
    let t = ChatTemplate::new(
        "/x/tokenizer_config.json",
        "{{ bos_token }}|{{ messages[0].content }}|{% if tools is none %}no tools{% endif %}",
        tokens,
    )
    .unwrap();
    let msg = [Message::user("<b>\"&'</b>")];
    assert_eq!(
        t.render(&msg, false, &Variables::new()).unwrap(),
        "<s>|<b>\"&'</b>|no tools"
    );
    let mut vars = Variables::new();
    vars.insert("bos_token".into(), "[BOS]".into());
    assert!(t.render(&msg, false, &vars).unwrap().starts_with("[BOS]|"));
}

#[test]
fn synthetic_models_prompt_as_before() {
    let cli = Cli::parse_from(["test", "--synthetic", "tiny", "--cpu"]);
    let mut loaded = cli.model.load(DType::F32, &Device::Cpu).unwrap();
    let chat = loaded.chat(&cli.chat).unwrap().unwrap();
    assert_eq!(chat.template.origin(), "built-in olmoe");
    // The prompt the hand-written Tulu template of earlier versions produced.
    let before = "<|endoftext|><|user|>\nHello\n<|assistant|>\n";
    assert_eq!(chat.prompt("Hello").unwrap(), before);
    let ids = loaded.encode("Hello", Some(&chat)).unwrap();
    let plain = loaded.tokenizer.encode(before, false).unwrap();
    assert_eq!(ids, plain.get_ids());
    let endoftext = loaded.tokenizer.token_to_id("<|endoftext|>").unwrap();
    assert!(loaded.stop_ids(Some(chat.template)).contains(&endoftext));

    let raw = Cli::parse_from(["test", "--synthetic", "tiny", "--no-chat"]);
    assert!(loaded.chat(&raw.chat).unwrap().is_none());
    loaded.chat_template = None;
    let forced = Cli::parse_from(["test", "--synthetic", "tiny", "--chat"]);
    let err = loaded.chat(&forced.chat).unwrap_err().to_string();
    assert!(err.contains("no chat template"), "{err}");
}
