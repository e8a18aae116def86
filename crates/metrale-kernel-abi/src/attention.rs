//! The attention kernels' geometry as pure functions of the shape, which `kernels/attention.cu`
//! computes on the device and the launchers (`metrale-model-layers::ops_attention`) and the CPU
//! twins compute on the host: padded head dimension, query heads per item, rows per prefill item
//! and dynamic shared memory.

use crate::consts::{
    APR_D, APR_ROWS, APR_STAGES, APR_TILE, ATP_FOLD, ATP_ROWS, ATP_WARPS, ATT_HB, ATT_QSLOTS,
    ATT_STAGES, ATT_UNIT, ATT_WARPS,
};

/// The head dimension padded to the tensor-core tile the kernels are instantiated for
/// (`att_padded_dim`).
pub const fn padded_dim(head_dim: u32) -> u32 {
    match head_dim {
        0..=32 => 32,
        33..=64 => 64,
        65..=128 => 128,
        _ => 256,
    }
}

/// Query heads of one item (`att_heads_per_block`): the largest divisor of the GQA group size
/// up to `ATT_HB`, or 1 when the heads do not group.
pub const fn heads_per_block(num_q_heads: u32, num_kv_heads: u32) -> u32 {
    if num_kv_heads == 0 || !num_q_heads.is_multiple_of(num_kv_heads) {
        return 1;
    }
    let group = num_q_heads / num_kv_heads;
    let mut b = ATT_HB;
    while b > 1 {
        if group.is_multiple_of(b) {
            return b;
        }
        b -= 1;
    }
    1
}

/// Dynamic shared memory of a decode attention block (`att_dyn_bytes`): every warp's ring of
/// `ATT_STAGES` units of 16 key and 16 value rows of `padded + 8` bf16 and its `ATT_QSLOTS`
/// query slots of `ATT_HB` rows, then f32 partials `[ATT_WARPS + partials][heads][padded]`
/// (`paged_attention`: 2 partials, by item parity; `paged_attention_flat`: one per split).
pub const fn decode_shared_bytes(padded: u32, heads_per_block: u32, partials: u32) -> u32 {
    ATT_WARPS * (ATT_STAGES * 2 * ATT_UNIT + ATT_QSLOTS * ATT_HB) * (padded + 8) * 2
        + (ATT_WARPS + partials) * heads_per_block * padded * 4
}

/// Virtual rows (row, head) of one prefill item (`atp_vrows`): four MMA tiles of 16 up to a
/// padded dimension of 128, two above.
pub const fn prefill_virtual_rows(padded: u32) -> u32 {
    if padded > 128 { 32 } else { 64 }
}

/// Stages of a prefill block's ring (`atp_stages`).
pub const fn prefill_stages(padded: u32) -> u32 {
    if padded > 128 { 2 } else { 3 }
}

/// Rows of one prefill item (`atp_rows_per_item`): as many as fill its virtual rows beside
/// `heads_per_block` heads each, at most `ATP_ROWS` (a 16-token unit).
pub const fn prefill_rows_per_item(heads_per_block: u32, padded: u32) -> u32 {
    let rows = prefill_virtual_rows(padded)
        / if heads_per_block == 0 {
            1
        } else {
            heads_per_block
        };
    if rows < ATP_ROWS { rows } else { ATP_ROWS }
}

/// Dynamic shared memory of a prefill attention block (`atp_shared_bytes`): the ring of units
/// (16 key and 16 value rows of `padded + 8` bf16 each), the item's queries
/// `[vrows][padded + 8]` bf16, and each thread's folded f32 numerators `[ATP_FOLD][threads]`.
pub const fn prefill_shared_bytes(padded: u32) -> u32 {
    let vrows = prefill_virtual_rows(padded);
    prefill_ring_bytes(padded) + vrows * (padded + 8) * 2 + ATP_FOLD * 32 * ATP_WARPS * 4
}

