// TurboQuant writer side: the encoders that fill the compressed KV cache read
// by `flash_attention_tq.wgsl`, and the query rotation that kernel expects.
//
// Math (docs/turboquant.md; TurboQuant arXiv:2504.19874, QJL arXiv:2406.03482):
//
//   rht(x, s) = H (s * x) / sqrt(d)     H: unnormalized Walsh-Hadamard (+-1)
//
// Keys, per (timestep, kv head), d = head_dim (32, 64 or 128):
//   norm = ||k||; a vector with norm < 1e-12 is stored as all-zero words.
//   y    = rht(k / norm, polar_signs);  idx_j = #{ i : y_j >= b_i }  (0..3)
//   r    = y - c[idx];  residual_norm = ||r||  (unit-key space)
//   bit_j = rht(r / residual_norm, jl_signs)_j >= 0   (all zero if ||r|| < 1e-12)
//   norm word = pack2x16float(norm, residual_norm)
// Values: the same first two steps; norm word = pack2x16float(norm, 0).
//
// Cache layout of one pool slab (`cap` = its rows = per-head stride,
// `vecs = n_kv_heads * cap`, slot(h, r) = h * cap + r for slab row r; a layer's
// timestep t is slab row phys_row(t) through its page table), all `array<u32>`:
//   keys:   [ polar: vecs * d/16 | jl: vecs * d/32 | norms: vecs ]
//   values: [ polar: vecs * d/16 | norms: vecs ]
//   polar word w of a slot: slot * (d/16) + w, element j at bits 2j..2j+1 (LSB first)
//   jl word w of a slot:    jl_off + slot * (d/32) + w, element j at bit j
//
// Rotated queries (`tq_rotate_q`), one f32 buffer of q_cap query rows:
//   [ q_rot: q_cap*n_heads*d | q_jl: same | sums: q_cap*n_heads ]
//   q_rot = rht(q, polar_signs); q_jl = rht(q_rot, jl_signs); sums = sum_d q_jl
//
// Signs: one layer's 2*d values of +-1.0 at sign_off (uploaded with the batch),
// polar signs first, JL signs after them.
//
// Every workgroupBarrier() sits in uniform control flow at entry-point scope and
// the reductions / butterflies are inlined: naga's SPIR-V path miscompiles a
// barrier reached through a function call inside a loop (see attention_prefill.wgsl).
// Loop bounds come from `params` (read-only storage), which is uniform.
// Workgroup memory is not zero-initialized: every slot read is written first.
//
// ── tq_encode_keys / tq_encode_values ───────────────────────────────────────
// One dispatch encodes the rows of a batch of appends into one pool slab, one
// params block per row (a single append is the batch of one):
// @binding(0) src:    array<f32>  the rows, row i's n_kv_heads x head_dim at word src_off
// @binding(1) cache:  array<u32>  the pool slab's key (or value) words, cache_cap rows (rw)
// @binding(2) eparams: array<TqEncodeParams> (gpu/params.py TQ_ENCODE_PARAMS), block
//   workgroup_id.y: the row goes to timestep t of the layer whose page table
//   starts at table_off (slab row phys_row(t), include/paging.wgsl).
//   Boundaries b_i = (c_i + c_{i+1}) / 2 are passed as f32 so the host's
//   oracle compares against the very same thresholds.
// @binding(3) signs:  array<f32>  the layer's signs at word sign_off
// @binding(7) pages:  array<u32>  page tables
// Dispatch: (n_kv_heads, rows, 1) workgroups of 128 threads.
//
// ── tq_rotate_q ─────────────────────────────────────────────────────────────
// One dispatch rotates the query rows of a batch of attends, one params block
// per query row:
// @binding(3) signs:  array<f32>  the layer's signs at word sign_off
// @binding(4) q_in:   array<f32>  query rows, the item's at word q_in_off, row stride q_stride
// @binding(5) q_out:  array<f32>  the item's [q_rot | q_jl | sums] of q_cap rows at word q_out_off (rw)
// @binding(6) rparams: array<TqRotateParams> (gpu/params.py TQ_ROTATE_PARAMS), block
//   workgroup_id.y for query row q_row of its item
// Dispatch: (n_heads, query rows, 1) workgroups of 128 threads.

@group(0) @binding(0) var<storage, read> src: array<f32>;
@group(0) @binding(1) var<storage, read_write> cache: array<u32>;
// #struct TqEncodeParams
@group(0) @binding(2) var<storage, read> eparams: array<TqEncodeParams>;   // one block per row (wid.y)
@group(0) @binding(3) var<storage, read> signs: array<f32>;
@group(0) @binding(4) var<storage, read> q_in: array<f32>;
@group(0) @binding(5) var<storage, read_write> q_out: array<f32>;
// #struct TqRotateParams
@group(0) @binding(6) var<storage, read> rparams: array<TqRotateParams>;   // one block per query row (wid.y)
@group(0) @binding(7) var<storage, read> pages: array<u32>;
// #include "paging.wgsl"

