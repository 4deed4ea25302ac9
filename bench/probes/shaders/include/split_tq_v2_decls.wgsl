// (bench/probes/shaders/include/split_tq_v2_decls.wgsl: module-scope declarations of
// flash_attention_tq_split_v2.wgsl and _v3.wgsl: bindings, override constants,
// the codebook, and the load / decode / scoring helpers.)
//
// The bindings are those of turboquant's shipped split kernel (the tqx instance
// attention_split_tqx.turboquant: same bind group layout, same buffers), typed wider: the cache slabs and the rotated queries as vec4 words
// (every region and row the kernel reads as a vec4 starts at a multiple of four
// words: checked in the header of flash_attention_tq_split_v2.wgsl).

@group(0) @binding(0) var<storage, read> qrot: array<vec4<f32>>;
@group(0) @binding(1) var<storage, read> k_cache: array<vec4<u32>>;
@group(0) @binding(2) var<storage, read> v_cache: array<vec4<u32>>;
@group(0) @binding(3) var<storage, read_write> partial: array<f32>;
// #struct TqSplitParams
@group(0) @binding(4) var<storage, read> params: array<TqSplitParams>;   // one block per query row (wid.z)
@group(0) @binding(5) var<storage, read> pages: array<u32>;

// The centroids: turboquant's constants (the kernel file's TQX_CONSTS line, replaced
// by the probe with the shipped kernel's defines, gpu/shaders.py tqx_consts).
// #include "tqx_codebooks.wgsl"

const WG: u32 = 256u;
const NEG_INF: f32 = -3.402823e+38;
const FLAG_NON_CAUSAL: u32 = 1u;

// Set by the host per pipeline (bench/probes/tq_decode_variants.py says how):
// GROUP = n_heads / n_kv_heads (1, 2, 4, 8), HEAD_DIM = params.head_dim (32, 64,
// 128), SPLIT = the longest split_len the pipeline takes (256 or 512: at most
// two keys per thread, and the reductions use wts as WG vec4 per head quad).
override GROUP: u32 = 4u;
override HEAD_DIM: u32 = 128u;
override SPLIT: u32 = 512u;
// Variant switches (1 = on): JL_LUT scores the QJL term by table lookups of
// nibbles (else one FMA per bit and head); CODE_LUT decodes two 2-bit codes per
// lookup of a 16-entry table (else compare/select); STAGE_V loads the split's
// value words into workgroup memory at the start (else the value phase reads
// them from global memory, four rows per step).
override JL_LUT: u32 = 1u;
override CODE_LUT: u32 = 1u;
override STAGE_V: u32 = 1u;
// Measurement only: return early after the scores (1), the weights (2) or the
// value phase (3); the partials are then garbage.
override CUT: u32 = 0u;
// Measurement only: PAD more words of workgroup memory (fewer workgroups per SM);
// SKIP = 1 / 2 leaves the polar / the JL part of the scores out.
override PAD: u32 = 0u;
override SKIP: u32 = 0u;
// v3: value rows prefetched VPF steps of eight rows ahead (1 or 2; 0: as 1, but the
// first eight rows are loaded after the scores, not before the keys).
override VPF: u32 = 1u;
// Value codes through cdec (1) or compare/select (0); CODE_LUT = 0 sets both.
override VCODE_LUT: u32 = 1u;

// Workgroup memory the helpers below use, declared by each kernel file: qv (q_rot
// of the group's heads, head h's vec4 column i at h * d/4 + i), qjv (q_jl, only
// without JL_LUT), jlut (JL nibble tables: head pair p, nibble group g, pattern
// e at (p * d/4 + g) * 16 + e = the sum of q_jl[4g + k] over the set bits k of
// e), cdec (a nibble of two 2-bit codes, low code first -> their centroids),
// vstage (staged value words), pg_sh (the split's page table entries), and
// the function wrow(t, q) (row t's weights of head quad q).

fn kword(i: u32) -> u32 {
    return k_cache[i >> 2u][i & 3u];
}

