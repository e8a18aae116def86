//! Lowering rules: an op chain lowered to named kernels, with what that does to the numbers.
//! A [`RuleTable`] is an ordered list of rules (one per architecture in `tables.rs`); the order
//! breaks ties between equally long matches, so it is part of the plan.
//!
//! Also what the caller says about its backend: which kernels exist ([`KernelSet`]) and which
//! rules it wants ([`Fusions`]).
//!
//! Invariants:
//! - A rule's chain and kernel list are non-empty (checked by [`RuleTable::new`]).
//! - A `Reference` rule lowers to exactly the kernels the legacy forward launches for its op,
//!   in the same order, so a plan of reference rules reproduces the legacy step bitwise.

use std::collections::BTreeSet;
use std::fmt;

use crate::error::CircuitError;
use crate::op::Op;

/// A kernel, named as the backends resolve it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Kernel {
    /// Module (`norm`, `gemm`, `gdn`, ...).
    pub module: &'static str,
    /// Function in the module.
    pub name: &'static str,
}

impl Kernel {
    /// `module::name`.
    pub const fn new(module: &'static str, name: &'static str) -> Kernel {
        Kernel { module, name }
    }
}

impl fmt::Display for Kernel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}::{}", self.module, self.name)
    }
}

/// What a rule does to the numbers, compared with the legacy forward.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Numerics {
    /// The kernels the legacy forward launches for these ops.
    Reference,
    /// Other kernels whose outputs are byte-identical to the reference chain's (each such rule
    /// ships with a test proving it).
    BitIdentical,
    /// Other kernels whose outputs differ within tolerance (a different accumulation order, an
    /// intermediate kept in f32 instead of rounded to bf16, ...).
    Differs,
}

impl Numerics {
    /// The tag's text name.
    pub fn name(self) -> &'static str {
        match self {
            Numerics::Reference => "reference",
            Numerics::BitIdentical => "bit_identical",
            Numerics::Differs => "differs",
        }
    }
}

impl fmt::Display for Numerics {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Which rules a plan may use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Fusions {
    /// Every rule whose kernels all exist.
    All,
    /// Only `Reference` rules (whose kernels exist): the legacy forward, bitwise.
    ReferenceOnly,
}

/// An op chain and the kernels it lowers to.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Rule {
    /// The ops it covers, in launch order; each after the first must read a value the one
    /// before it writes, and all must be in one block.
    pub chain: Vec<Op>,
    /// The kernels it launches, in order, one launch each.
    pub kernels: Vec<Kernel>,
    /// What it does to the numbers.
    pub numerics: Numerics,
}

impl Rule {
    /// The chain as the plan text prints it: ops joined by ` > `.
    pub fn chain_text(&self) -> String {
        chain_text(&self.chain)
    }
}

/// `ops` joined by ` > `.
pub(crate) fn chain_text(ops: &[Op]) -> String {
    let names: Vec<String> = ops.iter().map(ToString::to_string).collect();
    names.join(" > ")
}

/// An ordered list of rules; see the module header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RuleTable {
    pub(crate) rules: Vec<Rule>,
}

impl RuleTable {
    /// A table of `rules`, in the order given; fails naming a rule with an empty chain or no
    /// kernel.
    pub fn new(rules: Vec<Rule>) -> Result<RuleTable, CircuitError> {
        for (index, r) in rules.iter().enumerate() {
            let problem = if r.chain.is_empty() {
                "covers no op"
            } else if r.kernels.is_empty() {
                "launches no kernel"
            } else {
                continue;
            };
            return Err(CircuitError::BadRule {
                index,
                chain: r.chain_text(),
                problem,
            });
        }
        Ok(RuleTable { rules })
    }

    /// The rules, in order.
    pub fn rules(&self) -> &[Rule] {
        &self.rules
    }

    /// Every kernel the table's rules of `numerics` name, for a caller listing what exists.
    pub fn kernels(&self, numerics: Numerics) -> BTreeSet<Kernel> {
        self.rules
            .iter()
            .filter(|r| r.numerics == numerics)
            .flat_map(|r| r.kernels.iter().copied())
            .collect()
    }
}

/// The kernels the caller's backend has.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KernelSet {
    /// `None`: every kernel any rule names.
    names: Option<BTreeSet<(String, String)>>,
    /// Taken out of `names` (or of every kernel) by [`KernelSet::without`].
    excluded: BTreeSet<(String, String)>,
}

impl KernelSet {
    /// Every kernel exists: for printing and comparing plans without a backend.
    pub fn all() -> KernelSet {
        KernelSet {
            names: None,
            excluded: BTreeSet::new(),
        }
    }

    /// Exactly the kernels `(module, name)` listed.
    pub fn from_names<I, M, N>(names: I) -> KernelSet
    where
        I: IntoIterator<Item = (M, N)>,
        M: Into<String>,
        N: Into<String>,
    {
        KernelSet {
            names: Some(
                names
                    .into_iter()
                    .map(|(m, n)| (m.into(), n.into()))
                    .collect(),
            ),
            excluded: BTreeSet::new(),
        }
    }

    /// This set less `kernel` (a caller's kernel that serves only some widths, at the others).
    pub fn without(mut self, kernel: Kernel) -> KernelSet {
        self.excluded
            .insert((kernel.module.to_string(), kernel.name.to_string()));
        self
    }

    /// Exactly `kernels`.
    pub fn from_kernels<'a>(kernels: impl IntoIterator<Item = &'a Kernel>) -> KernelSet {
        KernelSet::from_names(kernels.into_iter().map(|k| (k.module, k.name)))
    }

    /// Whether `kernel` exists.
    pub fn contains(&self, kernel: Kernel) -> bool {
        let key = (kernel.module.to_string(), kernel.name.to_string());
        !self.excluded.contains(&key) && self.names.as_ref().is_none_or(|set| set.contains(&key))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::op::LinearRole;

    #[test]
    fn a_rule_without_ops_or_kernels_is_refused_by_index() {
        let ok = Rule {
            chain: vec![Op::SiluMul],
            kernels: vec![Kernel::new("activation", "silu_mul")],
            numerics: Numerics::Reference,
        };
        let no_kernel = Rule {
            chain: vec![Op::Linear(LinearRole::Down)],
            kernels: vec![],
            numerics: Numerics::Reference,
        };
        let err = RuleTable::new(vec![ok.clone(), no_kernel]).err();
        assert_eq!(
            err.map(|e| e.to_string()),
            Some("rule 1 of the table (linear(down)) launches no kernel".to_string())
        );
        let no_op = Rule {
            chain: vec![],
            ..ok.clone()
        };
        assert!(matches!(
            RuleTable::new(vec![ok, no_op]),
            Err(CircuitError::BadRule { index: 1, .. })
        ));
    }

    #[test]
    fn a_kernel_set_holds_what_it_lists() {
        let set = KernelSet::from_names([("norm", "rms_norm")]);
        assert!(set.contains(Kernel::new("norm", "rms_norm")));
        assert!(!set.contains(Kernel::new("norm", "add_rms_norm")));
        assert!(!set.contains(Kernel::new("rms_norm", "norm")));
        assert!(KernelSet::all().contains(Kernel::new("any", "thing")));
    }
}