const WG: u32 = 128u;
const MAX_HEAD_DIM: u32 = 128u;
const NORM_EPS: f32 = 1e-12;

var<workgroup> buf: array<f32, MAX_HEAD_DIM>;   // butterfly workspace
var<workgroup> red: array<f32, WG>;             // reduction scratch
var<workgroup> code: array<u32, MAX_HEAD_DIM>;  // 2-bit indices / sign bits
var<workgroup> jl_bits: array<u32, MAX_HEAD_DIM>;

// 2-bit Lloyd-Max index: how many boundaries the value is >= to.
fn quantize(y: f32, b0: f32, b1: f32, b2: f32) -> u32 {
    return u32(y >= b0) + u32(y >= b1) + u32(y >= b2);
}

fn centroid(i: u32, c0: f32, c1: f32, c2: f32, c3: f32) -> f32 {
    var c = c0;
    if i == 1u { c = c1; }
    if i == 2u { c = c2; }
    if i == 3u { c = c3; }
    return c;
}

@compute @workgroup_size(128, 1, 1)
fn tq_encode_keys(
    @builtin(local_invocation_id) lid: vec3<u32>,
    @builtin(workgroup_id) wid: vec3<u32>,
) {
    // #include "tq_encode_rotate.wgsl"
    let b0 = ep.b0;
    let b1 = ep.b1;
    let b2 = ep.b2;
    let c0 = ep.c0;
    let c1 = ep.c1;
    let c2 = ep.c2;
    let c3 = ep.c3;
    var r = 0.0;
    if in_dim {
        let y = buf[tid] * inv_sqrt_d;
        let idx = quantize(y, b0, b1, b2);
        code[tid] = idx;
        r = y - centroid(idx, c0, c1, c2, c3);
    }

    // ── residual_norm = ||y - c[idx]|| ──
    red[tid] = r * r;
    // #include "tree_sum_128.wgsl"
    let residual_norm = sqrt(red[0]);
    let rlive = live && residual_norm >= NORM_EPS;
    var inv_rn = 0.0;
    if rlive { inv_rn = 1.0 / residual_norm; }

    // ── JL sign bits of rht(r / ||r||, jl_signs) (the 1/sqrt(d) keeps signs) ──
    if in_dim {
        buf[tid] = r * inv_rn * signs[sign_off + head_dim + tid];
    }
    // #include "butterfly.wgsl" ARR=buf
    if in_dim {
        jl_bits[tid] = u32(rlive && buf[tid] >= 0.0);
    }
    workgroupBarrier();

    // ── pack: polar words, JL words, norm word ──
    let polar_words = head_dim / 16u;
    let jl_words = head_dim / 32u;
    let vecs = n_kv_heads * cache_cap;
    let slot = head * cache_cap + slab_row;
    if tid < polar_words {
        var word = 0u;
        for (var k = 0u; k < 16u; k += 1u) {
            word = word | (code[tid * 16u + k] << (2u * k));
        }
        if !live { word = 0u; }
        cache[slot * polar_words + tid] = word;
    }
    if tid < jl_words {
        var word = 0u;
        for (var k = 0u; k < 32u; k += 1u) {
            word = word | (jl_bits[tid * 32u + k] << k);
        }
        cache[vecs * polar_words + slot * jl_words + tid] = word;
    }
    if tid == 0u {
        var nw = 0u;
        if live { nw = pack2x16float(vec2<f32>(norm, residual_norm)); }
        cache[vecs * (polar_words + jl_words) + slot] = nw;
    }
}

@compute @workgroup_size(128, 1, 1)
fn tq_encode_values(
    @builtin(local_invocation_id) lid: vec3<u32>,
    @builtin(workgroup_id) wid: vec3<u32>,
) {
    // #include "tq_encode_rotate.wgsl"
    let b0 = ep.b0;
    let b1 = ep.b1;
    let b2 = ep.b2;
    // idx = quantize(y)
    if in_dim {
        code[tid] = quantize(buf[tid] * inv_sqrt_d, b0, b1, b2);
    }
    workgroupBarrier();

    // ── pack: polar words, norm word (no JL region for values) ──
    let polar_words = head_dim / 16u;
    let vecs = n_kv_heads * cache_cap;
    let slot = head * cache_cap + slab_row;
    if tid < polar_words {
        var word = 0u;
        for (var k = 0u; k < 16u; k += 1u) {
            word = word | (code[tid * 16u + k] << (2u * k));
        }
        if !live { word = 0u; }
        cache[slot * polar_words + tid] = word;
    }
    if tid == 0u {
        var nw = 0u;
        if live { nw = pack2x16float(vec2<f32>(norm, 0.0)); }
        cache[vecs * polar_words + slot] = nw;
    }
}

