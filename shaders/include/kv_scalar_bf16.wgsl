// The plain KV slab of kv_format "bf16", read one element at a time: element i
// is the low (i even) or high (i odd) half of word i / 2, a bfloat16, widened to
// f32 exactly (moved to the high half of the float32's bits). kv_scalar_f16.wgsl
// is the "f16" twin.
@group(0) @binding(1) var<storage, read> k_cache: array<u32>;
@group(0) @binding(2) var<storage, read> v_cache: array<u32>;

fn bf16_at(w: u32, i: u32) -> f32 {
    return bitcast<f32>(select(w << 16u, w & 0xffff0000u, (i & 1u) == 1u));
}

fn key1(i: u32) -> f32 {
    return bf16_at(k_cache[i >> 1u], i);
}

fn value1(i: u32) -> f32 {
    return bf16_at(v_cache[i >> 1u], i);
}
