//! `CircuitExecError`: every way binding a model to its circuit, or compiling a plan into a
//! program, can fail; `BindingProblem`: one thing a model has that its circuit would
//! misdescribe. A refused model gets every problem at once, never the first alone.

use std::fmt;

use metrale_circuit::{Block, CircuitError, Kernel, LayerSpec};
use metrale_gpu_runtime::GpuError;

use super::bindings::WeightSlot;

/// Where a problem is: the model as a whole, a decoder layer, its head, or the MTP draft head
/// (its own weights, or its decoder layer).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Part {
    /// The model's own settings (norm convention, attention gate, ...).
    Model,
    /// Decoder layer `i` (0-based).
    Layer(usize),
    /// The embedding, final norm and LM head.
    Head,
    /// The MTP draft head's own weights and settings (its norms, `fc`, its layer count).
    Draft,
    /// The MTP draft head's decoder layer `i` (0-based).
    DraftLayer(usize),
}

impl fmt::Display for Part {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Part::Model => f.write_str("model"),
            Part::Layer(i) => write!(f, "layer {i}"),
            Part::Head => f.write_str("head"),
            Part::Draft => f.write_str("draft head"),
            Part::DraftLayer(i) => write!(f, "draft head layer {i}"),
        }
    }
}

/// One reason the circuit would misdescribe the model; see [`CircuitExecError::Bindings`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BindingProblem {
    /// A layer whose type gives the executor no binding (`CircuitBindings::circuit_layer`
    /// returned `None`).
    #[error("{part} has no circuit binding")]
    Unbound {
        /// The layer (or the draft head).
        part: Part,
    },
    /// A feature present in the model that no node of the circuit computes.
    #[error("{part}: {feature} is not modelled by the circuit")]
    Unmodelled {
        /// Where.
        part: Part,
        /// The feature, in words.
        feature: String,
    },
    /// A layer whose mixer or FFN is not the one the circuit has at its index.
    #[error("{part}: the model has {model}, the circuit {circuit}")]
    KindDisagrees {
        /// The layer.
        part: Part,
        /// The model's layer.
        model: LayerSpec,
        /// The circuit's layer.
        circuit: LayerSpec,
    },
    /// A different number of decoder layers in the model and in the circuit.
    #[error("the model has {model} decoder layers, the circuit {circuit}")]
    LayerCount {
        /// The model's layers.
        model: usize,
        /// The circuit's layers.
        circuit: usize,
    },
    /// A fact of a layer's kernels (a head count, a width, a gate) that differs from the
    /// circuit's instance.
    #[error("{part}: {fact} is {model} in the model, {circuit} in the circuit")]
    FactDisagrees {
        /// The layer.
        part: Part,
        /// What differs.
        fact: &'static str,
        /// The model's value.
        model: String,
        /// The circuit's value.
        circuit: String,
    },
    /// A node reads a weight the binding does not provide.
    #[error("{block}: no weight bound for {slot}, which the circuit reads")]
    MissingWeight {
        /// The node's block.
        block: Block,
        /// The weight.
        slot: WeightSlot,
    },
    /// A bound weight that no node of the circuit reads (the model would apply it; the
    /// circuit would not).
    #[error("{block}: weight {slot} is bound, but no node of the circuit reads it")]
    UnreadWeight {
        /// The layer's block.
        block: Block,
        /// The weight.
        slot: WeightSlot,
    },
    /// A bound weight whose shape does not fit the node that reads it.
    #[error(
        "{block}: weight {slot} has shape {found:?}; the circuit reads {expected} elements{}",
        last.map(|d| format!(" in rows of {d}")).unwrap_or_default()
    )]
    WeightShape {
        /// The node's block.
        block: Block,
        /// The weight.
        slot: WeightSlot,
        /// Elements the node reads.
        expected: u64,
        /// The innermost dimension the node reads, where it has one.
        last: Option<u64>,
        /// The bound weight's shape.
        found: Vec<usize>,
    },
    /// A bound weight stored in another format than the circuit's instance says
    /// (`Instance::weights`), which picks the kernel that reads it.
    #[error(
        "{block}: weight {slot} is {found}; the circuit's {format} weights read it as {expected}"
    )]
    WeightStorage {
        /// The node's block.
        block: Block,
        /// The weight.
        slot: WeightSlot,
        /// The instance's weight format.
        format: &'static str,
        /// The format family the circuit reads.
        expected: &'static str,
        /// The bound weight's format family.
        found: &'static str,
    },
    /// An attention layer whose KV pool stores another element format than the instance's
    /// `kv_cache` (the plan would name the wrong cache numerics).
    #[error("{part}: its KV cache is {found}; the circuit's instance says {expected}")]
    KvStorage {
        /// The layer.
        part: Part,
        /// The instance's KV format.
        expected: &'static str,
        /// The bound pool's format.
        found: &'static str,
    },
    /// An attention or GDN layer without its cache or state pool in [`super::Fixed`].
    #[error("{part}: no {pool} bound")]
    MissingPool {
        /// The layer.
        part: Part,
        /// "KV cache" or "SSM state".
        pool: &'static str,
    },
}

