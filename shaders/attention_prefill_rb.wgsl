// Query-block flash attention over an f32 KV cache, register blocked for the
// prefill: the "rb" variant of attention_prefill_tiled.wgsl (same bindings,
// params and dispatch; chosen by KernelPolicy.prefill_f32 = "rb").
//
// One workgroup of 128 threads takes R = 64 rows (a block of BQ = R / G query
// positions times the G query heads of one KV head; row r = g * BQ + b) and
// walks the keys in tiles of TK = 64 with online softmax per row (Dao 2022),
// in the base-2 domain (Q is staged pre-multiplied by scale * log2(e)).
// Thread (tr, tc), tr in 0..7, tc in 0..15, owns rows r_i = tr + 8i (i < 8):
//   scores: keys 4tc .. 4tc + 3 of the tile (s0..s7: one vec4 per row, 32
//     scalars), computed as outer products over head_dim: per 4 dims, 8 Q
//     vec4 (one per row, 4 dims) + 4 K^T vec4 (one per dim, 4 keys) -> 128
//     FMAs (2.7 FMA per float read from workgroup memory; the tiled kernel: 1.3);
//   values: columns (vec4) tc and tc + 16 of its 8 rows (o0a..o7b, 64
//     scalars): per key, 2 vec4 of probabilities (8 rows) + 2 vec4 of V ->
//     64 FMAs (4 FMA per float read).
// Lanes: bit 0 of the lane is a bit of tc and bit 1 a bit of tr, so lanes n
// and n ^ 1 read the same Q / probability vec4 and lanes n and n ^ 2 the same
// K^T / V vec4 (NVIDIA packs such pairs: half the shared-memory cycles of an
// LDS.128); a warp holds 4 tr x 8 tc, every read is conflict free.
//
// Workgroup memory (32768 bytes), indexed [literal][literal][per-thread
// invariant] in the hot loops so naga's bounds clamps hoist:
//   qk[64][2][8] vec4 (16 KB): during the scores one 32-dim chunk of Q,
//     row tr + 8i dims 4dv.. at qk[4dv + i / 2][i % 2][tr], and of K^T, dim d
//     keys 4kv.. at qk[32 + d][kv / 8][kv % 8]; then the probabilities P^T,
//     key j rows tr + 8(4h + 0..3) at qk[j][h][tr ^ (2 * (j / 4 % 4))] (the
//     xor spreads the stores of a quarter warp over the banks).
//   vb[32][2][16] vec4 (16 KB): V in quarters of 16 keys, double buffered
//     (quarter k: vb[16 (k % 2) + key][col / 16][col % 16]); rows 24..31 also
//     hold the partial row maxima (and at the end the partial row sums),
//     thread tc's rows tr + 8(4h + 0..3) at vb[24 + tc / 2][tc % 2][8h + tr].
//
// Per tile:
//   scores, per 32-dim chunk (ceil(head_dim / 32)): load the Q and K chunks;
//     barrier; store them; barrier; after the last chunk, prefetch V quarter 0;
//     8 vec4 columns of outer products (columns past head_dim skipped). (Holding
//     the next Q/K chunk in registers during the scores measured slower on the
//     H200: more registers, fewer workgroups per SM; bench/probes/prefill_sweep.py
//     before it went.)
//   softmax: mask (only in tiles that cross some row's window end); each
//     thread writes the max of its 4 keys per row; stores V quarter 0;
//     barrier; reads the 16 partial maxima of its rows, new running max m,
//     rescale f = exp2(m_old - m_new), its 32 probabilities -> P^T; its
//     partial row sums l (its own keys only; summed over the 16 threads of a
//     row once, at the end); prefetches V quarter 1; barrier.
//   values: store V quarter k + 1, prefetch quarter k + 2, 16 keys of P V
//     (quarters wholly past the block's window are skipped), barrier, for
//     k = 0..3.
// Barriers per tile: 2 * ceil(head_dim / 32) + 5 (13 at head_dim 128, per
// 64 keys; the tiled kernel: 10 per 32 keys).
// Registers: 64 (O) + 32 (S) + 16 (m, l) + 32 (the Q/K chunk) + ~30 operands
// and indices: ~145 per thread.
//
// Causal: the tile loop ends at the block's widest window; a key past a
// row's window scores NEG_INF and weighs exactly 0, a tile wholly past it
// rescales by exp2(0) = 1, so a row's result does not depend on which block
// it falls in (chunked prefill equals one call bit for bit). Blocks are
// dispatched longest first.
//
// Every workgroupBarrier() sits at entry-point scope in uniform control flow.
// Register blocks are explicit vec4 variables (no runtime-indexed arrays).
//
// Pipeline overrides (set by kernels._tiled_kernel from
// KernelPolicy.prefill_rb_specialize): GROUP (= n_heads / n_kv_heads) and
// HEAD_DIM (= params.head_dim) let the compiler drop the other shapes' branches
// (0, the default: read from params, the generic path).
//
// Constraints (checked host-side): head_dim % 4 == 0 and <= 128; G in
// {1, 2, 4, 8}.
//
// Bind group 0 (one dispatch serves a batch of attends over one pool slab, one
// params block per workgroup; a single attend is the batch of one):
// @binding(0) q_batch:   array<vec4<f32>>  every item's queries, the item's n_queries x
//                                          q_stride floats at word q_off
// @binding(1) k_cache:   the slab, [rows, kv_dim] (f32, f16 or bf16: include/kv_vec4_{f32,f16,bf16}.wgsl)
// @binding(2) v_cache:   the slab's values, [rows, kv_dim], read through key4() / value4()
// @binding(3) out_batch: array<vec4<f32>>  every item's outputs, at word out_off, then its
//                                          log-sum-exp per (row, head) (rw; gpu/kernels.py "LSE")
// @binding(4) params:    array<PrefillParams> (gpu/params.py PREFILL_PARAMS), block wid.x:
//                        its item's fields, q_base = the block's first query row
// @binding(5) pages:     array<u32> page tables (include/paging.wgsl)
//   n_queries: the item's query rows (rows past it are skipped); flags bit 0: non-causal.
//
// Dispatch: (the batch's blocks of BQ rows, n_kv_heads, 1) workgroups of 128
// threads; the host puts the blocks with the longest causal windows first.

