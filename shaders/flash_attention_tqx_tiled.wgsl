// Query-block flash attention over a TurboQuant cache: the prefill path of every
// compressed format (formats.TQ_SPECS, `turboquant` included), compiled once per
// format.
//
// `attention_prefill_tiled.wgsl`'s register-blocked tile on compressed keys and
// values (read it first, and `flash_attention_tqx.wgsl` for the estimator). One
// workgroup takes R = 64 rows (a block of BQ = R / G query positions times the G
// heads of one KV head's GQA group) and walks the cache in tiles of TK = 32
// timesteps; thread (tr, tc) owns rows {tr, tr+16, tr+32, tr+48} x keys
// {tc, tc+16} of the scores and the same rows x vec4 columns {tc, tc+16} of the
// rotated output, in registers. With QJL the estimator
//   score = norm * (q_rot . c[idx] + residual_norm * qjl_scale * sum_d q_jl[d] (2 bit_d - 1)) * scale
// is one dot product of length 2 * head_dim between the row [q_rot | q_jl] and
// the decoded key [c[idx] | +-residual_norm * qjl_scale], so the score phase is
// the f32 kernel's over chunks of 32 dims: the code chunks (a chunk stages, per
// key, the centroids of its codes: the thread's column, its low-field word and
// one word per bit plane of `tqx.wgsl`), then, where QJL is set, the JL chunks
// (sign bits); without QJL the dot has length head_dim. The key norms go to
// kn_sh and multiply the finished dot products. The value tile is decoded to
// norm * centroid (rotated space) from VB-bit codes. The softmax and value phases
// are the f32 kernel's includes. At the end every row's rotated output gets one
// inverse RHT: strides 1 and 2 of the Walsh-Hadamard butterfly in registers, the
// rest in `stage` (32 rows at a time), then the polar signs and 1/sqrt(d).
// Every workgroupBarrier() sits at entry-point scope in uniform control flow.
//
// Constraints (checked host-side): head_dim in {32, 64, 128};
// G = n_heads / n_kv_heads in {1, 2, 4, 8}.
//
// Bind group 0 (one dispatch serves a batch of attends over one pool slab, one
// params block per workgroup; a single attend is the batch of one):
// @binding(0) qrot:    array<f32>  every item's [q_rot | q_jl | sums] of q_cap rows
//   (tq_rotate_q) at word q_off (the sums are not read here)
// @binding(1) k_cache: array<u32>  the slab's key regions (cache_cap rows)
// @binding(2) v_cache: array<u32>  the slab's value regions
// @binding(3) out_batch: array<f32> every item's outputs at word out_off, then its
//                        log-sum-exp per (row, head) of its q_cap rows (rw; gpu/kernels.py "LSE")
// @binding(4) params:  array<TqAttentionParams> (gpu/params.py TQ_ATTENTION_PARAMS),
//   block wid.x: its item's fields, q_base = the block's first query row, q_cap the
//   item's query rows
// @binding(5) signs:   array<f32>  the item's layer's signs at word sign_off
// @binding(6) pages:   array<u32> page tables (include/paging.wgsl)
//
// Dispatch: (the batch's blocks of BQ rows, n_kv_heads, 1) workgroups of 256
// threads; the host puts the blocks with the longest causal windows first.
// The placeholder line TQX_CONSTS is replaced by the format's constants (tqx.wgsl).

{TQX_CONSTS}

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
var<workgroup> kc_sh: array<f32, 16>;            // key centroids
var<workgroup> vc_sh: array<f32, 16>;            // value centroids

// #include "tiled_common.wgsl"

// #include "tqx_codebooks.wgsl"
// #include "tqx_outliers.wgsl"

// The key outliers' part of the score of the query row whose q * signs start at
// word qb (ok: a row of the block) and the key slot whose outlier words start at ob.
fn ksparse(qb: u32, ok: bool, ob: u32, v0: f32) -> f32 {
    var s = 0.0;
    if ok {
        for (var j = 0u; j < KO; j += 1u) {
            let o = k_outlier(ob, j, v0);
            s += qrot[qb + o.ch] * o.val;
        }
    }
    return s;
}

fn kvals(c: vec4<u32>) -> vec4<f32> {
    return vec4<f32>(kc_sh[c.x], kc_sh[c.y], kc_sh[c.z], kc_sh[c.w]);
}

