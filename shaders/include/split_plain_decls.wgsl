// Module-scope declarations of the plain (f32, f16, bf16) split kernels
// (attention_split.wgsl): bindings, constants and
// workgroup memory; the slab and its reads come from kv_{SLAB}_{KV}.wgsl (SLAB: vec4
// for attention_split.wgsl, wide for attention_split_wide.wgsl).
@group(0) @binding(0) var<storage, read> q_batch: array<f32>;
// #include "kv_{SLAB}_{KV}.wgsl"
@group(0) @binding(3) var<storage, read_write> partial: array<f32>;
// #struct SplitParams
@group(0) @binding(4) var<storage, read> params: array<SplitParams>;   // one block per query row (wid.z)
@group(0) @binding(5) var<storage, read> pages: array<u32>;
// #include "paging.wgsl"

const WG: u32 = 256u;
const MAX_GROUP: u32 = 8u;
const MAX_SCORES: u32 = 4096u;       // G * split_len (kernels.PLAIN_MAX_SCORES); reused for the row-group sums
const NEG_INF: f32 = -3.402823e+38;
const FLAG_NON_CAUSAL: u32 = 1u;

// Not specialized per pipeline (unlike the TurboQuant split kernels): with
// GROUP and HEAD_DIM override constants the 32k decode step measured 15-20%
// slower on the H200 (docs/benchmarks.md).

var<workgroup> q_sh: array<vec4<f32>, 256>;      // MAX_GROUP * head_dim/4
var<workgroup> scores: array<f32, MAX_SCORES>;   // [G][split_len]
var<workgroup> red: array<f32, WG>;
var<workgroup> stat: array<f32, MAX_GROUP>;      // per-head split max

// The split's page table entries (split_len / P of them at most: MAX_SCORES / 16).
var<workgroup> pg_sh: array<u32, 256>;

// Slab row of timestep t (absolute) of this split, from pg_sh (page0: its first page).
fn split_row(page0: u32, shift: u32, t: u32) -> u32 {
    return (pg_sh[(t >> shift) - page0] << shift) | (t & ((1u << shift) - 1u));
}

// Key t's scores against the group's heads 0..3 (sa) and 4..7 (sb), into `scores`
// ([G][split_len]): the score phase's last step, in both plain split kernels.
fn store_scores(t: u32, split_len: u32, group: u32, sa: vec4<f32>, sb: vec4<f32>) {
    scores[t] = sa.x;
    if group > 1u { scores[split_len + t] = sa.y; }
    if group > 2u {
        scores[2u * split_len + t] = sa.z;
        scores[3u * split_len + t] = sa.w;
    }
    if group > 4u {
        scores[4u * split_len + t] = sb.x;
        scores[5u * split_len + t] = sb.y;
        scores[6u * split_len + t] = sb.z;
        scores[7u * split_len + t] = sb.w;
    }
}
