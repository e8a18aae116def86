//! The gate's decisions on synthetic step times and checks.

use super::*;

#[test]
fn the_setters_set_their_field() {
    let o = GateOptions::default()
        .enabled(false)
        .margin_percent(9)
        .ema_steps(4)
        .probe_every(32)
        .probe_every_max(64)
        .probe_steps(2)
        .check_before_probe(false);
    let want = GateOptions {
        enabled: false,
        margin_percent: 9,
        ema_steps: 4,
        probe_every: 32,
        probe_every_max: 64,
        probe_steps: 2,
        check_before_probe: false,
    };
    assert_eq!(o, want);
}

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

/// Feed the gate steps of one sequence timed by `cost(speculating)` for `n` steps; returns
/// the modes run.
fn run(g: &mut SpeculationGate, n: usize, cost: impl Fn(bool) -> (usize, Duration)) -> Vec<bool> {
    run_at(g, 1, n, cost)
}

/// [`run`] with steps of `width` sequences, a drafter that cannot check answering checks.
fn run_at(
    g: &mut SpeculationGate,
    width: usize,
    n: usize,
    cost: impl Fn(bool) -> (usize, Duration),
) -> Vec<bool> {
    run_checked(g, width, n, cost, |_| None).0
}

/// [`run_at`] with checks answered by `check(step)`; also returns the steps that asked.
fn run_checked(
    g: &mut SpeculationGate,
    width: usize,
    n: usize,
    cost: impl Fn(bool) -> (usize, Duration),
    check: impl Fn(usize) -> Option<(usize, usize)>,
) -> (Vec<bool>, Vec<usize>) {
    let mut asked = Vec::new();
    let modes = (0..n)
        .map(|i| {
            let spec = g.speculating(width);
            let (tokens, t) = cost(spec);
            g.record(width, spec, tokens, t);
            if g.wants_check(width) {
                asked.push(i);
                g.checked(width, check(i));
            }
            spec
        })
        .collect();
    (modes, asked)
}

/// Probe starts (steps of the other mode after one of `from`'s).
fn starts(modes: &[bool], from: bool) -> Vec<usize> {
    (1..modes.len())
        .filter(|&i| modes[i] != from && modes[i - 1] == from)
        .collect()
}

#[test]
fn the_gate_probes_plain_decode_and_keeps_speculation_while_it_is_faster() {
    let mut g = SpeculationGate::new(GateOptions::default(), 3);
    // Speculation: 2 tokens in 12 ms; plain: 1 token in 10 ms.
    let modes = run(&mut g, 300, |s| if s { (2, ms(12)) } else { (1, ms(10)) });
    assert!(g.is_on(1) && g.switches() == 0);
    // It probed plain decode right after its first 8 steps, then after 256 steps of
    // speculation (the first probe confirmed it: the period doubled from 128), then after
    // 512, 1024 and 1024 more.
    assert!(modes[..8].iter().all(|&s| s) && modes[8..16].iter().all(|&s| !s));
    let probes: Vec<usize> = (1..modes.len())
        .filter(|&i| !modes[i] && modes[i - 1])
        .collect();
    assert_eq!(probes, [8, 16 + 256]);
    assert_eq!(modes.iter().filter(|&&s| !s).count(), 8 * 2);
    let modes = run(&mut g, 3000, |s| if s { (2, ms(12)) } else { (1, ms(10)) });
    let probes: Vec<usize> = (1..modes.len())
        .filter(|&i| !modes[i] && modes[i - 1])
        .collect();
    // 300 steps in: 20 steps into the period of 512 that began at step 280.
    let first = 512 - 20;
    assert_eq!(probes, [first, first + 8 + 1024, first + 2 * (8 + 1024)]);
}

#[test]
fn the_gate_turns_speculation_off_while_slower_and_on_again_past_the_margin() {
    let mut g = SpeculationGate::new(GateOptions::default(), 3);
    // Speculation slower: 1.2 tokens per 15 ms against 1 per 10 ms.
    run(&mut g, 40, |s| if s { (6, ms(75)) } else { (1, ms(10)) });
    assert!(!g.is_on(1), "{g:?}");
    assert_eq!(g.switches(), 1);
    // Speculation now 3% faster: inside the margin, the gate stays off (probing on).
    let modes = run(
        &mut g,
        600,
        |s| if s { (103, ms(1000)) } else { (1, ms(10)) },
    );
    assert!(!g.is_on(1), "{g:?}");
    assert_eq!(g.switches(), 1);
    // The switch (after step 16) started the probes' period over at 128; the probe at step
    // 144 confirmed the mode and doubled it.
    let probes: Vec<usize> = (0..modes.len())
        .filter(|&i| modes[i] && (i == 0 || !modes[i - 1]))
        .collect();
    assert_eq!(probes, [144 - 40, 144 + 8 + 256 - 40]);
    // 20% faster: the next probe's average crosses the margin and the gate turns on, within
    // the longest period between probes.
    let modes = run(
        &mut g,
        1100,
        |s| if s { (12, ms(100)) } else { (1, ms(10)) },
    );
    assert!(g.is_on(1), "{g:?}");
    assert_eq!(g.switches(), 2);
    assert!(modes.last() == Some(&true));
}

