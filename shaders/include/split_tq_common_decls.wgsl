// (shaders/include/split_tq_common_decls.wgsl: the module-scope declarations
// of every TurboQuant split kernel (split_tq_decls.wgsl, split_tqx_decls.wgsl):
// bindings, limits, override constants and workgroup memory.)
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
