// FlashAttention over a TurboQuant cache, single pass (`flash_attention_tqx`,
// planned by `kernels.plan_attention_tq`; the KernelPolicy's force="single" kernel
// and the fallback for shapes the split and tiled kernels do not take), for every
// compressed format (formats.TQ_SPECS), compiled once per format. Its float64
// oracles: `attnserve.testing.reference.tq_attention` (turboquant) and
// `tqx_attention` (every format).
//
// Structurally `attention_prefill.wgsl` with the two f32 KV reads replaced by the
// compressed estimators: decode dispatches a single query row, chunked prefill the
// whole chunk. Online softmax (Dao 2022), one workgroup per (head, query), tiles of
// 256 timesteps in workgroup memory, no materialized scores slab.
//
// Scores: keys are never reconstructed. With the query pre-rotated into the same
// basis by `tq_rotate_q`, the code term is a dot against the format's centroids
// (KC, from workgroup memory) in rotated space, and the QJL sign bits (where QJL
// is set) add an unbiased inner-product correction (arXiv:2504.19874 §3.2):
//
//   score = norm * (sum_d q_rot[d] KC[idx_d] + [QJL] residual_norm * qjl_scale * signed_sum) * scale
//   signed_sum = 2 * sum_{bit_d = 1} q_jl[d] - sum_d q_jl[d]
//
// `qjl_scale` is a host parameter (`turboquant.qjl_scale`): sqrt(pi/2)/sqrt(head_dim)
// for the ORTHONORMAL rotation rht(x, s) = H (s * x) / sqrt(d) (docs/turboquant.md).
// `residual_norm` is stored in unit-key space, hence the factor norm. Key outliers
// (KO > 0) add their part to the score; value outliers theirs to the accumulator.
//
// Values: the RHT is linear, so the accumulator stays in rotated space for the
// whole pass and the inverse rotation is applied once, in the epilogue; the
// online-softmax rescaling commutes with it.
//
// The placeholder line TQX_CONSTS is replaced by the format's constants (tqx.wgsl),
// whose header has the cache layout. Constraints (host-side): head_dim 32, 64 or
// 128; the cache holds positions [0, max_seq), and the shader clamps
// seq_len = min(pos_q + 1, max_seq). `cache_cap` (the slab's rows) is the per-head
// stride of every region; `max_seq` the causal clamp: not interchangeable.
// GQA: kv_head = head / (n_heads / n_kv_heads). All barriers sit at entry-point
// scope (the tile step is an include, not a call: naga's SPIR-V path miscompiles
// a barrier reached through a call inside a loop).
//
// Bind group 0:
// @binding(0) qrot:      array<f32> rotated queries: [q_rot | q_jl | sums] (tq_rotate_q)
// @binding(1) k_cache:   array<u32> the slab's key regions (tqx.wgsl)
// @binding(2) v_cache:   array<u32> the slab's value regions
// @binding(3) out_batch: array<f32> outputs at out_off, row stride out_stride, then
//                        the log-sum-exp of each (query, head) of the q_cap rows
//                        (rw; gpu/kernels.py "LSE")
// @binding(4) params:    TqAttentionParams (gpu/params.py TQ_ATTENTION_PARAMS);
//   flags bit 0 (FLAG_NON_CAUSAL): every row attends to all max_seq timesteps
// @binding(5) signs:     array<f32> the layer's [polar | jl] signs at sign_off
// @binding(6) pages:     array<u32> page tables (include/paging.wgsl)
// Dispatch: (n_heads, n_queries, 1) workgroups of 256 threads.

{TQX_CONSTS}

