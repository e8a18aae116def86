//! The fuser: covers a circuit's nodes with rule matches, deterministically.
//!
//! Walking the nodes in launch order, at each uncovered node it takes the longest usable rule
//! whose chain matches there, the earliest in the table among equally long ones, and moves past
//! the nodes it covers. A chain matches at node `i` when its ops equal the ops of nodes
//! `i, i+1, ...`, all in one block, each after the first reading a value the one before writes.
//! A rule is usable when every kernel it names is in the caller's [`KernelSet`] and, under
//! [`Fusions::ReferenceOnly`], it is a `Reference` rule.
//!
//! Invariants: the groups are contiguous, in launch order, and cover every node exactly once;
//! the same circuit, table, fusions and kernel set always give the same groups. A node no
//! usable rule covers is an error naming it, its block, its op and the rules that match there
//! but were excluded.

use std::ops::Range;

use crate::circuit::{Circuit, NodeId};
use crate::error::{CircuitError, Excluded};
use crate::op::{Block, Op};
use crate::rules::{Fusions, Kernel, KernelSet, Numerics, Rule, RuleTable, chain_text};

/// What a plan may lower with: the rule table, the fusions wanted, and the kernels that exist.
#[derive(Debug, Clone, Copy)]
pub struct Lowering<'a> {
    /// The architecture's table, or another.
    pub rules: &'a RuleTable,
    /// Which rules may be used.
    pub fusions: Fusions,
    /// The kernels the backend has.
    pub kernels: &'a KernelSet,
}

/// A run of nodes lowered together by one rule.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Group {
    /// The block of its nodes.
    pub block: Block,
    /// Its nodes: indices into [`Circuit::nodes`].
    pub nodes: Range<usize>,
    /// Their ops, in order (the rule's chain).
    pub ops: Vec<Op>,
    /// The kernels it launches, in order, one launch each.
    pub kernels: Vec<Kernel>,
    /// What its rule does to the numbers.
    pub numerics: Numerics,
}

impl Group {
    /// Launches it makes per step.
    pub fn launches(&self) -> usize {
        self.kernels.len()
    }

    /// Its nodes' ids.
    pub fn node_ids(&self) -> impl Iterator<Item = NodeId> + '_ {
        self.nodes.clone().map(NodeId)
    }
}

/// Cover `circuit` with `lowering`'s rules; see the module header.
pub fn fuse(circuit: &Circuit, lowering: &Lowering<'_>) -> Result<Vec<Group>, CircuitError> {
    let nodes = circuit.nodes();
    let mut groups = Vec::new();
    let mut i = 0;
    while let Some(node) = nodes.get(i) {
        let mut best: Option<&Rule> = None;
        let mut excluded = Vec::new();
        for rule in lowering.rules.rules() {
            if !matches_at(circuit, rule, i) {
                continue;
            }
            let missing: Vec<Kernel> = rule
                .kernels
                .iter()
                .copied()
                .filter(|&k| !lowering.kernels.contains(k))
                .collect();
            let not_reference =
                lowering.fusions == Fusions::ReferenceOnly && rule.numerics != Numerics::Reference;
            if !missing.is_empty() || not_reference {
                excluded.push(Excluded {
                    chain: rule.chain_text(),
                    missing,
                    not_reference,
                });
            } else if best.is_none_or(|b| rule.chain.len() > b.chain.len()) {
                best = Some(rule);
            }
        }
        let Some(rule) = best else {
            return Err(CircuitError::Uncovered {
                node: NodeId(i),
                block: node.block,
                op: node.op,
                excluded,
            });
        };
        let end = i + rule.chain.len();
        groups.push(Group {
            block: node.block,
            nodes: i..end,
            ops: rule.chain.clone(),
            kernels: rule.kernels.clone(),
            numerics: rule.numerics,
        });
        i = end;
    }
    Ok(groups)
}

/// Whether `rule`'s chain matches at node `at`; see the module header.
fn matches_at(circuit: &Circuit, rule: &Rule, at: usize) -> bool {
    let Some(run) = circuit.nodes().get(at..at + rule.chain.len()) else {
        return false;
    };
    let Some(block) = run.first().map(|n| n.block) else {
        return false;
    };
    run.iter()
        .zip(&rule.chain)
        .enumerate()
        .all(|(j, (node, &op))| {
            node.op == op
                && node.block == block
                && (j == 0 || circuit.reads_from(NodeId(at + j), NodeId(at + j - 1)))
        })
}

/// The chain text of a group, as the plan prints it.
pub(crate) fn group_chain(group: &Group) -> String {
    chain_text(&group.ops)
}