#[test]
fn each_batch_width_class_decides_on_its_own_steps() {
    let mut g = SpeculationGate::new(GateOptions::default(), 3);
    // Batch 1: speculation doubles the rate. Batches of 17 to 32: it halves it.
    let fast = |s: bool| if s { (2, ms(10)) } else { (1, ms(10)) };
    let slow = |s: bool| if s { (32, ms(40)) } else { (32, ms(20)) };
    for _ in 0..4 {
        run_at(&mut g, 1, 50, fast);
        run_at(&mut g, 24, 50, slow);
    }
    assert!(g.is_on(1) && !g.is_on(32) && !g.is_on(17), "{g:?}");
    assert_eq!(g.switches(), 1, "only the wide class switched");
    assert_eq!(g.last_class(), 32);
    // Classes not met yet speculate; a class's averages are its own.
    assert!(g.is_on(2) && g.speculating(3) && g.rates(2) == (None, None));
    let (plain, spec) = g.rates(1);
    assert!(spec.unwrap() > 1.5 * plain.unwrap());
    let (plain, spec) = g.rates(32);
    assert!(plain.unwrap() > 1.5 * spec.unwrap());
}

#[test]
fn a_disabled_gate_always_speculates() {
    let mut g = SpeculationGate::new(
        GateOptions {
            enabled: false,
            ..Default::default()
        },
        3,
    );
    let modes = run(&mut g, 50, |s| if s { (1, ms(100)) } else { (1, ms(1)) });
    assert!(modes.iter().all(|&s| s) && g.is_on(1) && g.rates(1) == (None, None));
}

/// Speculation slower (1.2 tokens per 15 ms against 1 per 10 ms), so the gate turns it off.
fn slower(s: bool) -> (usize, Duration) {
    if s { (6, ms(75)) } else { (1, ms(10)) }
}

#[test]
fn a_hopeless_acceptance_turns_speculation_off_whatever_the_step_times() {
    let mut g = SpeculationGate::new(GateOptions::default(), 3);
    // Speculation looks faster (2 tokens per 12 ms against 1 per 10 ms), but its verifies
    // kept no first draft: once 32 are checked the class turns off, and stays off.
    let faster = |s: bool| if s { (2, ms(12)) } else { (1, ms(10)) };
    let modes: Vec<bool> = (0..40)
        .map(|_| {
            let spec = g.speculating(1);
            if spec {
                g.record_first_drafts(1, 0);
            }
            let (tokens, t) = faster(spec);
            g.record(1, spec, tokens, t);
            spec
        })
        .collect();
    // 8 verify steps, the plain probe (slower: the class stays on), then verify steps up to
    // the 32nd check.
    assert!(modes[..8].iter().all(|&s| s) && !modes[8..16].iter().any(|&s| s));
    assert!(modes[16..40].iter().all(|&s| s));
    assert_eq!(modes.iter().filter(|&&s| s).count(), 32);
    assert!(!g.is_on(1) && g.switches() == 1 && g.hopeless(), "{g:?}");
}

#[test]
fn a_hopeless_acceptance_skips_the_probes_of_speculation() {
    let mut g = SpeculationGate::new(GateOptions::default(), 3);
    // 8 verify steps, then 8 plain: off. No first draft was kept in those verifies.
    g.record_first_drafts(8, 0);
    let (modes, _) = run_checked(&mut g, 1, 16, slower, |_| Some((64, 0)));
    assert!(!g.is_on(1) && g.switches() == 1, "{g:?}");
    assert!(modes[..8].iter().all(|&s| s));
    // From then on every probe of speculation is skipped at its check: the checks come 128,
    // 256, 512, 1024 and 1024 steps apart, and no step speculates.
    let (modes, asked) = run_checked(&mut g, 1, 3000, slower, |_| Some((64, 1)));
    assert!(modes.iter().all(|&s| !s), "{:?}", starts(&modes, false));
    assert_eq!(asked, [127, 127 + 256, 127 + 768, 127 + 1792, 127 + 2816]);
    assert!(g.acceptance().unwrap() < 0.02 && g.hopeless());
    // A class met while the acceptance is hopeless starts with speculation off. Its first
    // probe comes due after 8 steps and is skipped at its check; the next waits a period.
    assert!(!g.is_on(16) && !g.speculating(16));
    let (modes, asked) = run_checked(&mut g, 16, 300, slower, |_| Some((64, 0)));
    assert!(!g.is_on(16) && modes.iter().all(|&s| !s));
    assert_eq!(asked, [7, 7 + 256]);
}

#[test]
fn an_acceptance_worth_a_probe_starts_it_and_an_empty_check_waits() {
    let mut g = SpeculationGate::new(GateOptions::default(), 3);
    run_at(&mut g, 1, 16, slower);
    assert!(!g.is_on(1));
    // The first check scores nothing yet (the probe stays due), the next keeps 30 of 64
    // first drafts: the probe starts a step after that answer.
    let (modes, asked) = run_checked(&mut g, 1, 200, slower, |i| {
        if i == 127 {
            Some((0, 0))
        } else {
            Some((64, 30))
        }
    });
    assert_eq!(asked, [127, 128]);
    assert_eq!(starts(&modes, false), [129]);
    assert!(!g.hopeless() && (g.acceptance().unwrap() - 30.0 / 64.0).abs() < 1e-9);
    // Checks disabled: no acceptance is hopeless and a probe starts when due.
    let mut g = SpeculationGate::new(GateOptions::default().check_before_probe(false), 3);
    g.record_first_drafts(64, 0);
    let (modes, asked) = run_checked(&mut g, 1, 200, slower, |_| Some((64, 0)));
    assert!(asked.is_empty() && !g.hopeless());
    assert_eq!(starts(&modes, false), [16 + 128]);
}
