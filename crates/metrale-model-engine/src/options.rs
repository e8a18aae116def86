//! `ModelOptions`: the sizes a model is built for. Every buffer is allocated from these once, at
//! load.

/// See the module header. Every field has a documented default.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelOptions {
    /// Most tokens one step processes (prefill chunks are cut to this). Default 512.
    pub max_batch_tokens: usize,
    /// Longest sequence (prompt plus output). Default: the config's
    /// `max_position_embeddings`, capped at 4096.
    pub max_seq_len: Option<usize>,
    /// Tokens per KV-cache block. Default 16.
    pub block_size: usize,
    /// KV-cache blocks. Default: enough for `max_decode_seqs` sequences of `max_seq_len`, plus
    /// the dummy block.
    pub num_kv_blocks: Option<usize>,
    /// Most sequences in one step; decode batches are padded up the ladder 1, 2, 4, ... to at
    /// most this. Default 8.
    pub max_decode_seqs: usize,
    /// Capture each decode width's step once as a graph and replay it. Default true.
    pub decode_graphs: bool,
}

impl Default for ModelOptions {
    fn default() -> Self {
        ModelOptions {
            max_batch_tokens: 512,
            max_seq_len: None,
            block_size: 16,
            num_kv_blocks: None,
            max_decode_seqs: 8,
            decode_graphs: true,
        }
    }
}

impl ModelOptions {
    /// The padded decode widths: powers of two below `max_decode_seqs`, then `max_decode_seqs`.
    pub fn decode_ladder(&self) -> Vec<usize> {
        let mut out = Vec::new();
        let mut w = 1;
        while w < self.max_decode_seqs {
            out.push(w);
            w *= 2;
        }
        out.push(self.max_decode_seqs.max(1));
        out
    }

    /// The ladder width a decode of `n` sequences is padded to.
    pub fn decode_width(&self, n: usize) -> Option<usize> {
        self.decode_ladder().into_iter().find(|&w| w >= n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ladder_doubles_up_to_the_maximum() {
        let o = ModelOptions {
            max_decode_seqs: 24,
            ..Default::default()
        };
        assert_eq!(o.decode_ladder(), vec![1, 2, 4, 8, 16, 24]);
        assert_eq!(o.decode_width(3), Some(4));
        assert_eq!(o.decode_width(17), Some(24));
        assert_eq!(o.decode_width(25), None);
        assert_eq!(
            ModelOptions {
                max_decode_seqs: 1,
                ..Default::default()
            }
            .decode_ladder(),
            vec![1]
        );
    }
}
