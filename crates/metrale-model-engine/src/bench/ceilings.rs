//! The ceilings a run measures beside its figures: the device-to-device copy bandwidth, the
//! bf16 GEMM rates (ours and the vendor library's) and, in runs with FP8 weights, the FP8 GEMM
//! rates (our `linear` of a block-FP8 weight and the vendor's e4m3 GEMM).

use std::sync::Arc;

use metrale_gpu_runtime::fp8::FP8_BLOCK_ROW_SHIFT;
use metrale_gpu_runtime::{DType, DevicePtr, GpuBackend, VendorGemm};
use metrale_model_layers::Ops;
use metrale_model_layers::ops::{BlockScales, Matrix};
use metrale_model_layers::ops_gemm::{self, Fp8Scratch, LinearStaging};

use super::{BenchOptions, time_ms};
use crate::error::ModelError;
use crate::options::Quantization;

/// The ceilings one run measures.
#[derive(Debug, Clone, PartialEq)]
pub struct Ceilings {
    /// Device-to-device copy bandwidth (read + write), GB/s.
    pub copy_gb_s: f64,
    /// bf16 GEMM rate of our `linear`, TFLOP/s.
    pub gemm_tflop_s: f64,
    /// bf16 GEMM rate of the vendor library, TFLOP/s, where the backend has one.
    pub vendor_gemm_tflop_s: Option<f64>,
    /// The FP8 rates, where the run asked for them ([`BenchOptions::quantization`] FP8).
    pub fp8: Option<Fp8Rates>,
}

/// The FP8 GEMM rates of a run with FP8 weights, at the bf16 rates' shape.
#[derive(Debug, Clone, PartialEq)]
pub struct Fp8Rates {
    /// Our `linear` of a block-FP8 weight (x bf16: the prefill's path), TFLOP/s.
    pub ours_tflop_s: f64,
    /// The vendor library's e4m3 GEMM (x and w e4m3, fast accumulation), TFLOP/s: the FP8
    /// ceiling; `None` where the backend has no vendor library or the library refused it.
    pub vendor_tflop_s: Option<f64>,
    /// Why the vendor's e4m3 GEMM did not run, where the library refused it.
    pub vendor_refused: Option<String>,
}

/// The device-to-device copy bandwidth (read + write) over buffers of `bytes`, GB/s.
pub fn copy_bandwidth(
    gpu: &Arc<dyn GpuBackend>,
    bytes: usize,
    iters: usize,
) -> Result<f64, ModelError> {
    let s = gpu.default_stream();
    let (src, dst) = (gpu.alloc(bytes)?, gpu.alloc(bytes)?);
    gpu.memset(src, 1, bytes, s)?;
    let copy_ms = time_ms(gpu.as_ref(), s, iters, || {
        Ok(gpu.copy_d2d(dst, src, bytes, s)?)
    })?;
    gpu.free(src)?;
    gpu.free(dst)?;
    Ok(2.0 * bytes as f64 / (copy_ms * 1e-3) / 1e9)
}

/// Measure the copy bandwidth and the bf16 GEMM rates (ours, and the vendor library's), and in
/// a run with FP8 weights the FP8 rates ([`Fp8Rates`]).
pub fn ceilings(gpu: &Arc<dyn GpuBackend>, opts: &BenchOptions) -> Result<Ceilings, ModelError> {
    let s = gpu.default_stream();
    let copy = copy_bandwidth(gpu, opts.copy_bytes, opts.iters)?;

    let ops = Ops::new(gpu.clone())?;
    let d = opts.gemm_dim;
    let bufs: Vec<DevicePtr> = (0..3)
        .map(|_| gpu.alloc(d * d * 2))
        .collect::<Result<_, _>>()?;
    ops.fill_uniform_bf16(s, bufs[1], (d * d) as u64, 1, 0.0, 0.5)?;
    ops.fill_uniform_bf16(s, bufs[2], (d * d) as u64, 2, 0.0, 0.5)?;
    let dd = d as u32;
    // The engine's prefill path: x staged for `linear_tma` as a model's step buffers do, with a
    // map slot for the bf16 weight and one for its FP8 image.
    let image_bytes = ops_gemm::linear_staging_bytes(dd, dd);
    let staging = gpu.alloc(LinearStaging::bytes(image_bytes, 2))?;
    ops.set_linear_staging(Some(LinearStaging::at(staging, image_bytes, 2)));
    let tflop_s = |ms: f64| 2.0 * (d as f64).powi(3) / (ms * 1e-3) / 1e12;
    let measured = (|| {
        let gemm_ms = time_ms(gpu.as_ref(), s, opts.iters, || {
            let [out, x, w] = [bufs[0], bufs[1], bufs[2]].map(|p| Matrix::bf16(p, dd, dd));
            Ok(ops.linear(s, out, x, w)?)
        })?;
        let vendor = VendorGemm {
            out: bufs[0],
            x: bufs[1],
            w: bufs[2],
            m: dd,
            n: dd,
            k: dd,
            inputs: DType::Bf16,
        };
        let vendor_ms = match gpu.vendor_gemm(&vendor, s) {
            None => None,
            Some(first) => {
                first?;
                Some(vendor_ms(gpu.as_ref(), &vendor, opts.iters)?)
            }
        };
        let fp8 = match opts.quantization {
            Quantization::Fp8 => Some(fp8_rates(
                gpu,
                &ops,
                (bufs[0], bufs[1], bufs[2]),
                dd,
                opts.iters,
            )?),
            Quantization::AsStored => None,
        };
        Ok::<_, ModelError>((gemm_ms, vendor_ms, fp8))
    })();
    ops.set_linear_staging(None);
    gpu.free(staging)?;
    for b in bufs {
        gpu.free(b)?;
    }
    let (gemm_ms, vendor_ms, fp8) = measured?;
    Ok(Ceilings {
        copy_gb_s: copy,
        gemm_tflop_s: tflop_s(gemm_ms),
        vendor_gemm_tflop_s: vendor_ms.map(tflop_s),
        fp8: fp8.map(|(ours, vendor, refused)| Fp8Rates {
            ours_tflop_s: tflop_s(ours),
            vendor_tflop_s: vendor.map(tflop_s),
            vendor_refused: refused,
        }),
    })
}

