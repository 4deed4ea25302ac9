// (shaders/include/split_tqx_decls.wgsl: the module-scope declarations of the
// TurboQuant split kernels (flash_attention_tqx_split.wgsl, every format of
// formats.TQ_SPECS): bindings, limits, override constants, workgroup memory (with
// the codebooks), and the code/score helpers.)

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
// #include "tqx_outliers.wgsl"

// The layer's value geometry (set by the prologue, read by value_col).
var<private> g_vcw: u32;        // code words of a value slot
var<private> g_lw: u32;         // low-field words
var<private> g_pwd: u32;        // words of a bit plane
var<private> g_vn_off: u32;     // the value norms region
var<private> g_vo_off: u32;     // the value outliers region
var<private> g_vow: u32;        // outlier words of a value slot
var<private> g_isd: f32;        // 1 / sqrt(head_dim)

// Decoded value column c (dims 4c .. 4c+3, rotated space) of the value in `slot`
// at split row t: its codes' centroids, and (formats with value outliers) times its
// norm plus the outliers' part (then the softmax weight is p alone: vweight).
fn value_col(slot: u32, c: u32, t: u32) -> vec4<f32> {
    let o = slot * g_vcw;
    let lo = v_cache[o + c / 4u];
    var p2 = 0u;
    var p3 = 0u;
    if VB > 2u { p2 = v_cache[o + g_lw + c / 8u]; }
    if VB > 3u { p3 = v_cache[o + g_lw + g_pwd + c / 8u]; }
    var x = vvals(codes4(lo, p2, p3, c, VB));
    if VO > 0u {
        let v0 = unpack2x16float(v_cache[g_vn_off + slot]).y;
        x = x * vn_sh[t] + v_outliers4(g_vo_off + slot * g_vow, c, v0) * g_isd;
    }
    return x;
}

// The softmax weight's factor of split row t: the value norm, folded into the
// weight unless the format has value outliers (value_col applies it then).
fn vweight(t: u32) -> f32 {
    if VO > 0u { return 1.0; }
    return vn_sh[t];
}

struct Heads8 {
    lo: vec4<f32>,
    hi: vec4<f32>,
}

// The key outliers' part of the scores of every head of the group (q * signs at
// qbuf[256 + h * d4 ..]) for the key slot whose outlier words start at ob.
fn k_outliers_heads(ob: u32, v0: f32, d4: u32, group: u32) -> Heads8 {
    var r: Heads8;
    r.lo = vec4<f32>(0.0);
    r.hi = vec4<f32>(0.0);
    for (var j = 0u; j < KO; j += 1u) {
        let o = k_outlier(ob, j, v0);
        let i = 256u + o.ch / 4u;
        let e = o.ch % 4u;
        r.lo.x += qbuf[i][e] * o.val;
        if group > 1u { r.lo.y += qbuf[i + d4][e] * o.val; }
        if group > 2u {
            r.lo.z += qbuf[i + 2u * d4][e] * o.val;
            r.lo.w += qbuf[i + 3u * d4][e] * o.val;
        }
        if group > 4u {
            r.hi += o.val * vec4<f32>(qbuf[i + 4u * d4][e], qbuf[i + 5u * d4][e], qbuf[i + 6u * d4][e],
                                      qbuf[i + 7u * d4][e]);
        }
    }
    return r;
}

fn kvals(c: vec4<u32>) -> vec4<f32> {
    return vec4<f32>(kc_sh[c.x], kc_sh[c.y], kc_sh[c.z], kc_sh[c.w]);
}

fn vvals(c: vec4<u32>) -> vec4<f32> {
    return vec4<f32>(vc_sh[c.x], vc_sh[c.y], vc_sh[c.z], vc_sh[c.w]);
}

// Score of one head from its polar dot and (QJL) its sum of q_jl over set bits, or
// (key outliers) the outliers' part of the score.
fn tq_score(polar: f32, pos: f32, qsum: f32, nr: vec2<f32>, qjl_scale: f32, scale: f32) -> f32 {
    var s = polar * nr.x;
    if QJL { s += nr.x * nr.y * qjl_scale * (2.0 * pos - qsum); }
    if KO > 0u { s += pos; }
    return s * scale;
}

// The split's page table entries (split_len / P of them at most, P >= 16).
var<workgroup> pg_sh: array<u32, 128>;

// Slab row of timestep t (absolute) of this split, from pg_sh (page0: its first page).
fn split_row(page0: u32, shift: u32, t: u32) -> u32 {
    return (pg_sh[(t >> shift) - page0] << shift) | (t & ((1u << shift) - 1u));
}
