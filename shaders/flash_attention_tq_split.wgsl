// Split-KV attention (flash-decoding) over the TurboQuant cache: the decode path.
//
// The same estimator and value path as `flash_attention_tq.wgsl` (see its
// comments and docs/turboquant.md), reorganized like `attention_split.wgsl`:
// one workgroup per (split, KV head, query row) serves every query head of the
// GQA group, so each compressed key is read once per query row, and thousands
// of workgroups are in flight. Scores: one thread per key. Thread i scores keys
// i, i + WG, ... of the split against every query head of the group: it loads
// the key's 13 words (d = 128: 8 polar, 4 JL, 1 norm) straight from global
// memory, all independent, decodes four 2-bit codes (or four JL bits) per vec4
// step once for all G heads, and reads the rotated queries from workgroup
// memory, where every thread of a subgroup reads the same address (a
// broadcast). No staging and no barriers in this phase. Values: thread (c, grp)
// owns the vec4 column c of the rotated accumulator of EVERY query head of the
// group (G vec4 registers) and reads value words straight from global memory.
// The accumulator stays in rotated space; `attention_merge` (ROTATE) merges the
// splits and applies the inverse RHT. (Earlier versions staged tiles in
// workgroup memory, or scored one key per subgroup; docs/benchmarks.md has
// what each measured.)
//
//   score = norm * (sum_d q_rot[d] c[idx_d] + residual_norm * qjl_scale * signed_sum) * scale
//   signed_sum = 2 * sum_{bit_d = 1} q_jl[d] - sum_d q_jl[d]
//
// Constraints (checked host-side): head_dim in {32, 64, 128};
// G = n_heads / n_kv_heads in {1, 2, 4, 8}; G * split_len <= MAX_SCORES and
// split_len <= MAX_SPLIT.
//
// Bind group 0:
// @binding(0) qrot:    array<f32>  [q_rot | q_jl | sums] of q_cap rows (tq_rotate_q)
// @binding(1) k_cache: array<u32>  [polar | jl | norms]
// @binding(2) v_cache: array<u32>  [polar | norms]
// @binding(3) partial: array<f32>  [acc | m | l], see attention_merge.wgsl (q_total = q_cap)
// @binding(4) params:  array<u32, 20>
//   ( n_heads, n_kv_heads, head_dim, max_seq, start_pos, scale_bits, q_cap,
//     split_len, qjl_scale_bits, n_splits, c0_bits, c1_bits, c2_bits, c3_bits,
//     q_base, cache_cap, flags, _pad0, _pad1, _pad2 )
//   flags bit 0: non-causal.
//
// Dispatch: (n_splits, n_kv_heads, n_queries) workgroups of 256 threads.

@group(0) @binding(0) var<storage, read> qrot: array<f32>;
@group(0) @binding(1) var<storage, read> k_cache: array<u32>;
@group(0) @binding(2) var<storage, read> v_cache: array<u32>;
@group(0) @binding(3) var<storage, read_write> partial: array<f32>;
@group(0) @binding(4) var<storage, read> params: array<u32, 20>;

const WG: u32 = 256u;
const MAX_GROUP: u32 = 8u;
const MAX_SCORES: u32 = 2048u;
const MAX_SPLIT: u32 = 512u;
const NEG_INF: f32 = -3.402823e+38;
const FLAG_NON_CAUSAL: u32 = 1u;

// q_rot at [0, 256), q_jl at [256, 512) (G * d/4 <= 256 each); reused at the end
// to sum the value accumulators' row groups, two heads per pass.
var<workgroup> qbuf: array<vec4<f32>, 512>;
var<workgroup> qsum_sh: array<f32, MAX_GROUP>;
var<workgroup> vn_sh: array<f32, MAX_SPLIT>;     // value norms of the split
var<workgroup> scores: array<f32, MAX_SCORES>;
var<workgroup> red: array<f32, WG>;
var<workgroup> stat: array<f32, MAX_GROUP>;

// Centroids of four 2-bit codes.
fn cvals(codes: vec4<u32>, c0: f32, c1: f32, c2: f32, c3: f32) -> vec4<f32> {
    let lo = select(vec4<f32>(c0), vec4<f32>(c1), codes == vec4<u32>(1u));
    let hi = select(vec4<f32>(c2), vec4<f32>(c3), codes == vec4<u32>(3u));
    return select(lo, hi, codes >= vec4<u32>(2u));
}

// x (four decoded dims at vec4 column i) dotted with heads 0..3 / 4..7 of the
// group, queries at qbuf[base + h * d4 + i].
fn hq_lo(base: u32, i: u32, d4: u32, group: u32, x: vec4<f32>) -> vec4<f32> {
    var s = vec4<f32>(dot(qbuf[base + i], x), 0.0, 0.0, 0.0);
    if group > 1u { s.y = dot(qbuf[base + d4 + i], x); }
    if group > 2u {
        s.z = dot(qbuf[base + 2u * d4 + i], x);
        s.w = dot(qbuf[base + 3u * d4 + i], x);
    }
    return s;
}

fn hq_hi(base: u32, i: u32, d4: u32, x: vec4<f32>) -> vec4<f32> {
    return vec4<f32>(dot(qbuf[base + 4u * d4 + i], x), dot(qbuf[base + 5u * d4 + i], x),
                     dot(qbuf[base + 6u * d4 + i], x), dot(qbuf[base + 7u * d4 + i], x));
}

