//! Mixed steps (`ModelOptions::mixed_steps`): while a long prompt prefills, every decoding
//! sequence gets a token in every step (each step holds their decode rows and a chunk of the
//! prompt sized to the token budget they leave), and that changes no bit: the prompt's
//! choices and the decoding sequences (greedy, sampled, with penalties and logprobs) get the
//! tokens and logits of their solo runs and of the same traffic with mixing off, preempted or
//! not. On the dense, hybrid (Gated DeltaNet) and MoE fixtures, on the CPU backend (and, built
//! with `--features cuda`, on the CUDA backend too). A budget of attention work per mixed
//! chunk (`mixed_chunk_attention`) cuts the chunks late in the prompt shorter, a mixed step's
//! token budget (`mixed_step_tokens`) every chunk, pacing to a step time
//! (`mixed_step_slowdown_pct`) sizes the chunks from the steps' measured times, and none
//! changes a bit.

#![allow(clippy::unwrap_used)]

mod support;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use metrale_gpu_runtime::{CpuBackend, GpuBackend};
use metrale_model_engine::generate::Generation;
use metrale_model_engine::runner::Fusions;
use metrale_model_engine::sampling::SamplingParams;
use metrale_model_engine::scheduler::{SchedulerStats, SeqEvent, SeqId, SeqRequest, StepKind};
use metrale_model_engine::{
    ForwardSelect, KvCacheDtype, ModelCircuit, ModelError, ModelOptions, Scheduler, factory,
};
use metrale_testkit::Rng;
use support::{StepClock, logit_bits, params, request};

/// Where the model runs.
type Backend = fn() -> Arc<dyn GpuBackend>;

fn cpu() -> Arc<dyn GpuBackend> {
    Arc::new(CpuBackend::default())
}

/// Dense, hybrid with a dense FFN, hybrid with MoE FFNs (Qwen3-Next and Qwen3.5-MoE).
const FIXTURES: [&str; 4] = [
    "qwen3-tiny",
    "qwen3_5-tiny",
    "qwen3_next-tiny",
    "qwen3_5_moe-tiny",
];
/// The token budget: past the GDN chunk (64) by more than the decode rows, so hybrid prompts
/// mix too, and below the alternating chunk the budget cuts at 128, so mixed chunks are cut
/// where the alternating run does not cut.
const BUDGET: usize = 130;
const LONG_PROMPT: usize = 300;

fn load_on(backend: Backend, name: &str, options: ModelOptions) -> Scheduler {
    let model =
        factory::load(&support::fixture(name), backend()).unwrap_or_else(|e| panic!("{name}: {e}"));
    Scheduler::new(model, options).unwrap()
}

fn options(mixed: bool) -> ModelOptions {
    ModelOptions::default()
        .max_batch_tokens(BUDGET)
        .max_decode_seqs(8)
        .mixed_steps(mixed)
}

/// Short prompts that decode long (greedy; sampled; top-k and top-p; penalties with logprobs;
/// greedy with a stop token), then a long prompt of two sampled choices, which fork after its
/// last chunk.
fn traffic(vocab: u32, seed: u64) -> (Vec<SeqRequest>, SeqRequest) {
    let mut rng = Rng::new(seed);
    let mut prompt = |n: usize| -> Vec<u32> { (0..n).map(|_| rng.below(vocab)).collect() };
    let samplings = [
        SamplingParams::default(),
        SamplingParams::default().temperature(0.9).seed(7),
        SamplingParams::default()
            .temperature(1.2)
            .top_k(20)
            .top_p(0.9)
            .seed(8),
        SamplingParams::default()
            .temperature(1.0)
            .repetition_penalty(1.3)
            .frequency_penalty(0.5)
            .logprobs(true)
            .top_logprobs(3)
            .seed(9),
        SamplingParams::default(),
    ];
    let decoders = (samplings.into_iter().enumerate())
        .map(|(i, sampling)| {
            let mut p = params(20 + 3 * i, sampling);
            if i == 4 {
                p.stop_token_ids = vec![3];
            }
            request(&prompt(3 + 4 * i), &p)
        })
        .collect();
    let long = params(6, SamplingParams::default().temperature(0.8).seed(11).n(2));
    (decoders, request(&prompt(LONG_PROMPT), &long))
}