fn vword(i: u32) -> u32 {
    return v_cache[i >> 2u][i & 3u];
}

fn qf(i: u32) -> f32 {
    return qrot[i >> 2u][i & 3u];
}

// Slab row of timestep t (absolute) of this split, from pg_sh (page0: its first page).
fn split_row(page0: u32, shift: u32, t: u32) -> u32 {
    return (pg_sh[(t >> shift) - page0] << shift) | (t & ((1u << shift) - 1u));
}

// Centroids of four 2-bit codes (compare/select).
fn cvals(codes: vec4<u32>, cb: vec4<f32>) -> vec4<f32> {
    let lo = select(vec4<f32>(cb.x), vec4<f32>(cb.y), codes == vec4<u32>(1u));
    let hi = select(vec4<f32>(cb.z), vec4<f32>(cb.w), codes == vec4<u32>(3u));
    return select(lo, hi, codes >= vec4<u32>(2u));
}

// The four centroids of the byte of `w` at bit s (four codes, low code first).
fn dec4(w: u32, s: u32, cb: vec4<f32>) -> vec4<f32> {
    if CODE_LUT == 1u {
        return vec4<f32>(cdec[(w >> s) & 15u], cdec[(w >> (s + 4u)) & 15u]);
    }
    return cvals((vec4<u32>(w) >> (vec4<u32>(0u, 2u, 4u, 6u) + vec4<u32>(s))) & vec4<u32>(3u), cb);
}

// dec4 for the value phase (VCODE_LUT).
fn dec4v(w: u32, s: u32, cb: vec4<f32>) -> vec4<f32> {
    if CODE_LUT == 1u && VCODE_LUT == 1u {
        return vec4<f32>(cdec[(w >> s) & 15u], cdec[(w >> (s + 4u)) & 15u]);
    }
    return cvals((vec4<u32>(w) >> (vec4<u32>(0u, 2u, 4u, 6u) + vec4<u32>(s))) & vec4<u32>(3u), cb);
}

// The words of one key: polar (p0, p1: up to 8), JL (up to 4), the packed norms.
struct Key {
    p0: vec4<u32>,
    p1: vec4<u32>,
    j: vec4<u32>,
    nr: vec2<f32>,
}

fn load_key(slot: u32, k_jl_off: u32, k_norm_off: u32) -> Key {
    var k: Key;
    k.p1 = vec4<u32>(0u);
    if HEAD_DIM == 128u {
        k.p0 = k_cache[2u * slot];
        k.p1 = k_cache[2u * slot + 1u];
        k.j = k_cache[(k_jl_off >> 2u) + slot];
    } else if HEAD_DIM == 64u {
        k.p0 = k_cache[slot];
        let jv = k_cache[(k_jl_off >> 2u) + (slot >> 1u)];
        k.j = vec4<u32>(select(jv.xy, jv.zw, (slot & 1u) == 1u), 0u, 0u);
    } else {
        let pv = k_cache[slot >> 1u];
        k.p0 = vec4<u32>(select(pv.xy, pv.zw, (slot & 1u) == 1u), 0u, 0u);
        k.j = vec4<u32>(kword(k_jl_off + slot), 0u, 0u, 0u);
    }
    k.nr = unpack2x16float(kword(k_norm_off + slot));
    return k;
}

// Value polar words of unit u of the split (d >= 64: four words, d / 64 units a
// row; d = 32: a row's two words in .xy), for the staging.
fn load_vunit(u: u32, hslot: u32, page0: u32, shift: u32, t0: u32) -> vec4<u32> {
    if HEAD_DIM == 128u {
        let slot = hslot + split_row(page0, shift, t0 + (u >> 1u));
        return v_cache[2u * slot + (u & 1u)];
    } else if HEAD_DIM == 64u {
        return v_cache[hslot + split_row(page0, shift, t0 + u)];
    }
    let slot = hslot + split_row(page0, shift, t0 + u);
    let pv = v_cache[slot >> 1u];
    return vec4<u32>(select(pv.xy, pv.zw, (slot & 1u) == 1u), 0u, 0u);
}

