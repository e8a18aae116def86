//! A step's input (`StepRow`, `StepInput`), checked against the runner's limits and the cache's
//! slots, then written to the fixed step buffers (token ids, positions, sequences, slots, block
//! tables, logit rows, per-sequence starts and SSM slots, verify row slots, and a prefill
//! chunk's attention row groups), giving the `StepShape` the launches read.

use metrale_cache::{BlockTable, CacheManager};
use metrale_gpu_runtime::{GpuBackend, GpuBackendExt, StreamHandle};
use metrale_model_layers::ops::{Ops, attention_step_plan};
use metrale_model_layers::{ModelDims, StepBuffers, StepShape};

use super::sizes::StepSizes;
use crate::error::ModelError;

/// One row of a step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepRow {
    /// Input token.
    pub token: u32,
    /// Its position in its sequence.
    pub position: u32,
    /// Its sequence: an index into the step's block tables. Rows of one sequence are
    /// contiguous and in position order, and sequences appear in index order.
    pub seq: u32,
}

/// One step's input.
#[derive(Debug, Clone, Copy)]
pub struct StepInput<'a> {
    /// The rows, in order.
    pub rows: &'a [StepRow],
    /// The block table of each sequence in the step; they must cover every row's position.
    pub tables: &'a [&'a BlockTable],
    /// Indices of the rows whose logits are wanted.
    pub logit_rows: &'a [u32],
    /// The SSM state slot of each sequence (hybrid models; empty for models without GDN
    /// layers).
    pub ssm_slots: &'a [u32],
    /// Of each sequence (`tables` order), the positions below which its rows are prompt rows,
    /// attending in the prompt arithmetic where the runner has it
    /// (`ModelOptions::prompt_attention`); a sequence past the slice has none. Read by forward
    /// steps only.
    pub prompt_until: &'a [u32],
}

/// What checking and uploading a step reads: the runner's buffers, limits and dimensions.
#[derive(Debug, Clone, Copy)]
pub(super) struct Io<'a> {
    pub gpu: &'a dyn GpuBackend,
    pub stream: StreamHandle,
    pub buf: &'a StepBuffers,
    pub sizes: &'a StepSizes,
    pub dims: &'a ModelDims,
    /// The model's launchers (a forward step's row groups are planned against the prefill
    /// attention's resident blocks).
    pub ops: &'a Ops,
}

fn bad<T>(m: String) -> Result<T, ModelError> {
    Err(ModelError::Step(m))
}