/// A prefill ring (`atp_ring_bytes`): `prefill_stages` units of 16 key and 16 value rows of
/// `padded + 8` bf16.
const fn prefill_ring_bytes(padded: u32) -> u32 {
    prefill_stages(padded) * 2 * ATT_UNIT * (padded + 8) * 2
}

/// Threads of a split prefill attention block (`ATPS_THREADS`): `ATT_WARPS` chain groups of
/// `ATP_WARPS` warps.
pub const PREFILL_SPLIT_THREADS: u32 = 32 * ATP_WARPS * ATT_WARPS;

/// Dynamic shared memory of a split prefill attention block (`atp_split_shared_bytes`): a ring
/// a chain group, then the queries and the folded numerators as in [`prefill_shared_bytes`].
pub const fn prefill_split_shared_bytes(padded: u32) -> u32 {
    prefill_shared_bytes(padded) + (ATT_WARPS - 1) * prefill_ring_bytes(padded)
}

/// Dynamic shared memory of a `paged_attention_prompt` block (`apr_shared_bytes`): 128 bytes of
/// alignment slack, the item's queries (128 virtual rows of `APR_D` bf16), a ring of `APR_STAGES`
/// tiles of keys and values, then the mbarriers (one full and one empty a stage, the queries'
/// one).
pub const fn prompt_shared_bytes() -> u32 {
    128 + PROMPT_VIRTUAL_ROWS * APR_D * 2
        + APR_STAGES * 2 * APR_TILE * APR_D * 2
        + (2 * APR_STAGES + 1) * 8
}

/// Virtual rows (a row's query head) of a `paged_attention_prompt` item (`APR_VROWS`): 64 for
/// each of its two computing warpgroups.
pub const PROMPT_VIRTUAL_ROWS: u32 = 128;

/// Rows of one `paged_attention_prompt` item: as many as fill its virtual rows beside
/// `heads_per_block` heads each, at most `APR_ROWS` (a tile of positions).
pub const fn prompt_rows_per_item(heads_per_block: u32) -> u32 {
    let rows = PROMPT_VIRTUAL_ROWS
        / if heads_per_block == 0 {
            1
        } else {
            heads_per_block
        };
    if rows < APR_ROWS { rows } else { APR_ROWS }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The sizes the kernels were laid out for: two decode blocks a multiprocessor up to head
    /// dimension 128, one above, two prefill blocks and one split prefill block.
    #[test]
    fn shared_memory_matches_the_kernels_budget() {
        assert_eq!(decode_shared_bytes(128, 4, 2), 99_328);
        assert_eq!(decode_shared_bytes(128, 4, 8), 111_616);
        assert_eq!(decode_shared_bytes(256, 4, 2), 193_536);
        assert_eq!(decode_shared_bytes(256, 4, 8), 218_112);
        assert_eq!(prefill_shared_bytes(128), 76_288);
        assert_eq!(prefill_shared_bytes(256), 83_456);
        // One split block a multiprocessor (at most 227 KiB).
        assert_eq!(prefill_split_shared_bytes(128), 154_624);
        assert_eq!(prefill_split_shared_bytes(256), 184_832);
        // One prompt block a multiprocessor.
        assert_eq!(prompt_shared_bytes(), 229_608);
        assert_eq!(
            [1, 2, 4, 5, 8].map(prompt_rows_per_item),
            [64, 64, 32, 25, 16]
        );
        assert_eq!([100, 64, 65, 256].map(padded_dim), [128, 64, 128, 256]);
        assert_eq!(heads_per_block(32, 8), 4);
        assert_eq!(heads_per_block(16, 1), 8);
        assert_eq!(heads_per_block(12, 1), 6);
        assert_eq!(heads_per_block(3, 2), 1);
        assert_eq!(prefill_rows_per_item(4, 128), 16);
        assert_eq!(prefill_rows_per_item(8, 256), 4);
    }
}