/// What a run of the traffic saw.
struct Run {
    /// Every generation by id (the long prompt's two choices are `long` and `long + 1`).
    gens: HashMap<SeqId, Generation>,
    decoders: Vec<SeqId>,
    long: SeqId,
    /// The steps from the long prompt's arrival to its first token.
    window: Vec<StepKind>,
    /// Steps of the window in which a decoding sequence, not finished, got no token.
    missed: usize,
    stats: SchedulerStats,
}

impl Run {
    /// Every request's generation ids in order: the decoders', then the long prompt's two
    /// choices.
    fn ids(&self) -> Vec<SeqId> {
        [&self.decoders[..], &[self.long, SeqId(self.long.0 + 1)]].concat()
    }
}

/// The sequences that got a token in `events`; finished generations go into `gens`.
fn collect(events: Vec<SeqEvent>, gens: &mut HashMap<SeqId, Generation>) -> Vec<SeqId> {
    let mut got = Vec::new();
    for e in events {
        match e {
            SeqEvent::Token { id, .. } => got.push(id),
            SeqEvent::Finished { id, generation } => {
                assert!(gens.insert(id, generation).is_none(), "{id} finished twice");
            }
        }
    }
    got
}

/// Run the decoders until each has a token, then add the long prompt and run to the end.
fn run(s: &mut Scheduler, traffic: &(Vec<SeqRequest>, SeqRequest)) -> Run {
    run_watched(s, traffic, |_| {})
}

/// [`run`], calling `before` with the window's steps so far before each step of the window.
fn run_watched(
    s: &mut Scheduler,
    (decoders, long): &(Vec<SeqRequest>, SeqRequest),
    mut before: impl FnMut(&[StepKind]),
) -> Run {
    let mut gens = HashMap::new();
    let ids: Vec<SeqId> = decoders.iter().map(|r| s.add(r.clone()).unwrap()).collect();
    let mut started: Vec<SeqId> = Vec::new();
    while !ids.iter().all(|id| started.contains(id)) {
        started.extend(collect(s.step().unwrap().events, &mut gens));
        assert!(started.len() < 1000, "the decoders do not start");
    }
    let long_id = s.add(long.clone()).unwrap();
    let (mut window, mut missed) = (Vec::new(), 0);
    loop {
        before(&window);
        let report = s.step().unwrap();
        window.push(report.kind);
        let got = collect(report.events, &mut gens);
        // A decoder finishing in this step got its last token in it.
        let live = ids
            .iter()
            .filter(|id| !gens.contains_key(id) || got.contains(id));
        if live.clone().any(|id| !got.contains(id)) {
            missed += 1;
        }
        if got.contains(&long_id) {
            break;
        }
        assert!(window.len() < 1000, "the long prompt never gets a token");
    }
    while !s.is_idle() {
        collect(s.step().unwrap().events, &mut gens);
    }
    Run {
        gens,
        decoders: ids,
        long: long_id,
        window,
        missed,
        stats: s.stats(),
    }
}

/// The generations of `a` and `b` are bitwise the same, request by request (`what` names the
/// comparison).
fn assert_bitwise(a: &Run, b: &HashMap<SeqId, Generation>, ids: &[SeqId], what: &str) {
    for (&x, &y) in a.ids().iter().zip(ids) {
        let (g, h) = (&a.gens[&x], &b[&y]);
        assert_eq!(g.token_ids, h.token_ids, "{what}: {x} tokens");
        assert_eq!(g.finish_reason, h.finish_reason, "{what}: {x}");
        assert!(logit_bits(g) == logit_bits(h), "{what}: {x} logits differ");
        let lp = |g: &Generation| {
            (g.logprobs.iter().flatten())
                .map(|t| (t.token, t.logprob.to_bits(), t.top.len()))
                .collect::<Vec<_>>()
        };
        assert_eq!(lp(g), lp(h), "{what}: {x} logprobs");
    }
}