impl Io<'_> {
    /// Check a step's rows and its SSM slots (each held, none shared) against `cache`.
    pub fn check(&self, cache: &CacheManager, input: &StepInput<'_>) -> Result<(), ModelError> {
        self.check_rows(input)?;
        if cache.ssm_slots().is_none() {
            return Ok(());
        }
        if input.ssm_slots.len() != input.tables.len() {
            return bad(format!(
                "{} SSM slots for {} sequences",
                input.ssm_slots.len(),
                input.tables.len()
            ));
        }
        if let Some(&s) = input.ssm_slots.iter().find(|&&s| !cache.ssm_slot_held(s)) {
            return bad(format!("SSM slot {s} is not held by a sequence"));
        }
        let mut sorted = input.ssm_slots.to_vec();
        sorted.sort_unstable();
        if sorted.windows(2).any(|w| w[0] == w[1]) {
            return bad("two sequences of one step share an SSM slot".into());
        }
        Ok(())
    }

    /// The checks of a step's rows, tables and logit rows (not its SSM slots).
    pub fn check_rows(&self, input: &StepInput<'_>) -> Result<(), ModelError> {
        let z = self.sizes;
        if input.rows.is_empty() || input.rows.len() > z.max_rows {
            return bad(format!(
                "{} rows (1..={} allowed)",
                input.rows.len(),
                z.max_rows
            ));
        }
        if input.tables.is_empty() || input.tables.len() > z.max_seqs {
            return bad(format!(
                "{} sequences (1..={} allowed)",
                input.tables.len(),
                z.max_seqs
            ));
        }
        if input.logit_rows.len() > z.max_logit_rows {
            return bad(format!(
                "{} logit rows (at most {})",
                input.logit_rows.len(),
                z.max_logit_rows
            ));
        }
        for (i, r) in input.rows.iter().enumerate() {
            if r.token >= self.dims.vocab {
                return bad(format!(
                    "row {i}: token {} is outside the vocabulary ({})",
                    r.token, self.dims.vocab
                ));
            }
            let Some(table) = input.tables.get(r.seq as usize) else {
                return bad(format!("row {i}: sequence {} has no block table", r.seq));
            };
            if r.position as usize >= z.max_seq_len
                || table.slot(r.position as usize, z.block_size).is_none()
            {
                return bad(format!(
                    "row {i}: position {} is not covered by its block table",
                    r.position
                ));
            }
        }
        if let Some(&r) = (input.logit_rows.iter()).find(|&&r| r as usize >= input.rows.len()) {
            return bad(format!(
                "logit row {r} is past the {} rows",
                input.rows.len()
            ));
        }
        if input.rows.windows(2).any(|w| w[1].seq < w[0].seq) {
            return bad("rows must be grouped by sequence in sequence order".into());
        }
        Ok(())
    }

    /// Check a verify step's row slots: one per row, each held (or `u32::MAX`: none), named by
    /// one row only, and never another sequence's own slot.
    pub fn check_row_slots(
        &self,
        cache: &CacheManager,
        input: &StepInput<'_>,
        row_slots: &[u32],
    ) -> Result<(), ModelError> {
        if row_slots.len() != input.rows.len() {
            return bad(format!(
                "{} row slots for {} verify rows",
                row_slots.len(),
                input.rows.len()
            ));
        }
        let named = row_slots
            .iter()
            .enumerate()
            .filter(|(_, s)| **s != u32::MAX);
        let mut seen: Vec<u32> = Vec::new();
        for (r, &slot) in named {
            if cache.ssm_slots().is_none() {
                return bad(format!(
                    "row {r} names SSM slot {slot}, but the model keeps no SSM state"
                ));
            }
            if !cache.ssm_slot_held(slot) {
                return bad(format!("row {r}: SSM slot {slot} is not held"));
            }
            if seen.contains(&slot) {
                return bad(format!("two rows keep their state in SSM slot {slot}"));
            }
            seen.push(slot);
            let own = input.rows[r].seq as usize;
            if let Some(other) =
                (0..input.ssm_slots.len()).find(|&q| q != own && input.ssm_slots[q] == slot)
            {
                return bad(format!(
                    "row {r} keeps its state in SSM slot {slot}, which sequence {other} reads"
                ));
            }
        }
        Ok(())
    }

    /// Upload a step's metadata. With `pad_to` = W the step becomes W rows, W sequences and W
    /// logit rows: padding row `i` is its own sequence at position 0 whose block table is all
    /// dummy blocks (block 0, always zero), writes no cache slot, and reads the dummy block's
    /// zeros. With `row_slots` it is a verify step keeping each row's SSM state in its slot.
    pub fn upload(
        &self,
        input: &StepInput<'_>,
        pad_to: Option<usize>,
        row_slots: Option<&[u32]>,
    ) -> Result<StepShape, ModelError> {
        let (gpu, s, z) = (self.gpu, self.stream, self.sizes);
        let n = pad_to.unwrap_or(input.rows.len());
        let num_seqs = pad_to.unwrap_or(input.tables.len());
        let mut ids = Vec::with_capacity(n);
        let mut pos = Vec::with_capacity(n);
        let mut seq = Vec::with_capacity(n);
        let mut slots = Vec::with_capacity(n);
        for r in input.rows {
            ids.push(r.token);
            pos.push(r.position);
            seq.push(r.seq);
            let table = input.tables[r.seq as usize];
            slots.push(
                table
                    .slot(r.position as usize, z.block_size)
                    .unwrap_or(u32::MAX),
            );
        }
        for i in input.rows.len()..n {
            ids.push(0);
            pos.push(0);
            seq.push(i as u32);
            slots.push(u32::MAX);
        }
        let logit_rows: Vec<u32> = match pad_to {
            Some(w) => (0..w as u32).collect(),
            None => input.logit_rows.to_vec(),
        };
        let mut tables = vec![0u32; num_seqs * z.max_blocks];
        for (i, t) in input.tables.iter().enumerate() {
            let blocks = &t.blocks()[..t.blocks().len().min(z.max_blocks)];
            tables[i * z.max_blocks..i * z.max_blocks + blocks.len()].copy_from_slice(blocks);
        }
        let b = self.buf;
        gpu.upload(b.meta.token_ids, &ids, s)?;
        gpu.upload(b.meta.positions, &pos, s)?;
        gpu.upload(b.meta.row_seq, &seq, s)?;
        gpu.upload(b.meta.slot_mapping, &slots, s)?;
        gpu.upload(b.meta.block_tables, &tables, s)?;
        gpu.upload(b.meta.logit_rows, &logit_rows, s)?;
        let mut seq_start = vec![0u32; num_seqs + 1];
        for (i, &q) in seq.iter().enumerate().rev() {
            seq_start[q as usize] = i as u32;
        }
        seq_start[num_seqs] = n as u32;
        for q in (0..num_seqs).rev() {
            if !seq.contains(&(q as u32)) {
                seq_start[q] = seq_start[q + 1];
            }
        }
        let mut seq_slot = vec![u32::MAX; num_seqs];
        seq_slot[..input.ssm_slots.len()].copy_from_slice(input.ssm_slots);
        gpu.upload(b.meta.seq_start, &seq_start, s)?;
        gpu.upload(b.meta.seq_slot, &seq_slot, s)?;
        if let Some(rs) = row_slots {
            gpu.upload(b.meta.row_slot, rs, s)?;
        }
        Ok(StepShape {
            rows: n as u32,
            num_seqs: num_seqs as u32,
            max_blocks: z.max_blocks as u32,
            logit_rows: logit_rows.len() as u32,
            verify: row_slots.is_some(),
            att_groups: 0,
            att_split: 0,
            att_prompt: 0,
        })
    }

    /// `upload` for a forward step (a prefill chunk, or rows of several sequences), whose
    /// attention runs through the row groups of `paged_attention_prefill` when a sequence has
    /// several rows. Only these steps: decode, verify and MTP steps are captured as graphs, and
    /// a group count depends on the positions.
    ///
    /// With `prompt`, rows below their sequence's `input.prompt_until` are prompt rows, whose
    /// groups come first (`StepShape::att_prompt`); then a step of one row per sequence still
    /// gets its groups when a row is a prompt row.
    pub fn upload_forward(
        &self,
        input: &StepInput<'_>,
        prompt: bool,
    ) -> Result<StepShape, ModelError> {
        let shape = self.upload(input, None, None)?;
        let is_prompt =
            |r: &StepRow| (input.prompt_until.get(r.seq as usize)).is_some_and(|&p| r.position < p);
        let flags: Vec<bool> = match prompt {
            true => input.rows.iter().map(is_prompt).collect(),
            false => Vec::new(),
        };
        if shape.rows <= shape.num_seqs && !flags.contains(&true) {
            return Ok(shape);
        }
        let d = self.dims;
        let rows: Vec<(u32, u32)> = input.rows.iter().map(|r| (r.seq, r.position)).collect();
        let plan = attention_step_plan(
            &rows,
            &flags,
            (d.num_q_heads, d.num_kv_heads, d.head_dim),
            self.ops.attention_prefill_blocks(d.head_dim)?,
        );
        self.gpu
            .upload(self.buf.meta.att_groups, &plan.groups, self.stream)?;
        Ok(StepShape {
            att_groups: (plan.groups.len() / 2) as u32,
            att_split: plan.split,
            att_prompt: plan.prompt,
            ..shape
        })
    }
}
