// Merge of split-KV partials (flash-decoding's second pass), for both formats.
//
// The split kernels (`attention_split.wgsl`, `flash_attention_tq_split.wgsl`)
// leave, for every (query row, query head, split), the split's running max m,
// its sum of exponentials l and its unnormalized accumulator acc[d]. This pass
// combines them with the usual rescaling:
//
//   M = max_s m_s;  L = sum_s l_s exp(m_s - M);  out = sum_s acc_s exp(m_s - M) / L
//
// `attention_merge_rot` does the same and then applies the TurboQuant epilogue
// to the rotated-space accumulator: out = s * (H out) / sqrt(d) with the layer's
// polar signs (one Walsh-Hadamard butterfly in workgroup memory).
//
// Bind group 0:
// @binding(0) partial: array<f32>  [acc: n_part*d | m: n_part | l: n_part],
//                                  n_part = q_total * n_heads * n_splits
// @binding(1) out_batch: array<f32> n_queries x out_stride floats (rw)
// @binding(2) mparams: array<u32, 8>
//   ( n_heads, head_dim, n_splits, q_total, q_base, out_stride, sign_off, _pad0 )
// @binding(3) signs: array<f32>  (attention_merge_rot only)
//
// Dispatch: (n_heads, n_queries, 1) workgroups of 128 threads (thread = dim).

@group(0) @binding(0) var<storage, read> partial: array<f32>;
@group(0) @binding(1) var<storage, read_write> out_batch: array<f32>;
@group(0) @binding(2) var<storage, read> mparams: array<u32, 8>;
@group(0) @binding(3) var<storage, read> signs: array<f32>;

const NEG_INF: f32 = -3.402823e+38;
const MAX_HEAD_DIM: u32 = 128u;

var<workgroup> acc_sh: array<f32, MAX_HEAD_DIM>;

// Merged, normalized accumulator of one (query, head) at dim x (x < head_dim).
fn merged(head: u32, q_idx: u32, x: u32) -> f32 {
    let n_heads = mparams[0];
    let head_dim = mparams[1];
    let n_splits = mparams[2];
    let q_total = mparams[3];
    let n_part = q_total * n_heads * n_splits;
    let base = (q_idx * n_heads + head) * n_splits;
    var mx = NEG_INF;
    for (var s = 0u; s < n_splits; s += 1u) {
        mx = max(mx, partial[n_part * head_dim + base + s]);
    }
    var l = 0.0;
    var acc = 0.0;
    for (var s = 0u; s < n_splits; s += 1u) {
        let w = exp(partial[n_part * head_dim + base + s] - mx);
        l += partial[n_part * (head_dim + 1u) + base + s] * w;
        acc += partial[(base + s) * head_dim + x] * w;
    }
    return acc / l;
}

@compute @workgroup_size(128, 1, 1)
fn attention_merge(
    @builtin(local_invocation_id) lid: vec3<u32>,
    @builtin(workgroup_id) wid: vec3<u32>,
) {
    let head_dim = mparams[1];
    let q_base = mparams[4];
    let q_idx = q_base + wid.y;
    let out_stride = mparams[5];
    if lid.x < head_dim {
        out_batch[q_idx * out_stride + wid.x * head_dim + lid.x] = merged(wid.x, q_idx, lid.x);
    }
}

@compute @workgroup_size(128, 1, 1)
fn attention_merge_rot(
    @builtin(local_invocation_id) lid: vec3<u32>,
    @builtin(workgroup_id) wid: vec3<u32>,
) {
    let tid = lid.x;
    let head_dim = mparams[1];
    let q_base = mparams[4];
    let q_idx = q_base + wid.y;
    let out_stride = mparams[5];
    let sign_off = mparams[6];
    let inv_sqrt_d = 1.0 / sqrt(f32(head_dim));
    if tid < head_dim {
        acc_sh[tid] = merged(wid.x, q_idx, tid) * inv_sqrt_d;
    }
    var stride = 1u;
    while stride < head_dim {
        workgroupBarrier();
        if tid < head_dim / 2u {
            let i = (tid / stride) * 2u * stride + (tid % stride);
            let a = acc_sh[i];
            let b = acc_sh[i + stride];
            acc_sh[i] = a + b;
            acc_sh[i + stride] = a - b;
        }
        stride = stride * 2u;
    }
    workgroupBarrier();
    if tid < head_dim {
        out_batch[q_idx * out_stride + wid.x * head_dim + tid] = acc_sh[tid] * signs[sign_off + tid];
    }
}
