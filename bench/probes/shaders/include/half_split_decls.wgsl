// (bench/probes/shaders/include/half_split_decls.wgsl: a probe's.) Module-scope
// declarations of the probe's piece-wise split kernel (half_split_flash.wgsl):
// the shipped split kernel's bindings, params and page table in workgroup memory (as shaders/include/split_plain_decls.wgsl, so that the
// shipped prologue, split_plain_prologue.wgsl, runs unchanged), the slab read in
// 16-byte pieces (kv_wide_{KV}.wgsl: key8 / value8; f16 and bf16 the shipped
// includes, f32 the probe's).
@group(0) @binding(0) var<storage, read> q_batch: array<f32>;
// #include "kv_wide_{KV}.wgsl"
@group(0) @binding(3) var<storage, read_write> partial: array<f32>;
// #struct SplitParams
@group(0) @binding(4) var<storage, read> params: array<SplitParams>;
@group(0) @binding(5) var<storage, read> pages: array<u32>;
// #include "paging.wgsl"

const WG: u32 = 256u;
const MAX_GROUP: u32 = 8u;
const NEG_INF: f32 = -3.402823e+38;
const FLAG_NON_CAUSAL: u32 = 1u;

var<workgroup> q_sh: array<vec4<f32>, 256>;      // MAX_GROUP * head_dim/4
// the split's page table entries (split_len / P of them at most; the host keeps within)
override PG_MAX: u32 = 256u;
var<workgroup> pg_sh: array<u32, PG_MAX>;

fn split_row(page0: u32, shift: u32, t: u32) -> u32 {
    return (pg_sh[(t >> shift) - page0] << shift) | (t & ((1u << shift) - 1u));
}

fn nan_f32() -> f32 {
    return bitcast<f32>(0x7fc00000u);
}
