//! `TransformerModel::check` and `upload`: a step's input validated against the model's limits,
//! then written to the fixed step buffers (token ids, positions, sequences, slots, block tables,
//! logit rows, per-sequence starts and SSM slots, verify row slots, and a prefill chunk's
//! attention row groups), giving the `StepShape` the launches read.

use metrale_gpu_runtime::GpuBackendExt;
use metrale_model_layers::StepShape;
use metrale_model_layers::ops::attention_row_groups;

use super::{StepInput, TransformerModel};
use crate::error::ModelError;

impl TransformerModel {
    pub(super) fn check(&self, input: &StepInput<'_>) -> Result<(), ModelError> {
        self.check_rows(input)?;
        let bad = |m: String| Err(ModelError::Step(m));
        if let Some(pool) = &self.ssm {
            if input.ssm_slots.len() != input.tables.len() {
                return bad(format!(
                    "{} SSM slots for {} sequences",
                    input.ssm_slots.len(),
                    input.tables.len()
                ));
            }
            if let Some(&s) = input.ssm_slots.iter().find(|&&s| !pool.is_held(s)) {
                return bad(format!("SSM slot {s} is not held by a sequence"));
            }
            let mut sorted = input.ssm_slots.to_vec();
            sorted.sort_unstable();
            if sorted.windows(2).any(|w| w[0] == w[1]) {
                return bad("two sequences of one step share an SSM slot".into());
            }
        }
        Ok(())
    }

    /// The checks of a step's rows, tables and logit rows (not its SSM slots).
    pub(super) fn check_rows(&self, input: &StepInput<'_>) -> Result<(), ModelError> {
        let bad = |m: String| Err(ModelError::Step(m));
        if input.rows.is_empty() || input.rows.len() > self.max_rows {
            return bad(format!(
                "{} rows (1..={} allowed)",
                input.rows.len(),
                self.max_rows
            ));
        }
        if input.tables.is_empty() || input.tables.len() > self.max_seqs {
            return bad(format!(
                "{} sequences (1..={} allowed)",
                input.tables.len(),
                self.max_seqs
            ));
        }
        if input.logit_rows.len() > self.max_logit_rows {
            return bad(format!(
                "{} logit rows (at most {})",
                input.logit_rows.len(),
                self.max_logit_rows
            ));
        }
        let bs = self.kv.block_size();
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
            if r.position as usize >= self.max_seq_len
                || table.slot(r.position as usize, bs).is_none()
            {
                return bad(format!(
                    "row {i}: position {} is not covered by its block table",
                    r.position
                ));
            }
        }
        if let Some(&r) = input
            .logit_rows
            .iter()
            .find(|&&r| r as usize >= input.rows.len())
        {
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

    /// Upload a step's metadata. With `pad_to` = W the step becomes W rows, W sequences and W
    /// logit rows: padding row `i` is its own sequence at position 0 whose block table is all
    /// dummy blocks, writes no cache slot, and reads the dummy block's zeros. With `row_slots`
    /// it is a verify step keeping each row's SSM state in its slot.
    pub(super) fn upload(
        &self,
        input: &StepInput<'_>,
        pad_to: Option<usize>,
        row_slots: Option<&[u32]>,
    ) -> Result<StepShape, ModelError> {
        let (gpu, s, bs) = (&self.gpu, self.stream, self.kv.block_size());
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
            slots.push(table.slot(r.position as usize, bs).unwrap_or(u32::MAX));
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
        let mut tables = vec![self.kv.dummy_block(); num_seqs * self.max_blocks];
        for (i, t) in input.tables.iter().enumerate() {
            let blocks = &t.blocks()[..t.blocks().len().min(self.max_blocks)];
            tables[i * self.max_blocks..i * self.max_blocks + blocks.len()].copy_from_slice(blocks);
        }
        gpu.upload(self.buf.token_ids, &ids, s)?;
        gpu.upload(self.buf.positions, &pos, s)?;
        gpu.upload(self.buf.row_seq, &seq, s)?;
        gpu.upload(self.buf.slot_mapping, &slots, s)?;
        gpu.upload(self.buf.block_tables, &tables, s)?;
        gpu.upload(self.buf.logit_rows, &logit_rows, s)?;
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
        gpu.upload(self.buf.seq_start, &seq_start, s)?;
        gpu.upload(self.buf.seq_slot, &seq_slot, s)?;
        if let Some(rs) = row_slots {
            gpu.upload(self.buf.row_slot, rs, s)?;
        }
        Ok(StepShape {
            rows: n as u32,
            num_seqs: num_seqs as u32,
            max_blocks: self.max_blocks as u32,
            logit_rows: logit_rows.len() as u32,
            verify: row_slots.is_some(),
            att_groups: 0,
        })
    }

    /// `upload` for a forward step (a prefill chunk, or rows of several sequences), whose
    /// attention runs through the row groups of `paged_attention_prefill` when a sequence has
    /// several rows. Only these steps: decode, verify and MTP steps are captured as graphs, and
    /// a group count depends on the positions.
    pub(super) fn upload_forward(&self, input: &StepInput<'_>) -> Result<StepShape, ModelError> {
        let shape = self.upload(input, None, None)?;
        if shape.rows <= shape.num_seqs {
            return Ok(shape);
        }
        let d = &self.dims;
        let groups = attention_row_groups(
            input.rows.iter().map(|r| (r.seq, r.position)),
            d.num_q_heads,
            d.num_kv_heads,
            d.head_dim,
        );
        self.gpu.upload(self.buf.att_groups, &groups, self.stream)?;
        Ok(StepShape {
            att_groups: (groups.len() / 2) as u32,
            ..shape
        })
    }
}
