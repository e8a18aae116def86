//! `BenchReport::table`: the run's figures as text, each beside its roofline (decode per forward
//! with its launches and the ratio to legacy, then the launch-by-launch profiles and the
//! kernel-by-kernel breakdowns).

use super::{BenchReport, StepPart};

impl BenchReport {
    /// The human-readable table: each figure beside its roofline.
    pub fn table(&self) -> String {
        let mut s = String::new();
        let vendor = self
            .vendor_gemm_tflop_s
            .map_or("no vendor GEMM".to_string(), |v| {
                format!("cuBLASLt bf16 GEMM {v:.1} TFLOP/s (the device ceiling)")
            });
        s += &format!(
            "backend {}: copy {:.0} GB/s, {vendor}, our linear {:.1} TFLOP/s, weights {:.2} GB\n",
            self.backend,
            self.copy_gb_s,
            self.gemm_tflop_s,
            self.weight_bytes / 1e9
        );
        if let Some(f) = &self.fp8_gemm {
            let vendor = match (f.vendor_tflop_s, &f.vendor_refused) {
                (Some(v), _) => format!("cuBLASLt FP8 GEMM {v:.1} TFLOP/s (the FP8 ceiling)"),
                (None, Some(why)) => format!("cuBLASLt FP8 GEMM refused ({why})"),
                (None, None) => "no vendor FP8 GEMM".to_string(),
            };
            s += &format!(
                "FP8: {vendor}, our linear of a block-FP8 weight {:.1} TFLOP/s\n",
                f.ours_tflop_s
            );
        }
        let tok_s = self.prefill_tokens as f64 / (self.prefill_ms * 1e-3);
        s += &format!(
            "prefill {} tokens: {:.2} ms ({:.0} tok/s); GEMM floor {:.2} ms; {:.0}% of the GEMM rate\n",
            self.prefill_tokens,
            self.prefill_ms,
            tok_s,
            self.prefill_floor_ms,
            100.0 * self.prefill_floor_ms / self.prefill_ms
        );
        s += "decode  forward            launches  batch   ms/step   floor ms   x floor   tok/s   vs legacy\n";
        for d in &self.decode {
            let legacy = self
                .decode
                .iter()
                .find(|l| l.forward == "legacy" && l.batch == d.batch)
                .map_or(String::new(), |l| format!("{:.3}x", d.ms / l.ms));
            s += &format!(
                "        {:<18} {:>8} {:>6} {:>9.3} {:>10.3} {:>9.2} {:>7.0}   {legacy}\n",
                d.forward,
                d.launches,
                d.batch,
                d.ms,
                d.floor_ms,
                d.ms / d.floor_ms,
                d.batch as f64 / (d.ms * 1e-3)
            );
        }
        if let Some(b) = &self.prefill_profile {
            s += &format!(
                "prefill of {} tokens, launch by launch (eager replay, µs per launch): sum {:.3} ms of the measured {:.3} ms\n",
                b.context,
                b.total_ms(),
                self.prefill_ms
            );
            s += &parts_table(&b.parts, b.total_ms());
        }
        for b in &self.profiles {
            s += &format!(
                "decode step at batch {} ctx {}, launch by launch (eager replay of the real step, µs per launch): sum {:.3} ms\n",
                b.batch,
                b.context,
                b.total_ms()
            );
            s += &parts_table(&b.parts, b.total_ms());
        }
        for b in &self.breakdowns {
            let step = self
                .decode
                .iter()
                .find(|d| d.batch == b.batch as usize && d.forward == "legacy")
                .map(|d| d.ms);
            s += &format!(
                "decode step at batch {} ctx {}, kernel by kernel (graph-replayed, µs per launch): sum {:.3} ms{}\n",
                b.batch,
                b.context,
                b.total_ms(),
                step.map_or(String::new(), |ms| format!(" of the measured {ms:.3} ms"))
            );
            s += &parts_table(&b.parts, step.unwrap_or(b.total_ms()));
        }
        s
    }
}

/// One line per part: its time per launch, launches, total and share of `of_ms`.
fn parts_table(parts: &[StepPart], of_ms: f64) -> String {
    let mut s = String::new();
    for p in parts {
        let ms = p.us * f64::from(p.per_step) / 1e3;
        s += &format!(
            "  {:<44} {:>9.2} us x {:>3} = {:>7.3} ms ({:>4.1}%)\n",
            p.name,
            p.us,
            p.per_step,
            ms,
            100.0 * ms / of_ms
        );
    }
    s
}
