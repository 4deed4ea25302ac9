// Query-block flash attention over the TurboQuant cache: the prefill path.
//
// `attention_prefill_tiled.wgsl`'s register-blocked tile on compressed keys
// and values (read it first, and `flash_attention_tq.wgsl` for the estimator).
// One workgroup takes R = 64 rows (a block of BQ = R / G query positions times
// the G heads of one KV head's GQA group) and walks the cache in tiles of
// TK = 32 timesteps; thread (tr, tc) owns rows {tr, tr+16, tr+32, tr+48} x keys
// {tc, tc+16} of the scores and the same rows x vec4 columns {tc, tc+16} of the
// rotated output, in registers. The estimator
//   score = norm * (q_rot . c[idx] + residual_norm * qjl_scale * sum_d q_jl[d] (2 bit_d - 1)) * scale
// is one dot product of length 2 * head_dim between the row [q_rot | q_jl] and
// the decoded key [c[idx] | +-residual_norm * qjl_scale], so the score phase is
// the f32 kernel's over 2 * head_dim / 32 chunks of 32 dims: the first half
// polar (codes to centroids), the second half JL (sign bits). Each chunk's raw
// words are prefetched into registers and decoded once, when staged, into
// workgroup memory for all 64 rows; the key norms go to kn_sh and multiply the
// finished dot products. The value tile is decoded to norm * centroid (rotated
// space). The softmax and value phases are the f32 kernel's includes. At the
// end every row's rotated output gets one inverse RHT: strides 1 and 2 of the
// Walsh-Hadamard butterfly in registers, the rest in `stage` (32 rows at a
// time), then the polar signs and 1/sqrt(d).
//
// Barriers per tile: 2 * head_dim / 16 + 2 (18 at head_dim 128).
// Workgroup memory (the f32 kernel's layout): stage 16384 + p_sh 9216 + pm_sh 4096
// + kn_sh 128 = 29824 bytes; the epilogue reuses stage as [32 rows][head_dim / 4].
//
// Every workgroupBarrier() sits at entry-point scope in uniform control flow.
//
// Constraints (checked host-side): head_dim in {32, 64, 128};
// G = n_heads / n_kv_heads in {1, 2, 4, 8}.
//
// Bind group 0 (one dispatch serves a batch of attends over one pool slab, one
// params block per workgroup; a single attend is the batch of one):
// @binding(0) qrot:    array<f32>  every item's [q_rot | q_jl | sums] of q_cap rows
//   (tq_rotate_q) at word q_off (the sums are not read here: the +-1 form of the
//   JL term needs none)
// @binding(1) k_cache: array<u32>  the slab's [polar | jl | norms] (cache_cap rows)
// @binding(2) v_cache: array<u32>  the slab's [polar | norms]
// @binding(3) out_batch: array<f32> every item's outputs at word out_off (rw)
// @binding(4) params:  array<TqAttentionParams> (gpu/params.py TQ_ATTENTION_PARAMS),
//   block wid.x: its item's fields, q_base = the block's first query row, q_cap the
//   item's query rows
// @binding(5) signs:   array<f32>  the item's layer's signs at word sign_off
// @binding(6) pages:   array<u32> page tables (include/paging.wgsl)
//
// Dispatch: (the batch's blocks of BQ rows, n_kv_heads, 1) workgroups of 256
// threads; the host puts the blocks with the longest causal windows first.

@group(0) @binding(0) var<storage, read> qrot: array<f32>;
@group(0) @binding(1) var<storage, read> k_cache: array<u32>;
@group(0) @binding(2) var<storage, read> v_cache: array<u32>;
@group(0) @binding(3) var<storage, read_write> out_batch: array<f32>;
// #struct TqAttentionParams
@group(0) @binding(4) var<storage, read> params: array<TqAttentionParams>;   // one block per workgroup (wid.x)
@group(0) @binding(5) var<storage, read> signs: array<f32>;
@group(0) @binding(6) var<storage, read> pages: array<u32>;
// #include "paging.wgsl"

const WG: u32 = 256u;
const R: u32 = 64u;                  // rows (query position x head) per workgroup
const TK: u32 = 32u;                 // timesteps per tile
const CV: u32 = 8u;                  // vec4 per chunk (32 dims)
const NEG_INF: f32 = -3.402823e+38;
const FLAG_NON_CAUSAL: u32 = 1u;

