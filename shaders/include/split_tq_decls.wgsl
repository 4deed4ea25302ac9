// (shaders/include/split_tq_decls.wgsl: module-scope declarations shared by
// flash_attention_tq_split.wgsl and flash_attention_tq_split_sg.wgsl: bindings,
// limits, override constants, workgroup memory, and the code/score helpers.)

// #include "split_tq_common_decls.wgsl"

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
