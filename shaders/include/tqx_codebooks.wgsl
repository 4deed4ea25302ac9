// (shaders/include/tqx_codebooks.wgsl: the format's codebook of a head_dim, from the
// constants TQX_CONSTS defines (gpu/shaders.py tqx_consts), 2^b entries used of 16;
// and the decoding of four b-bit codes.)
fn key_centroids(d: u32) -> array<f32, 16> {
    if d == 32u { return KC_32; }
    if d == 64u { return KC_64; }
    return KC_128;
}

fn value_centroids(d: u32) -> array<f32, 16> {
    if d == 32u { return VC_32; }
    if d == 64u { return VC_64; }
    return VC_128;
}

fn key_bounds(d: u32) -> array<f32, 16> {
    if d == 32u { return KCB_32; }
    if d == 64u { return KCB_64; }
    return KCB_128;
}

fn value_bounds(d: u32) -> array<f32, 16> {
    if d == 32u { return VCB_32; }
    if d == 64u { return VCB_64; }
    return VCB_128;
}

// The b-bit codes of vec4 column i (dims 4i .. 4i+3) from the words holding
// them: lo = low-field word i / 4, p2 / p3 = the planes' words i / 8 (tqx.wgsl).
fn codes4(lo: u32, p2: u32, p3: u32, i: u32, bits: u32) -> vec4<u32> {
    var c = (vec4<u32>(lo) >> (vec4<u32>(0u, 2u, 4u, 6u) + vec4<u32>(8u * (i % 4u)))) & vec4<u32>(3u);
    let sh = vec4<u32>(0u, 1u, 2u, 3u) + vec4<u32>(4u * (i % 8u));
    if bits > 2u { c |= ((vec4<u32>(p2) >> sh) & vec4<u32>(1u)) << vec4<u32>(2u); }
    if bits > 3u { c |= ((vec4<u32>(p3) >> sh) & vec4<u32>(1u)) << vec4<u32>(3u); }
    return c;
}