// Value column vc (dims 4vc .. 4vc+3) of the value slot at word o of the codes, times
// its norm, plus (value outliers) the outliers' part, whose words start at word
// vo_off + (o / vcw) * vow.
fn vdec(o: u32, vc: u32, nw: u32, lw: u32, pwd: u32, vcw: u32, vo_off: u32, vow: u32, isd: f32) -> vec4<f32> {
    let lo = v_cache[o + vc / 4u];
    var p2 = 0u;
    var p3 = 0u;
    if VB > 2u { p2 = v_cache[o + lw + vc / 8u]; }
    if VB > 3u { p3 = v_cache[o + lw + pwd + vc / 8u]; }
    let c = codes4(lo, p2, p3, vc, VB);
    let n = unpack2x16float(nw);
    var x = n.x * vec4<f32>(vc_sh[c.x], vc_sh[c.y], vc_sh[c.z], vc_sh[c.w]);
    if VO > 0u && nw != 0u {                     // nw == 0: past the end, or all zero
        x += v_outliers4(vo_off + (o / vcw) * vow, vc, n.y) * isd;
    }
    return x;
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

// Row r's log-sum-exp at word lse_off + row * n_heads + head, if r is a query row.
fn write_lse(r: u32, lse: f32, q_first: u32, q_last: u32, bq: u32, head0: u32, lse_off: u32, n_heads: u32) {
    let qi = q_first + r % bq;
    if qi <= q_last {
        out_batch[lse_off + qi * n_heads + head0 + r / bq] = lse;
    }
}

@compute @workgroup_size(256, 1, 1)
fn attention_tqx_tiled(
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
    // #include "tqx_regions.wgsl"
    let isd = 1.0 / sqrt(f32(head_dim));
    if tid < 16u {
        var kc = key_centroids(head_dim);
        var vc = value_centroids(head_dim);
        kc_sh[tid] = kc[tid];
        vc_sh[tid] = vc[tid];
    }
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
    var nch = npc;
    if QJL { nch = 2u * npc; }

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
    let sh1 = vec4<u32>(0u, 1u, 2u, 3u) + vec4<u32>(4u * sc);          // JL bits of column sc

    // #include "tiled_roles.wgsl"
    // each row's q * signs (the second region of the rotated queries; formats with key outliers)
    let qok0 = q_first + r0 % bq <= q_last;
    let qok1 = q_first + r1 % bq <= q_last;
    let qok2 = q_first + r2 % bq <= q_last;
    let qok3 = q_first + r3 % bq <= q_last;
    let qs0 = q_off + q_region + ((q_first + r0 % bq) * n_heads + kv_head * group + r0 / bq) * head_dim;
    let qs1 = q_off + q_region + ((q_first + r1 % bq) * n_heads + kv_head * group + r1 / bq) * head_dim;
    let qs2 = q_off + q_region + ((q_first + r2 % bq) * n_heads + kv_head * group + r2 / bq) * head_dim;
    let qs3 = q_off + q_region + ((q_first + r3 % bq) * n_heads + kv_head * group + r3 / bq) * head_dim;

    // prefetch: the first tile's first (polar) chunk, raw key words
    var pqa = ld_q(qa_base, qa_ok);
    var pqb = ld_q(qb_base, qb_ok);
    var pkw = 0u;                                    // the key's low-field or JL word
    var pk2 = 0u;                                    // ... its plane 2 and 3 words
    var pk3 = 0u;
    var pkn = 0u;                                    // the key's norm word (whole tile)
    if sq < t_end {
        let o = (slot0 + phys_row(table_off, page_shift, sq)) * kcw;
        pkw = k_cache[o + sc / 4u];
        if KB > 2u { pk2 = k_cache[o + lw]; }
        if KB > 3u { pk3 = k_cache[o + lw + pwd]; }
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
                kd = kvals(codes4(pkw, pk2, pk3, sc, KB));
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
                    if tb + sq < t_end {
                        let o = (slot0 + phys_row(table_off, page_shift, tb + sq)) * kcw;
                        pkw = k_cache[o + (CV * nx + sc) / 4u];
                        if KB > 2u { pk2 = k_cache[o + lw + nx]; }
                        if KB > 3u { pk3 = k_cache[o + lw + pwd + nx]; }
                    }
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
                    if tb + vk < t_end {
                        pvw0 = (slot0 + phys_row(table_off, page_shift, tb + vk)) * vcw;
                        pvn0 = v_cache[v_norm_off + slot0 + phys_row(table_off, page_shift, tb + vk)];
                    }
                    if tb + vk + 8u < t_end {
                        pvw1 = (slot0 + phys_row(table_off, page_shift, tb + vk + 8u)) * vcw;
                        pvn1 = v_cache[v_norm_off + slot0 + phys_row(table_off, page_shift, tb + vk + 8u)];
                    }
                    if tb + vk + 16u < t_end {
                        pvw2 = (slot0 + phys_row(table_off, page_shift, tb + vk + 16u)) * vcw;
                        pvn2 = v_cache[v_norm_off + slot0 + phys_row(table_off, page_shift, tb + vk + 16u)];
                    }
                    if tb + vk + 24u < t_end {
                        pvw3 = (slot0 + phys_row(table_off, page_shift, tb + vk + 24u)) * vcw;
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
        var x00 = 0.0;                               // the key outliers' parts (KO > 0)
        var x01 = 0.0;
        var x10 = 0.0;
        var x11 = 0.0;
        var x20 = 0.0;
        var x21 = 0.0;
        var x30 = 0.0;
        var x31 = 0.0;
        if KO > 0u {
            if t0 < t_end {
                let ob = k_out_off + (slot0 + phys_row(table_off, page_shift, t0)) * kow;
                let v0 = unpack2x16float(kn_sh[tc]).y;
                x00 = ksparse(qs0, qok0, ob, v0) * scale;
                x10 = ksparse(qs1, qok1, ob, v0) * scale;
                x20 = ksparse(qs2, qok2, ob, v0) * scale;
                x30 = ksparse(qs3, qok3, ob, v0) * scale;
            }
            if t1 < t_end {
                let ob = k_out_off + (slot0 + phys_row(table_off, page_shift, t1)) * kow;
                let v0 = unpack2x16float(kn_sh[tc + 16u]).y;
                x01 = ksparse(qs0, qok0, ob, v0) * scale;
                x11 = ksparse(qs1, qok1, ob, v0) * scale;
                x21 = ksparse(qs2, qok2, ob, v0) * scale;
                x31 = ksparse(qs3, qok3, ob, v0) * scale;
            }
        }
        let s00 = select(NEG_INF, hsum(a00) * g0 + x00, t0 < e0);
        let s01 = select(NEG_INF, hsum(a01) * g1 + x01, t1 < e0);
        let s10 = select(NEG_INF, hsum(a10) * g0 + x10, t0 < e1);
        let s11 = select(NEG_INF, hsum(a11) * g1 + x11, t1 < e1);
        let s20 = select(NEG_INF, hsum(a20) * g0 + x20, t0 < e2);
        let s21 = select(NEG_INF, hsum(a21) * g1 + x21, t1 < e2);
        let s30 = select(NEG_INF, hsum(a30) * g0 + x30, t0 < e3);
        let s31 = select(NEG_INF, hsum(a31) * g1 + x31, t1 < e3);
        // #include "tiled_softmax.wgsl"
        // (the decoded value tile, norm * centroid, goes into `stage`, which no thread reads any more)
        // (pvw*: the value slots' code offsets; a norm word of 0 past the end gives zeros)
        stage[vk][vc] = vdec(pvw0, vc, pvn0, lw, pwd, vcw, v_out_off, vow, isd);
        stage[vk + 8u][vc] = vdec(pvw1, vc, pvn1, lw, pwd, vcw, v_out_off, vow, isd);
        stage[vk + 16u][vc] = vdec(pvw2, vc, pvn2, lw, pwd, vcw, v_out_off, vow, isd);
        stage[vk + 24u][vc] = vdec(pvw3, vc, pvn3, lw, pwd, vcw, v_out_off, vow, isd);
        // #include "tiled_probs.wgsl"
        // prefetch the next tile's first (polar) chunk
        if tb + TK < t_end {
            pqa = ld_q(qa_base, qa_ok);
            pqb = ld_q(qb_base, qb_ok);
            pkw = 0u;
            pk2 = 0u;
            pk3 = 0u;
            pkn = 0u;
            if tb + TK + sq < t_end {
                let o = (slot0 + phys_row(table_off, page_shift, tb + TK + sq)) * kcw;
                pkw = k_cache[o + sc / 4u];
                if KB > 2u { pk2 = k_cache[o + lw]; }
                if KB > 3u { pk3 = k_cache[o + lw + pwd]; }
                pkn = k_cache[k_norm_off + slot0 + phys_row(table_off, page_shift, tb + TK + sq)];
            }
        }
        // #include "tiled_values.wgsl"
    }

    // ── the rows' log-sum-exp (thread tc 0 of each row), after the item's outputs ──
    if tc == 0u {
        let lse_off = out_off + q_cap * out_stride;
        write_lse(r0, m0 + log(l0), q_first, q_last, bq, kv_head * group, lse_off, n_heads);
        write_lse(r1, m1 + log(l1), q_first, q_last, bq, kv_head * group, lse_off, n_heads);
        write_lse(r2, m2 + log(l2), q_first, q_last, bq, kv_head * group, lse_off, n_heads);
        write_lse(r3, m3 + log(l3), q_first, q_last, bq, kv_head * group, lse_off, n_heads);
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