/// The problems of a refused model, one per line.
fn list(problems: &[BindingProblem]) -> String {
    let lines: Vec<String> = problems.iter().map(|p| format!("\n  - {p}")).collect();
    lines.concat()
}

/// See the module header.
#[derive(Debug, thiserror::Error)]
pub enum CircuitExecError {
    /// The instance or its lowering (an invalid instance, a node no rule covers).
    #[error("circuit: {0}")]
    Circuit(#[from] CircuitError),
    /// The model does not fit its circuit; every problem found, in layer order.
    #[error(
        "the circuit does not model this model ({} problem{}):{}",
        problems.len(),
        if problems.len() == 1 { "" } else { "s" },
        list(problems)
    )]
    Bindings {
        /// What is wrong.
        problems: Vec<BindingProblem>,
    },
    /// A bound weight whose storage format is not the one the plan's kernel reads.
    #[error("{block}: weight {slot} is {bound}, but {kernel} reads {expected}")]
    WeightFormat {
        /// The node's block.
        block: Block,
        /// The weight.
        slot: WeightSlot,
        /// The kernel the plan lowered the node to.
        kernel: Kernel,
        /// The bound weight's format family.
        bound: &'static str,
        /// The family the kernel reads.
        expected: &'static str,
    },
    /// A plan group whose op chain and kernels the executor cannot emit (a fused rule whose
    /// launcher exists but whose emitter does not).
    #[error("{block}: no emitter for `{chain}` lowered to {kernels}")]
    NoEmitter {
        /// The group's block.
        block: Block,
        /// Its op chain.
        chain: String,
        /// Its kernels.
        kernels: String,
    },
    /// A node of a layer whose binding lacks what its kernels need (its mixer's or FFN's
    /// facts, its cache or state pool); `check_bindings` refuses such a model first.
    #[error("{block}: the program needs {what}, which the binding does not provide")]
    MissingFacts {
        /// The node's block.
        block: Block,
        /// What is missing.
        what: &'static str,
    },
    /// A circuit tensor with no buffer behind it (a buffer the model did not allocate).
    #[error("{block}: tensor `{tensor}` has no buffer")]
    NoBuffer {
        /// The block reading or writing it.
        block: Block,
        /// The tensor's name.
        tensor: &'static str,
    },
    /// An extent that does not fit a kernel's 32-bit argument.
    #[error("{block}: {what} = {value} does not fit a 32-bit kernel argument")]
    TooLarge {
        /// The block.
        block: Block,
        /// Which extent.
        what: &'static str,
        /// Its value.
        value: u64,
    },
    /// A group emitted launches other than the plan's kernels for it.
    #[error(
        "at {rows} rows, {block} `{chain}`: the plan launches {planned}, the emitter launched {emitted}"
    )]
    GroupLaunches {
        /// The program's width.
        rows: u64,
        /// The group's block.
        block: Block,
        /// Its op chain.
        chain: String,
        /// The plan's kernels for it.
        planned: String,
        /// What was emitted (kernel handles).
        emitted: String,
    },
    /// A program whose launch count is not the plan's (with the preludes its groups launched).
    #[error("at {rows} rows the plan counts {planned} launches, the program has {emitted}")]
    LaunchCount {
        /// The program's width.
        rows: u64,
        /// `Plan::launches_per_step` and the preludes.
        planned: usize,
        /// Launches compiled.
        emitted: usize,
    },
    /// The device (resolving kernels, the workspace allocation).
    #[error("device: {0}")]
    Gpu(#[from] GpuError),
}
