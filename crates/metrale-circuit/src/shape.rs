//! Shape expressions over named dimensions: what an edge's extent is, written in the names of
//! the model (`[rows, qkv_width]`, `[rows*top_k, 2*expert_ffn]`), resolved to numbers by an
//! [`Instance`](crate::Instance) at a width.
//!
//! Invariant: an extent is `factor * d1 * d2 * ... + plus`; the text form prints exactly that,
//! so two extents print the same only when they are the same expression.

use std::fmt;

/// A named dimension a shape can use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Dim {
    /// Rows of the step: the decode width (one row per sequence), or a verify step's rows.
    Rows,
    /// Sequences of the step: `rows` in a decode step, 1 in a (single-sequence) verify or
    /// draft step.
    Seqs,
    /// Rows with logits: every row in decode and verify, the last one in a draft step.
    LogitRows,
    /// Hidden size.
    Hidden,
    /// Vocabulary.
    Vocab,
    /// Dense FFN width (`intermediate_size`).
    Ffn,
    /// The fused qkv projection's width: `q_heads * head_dim * (2 if gated else 1) +
    /// 2 * kv_heads * head_dim`.
    QkvWidth,
    /// Attention's output width before `o`: `q_heads * head_dim`.
    AttnOutWidth,
    /// One token's k (or v) in the cache: `kv_heads * head_dim`.
    KvWidth,
    /// Columns of the block table: the most KV blocks one sequence can hold.
    BlocksPerSeq,
    /// GDN fused input projection width: `gdn_conv_dim + gdn_value_dim + 2 * gdn_v_heads`.
    GdnProjWidth,
    /// GDN conv channels `[q | k | v]`: `2 * k_heads * k_head_dim + gdn_value_dim`.
    GdnConvDim,
    /// GDN normalised q and k: `2 * k_heads * k_head_dim`.
    GdnQkWidth,
    /// GDN value heads.
    GdnVHeads,
    /// GDN key head dim.
    GdnKHeadDim,
    /// GDN value head dim.
    GdnVHeadDim,
    /// GDN value width: `v_heads * v_head_dim`.
    GdnValueDim,
    /// GDN conv window kept per sequence: `conv_kernel - 1`.
    ConvWindow,
    /// Routed experts.
    Experts,
    /// Experts per token.
    TopK,
    /// One routed expert's width.
    ExpertFfn,
    /// The shared expert's width.
    SharedFfn,
}

impl Dim {
    /// The dimension's text name.
    pub fn name(self) -> &'static str {
        match self {
            Dim::Rows => "rows",
            Dim::Seqs => "seqs",
            Dim::LogitRows => "logit_rows",
            Dim::Hidden => "hidden",
            Dim::Vocab => "vocab",
            Dim::Ffn => "ffn",
            Dim::QkvWidth => "qkv_width",
            Dim::AttnOutWidth => "attn_out_width",
            Dim::KvWidth => "kv_width",
            Dim::BlocksPerSeq => "blocks_per_seq",
            Dim::GdnProjWidth => "gdn_proj_width",
            Dim::GdnConvDim => "gdn_conv_dim",
            Dim::GdnQkWidth => "gdn_qk_width",
            Dim::GdnVHeads => "gdn_v_heads",
            Dim::GdnKHeadDim => "gdn_k_head_dim",
            Dim::GdnVHeadDim => "gdn_v_head_dim",
            Dim::GdnValueDim => "gdn_value_dim",
            Dim::ConvWindow => "conv_window",
            Dim::Experts => "experts",
            Dim::TopK => "top_k",
            Dim::ExpertFfn => "expert_ffn",
            Dim::SharedFfn => "shared_ffn",
        }
    }
}

impl fmt::Display for Dim {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// One extent of a shape: `factor * dims[0] * dims[1] * ... + plus`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Extent {
    /// A constant factor (1 for none).
    pub factor: u64,
    /// Named dimensions multiplied together.
    pub dims: &'static [Dim],
    /// A constant added last (0 for none).
    pub plus: u64,
}

impl Extent {
    /// A single named dimension.
    pub const fn dim(dims: &'static [Dim]) -> Extent {
        Extent {
            factor: 1,
            dims,
            plus: 0,
        }
    }

    /// `factor` times the product of `dims`.
    pub const fn times(factor: u64, dims: &'static [Dim]) -> Extent {
        Extent {
            factor,
            dims,
            plus: 0,
        }
    }

    /// The product of `dims`, plus `plus`.
    pub const fn plus(dims: &'static [Dim], plus: u64) -> Extent {
        Extent {
            factor: 1,
            dims,
            plus,
        }
    }

    /// The extent's value, `value(dim)` giving each named dimension; `None` on overflow.
    pub fn eval<E>(&self, mut value: impl FnMut(Dim) -> Result<u64, E>) -> Result<Option<u64>, E> {
        let mut n = Some(self.factor);
        for &d in self.dims {
            let v = value(d)?;
            n = n.and_then(|n| n.checked_mul(v));
        }
        Ok(n.and_then(|n| n.checked_add(self.plus)))
    }
}

impl fmt::Display for Extent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut first = true;
        if self.factor != 1 || self.dims.is_empty() {
            write!(f, "{}", self.factor)?;
            first = false;
        }
        for d in self.dims {
            if !first {
                f.write_str("*")?;
            }
            f.write_str(d.name())?;
            first = false;
        }
        if self.plus != 0 {
            write!(f, "+{}", self.plus)?;
        }
        Ok(())
    }
}

/// A shape expression: one [`Extent`] per axis, outermost first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Shape(pub &'static [Extent]);

impl fmt::Display for Shape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("[")?;
        for (i, e) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            write!(f, "{e}")?;
        }
        f.write_str("]")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn extents_print_as_written_and_evaluate() {
        const A: Extent = Extent::times(2, &[Dim::Ffn]);
        const B: Extent = Extent::dim(&[Dim::Rows, Dim::TopK]);
        const C: Extent = Extent::plus(&[Dim::Rows], 1);
        assert_eq!(Shape(&[B, A]).to_string(), "[rows*top_k, 2*ffn]");
        assert_eq!(C.to_string(), "rows+1");
        let v = |d: Dim| -> Result<u64, ()> {
            Ok(match d {
                Dim::Ffn => 96,
                Dim::Rows => 3,
                Dim::TopK => 5,
                _ => 0,
            })
        };
        assert_eq!(A.eval(v), Ok(Some(192)));
        assert_eq!(B.eval(v), Ok(Some(15)));
        assert_eq!(C.eval(v), Ok(Some(4)));
        let big = |_: Dim| -> Result<u64, ()> { Ok(u64::MAX) };
        assert_eq!(A.eval(big), Ok(None));
    }
}
