//! CPU twin of `kernels/init.cu`: filling a buffer with reproducible pseudo-random values from a
//! counter-based hash, so a benchmark model of a real shape can be built on the device without a
//! checkpoint (and the CPU and CUDA fills agree bit for bit).

use half::bf16;
use metrale_kernel_abi::FillUniformBf16Params;

use crate::cpu::KernelCtx;
use crate::error::GpuResult;

/// The SplitMix64 finaliser of `index` mixed with `seed`.
pub fn hash(index: u64, seed: u64) -> u64 {
    let mut z =
        index.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ seed.wrapping_mul(0xD1B5_4A32_D192_ED03);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A value in `[-scale, scale)` for `index`: the top 24 bits of the hash as a fraction.
pub fn uniform(index: u64, seed: u64, scale: f32) -> f32 {
    let u = (hash(index, seed) >> 40) as f32 * (1.0 / 16_777_216.0);
    (2.0 * u - 1.0) * scale
}

/// `fill_uniform_bf16` ([`FillUniformBf16Params`]): `out[i] = offset + uniform(i, seed, scale)`.
pub fn fill_uniform_bf16(ctx: &KernelCtx<'_>) -> GpuResult<()> {
    let p: FillUniformBf16Params = ctx.params()?;
    let out = ctx.slice_mut::<bf16>("out", p.out, p.n as usize)?;
    for (i, o) in out.iter_mut().enumerate() {
        *o = bf16::from_f32(p.offset + uniform(i as u64, p.seed, p.scale));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_fill_is_spread_and_seed_dependent() {
        let a: Vec<f32> = (0..1000).map(|i| uniform(i, 7, 0.5)).collect();
        let b: Vec<f32> = (0..1000).map(|i| uniform(i, 8, 0.5)).collect();
        assert_ne!(a, b);
        assert!(a.iter().all(|v| (-0.5..0.5).contains(v)));
        let mean = a.iter().sum::<f32>() / 1000.0;
        assert!(mean.abs() < 0.05, "mean {mean}");
        assert!(a.iter().any(|&v| v > 0.4) && a.iter().any(|&v| v < -0.4));
    }

    /// With seed 0 the hash of index i is the i-th output of SplitMix64 from state 0, whose
    /// first outputs are published (Vigna's reference implementation); the value takes the top
    /// 24 bits: 0xE220A8 = 14,819,496, so (2 * 14,819,496 - 2^24) / 2^24.
    #[test]
    fn the_hash_is_splitmix64_and_the_value_its_top_24_bits() {
        assert_eq!(hash(1, 0), 0xE220_A839_7B1D_CDAF);
        assert_eq!(hash(2, 0), 0x6E78_9E6A_A1B9_65F4);
        assert_eq!(uniform(1, 0, 1.0), 12_861_776.0 / 16_777_216.0);
        assert_eq!(uniform(1, 0, 0.25), 3_215_444.0 / 16_777_216.0);
    }
}
