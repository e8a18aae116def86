//! `CircuitError`: every way building a circuit, a rule table or a plan can fail, each naming
//! what is wrong and where (the layer, the node and its op, the dimension, the rule).

use crate::circuit::NodeId;
use crate::op::{Block, LayerSpec, Op};
use crate::rules::Kernel;
use crate::shape::Dim;

/// A rule that matches where the fuser looked but may not be used, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Excluded {
    /// The rule's op chain, as the plan text prints it (`qk_norm_rope > kv_store`).
    pub chain: String,
    /// Its kernels that the caller's kernel set lacks.
    pub missing: Vec<Kernel>,
    /// It is not a `reference` rule and the plan uses only those.
    pub not_reference: bool,
}

impl std::fmt::Display for Excluded {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "`{}`", self.chain)?;
        let mut why = Vec::new();
        if self.not_reference {
            why.push("not a reference rule".to_string());
        }
        if !self.missing.is_empty() {
            let names: Vec<String> = self.missing.iter().map(ToString::to_string).collect();
            why.push(format!("missing kernel {}", names.join(", ")));
        }
        if !why.is_empty() {
            write!(f, " ({})", why.join("; "))?;
        }
        Ok(())
    }
}

/// See the module header.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CircuitError {
    /// The instance has no decoder layer.
    #[error("the instance has no decoder layer")]
    NoLayers,
    /// The instance's widths are not a non-empty, strictly ascending list of positive numbers.
    #[error(
        "the instance's widths {widths:?} are not a non-empty, strictly ascending list of widths >= 1"
    )]
    BadWidths {
        /// The widths given.
        widths: Vec<u64>,
    },
    /// The instance's verify rows are not a strictly ascending list of positive numbers.
    #[error("the instance's verify rows {rows:?} are not a strictly ascending list of rows >= 1")]
    BadVerifyRows {
        /// The row counts given.
        rows: Vec<u64>,
    },
    /// The instance's batched verify shapes are not strictly ascending, or one has fewer than
    /// two sequences or no more rows than sequences.
    #[error(
        "the instance's batched verify shapes {batches:?} are not a strictly ascending list of \
         shapes of >= 2 sequences with more rows than sequences"
    )]
    BadVerifyBatches {
        /// The shapes given.
        batches: Vec<crate::Width>,
    },
    /// The instance's batched draft shapes are not strictly ascending, or one has fewer than
    /// two sequences or fewer rows than sequences.
    #[error(
        "the instance's batched draft shapes {batches:?} are not a strictly ascending list of \
         shapes of >= 2 sequences with at least a row per sequence"
    )]
    BadDraftBatches {
        /// The shapes given.
        batches: Vec<crate::Width>,
    },
    /// The instance's draft rows are not a strictly ascending list of positive numbers.
    #[error("the instance's draft rows {rows:?} are not a strictly ascending list of rows >= 1")]
    BadDraftRows {
        /// The row counts given.
        rows: Vec<u64>,
    },
    /// Draft rows (or a draft circuit) without the MTP head's layer.
    #[error("a draft step needs the MTP head's layer (`Instance::draft_layer`)")]
    NoDraftLayer,
    /// An MTP head layer that is not full attention, or not of a kind the architecture has.
    #[error(
        "the draft layer {spec} is not a full-attention layer the {architecture} architecture has"
    )]
    BadDraftLayer {
        /// The draft layer.
        spec: LayerSpec,
        /// The architecture's name.
        architecture: &'static str,
    },
    /// A plan was asked for zero rows or zero sequences.
    #[error("a plan needs at least one row and one sequence")]
    ZeroRows,
    /// A layer's kind is not one the architecture has.
    #[error("layer {layer} is {spec}, which the {architecture} circuit does not have")]
    LayerNotInArchitecture {
        /// The layer.
        layer: usize,
        /// Its kind.
        spec: LayerSpec,
        /// The architecture's text name.
        architecture: &'static str,
    },
    /// A dimension the circuit uses is missing from the instance (no GDN or MoE dims, no
    /// shared expert).
    #[error("the circuit uses `{dim}`, but the instance has no {group} dims")]
    MissingDim {
        /// The dimension.
        dim: Dim,
        /// The group of dims it comes from (`gdn`, `moe`, `shared expert`).
        group: &'static str,
    },
    /// A dimension the circuit uses resolves to zero, or an extent overflows.
    #[error("`{dim}` of {tensor} resolves to {value}: every extent must be >= 1 and fit in u64")]
    BadExtent {
        /// The tensor whose shape holds the extent.
        tensor: &'static str,
        /// The extent, as written.
        dim: String,
        /// What it resolved to (0, or `overflow`).
        value: String,
    },
    /// A rule of a table has an empty op chain or no kernel.
    #[error("rule {index} of the table ({chain}) {problem}")]
    BadRule {
        /// Its index in the table.
        index: usize,
        /// Its chain as written.
        chain: String,
        /// What is wrong.
        problem: &'static str,
    },
    /// No usable rule covers a node.
    #[error(
        "no rule covers node {node} ({block}, `{op}`){}",
        if excluded.is_empty() {
            String::new()
        } else {
            let list: Vec<String> = excluded.iter().map(ToString::to_string).collect();
            format!("; rules that match there but cannot be used: {}", list.join(", "))
        }
    )]
    Uncovered {
        /// The node.
        node: NodeId,
        /// Its block.
        block: Block,
        /// Its op.
        op: Op,
        /// Rules that match at the node but were excluded.
        excluded: Vec<Excluded>,
    },
}
