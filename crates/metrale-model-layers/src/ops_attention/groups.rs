//! The host side of `paged_attention_prefill`'s row groups: a step's rows cut into groups
//! (`attention_row_groups`), and which of them the split kernels take (`attention_prefill_plan`,
//! [`RowGroups`]).

use metrale_gpu_runtime::DevicePtr;
use metrale_kernel_abi::attention::{padded_dim, prefill_rows_per_item, prompt_rows_per_item};
use metrale_kernel_abi::{APR_TILE, ATT_UNIT};

use super::{ATTENTION_SPLITS, attention_heads_per_block};

/// The row groups of `paged_attention_prefill` for a step's rows, given as (sequence, position)
/// in row order: runs of consecutive rows of one sequence whose positions lie in one 16-token
/// unit (so their contexts split into the same units), at most the kernel's rows per item each;
/// flattened as (first row, rows) pairs.
pub fn attention_row_groups(
    rows: impl IntoIterator<Item = (u32, u32)>,
    num_q_heads: u32,
    num_kv_heads: u32,
    head_dim: u32,
) -> Vec<u32> {
    let rows = rows.into_iter().map(|(seq, pos)| (seq, pos, false));
    (row_groups_keyed(rows, num_q_heads, num_kv_heads, head_dim).into_iter())
        .flat_map(|(first, count, _)| [first, count])
        .collect()
}

/// [`attention_row_groups`] of rows given as (sequence, position, class): a group never holds
/// rows of two classes. Prompt rows (class true) are grouped for `paged_attention_prompt`:
/// positions in one `APR_TILE`-key tile, at most [`prompt_rows_per_item`] rows. Each group as
/// (first row, rows, class).
fn row_groups_keyed(
    rows: impl IntoIterator<Item = (u32, u32, bool)>,
    num_q_heads: u32,
    num_kv_heads: u32,
    head_dim: u32,
) -> Vec<(u32, u32, bool)> {
    let hb = attention_heads_per_block(num_q_heads, num_kv_heads);
    let most = |class: bool| match class {
        true => prompt_rows_per_item(hb),
        false => prefill_rows_per_item(hb, padded_dim(head_dim)),
    };
    let span = |class: bool| if class { APR_TILE } else { ATT_UNIT };
    let mut groups: Vec<(u32, u32, bool)> = Vec::new();
    let mut open: Option<(u32, u32, bool)> = None; // (sequence, span, class) of the last group
    for (r, (seq, pos, class)) in rows.into_iter().enumerate() {
        let key = (seq, pos / span(class), class);
        match groups.last_mut() {
            Some(last) if open == Some(key) && last.1 < most(class) => last.1 += 1,
            _ => {
                groups.push((r as u32, 1, class));
                open = Some(key);
            }
        }
    }
    groups
}

/// A step's row groups for its prefill attention, as uploaded: the prompt rows' groups first
/// (`prompt` of them, for `paged_attention_prompt`), then the other rows' groups as
/// [`attention_prefill_plan`] orders them, the last `split` of those through the split kernels.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StepPlan {
    /// (first row, rows) pairs.
    pub groups: Vec<u32>,
    /// The leading groups of prompt rows.
    pub prompt: u32,
    /// The trailing groups the split kernels take.
    pub split: u32,
}

