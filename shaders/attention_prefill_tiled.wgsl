// Query-block flash attention over an f32 KV cache: the prefill path.
//
// The seed kernel (`attention_prefill.wgsl`) runs one workgroup per (head,
// query) and re-reads every K/V row once per (query, head). Here one workgroup
// takes R = 64 rows: a block of BQ = R / G consecutive query positions times
// the G query heads of one KV head's GQA group (row r = g * BQ + b), and walks
// the K/V rows in tiles of TK = 32 keys with online softmax (Dao 2022) per row.
// It is register blocked like an SGEMM: 256 threads, thread (tr, tc) with
// tr, tc in 0..15 owns rows {tr, tr+16, tr+32, tr+48} x keys {tc, tc+16} of
// each tile's 64 x 32 scores (8 vec4 accumulators) and the same 4 rows x
// columns (vec4) {tc, tc+16} of the 64 x head_dim output (8 vec4 accumulators
// in registers). A warp holds 4 row groups x 8 key groups, so each of its
// workgroup-memory vec4 reads touches at most 8 distinct, consecutive (bank
// conflict free) vec4s and feeds 8 (scores) or ~10 (values) vec4 FMAs.
//
// Workgroup memory is indexed [a][b] with a a literal and b a per-thread
// invariant in the hot loops (unrolled by includes), so naga's bounds clamps
// fold or hoist out instead of costing integer ops per read.
//   stage[32][32] vec4: during the scores, chunk column c of Q row r < 32 in
//     stage[3c][r], of Q row r + 32 in stage[3c + 1][r], of key j in
//     stage[3c + 2][j] (column-major: a warp's distinct rows are adjacent);
//     during the values, the V tile, stage[key][column].
//   p_sh[64][9] vec4: probabilities, [row][key / 4] (padded: a warp's 4 adjacent rows
//     land on different banks).
//   pm_sh[64][4] vec4: the 16 partial maxima of each row.
//
// Per tile:
//   scores: for each 32-dim chunk of head_dim (ceil(head_dim / 32) chunks):
//     barrier; store the prefetched Q chunk (64 x 8 vec4) and K chunk (32 x 8
//     vec4) into `stage`; barrier; prefetch the next chunk (or this tile's V)
//     from global memory into registers; per vec4 column, 6 vec4 reads -> 8
//     vec4 FMAs. Q is re-staged per tile (the budget below has no room to keep
//     64 x 128 floats resident); it comes from L2.
//   softmax: each thread masks and scales its 8 scores, writes the max of its
//     two keys per row to pm_sh; barrier; stores V into `stage`; reads the 16
//     partial maxima of each of its rows (4 vec4), updates the running max in
//     registers (every thread of a row computes the same value), writes its 8
//     probabilities to p_sh; barrier; prefetches the next tile's first chunk.
//   values: rescale the accumulators by exp(m_old - m_new) and, per 4 keys,
//     4 vec4 reads of p_sh + 8 of V -> 32 vec4 FMAs; the row sum l is summed
//     by each thread of the row from the same p_sh values in the same order.
// Barriers per tile: 2 * ceil(head_dim / 32) + 2 (10 at head_dim 128).
// Workgroup memory: stage 16384 + p_sh 9216 + pm_sh 4096 = 29696 bytes.
//
// Causal: the tile loop ends at the block's widest window (tiles fully masked
// for every row of the block are never read); a key past a row's window scores
// NEG_INF and weighs exactly 0, a tile wholly past it rescales by exp(0) = 1,
// so a row's result does not depend on which block it falls in (chunked
// prefill equals one call bit for bit). Blocks are dispatched longest first
// (block x covers the (n_blocks - 1 - x)-th group of BQ rows) so the causal
// tail is short.
//
// Every workgroupBarrier() sits at entry-point scope in uniform control flow.
// Register blocks are explicit vec4 variables (no runtime-indexed arrays).
//
// Constraints (checked host-side in kernels._plan_tiled):
//   head_dim % 4 == 0 and <= 128; G = n_heads / n_kv_heads in {1, 2, 4, 8}.
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
// Dispatch: (the batch's blocks of BQ rows, n_kv_heads, 1) workgroups of 256
// threads; the host puts the blocks with the longest causal windows first.