// One polar word (16 dims, vec4 columns 4w..4w+3): the PolarQuant dot with
// every head, added to pa (heads 0..3) and pb (heads 4..7).
fn polar_word(word: u32, w: u32, d4: u32, group: u32, cb: vec4<f32>,
              pa: ptr<function, vec4<f32>>, pb: ptr<function, vec4<f32>>) {
    let sh = vec4<u32>(0u, 2u, 4u, 6u);
    for (var k4 = 0u; k4 < 4u; k4 += 1u) {
        let x = cvals((vec4<u32>(word) >> (sh + vec4<u32>(8u * k4))) & vec4<u32>(3u), cb.x, cb.y, cb.z, cb.w);
        *pa += hq_lo(0u, 4u * w + k4, d4, group, x);
        if group > 4u { *pb += hq_hi(0u, 4u * w + k4, d4, x); }
    }
}

// One JL word (32 dims, vec4 columns 8w..8w+7): the sum of q_jl over set bits.
fn jl_word(word: u32, w: u32, d4: u32, group: u32,
           ja: ptr<function, vec4<f32>>, jb: ptr<function, vec4<f32>>) {
    let sh = vec4<u32>(0u, 1u, 2u, 3u);
    for (var k8 = 0u; k8 < 8u; k8 += 1u) {
        let x = vec4<f32>((vec4<u32>(word) >> (sh + vec4<u32>(4u * k8))) & vec4<u32>(1u));
        *ja += hq_lo(256u, 8u * w + k8, d4, group, x);
        if group > 4u { *jb += hq_hi(256u, 8u * w + k8, d4, x); }
    }
}

fn tq_score(polar: f32, pos: f32, qsum: f32, nr: vec2<f32>, qjl_scale: f32, scale: f32) -> f32 {
    return (polar * nr.x + nr.x * nr.y * qjl_scale * (2.0 * pos - qsum)) * scale;
}

@compute @workgroup_size(256, 1, 1)
fn attention_split_tq(
    @builtin(local_invocation_id) lid: vec3<u32>,
    @builtin(workgroup_id) wid: vec3<u32>,
) {
    // #include "split_tq_prologue.wgsl"

    // ── 1. scores: one thread per compressed key, every head of the group ──
    let cb = vec4<f32>(c0, c1, c2, c3);
    for (var t = tid; t < n_t; t += WG) {
        let slot = slot0 + t;
        // every word of the key first: independent loads, all in flight
        let po = slot * pw;
        let jo = k_jl_off + slot * jw;
        var p = vec4<u32>(k_cache[po], k_cache[po + 1u], 0u, 0u);    // pw >= 2
        var p2 = vec4<u32>(0u);
        var j = vec2<u32>(k_cache[jo], 0u);                          // jw >= 1
        var j2 = vec2<u32>(0u);
        if pw > 2u {
            p.z = k_cache[po + 2u];
            p.w = k_cache[po + 3u];
            j.y = k_cache[jo + 1u];
        }
        if pw > 4u {
            p2 = vec4<u32>(k_cache[po + 4u], k_cache[po + 5u], k_cache[po + 6u], k_cache[po + 7u]);
            j2 = vec2<u32>(k_cache[jo + 2u], k_cache[jo + 3u]);
        }
        let nr = unpack2x16float(k_cache[k_norm_off + slot]);
        vn_sh[t] = unpack2x16float(v_cache[v_norm_off + slot]).x;

        var pa = vec4<f32>(0.0);   // polar, heads 0..3
        var pb = vec4<f32>(0.0);   // polar, heads 4..7
        var ja = vec4<f32>(0.0);   // sums of q_jl over set bits, heads 0..3
        var jb = vec4<f32>(0.0);   // heads 4..7
        polar_word(p.x, 0u, d4, group, cb, &pa, &pb);
        polar_word(p.y, 1u, d4, group, cb, &pa, &pb);
        jl_word(j.x, 0u, d4, group, &ja, &jb);
        if pw > 2u {
            polar_word(p.z, 2u, d4, group, cb, &pa, &pb);
            polar_word(p.w, 3u, d4, group, cb, &pa, &pb);
            jl_word(j.y, 1u, d4, group, &ja, &jb);
        }
        if pw > 4u {
            polar_word(p2.x, 4u, d4, group, cb, &pa, &pb);
            polar_word(p2.y, 5u, d4, group, cb, &pa, &pb);
            polar_word(p2.z, 6u, d4, group, cb, &pa, &pb);
            polar_word(p2.w, 7u, d4, group, cb, &pa, &pb);
            jl_word(j2.x, 2u, d4, group, &ja, &jb);
            jl_word(j2.y, 3u, d4, group, &ja, &jb);
        }
        scores[t] = tq_score(pa.x, ja.x, qsum_sh[0], nr, qjl_scale, scale);
        if group > 1u { scores[split_len + t] = tq_score(pa.y, ja.y, qsum_sh[1], nr, qjl_scale, scale); }
        if group > 2u {
            scores[2u * split_len + t] = tq_score(pa.z, ja.z, qsum_sh[2], nr, qjl_scale, scale);
            scores[3u * split_len + t] = tq_score(pa.w, ja.w, qsum_sh[3], nr, qjl_scale, scale);
        }
        if group > 4u {
            scores[4u * split_len + t] = tq_score(pb.x, jb.x, qsum_sh[4], nr, qjl_scale, scale);
            scores[5u * split_len + t] = tq_score(pb.y, jb.y, qsum_sh[5], nr, qjl_scale, scale);
            scores[6u * split_len + t] = tq_score(pb.z, jb.z, qsum_sh[6], nr, qjl_scale, scale);
            scores[7u * split_len + t] = tq_score(pb.w, jb.w, qsum_sh[7], nr, qjl_scale, scale);
        }
    }
    workgroupBarrier();

    // #include "split_softmax.wgsl" WEIGHT="p * vn_sh[t]"

    // #include "split_tq_values.wgsl"

    // #include "split_tq_epilogue.wgsl"
}