/// The [`StepPlan`] of a step's rows, given as (sequence, position) in row order, row `r` a
/// prompt row where `prompt[r]` (rows past `prompt` are not): a group holds rows of one class,
/// the prompt rows' groups come first, in row order, and the other rows' groups follow as
/// [`attention_prefill_plan`] plans them over `blocks` resident blocks.
pub fn attention_step_plan(
    rows: &[(u32, u32)],
    prompt: &[bool],
    (num_q_heads, num_kv_heads, head_dim): (u32, u32, u32),
    blocks: u32,
) -> StepPlan {
    let keyed = (rows.iter().enumerate())
        .map(|(r, &(seq, pos))| (seq, pos, prompt.get(r).copied().unwrap_or(false)));
    let (mut groups, mut rest) = (Vec::new(), Vec::new());
    for (first, count, class) in row_groups_keyed(keyed, num_q_heads, num_kv_heads, head_dim) {
        match class {
            true => groups.extend([first, count]),
            false => rest.extend([first, count]),
        }
    }
    let n_prompt = (groups.len() / 2) as u32;
    let (planned, split) = plan_groups(rest, rows, (num_q_heads, num_kv_heads), blocks);
    groups.extend(planned);
    StepPlan {
        groups,
        prompt: n_prompt,
        split,
    }
}

/// A step's row groups of [`Ops::paged_attention_prefill`] as uploaded: `count` (first row,
/// rows) pairs at `at`, of which the last `split` run through the split kernels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RowGroups {
    /// u32 `[count, 2]`.
    pub at: DevicePtr,
    /// Groups.
    pub count: u32,
    /// The last groups, which the split kernels take.
    pub split: u32,
}

/// Units of walk time the split kernels' second launch costs (its start and its blocks'
/// query loads), and each split item's cluster combine, in the estimate of
/// [`attention_prefill_plan`].
const SPLIT_LAUNCH_UNITS: u64 = 8;
const SPLIT_ITEM_UNITS: u64 = 2;

/// A split block's unit against a walked one, in quarters, where every block is busy: a step of
/// 64 decode rows and 448 prompt rows at 16K keys took 1,474 us all split against 1,045 walked
/// at Qwen3-8B's heads, 1,788 against 1,458 at Qwen3.5-9B's, on an H100 (`kernel_bench mixed`).
const SPLIT_UNIT_QUARTERS: u64 = 6;

/// A step's row groups ([`attention_row_groups`] of its rows, given as (sequence, position))
/// ordered for [`Ops::paged_attention_prefill`], with how many of them, last, run through the
/// split kernels: the groups whose contexts are long enough that walking each of their items in
/// one block would leave most of the `blocks` resident blocks idle while they finish (a prefill
/// chunk's late rows beside a step's short decode rows). Each part keeps row order. The choice
/// weighs the launch times the walk and the split kernels would take (in units of 16 keys a
/// block walks: the longest item, or the step's units over the blocks, whichever is more; a
/// split item is an eighth as long) and splits only where that saves a tenth. It never changes
/// a row's result.
pub fn attention_prefill_plan(
    rows: &[(u32, u32)],
    num_q_heads: u32,
    num_kv_heads: u32,
    head_dim: u32,
    blocks: u32,
) -> (Vec<u32>, u32) {
    let groups = attention_row_groups(rows.iter().copied(), num_q_heads, num_kv_heads, head_dim);
    plan_groups(groups, rows, (num_q_heads, num_kv_heads), blocks)
}