/// The median time of the vendor library's GEMM `g`, ms (the backend has the library).
fn vendor_ms(gpu: &dyn GpuBackend, g: &VendorGemm, iters: usize) -> Result<f64, ModelError> {
    let s = gpu.default_stream();
    time_ms(gpu, s, iters, || {
        gpu.vendor_gemm(g, s).unwrap_or(Ok(()))?;
        Ok(())
    })
}

/// The FP8 GEMM times at `d`³, ms: our `linear` of the block-FP8 image of the weight `w` (x
/// bf16, the prefill's path: scratch for its dequantized image is given, and `ops` has staging
/// memory), and the vendor library's e4m3 GEMM of x's and w's e4m3 images, or why the library
/// refused it. `out` takes the products.
fn fp8_rates(
    gpu: &Arc<dyn GpuBackend>,
    ops: &Ops,
    (out, x, w): (DevicePtr, DevicePtr, DevicePtr),
    d: u32,
    iters: usize,
) -> Result<(f64, Option<f64>, Option<String>), ModelError> {
    let s = gpu.default_stream();
    let elems = d as usize * d as usize;
    let scale_bytes = ops_gemm::fp8_scale_bytes(d, d, FP8_BLOCK_ROW_SHIFT);
    let bufs: Vec<DevicePtr> = [elems, scale_bytes, elems, scale_bytes, 2 * elems]
        .into_iter()
        .map(|bytes| gpu.alloc(bytes))
        .collect::<Result<_, _>>()?;
    let fp8 = |q: DevicePtr, scales: DevicePtr| Matrix {
        scales: Some(BlockScales {
            ptr: scales,
            row_shift: FP8_BLOCK_ROW_SHIFT,
        }),
        ..Matrix::new(q, DType::F8E4M3, d, d)
    };
    let (wq, xq) = (fp8(bufs[0], bufs[1]), fp8(bufs[2], bufs[3]));
    ops.set_fp8_scratch(Some(Fp8Scratch {
        ptr: bufs[4],
        bytes: 2 * elems,
    }));
    let measured = (|| {
        ops.quantize_fp8(s, wq, Matrix::bf16(w, d, d))?;
        ops.quantize_fp8(s, xq, Matrix::bf16(x, d, d))?;
        let ours = time_ms(gpu.as_ref(), s, iters, || {
            Ok(ops.linear(s, Matrix::bf16(out, d, d), Matrix::bf16(x, d, d), wq)?)
        })?;
        let vendor = VendorGemm {
            out,
            x: xq.ptr,
            w: wq.ptr,
            m: d,
            n: d,
            k: d,
            inputs: DType::F8E4M3,
        };
        let (vendor, refused) = match gpu.vendor_gemm(&vendor, s) {
            None => (None, None),
            Some(Err(e)) => (None, Some(e.to_string())),
            Some(Ok(())) => (Some(vendor_ms(gpu.as_ref(), &vendor, iters)?), None),
        };
        Ok::<_, ModelError>((ours, vendor, refused))
    })();
    ops.set_fp8_scratch(None);
    for b in bufs {
        gpu.free(b)?;
    }
    measured
}