@group(0) @binding(0) var<storage, read> qrot: array<f32>;
@group(0) @binding(1) var<storage, read> k_cache: array<u32>;
@group(0) @binding(2) var<storage, read> v_cache: array<u32>;
@group(0) @binding(3) var<storage, read_write> out_batch: array<f32>;
// #struct TqAttentionParams
@group(0) @binding(4) var<storage, read> params: TqAttentionParams;
@group(0) @binding(5) var<storage, read> signs: array<f32>;
@group(0) @binding(6) var<storage, read> pages: array<u32>;
// #include "paging.wgsl"
const TILE: u32 = 256u;
const MAX_HEAD_DIM: u32 = 128u;
const NEG_INF: f32 = -3.402823e+38;
const FLAG_NON_CAUSAL: u32 = 1u;
var<workgroup> q_rot_shared: array<f32, MAX_HEAD_DIM>;
var<workgroup> q_jl_shared: array<f32, MAX_HEAD_DIM>;
var<workgroup> acc: array<f32, MAX_HEAD_DIM>; // rotated-space output accumulator
var<workgroup> tile_scores: array<f32, TILE>;
var<workgroup> tile_vnorm: array<f32, TILE>;
var<workgroup> kc_sh: array<f32, 16>;         // key centroids
var<workgroup> vc_sh: array<f32, 16>;         // value centroids
// #include "single_pass_state.wgsl"
// #include "tqx_codebooks.wgsl"
// #include "tqx_outliers.wgsl"