/// [`attention_prefill_plan`] of row groups already cut (`groups`, rows indexing `rows`).
fn plan_groups(
    groups: Vec<u32>,
    rows: &[(u32, u32)],
    (num_q_heads, num_kv_heads): (u32, u32),
    blocks: u32,
) -> (Vec<u32>, u32) {
    // Each group's units: its rows' contexts span the same ones.
    let units: Vec<u64> = groups
        .chunks_exact(2)
        .map(|g| {
            let last = rows[(g[0] + g[1] - 1) as usize].1 as u64;
            (last + 1).div_ceil(u64::from(ATT_UNIT))
        })
        .collect();
    let items = (num_q_heads / attention_heads_per_block(num_q_heads, num_kv_heads)) as u64;
    let blocks = u64::from(blocks.max(ATTENTION_SPLITS));
    let splits = u64::from(ATTENTION_SPLITS);
    // Launch times: the walk over groups of `sum` units, the longest `max`; the split kernels
    // likewise.
    let walk = |max: u64, sum: u64| max.max((items * sum).div_ceil(blocks));
    let split = |max: u64, sum: u64, n: u64| {
        let per_item = SPLIT_ITEM_UNITS * splits;
        let busy = (SPLIT_UNIT_QUARTERS * items * (sum + n * per_item)).div_ceil(4 * blocks);
        (max.div_ceil(splits) + SPLIT_ITEM_UNITS).max(busy) + SPLIT_LAUNCH_UNITS
    };
    let mut order: Vec<usize> = (0..units.len()).collect();
    order.sort_by(|&a, &b| units[b].cmp(&units[a]));
    let total: u64 = units.iter().sum();
    let whole = walk(units.iter().copied().max().unwrap_or(0), total);
    // The best k: the k longest groups split, the rest walked. Only groups longer than a
    // block's share of the whole step are candidates: a shorter one never sets the walk's time.
    let share = (items * total).div_ceil(blocks);
    let candidates = order.iter().take_while(|&&g| units[g] > share).count();
    let (mut best, mut best_k) = (whole, 0usize);
    let mut long_sum = 0u64;
    for k in 1..=candidates {
        long_sum += units[order[k - 1]];
        let rest_max = order.get(k).map_or(0, |&g| units[g]);
        let cost = split(units[order[0]], long_sum, k as u64)
            + if k < order.len() {
                walk(rest_max, total - long_sum)
            } else {
                0
            };
        if cost < best {
            (best, best_k) = (cost, k);
        }
    }
    if best_k == 0 || 10 * best > 9 * whole {
        return (groups, 0);
    }
    let mut long = vec![false; units.len()];
    for &g in &order[..best_k] {
        long[g] = true;
    }
    let mut planned = Vec::with_capacity(groups.len());
    for want in [false, true] {
        for (g, pair) in groups.chunks_exact(2).enumerate() {
            if long[g] == want {
                planned.extend_from_slice(pair);
            }
        }
    }
    (planned, best_k as u32)
}

#[cfg(test)]
mod tests {
    use super::super::prefill::PREFILL_BLOCKS;
    use super::*;

    /// Rows of a decode row each for `seqs` sequences at `pos`, then a prefill chunk of
    /// `chunk` rows of one more sequence from `from`: (sequence, position) in row order.
    fn mixed(seqs: u32, pos: u32, chunk: u32, from: u32) -> Vec<(u32, u32)> {
        (0..seqs)
            .map(|s| (s, pos))
            .chain((from..from + chunk).map(|p| (seqs, p)))
            .collect()
    }

    /// A step's prompt rows go to groups of their own, first and in row order, each within one
    /// 64-key tile of positions and at most 32 rows at Qwen3-8B's heads; the other rows' groups
    /// follow as `attention_prefill_plan` plans them alone (a prompt's first generated positions
    /// beside its last prompt positions in one 16-token unit are two groups), and every row is in
    /// exactly one group.
    #[test]
    fn prompt_rows_get_groups_of_their_own_first() {
        // Sequence 0 recomputed after preemption: prompt of 20 tokens, 10 generated; sequence
        // 1 a fresh prompt chunk of 70 from position 0; two decode rows.
        let rows: Vec<(u32, u32)> = (0..30)
            .map(|p| (0, p))
            .chain((0..70).map(|p| (1, p)))
            .chain([(2, 500), (3, 90)])
            .collect();
        let prompt: Vec<bool> = (rows.iter())
            .map(|&(s, p)| (s == 0 && p < 20) || s == 1)
            .collect();
        let plan = attention_step_plan(&rows, &prompt, (32, 8, 128), PREFILL_BLOCKS);
        let pairs: Vec<(u32, u32)> = plan.groups.chunks(2).map(|g| (g[0], g[1])).collect();
        let (head, tail) = pairs.split_at(plan.prompt as usize);
        assert_eq!(head, &[(0, 20), (30, 32), (62, 32), (94, 6)]);
        let mut other = tail.to_vec();
        other.sort_unstable();
        assert_eq!(other, [(20, 10), (100, 1), (101, 1)]);
        assert!(plan.split as usize <= tail.len());
        let mut seen = vec![0u32; rows.len()];
        for &(first, count) in &pairs {
            let class = prompt[first as usize];
            for r in first..first + count {
                seen[r as usize] += 1;
                assert_eq!(
                    prompt[r as usize], class,
                    "group ({first}, {count}) mixes classes"
                );
            }
        }
        assert!(seen.iter().all(|&n| n == 1));
        // No prompt rows: attention_prefill_plan's groups.
        let none = attention_step_plan(&rows, &[], (32, 8, 128), PREFILL_BLOCKS);
        let want = attention_prefill_plan(&rows, 32, 8, 128, PREFILL_BLOCKS);
        assert_eq!((none.groups, none.split, none.prompt), (want.0, want.1, 0));
    }