var<workgroup> stage: array<array<vec4<f32>, 32>, 32>;  // Q + K chunk [3c + i][.], then V tile [key][column]
var<workgroup> p_sh: array<array<vec4<f32>, 9>, R>;     // probabilities [row][key / 4] (8 used, padded)
var<workgroup> pm_sh: array<array<vec4<f32>, 4>, R>;    // partial row maxima [row][tc / 4][tc % 4]
var<workgroup> kn_sh: array<u32, TK>;            // the tile's packed (norm, residual_norm)

// #include "tiled_common.wgsl"

// Centroids of four 2-bit codes.
fn cvals(codes: vec4<u32>, c0: f32, c1: f32, c2: f32, c3: f32) -> vec4<f32> {
    let lo = select(vec4<f32>(c0), vec4<f32>(c1), codes == vec4<u32>(1u));
    let hi = select(vec4<f32>(c2), vec4<f32>(c3), codes == vec4<u32>(3u));
    return select(lo, hi, codes >= vec4<u32>(2u));
}

// Walsh-Hadamard strides 1 and 2 within one vec4 (elements 4c .. 4c+3).
fn wht4(v: vec4<f32>) -> vec4<f32> {
    let s1 = vec4<f32>(v.x + v.y, v.x - v.y, v.z + v.w, v.z - v.w);
    return vec4<f32>(s1.x + s1.z, s1.y + s1.w, s1.x - s1.z, s1.y - s1.w);
}

// Four consecutive floats of the rotated queries, or zeros for a row past the queries.
fn ld_q(o: u32, ok: bool) -> vec4<f32> {
    if ok {
        return vec4<f32>(qrot[o], qrot[o + 1u], qrot[o + 2u], qrot[o + 3u]);
    }
    return vec4<f32>(0.0);
}