@compute @workgroup_size(256, 1, 1)
fn flash_attention_tqx(
    @builtin(local_invocation_id) lid: vec3<u32>,
    @builtin(workgroup_id) wid: vec3<u32>,
) {
    let head = wid.x;
    let q_idx = wid.y;
    let tid = lid.x;
    let prm = params;
    // #include "tq_attention_params.wgsl"
    let q_global = q_base + q_idx;
    let pos_q = start_pos + q_global;
    var seq_len = min(pos_q + 1u, max_seq);
    if (flags & FLAG_NON_CAUSAL) != 0u {
        seq_len = max_seq;
    }
    let group_size = n_heads / n_kv_heads;
    let kv_head = head / group_size;
    let out_offset = out_off + q_global * out_stride + head * head_dim;
    let q_region = q_cap * n_heads * head_dim;
    let q_offset = q_off + (q_global * n_heads + head) * head_dim;
    let q_jl_sum = qrot[q_off + 2u * q_region + q_global * n_heads + head];
    // #include "tqx_regions.wgsl"
    let kv_slot_base = kv_head * cache_cap;
    let inv_sqrt_d = 1.0 / sqrt(f32(head_dim));
    let lse_at = out_off + q_cap * out_stride + q_global * n_heads + head;
    if seq_len == 0u {
        if tid < head_dim {
            out_batch[out_offset + tid] = 0.0;
        }
        if tid == 0u {
            out_batch[lse_at] = NEG_INF;       // no key: weighs nothing in a merge
        }
        return;
    }
    if tid < head_dim {
        q_rot_shared[tid] = qrot[q_offset + tid];
        q_jl_shared[tid] = qrot[q_region + q_offset + tid];
        acc[tid] = 0.0;
    }
    if tid < 16u {
        var kc = key_centroids(head_dim);
        var vc = value_centroids(head_dim);
        kc_sh[tid] = kc[tid];
        vc_sh[tid] = vc[tid];
    }
    // #include "single_pass_start.wgsl"
    var base = 0u;
    while base < seq_len {
        let t = base + tid;
        var score = NEG_INF;
        if t < seq_len {
            let slot = kv_slot_base + phys_row(table_off, page_shift, t);
            let norms = unpack2x16float(k_cache[k_norm_off + slot]);
            let norm = norms.x;
            // codes, 32 dims per step: two low-field words and one word per plane
            var polar_dot = 0.0;
            let cb = slot * kcw;
            for (var w = 0u; w < pwd; w += 1u) {
                let lo0 = k_cache[cb + 2u * w];
                let lo1 = k_cache[cb + 2u * w + 1u];
                var h2 = 0u;
                var h3 = 0u;
                if KB > 2u { h2 = k_cache[cb + lw + w]; }
                if KB > 3u { h3 = k_cache[cb + lw + pwd + w]; }
                for (var k = 0u; k < 32u; k += 1u) {
                    let lo = select(lo0, lo1, k >= 16u);
                    let c = ((lo >> (2u * (k % 16u))) & 3u) | (((h2 >> k) & 1u) << 2u) | (((h3 >> k) & 1u) << 3u);
                    polar_dot += q_rot_shared[32u * w + k] * kc_sh[c];
                }
            }
            score = polar_dot * norm;
            if KO > 0u {                         // the outlier channels: q * signs . the stored values
                let ob = k_out_off + slot * kow;
                for (var j = 0u; j < KO; j += 1u) {
                    let o = k_outlier(ob, j, norms.y);
                    score += q_jl_shared[o.ch] * o.val;
                }
            }
            if QJL {
                var pos_sum = 0.0;
                let jl_base = k_jl_off + slot * jw;
                for (var w = 0u; w < jw; w += 1u) {
                    let word = k_cache[jl_base + w];
                    for (var k = 0u; k < 32u; k += 1u) {
                        pos_sum += q_jl_shared[32u * w + k] * f32((word >> k) & 1u);
                    }
                }
                score += norm * norms.y * qjl_scale * (2.0 * pos_sum - q_jl_sum);
            }
            score = score * scale;
            tile_vnorm[tid] = unpack2x16float(v_cache[v_norm_off + slot]).x;
        }
        // #include "single_tile_softmax.wgsl"
        if tid < head_dim {
            var a = acc[tid] * corr;
            let vlo = tid / 16u;
            let vsh = (tid % 16u) * 2u;
            let vpw = tid / 32u;
            let vpb = tid % 32u;
            for (var jj = 0u; jj < TILE; jj += 1u) {
                let tt = base + jj;
                if tt < seq_len {
                    let vb = (kv_slot_base + phys_row(table_off, page_shift, tt)) * vcw;
                    var c = (v_cache[vb + vlo] >> vsh) & 3u;
                    if VB > 2u { c |= ((v_cache[vb + lw + vpw] >> vpb) & 1u) << 2u; }
                    if VB > 3u { c |= ((v_cache[vb + lw + pwd + vpw] >> vpb) & 1u) << 3u; }
                    var x = tile_vnorm[jj] * vc_sh[c];
                    if VO > 0u {
                        let vslot = kv_slot_base + phys_row(table_off, page_shift, tt);
                        let v0 = unpack2x16float(v_cache[v_norm_off + vslot]).y;
                        let ob = v_out_off + vslot * vow;
                        var sp = 0.0;
                        for (var j = 0u; j < VO; j += 1u) {
                            let o = v_outlier(ob, j, v0);
                            sp += o.val * hsign(tid, o.ch);
                        }
                        x += sp * inv_sqrt_d;
                    }
                    a += tile_scores[jj] * x;
                }
            }
            acc[tid] = a;
        }
        if tid == 0u {
            st[1] = st[1] * corr + tsum;
            st[0] = nm;
        }
        workgroupBarrier();
        base += TILE;
    }
    // ── epilogue: normalize, then one inverse RHT back to the original basis ──
    if tid < head_dim {
        acc[tid] = acc[tid] / st[1] * inv_sqrt_d;
    }
    var stride = 1u;
    while stride < head_dim {
        workgroupBarrier();
        if tid < head_dim / 2u {
            let i = (tid / stride) * 2u * stride + (tid % stride);
            let a = acc[i];
            let b = acc[i + stride];
            acc[i] = a + b;
            acc[i + stride] = a - b;
        }
        stride = stride * 2u;
    }
    workgroupBarrier();
    if tid < head_dim {
        out_batch[out_offset + tid] = acc[tid] * signs[sign_off + tid];
    }
    if tid == 0u {
        out_batch[lse_at] = st[0] + log(st[1]);
    }
}
