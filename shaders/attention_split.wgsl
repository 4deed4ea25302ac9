// Split-KV attention (flash-decoding) over an f32 KV cache: the decode path.
//
// The seed kernel (`attention_prefill.wgsl`) runs one workgroup per (head,
// query): at decode that is 32 workgroups on a 132-SM GPU, each thread walking
// a whole key row with a `kv_dim` stride between threads. Here the context is
// cut into splits of `split_len` timesteps and one workgroup handles
// (split, KV head, query row) for ALL the query heads of that KV head's GQA
// group, so each K/V row is read once per query row instead of once per query
// head, and thousands of workgroups are in flight. Each workgroup writes a
// partial (max, sum, unnormalized accumulator) per query head; the merge kernel
// (`attention_merge.wgsl`) combines the splits.
//
// Within a split (at most MAX_SCORES / G timesteps):
//   1. K tiles of TK rows are staged in workgroup memory with coalesced vec4
//      loads (consecutive threads read consecutive 16-byte words of a row),
//      rows padded to head_dim + 1 floats so the score phase is bank-conflict
//      free; thread (gi, j) scores query head gi against row j of the tile.
//   2. Per query head: max and sum of exp over the split's scores (inlined
//      tree reductions over segments of WG / G threads).
//   3. V tiles are staged the same way; thread (gi, x) accumulates
//      sum_t p[gi][t] * V[t][x] from workgroup memory.
//
// Every workgroupBarrier() sits at entry-point scope in uniform control flow:
// loop bounds depend only on params and the workgroup id (naga's SPIR-V path
// miscompiles a barrier reached through a function call inside a loop).
//
// Constraints (checked host-side in kernels.plan_attention_split):
//   head_dim % 4 == 0 and <= 128; G = n_heads / n_kv_heads in {1, 2, 4, 8};
//   split_len a multiple of TK with G * split_len <= MAX_SCORES.
//
// Bind group 0:
// @binding(0) q_batch:  array<f32>        n_queries x q_stride floats
// @binding(1) k_cache:  array<vec4<f32>>  [cap, kv_dim] (row t at t * kv_dim floats)
// @binding(2) v_cache:  array<vec4<f32>>  [cap, kv_dim]
// @binding(3) partial:  array<f32>        [acc: n_q*H*n_splits*d | m: n_q*H*n_splits | l: same] (rw)
// @binding(4) params:   array<u32, 16>
//   ( n_heads, n_kv_heads, head_dim, kv_dim, max_seq, scale_bits, start_pos,
//     split_len, q_stride, n_splits, q_base, flags, q_total, _pad0, _pad1, _pad2 )
//   flags bit 0: non-causal (every row attends to all max_seq timesteps).
//   q_total: query rows in the partial buffer (its row stride); query row
//   q_base + workgroup_id.z is processed.
//
// Dispatch: (n_splits, n_kv_heads, n_queries) workgroups of 256 threads.

@group(0) @binding(0) var<storage, read> q_batch: array<f32>;
@group(0) @binding(1) var<storage, read> k_cache: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read> v_cache: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read_write> partial: array<f32>;
@group(0) @binding(4) var<storage, read> params: array<u32, 16>;

const WG: u32 = 256u;
const TK: u32 = 32u;                 // K rows per staged tile
const MAX_HEAD_DIM: u32 = 128u;
const MAX_GROUP: u32 = 8u;
const MAX_SCORES: u32 = 2048u;       // G * split_len
const ROW: u32 = 129u;               // padded tile row (MAX_HEAD_DIM + 1)
const NEG_INF: f32 = -3.402823e+38;
const FLAG_NON_CAUSAL: u32 = 1u;

var<workgroup> q_sh: array<f32, 1024>;            // MAX_GROUP * MAX_HEAD_DIM
var<workgroup> k_tile: array<f32, 4128>;          // TK * ROW
var<workgroup> scores: array<f32, MAX_SCORES>;    // [G][split_len]
var<workgroup> red: array<f32, WG>;
var<workgroup> stat: array<f32, MAX_GROUP>;     // per-head split max

