// Split-KV attention over an f32 KV cache, subgroup variant (decode path).
//
// Same work split, partial layout, params and bindings as `attention_split.wgsl`
// (read its header); used when the device was opened with the `subgroup`
// feature. The difference is how a key is scored and how V is read:
//
//   scores: one subgroup scores one key at a time. Lane c reads vec4 column c
//           (and c + sg, ... when head_dim/4 > subgroup size) of the key row
//           straight from global memory (consecutive lanes, consecutive 16-byte
//           words: one coalesced 512-byte read per key at head_dim 128), forms
//           its share of the dot product with every query head of the GQA
//           group, and subgroupAdd finishes the G dot products. No staging, no
//           barriers per tile.
//   values: thread (c, grp) owns output column c of every head of the group
//           (G vec4 registers) and reads V rows grp, grp + NG, ... straight
//           from global memory (coalesced), two rows per step.
//
// Subgroup builtins need no `enable` line with this naga once the device has
// the feature. Calls to subgroupAdd sit in control flow uniform across the
// workgroup: every subgroup runs the same number of key steps, lanes of a
// subgroup past the split's end contribute zeros.
//
// Dispatch: (n_splits, n_kv_heads, n_queries) workgroups of 256 threads.

@group(0) @binding(0) var<storage, read> q_batch: array<f32>;
@group(0) @binding(1) var<storage, read> k_cache: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read> v_cache: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read_write> partial: array<f32>;
@group(0) @binding(4) var<storage, read> params: array<u32, 16>;

const WG: u32 = 256u;
const MAX_GROUP: u32 = 8u;
const MAX_SCORES: u32 = 2048u;       // G * split_len
const NEG_INF: f32 = -3.402823e+38;
const FLAG_NON_CAUSAL: u32 = 1u;

var<workgroup> q_sh: array<vec4<f32>, 256>;      // MAX_GROUP * head_dim/4
var<workgroup> scores: array<f32, MAX_SCORES>;   // [G][split_len]
var<workgroup> red: array<f32, WG>;
var<workgroup> stat: array<f32, MAX_GROUP>;      // per-head split max
var<workgroup> sums: array<vec4<f32>, 1024>;     // row-group partial sums, 4 heads per pass

@compute @workgroup_size(256, 1, 1)
fn attention_split_f32_sg(
    @builtin(local_invocation_id) lid: vec3<u32>,
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(subgroup_invocation_id) lane_id: u32,
    @builtin(subgroup_size) sg_size: u32,
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
    let seg = WG / group;
    let d4 = head_dim / 4u;
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
    let row0 = (t0 * kv_dim + kv_head * head_dim) / 4u;
    let kv4 = kv_dim / 4u;

    let q_off = q_idx * q_stride + kv_head * group * head_dim;
    for (var e = tid; e < group * d4; e += WG) {
        let o = q_off + 4u * e;
        q_sh[e] = vec4<f32>(q_batch[o], q_batch[o + 1u], q_batch[o + 2u], q_batch[o + 3u]);
    }
    workgroupBarrier();

    // ── 1. scores: one subgroup per key ──
    let n_sg = WG / sg_size;                    // subgroups in the workgroup
    let sg = tid / sg_size;
    for (var tb = 0u; tb < n_t; tb += n_sg) {
        let t = tb + sg;
        let live = t < n_t;
        var p0 = 0.0;
        var p1 = 0.0;
        var p2 = 0.0;
        var p3 = 0.0;
        var p4 = 0.0;
        var p5 = 0.0;
        var p6 = 0.0;
        var p7 = 0.0;
        if live {
            for (var c = lane_id; c < d4; c += sg_size) {
                let k = k_cache[row0 + t * kv4 + c];
                p0 += dot(q_sh[c], k);
                if group > 1u { p1 += dot(q_sh[d4 + c], k); }
                if group > 2u {
                    p2 += dot(q_sh[2u * d4 + c], k);
                    p3 += dot(q_sh[3u * d4 + c], k);
                }
                if group > 4u {
                    p4 += dot(q_sh[4u * d4 + c], k);
                    p5 += dot(q_sh[5u * d4 + c], k);
                    p6 += dot(q_sh[6u * d4 + c], k);
                    p7 += dot(q_sh[7u * d4 + c], k);
                }
            }
        }
        let s0 = subgroupAdd(vec4<f32>(p0, p1, p2, p3));
        let s1 = subgroupAdd(vec4<f32>(p4, p5, p6, p7));
        if live && lane_id == 0u {
            scores[t] = s0.x * scale;
            if group > 1u { scores[split_len + t] = s0.y * scale; }
            if group > 2u {
                scores[2u * split_len + t] = s0.z * scale;
                scores[3u * split_len + t] = s0.w * scale;
            }
            if group > 4u {
                scores[4u * split_len + t] = s1.x * scale;
                scores[5u * split_len + t] = s1.y * scale;
                scores[6u * split_len + t] = s1.z * scale;
                scores[7u * split_len + t] = s1.w * scale;
            }
        }
    }
    workgroupBarrier();

    // ── 2. per-head max and sum over this split ──
    let rh = tid / seg;
    let lane = tid % seg;
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

    // ── 3. V: thread (column c, row group grp), all G heads, rows from global ──
    let n_grp = WG / d4;
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
    if grp < n_grp {
        for (var t = grp; t < n_t; t += n_grp) {
            let v = v_cache[row0 + t * kv4 + c];
            a0 += scores[t] * v;
            if group > 1u { a1 += scores[split_len + t] * v; }
            if group > 2u {
                a2 += scores[2u * split_len + t] * v;
                a3 += scores[3u * split_len + t] * v;
            }
            if group > 4u {
                a4 += scores[4u * split_len + t] * v;
                a5 += scores[5u * split_len + t] * v;
                a6 += scores[6u * split_len + t] * v;
                a7 += scores[7u * split_len + t] * v;
            }
        }
    }

    // ── sum the row groups; write the partial of each head ──
    let n_part = q_total * n_heads * n_splits;
    let pbase = (q_idx * n_heads + kv_head * group) * n_splits + split;
    if tid < group {
        let pi = pbase + tid * n_splits;
        partial[n_part * head_dim + pi] = stat[tid];
        partial[n_part * (head_dim + 1u) + pi] = red[tid * seg];
    }
    for (var h0 = 0u; h0 < group; h0 += 4u) {
        if grp < n_grp {
            let o = grp * d4 + c;
            if h0 == 0u {
                sums[o] = a0;
                sums[WG + o] = a1;
                sums[2u * WG + o] = a2;
                sums[3u * WG + o] = a3;
            } else {
                sums[o] = a4;
                sums[WG + o] = a5;
                sums[2u * WG + o] = a6;
                sums[3u * WG + o] = a7;
            }
        }
        workgroupBarrier();
        let hh = tid / d4;
        let cc = tid % d4;
        if hh < 4u && h0 + hh < group {
            var sum = vec4<f32>(0.0);
            for (var g = 0u; g < n_grp; g += 1u) {
                sum += sums[hh * WG + g * d4 + cc];
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