/// The request alone on an idle scheduler; its generations (one per choice) by choice.
fn solo(s: &mut Scheduler, req: &SeqRequest) -> Vec<Generation> {
    let id = s.add(req.clone()).unwrap();
    let mut gens = HashMap::new();
    while !s.is_idle() {
        collect(s.step().unwrap().events, &mut gens);
    }
    let n = req.params.sampling.choices_generated().max(1) as u64;
    (0..n)
        .map(|c| gens.remove(&SeqId(id.0 + c)).unwrap())
        .collect()
}

/// Every request of `t` alone on `s`, in order (the decoders, then the long prompt): their
/// generations under ids 1000 + 10 k + choice, and those ids in order.
fn solo_all(
    s: &mut Scheduler,
    t: &(Vec<SeqRequest>, SeqRequest),
) -> (HashMap<SeqId, Generation>, Vec<SeqId>) {
    let mut alone = HashMap::new();
    let mut ids = Vec::new();
    for (k, req) in t.0.iter().chain([&t.1]).enumerate() {
        for (c, g) in solo(s, req).into_iter().enumerate() {
            let id = SeqId((1000 + 10 * k + c) as u64);
            alone.insert(id, g);
            ids.push(id);
        }
    }
    (alone, ids)
}

/// Traffic for a cache of 28 blocks of 16 (see `preemption_beside_mixed_steps_is_bitwise_solo`):
/// three short decoders of 30, 70 and 70 tokens, and the long prompt answering 40.
fn preempting_traffic(vocab: u32) -> (Vec<SeqRequest>, SeqRequest) {
    let (decoders, mut long) = traffic(vocab, 9);
    let decoders: Vec<SeqRequest> = (decoders.into_iter().take(3).enumerate())
        .map(|(i, mut d)| {
            d.prompt = (0..12 + i as u32).map(|t| (t * 13 + 5) % vocab).collect();
            d.params.max_new_tokens = [30, 70, 70][i];
            d
        })
        .collect();
    long.params.max_new_tokens = 40;
    (decoders, long)
}

fn a_long_prompt_never_stalls_the_decoding_sequences(backend: Backend, name: &str) {
    let mut on = load_on(backend, name, options(true));
    let vocab = on.runner().model().config().tokens.vocab_size as u32;
    let t = traffic(vocab, 5);
    let mixed = run(&mut on, &t);
    // Every step from the long prompt's arrival to its first token held every decoding
    // sequence's row and a chunk of the prompt, within the budget.
    assert_eq!(mixed.missed, 0, "{name}: a decoding sequence missed a step");
    let mut prefilled = 0;
    for kind in &mixed.window {
        match *kind {
            StepKind::Mixed {
                seqs, seq, rows, ..
            } => {
                assert!(seq == mixed.long && seqs >= 1, "{name}: {kind:?}");
                assert!(seqs + rows <= BUDGET, "{name}: {kind:?} is over the budget");
                prefilled += rows;
            }
            _ => panic!("{name}: {kind:?} while the long prompt prefills"),
        }
    }
    assert_eq!(prefilled, LONG_PROMPT, "{name}");
    assert!(mixed.stats.steps.mixed_steps >= mixed.window.len() as u64);
    // Mixing off: the same bits, in alternating steps where the decoders miss some.
    let mut off = load_on(backend, name, options(false));
    let alternating = run(&mut off, &t);
    assert_eq!(alternating.stats.steps.mixed_steps, 0, "{name}");
    assert!(
        alternating.missed > 0,
        "{name}: the alternation never stalls"
    );
    assert_bitwise(
        &mixed,
        &alternating.gens,
        &alternating.ids(),
        &format!("{name}: on vs off"),
    );
    // Each request alone.
    let (alone, solo_ids) = solo_all(&mut on, &t);
    assert_bitwise(&mixed, &alone, &solo_ids, &format!("{name}: mixed vs solo"));
    let cache = on.stats().cache;
    assert_eq!(
        (cache.kv_blocks_used, cache.ssm_slots_used),
        (0, 0),
        "{name}"
    );
}

