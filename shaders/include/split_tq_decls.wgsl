// (shaders/include/split_tq_decls.wgsl: module-scope declarations shared by
// flash_attention_tq_split.wgsl and flash_attention_tq_split_sg.wgsl: bindings,
// limits, override constants, workgroup memory, and the code/score helpers.)

@group(0) @binding(0) var<storage, read> qrot: array<f32>;
@group(0) @binding(1) var<storage, read> k_cache: array<u32>;
@group(0) @binding(2) var<storage, read> v_cache: array<u32>;
@group(0) @binding(3) var<storage, read_write> partial: array<f32>;
// #struct TqSplitParams
@group(0) @binding(4) var<storage, read> params: array<TqSplitParams>;   // one block per query row (wid.z)
@group(0) @binding(5) var<storage, read> pages: array<u32>;
// #include "paging.wgsl"

const WG: u32 = 256u;
const MAX_GROUP: u32 = 8u;
const MAX_SCORES: u32 = 2048u;
const MAX_SPLIT: u32 = 512u;
const NEG_INF: f32 = -3.402823e+38;
const FLAG_NON_CAUSAL: u32 = 1u;

// Pipeline-overridable constants, set by the host for each (GQA group size,
// head_dim) it dispatches (they must equal n_heads / n_kv_heads and params.head_dim):
// the compiler then drops the branches and registers of other group sizes and
// knows the loop bounds over head_dim.
override GROUP: u32 = 4u;
override HEAD_DIM: u32 = 128u;

// q_rot at [0, 256), q_jl at [256, 512) (G * d/4 <= 256 each); reused at the end
// to sum the value accumulators' row groups, two heads per pass.
var<workgroup> qbuf: array<vec4<f32>, 512>;
var<workgroup> qsum_sh: array<f32, MAX_GROUP>;
var<workgroup> vn_sh: array<f32, MAX_SPLIT>;     // value norms of the split
var<workgroup> scores: array<f32, MAX_SCORES>;
var<workgroup> red: array<f32, WG>;
var<workgroup> stat: array<f32, MAX_GROUP>;

// Centroids of four 2-bit codes.
fn cvals(codes: vec4<u32>, c0: f32, c1: f32, c2: f32, c3: f32) -> vec4<f32> {
    let lo = select(vec4<f32>(c0), vec4<f32>(c1), codes == vec4<u32>(1u));
    let hi = select(vec4<f32>(c2), vec4<f32>(c3), codes == vec4<u32>(3u));
    return select(lo, hi, codes >= vec4<u32>(2u));
}

// Score of one head from its polar dot and its sum of q_jl over set bits.
fn tq_score(polar: f32, pos: f32, qsum: f32, nr: vec2<f32>, qjl_scale: f32, scale: f32) -> f32 {
    return (polar * nr.x + nr.x * nr.y * qjl_scale * (2.0 * pos - qsum)) * scale;
}

// The split's page table entries (split_len / P of them at most, P >= 16).
var<workgroup> pg_sh: array<u32, 128>;

// Slab row of timestep t (absolute) of this split, from pg_sh (page0: its first page).
fn split_row(page0: u32, shift: u32, t: u32) -> u32 {
    return (pg_sh[(t >> shift) - page0] << shift) | (t & ((1u << shift) - 1u));
}
