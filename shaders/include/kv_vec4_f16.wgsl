// The plain KV slab of kv_format "f16", read as vec4 columns: a row is kv_dim
// IEEE halves, four to a vec2<u32> (element 2j in the low half of word j, as
// pack2x16float and numpy's little-endian float16 lay them out). key4(i) /
// value4(i): vec4 column i, widened to f32 (the arithmetic stays f32 on every
// adapter; kv_vec4_f32.wgsl is the f32 twin).
@group(0) @binding(1) var<storage, read> k_cache: array<vec2<u32>>;
// 8 bytes a column (f32's: 16): the split kernels keep twice as many column loads
// in flight per step over this slab, so that a step moves f32's bytes.
const KV_NARROW: bool = true;
@group(0) @binding(2) var<storage, read> v_cache: array<vec2<u32>>;

fn key4(i: u32) -> vec4<f32> {
    let w = k_cache[i];
    return vec4<f32>(unpack2x16float(w.x), unpack2x16float(w.y));
}

fn value4(i: u32) -> vec4<f32> {
    let w = v_cache[i];
    return vec4<f32>(unpack2x16float(w.x), unpack2x16float(w.y));
}
