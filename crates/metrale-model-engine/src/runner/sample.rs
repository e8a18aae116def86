//! The device sampler in the runner: each logit row's parameters, entries and allowed-token mask
//! uploaded to the sampler's fixed addresses (`build::SamplerBuffers`), `sampling::sample`
//! launched over the rows (inside the decode graph for decode steps, after the step otherwise;
//! a decode step with token masks launches it after its forward, once the host has uploaded
//! them: `StepRunner::decode_forward`), and only the tokens and logprobs downloaded
//! (`SAMPLE_OUT_WORDS` words a row).
//!
//! Invariants:
//! - Rows past the ones given (a decode step's padding) are greedy rows without entries, so the
//!   launch reads only what this step uploaded.
//! - The launch's parameters are the same at every step (fixed addresses, the entry capacity,
//!   the mask always given), so a captured graph replays it with this step's uploads. Only rows
//!   flagged `SAMPLE_F_MASK` read their row of the mask buffer; an unmasked row never touches it.

use metrale_gpu_runtime::GpuBackendExt;
use metrale_kernel_abi::{
    SAMPLE_ENTRY_WORDS, SAMPLE_F_MASK, SAMPLE_OUT_WORDS, SAMPLE_R_ENTRY_COUNT,
    SAMPLE_R_ENTRY_START, SAMPLE_R_FLAGS, SAMPLE_TOP_MAX,
};
use metrale_model_layers::ops::{Matrix, SampleOperands};

use super::StepRunner;
use super::forward::Forward;
use crate::error::ModelError;
use crate::sampling::{SampleRow, SampledToken};

impl StepRunner {
    /// The tokens of the last step's first `rows.len()` logit rows, picked on the device by
    /// `rows` (each row's sampling; see [`SampleRow`]), with their logprobs.
    pub fn sample(&self, rows: &[SampleRow]) -> Result<Vec<SampledToken>, ModelError> {
        self.upload_sampling(rows, rows.len())?;
        launch_sample(&self.forward, &self.sampler, rows.len() as u32)?;
        self.sampled(rows)
    }

    /// Upload `rows` and greedy rows after them up to `pad_to`.
    pub(super) fn upload_sampling(
        &self,
        rows: &[SampleRow],
        pad_to: usize,
    ) -> Result<(), ModelError> {
        let model = &self.forward.model;
        let (gpu, stream) = (model.gpu(), model.stream());
        let words = (model.dims().vocab as usize).div_ceil(32);
        let b = &self.sampler;
        if pad_to > self.sizes.max_logit_rows || rows.len() > pad_to {
            return Err(ModelError::Step(format!(
                "{} sampled rows, the runner holds {}",
                pad_to, self.sizes.max_logit_rows
            )));
        }
        let greedy = SampleRow::greedy();
        let (mut rowp, mut entries) = (Vec::with_capacity(pad_to * 16), Vec::<u32>::new());
        for r in 0..pad_to {
            let row = rows.get(r).unwrap_or(&greedy);
            let mut w = row.words;
            w[SAMPLE_R_ENTRY_START as usize] = (entries.len() / 3) as u32;
            w[SAMPLE_R_ENTRY_COUNT as usize] = row.entries.len() as u32;
            w[SAMPLE_R_FLAGS as usize] &= !SAMPLE_F_MASK;
            if let Some(mask) = &row.mask {
                if mask.len() != words {
                    return Err(ModelError::Step(format!(
                        "row {r}'s token mask has {} words, the vocabulary needs {words}",
                        mask.len()
                    )));
                }
                w[SAMPLE_R_FLAGS as usize] |= SAMPLE_F_MASK;
                gpu.upload(b.mask.offset(r * words * 4), mask, stream)?;
            }
            rowp.extend_from_slice(&w);
            entries.extend(row.entries.iter().flatten());
        }
        let n = entries.len() / SAMPLE_ENTRY_WORDS as usize;
        if n > b.entry_capacity {
            return Err(ModelError::Step(format!(
                "the sampled rows have {n} penalised or biased tokens, the sampler holds {}",
                b.entry_capacity
            )));
        }
        gpu.upload(b.rowp, &rowp, stream)?;
        if !entries.is_empty() {
            gpu.upload(b.entries, &entries, stream)?;
        }
        Ok(())
    }

    /// Download what the sampler picked for `rows` (the first `rows.len()` rows).
    pub(super) fn sampled(&self, rows: &[SampleRow]) -> Result<Vec<SampledToken>, ModelError> {
        let model = &self.forward.model;
        let w = SAMPLE_OUT_WORDS as usize;
        let out: Vec<u32> =
            (model.gpu()).download(self.sampler.out, rows.len() * w, model.stream())?;
        Ok((out.chunks(w).zip(rows))
            .map(|(o, row)| {
                let n = row.words[metrale_kernel_abi::SAMPLE_R_NUM_TOP as usize] as usize;
                let top = SAMPLE_TOP_MAX as usize;
                SampledToken {
                    token: o[0],
                    logprob: f32::from_bits(o[1]),
                    top: (0..n.min(top))
                        .map(|j| (o[2 + j], f32::from_bits(o[2 + top + j])))
                        .collect(),
                }
            })
            .collect())
    }
}

/// Launch the sampler over the first `rows` logit rows (the same parameters every step).
pub(super) fn launch_sample(
    forward: &Forward,
    b: &super::build::SamplerBuffers,
    rows: u32,
) -> Result<(), ModelError> {
    let model = &forward.model;
    let vocab = model.dims().vocab;
    let op = SampleOperands {
        out: b.out,
        rowp: b.rowp,
        entries: b.entries,
        num_entries: b.entry_capacity as u32,
        mask: Some((b.mask, vocab.div_ceil(32))),
    };
    let logits = Matrix::f32(forward.buf.head.logits, rows, vocab);
    Ok(model.ops().sample(model.stream(), logits, &op)?)
}
