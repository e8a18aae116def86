//! `Plan`: a circuit lowered at one width. The fuser's groups, every edge's extents at that
//! width, a canonical text form and the SHA-256 digest of that text.
//!
//! The text (format `metrale plan v1`) is a header, one line per group, and a footer:
//!
//! ```text
//! metrale plan v1
//! architecture dense_gqa
//! dims hidden=64 vocab=256 ffn=96 q_heads=4 kv_heads=2 head_dim=16 blocks_per_seq=8
//! layers 2: full_attention/dense x2
//! argmax yes
//! rows 1
//! embed | embedding | embed::embedding_gather | reference | 1
//! layer 0 | rms_norm(input) | norm::rms_norm | reference | 1
//! layer 0 | linear(qkv) | gemm::linear | reference | 1
//! layer 0 | qk_norm_rope > kv_store | rope::qk_norm_rope_kv_store | bit_identical | 1
//! ...
//! head | argmax | sampling::argmax | reference | 1
//! launches 21
//! ```
//!
//! A group line is `block | op chain (ops joined by " > ") | kernels (joined by ", ") |
//! numerics | launches`; `tests/golden/` holds whole examples. The header has a `gdn` and a
//! `moe` line when the instance has those dims, a `weights` and a `kv_cache` line when the
//! projections or the KV cache are not bf16, and a verify step's plan a `step verify` line before `rows` (a decode plan has none,
//! so its text does not depend on whether verify or draft steps are compiled too), and a
//! verify step of several sequences a `seqs <n>` line after `rows` (the other steps' sequences
//! follow from their rows, so their texts have none); a draft
//! step's plan has `step draft` and `draft_layer <kind>/<ffn>` lines there. The fusions asked for are not in the text: two plans that launch the same kernels over
//! the same instance have the same text and digest, whichever mode produced them.
//!
//! Invariants: the text is a function of the circuit, the groups and the width only (no
//! clock, no environment, no map iteration order); `launches` is the sum of the group lines'
//! counts and equals [`Plan::launches_per_step`].

use std::fmt::{self, Write as _};
use std::sync::Arc;

use sha2::{Digest as _, Sha256};

use crate::circuit::{Circuit, Node, ValueId};
use crate::error::CircuitError;
use crate::fuser::{Group, Lowering, fuse, group_chain};
use crate::instance::{Step, Width};
use crate::rules::{Kernel, Numerics};

/// The first line of every plan text; bumped whenever the text's format or the meaning of a
/// name in it changes.
pub const PLAN_FORMAT: &str = "metrale plan v1";

/// A SHA-256 digest, shown as 64 lowercase hex digits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Digest(pub [u8; 32]);

impl Digest {
    /// The digest of `bytes`.
    pub fn of(bytes: &[u8]) -> Digest {
        let mut out = [0u8; 32];
        out.copy_from_slice(&Sha256::digest(bytes));
        Digest(out)
    }
}

impl fmt::Display for Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for b in self.0 {
            write!(f, "{b:02x}")?;
        }
        Ok(())
    }
}

/// See the module header.
#[derive(Debug, Clone)]
pub struct Plan {
    circuit: Arc<Circuit>,
    width: Width,
    groups: Vec<Group>,
    extents: Vec<Vec<u64>>,
    text: String,
    digest: Digest,
}

impl Plan {
    /// Lower `circuit` at `width`.
    pub fn compile(
        circuit: &Arc<Circuit>,
        lowering: &Lowering<'_>,
        width: Width,
    ) -> Result<Plan, CircuitError> {
        let groups = fuse(circuit, lowering)?;
        Plan::with_groups(circuit, groups, width)
    }

    /// Lower `circuit` at every width of its step ([`Circuit::widths`]), ascending.
    pub fn compile_widths(
        circuit: &Arc<Circuit>,
        lowering: &Lowering<'_>,
    ) -> Result<Vec<Plan>, CircuitError> {
        let groups = fuse(circuit, lowering)?;
        circuit
            .widths()
            .into_iter()
            .map(|width| Plan::with_groups(circuit, groups.clone(), width))
            .collect()
    }