@group(0) @binding(0) var<storage, read> q_batch: array<vec4<f32>>;
// #include "kv_vec4_{KV}.wgsl"
@group(0) @binding(3) var<storage, read_write> out_batch: array<vec4<f32>>;
// #struct PrefillParams
@group(0) @binding(4) var<storage, read> params: array<PrefillParams>;   // one block per workgroup (wid.x)
@group(0) @binding(5) var<storage, read> pages: array<u32>;
// #include "paging.wgsl"

const WG: u32 = 256u;
const R: u32 = 64u;                  // rows (query position x head) per workgroup
const TK: u32 = 32u;                 // keys per tile
const CV: u32 = 8u;                  // vec4 per head_dim chunk (32 dims)
const NEG_INF: f32 = -3.402823e+38;
const FLAG_NON_CAUSAL: u32 = 1u;

var<workgroup> stage: array<array<vec4<f32>, 32>, 32>;  // Q + K chunk [3c + i][.], then V tile [key][column]
var<workgroup> p_sh: array<array<vec4<f32>, 9>, R>;     // probabilities [row][key / 4] (8 used, padded)
var<workgroup> pm_sh: array<array<vec4<f32>, 4>, R>;    // partial row maxima [row][tc / 4][tc % 4]

// #include "tiled_common.wgsl"

// #include "prefill_write_row.wgsl"