    /// A step whose few long row groups would hold the walk long after its other blocks are
    /// done gives them to the split kernels, last and in row order: a chunk's late rows beside
    /// 64 short decode rows, and a lone decode row at a long context among them; whole prefill
    /// chunks, short contexts and the same rows at a context past the walk's balance do not.
    /// Every group is kept, once.
    #[test]
    fn the_split_kernels_take_few_long_row_groups() {
        let plan = |rows: &[(u32, u32)]| attention_prefill_plan(rows, 32, 8, 128, PREFILL_BLOCKS);
        let pairs = |g: &[u32]| -> Vec<(u32, u32)> { g.chunks(2).map(|p| (p[0], p[1])).collect() };

        // 64 decode rows at 400, 20 chunk rows at 16,000 (two groups): those two split.
        let rows = mixed(64, 400, 20, 16_000);
        let (groups, split) = plan(&rows);
        let want = attention_row_groups(rows.iter().copied(), 32, 8, 128);
        assert_eq!(split, 2);
        assert_eq!(
            pairs(&groups[..groups.len() - 4]),
            pairs(&want[..want.len() - 4])
        );
        assert_eq!(pairs(&groups[groups.len() - 4..]), vec![(64, 16), (80, 4)]);

        // A decode row at 16,000 among them: it splits too, after the walked groups.
        let mut rows = mixed(64, 400, 20, 1_000);
        rows[5].1 = 16_000;
        let (groups, split) = plan(&rows);
        assert_eq!(split, 1);
        assert_eq!(pairs(&groups[groups.len() - 2..]), vec![(5, 1)]);
        let mut all = pairs(&groups);
        all.sort();
        let mut want = pairs(&attention_row_groups(rows.iter().copied(), 32, 8, 128));
        want.sort();
        assert_eq!(all, want);

        // A prefill chunk of 512 or 2,048 rows at 16,000, alone: every block already has a long
        // item; short contexts: nothing to gain.
        for chunk in [512, 2048] {
            assert_eq!(plan(&mixed(0, 0, chunk, 16_000)).1, 0, "{chunk} rows");
        }
        assert_eq!(plan(&mixed(64, 400, 20, 300)).1, 0);
        assert_eq!(plan(&mixed(64, 400, 448, 16_000)).1, 0);
        // Qwen3.5-9B's heads (8 rows a group at head_dim 256): 16 or 64 late rows split, 448
        // do not (all split took 1,788 us against 1,458 walked on an H100).
        let plan256 =
            |rows: &[(u32, u32)]| attention_prefill_plan(rows, 16, 4, 256, PREFILL_BLOCKS).1;
        assert_eq!(plan256(&mixed(64, 400, 16, 16_384)), 2);
        assert_eq!(plan256(&mixed(64, 400, 64, 16_384)), 8);
        assert_eq!(plan256(&mixed(64, 400, 448, 16_384)), 0);
    }
}
