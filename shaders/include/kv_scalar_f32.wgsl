// The plain KV slab of kv_format "f32", read one element at a time (the
// single-pass kernel): key1(i) / value1(i) is element i of the slab (row r,
// column c is i = r * kv_dim + c). kv_scalar_f16.wgsl is the "f16" twin.
@group(0) @binding(1) var<storage, read> k_cache: array<f32>;
@group(0) @binding(2) var<storage, read> v_cache: array<f32>;

fn key1(i: u32) -> f32 {
    return k_cache[i];
}

fn value1(i: u32) -> f32 {
    return v_cache[i];
}