/// A cache too small for everyone: once the long prompt is admitted (taking all but a block of
/// headroom per sequence), the decoders' growth preempts it (the most recently admitted), and
/// it resumes by recompute; every request still gets its solo run bitwise, with the KV cache
/// in `kv` (an FP8 recompute stores the e4m3 bytes the first run stored).
fn preemption_beside_mixed_steps_is_bitwise_solo(backend: Backend, name: &str, kv: KvCacheDtype) {
    // 27 usable blocks of 16: the decoders' first blocks, the long prompt's 19 plus a block
    // for each choice to fork, and a block of headroom each; the decoders' second blocks
    // preempt the long one.
    let opts = options(true).num_kv_blocks(Some(28)).kv_cache_dtype(kv);
    let mut s = load_on(backend, name, opts);
    let got = preempted_vs_solo(&mut s, None, &format!("{name}, {kv:?} KV"));
    assert!(got.stats.steps.mixed_steps > 0, "{name}: no mixed step");
}

/// `preempting_traffic` on `tight` (a cache of 28 blocks): it preempts, and every request is
/// bitwise its run alone on `solo` (`tight` itself where `None`). The run on `tight`.
fn preempted_vs_solo(tight: &mut Scheduler, solo: Option<&mut Scheduler>, what: &str) -> Run {
    let t = preempting_traffic(tight.runner().model().config().tokens.vocab_size as u32);
    let got = run(tight, &t);
    assert!(got.stats.steps.preemptions > 0, "{what}: no preemption");
    let (alone, solo_ids) = solo_all(solo.unwrap_or(tight), &t);
    assert_bitwise(
        &got,
        &alone,
        &solo_ids,
        &format!("{what}: preempted vs solo"),
    );
    got
}

#[test]
fn a_long_prompt_never_stalls_decoding_sequences_and_changes_no_bit() {
    for name in FIXTURES {
        a_long_prompt_never_stalls_the_decoding_sequences(cpu, name);
    }
}

#[test]
fn preemption_beside_mixed_steps_is_bitwise_solo_on_every_family() {
    for name in FIXTURES {
        for kv in [KvCacheDtype::Bf16, KvCacheDtype::Fp8] {
            preemption_beside_mixed_steps_is_bitwise_solo(cpu, name, kv);
        }
    }
}

/// Query-row by key pairs one mixed chunk may read in `mixed_step_budgets_...`: the whole
/// step budget's rows early in the long prompt, about 50 rows from position 128, 37 from 200.
const ATTENTION: usize = 8000;
/// The token budget of a mixed step there (below `BUDGET`, above the attention budget's rows
/// late in the prompt).
const MIXED_STEP: usize = 72;

/// Under the circuit forward's fused programs (every fusion byte-identical to the legacy
/// launches) a long prompt still shares each step with the decoding sequences, and every
/// request gets the bits of the legacy forward's run.
#[test]
fn fused_circuit_decode_steps_still_mix_and_change_no_bit() {
    for name in ["qwen3-tiny", "qwen3_5-tiny"] {
        let mut legacy = load_on(cpu, name, options(true));
        let vocab = legacy.runner().model().config().tokens.vocab_size as u32;
        let t = traffic(vocab, 5);
        let want = run(&mut legacy, &t);
        let mut fused = load_on(cpu, name, options(true));
        let all = Fusions::All;
        fused
            .runner_mut()
            .set_forward(ForwardSelect::Circuit { fusions: all })
            .unwrap();
        let got = run(&mut fused, &t);
        assert_eq!(got.missed, 0, "{name}: a decoding sequence missed a step");
        assert!(
            (got.window.iter()).all(|k| matches!(k, StepKind::Mixed { .. })),
            "{name}: {:?}",
            got.window
        );
        assert_bitwise(
            &got,
            &want.gens,
            &want.ids(),
            &format!("{name}: fused vs legacy"),
        );
    }
}

/// `ModelOptions::prompt_attention` on a dense shape of head_dim 128 (random weights): prompt
/// rows attend through `paged_attention_prompt`, generated rows in the decode arithmetic. A long
/// prompt still shares every step with the decoding sequences, and every request gets the bits
/// of its solo run, with the cache large enough and with one so small that the long prompt is
/// preempted and recomputed (its prompt rows in the prompt arithmetic, its generated rows in the
/// decode one). The prompt arithmetic is not the decode one: without the option the same
/// traffic gives other logits.
#[test]
fn prompt_rows_in_their_own_arithmetic_keep_every_request_bitwise_solo() {
    prompt_rows_bitwise_solo(cpu);
}

