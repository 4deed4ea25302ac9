// The plain KV slab of kv_format "f16", read one element at a time: element i
// is the low (i even) or high (i odd) half of word i / 2, widened to f32.
@group(0) @binding(1) var<storage, read> k_cache: array<u32>;
@group(0) @binding(2) var<storage, read> v_cache: array<u32>;

fn key1(i: u32) -> f32 {
    return unpack2x16float(k_cache[i >> 1u])[i & 1u];
}

fn value1(i: u32) -> f32 {
    return unpack2x16float(v_cache[i >> 1u])[i & 1u];
}
