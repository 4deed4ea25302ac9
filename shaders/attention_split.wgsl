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
//      rows padded to head_dim/4 + 1 vec4 so that the score phase's vec4 reads
//      are bank-conflict free; thread (gi, j) scores query head gi against tile
//      row j with vec4 dot products (q and k both read as vec4).
//   2. Per query head: max and sum of exp over the split's scores (inlined
//      tree reductions over segments of WG / G threads).
//   3. V tiles are staged the same way. Thread (c, grp) owns the vec4 column c
//      of the output for EVERY query head of the group (G vec4 accumulators in
//      registers, so a V element is read once from workgroup memory for all G
//      heads) and takes every NG-th row of the tile; the NG row groups are
//      summed in workgroup memory at the end.
//
// Every workgroupBarrier() sits at entry-point scope in uniform control flow:
// loop bounds depend only on params and the workgroup id (naga's SPIR-V path
// miscompiles a barrier reached through a function call inside a loop).
//
// Constraints (checked host-side in kernels.plan_attention_split_f32):
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
const TK: u32 = 32u;                 // K/V rows per staged tile
const MAX_D4: u32 = 32u;             // head_dim / 4 <= 32
const ROW4: u32 = 33u;               // padded tile row, in vec4
const MAX_GROUP: u32 = 8u;
const MAX_SCORES: u32 = 2048u;       // G * split_len
const NEG_INF: f32 = -3.402823e+38;
const FLAG_NON_CAUSAL: u32 = 1u;

var<workgroup> q_sh: array<vec4<f32>, 256>;      // MAX_GROUP * MAX_D4
var<workgroup> tile: array<vec4<f32>, 1056>;     // TK * ROW4 (K, then V; then the row-group sums)
var<workgroup> scores: array<f32, MAX_SCORES>;   // [G][split_len]
var<workgroup> red: array<f32, WG>;
var<workgroup> stat: array<f32, MAX_GROUP>;      // per-head split max

@compute @workgroup_size(256, 1, 1)
fn attention_split_f32(
    @builtin(local_invocation_id) lid: vec3<u32>,
    @builtin(workgroup_id) wid: vec3<u32>,
) {
    // #include "split_f32_prologue.wgsl"

    // ── 1. scores, one staged K tile at a time ──
    let gi = tid / TK;                           // score phase: query head ...
    let j = tid % TK;                            // ... against tile row j
    for (var tb = 0u; tb < n_t; tb += TK) {
        let nk = min(TK, n_t - tb);
        for (var e = tid; e < nk * d4; e += WG) {
            let row = e / d4;
            let c = e % d4;
            tile[row * ROW4 + c] = k_cache[row0 + (tb + row) * kv4 + c];
        }
        workgroupBarrier();
        if gi < group && j < nk {
            var dot = vec4<f32>(0.0);
            let qo = gi * d4;
            let ko = j * ROW4;
            for (var c = 0u; c < d4; c += 1u) {
                dot += q_sh[qo + c] * tile[ko + c];
            }
            scores[gi * split_len + tb + j] = (dot.x + dot.y + dot.z + dot.w) * scale;
        }
        workgroupBarrier();
    }

    // #include "split_softmax.wgsl" WEIGHT="p"

    // ── 3. V: thread (column c, row group grp) accumulates all G heads ──
    let n_grp = WG / d4;                         // row groups (8 for d = 128)
    let c = tid % d4;
    let grp = tid / d4;
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
        for (var e = tid; e < nk * d4; e += WG) {
            let row = e / d4;
            let cc = e % d4;
            tile[row * ROW4 + cc] = v_cache[row0 + (tb + row) * kv4 + cc];
        }
        workgroupBarrier();
        if grp < n_grp {
            for (var t = grp; t < nk; t += n_grp) {
                let v = tile[t * ROW4 + c];
                let st = tb + t;
                // #include "accumulate_heads.wgsl" T=st V=v
            }
        }
        workgroupBarrier();
    }

    // ── sum the row groups (through `tile`), write the partial of each head ──
    let n_part = q_total * n_heads * n_splits;
    let pbase = (q_idx * n_heads + kv_head * group) * n_splits + split;  // head gi = 0
    if tid < group {
        let pi = pbase + tid * n_splits;
        partial[n_part * head_dim + pi] = stat[tid];                 // m (NEG_INF if empty)
        partial[n_part * (head_dim + 1u) + pi] = red[tid * seg];     // l (0 if empty)
    }
    // `tile` holds n_grp * G * d4 vec4 = WG * G / ... <= 8 * 32 * 8 / ... ; done in
    // passes of at most 4 heads so it fits (n_grp * d4 = WG vec4 per head).
    for (var h0 = 0u; h0 < group; h0 += 4u) {
        if grp < n_grp {
            let o = grp * d4 + c;
            if h0 == 0u {
                tile[o] = a0;
                tile[WG + o] = a1;
                tile[2u * WG + o] = a2;
                tile[3u * WG + o] = a3;
            } else {
                tile[o] = a4;
                tile[WG + o] = a5;
                tile[2u * WG + o] = a6;
                tile[3u * WG + o] = a7;
            }
        }
        workgroupBarrier();
        // thread -> (head hh of this pass, vec4 column cc)
        let hh = tid / d4;
        let cc = tid % d4;
        if hh < 4u && h0 + hh < group {
            var sum = vec4<f32>(0.0);
            for (var g = 0u; g < n_grp; g += 1u) {
                sum += tile[hh * WG + g * d4 + cc];
            }
            let o = (pbase + (h0 + hh) * n_splits) * head_dim + 4u * cc;
            partial[o] = sum.x;
            partial[o + 1u] = sum.y;
            partial[o + 2u] = sum.z;
            partial[o + 3u] = sum.w;
        }
        workgroupBarrier();
    }
}