fn prompt_rows_bitwise_solo(backend: Backend) {
    let [config, _] = metrale_model_engine::bench::decode_staging_shapes_for_cpu().unwrap();
    let load = |options: ModelOptions| {
        let model = factory::random(config.clone(), backend(), 7).unwrap();
        Scheduler::new(model, options).unwrap()
    };
    let mut on = load(options(true).prompt_attention(true));
    assert!(on.runner().prompt_attention());
    let t = traffic(config.tokens.vocab_size as u32, 5);
    let mixed = run(&mut on, &t);
    assert_eq!(mixed.missed, 0, "a decoding sequence missed a step");
    assert!(mixed.stats.steps.mixed_steps > 0);
    let (alone, solo_ids) = solo_all(&mut on, &t);
    assert_bitwise(&mixed, &alone, &solo_ids, "prompt attention: mixed vs solo");
    // A cache too small for everyone: the long prompt is preempted and recomputed.
    let mut tight = load(options(true).prompt_attention(true).num_kv_blocks(Some(28)));
    preempted_vs_solo(&mut tight, Some(&mut on), "prompt attention");
    // Without the option: other bits for the long prompt's first token.
    let mut off = load(options(true));
    assert!(!off.runner().prompt_attention());
    let plain = run(&mut off, &t);
    let first = |r: &Run| logit_bits(&r.gens[&r.long])[0].clone();
    assert!(
        first(&mixed) != first(&plain),
        "the prompt rows kept the decode arithmetic"
    );
}

#[test]
fn mixed_step_budgets_cut_chunks_shorter_and_change_no_bit() {
    for name in ["qwen3-tiny", "qwen3_5-tiny"] {
        let budgeted = (options(true).mixed_chunk_attention(Some(ATTENTION)))
            .mixed_step_tokens(Some(MIXED_STEP));
        let mut on = load_on(cpu, name, budgeted);
        let vocab = on.runner().model().config().tokens.vocab_size as u32;
        let t = traffic(vocab, 5);
        let got = run(&mut on, &t);
        assert_eq!(got.missed, 0, "{name}: a decoding sequence missed a step");
        let interval = on.runner().ssm_snapshot_interval();
        let mut start = 0;
        for kind in &got.window {
            let StepKind::Mixed { rows, seqs, .. } = *kind else {
                panic!("{name}: {kind:?} while the long prompt prefills");
            };
            let keys = rows * start + rows * (rows + 1) / 2;
            // Within both budgets; on the hybrid model a piece may run on to the next allowed
            // cut, never past the next multiple of the snapshot interval.
            let next = interval.map(|i| (start / i + 1) * i);
            let cut_late = rows == 1 || next.is_some_and(|n| start + rows <= n);
            assert!(
                keys <= ATTENTION || cut_late,
                "{name}: {rows} rows from {start} read {keys} keys"
            );
            assert!(
                seqs + rows <= MIXED_STEP || cut_late,
                "{name}: {seqs} decode rows and {rows} prompt rows from {start}"
            );
            start += rows;
        }
        assert_eq!(start, LONG_PROMPT, "{name}");
        // Without the budget the dense prompt takes fewer, longer chunks (the hybrid one's
        // are whole snapshot intervals either way); the bits are the same.
        let mut free = load_on(cpu, name, options(true));
        let unbudgeted = run(&mut free, &t);
        assert!(
            interval.is_some() || unbudgeted.window.len() < got.window.len(),
            "{name}: {} steps with the budget, {} without",
            got.window.len(),
            unbudgeted.window.len()
        );
        assert_bitwise(
            &got,
            &unbudgeted.gens,
            &unbudgeted.ids(),
            &format!("{name}: budget vs none"),
        );
    }
}

