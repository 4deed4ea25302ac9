// Merge of split-KV partials (flash-decoding's second pass), for both formats.
//
// The split kernels (`attention_split.wgsl`, `flash_attention_tqx_split.wgsl`)
// leave, for every (query row, query head, split), the split's max m, its sum
// of exponentials l and its unnormalized accumulator acc[d]. This pass combines
// them with the usual rescaling:
//
//   M = max_s m_s;  L = sum_s l_s exp(m_s - M);  out = sum_s acc_s exp(m_s - M) / L
//
// One 256-thread workgroup per (query head, query row). Thread (c, g) owns
// the vec4 column c of the accumulator and walks splits g, g + NG, ... (NG =
// 256 / (head_dim / 4) groups), four per step so several loads are in flight,
// merging them online into its own (m, l, acc); the NG groups are combined in
// workgroup memory with the same rescaling. One barrier before the combine
// (two more, plus the butterfly's, with ROTATE).
//
// With flags bit 0 (ROTATE) it then applies the TurboQuant epilogue to the
// rotated-space result: out = s * (H out) / sqrt(d) with the layer's polar signs
// (one Walsh-Hadamard butterfly in workgroup memory). The splits from `n_rotated` on
// (a windowed attend's exact rows: the sinks and the recent window, read by the
// plain split kernel with the plain queries) share the max and the sum but are
// added after the rotation, in the original basis. f32 attends leave the bit
// clear and may bind any read-only buffer as `signs`.
//
// Bind group 0 (one dispatch merges a batch of attends, one params block per
// query row; a single attend is the batch of one):
// @binding(0) partial: array<vec4<f32>>  every item's [acc: n_part*d | m: n_part |
//                                  l: n_part] floats at word part_off (a multiple
//                                  of 4), n_part = q_total * n_heads * n_splits
// @binding(1) out_batch: array<f32> every item's n_queries x out_stride floats at
//                                  word out_off, then its log-sum-exp M + log(L)
//                                  of each (query, head), q_total x n_heads floats
//                                  (rw; gpu/kernels.py "LSE")
// @binding(2) mparams: array<MergeParams> (gpu/params.py MERGE_PARAMS), block wid.y
//                                  for query row q_row of its item
// @binding(3) signs: array<f32>   the item's layer's polar signs at word sign_off
//
// Dispatch: (n_heads, query rows of the batch, 1) workgroups of 256 threads.
@group(0) @binding(0) var<storage, read> partial: array<vec4<f32>>;
@group(0) @binding(1) var<storage, read_write> out_batch: array<f32>;
// #struct MergeParams
@group(0) @binding(2) var<storage, read> mparams: array<MergeParams>;   // one block per query row (wid.y)
@group(0) @binding(3) var<storage, read> signs: array<f32>;

const WG: u32 = 256u;
const NEG_INF: f32 = -3.402823e+38;
const MAX_HEAD_DIM: u32 = 128u;
const FLAG_ROTATE: u32 = 1u;

// per thread group: running max, sum, accumulator column
var<workgroup> gm: array<f32, WG>;
var<workgroup> gl: array<f32, WG>;
var<workgroup> gacc: array<vec4<f32>, WG>;
var<workgroup> gacc_x: array<vec4<f32>, WG>;   // the splits past n_rotated (a windowed attend's exact rows)
var<workgroup> acc_sh: array<f32, MAX_HEAD_DIM>;
var<workgroup> exact_sh: array<f32, MAX_HEAD_DIM>;

// One float of the partial buffer (bound as vec4; the m and l regions start at
// multiples of four floats).
fn pf(i: u32) -> f32 {
    return partial[i / 4u][i % 4u];
}