@group(0) @binding(0) var<storage, read> q_batch: array<vec4<f32>>;
// #include "kv_vec4_{KV}.wgsl"
@group(0) @binding(3) var<storage, read_write> out_batch: array<vec4<f32>>;
// #struct PrefillParams
@group(0) @binding(4) var<storage, read> params: array<PrefillParams>;   // one block per workgroup (wid.x)
@group(0) @binding(5) var<storage, read> pages: array<u32>;
// #include "paging.wgsl"

const R: u32 = 64u;                  // rows (query position x head) per workgroup
const TK: u32 = 64u;                 // keys per tile
const CV: u32 = 8u;                  // vec4 per head_dim chunk (32 dims)
const NEG_INF: f32 = -3.402823e+38;
const FLAG_NON_CAUSAL: u32 = 1u;
const LOG2E: f32 = 1.4426950408889634;
const LN2: f32 = 0.6931471805599453;

override GROUP: u32 = 0u;            // 0: n_heads / n_kv_heads from params
override HEAD_DIM: u32 = 0u;         // 0: params.head_dim

var<workgroup> qk: array<array<array<vec4<f32>, 8>, 2>, 64>;   // Q + K^T chunk, then P^T
var<workgroup> vb: array<array<array<vec4<f32>, 16>, 2>, 32>;  // V quarters (2 buffers); row maxima / sums

// #include "prefill_common.wgsl"

// Scores past a row's window -> NEG_INF (keys kt of the thread's vec4).
fn mask_row(s: vec4<f32>, kt: vec4<u32>, e: u32) -> vec4<f32> {
    return select(vec4<f32>(NEG_INF), s, kt < vec4<u32>(e));
}

fn probs(s: vec4<f32>, m: f32) -> vec4<f32> {
    return select(vec4<f32>(0.0), exp2(s - vec4<f32>(m)), s > vec4<f32>(NEG_INF));
}

// Q row `base` (an offset in vec4), vec4 column col, or zeros.
fn load_q(base: u32, ok: bool, col: u32, d4: u32) -> vec4<f32> {
    if ok && col < d4 {
        return q_batch[base + col];
    }
    return vec4<f32>(0.0);
}

fn load_k(b: u32, t: u32, t_end: u32, kv4: u32, off: u32, col: u32, d4: u32) -> vec4<f32> {
    if t < t_end && col < d4 {
        return key4(phys_row(params[b].table_off, params[b].page_shift, t) * kv4 + off + col);
    }
    return vec4<f32>(0.0);
}

fn load_v(b: u32, t: u32, t_end: u32, kv4: u32, off: u32, col: u32, d4: u32) -> vec4<f32> {
    if t < t_end && col < d4 {
        return value4(phys_row(params[b].table_off, params[b].page_shift, t) * kv4 + off + col);
    }
    return vec4<f32>(0.0);
}

// #include "prefill_write_row.wgsl"

