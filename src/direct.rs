//! `generate_direct`: one request on the calling thread, through
//! `metrale_model_engine::generate` instead of the engine's scheduler (speculative decoding
//! included, without the gate: it always speculates); `metrale generate --speculative mtp`
//! takes this path.
//!
//! The request is checked as `Engine::submit` checks it, stops at the model's EOS tokens unless
//! `ignore_eos`, and at its stop strings (the text ends before the first one).

use std::ops::ControlFlow;
use std::path::Path;

use metrale_model_engine::factory;
use metrale_model_engine::generate::{FinishReason, GenerateParams, generate};
use metrale_model_engine::model_circuit::ModelCircuit;
use metrale_model_engine::scheduler::{RequestLimits, SeqRequest};

use crate::engine::{load_tokenizer, make_backend};
use crate::error::{EngineError, RequestError};
use crate::options::EngineOptions;
use crate::request::{GenerateOutput, GenerateRequest, Prompt};
use crate::text::TextStream;

/// Load the checkpoint in `dir` and generate for `req` on this thread, calling
/// `on_token(token_id, text_so_far)` as each token is chosen (`ControlFlow::Break` stops after
/// it, finish reason `cancelled`). See the module header.
pub fn generate_direct(
    dir: impl AsRef<Path>,
    options: EngineOptions,
    req: &GenerateRequest,
    mut on_token: impl FnMut(u32, Option<&str>) -> ControlFlow<()>,
) -> Result<GenerateOutput, EngineError> {
    let dir = dir.as_ref();
    let gpu = make_backend(options.backend)?;
    let mut model = factory::load(dir, options.model, gpu)?;
    model.set_forward(options.forward)?;
    let tokenizer = load_tokenizer(dir)?;
    let prompt = match &req.prompt {
        Prompt::TokenIds(ids) => ids.clone(),
        Prompt::Text(t) => {
            let tok = tokenizer.as_ref().ok_or(RequestError::NoTokenizer)?;
            let enc = tok
                .encode(t.as_str(), false)
                .map_err(|e| RequestError::Tokenize(e.to_string()))?;
            enc.get_ids().to_vec()
        }
    };
    if !req.stop_strings.is_empty() && tokenizer.is_none() {
        return Err(RequestError::NoTokenizer.into());
    }
    if let Some(index) = req.stop_strings.iter().position(String::is_empty) {
        return Err(RequestError::EmptyStopString { index }.into());
    }
    let mut stop_token_ids = req.stop_token_ids.clone();
    if !req.ignore_eos {
        stop_token_ids.extend(&model.config().eos_token_ids);
    }
    let seq = SeqRequest {
        prompt,
        params: GenerateParams {
            max_new_tokens: req.max_new_tokens,
            sampling: req.sampling,
            stop_token_ids,
            return_logits: req.return_logits,
        },
        ignore_eos: req.ignore_eos,
    };
    RequestLimits::of(&mut model)
        .check(&seq)
        .map_err(RequestError::from)?;

    let mut text = tokenizer
        .as_ref()
        .map(|_| (TextStream::new(req.stop_strings.clone()), String::new()));
    let (mut by_string, mut by_caller) = (false, false);
    let g = generate(&mut model, &seq.prompt, &seq.params, &mut |token| {
        let so_far = match (text.as_mut(), tokenizer.as_ref()) {
            (Some((stream, acc)), Some(tok)) => {
                let delta = stream.push(token, false, |ids| {
                    tok.decode(ids, true).unwrap_or_default()
                });
                acc.push_str(&delta);
                by_string = stream.stopped();
                Some(acc.as_str())
            }
            _ => None,
        };
        if on_token(token, so_far).is_break() {
            by_caller = true;
        }
        if by_string || by_caller {
            ControlFlow::Break(())
        } else {
            ControlFlow::Continue(())
        }
    })?;
    let full = tokenizer
        .as_ref()
        .and_then(|tok| tok.decode(&g.token_ids, true).ok());
    let finish_reason = if by_string && !by_caller {
        FinishReason::Stop
    } else {
        g.finish_reason
    };
    Ok(GenerateOutput {
        prompt_ids: seq.prompt,
        token_ids: g.token_ids,
        text: text.and_then(|(stream, _)| stream.final_text(full)),
        finish_reason,
        logits: g.logits,
    })
}