@compute @workgroup_size(256, 1, 1)
fn attention_split_f32(
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
    let split_len = params[7];
    let q_stride = params[8];
    let n_splits = params[9];
    let q_base = params[10];
    let flags = params[11];
    let q_total = params[12];

    let split = wid.x;
    let kv_head = wid.y;
    let q_idx = q_base + wid.z;
    let group = n_heads / n_kv_heads;
    let seg = WG / group;                      // threads per query head in reductions
    let pos_q = start_pos + q_idx;
    var seq_len = min(pos_q + 1u, max_seq);
    if (flags & FLAG_NON_CAUSAL) != 0u {
        seq_len = max_seq;
    }
    let t0 = split * split_len;
    var n_t = 0u;
    if t0 < seq_len {
        n_t = min(split_len, seq_len - t0);
    }

    // ── the group's query heads (contiguous: heads kv_head*G .. +G-1) ──
    let q_off = q_idx * q_stride + kv_head * group * head_dim;
    for (var e = tid; e < group * head_dim; e += WG) {
        q_sh[e] = q_batch[q_off + e];
    }
    workgroupBarrier();

    // ── 1. scores, one staged K tile at a time ──
    let d4 = head_dim / 4u;
    let gi = tid / TK;                           // score phase: query head ...
    let j = tid % TK;                            // ... against tile row j
    for (var tb = 0u; tb < n_t; tb += TK) {
        let nk = min(TK, n_t - tb);
        for (var e = tid; e < nk * d4; e += WG) {
            let row = e / d4;
            let part = e % d4;
            let kv = k_cache[((t0 + tb + row) * kv_dim + kv_head * head_dim) / 4u + part];
            let o = row * ROW + 4u * part;
            k_tile[o] = kv.x;
            k_tile[o + 1u] = kv.y;
            k_tile[o + 2u] = kv.z;
            k_tile[o + 3u] = kv.w;
        }
        workgroupBarrier();
        if gi < group && j < nk {
            var dot = 0.0;
            let qo = gi * head_dim;
            let ko = j * ROW;
            for (var x = 0u; x < head_dim; x += 1u) {
                dot += q_sh[qo + x] * k_tile[ko + x];
            }
            scores[gi * split_len + tb + j] = dot * scale;
        }
        workgroupBarrier();
    }

    // ── 2. per-head max and sum over this split ──
    let rh = tid / seg;                          // reduction phase: query head ...
    let lane = tid % seg;                        // ... and lane within its segment
    var m = NEG_INF;
    if rh < group {
        for (var t = lane; t < n_t; t += seg) {
            m = max(m, scores[rh * split_len + t]);
        }
    }
    red[tid] = m;
    for (var s = seg / 2u; s > 0u; s = s / 2u) {
        workgroupBarrier();
        if lane < s {
            red[tid] = max(red[tid], red[tid + s]);
        }
    }
    workgroupBarrier();
    if lane == 0u && rh < group {
        stat[rh] = red[tid];
    }
    workgroupBarrier();
    var l = 0.0;
    if rh < group {
        let mx = stat[rh];
        for (var t = lane; t < n_t; t += seg) {
            let p = exp(scores[rh * split_len + t] - mx);
            scores[rh * split_len + t] = p;
            l += p;
        }
    }
    red[tid] = l;
    for (var s = seg / 2u; s > 0u; s = s / 2u) {
        workgroupBarrier();
        if lane < s {
            red[tid] += red[tid + s];
        }
    }
    workgroupBarrier();

    // ── 3. V accumulation; write the partial (m, l, acc) of each query head ──
    let n_part = q_total * n_heads * n_splits;
    let pbase = (q_idx * n_heads + kv_head * group) * n_splits + split;  // head gi = 0
    if tid < group {
        let pi = pbase + tid * n_splits;
        partial[n_part * head_dim + pi] = stat[tid];                 // m (NEG_INF if empty)
        partial[n_part * (head_dim + 1u) + pi] = red[tid * seg];     // l (0 if empty)
    }
    // V tiles are staged like K tiles (vec4 loads, all independent, coalesced),
    // then thread (g2, x) accumulates its outputs from workgroup memory.
    var acc0 = 0.0;
    var acc1 = 0.0;
    var acc2 = 0.0;
    var acc3 = 0.0;
    for (var tb = 0u; tb < n_t; tb += TK) {
        let nk = min(TK, n_t - tb);
        for (var e = tid; e < nk * d4; e += WG) {
            let row = e / d4;
            let part = e % d4;
            let vv = v_cache[((t0 + tb + row) * kv_dim + kv_head * head_dim) / 4u + part];
            let o = row * ROW + 4u * part;
            k_tile[o] = vv.x;
            k_tile[o + 1u] = vv.y;
            k_tile[o + 2u] = vv.z;
            k_tile[o + 3u] = vv.w;
        }
        workgroupBarrier();
        // up to 4 outputs per thread (group * head_dim <= 1024 = 4 * WG)
        for (var r = 0u; r < 4u; r += 1u) {
            let e = tid + r * WG;
            if e < group * head_dim {
                let g2 = e / head_dim;
                let x = e % head_dim;
                var a = 0.0;
                for (var t = 0u; t < nk; t += 1u) {
                    a += scores[g2 * split_len + tb + t] * k_tile[t * ROW + x];
                }
                if r == 0u { acc0 += a; }
                if r == 1u { acc1 += a; }
                if r == 2u { acc2 += a; }
                if r == 3u { acc3 += a; }
            }
        }
        workgroupBarrier();
    }
    for (var r = 0u; r < 4u; r += 1u) {
        let e = tid + r * WG;
        if e < group * head_dim {
            var a = acc0;
            if r == 1u { a = acc1; }
            if r == 2u { a = acc2; }
            if r == 3u { a = acc3; }
            partial[(pbase + (e / head_dim) * n_splits) * head_dim + e % head_dim] = a;
        }
    }
}
