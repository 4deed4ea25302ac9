// The plain KV slab of kv_format "bf16" (f16's layout holding bfloat16 bits) read
// in 16-byte pieces, for the wide split kernel (attention_split_wide.wgsl): piece i
// is elements 8i .. 8i+7 (one vec4<u32> load), widened exactly as
// kv_vec4_bf16.wgsl widens its columns (a bfloat16 is the high half of its
// float32: the low element of a word by a shift, the high by a mask). Rows and
// heads start on a piece (head_dim % 8 == 0: kernels.wide_split).
@group(0) @binding(1) var<storage, read> k_cache: array<vec4<u32>>;
@group(0) @binding(2) var<storage, read> v_cache: array<vec4<u32>>;

struct H8 {
    a: vec4<f32>,
    b: vec4<f32>,
}

fn widen8(w: vec4<u32>) -> H8 {
    return H8(vec4<f32>(bitcast<f32>(w.x << 16u), bitcast<f32>(w.x & 0xffff0000u),
                        bitcast<f32>(w.y << 16u), bitcast<f32>(w.y & 0xffff0000u)),
              vec4<f32>(bitcast<f32>(w.z << 16u), bitcast<f32>(w.z & 0xffff0000u),
                        bitcast<f32>(w.w << 16u), bitcast<f32>(w.w & 0xffff0000u)));
}

fn key8(i: u32) -> H8 {
    return widen8(k_cache[i]);
}

fn value8(i: u32) -> H8 {
    return widen8(v_cache[i]);
}