#[test]
fn paced_mixed_steps_size_their_chunks_from_step_times_and_change_no_bit() {
    let name = "qwen3-tiny";
    let mut paced = load_on(cpu, name, options(true).mixed_step_slowdown_pct(Some(150)));
    let clock = StepClock::default();
    clock.set_step_cost(Duration::from_millis(10));
    paced.set_mixed_step_clock(Box::new(clock.clone()));
    let vocab = paced.runner().model().config().tokens.vocab_size as u32;
    let t = traffic(vocab, 5);
    // Steps cost 10 ms until two mixed steps ran, then 30 ms (mixed steps three times a plain
    // one, where 1.5 times is allowed) for three, then 10 ms again.
    let got = run_watched(&mut paced, &t, |window| {
        let mixed = (window.iter())
            .filter(|k| matches!(k, StepKind::Mixed { .. }))
            .count();
        clock.set_step_cost(Duration::from_millis(if (2..5).contains(&mixed) {
            30
        } else {
            10
        }));
    });
    assert_eq!(got.missed, 0, "a decoding sequence missed a step");
    let mixed: Vec<(usize, usize)> = (got.window.iter())
        .filter_map(|k| match *k {
            StepKind::Mixed { seqs, rows, .. } => Some((seqs, rows)),
            _ => None,
        })
        .collect();
    // Each chunk from the last one's step time: doubling while a mixed step costs what a plain
    // one does (up to what the token budget leaves); a quarter (at least one row) after one at
    // three times a plain step, four times the allowed extra. The prompt's end may cut one.
    // (The first chunk carries on from the mixed steps of the decoders' own prompts.)
    let mut end = 0;
    for (i, w) in mixed.windows(2).enumerate() {
        let ((_, last), (seqs, rows)) = (w[0], w[1]);
        let want = if (2..5).contains(&i) {
            (last / 4).max(1)
        } else {
            (2 * last).min(BUDGET - seqs)
        };
        end += last;
        assert!(
            rows == want || (rows < want && end + rows == LONG_PROMPT),
            "mixed step {}: {rows} rows after {last}, not {want}: {:?}",
            i + 1,
            got.window
        );
    }
    assert!(mixed[4].1 < mixed[2].1 / 8, "{:?}", got.window);
    // The first steps of the window may run plain (timing the decode width), never a chunk
    // alone.
    assert!(
        (got.window.iter()).all(|k| matches!(k, StepKind::Mixed { .. } | StepKind::Decode { .. })),
        "{:?}",
        got.window
    );
    let mut free = load_on(cpu, name, options(true));
    let unpaced = run(&mut free, &t);
    assert_bitwise(
        &got,
        &unpaced.gens,
        &unpaced.ids(),
        &format!("{name}: paced vs not"),
    );
    // A mixed step cannot aim below a plain step's time: refused at load, naming the option.
    let model = factory::load(&support::fixture(name), cpu()).unwrap();
    let err = Scheduler::new(model, options(true).mixed_step_slowdown_pct(Some(100))).unwrap_err();
    assert!(
        matches!(
            err,
            ModelError::Options {
                option: "mixed_step_slowdown_pct",
                ..
            }
        ),
        "{err}"
    );
}

/// The same on the GPU: the CUDA kernels' rows must not depend on their step either.
#[cfg(feature = "cuda")]
mod cuda {
    use super::*;
    use metrale_gpu_runtime::cuda::CudaBackend;

    fn gpu() -> Arc<dyn GpuBackend> {
        Arc::new(CudaBackend::new(0).expect("a CUDA device"))
    }

    #[test]
    fn a_long_prompt_never_stalls_decoding_sequences_and_changes_no_bit_on_cuda() {
        for name in FIXTURES {
            a_long_prompt_never_stalls_the_decoding_sequences(gpu, name);
        }
    }

    #[test]
    fn prompt_rows_in_their_own_arithmetic_keep_every_request_bitwise_solo_on_cuda() {
        prompt_rows_bitwise_solo(gpu);
    }

    #[test]
    fn preemption_beside_mixed_steps_is_bitwise_solo_on_cuda() {
        for name in FIXTURES {
            for kv in [KvCacheDtype::Bf16, KvCacheDtype::Fp8] {
                preemption_beside_mixed_steps_is_bitwise_solo(gpu, name, kv);
            }
        }
    }
}
