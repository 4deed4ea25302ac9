// (shaders/include/tq_decode.wgsl: TurboQuant code decoding with floating-point
// arithmetic instead of compare-and-select chains; module scope, inlined by the
// loader into the split kernels.)
//
// A bit k <= 22 of y, masked out and OR-ed into the bits of 1.0f, gives
// f = 1 + 2^(k-23) or 1; fma(f, 2^(23-k), -2^(23-k)) is then exactly 1.0 or 0.0
// (every step is exact). Four dims are decoded per call from one byte (2-bit
// codes: element j at bits 2j, 2j+1) or one nibble (JL bits). With b0, b1 the
// two bits of a code, its centroid is the bilinear form
//   c[b1 b0] = c0 + (c2 - c0) b1 + ((c1 - c0) + (c3 - c2 - c1 + c0) b1) b0,
// exact in real arithmetic for any four centroids (float32 rounding of the
// coefficients: ~1 ulp of a centroid).

const TQ_ONE: vec4<u32> = vec4<u32>(0x3f800000u);

// Bilinear coefficients (c0, c2 - c0, c1 - c0, c3 - c2 - c1 + c0).
fn tq_bilinear(c0: f32, c1: f32, c2: f32, c3: f32) -> vec4<f32> {
    return vec4<f32>(c0, c2 - c0, c1 - c0, c3 - c2 - c1 + c0);
}

// Centroids of the four 2-bit codes in the low byte of y.
fn tq_codes4(y: u32, bl: vec4<f32>) -> vec4<f32> {
    let s0 = vec4<f32>(8388608.0, 2097152.0, 524288.0, 131072.0);    // 2^23, 2^21, 2^19, 2^17
    let s1 = vec4<f32>(4194304.0, 1048576.0, 262144.0, 65536.0);     // 2^22, 2^20, 2^18, 2^16
    let b0 = fma(bitcast<vec4<f32>>((vec4<u32>(y) & vec4<u32>(1u, 4u, 16u, 64u)) | TQ_ONE), s0, -s0);
    let b1 = fma(bitcast<vec4<f32>>((vec4<u32>(y) & vec4<u32>(2u, 8u, 32u, 128u)) | TQ_ONE), s1, -s1);
    return fma(b0, fma(vec4<f32>(bl.w), b1, vec4<f32>(bl.z)), fma(vec4<f32>(bl.y), b1, vec4<f32>(bl.x)));
}

// The four bits of the low nibble of y as 0.0 / 1.0.
fn tq_bits4(y: u32) -> vec4<f32> {
    let s = vec4<f32>(8388608.0, 4194304.0, 2097152.0, 1048576.0);   // 2^23 .. 2^20
    return fma(bitcast<vec4<f32>>((vec4<u32>(y) & vec4<u32>(1u, 2u, 4u, 8u)) | TQ_ONE), s, -s);
}