@compute @workgroup_size(128, 1, 1)
fn tq_rotate_q(
    @builtin(local_invocation_id) lid: vec3<u32>,
    @builtin(workgroup_id) wid: vec3<u32>,
) {
    let tid = lid.x;
    let rp = rparams[wid.y];
    let n_heads = rp.n_heads;
    let head_dim = rp.head_dim;
    let q_cap = rp.q_cap;
    let sign_off = rp.sign_off;
    let q_row = rp.q_row;
    let q_global = q_row;
    let q_stride = rp.q_stride;
    let head = wid.x;
    if head >= n_heads {
        return;                                // an item of the batch with fewer heads
    }
    let in_dim = tid < head_dim;
    let inv_sqrt_d = 1.0 / sqrt(f32(head_dim));
    let q_region = q_cap * n_heads * head_dim;
    let q_in_off = rp.q_in_off;
    let q_out_off = rp.q_out_off;
    let out_off = q_out_off + (q_global * n_heads + head) * head_dim;

    // ── q_rot = rht(q, polar_signs) ──
    if in_dim {
        buf[tid] = q_in[q_in_off + q_global * q_stride + head * head_dim + tid] * signs[sign_off + tid];
    }
    // #include "butterfly.wgsl" ARR=buf
    var q_rot = 0.0;
    if in_dim {
        q_rot = buf[tid] * inv_sqrt_d;
        q_out[out_off + tid] = q_rot;
    }
    workgroupBarrier();

    // ── q_jl = rht(q_rot, jl_signs) ──
    if in_dim {
        buf[tid] = q_rot * signs[sign_off + head_dim + tid];
    }
    // #include "butterfly.wgsl" ARR=buf
    var q_jl = 0.0;
    if in_dim {
        q_jl = buf[tid] * inv_sqrt_d;
        q_out[q_region + out_off + tid] = q_jl;
    }

    // ── sums = sum_d q_jl ──
    red[tid] = q_jl;
    // #include "tree_sum_128.wgsl"
    if tid == 0u {
        q_out[q_out_off + 2u * q_region + q_global * n_heads + head] = red[0];
    }
}

// tq_rotate_q_signed: tq_rotate_q for the formats with outlier channels (tqx.wgsl):
// [q_rot | q * polar_signs | sums of it], the second region in place of q_jl.
@compute @workgroup_size(128, 1, 1)
fn tq_rotate_q_signed(
    @builtin(local_invocation_id) lid: vec3<u32>,
    @builtin(workgroup_id) wid: vec3<u32>,
) {
    let tid = lid.x;
    let rp = rparams[wid.y];
    let n_heads = rp.n_heads;
    let head_dim = rp.head_dim;
    let q_cap = rp.q_cap;
    let sign_off = rp.sign_off;
    let q_row = rp.q_row;
    let q_global = q_row;
    let q_stride = rp.q_stride;
    let head = wid.x;
    if head >= n_heads {
        return;                                // an item of the batch with fewer heads
    }
    let in_dim = tid < head_dim;
    let inv_sqrt_d = 1.0 / sqrt(f32(head_dim));
    let q_region = q_cap * n_heads * head_dim;
    let q_in_off = rp.q_in_off;
    let q_out_off = rp.q_out_off;
    let out_off = q_out_off + (q_global * n_heads + head) * head_dim;

    // ── q_rot = rht(q, polar_signs) ──
    if in_dim {
        buf[tid] = q_in[q_in_off + q_global * q_stride + head * head_dim + tid] * signs[sign_off + tid];
    }
    // #include "butterfly.wgsl" ARR=buf
    var q_rot = 0.0;
    if in_dim {
        q_rot = buf[tid] * inv_sqrt_d;
        q_out[out_off + tid] = q_rot;
    }
    workgroupBarrier();

    // ── q * polar_signs in place of q_jl (the outlier channels' dot) ──
    var q_jl = 0.0;
    if in_dim {
        q_jl = q_in[q_in_off + q_global * q_stride + head * head_dim + tid] * signs[sign_off + tid];
        q_out[q_region + out_off + tid] = q_jl;
    }

    // ── sums = sum_d q_jl ──
    red[tid] = q_jl;
    // #include "tree_sum_128.wgsl"
    if tid == 0u {
        q_out[q_out_off + 2u * q_region + q_global * n_heads + head] = red[0];
    }
}
