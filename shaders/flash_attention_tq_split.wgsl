// Split-KV attention (flash-decoding) over the TurboQuant cache: the decode path.
//
// The same estimator and value path as `flash_attention_tq.wgsl` (see its
// comments and docs/turboquant.md), reorganized like `attention_split.wgsl`:
// one workgroup per (split, KV head, query row) serves every query head of the
// GQA group, so each compressed key is read once per query row, and thousands
// of workgroups are in flight. Per TK-row tile, the compressed words of the
// tile (polar, JL, norm, value norm) are staged in workgroup memory with
// coalesced loads (consecutive threads read consecutive words: for a fixed KV
// head, consecutive timesteps are consecutive slots of every region), padded
// so the score phase is bank-conflict free. Queries are read as vec4 and four
// 2-bit codes (or four JL bits) are decoded per vec4 step. For values, thread
// (c, grp) owns the vec4 column c of the rotated accumulator of EVERY query head
// of the group (G vec4 registers) and takes every NG-th row of the tile. The
// accumulator stays in rotated space; `attention_merge` (ROTATE) merges the
// splits and applies the inverse RHT.
//
//   score = norm * (sum_d q_rot[d] c[idx_d] + residual_norm * qjl_scale * signed_sum) * scale
//   signed_sum = 2 * sum_{bit_d = 1} q_jl[d] - sum_d q_jl[d]
//
// Constraints (checked host-side): head_dim in {32, 64, 128};
// G = n_heads / n_kv_heads in {1, 2, 4, 8}; split_len a multiple of TK with
// G * split_len <= MAX_SCORES and split_len <= MAX_SPLIT.
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
const TK: u32 = 64u;                 // compressed keys per staged tile
const MAX_GROUP: u32 = 8u;
const MAX_SCORES: u32 = 2048u;
const MAX_SPLIT: u32 = 512u;
const PROW: u32 = 9u;                 // padded polar words per staged key (d/16 <= 8)
const JROW: u32 = 5u;                 // padded JL words per staged key (d/32 <= 4)
const NEG_INF: f32 = -3.402823e+38;
const FLAG_NON_CAUSAL: u32 = 1u;

// q_rot at [0, 256), q_jl at [256, 512) (G * d/4 <= 256 each); reused at the end
// to sum the value accumulators' row groups, two heads per pass.
var<workgroup> qbuf: array<vec4<f32>, 512>;
var<workgroup> qsum_sh: array<f32, MAX_GROUP>;
var<workgroup> kp_tile: array<u32, 576>;         // TK * PROW
var<workgroup> kj_tile: array<u32, 320>;         // TK * JROW
var<workgroup> kn_tile: array<u32, TK>;          // packed (norm, residual_norm)
var<workgroup> vp_tile: array<u32, 512>;         // TK * d/16 value polar words
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

@compute @workgroup_size(256, 1, 1)
fn attention_split_tq(
    @builtin(local_invocation_id) lid: vec3<u32>,
    @builtin(workgroup_id) wid: vec3<u32>,
) {
    // #include "split_tq_prologue.wgsl"

    // ── 1. scores, one staged tile of compressed keys at a time ──
    let gi = tid / TK;
    let j = tid % TK;
    let sh2 = vec4<u32>(0u, 2u, 4u, 6u);
    let sh1 = vec4<u32>(0u, 1u, 2u, 3u);
    for (var tb = 0u; tb < n_t; tb += TK) {
        let nk = min(TK, n_t - tb);
        let s0 = slot0 + tb;
        for (var e = tid; e < nk * pw; e += WG) {
            kp_tile[(e / pw) * PROW + e % pw] = k_cache[s0 * pw + e];
        }
        for (var e = tid; e < nk * jw; e += WG) {
            kj_tile[(e / jw) * JROW + e % jw] = k_cache[k_jl_off + s0 * jw + e];
        }
        if tid < nk {
            kn_tile[tid] = k_cache[k_norm_off + s0 + tid];
            vn_sh[tb + tid] = unpack2x16float(v_cache[v_norm_off + s0 + tid]).x;
        }
        workgroupBarrier();
        // thread (head gg, key j); with G = 8 each thread scores two heads
        for (var gg = gi; gg < group; gg += WG / TK) {
            if j < nk {
                let qo = gg * d4;
                var polar = vec4<f32>(0.0);
                for (var w = 0u; w < pw; w += 1u) {
                    let word = vec4<u32>(kp_tile[j * PROW + w]);
                    for (var k4 = 0u; k4 < 4u; k4 += 1u) {
                        let codes = (word >> (sh2 + vec4<u32>(8u * k4))) & vec4<u32>(3u);
                        polar += qbuf[qo + 4u * w + k4] * cvals(codes, c0, c1, c2, c3);
                    }
                }
                var pos = vec4<f32>(0.0);
                for (var w = 0u; w < jw; w += 1u) {
                    let word = vec4<u32>(kj_tile[j * JROW + w]);
                    for (var k8 = 0u; k8 < 8u; k8 += 1u) {
                        let bits = (word >> (sh1 + vec4<u32>(4u * k8))) & vec4<u32>(1u);
                        pos += select(vec4<f32>(0.0), qbuf[256u + qo + 8u * w + k8], bits == vec4<u32>(1u));
                    }
                }
                let nr = unpack2x16float(kn_tile[j]);
                let polar_dot = polar.x + polar.y + polar.z + polar.w;
                let signed_sum = 2.0 * (pos.x + pos.y + pos.z + pos.w) - qsum_sh[gg];
                scores[gg * split_len + tb + j] = (polar_dot * nr.x + nr.x * nr.y * qjl_scale * signed_sum) * scale;
            }
        }
        workgroupBarrier();
    }

    // #include "split_softmax.wgsl" WEIGHT="p * vn_sh[t]"

    // ── 3. values: thread (column c, row group grp) accumulates all G heads ──
    let n_grp = WG / d4;
    let c = tid % d4;
    let grp = tid / d4;
    let vw = c / 4u;                             // value word of dims 4c..4c+3
    let vsh = sh2 + vec4<u32>(8u * (c % 4u));
    var a0 = vec4<f32>(0.0);
    var a1 = vec4<f32>(0.0);
    var a2 = vec4<f32>(0.0);
    var a3 = vec4<f32>(0.0);
    var a4 = vec4<f32>(0.0);
    var a5 = vec4<f32>(0.0);
    var a6 = vec4<f32>(0.0);
    var a7 = vec4<f32>(0.0);
    for (var tb = 0u; tb < n_t; tb += TK) {
        let nk = min(TK, n_t - tb);
        for (var e = tid; e < nk * pw; e += WG) {
            vp_tile[e] = v_cache[(slot0 + tb) * pw + e];
        }
        workgroupBarrier();
        for (var t = grp; t < nk; t += n_grp) {
            let v = cvals((vec4<u32>(vp_tile[t * pw + vw]) >> vsh) & vec4<u32>(3u), c0, c1, c2, c3);
            let st = tb + t;
            // #include "accumulate_heads.wgsl" T=st V=v
        }
        workgroupBarrier();
    }

    // #include "split_tq_epilogue.wgsl"
}
