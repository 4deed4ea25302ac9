// (bench/probes/shaders/include/kv_wide_f32.wgsl: a probe's; the shipped
// include/kv_wide_f16.wgsl and kv_wide_bf16.wgsl are its half-precision twins.) The f32 slab read
// in pieces of eight elements: piece i is two vec4<f32> loads (32 bytes), so that
// the piece-wise kernels run unchanged over f32 (variant (d) of the probe).
@group(0) @binding(1) var<storage, read> k_cache: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read> v_cache: array<vec4<f32>>;

struct H8 {
    a: vec4<f32>,
    b: vec4<f32>,
}

fn key8(i: u32) -> H8 {
    return H8(k_cache[2u * i], k_cache[2u * i + 1u]);
}

fn value8(i: u32) -> H8 {
    return H8(v_cache[2u * i], v_cache[2u * i + 1u]);
}