@compute @workgroup_size(128, 1, 1)
fn attention_prefill_rb(
    @builtin(local_invocation_id) lid: vec3<u32>,
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
) {
    let tid = lid.x;
    let prm = params[wid.x];                     // this block of query rows (of one item)
    // #include "prefill_params.wgsl"

    let group = select(n_heads / n_kv_heads, GROUP, GROUP != 0u);
    let hd = select(head_dim, HEAD_DIM, HEAD_DIM != 0u);
    let full_chunks = HEAD_DIM != 0u && HEAD_DIM % 32u == 0u;  // no partial chunk (constant)
    let kv_head = wid.y;
    let head0 = kv_head * group;
    let bq = R / group;                          // query positions per block
    let d4 = hd / 4u;
    let wide = d4 > 16u;                         // the threads' second output column is used
    let kv4 = kv_dim / 4u;
    let kv_off = kv_head * d4;
    let q_first = q_base;                        // the block's first row (the host puts the longest first)
    let q_last = min(q_first + bq, n_queries) - 1u;  // host guarantees q_first < n_queries
    let non_causal = (flags & FLAG_NON_CAUSAL) != 0u;
    var t_end = max_seq;                         // the block's widest window
    var e_min = max_seq;                         // and its narrowest
    if !non_causal {
        t_end = min(start_pos + q_last + 1u, max_seq);
        e_min = min(start_pos + q_first + 1u, t_end);
    }
    let nch = (d4 + CV - 1u) / CV;               // head_dim chunks per tile
    let qscale = scale * LOG2E;

    let lane = tid % 32u;
    let warp = tid / 32u;

    // ── staging roles ──
    // Q: rows sr + 8 (warp + 4a) (a < 2) at chunk columns sd + 4b (b < 2)
    let sr = lane % 8u;
    let sd = lane / 8u;
    let sq0 = sr + 8u * warp;
    let sq1 = sq0 + 32u;
    let qa = q_first + sq0 % bq;
    let qa_ok = qa <= q_last;
    let qa_base = (q_off + qa * q_stride + (head0 + sq0 / bq) * hd) / 4u;
    let qb = q_first + sq1 % bq;
    let qb_ok = qb <= q_last;
    let qb_base = (q_off + qb * q_stride + (head0 + sq1 / bq) * hd) / 4u;
    let qo0 = 4u * sd + warp / 2u;               // qk index of (row sq0, column sd); + 16 for sd + 4, + 2 for sq1
    let qo1 = warp % 2u;
    // K: key kk at chunk columns kd + 2i (i < 4)
    let kk = lane + 32u * (warp % 2u);
    let kd = warp / 2u;
    let kk_hi = kk / 32u;
    let kk_lo = (kk / 4u) % 8u;
    let kk_c = kk % 4u;
    // V: keys vk + 4j (j < 4) of a quarter at column vc
    let vc = tid % 32u;
    let vk = tid / 32u;
    let vc_hi = vc / 16u;
    let vc_lo = vc % 16u;

    // ── compute roles: rows tr + 8i, keys 4tc .. 4tc + 3, output columns tc, tc + 16 ──
    let tch = warp & 1u;
    let tcl = (lane & 1u) | ((lane >> 1u) & 2u) | ((lane >> 1u) & 4u);
    let tc = tch * 8u + tcl;
    let tr = ((lane >> 1u) & 1u) | ((lane >> 3u) & 2u) | ((warp >> 1u) << 2u);
    let trs = tr ^ (2u * (tc % 4u));             // P^T slot of the thread's keys
    let px0 = tr;                                // P^T slots of keys 4t.. with t % 4 = 0..3
    let px1 = tr ^ 2u;
    let px2 = tr ^ 4u;
    let px3 = tr ^ 6u;
    let pm_a = 24u + tc / 2u;
    let pm_b = tc % 2u;

    var m_a = vec4<f32>(NEG_INF);                // running maxima, rows tr + 8 * (0..3)
    var m_b = vec4<f32>(NEG_INF);                // rows tr + 8 * (4..7)
    var l_a = vec4<f32>(0.0);                    // partial row sums (this thread's keys)
    var l_b = vec4<f32>(0.0);
    var o0a = vec4<f32>(0.0);
    var o0b = vec4<f32>(0.0);
    var o1a = vec4<f32>(0.0);
    var o1b = vec4<f32>(0.0);
    var o2a = vec4<f32>(0.0);
    var o2b = vec4<f32>(0.0);
    var o3a = vec4<f32>(0.0);
    var o3b = vec4<f32>(0.0);
    var o4a = vec4<f32>(0.0);
    var o4b = vec4<f32>(0.0);
    var o5a = vec4<f32>(0.0);
    var o5b = vec4<f32>(0.0);
    var o6a = vec4<f32>(0.0);
    var o6b = vec4<f32>(0.0);
    var o7a = vec4<f32>(0.0);
    var o7b = vec4<f32>(0.0);

    // prefetch registers: Q (rows a, columns b), K (columns kd + 2i), V (keys vk + 4j)
    var pq00 = vec4<f32>(0.0);
    var pq01 = vec4<f32>(0.0);
    var pq10 = vec4<f32>(0.0);
    var pq11 = vec4<f32>(0.0);
    var pk0 = vec4<f32>(0.0);
    var pk1 = vec4<f32>(0.0);
    var pk2 = vec4<f32>(0.0);
    var pk3 = vec4<f32>(0.0);
    var pv0 = vec4<f32>(0.0);
    var pv1 = vec4<f32>(0.0);
    var pv2 = vec4<f32>(0.0);
    var pv3 = vec4<f32>(0.0);

    for (var tb = 0u; tb < t_end; tb += TK) {
        var s0 = vec4<f32>(0.0);
        var s1 = vec4<f32>(0.0);
        var s2 = vec4<f32>(0.0);
        var s3 = vec4<f32>(0.0);
        var s4 = vec4<f32>(0.0);
        var s5 = vec4<f32>(0.0);
        var s6 = vec4<f32>(0.0);
        var s7 = vec4<f32>(0.0);
        for (var ch = 0u; ch < nch; ch += 1u) {
            let c0 = ch * CV;
            pq00 = load_q(qa_base, qa_ok, c0 + sd, d4);
            pq01 = load_q(qa_base, qa_ok, c0 + sd + 4u, d4);
            pq10 = load_q(qb_base, qb_ok, c0 + sd, d4);
            pq11 = load_q(qb_base, qb_ok, c0 + sd + 4u, d4);
            pk0 = load_k(wid.x, tb + kk, t_end, kv4, kv_off, c0 + kd, d4);
            pk1 = load_k(wid.x, tb + kk, t_end, kv4, kv_off, c0 + kd + 2u, d4);
            pk2 = load_k(wid.x, tb + kk, t_end, kv4, kv_off, c0 + kd + 4u, d4);
            pk3 = load_k(wid.x, tb + kk, t_end, kv4, kv_off, c0 + kd + 6u, d4);
            workgroupBarrier();
            qk[qo0][qo1][sr] = pq00 * qscale;
            qk[qo0 + 16u][qo1][sr] = pq01 * qscale;
            qk[qo0 + 2u][qo1][sr] = pq10 * qscale;
            qk[qo0 + 18u][qo1][sr] = pq11 * qscale;
            qk[32u + 4u * kd][kk_hi][kk_lo][kk_c] = pk0.x;
            qk[33u + 4u * kd][kk_hi][kk_lo][kk_c] = pk0.y;
            qk[34u + 4u * kd][kk_hi][kk_lo][kk_c] = pk0.z;
            qk[35u + 4u * kd][kk_hi][kk_lo][kk_c] = pk0.w;
            qk[40u + 4u * kd][kk_hi][kk_lo][kk_c] = pk1.x;
            qk[41u + 4u * kd][kk_hi][kk_lo][kk_c] = pk1.y;
            qk[42u + 4u * kd][kk_hi][kk_lo][kk_c] = pk1.z;
            qk[43u + 4u * kd][kk_hi][kk_lo][kk_c] = pk1.w;
            qk[48u + 4u * kd][kk_hi][kk_lo][kk_c] = pk2.x;
            qk[49u + 4u * kd][kk_hi][kk_lo][kk_c] = pk2.y;
            qk[50u + 4u * kd][kk_hi][kk_lo][kk_c] = pk2.z;
            qk[51u + 4u * kd][kk_hi][kk_lo][kk_c] = pk2.w;
            qk[56u + 4u * kd][kk_hi][kk_lo][kk_c] = pk3.x;
            qk[57u + 4u * kd][kk_hi][kk_lo][kk_c] = pk3.y;
            qk[58u + 4u * kd][kk_hi][kk_lo][kk_c] = pk3.z;
            qk[59u + 4u * kd][kk_hi][kk_lo][kk_c] = pk3.w;
            workgroupBarrier();
            if ch + 1u == nch {
                pv0 = load_v(wid.x, tb + vk, t_end, kv4, kv_off, vc, d4);
                pv1 = load_v(wid.x, tb + vk + 4u, t_end, kv4, kv_off, vc, d4);
                pv2 = load_v(wid.x, tb + vk + 8u, t_end, kv4, kv_off, vc, d4);
                pv3 = load_v(wid.x, tb + vk + 12u, t_end, kv4, kv_off, vc, d4);
            }
            // #include "rb_score_col.wgsl" DV=0 KD=32 QO=0
            // #include "rb_score_col.wgsl" DV=1 KD=36 QO=4
            // #include "rb_score_col.wgsl" DV=2 KD=40 QO=8
            // #include "rb_score_col.wgsl" DV=3 KD=44 QO=12
            // #include "rb_score_col.wgsl" DV=4 KD=48 QO=16
            // #include "rb_score_col.wgsl" DV=5 KD=52 QO=20
            // #include "rb_score_col.wgsl" DV=6 KD=56 QO=24
            // #include "rb_score_col.wgsl" DV=7 KD=60 QO=28
        }

        // ── softmax: mask, partial maxima, V quarter 0 ──
        if tb + TK > e_min {
            let kt = vec4<u32>(tb + 4u * tc) + vec4<u32>(0u, 1u, 2u, 3u);
            s0 = mask_row(s0, kt, row_end(tr, q_first, bq, start_pos, t_end, non_causal));
            s1 = mask_row(s1, kt, row_end(tr + 8u, q_first, bq, start_pos, t_end, non_causal));
            s2 = mask_row(s2, kt, row_end(tr + 16u, q_first, bq, start_pos, t_end, non_causal));
            s3 = mask_row(s3, kt, row_end(tr + 24u, q_first, bq, start_pos, t_end, non_causal));
            s4 = mask_row(s4, kt, row_end(tr + 32u, q_first, bq, start_pos, t_end, non_causal));
            s5 = mask_row(s5, kt, row_end(tr + 40u, q_first, bq, start_pos, t_end, non_causal));
            s6 = mask_row(s6, kt, row_end(tr + 48u, q_first, bq, start_pos, t_end, non_causal));
            s7 = mask_row(s7, kt, row_end(tr + 56u, q_first, bq, start_pos, t_end, non_causal));
        }
        vb[pm_a][pm_b][tr] = vec4<f32>(vmax(s0), vmax(s1), vmax(s2), vmax(s3));
        vb[pm_a][pm_b][8u + tr] = vec4<f32>(vmax(s4), vmax(s5), vmax(s6), vmax(s7));
        vb[vk][vc_hi][vc_lo] = pv0;
        vb[vk + 4u][vc_hi][vc_lo] = pv1;
        vb[vk + 8u][vc_hi][vc_lo] = pv2;
        vb[vk + 12u][vc_hi][vc_lo] = pv3;
        workgroupBarrier();
        // the row maxima over the 16 threads of each row (same order for all)
        var xa = vb[24u][0u][tr];
        var xb = vb[24u][0u][8u + tr];
        xa = max(xa, vb[24u][1u][tr]);
        xb = max(xb, vb[24u][1u][8u + tr]);
        xa = max(xa, vb[25u][0u][tr]);
        xb = max(xb, vb[25u][0u][8u + tr]);
        xa = max(xa, vb[25u][1u][tr]);
        xb = max(xb, vb[25u][1u][8u + tr]);
        xa = max(xa, vb[26u][0u][tr]);
        xb = max(xb, vb[26u][0u][8u + tr]);
        xa = max(xa, vb[26u][1u][tr]);
        xb = max(xb, vb[26u][1u][8u + tr]);
        xa = max(xa, vb[27u][0u][tr]);
        xb = max(xb, vb[27u][0u][8u + tr]);
        xa = max(xa, vb[27u][1u][tr]);
        xb = max(xb, vb[27u][1u][8u + tr]);
        xa = max(xa, vb[28u][0u][tr]);
        xb = max(xb, vb[28u][0u][8u + tr]);
        xa = max(xa, vb[28u][1u][tr]);
        xb = max(xb, vb[28u][1u][8u + tr]);
        xa = max(xa, vb[29u][0u][tr]);
        xb = max(xb, vb[29u][0u][8u + tr]);
        xa = max(xa, vb[29u][1u][tr]);
        xb = max(xb, vb[29u][1u][8u + tr]);
        xa = max(xa, vb[30u][0u][tr]);
        xb = max(xb, vb[30u][0u][8u + tr]);
        xa = max(xa, vb[30u][1u][tr]);
        xb = max(xb, vb[30u][1u][8u + tr]);
        xa = max(xa, vb[31u][0u][tr]);
        xb = max(xb, vb[31u][0u][8u + tr]);
        xa = max(xa, vb[31u][1u][tr]);
        xb = max(xb, vb[31u][1u][8u + tr]);
        let na = max(m_a, xa);
        let nb = max(m_b, xb);
        let fa = exp2(m_a - na);
        let fb = exp2(m_b - nb);
        m_a = na;
        m_b = nb;
        let p0 = probs(s0, na.x);
        let p1 = probs(s1, na.y);
        let p2 = probs(s2, na.z);
        let p3 = probs(s3, na.w);
        let p4 = probs(s4, nb.x);
        let p5 = probs(s5, nb.y);
        let p6 = probs(s6, nb.z);
        let p7 = probs(s7, nb.w);
        l_a = l_a * fa + vec4<f32>(hsum(p0), hsum(p1), hsum(p2), hsum(p3));
        l_b = l_b * fb + vec4<f32>(hsum(p4), hsum(p5), hsum(p6), hsum(p7));
        // P^T: the thread's keys 4tc + c (the region's Q/K chunk is no longer read)
        let kp = 4u * tc;
        qk[kp][0][trs] = vec4<f32>(p0.x, p1.x, p2.x, p3.x);
        qk[kp][1][trs] = vec4<f32>(p4.x, p5.x, p6.x, p7.x);
        qk[kp + 1u][0][trs] = vec4<f32>(p0.y, p1.y, p2.y, p3.y);
        qk[kp + 1u][1][trs] = vec4<f32>(p4.y, p5.y, p6.y, p7.y);
        qk[kp + 2u][0][trs] = vec4<f32>(p0.z, p1.z, p2.z, p3.z);
        qk[kp + 2u][1][trs] = vec4<f32>(p4.z, p5.z, p6.z, p7.z);
        qk[kp + 3u][0][trs] = vec4<f32>(p0.w, p1.w, p2.w, p3.w);
        qk[kp + 3u][1][trs] = vec4<f32>(p4.w, p5.w, p6.w, p7.w);
        pv0 = load_v(wid.x, tb + 16u + vk, t_end, kv4, kv_off, vc, d4);
        pv1 = load_v(wid.x, tb + 20u + vk, t_end, kv4, kv_off, vc, d4);
        pv2 = load_v(wid.x, tb + 24u + vk, t_end, kv4, kv_off, vc, d4);
        pv3 = load_v(wid.x, tb + 28u + vk, t_end, kv4, kv_off, vc, d4);
        workgroupBarrier();

        // ── values: quarter 0 (keys 0..15, buffer 0); V quarter 1 -> buffer 1 ──
        vb[16u + vk][vc_hi][vc_lo] = pv0;
        vb[20u + vk][vc_hi][vc_lo] = pv1;
        vb[24u + vk][vc_hi][vc_lo] = pv2;
        vb[28u + vk][vc_hi][vc_lo] = pv3;
        pv0 = load_v(wid.x, tb + 32u + vk, t_end, kv4, kv_off, vc, d4);
        pv1 = load_v(wid.x, tb + 36u + vk, t_end, kv4, kv_off, vc, d4);
        pv2 = load_v(wid.x, tb + 40u + vk, t_end, kv4, kv_off, vc, d4);
        pv3 = load_v(wid.x, tb + 44u + vk, t_end, kv4, kv_off, vc, d4);
        o0a *= fa.x;
        o0b *= fa.x;
        o1a *= fa.y;
        o1b *= fa.y;
        o2a *= fa.z;
        o2b *= fa.z;
        o3a *= fa.w;
        o3b *= fa.w;
        o4a *= fb.x;
        o4b *= fb.x;
        o5a *= fb.y;
        o5b *= fb.y;
        o6a *= fb.z;
        o6b *= fb.z;
        o7a *= fb.w;
        o7b *= fb.w;
        {
            // #include "rb_value_key.wgsl" K=0 PX=px0 VR=0
            // #include "rb_value_key.wgsl" K=1 PX=px0 VR=1
            // #include "rb_value_key.wgsl" K=2 PX=px0 VR=2
            // #include "rb_value_key.wgsl" K=3 PX=px0 VR=3
            // #include "rb_value_key.wgsl" K=4 PX=px1 VR=4
            // #include "rb_value_key.wgsl" K=5 PX=px1 VR=5
            // #include "rb_value_key.wgsl" K=6 PX=px1 VR=6
            // #include "rb_value_key.wgsl" K=7 PX=px1 VR=7
            // #include "rb_value_key.wgsl" K=8 PX=px2 VR=8
            // #include "rb_value_key.wgsl" K=9 PX=px2 VR=9
            // #include "rb_value_key.wgsl" K=10 PX=px2 VR=10
            // #include "rb_value_key.wgsl" K=11 PX=px2 VR=11
            // #include "rb_value_key.wgsl" K=12 PX=px3 VR=12
            // #include "rb_value_key.wgsl" K=13 PX=px3 VR=13
            // #include "rb_value_key.wgsl" K=14 PX=px3 VR=14
            // #include "rb_value_key.wgsl" K=15 PX=px3 VR=15
        }
        workgroupBarrier();

        // ── quarter 1 (buffer 1); V quarter 2 -> buffer 0 ──
        vb[vk][vc_hi][vc_lo] = pv0;
        vb[vk + 4u][vc_hi][vc_lo] = pv1;
        vb[vk + 8u][vc_hi][vc_lo] = pv2;
        vb[vk + 12u][vc_hi][vc_lo] = pv3;
        pv0 = load_v(wid.x, tb + 48u + vk, t_end, kv4, kv_off, vc, d4);
        pv1 = load_v(wid.x, tb + 52u + vk, t_end, kv4, kv_off, vc, d4);
        pv2 = load_v(wid.x, tb + 56u + vk, t_end, kv4, kv_off, vc, d4);
        pv3 = load_v(wid.x, tb + 60u + vk, t_end, kv4, kv_off, vc, d4);
        if tb + 16u < t_end {
            // #include "rb_value_key.wgsl" K=16 PX=px0 VR=16
            // #include "rb_value_key.wgsl" K=17 PX=px0 VR=17
            // #include "rb_value_key.wgsl" K=18 PX=px0 VR=18
            // #include "rb_value_key.wgsl" K=19 PX=px0 VR=19
            // #include "rb_value_key.wgsl" K=20 PX=px1 VR=20
            // #include "rb_value_key.wgsl" K=21 PX=px1 VR=21
            // #include "rb_value_key.wgsl" K=22 PX=px1 VR=22
            // #include "rb_value_key.wgsl" K=23 PX=px1 VR=23
            // #include "rb_value_key.wgsl" K=24 PX=px2 VR=24
            // #include "rb_value_key.wgsl" K=25 PX=px2 VR=25
            // #include "rb_value_key.wgsl" K=26 PX=px2 VR=26
            // #include "rb_value_key.wgsl" K=27 PX=px2 VR=27
            // #include "rb_value_key.wgsl" K=28 PX=px3 VR=28
            // #include "rb_value_key.wgsl" K=29 PX=px3 VR=29
            // #include "rb_value_key.wgsl" K=30 PX=px3 VR=30
            // #include "rb_value_key.wgsl" K=31 PX=px3 VR=31
        }
        workgroupBarrier();

        // ── quarter 2 (buffer 0); V quarter 3 -> buffer 1 ──
        vb[16u + vk][vc_hi][vc_lo] = pv0;
        vb[20u + vk][vc_hi][vc_lo] = pv1;
        vb[24u + vk][vc_hi][vc_lo] = pv2;
        vb[28u + vk][vc_hi][vc_lo] = pv3;
        if tb + 32u < t_end {
            // #include "rb_value_key.wgsl" K=32 PX=px0 VR=0
            // #include "rb_value_key.wgsl" K=33 PX=px0 VR=1
            // #include "rb_value_key.wgsl" K=34 PX=px0 VR=2
            // #include "rb_value_key.wgsl" K=35 PX=px0 VR=3
            // #include "rb_value_key.wgsl" K=36 PX=px1 VR=4
            // #include "rb_value_key.wgsl" K=37 PX=px1 VR=5
            // #include "rb_value_key.wgsl" K=38 PX=px1 VR=6
            // #include "rb_value_key.wgsl" K=39 PX=px1 VR=7
            // #include "rb_value_key.wgsl" K=40 PX=px2 VR=8
            // #include "rb_value_key.wgsl" K=41 PX=px2 VR=9
            // #include "rb_value_key.wgsl" K=42 PX=px2 VR=10
            // #include "rb_value_key.wgsl" K=43 PX=px2 VR=11
            // #include "rb_value_key.wgsl" K=44 PX=px3 VR=12
            // #include "rb_value_key.wgsl" K=45 PX=px3 VR=13
            // #include "rb_value_key.wgsl" K=46 PX=px3 VR=14
            // #include "rb_value_key.wgsl" K=47 PX=px3 VR=15
        }
        workgroupBarrier();

        // ── quarter 3 (buffer 1) ──
        if tb + 48u < t_end {
            // #include "rb_value_key.wgsl" K=48 PX=px0 VR=16
            // #include "rb_value_key.wgsl" K=49 PX=px0 VR=17
            // #include "rb_value_key.wgsl" K=50 PX=px0 VR=18
            // #include "rb_value_key.wgsl" K=51 PX=px0 VR=19
            // #include "rb_value_key.wgsl" K=52 PX=px1 VR=20
            // #include "rb_value_key.wgsl" K=53 PX=px1 VR=21
            // #include "rb_value_key.wgsl" K=54 PX=px1 VR=22
            // #include "rb_value_key.wgsl" K=55 PX=px1 VR=23
            // #include "rb_value_key.wgsl" K=56 PX=px2 VR=24
            // #include "rb_value_key.wgsl" K=57 PX=px2 VR=25
            // #include "rb_value_key.wgsl" K=58 PX=px2 VR=26
            // #include "rb_value_key.wgsl" K=59 PX=px2 VR=27
            // #include "rb_value_key.wgsl" K=60 PX=px3 VR=28
            // #include "rb_value_key.wgsl" K=61 PX=px3 VR=29
            // #include "rb_value_key.wgsl" K=62 PX=px3 VR=30
            // #include "rb_value_key.wgsl" K=63 PX=px3 VR=31
        }
    }

    // ── the row sums over the 16 threads of each row, then the outputs ──
    workgroupBarrier();
    vb[pm_a][pm_b][tr] = l_a;
    vb[pm_a][pm_b][8u + tr] = l_b;
    workgroupBarrier();
    var ya = vb[24u][0u][tr];
    var yb = vb[24u][0u][8u + tr];
    ya += vb[24u][1u][tr];
    yb += vb[24u][1u][8u + tr];
    ya += vb[25u][0u][tr];
    yb += vb[25u][0u][8u + tr];
    ya += vb[25u][1u][tr];
    yb += vb[25u][1u][8u + tr];
    ya += vb[26u][0u][tr];
    yb += vb[26u][0u][8u + tr];
    ya += vb[26u][1u][tr];
    yb += vb[26u][1u][8u + tr];
    ya += vb[27u][0u][tr];
    yb += vb[27u][0u][8u + tr];
    ya += vb[27u][1u][tr];
    yb += vb[27u][1u][8u + tr];
    ya += vb[28u][0u][tr];
    yb += vb[28u][0u][8u + tr];
    ya += vb[28u][1u][tr];
    yb += vb[28u][1u][8u + tr];
    ya += vb[29u][0u][tr];
    yb += vb[29u][0u][8u + tr];
    ya += vb[29u][1u][tr];
    yb += vb[29u][1u][8u + tr];
    ya += vb[30u][0u][tr];
    yb += vb[30u][0u][8u + tr];
    ya += vb[30u][1u][tr];
    yb += vb[30u][1u][8u + tr];
    ya += vb[31u][0u][tr];
    yb += vb[31u][0u][8u + tr];
    ya += vb[31u][1u][tr];
    yb += vb[31u][1u][8u + tr];
    // the log-sum-exp in natural log: the state is in log2 units (scores times LOG2E)
    let out_at = params[wid.x].out_off;
    let lse_off = out_at + n_queries * out_stride;
    let lse_a = (m_a + log2(ya)) * LN2;
    let lse_b = (m_b + log2(yb)) * LN2;
    write_row(tr, ya.x, lse_a.x, o0a, o0b, q_first, q_last, bq, head0, hd, out_stride, d4, tc, out_at, lse_off, n_heads);
    write_row(tr + 8u, ya.y, lse_a.y, o1a, o1b, q_first, q_last, bq, head0, hd, out_stride, d4, tc, out_at, lse_off, n_heads);
    write_row(tr + 16u, ya.z, lse_a.z, o2a, o2b, q_first, q_last, bq, head0, hd, out_stride, d4, tc, out_at, lse_off, n_heads);
    write_row(tr + 24u, ya.w, lse_a.w, o3a, o3b, q_first, q_last, bq, head0, hd, out_stride, d4, tc, out_at, lse_off, n_heads);
    write_row(tr + 32u, yb.x, lse_b.x, o4a, o4b, q_first, q_last, bq, head0, hd, out_stride, d4, tc, out_at, lse_off, n_heads);
    write_row(tr + 40u, yb.y, lse_b.y, o5a, o5b, q_first, q_last, bq, head0, hd, out_stride, d4, tc, out_at, lse_off, n_heads);
    write_row(tr + 48u, yb.z, lse_b.z, o6a, o6b, q_first, q_last, bq, head0, hd, out_stride, d4, tc, out_at, lse_off, n_heads);
    write_row(tr + 56u, yb.w, lse_b.w, o7a, o7b, q_first, q_last, bq, head0, hd, out_stride, d4, tc, out_at, lse_off, n_heads);
}
