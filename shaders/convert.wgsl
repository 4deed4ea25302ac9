// Array conversions between the wire's dtypes (`convert`): float32, IEEE float16 and
// bfloat16, each way, bit-exact: widening is exact, narrowing rounds to nearest even
// (overflow to infinity), in integer arithmetic, so every adapter gives numpy's bits
// (WGSL's pack2x16float leaves rounding and range to the implementation).
//
// Used twice per batch that sends or asks for half precision (kernels.py
// plan_uploads_as, plan_answer): the half arrays as received (the "wire" arena) into
// items of the input arena in their layers' dtype before any kernel reads them, and
// attends' float32 outputs into the answer's dtype (the "answer" arena, read back)
// after every kernel wrote them: one dispatch each, a params block per array.
//
// Element g of `total` (items of `per_item` elements, back to back) is at element
//   g                                        of a contiguous side (stride 0), or
//   (g / per_item) * stride * per_word + g % per_item   of a strided side
// (stride in u32 words per item; per_word: 1 for float32, 2 for halves, two to a word,
// element 2i in the low half), from word `src_base` / `dst_base` of its buffer. A
// strided half side needs an even per_item (a word never holds two items).
//
// @binding(0) src:     array<u32>  read
// @binding(1) dst:     array<u32>  written
// @binding(2) cparams: array<ConvertParams> (gpu/params.py CONVERT_PARAMS), one block
//   per array (workgroup_id.y); its src_kind, dst_kind: 0 float32, 1 float16, 2 bfloat16
// Dispatch: (workgroups, arrays, 1) of 256 threads, a thread per pair of elements,
// striding by the grid's x.

@group(0) @binding(0) var<storage, read> src: array<u32>;
@group(0) @binding(1) var<storage, read_write> dst: array<u32>;
// #struct ConvertParams
@group(0) @binding(2) var<storage, read> cparams: array<ConvertParams>;

const WG: u32 = 256u;

fn position(g: u32, per_item: u32, stride: u32, per_word: u32) -> u32 {
    if (stride == 0u) {
        return g;
    }
    return (g / per_item) * stride * per_word + g % per_item;
}

// IEEE half bits -> float32 bits, exact (subnormals normalised)
fn f16_to_f32_bits(h: u32) -> u32 {
    let sign = (h & 0x8000u) << 16u;
    let e = (h >> 10u) & 0x1fu;
    let m = h & 0x3ffu;
    if (e == 0u) {
        if (m == 0u) {
            return sign;
        }
        let top = 31u - countLeadingZeros(m);  // 0..9
        let shift = 10u - top;
        return sign | ((113u - shift) << 23u) | (((m << shift) & 0x3ffu) << 13u);
    }
    if (e == 31u) {
        return sign | 0x7f800000u | (m << 13u);
    }
    return sign | ((e + 112u) << 23u) | (m << 13u);
}

// float32 bits -> IEEE half bits, round to nearest even, overflow to infinity
fn f32_to_f16_bits(x: u32) -> u32 {
    let sign = (x >> 16u) & 0x8000u;
    let e = i32((x >> 23u) & 0xffu);
    let m = x & 0x7fffffu;
    if (e == 255) {
        return sign | 0x7c00u | select(0u, 0x200u, m != 0u);
    }
    let he = e - 112;  // the half's biased exponent
    if (he >= 31) {
        return sign | 0x7c00u;
    }
    if (he <= 0) {  // a half subnormal (or zero): units of 2^-24
        if (he < -10) {
            return sign;
        }
        let full = m | 0x800000u;
        let shift = u32(14 - he);  // 14..24
        let half = 1u << (shift - 1u);
        let rest = full & ((1u << shift) - 1u);
        var r = full >> shift;
        if (rest > half || (rest == half && (r & 1u) == 1u)) {
            r = r + 1u;
        }
        return sign | r;
    }
    var r = (u32(he) << 10u) | (m >> 13u);
    let rest = m & 0x1fffu;
    if (rest > 0x1000u || (rest == 0x1000u && (r & 1u) == 1u)) {
        r = r + 1u;  // a carry into the exponent is right, up to infinity
    }
    return sign | r;
}

// float32 bits -> bfloat16 bits, round to nearest even (NaN stays NaN)
fn f32_to_bf16_bits(x: u32) -> u32 {
    if ((x & 0x7f800000u) == 0x7f800000u) {
        return (x >> 16u) | select(0u, 0x40u, (x & 0x7fffffu) != 0u);
    }
    return (x + 0x7fffu + ((x >> 16u) & 1u)) >> 16u;
}

// the float32 bits of element g of src
fn load_bits(g: u32, per_item: u32, src_base: u32, src_stride: u32, src_kind: u32) -> u32 {
    if (src_kind == 0u) {
        return src[src_base + position(g, per_item, src_stride, 1u)];
    }
    let at = position(g, per_item, src_stride, 2u);
    let h = (src[src_base + at / 2u] >> (16u * (at % 2u))) & 0xffffu;
    if (src_kind == 2u) {
        return h << 16u;
    }
    return f16_to_f32_bits(h);
}

fn narrow_bits(x: u32, dst_kind: u32) -> u32 {
    if (dst_kind == 2u) {
        return f32_to_bf16_bits(x);
    }
    return f32_to_f16_bits(x);
}

@compute @workgroup_size(256, 1, 1)
fn convert(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(local_invocation_id) lid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
) {
    let p = cparams[wid.y];
    let total = p.total;
    let per_item = p.per_item;
    let src_base = p.src_base;
    let src_stride = p.src_stride;
    let dst_base = p.dst_base;
    let dst_stride = p.dst_stride;
    let src_kind = p.src_kind;
    let dst_kind = p.dst_kind;
    let pairs = (total + 1u) / 2u;
    for (var t = wid.x * WG + lid.x; t < pairs; t += nwg.x * WG) {
        let g = 2u * t;
        let has_b = g + 1u < total;
        let a = load_bits(g, per_item, src_base, src_stride, src_kind);
        var b = 0u;
        if (has_b) {
            b = load_bits(g + 1u, per_item, src_base, src_stride, src_kind);
        }
        if (dst_kind == 0u) {
            dst[dst_base + position(g, per_item, dst_stride, 1u)] = a;
            if (has_b) {
                dst[dst_base + position(g + 1u, per_item, dst_stride, 1u)] = b;
            }
        } else {
            var word = narrow_bits(a, dst_kind);
            if (has_b) {
                word = word | (narrow_bits(b, dst_kind) << 16u);
            }
            dst[dst_base + position(g, per_item, dst_stride, 2u) / 2u] = word;
        }
    }
}
