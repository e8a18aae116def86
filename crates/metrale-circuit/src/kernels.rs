//! Every kernel a rule names, in one place.
//!
//! The kernels a backend has are the kernel manifest's (`metrale_kernel_abi::for_each_kernel!`):
//! one constant per manifest kernel, named as the manifest names it (the kernel's name in upper
//! case), so renaming or removing a kernel there renames or removes it here, and a rule can only
//! name a manifest kernel through these. The reference rules use only these.
//!
//! [`proposed`] holds the fused kernels that `Differs` rules name and no backend has: a plan uses
//! such a rule only when the caller's [`KernelSet`](crate::KernelSet) lists all its kernels, which
//! a set made from a backend's kernels never does. A proposed kernel that gets a CUDA source and a
//! twin moves into the manifest (and out of `proposed`); the test below keeps the two apart.

use crate::rules::Kernel;

macro_rules! manifest_kernels {
    ($( $(#[$meta:meta])* $module:ident :: $name:ident => $konst:ident($params:ty) ),* $(,)?) => {
        $(
            $(#[$meta])*
            pub const $konst: Kernel = Kernel::new(stringify!($module), stringify!($name));
        )*

        /// Every kernel of the manifest, in manifest order.
        pub const MANIFEST: &[Kernel] = &[$($konst,)*];
    };
}

metrale_kernel_abi::for_each_kernel!(manifest_kernels);

/// Fused kernels that `Differs` rules name and no backend has.
pub mod proposed {
    use crate::rules::Kernel;

    /// `gdn::gdn_decode_step`: conv, gates and the recurrent rule of one token per sequence in
    /// one launch.
    pub const GDN_DECODE_STEP: Kernel = Kernel::new("gdn", "gdn_decode_step");
    /// `moe::expert_linear_silu_f32out`: the experts' down projection applying `silu(gate) * up`
    /// on load.
    pub const EXPERT_LINEAR_SILU_F32OUT: Kernel = Kernel::new("moe", "expert_linear_silu_f32out");

    /// Every proposed kernel.
    pub const ALL: &[Kernel] = &[GDN_DECODE_STEP, EXPERT_LINEAR_SILU_F32OUT];
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_manifest_kernels_are_the_abi_crates_and_no_proposed_kernel_is_one() {
        let abi: Vec<(&str, &str)> = metrale_kernel_abi::KERNELS
            .iter()
            .map(|k| (k.module, k.name))
            .collect();
        let here: Vec<(&str, &str)> = MANIFEST.iter().map(|k| (k.module, k.name)).collect();
        assert_eq!(here, abi);
        for k in proposed::ALL {
            assert!(
                !abi.contains(&(k.module, k.name)),
                "{k} is in the manifest: move it out of `proposed`"
            );
        }
    }
}
