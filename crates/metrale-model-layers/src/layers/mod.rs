//! The building blocks of decoder layers: full attention, Gated DeltaNet, the dense SwiGLU MLP,
//! the sparse MoE MLP, and `DecoderLayer`, which composes a mixer and an FFN between two norms.

mod attention;
mod decoder;
mod gdn;
mod mlp;
mod moe;
mod mtp;

pub use attention::Attention;
pub use decoder::{DecoderLayer, Ffn, Mixer};
pub use gdn::{GDN_CHUNK, GDN_L2_EPS, GatedDeltaNet, GdnShape, InProjSource};
pub use mlp::Mlp;
pub use moe::{MoeMlp, MoeShape, SharedExpert};
pub use mtp::MtpHead;
