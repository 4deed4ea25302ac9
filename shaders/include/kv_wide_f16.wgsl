// The plain KV slab of kv_format "f16" read in 16-byte pieces, for the wide split
// kernel (attention_split_wide.wgsl): piece i is elements 8i .. 8i+7 of the slab
// (one vec4<u32> load), widened to two vec4<f32> (H8) by unpack2x16float, as
// kv_vec4_f16.wgsl widens its columns. Rows and heads start on a piece
// (head_dim % 8 == 0: kernels.wide_split).
@group(0) @binding(1) var<storage, read> k_cache: array<vec4<u32>>;
@group(0) @binding(2) var<storage, read> v_cache: array<vec4<u32>>;

struct H8 {
    a: vec4<f32>,   // elements 0..3 of the piece
    b: vec4<f32>,   // elements 4..7
}

fn widen8(w: vec4<u32>) -> H8 {
    return H8(vec4<f32>(unpack2x16float(w.x), unpack2x16float(w.y)),
              vec4<f32>(unpack2x16float(w.z), unpack2x16float(w.w)));
}

fn key8(i: u32) -> H8 {
    return widen8(k_cache[i]);
}

fn value8(i: u32) -> H8 {
    return widen8(v_cache[i]);
}