fn stage_vunit(u: u32, x: vec4<u32>) {
    if HEAD_DIM >= 64u {
        vstage[4u * u] = x.x;
        vstage[4u * u + 1u] = x.y;
        vstage[4u * u + 2u] = x.z;
        vstage[4u * u + 3u] = x.w;
    } else {
        vstage[2u * u] = x.x;
        vstage[2u * u + 1u] = x.y;
    }
}

// One polar word (16 dims, vec4 columns 4w..4w+3) of keys A and B: the
// PolarQuant dot with every head, into pa/pb (key A, heads 0..3 / 4..7) and
// qa/qb (key B). Each query read from workgroup memory serves both keys.
fn polar_word(wa: u32, wb: u32, w: u32, cb: vec4<f32>,
              pa: ptr<function, vec4<f32>>, pb: ptr<function, vec4<f32>>,
              qa: ptr<function, vec4<f32>>, qb: ptr<function, vec4<f32>>) {
    let d4 = HEAD_DIM / 4u;
    for (var k = 0u; k < 4u; k += 1u) {
        let xa = dec4(wa, 8u * k, cb);
        let xb = dec4(wb, 8u * k, cb);
        let i = 4u * w + k;
        // heads 0..3 as vec4 lanes: acc += q_h[i] . x as four FMA steps
        var q0 = qv[i];
        var q1 = vec4<f32>(0.0);
        var q2 = vec4<f32>(0.0);
        var q3 = vec4<f32>(0.0);
        if GROUP > 1u {
            q1 = qv[d4 + i];
        }
        if GROUP > 2u {
            q2 = qv[2u * d4 + i];
            q3 = qv[3u * d4 + i];
        }
        // (q0..q3 as rows: column e of the four heads is vec4(q0[e], q1[e], q2[e], q3[e]))
        let h0 = vec4<f32>(q0.x, q1.x, q2.x, q3.x);
        let h1 = vec4<f32>(q0.y, q1.y, q2.y, q3.y);
        let h2 = vec4<f32>(q0.z, q1.z, q2.z, q3.z);
        let h3 = vec4<f32>(q0.w, q1.w, q2.w, q3.w);
        *pa = fma(h3, vec4<f32>(xa.w), fma(h2, vec4<f32>(xa.z), fma(h1, vec4<f32>(xa.y), fma(h0, vec4<f32>(xa.x), *pa))));
        if SPLIT > WG {
            *qa = fma(h3, vec4<f32>(xb.w), fma(h2, vec4<f32>(xb.z), fma(h1, vec4<f32>(xb.y), fma(h0, vec4<f32>(xb.x), *qa))));
        }
        if GROUP > 4u {
            let q4 = qv[4u * d4 + i];
            let q5 = qv[5u * d4 + i];
            let q6 = qv[6u * d4 + i];
            let q7 = qv[7u * d4 + i];
            let g0 = vec4<f32>(q4.x, q5.x, q6.x, q7.x);
            let g1 = vec4<f32>(q4.y, q5.y, q6.y, q7.y);
            let g2 = vec4<f32>(q4.z, q5.z, q6.z, q7.z);
            let g3 = vec4<f32>(q4.w, q5.w, q6.w, q7.w);
            *pb = fma(g3, vec4<f32>(xa.w), fma(g2, vec4<f32>(xa.z), fma(g1, vec4<f32>(xa.y), fma(g0, vec4<f32>(xa.x), *pb))));
            if SPLIT > WG {
                *qb = fma(g3, vec4<f32>(xb.w), fma(g2, vec4<f32>(xb.z), fma(g1, vec4<f32>(xb.y), fma(g0, vec4<f32>(xb.x), *qb))));
            }
        }
    }
}

