// Query-block flash attention over an f32 KV cache: the prefill path.
//
// The seed kernel (`attention_prefill.wgsl`) runs one workgroup per (head,
// query) and re-reads every K/V row once per (query, head). Here one workgroup
// takes R = 32 rows: a block of BQ = R / G consecutive query positions times
// the G query heads of one KV head's GQA group, and walks the K/V rows in tiles
// of TK staged once in workgroup memory for all R rows (coalesced vec4 loads,
// rows padded for conflict-free vec4 reads). Online softmax (Dao 2022) per row
// across tiles; each thread keeps 4 vec4 of one row's output in registers.
//
// Per tile: (1) stage K; (2) thread (row r, key pair) scores two keys with vec4
// dot products; (3) one thread per row updates the running max / sum and turns
// the scores into probabilities; (4) stage V; (5) thread (row r, column group)
// rescales and accumulates. Causal rows mask keys past their position; the tile
// loop runs to the end of the block's last row's window (uniform per workgroup).
//
// Every workgroupBarrier() sits at entry-point scope in uniform control flow.
//
// Constraints (checked host-side in kernels.plan_attention_prefill_tiled):
//   head_dim % 4 == 0 and <= 128; G = n_heads / n_kv_heads in {1, 2, 4, 8}.
//
// Bind group 0 (as attention_prefill.wgsl, whose params it shares but for one):
// @binding(0) q_batch:   array<vec4<f32>>  n_queries x q_stride floats
// @binding(1) k_cache:   array<vec4<f32>>  [cap, kv_dim]
// @binding(2) v_cache:   array<vec4<f32>>  [cap, kv_dim]
// @binding(3) out_batch: array<vec4<f32>>  n_queries x out_stride floats (rw)
// @binding(4) params:    array<u32, 12>
//   ( n_heads, n_kv_heads, head_dim, kv_dim, max_seq, scale_bits, start_pos,
//     n_queries, q_stride, out_stride, q_base, flags )
//   n_queries: query rows in q_batch (rows q_base + ... past it are skipped);
//   flags bit 0: non-causal.
//
// Dispatch: (ceil(rows / BQ), n_kv_heads, 1) workgroups of 256 threads; block
// x covers query rows q_base + x * BQ .. + BQ - 1.

@group(0) @binding(0) var<storage, read> q_batch: array<vec4<f32>>;
@group(0) @binding(1) var<storage, read> k_cache: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read> v_cache: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read_write> out_batch: array<vec4<f32>>;
@group(0) @binding(4) var<storage, read> params: array<u32, 12>;

const WG: u32 = 256u;
const R: u32 = 32u;                  // rows (query position x head) per workgroup
const TK: u32 = 16u;                 // keys per tile
const ROW4: u32 = 33u;               // padded tile row, in vec4 (head_dim/4 <= 32)
const NEG_INF: f32 = -3.402823e+38;
const FLAG_NON_CAUSAL: u32 = 1u;

var<workgroup> q_sh: array<vec4<f32>, 1024>;     // R * head_dim/4
var<workgroup> kv: array<vec4<f32>, 528>;        // TK * ROW4: K, then V
var<workgroup> p_sh: array<f32, 512>;            // R * TK scores, then probabilities
var<workgroup> m_sh: array<f32, R>;              // running max per row
var<workgroup> l_sh: array<f32, R>;              // running sum per row
var<workgroup> c_sh: array<f32, R>;              // this tile's rescale per row