@compute @workgroup_size(256, 1, 1)
fn attention_tq_tiled(
    @builtin(local_invocation_id) lid: vec3<u32>,
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
) {
    let tid = lid.x;
    let prm = params[wid.x];                         // this block of query rows (of one item)
    // #include "tq_attention_params.wgsl"

    let kv_head = wid.y;
    let group = n_heads / n_kv_heads;
    let bq = R / group;
    let d4 = head_dim / 4u;
    let pw = head_dim / 16u;
    let jw = head_dim / 32u;
    let vecs = n_kv_heads * cache_cap;
    let k_jl_off = vecs * pw;
    let k_norm_off = k_jl_off + vecs * jw;
    let v_norm_off = vecs * pw;
    let slot0 = kv_head * cache_cap;
    let q_first = q_base;                            // the block's first row (the host puts the longest first)
    let q_last = min(q_first + bq, q_cap) - 1u;      // host guarantees q_first < q_cap
    let non_causal = (flags & FLAG_NON_CAUSAL) != 0u;
    var t_end = max_seq;
    if !non_causal {
        t_end = min(start_pos + q_last + 1u, max_seq);
    }
    let q_region = q_cap * n_heads * head_dim;
    let npc = d4 / CV;                               // polar chunks (= JL chunks)
    let nch = 2u * npc;

    // ── staging roles: query rows sq, sq + 32 and key sq at chunk column sc; value keys vk + 8k at column vc ──
    let sq = tid % 8u + 8u * (tid / 64u);        // conflict-free stores, 64-byte row segments
    let sc = (tid / 8u) % 8u;
    let qa = q_first + sq % bq;
    let qa_ok = qa <= q_last;
    let qa_base = q_off + (qa * n_heads + kv_head * group + sq / bq) * head_dim + 4u * sc;
    let qb = q_first + (sq + 32u) % bq;
    let qb_ok = qb <= q_last;
    let qb_base = q_off + (qb * n_heads + kv_head * group + (sq + 32u) / bq) * head_dim + 4u * sc;
    let vk = tid / 32u;
    let vc = tid % 32u;
    let sh2 = vec4<u32>(0u, 2u, 4u, 6u) + vec4<u32>(8u * (sc % 4u));   // key chunk column sc's codes
    let vsh2 = vec4<u32>(0u, 2u, 4u, 6u) + vec4<u32>(8u * (vc % 4u));  // value column vc's codes
    let sh1 = vec4<u32>(0u, 1u, 2u, 3u) + vec4<u32>(4u * sc);          // JL bits of column sc

    // #include "tiled_roles.wgsl"

    // prefetch: the first tile's first (polar) chunk, raw key words
    var pqa = ld_q(qa_base, qa_ok);
    var pqb = ld_q(qb_base, qb_ok);
    var pkw = 0u;                                    // the key's polar or JL word
    var pkn = 0u;                                    // the key's norm word (whole tile)
    if sq < t_end {
        pkw = k_cache[(slot0 + phys_row(table_off, page_shift, sq)) * pw + sc / 4u];
        pkn = k_cache[k_norm_off + slot0 + phys_row(table_off, page_shift, sq)];
    }
    var pvw0 = 0u;
    var pvw1 = 0u;
    var pvw2 = 0u;
    var pvw3 = 0u;
    var pvn0 = 0u;
    var pvn1 = 0u;
    var pvn2 = 0u;
    var pvn3 = 0u;

    for (var tb = 0u; tb < t_end; tb += TK) {
        // #include "tiled_scores_zero.wgsl"
        for (var ch = 0u; ch < nch; ch += 1u) {
            workgroupBarrier();
            stage[3u * sc][sq] = pqa;
            stage[3u * sc + 1u][sq] = pqb;
            var kd: vec4<f32>;
            if ch < npc {
                kd = cvals((vec4<u32>(pkw) >> sh2) & vec4<u32>(3u), c0, c1, c2, c3);
            } else {
                let a = unpack2x16float(pkn).y * qjl_scale;
                kd = select(vec4<f32>(-a), vec4<f32>(a), ((vec4<u32>(pkw) >> sh1) & vec4<u32>(1u)) == vec4<u32>(1u));
            }
            stage[3u * sc + 2u][sq] = kd;
            if ch == 0u && sc == 0u {
                kn_sh[sq] = pkn;
            }
            workgroupBarrier();
            if ch + 1u < nch {
                let nx = ch + 1u;
                pkw = 0u;
                if nx < npc {
                    let off = 4u * CV * nx;
                    pqa = ld_q(qa_base + off, qa_ok);
                    pqb = ld_q(qb_base + off, qb_ok);
                    if tb + sq < t_end { pkw = k_cache[(slot0 + phys_row(table_off, page_shift, tb + sq)) * pw + (CV * nx + sc) / 4u]; }
                } else {
                    let off = q_region + 4u * CV * (nx - npc);
                    pqa = ld_q(qa_base + off, qa_ok);
                    pqb = ld_q(qb_base + off, qb_ok);
                    if tb + sq < t_end { pkw = k_cache[k_jl_off + (slot0 + phys_row(table_off, page_shift, tb + sq)) * jw + nx - npc]; }
                }
            } else {
                pvw0 = 0u;
                pvw1 = 0u;
                pvw2 = 0u;
                pvw3 = 0u;
                pvn0 = 0u;
                pvn1 = 0u;
                pvn2 = 0u;
                pvn3 = 0u;
                if vc < d4 {
                    let vo = vc / 4u;
                    if tb + vk < t_end {
                        pvw0 = v_cache[(slot0 + phys_row(table_off, page_shift, tb + vk)) * pw + vo];
                        pvn0 = v_cache[v_norm_off + slot0 + phys_row(table_off, page_shift, tb + vk)];
                    }
                    if tb + vk + 8u < t_end {
                        pvw1 = v_cache[(slot0 + phys_row(table_off, page_shift, tb + vk + 8u)) * pw + vo];
                        pvn1 = v_cache[v_norm_off + slot0 + phys_row(table_off, page_shift, tb + vk + 8u)];
                    }
                    if tb + vk + 16u < t_end {
                        pvw2 = v_cache[(slot0 + phys_row(table_off, page_shift, tb + vk + 16u)) * pw + vo];
                        pvn2 = v_cache[v_norm_off + slot0 + phys_row(table_off, page_shift, tb + vk + 16u)];
                    }
                    if tb + vk + 24u < t_end {
                        pvw3 = v_cache[(slot0 + phys_row(table_off, page_shift, tb + vk + 24u)) * pw + vo];
                        pvn3 = v_cache[v_norm_off + slot0 + phys_row(table_off, page_shift, tb + vk + 24u)];
                    }
                }
            }
            // #include "tiled_score_col.wgsl" QA=0u QB=1u KR=2u
            // #include "tiled_score_col.wgsl" QA=3u QB=4u KR=5u
            // #include "tiled_score_col.wgsl" QA=6u QB=7u KR=8u
            // #include "tiled_score_col.wgsl" QA=9u QB=10u KR=11u
            // #include "tiled_score_col.wgsl" QA=12u QB=13u KR=14u
            // #include "tiled_score_col.wgsl" QA=15u QB=16u KR=17u
            // #include "tiled_score_col.wgsl" QA=18u QB=19u KR=20u
            // #include "tiled_score_col.wgsl" QA=21u QB=22u KR=23u
        }
        // ── scores of keys t0 = tb + tc, t1 = t0 + 16: the dot products times norm * scale ──
        let t0 = tb + tc;
        let t1 = t0 + 16u;
        let g0 = unpack2x16float(kn_sh[tc]).x * scale;
        let g1 = unpack2x16float(kn_sh[tc + 16u]).x * scale;
        let s00 = select(NEG_INF, hsum(a00) * g0, t0 < e0);
        let s01 = select(NEG_INF, hsum(a01) * g1, t1 < e0);
        let s10 = select(NEG_INF, hsum(a10) * g0, t0 < e1);
        let s11 = select(NEG_INF, hsum(a11) * g1, t1 < e1);
        let s20 = select(NEG_INF, hsum(a20) * g0, t0 < e2);
        let s21 = select(NEG_INF, hsum(a21) * g1, t1 < e2);
        let s30 = select(NEG_INF, hsum(a30) * g0, t0 < e3);
        let s31 = select(NEG_INF, hsum(a31) * g1, t1 < e3);
        // #include "tiled_softmax.wgsl"
        // (the decoded value tile, norm * centroid, goes into `stage`, which no thread reads any more)
        stage[vk][vc] = unpack2x16float(pvn0).x * cvals((vec4<u32>(pvw0) >> vsh2) & vec4<u32>(3u), c0, c1, c2, c3);
        stage[vk + 8u][vc] = unpack2x16float(pvn1).x * cvals((vec4<u32>(pvw1) >> vsh2) & vec4<u32>(3u), c0, c1, c2, c3);
        stage[vk + 16u][vc] = unpack2x16float(pvn2).x * cvals((vec4<u32>(pvw2) >> vsh2) & vec4<u32>(3u), c0, c1, c2, c3);
        stage[vk + 24u][vc] = unpack2x16float(pvn3).x * cvals((vec4<u32>(pvw3) >> vsh2) & vec4<u32>(3u), c0, c1, c2, c3);
        // #include "tiled_probs.wgsl"
        // prefetch the next tile's first (polar) chunk
        if tb + TK < t_end {
            pqa = ld_q(qa_base, qa_ok);
            pqb = ld_q(qb_base, qb_ok);
            pkw = 0u;
            pkn = 0u;
            if tb + TK + sq < t_end {
                pkw = k_cache[(slot0 + phys_row(table_off, page_shift, tb + TK + sq)) * pw + sc / 4u];
                pkn = k_cache[k_norm_off + slot0 + phys_row(table_off, page_shift, tb + TK + sq)];
            }
        }
        // #include "tiled_values.wgsl"
    }

    // ── epilogue: normalize, inverse RHT per row, write; rows 0..31 then 32..63 ──
    // The butterfly's strides 1 and 2 stay inside one vec4 (done in registers);
    // strides 4 .. head_dim/2 pair whole vec4 columns of a row in `stage`.
    let sqrt_d = sqrt(f32(head_dim));
    let half4 = d4 / 2u;
    for (var half = 0u; half < 2u; half += 1u) {
        let hi = half == 1u;
        workgroupBarrier();
        let ia = 1.0 / (select(l0, l2, hi) * sqrt_d);
        let ib = 1.0 / (select(l1, l3, hi) * sqrt_d);
        if tc < d4 {
            stage[tr][tc] = wht4(select(o00, o20, hi) * ia);
            stage[tr + 16u][tc] = wht4(select(o10, o30, hi) * ib);
        }
        if tc + 16u < d4 {
            stage[tr][tc + 16u] = wht4(select(o01, o21, hi) * ia);
            stage[tr + 16u][tc + 16u] = wht4(select(o11, o31, hi) * ib);
        }
        for (var stride = 1u; stride < d4; stride = stride * 2u) {
            workgroupBarrier();
            for (var e = tid; e < 32u * half4; e += WG) {
                let row = e / half4;
                let k = e % half4;
                let i = (k / stride) * 2u * stride + (k % stride);
                let a = stage[row][i];
                let b = stage[row][i + stride];
                stage[row][i] = a + b;
                stage[row][i + stride] = a - b;
            }
        }
        workgroupBarrier();
        for (var e = tid; e < 32u * d4; e += WG) {
            let r = e / d4 + 32u * half;
            let c = e % d4;
            let qi = q_first + r % bq;
            if qi <= q_last {
                let head = kv_head * group + r / bq;
                let v = stage[e / d4][c];
                let o = out_off + qi * out_stride + head * head_dim + 4u * c;
                let sg = sign_off + 4u * c;
                out_batch[o] = v.x * signs[sg];
                out_batch[o + 1u] = v.y * signs[sg + 1u];
                out_batch[o + 2u] = v.z * signs[sg + 2u];
                out_batch[o + 3u] = v.w * signs[sg + 3u];
            }
        }
    }
}