@compute @workgroup_size(256, 1, 1)
fn attention_merge(
    @builtin(local_invocation_id) lid: vec3<u32>,
    @builtin(workgroup_id) wid: vec3<u32>,
) {
    let tid = lid.x;
    let mp = mparams[wid.y];
    let n_heads = mp.n_heads;
    let head_dim = mp.head_dim;
    let n_splits = mp.n_splits;
    let q_total = mp.q_total;
    let part_off = mp.part_off;                // the item's partials (a multiple of 4)
    let out_off = mp.out_off;
    let out_stride = mp.out_stride;
    let sign_off = mp.sign_off;
    let flags = mp.flags;
    let head = wid.x;
    if head >= n_heads {
        return;                                // an item of the batch with fewer heads
    }
    let q_row = mp.q_row;
    let q_idx = q_row;
    let n_part = q_total * n_heads * n_splits;
    let base = (q_idx * n_heads + head) * n_splits;
    let m_off = part_off + n_part * head_dim + base;
    let l_off = part_off + n_part * (head_dim + 1u) + base;
    let acc4 = part_off / 4u;                  // the item's accumulators, as vec4
    let d4 = head_dim / 4u;
    let n_grp = WG / d4;
    let c = tid % d4;
    let g = tid / d4;

    // ── each group merges its splits online: four per step ──
    // splits [0, n_rotated) accumulate in acc (rotated space with ROTATE), the others
    // in acc_x (a windowed attend's exact rows, never rotated); one max and sum for all
    let n_rotated = mp.n_rotated;
    var m = NEG_INF;
    var l = 0.0;
    var acc = vec4<f32>(0.0);
    var acc_x = vec4<f32>(0.0);
    if g < n_grp {
        var s = g;
        for (; s + 3u * n_grp < n_splits; s += 4u * n_grp) {
            let s1 = s + n_grp;
            let s2 = s1 + n_grp;
            let s3 = s2 + n_grp;
            let ms = vec4<f32>(pf(m_off + s), pf(m_off + s1), pf(m_off + s2), pf(m_off + s3));
            let ls = vec4<f32>(pf(l_off + s), pf(l_off + s1), pf(l_off + s2), pf(l_off + s3));
            let v0 = partial[acc4 + (base + s) * d4 + c];
            let v1 = partial[acc4 + (base + s1) * d4 + c];
            let v2 = partial[acc4 + (base + s2) * d4 + c];
            let v3 = partial[acc4 + (base + s3) * d4 + c];
            let mn = max(m, max(max(ms.x, ms.y), max(ms.z, ms.w)));
            let r = exp(m - mn);
            let w = exp(ms - vec4<f32>(mn));
            l = l * r + dot(ls, w);
            // 1 or 0 per split: the products are w's bits or zero
            let kr = select(vec4<f32>(0.0), vec4<f32>(1.0), vec4<u32>(s, s1, s2, s3) < vec4<u32>(n_rotated));
            let wr = w * kr;
            let wx = w * (vec4<f32>(1.0) - kr);
            acc = acc * r + (v0 * wr.x + v1 * wr.y) + (v2 * wr.z + v3 * wr.w);
            acc_x = acc_x * r + (v0 * wx.x + v1 * wx.y) + (v2 * wx.z + v3 * wx.w);
            m = mn;
        }
        for (; s < n_splits; s += n_grp) {
            let ms = pf(m_off + s);
            let mn = max(m, ms);
            let r = exp(m - mn);
            let w = exp(ms - mn);
            l = l * r + pf(l_off + s) * w;
            let v = partial[acc4 + (base + s) * d4 + c];
            if s < n_rotated {
                acc = acc * r + v * w;
                acc_x = acc_x * r;
            } else {
                acc = acc * r;
                acc_x = acc_x * r + v * w;
            }
            m = mn;
        }
    }
    gm[tid] = m;
    gl[tid] = l;
    gacc[tid] = acc;
    gacc_x[tid] = acc_x;
    workgroupBarrier();

    // ── combine the groups: thread c < d4 owns column c ──
    let rotate = (flags & FLAG_ROTATE) != 0u;
    let mixed = n_rotated < n_splits;        // uniform: exact splits to add after the rotation
    var o = vec4<f32>(0.0);
    var ox = vec4<f32>(0.0);
    var inv_l = 0.0;
    if tid < d4 {
        var mx = NEG_INF;
        for (var k = 0u; k < n_grp; k += 1u) {
            mx = max(mx, gm[k * d4]);
        }
        var lt = 0.0;
        for (var k = 0u; k < n_grp; k += 1u) {
            let w = exp(gm[k * d4] - mx);
            lt += gl[k * d4] * w;
            o += gacc[k * d4 + tid] * w;
            ox += gacc_x[k * d4 + tid] * w;
        }
        inv_l = 1.0 / lt;
        if tid == 0u {
            out_batch[out_off + q_total * out_stride + q_idx * n_heads + head] = mx + log(lt);
        }
        var inv = inv_l;
        if rotate {
            inv = inv / sqrt(f32(head_dim));
        }
        o *= inv;
        if !rotate && mixed {
            o += ox * inv_l;
        }
        if !rotate {
            let ob = out_off + q_idx * out_stride + head * head_dim + 4u * tid;
            out_batch[ob] = o.x;
            out_batch[ob + 1u] = o.y;
            out_batch[ob + 2u] = o.z;
            out_batch[ob + 3u] = o.w;
        }
    }

    // ── TurboQuant: inverse RHT of the rotated-space result ──
    if rotate {
        if tid < d4 {
            let e = ox * inv_l;                  // read after the butterfly's first barrier
            exact_sh[4u * tid] = e.x;
            exact_sh[4u * tid + 1u] = e.y;
            exact_sh[4u * tid + 2u] = e.z;
            exact_sh[4u * tid + 3u] = e.w;
            acc_sh[4u * tid] = o.x;
            acc_sh[4u * tid + 1u] = o.y;
            acc_sh[4u * tid + 2u] = o.z;
            acc_sh[4u * tid + 3u] = o.w;
        }
    // #include "butterfly.wgsl" ARR=acc_sh
        if tid < head_dim {
            var y = acc_sh[tid] * signs[sign_off + tid];
            if mixed {
                y += exact_sh[tid];                 // the exact rows' part, in the original basis
            }
            out_batch[out_off + q_idx * out_stride + head * head_dim + tid] = y;
        }
    }
}
