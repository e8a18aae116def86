//! The worker with a drafter the engine cannot be given from outside: an oracle that drafts the
//! plain continuation, so verify steps keep runs of several tokens and stop strings end inside
//! them. The output (tokens, text, finish reason) must be the plain engine's: the tokens a run
//! produced past the stop string are neither streamed nor kept.

#![allow(clippy::unwrap_used)]

use std::path::PathBuf;
use std::sync::Arc;

use metrale_gpu_runtime::CpuBackend;
use metrale_model_engine::Scheduler;
use metrale_model_engine::factory;
use metrale_model_engine::options::{ModelOptions, Speculative};
use metrale_model_engine::speculative::{GateOptions, OracleDrafter};

use crate::engine::Engine;
use crate::frontend::load_tokenizer;
use crate::options::EngineOptions;
use crate::request::{GenerateEvent, GenerateRequest, Prompt};

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

/// The Qwen3.5 fixture with the dense fixture's tokenizer (its vocabulary covers the 256 ids);
/// `drafts`: the oracle's continuations, or plain decoding.
fn engine(drafts: Option<Vec<Vec<u32>>>) -> Engine {
    let speculative = if drafts.is_some() {
        Speculative::External
    } else {
        Speculative::Off
    };
    let options = EngineOptions::default().model(
        ModelOptions::default()
            .speculative(speculative)
            .num_draft_tokens(3),
    );
    let model = factory::load(&fixture("qwen3_5-tiny"), Arc::new(CpuBackend::default())).unwrap();
    let mut scheduler = Scheduler::new(model, options.model.clone()).unwrap();
    if let Some(expected) = drafts {
        let drafter = Box::new(OracleDrafter::new(expected));
        scheduler.set_drafter(Some(drafter)).unwrap();
        (scheduler.speculation().unwrap()).set_gate(GateOptions::default().enabled(false));
    }
    let tokenizer = load_tokenizer(&fixture("qwen3-tiny")).unwrap();
    Engine::start(scheduler, tokenizer, &options).unwrap()
}

#[test]
fn a_stop_string_inside_an_accepted_run_ends_the_output_where_plain_decoding_does() {
    let prompt: Vec<u32> = (0..9).map(|t| (t * 29 + 4) % 250 + 1).collect();
    let req = GenerateRequest::new(Prompt::TokenIds(prompt.clone()))
        .max_new_tokens(40)
        .ignore_eos(true);
    let plain = engine(None);
    let full = plain.generate(&req).unwrap();
    let text = full.text.clone().unwrap();
    let chars: Vec<char> = text.chars().collect();
    assert!(chars.len() >= 12, "too short to cut: {text:?}");
    // The oracle drafts for requests by submission order: the three below.
    let continuation: Vec<u32> = prompt.iter().chain(&full.token_ids).copied().collect();
    let expected = vec![continuation; 3];
    let spec = engine(Some(expected));
    let mut cuts = 0;
    for at in [chars.len() / 3, chars.len() / 2, 2 * chars.len() / 3] {
        let stop: String = chars[at..at + 2].iter().collect();
        let req = req.clone().stop_strings(vec![stop.clone()]);
        let want = plain.generate(&req).unwrap();
        let mut streamed = Vec::new();
        let mut out = None;
        for ev in spec.submit(req).unwrap() {
            match ev.unwrap() {
                GenerateEvent::Token(t) => streamed.push(t.token_id),
                GenerateEvent::Finished { output } => out = Some(output),
                GenerateEvent::ChoiceFinished { finish_reason, .. } => {
                    assert_eq!(finish_reason, want.finish_reason, "stop {stop:?}");
                }
            }
        }
        let got = out.unwrap();
        assert_eq!(got.token_ids, want.token_ids, "stop {stop:?}");
        assert_eq!(streamed, want.token_ids, "stop {stop:?}: streamed");
        assert_eq!(got.text, want.text, "stop {stop:?}");
        assert_eq!(got.finish_reason, want.finish_reason, "stop {stop:?}");
        cuts += usize::from(want.token_ids.len() % 4 != 1);
    }
    // Every verify keeps all 3 drafts (4 tokens), so a cut not right after a run's last token
    // falls inside a run.
    assert!(cuts > 0);
    let m = spec.metrics().speculation.unwrap();
    assert!(m.accepted > 0 && m.accepted == m.drafted, "{m:?}");
}