@compute @workgroup_size(256, 1, 1)
fn attention_prefill_tiled(
    @builtin(local_invocation_id) lid: vec3<u32>,
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
) {
    let tid = lid.x;
    let prm = params[wid.x];                     // this block of query rows (of one item)
    // #include "prefill_params.wgsl"

    let kv_head = wid.y;
    let group = n_heads / n_kv_heads;
    let bq = R / group;                          // query positions per block
    let d4 = head_dim / 4u;
    let kv4 = kv_dim / 4u;
    let kv_off = kv_head * d4;
    let q_first = q_base;                        // the block's first row (the host puts the longest first)
    let q_last = min(q_first + bq, n_queries) - 1u;  // host guarantees q_first < n_queries
    let non_causal = (flags & FLAG_NON_CAUSAL) != 0u;
    var t_end = max_seq;                         // the block's widest window
    if !non_causal {
        t_end = min(start_pos + q_last + 1u, max_seq);
    }
    let nch = (d4 + CV - 1u) / CV;               // head_dim chunks per tile

    // ── staging roles: Q rows sq, sq + 32 and K key sq at chunk column sc; V keys vk + 8k at column vc ──
    let sq = tid % 8u + 8u * (tid / 64u);        // conflict-free stores, 64-byte row segments
    let sc = (tid / 8u) % 8u;
    let qa = q_first + sq % bq;
    let qa_ok = qa <= q_last;
    let qa_base = (q_off + qa * q_stride + (kv_head * group + sq / bq) * head_dim) / 4u;
    let qb = q_first + (sq + 32u) % bq;
    let qb_ok = qb <= q_last;
    let qb_base = (q_off + qb * q_stride + (kv_head * group + (sq + 32u) / bq) * head_dim) / 4u;
    let vk = tid / 32u;
    let vc = tid % 32u;

    // #include "tiled_roles.wgsl"

    // prefetch: the first tile's first chunk
    var pqa = vec4<f32>(0.0);
    var pqb = vec4<f32>(0.0);
    var pk = vec4<f32>(0.0);
    if sc < d4 {
        if qa_ok { pqa = q_batch[qa_base + sc]; }
        if qb_ok { pqb = q_batch[qb_base + sc]; }
        if sq < t_end { pk = key4(phys_row(table_off, page_shift, sq) * kv4 + kv_off + sc); }
    }
    var pv0 = vec4<f32>(0.0);
    var pv1 = vec4<f32>(0.0);
    var pv2 = vec4<f32>(0.0);
    var pv3 = vec4<f32>(0.0);

    for (var tb = 0u; tb < t_end; tb += TK) {
        // #include "tiled_scores_zero.wgsl"
        for (var ch = 0u; ch < nch; ch += 1u) {
            workgroupBarrier();
            stage[3u * sc][sq] = pqa;
            stage[3u * sc + 1u][sq] = pqb;
            stage[3u * sc + 2u][sq] = pk;
            workgroupBarrier();
            if ch + 1u < nch {
                let col = (ch + 1u) * CV + sc;
                pqa = vec4<f32>(0.0);
                pqb = vec4<f32>(0.0);
                pk = vec4<f32>(0.0);
                if col < d4 {
                    if qa_ok { pqa = q_batch[qa_base + col]; }
                    if qb_ok { pqb = q_batch[qb_base + col]; }
                    if tb + sq < t_end { pk = key4(phys_row(table_off, page_shift, tb + sq) * kv4 + kv_off + col); }
                }
            } else {
                pv0 = vec4<f32>(0.0);
                pv1 = vec4<f32>(0.0);
                pv2 = vec4<f32>(0.0);
                pv3 = vec4<f32>(0.0);
                if vc < d4 {
                    let vb = kv_off + vc;
                    if tb + vk < t_end { pv0 = value4(phys_row(table_off, page_shift, tb + vk) * kv4 + vb); }
                    if tb + vk + 8u < t_end { pv1 = value4(phys_row(table_off, page_shift, tb + vk + 8u) * kv4 + vb); }
                    if tb + vk + 16u < t_end { pv2 = value4(phys_row(table_off, page_shift, tb + vk + 16u) * kv4 + vb); }
                    if tb + vk + 24u < t_end { pv3 = value4(phys_row(table_off, page_shift, tb + vk + 24u) * kv4 + vb); }
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
        // ── scores of keys t0 = tb + tc, t1 = t0 + 16 ──
        let t0 = tb + tc;
        let t1 = t0 + 16u;
        let s00 = select(NEG_INF, hsum(a00) * scale, t0 < e0);
        let s01 = select(NEG_INF, hsum(a01) * scale, t1 < e0);
        let s10 = select(NEG_INF, hsum(a10) * scale, t0 < e1);
        let s11 = select(NEG_INF, hsum(a11) * scale, t1 < e1);
        let s20 = select(NEG_INF, hsum(a20) * scale, t0 < e2);
        let s21 = select(NEG_INF, hsum(a21) * scale, t1 < e2);
        let s30 = select(NEG_INF, hsum(a30) * scale, t0 < e3);
        let s31 = select(NEG_INF, hsum(a31) * scale, t1 < e3);
        // #include "tiled_softmax.wgsl"
        // (the V tile goes into `stage`, which no thread reads any more)
        stage[vk][vc] = pv0;
        stage[vk + 8u][vc] = pv1;
        stage[vk + 16u][vc] = pv2;
        stage[vk + 24u][vc] = pv3;
        // #include "tiled_probs.wgsl"
        // prefetch the next tile's first chunk
        if tb + TK < t_end {
            pqa = vec4<f32>(0.0);
            pqb = vec4<f32>(0.0);
            pk = vec4<f32>(0.0);
            if sc < d4 {
                if qa_ok { pqa = q_batch[qa_base + sc]; }
                if qb_ok { pqb = q_batch[qb_base + sc]; }
                if tb + TK + sq < t_end { pk = key4(phys_row(table_off, page_shift, tb + TK + sq) * kv4 + kv_off + sc); }
            }
        }
        // #include "tiled_values.wgsl"
    }

    // ── write the block's outputs: rows r0..r3, columns tc, tc + 16, and their log-sum-exp ──
    let lse_off = out_off + n_queries * out_stride;
    write_row(r0, l0, m0 + log(l0), o00, o01, q_first, q_last, bq, kv_head * group, head_dim, out_stride, d4, tc, out_off, lse_off, n_heads);
    write_row(r1, l1, m1 + log(l1), o10, o11, q_first, q_last, bq, kv_head * group, head_dim, out_stride, d4, tc, out_off, lse_off, n_heads);
    write_row(r2, l2, m2 + log(l2), o20, o21, q_first, q_last, bq, kv_head * group, head_dim, out_stride, d4, tc, out_off, lse_off, n_heads);
    write_row(r3, l3, m3 + log(l3), o30, o31, q_first, q_last, bq, kv_head * group, head_dim, out_stride, d4, tc, out_off, lse_off, n_heads);
}