// One JL word (32 dims, nibble groups 8w..8w+7) of keys A and B: the sums of
// q_jl over set bits, into ja/jb (key A, heads 0..3 / 4..7) and ka/kb (key B).
fn jl_word(wa: u32, wb: u32, w: u32,
           ja: ptr<function, vec4<f32>>, jb: ptr<function, vec4<f32>>,
           ka: ptr<function, vec4<f32>>, kb: ptr<function, vec4<f32>>) {
    let d4 = HEAD_DIM / 4u;
    let two = SPLIT > WG;                        // key B exists
    for (var k = 0u; k < 8u; k += 1u) {
        let g = 8u * w + k;
        if JL_LUT == 1u {
            let na = (wa >> (4u * k)) & 15u;
            let nb = (wb >> (4u * k)) & 15u;
            let e0 = g * 16u;
            let e1 = (d4 + g) * 16u;
            var x = vec4<f32>(jlut[e0 + na], 0.0, 0.0);
            var y = vec4<f32>(jlut[e0 + nb], 0.0, 0.0);
            if GROUP > 2u {
                x = vec4<f32>(x.xy, jlut[e1 + na]);
                if two {
                    y = vec4<f32>(y.xy, jlut[e1 + nb]);
                }
            }
            *ja += x;
            if two {
                *ka += y;
            }
            if GROUP > 4u {
                let e2 = (2u * d4 + g) * 16u;
                let e3 = (3u * d4 + g) * 16u;
                *jb += vec4<f32>(jlut[e2 + na], jlut[e3 + na]);
                if two {
                    *kb += vec4<f32>(jlut[e2 + nb], jlut[e3 + nb]);
                }
            }
        } else {
            let s = vec4<u32>(0u, 1u, 2u, 3u) + vec4<u32>(4u * k);
            let xa = select(vec4<f32>(0.0), vec4<f32>(1.0), ((vec4<u32>(wa) >> s) & vec4<u32>(1u)) != vec4<u32>(0u));
            let xb = select(vec4<f32>(0.0), vec4<f32>(1.0), ((vec4<u32>(wb) >> s) & vec4<u32>(1u)) != vec4<u32>(0u));
            var x = vec4<f32>(0.0);
            var y = vec4<f32>(0.0);
            for (var h = 0u; h < min(GROUP, 4u); h += 1u) {
                let q = qjv[h * d4 + g];
                x[h] = dot(q, xa);
                y[h] = dot(q, xb);
            }
            *ja += x;
            if two {
                *ka += y;
            }
            if GROUP > 4u {
                for (var h = 0u; h < 4u; h += 1u) {
                    let q = qjv[(4u + h) * d4 + g];
                    (*jb)[h] += dot(q, xa);
                    if two {
                        (*kb)[h] += dot(q, xb);
                    }
                }
            }
        }
    }
}

// Scores of heads 0..3 (lo) or 4..7 (hi) of one key, from its polar dots, its
// sums of q_jl over set bits and the group's sums of q_jl (heads past GROUP: 0).
fn tq_scores4(polar: vec4<f32>, pos: vec4<f32>, qs: vec4<f32>, nr: vec2<f32>, qjl_scale: f32,
              scale: f32, first: u32) -> vec4<f32> {
    let s = (polar * nr.x + (nr.x * nr.y * qjl_scale) * (2.0 * pos - qs)) * scale;
    let live = vec4<u32>(first) + vec4<u32>(0u, 1u, 2u, 3u) < vec4<u32>(GROUP);
    return select(vec4<f32>(0.0), s, live);
}

// Accumulator of head h (a0..a7).
fn pick(h: u32, a0: vec4<f32>, a1: vec4<f32>, a2: vec4<f32>, a3: vec4<f32>,
        a4: vec4<f32>, a5: vec4<f32>, a6: vec4<f32>, a7: vec4<f32>) -> vec4<f32> {
    var r = a0;
    if h == 1u { r = a1; }
    if h == 2u { r = a2; }
    if h == 3u { r = a3; }
    if h == 4u { r = a4; }
    if h == 5u { r = a5; }
    if h == 6u { r = a6; }
    if h == 7u { r = a7; }
    return r;
}