@compute @workgroup_size(256, 1, 1)
fn attention_prefill_tiled(
    @builtin(local_invocation_id) lid: vec3<u32>,
    @builtin(workgroup_id) wid: vec3<u32>,
) {
    let tid = lid.x;
    let n_heads = params[0];
    let n_kv_heads = params[1];
    let head_dim = params[2];
    let kv_dim = params[3];
    let max_seq = params[4];
    let scale = bitcast<f32>(params[5]);
    let start_pos = params[6];
    let n_queries = params[7];
    let q_stride = params[8];
    let out_stride = params[9];
    let q_base = params[10];
    let flags = params[11];

    let kv_head = wid.y;
    let group = n_heads / n_kv_heads;
    let bq = R / group;                          // query positions per block
    let d4 = head_dim / 4u;
    let kv4 = kv_dim / 4u;
    let q_first = q_base + wid.x * bq;
    let q_last = min(q_first + bq, n_queries) - 1u;  // host guarantees q_first < n_queries
    let non_causal = (flags & FLAG_NON_CAUSAL) != 0u;
    var t_end = max_seq;                         // the block's widest window
    if !non_causal {
        t_end = min(start_pos + q_last + 1u, max_seq);
    }

    // ── the block's rows: row r = g * bq + b is head kv_head*G + g at query q_first + b ──
    for (var e = tid; e < R * d4; e += WG) {
        let r = e / d4;
        let c = e % d4;
        let qi = q_first + r % bq;
        let head = kv_head * group + r / bq;
        var v = vec4<f32>(0.0);
        if qi <= q_last {
            v = q_batch[(qi * q_stride + head * head_dim) / 4u + c];
        }
        q_sh[r * d4 + c] = v;
    }
    if tid < R {
        m_sh[tid] = NEG_INF;
        l_sh[tid] = 0.0;
    }

    // score phase: thread (row sr, keys sj and sj + 8); value phase: thread (row sr, columns)
    let sr = tid / 8u;
    let sj = tid % 8u;
    let s_qi = q_first + sr % bq;
    var s_end = t_end;                           // this row's window
    if !non_causal {
        s_end = min(start_pos + s_qi + 1u, max_seq);
    }
    var acc0 = vec4<f32>(0.0);
    var acc1 = vec4<f32>(0.0);
    var acc2 = vec4<f32>(0.0);
    var acc3 = vec4<f32>(0.0);
    let kv_off = kv_head * head_dim / 4u;

    for (var tb = 0u; tb < t_end; tb += TK) {
        let nk = min(TK, t_end - tb);
        // (1) K tile
        workgroupBarrier();
        for (var e = tid; e < nk * d4; e += WG) {
            kv[(e / d4) * ROW4 + e % d4] = k_cache[(tb + e / d4) * kv4 + kv_off + e % d4];
        }
        workgroupBarrier();
        // (2) scores of keys sj, sj + 8 for row sr
        var s0 = 0.0;
        var s1 = 0.0;
        for (var c = 0u; c < d4; c += 1u) {
            let q = q_sh[sr * d4 + c];
            s0 += dot(q, kv[sj * ROW4 + c]);
            s1 += dot(q, kv[(sj + 8u) * ROW4 + c]);
        }
        let t0 = tb + sj;
        p_sh[sr * TK + sj] = select(NEG_INF, s0 * scale, sj < nk && t0 < s_end);
        p_sh[sr * TK + sj + 8u] = select(NEG_INF, s1 * scale, sj + 8u < nk && t0 + 8u < s_end);
        workgroupBarrier();
        // #include "tiled_row_softmax.wgsl"
        // (4) V tile (the K tile is no longer read)
        for (var e = tid; e < nk * d4; e += WG) {
            kv[(e / d4) * ROW4 + e % d4] = v_cache[(tb + e / d4) * kv4 + kv_off + e % d4];
        }
        workgroupBarrier();
        // (5) rescale and accumulate columns sj, sj + 8, sj + 16, sj + 24 of row sr
        let corr = c_sh[sr];
        acc0 *= corr;
        acc1 *= corr;
        acc2 *= corr;
        acc3 *= corr;
        for (var j = 0u; j < nk; j += 1u) {
            let p = p_sh[sr * TK + j];
            let o = j * ROW4 + sj;
            acc0 += p * kv[o];
            acc1 += p * kv[o + 8u];
            acc2 += p * kv[o + 16u];
            acc3 += p * kv[o + 24u];
        }
    }

    // ── write the block's outputs ──
    let qi = q_first + sr % bq;
    if qi <= q_last {
        let head = kv_head * group + sr / bq;
        let inv = 1.0 / l_sh[sr];
        let o = (qi * out_stride + head * head_dim) / 4u;
        if sj < d4 { out_batch[o + sj] = acc0 * inv; }
        if sj + 8u < d4 { out_batch[o + sj + 8u] = acc1 * inv; }
        if sj + 16u < d4 { out_batch[o + sj + 16u] = acc2 * inv; }
        if sj + 24u < d4 { out_batch[o + sj + 24u] = acc3 * inv; }
    }
}