    fn with_groups(
        circuit: &Arc<Circuit>,
        groups: Vec<Group>,
        width: Width,
    ) -> Result<Plan, CircuitError> {
        let extents = circuit.extents(width)?;
        let text = render(circuit, &groups, width);
        let digest = Digest::of(text.as_bytes());
        Ok(Plan {
            circuit: Arc::clone(circuit),
            width,
            groups,
            extents,
            text,
            digest,
        })
    }

    /// The circuit it lowers.
    pub fn circuit(&self) -> &Arc<Circuit> {
        &self.circuit
    }

    /// Rows per step.
    pub fn rows(&self) -> u64 {
        self.width.rows
    }

    /// Sequences per step.
    pub fn seqs(&self) -> u64 {
        self.width.seqs
    }

    /// Rows and sequences per step.
    pub fn width(&self) -> Width {
        self.width
    }

    /// The groups, in launch order.
    pub fn groups(&self) -> &[Group] {
        &self.groups
    }

    /// A group's nodes.
    pub fn group_nodes(&self, group: &Group) -> &[Node] {
        self.circuit.nodes().get(group.nodes.clone()).unwrap_or(&[])
    }

    /// Every launch of the step, in order: the group it belongs to (an index into
    /// [`Plan::groups`]) and its kernel.
    pub fn launches(&self) -> impl Iterator<Item = (usize, Kernel)> + '_ {
        self.groups
            .iter()
            .enumerate()
            .flat_map(|(g, group)| group.kernels.iter().map(move |&k| (g, k)))
    }

    /// Kernel launches per step.
    pub fn launches_per_step(&self) -> usize {
        self.groups.iter().map(Group::launches).sum()
    }

    /// The loosest numerics of its groups: `Reference` when every group is, `BitIdentical`
    /// when none differs, else `Differs`.
    pub fn numerics(&self) -> Numerics {
        self.groups
            .iter()
            .map(|g| g.numerics)
            .max()
            .unwrap_or(Numerics::Reference)
    }

    /// A value's extents at this plan's width; empty for an id not in the circuit.
    pub fn extents(&self, value: ValueId) -> &[u64] {
        self.extents.get(value.0).map_or(&[], Vec::as_slice)
    }

    /// The canonical text.
    pub fn text(&self) -> &str {
        &self.text
    }

    /// SHA-256 of the canonical text.
    pub fn digest(&self) -> Digest {
        self.digest
    }
}

/// The digest of several plans (a model's programs at every width): SHA-256 of their texts,
/// concatenated in the order given.
pub fn plans_digest(plans: &[Plan]) -> Digest {
    let mut h = Sha256::new();
    for p in plans {
        h.update(p.text.as_bytes());
    }
    let mut out = [0u8; 32];
    out.copy_from_slice(&h.finalize());
    Digest(out)
}

fn render(circuit: &Circuit, groups: &[Group], width: Width) -> String {
    let mut s = String::new();
    s.push_str(PLAN_FORMAT);
    s.push('\n');
    s.push_str(&circuit.instance().header());
    // Infallible: writing to a String.
    if circuit.step() != Step::Decode {
        let _ = writeln!(s, "step {}", circuit.step().name());
    }
    if let (Step::Draft, Some(layer)) = (circuit.step(), circuit.instance().draft_layer) {
        let _ = writeln!(s, "draft_layer {layer}");
    }
    let _ = writeln!(s, "rows {}", width.rows);
    if width != circuit.step().width(width.rows) {
        let _ = writeln!(s, "seqs {}", width.seqs);
    }
    let mut total = 0;
    for g in groups {
        let kernels: Vec<String> = g.kernels.iter().map(ToString::to_string).collect();
        let _ = writeln!(
            s,
            "{} | {} | {} | {} | {}",
            g.block,
            group_chain(g),
            kernels.join(", "),
            g.numerics,
            g.launches()
        );
        total += g.launches();
    }
    let _ = writeln!(s, "launches {total}");
    s
}
