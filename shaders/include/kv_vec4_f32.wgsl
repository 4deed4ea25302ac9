// The plain KV slab of kv_format "f32", read as vec4 columns: a row is kv_dim
// floats. key4(i) / value4(i): vec4 column i of the slab (row r, column c is
// i = r * kv_dim / 4 + c). kv_vec4_f16.wgsl reads the "f16" slab the same way.
@group(0) @binding(1) var<storage, read> k_cache: array<vec4<f32>>;
const KV_NARROW: bool = false;   // 16 bytes a column (see kv_vec4_f16.wgsl)
@group(0) @binding(2) var<storage, read> v_cache: array<vec4<f32>>;

fn key4(i: u32) -> vec4<f32> {
    return k_cache[i];
}

fn value4(i: u32) -> vec4<f32> {
    return v_cache[i];
}
