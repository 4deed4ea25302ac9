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
