// The plain KV slab of kv_format "bf16", read as vec4 columns: f16's layout (a row
// is kv_dim halves, four to a vec2<u32>, element 2j in the low half of word j, as
// numpy's little-endian bfloat16 lays them out) holding bfloat16 bits, widened to
// f32 exactly by a shift (the low half) or a mask (the high half): a bfloat16 is
// the high half of its float32. The twin of kv_vec4_f16.wgsl.
@group(0) @binding(1) var<storage, read> k_cache: array<vec2<u32>>;
// 8 bytes a column, as f16's: the split kernels' narrow-slab steps
const KV_NARROW: bool = true;
@group(0) @binding(2) var<storage, read> v_cache: array<vec2<u32>>;

fn bf16_pair(w: u32) -> vec2<f32> {
    return vec2<f32>(bitcast<f32>(w << 16u), bitcast<f32>(w & 0xffff0000u));
}

fn key4(i: u32) -> vec4<f32> {
    let w = k_cache[i];
    return vec4<f32>(bf16_pair(w.x), bf16_pair(w.y));
}

fn value4(i: u32) -> vec4<f32> {
    let w = v_cache[i];
    return vec4<f32>(bf16_pair(w.x), bf16_pair(w.y));
}
