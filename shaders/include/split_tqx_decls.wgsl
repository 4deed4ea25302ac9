// (shaders/include/split_tqx_decls.wgsl: split_tq_decls.wgsl for the TurboQuant
// variants (flash_attention_tqx_split{,_sg}.wgsl): bindings, limits, override
// constants, workgroup memory (with the codebooks), and the code/score helpers.)

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

var<workgroup> kc_sh: array<f32, 16>;           // key centroids
var<workgroup> vc_sh: array<f32, 16>;           // value centroids

// #include "tqx_codebooks.wgsl"

fn kvals(c: vec4<u32>) -> vec4<f32> {
    return vec4<f32>(kc_sh[c.x], kc_sh[c.y], kc_sh[c.z], kc_sh[c.w]);
}

fn vvals(c: vec4<u32>) -> vec4<f32> {
    return vec4<f32>(vc_sh[c.x], vc_sh[c.y], vc_sh[c.z], vc_sh[c.w]);
}

// Score of one head from its polar dot and (QJL) its sum of q_jl over set bits.
fn tq_score(polar: f32, pos: f32, qsum: f32, nr: vec2<f32>, qjl_scale: f32, scale: f32) -> f32 {
    var s = polar * nr.x;
    if QJL { s += nr.x * nr.y * qjl_scale * (2.0 * pos - qsum); }
    return s * scale;
}

// The split's page table entries (split_len / P of them at most, P >= 16).
var<workgroup> pg_sh: array<u32, 128>;

// Slab row of timestep t (absolute) of this split, from pg_sh (page0: its first page).
fn split_row(page0: u32, shift: u32, t: u32) -> u32 {
    return (pg_sh[(t >> shift) - page0] << shift) | (t & ((1u << shift) - 1u));
}
