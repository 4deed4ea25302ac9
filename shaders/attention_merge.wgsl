// Merge of split-KV partials (flash-decoding's second pass), for both formats.
//
// The split kernels (`attention_split.wgsl`, `flash_attention_tq_split.wgsl`)
// leave, for every (query row, query head, split), the split's max m, its sum
// of exponentials l and its unnormalized accumulator acc[d]. This pass combines
// them with the usual rescaling:
//
//   M = max_s m_s;  L = sum_s l_s exp(m_s - M);  out = sum_s acc_s exp(m_s - M) / L
//
// One 256-thread workgroup per (query head, query row): M and L are tree
// reductions over the splits; the accumulators are summed by 256 / head_dim
// thread groups (each over every P-th split, four splits per step so several
// loads are in flight), then combined in workgroup memory.
//
// With flags bit 0 (ROTATE) it then applies the TurboQuant epilogue to the
// rotated-space result: out = s * (H out) / sqrt(d) with the layer's polar signs
// (one Walsh-Hadamard butterfly in workgroup memory). f32 attends leave the bit
// clear and may bind any read-only buffer as `signs`.
//
// Bind group 0:
// @binding(0) partial: array<f32>  [acc: n_part*d | m: n_part | l: n_part],
//                                  n_part = q_total * n_heads * n_splits
// @binding(1) out_batch: array<f32> n_queries x out_stride floats (rw)
// @binding(2) mparams: array<u32, 8>
//   ( n_heads, head_dim, n_splits, q_total, q_base, out_stride, sign_off, flags )
// @binding(3) signs: array<f32>
//
// Dispatch: (n_heads, n_queries, 1) workgroups of 256 threads.

@group(0) @binding(0) var<storage, read> partial: array<f32>;
@group(0) @binding(1) var<storage, read_write> out_batch: array<f32>;
@group(0) @binding(2) var<storage, read> mparams: array<u32, 8>;
@group(0) @binding(3) var<storage, read> signs: array<f32>;

const WG: u32 = 256u;
const NEG_INF: f32 = -3.402823e+38;
const MAX_HEAD_DIM: u32 = 128u;
const FLAG_ROTATE: u32 = 1u;

var<workgroup> red: array<f32, WG>;
var<workgroup> acc_sh: array<f32, MAX_HEAD_DIM>;

@compute @workgroup_size(256, 1, 1)
fn attention_merge(
    @builtin(local_invocation_id) lid: vec3<u32>,
    @builtin(workgroup_id) wid: vec3<u32>,
) {
    let tid = lid.x;
    let n_heads = mparams[0];
    let head_dim = mparams[1];
    let n_splits = mparams[2];
    let q_total = mparams[3];
    let q_base = mparams[4];
    let out_stride = mparams[5];
    let sign_off = mparams[6];
    let flags = mparams[7];
    let head = wid.x;
    let q_idx = q_base + wid.y;
    let n_part = q_total * n_heads * n_splits;
    let base = (q_idx * n_heads + head) * n_splits;
    let m_off = n_part * head_dim + base;
    let l_off = n_part * (head_dim + 1u) + base;

    // ── M = max_s m_s ──
    var mx = NEG_INF;
    for (var s = tid; s < n_splits; s += WG) {
        mx = max(mx, partial[m_off + s]);
    }
    red[tid] = mx;
    for (var st = WG / 2u; st > 0u; st = st / 2u) {
        workgroupBarrier();
        if tid < st {
            red[tid] = max(red[tid], red[tid + st]);
        }
    }
    workgroupBarrier();
    let m_all = red[0];
    workgroupBarrier();

    // ── L = sum_s l_s exp(m_s - M) ──
    var l = 0.0;
    for (var s = tid; s < n_splits; s += WG) {
        l += partial[l_off + s] * exp(partial[m_off + s] - m_all);
    }
    red[tid] = l;
    for (var st = WG / 2u; st > 0u; st = st / 2u) {
        workgroupBarrier();
        if tid < st {
            red[tid] += red[tid + st];
        }
    }
    workgroupBarrier();
    let l_all = red[0];
    workgroupBarrier();

    // ── accumulators: P = WG / head_dim groups, each over every P-th split ──
    let n_groups = WG / head_dim;
    let part = tid / head_dim;
    let x = tid % head_dim;
    var a = 0.0;
    if part < n_groups {
        var s = part;
        let step = n_groups;
        while s + 3u * step < n_splits {
            let s1 = s + step;
            let s2 = s1 + step;
            let s3 = s2 + step;
            let v0 = partial[(base + s) * head_dim + x];
            let v1 = partial[(base + s1) * head_dim + x];
            let v2 = partial[(base + s2) * head_dim + x];
            let v3 = partial[(base + s3) * head_dim + x];
            let w0 = exp(partial[m_off + s] - m_all);
            let w1 = exp(partial[m_off + s1] - m_all);
            let w2 = exp(partial[m_off + s2] - m_all);
            let w3 = exp(partial[m_off + s3] - m_all);
            a += (v0 * w0 + v1 * w1) + (v2 * w2 + v3 * w3);
            s += 4u * step;
        }
        while s < n_splits {
            a += partial[(base + s) * head_dim + x] * exp(partial[m_off + s] - m_all);
            s += step;
        }
    }
    red[tid] = a;
    workgroupBarrier();
    let rotate = (flags & FLAG_ROTATE) != 0u;
    var inv = 1.0 / l_all;
    if rotate {
        inv = inv / sqrt(f32(head_dim));
    }
    if tid < head_dim {
        var sum = 0.0;
        for (var p = 0u; p < n_groups; p += 1u) {
            sum += red[p * head_dim + tid];
        }
        acc_sh[tid] = sum * inv;
    }
    workgroupBarrier();

    // ── TurboQuant: inverse RHT of the rotated-space result ──
    if rotate {
    // #include "butterfly.wgsl" ARR=acc_sh
    }
    if tid < head_dim {
        var o = acc_sh[tid];
        if rotate {
            o = o * signs[sign_off + tid];
        }
        out_batch[q_idx * out_stride + head * head_dim + tid] = o;
    }
}
