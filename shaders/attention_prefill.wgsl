// f32 attention, single pass: N queries x n_heads in one dispatch
// (`attention_prefill`, planned by `kernels.plan_attention_plain`; the
// KernelPolicy's force="single" kernel, and the reference the query-block and
// split kernels are measured against).
//
// Online softmax (Dao 2022), one tiled pass over the KV cache with bounded
// workgroup memory (TILE scores, not seq_len) and no scores scratch buffer: one
// workgroup per (head, query), a per-query causal window, batched Q/out strides,
// each K/V row read once per (query, head). It matches the float64 oracle
// (`attnserve.reference.attention`) up to the roundoff of the online
// accumulation order; tests/test_core_attention.py checks it.
//
// The tree reductions and the tile step are included, not called, so every
// barrier sits in the entry point: naga's SPIR-V path (lavapipe/Vulkan)
// miscompiles `workgroupBarrier()` reached through a function call inside a
// loop.
//
// Constraints:
// - head_dim <= 128 (bounds `q_shared` and `acc`; `formats.check_head_dim`).
// - `max_seq` (the host's `length`) >= start_pos + the queries attended, and
//   K/V hold valid rows `[0, max_seq)`. The shader also clamps
//   `seq_len = min(pos_q + 1, max_seq)`, so an under-sized `max_seq` truncates
//   the window rather than reading out of bounds.
// GQA: kv_head = head / (n_heads / n_kv_heads).
//
// Bind group 0:
// @binding(0) q_batch: array<f32> n_queries x q_stride floats
// @binding(1) k_cache: slab rows of kv_dim elements (f32, f16 or bf16: include/kv_scalar_{f32,f16,bf16}.wgsl)
// @binding(2) v_cache: the same for values, read through key1() / value1()
// @binding(3) out_batch: array<f32> n_queries x out_stride floats, then the
//                         log-sum-exp of each (query, head): n_queries x n_heads
//                         floats (rw; the attend's out segment, gpu/kernels.py "LSE")
// @binding(4) params: PrefillParams (gpu/params.py PREFILL_PARAMS)
// @binding(5) pages: array<u32> page tables (include/paging.wgsl); rows of k/v_cache are slab rows
//
// `flags` bit 0 (FLAG_NON_CAUSAL): when set, every query row attends to all
// `max_seq` timesteps (encoder / cross-attention); when clear, row q attends to
// `[0, min(start_pos + q_global + 1, max_seq))`. Other bits are zero.
//
// `n_queries` (the attend's rows) places the log-sum-exp after the outputs; the
// per-dispatch query count is the dispatch Y dimension (`wid.y`). `q_base` is the index, within `q_batch` / `out_batch`,
// of the first query of this dispatch (the host splits large batches into
// several dispatches); `q_global = q_base + wid.y` addresses both and sets the
// causal position.
//
// Dispatch: (n_heads, queries in this dispatch, 1) workgroups of 256 threads.
@group(0) @binding(0) var<storage, read> q_batch: array<f32>;
// #include "kv_scalar_{KV}.wgsl"
@group(0) @binding(3) var<storage, read_write> out_batch: array<f32>;
// #struct PrefillParams
@group(0) @binding(4) var<storage, read> params: PrefillParams;
@group(0) @binding(5) var<storage, read> pages: array<u32>;
// #include "paging.wgsl"
const TILE: u32 = 256u;
const MAX_HEAD_DIM: u32 = 128u;
const NEG_INF: f32 = -3.402823e+38;
const FLAG_NON_CAUSAL: u32 = 1u;
var<workgroup> q_shared: array<f32, MAX_HEAD_DIM>;
var<workgroup> acc: array<f32, MAX_HEAD_DIM>; // per-dim output accumulator
var<workgroup> tile_scores: array<f32, TILE>;
// #include "single_pass_state.wgsl"
@compute @workgroup_size(256, 1, 1)
fn attention_prefill(
    @builtin(local_invocation_id) lid: vec3<u32>,
    @builtin(workgroup_id) wid: vec3<u32>,
) {
    let head = wid.x;
    let q_idx = wid.y;
    let tid = lid.x;
    // the query count is the dispatch Y dimension (n_queries: the attend's rows)
    let prm = params;
    // #include "prefill_params.wgsl"
    // Global query index into q_batch / out_batch (q_base + local q_idx).
    let q_global = q_base + q_idx;
    // Per-query causal window: attend over [0..pos_q]. Clamp against max_seq so a
    // caller passing inconsistent params can only cause silent window truncation,
    // never an OOB read of k_cache / v_cache.
    let pos_q = start_pos + q_global;
    var seq_len = min(pos_q + 1u, max_seq);
    if (flags & FLAG_NON_CAUSAL) != 0u {
        seq_len = max_seq;
    }
    let group_size = n_heads / n_kv_heads;
    let kv_head = head / group_size;
    let kv_h_offset = kv_head * head_dim;
    let q_offset = q_off + q_global * q_stride + head * head_dim;
    let out_offset = out_off + q_global * out_stride + head * head_dim;
    let lse_at = out_off + n_queries * out_stride + q_global * n_heads + head;
    // seq_len == 0 would divide by st[1] == 0 → NaN. Write zeros and bail.
    if seq_len == 0u {
        if tid < head_dim {
            out_batch[out_offset + tid] = 0.0;
        }
        if tid == 0u {
            out_batch[lse_at] = NEG_INF;       // no key: weighs nothing in a merge
        }
        return;
    }
    // Load Q into workgroup memory and zero the output accumulator.
    if tid < head_dim {
        q_shared[tid] = q_batch[q_offset + tid];
        acc[tid] = 0.0;
    }
    // #include "single_pass_start.wgsl"
    var base = 0u;
    while base < seq_len {
        // ── score for timestep t = base + tid (one per thread) ──
        let t = base + tid;
        var score = NEG_INF;
        if t < seq_len {
            var dot = 0.0;
            let k_base = phys_row(table_off, page_shift, t) * kv_dim + kv_h_offset;
            for (var d = 0u; d < head_dim; d += 1u) {
                dot += q_shared[d] * key1(k_base + d);
            }
            score = dot * scale;
        }
        // #include "single_tile_softmax.wgsl"
        // rescale the accumulator by the correction and add this tile's V.
        if tid < head_dim {
            var a = acc[tid] * corr;
            let vd = kv_h_offset + tid;
            for (var jj = 0u; jj < TILE; jj += 1u) {
                let tt = base + jj;
                if tt < seq_len {
                    a += tile_scores[jj] * value1(phys_row(table_off, page_shift, tt) * kv_dim + vd);
                }
            }
            acc[tid] = a;
        }
        if tid == 0u {
            st[1] = st[1] * corr + tsum;
            st[0] = nm;
        }
        // Barrier before the next tile reuses tile_scores/red and reads acc/st.
        workgroupBarrier();
        base += TILE;
    }
    if tid < head_dim {
        out_batch[out_offset + tid] = acc[tid] / st[1];
    }
    if tid == 0u {
        out_batch[lse_at] = st[0] + log(st[1]);
    }
}