// TurboQuant query rotation (`tq_rotate_q`): the queries of an attend over any
// compressed cache (formats.TQ_SPECS), rotated into the basis the keys are coded in,
// as every `flash_attention_tqx*.wgsl` kernel reads them. docs/turboquant.md has the math:
//
//   rht(x, s) = H (s * x) / sqrt(d)     H: unnormalized Walsh-Hadamard (+-1)
//
// Rotated queries, one f32 buffer of q_cap query rows:
//   [ q_rot: q_cap*n_heads*d | q_jl: same | sums: q_cap*n_heads ]
//   q_rot = rht(q, polar_signs); q_jl = rht(q_rot, jl_signs); sums = sum_d q_jl
// With SIGNED = 1 (the formats with key outlier channels, tqx.wgsl) the second
// region is q * polar_signs instead of q_jl (the outliers' dot), and sums its sum.
//
// Signs: one layer's 2*d values of +-1.0 at sign_off (uploaded with the batch),
// polar signs first, JL signs after them.
//
// One dispatch rotates the query rows of a batch of attends, one params block
// per query row:
// @binding(3) signs:  array<f32>  the layer's signs at word sign_off
// @binding(4) q_in:   array<f32>  query rows, the item's at word q_in_off, row stride q_stride
// @binding(5) q_out:  array<f32>  the item's [q_rot | q_jl | sums] of q_cap rows at word q_out_off (rw)
// @binding(6) rparams: array<TqRotateParams> (gpu/params.py TQ_ROTATE_PARAMS), block
//   workgroup_id.y for query row q_row of its item
// Dispatch: (n_heads, query rows, 1) workgroups of 128 threads.
//
// Every workgroupBarrier() sits in uniform control flow at entry-point scope and
// the reduction / butterflies are inlined: naga's SPIR-V path miscompiles a
// barrier reached through a function call inside a loop (see attention_prefill.wgsl).
// Workgroup memory is not zero-initialized: every slot read is written first.

@group(0) @binding(3) var<storage, read> signs: array<f32>;
@group(0) @binding(4) var<storage, read> q_in: array<f32>;
@group(0) @binding(5) var<storage, read_write> q_out: array<f32>;
// #struct TqRotateParams
@group(0) @binding(6) var<storage, read> rparams: array<TqRotateParams>;   // one block per query row (wid.y)

const WG: u32 = 128u;
const MAX_HEAD_DIM: u32 = 128u;

// 1: the second region is q * polar_signs (key outlier formats), 0: q_jl.
override SIGNED: u32 = 0u;

var<workgroup> buf: array<f32, MAX_HEAD_DIM>;   // butterfly workspace
var<workgroup> red: array<f32, WG>;             // reduction scratch

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
    var q_signed = 0.0;
    if in_dim {
        q_signed = q_in[q_in_off + q_global * q_stride + head * head_dim + tid] * signs[sign_off + tid];
        buf[tid] = q_signed;
    }
    // #include "butterfly.wgsl" ARR=buf
    var q_rot = 0.0;
    if in_dim {
        q_rot = buf[tid] * inv_sqrt_d;
        q_out[out_off + tid] = q_rot;
    }
    workgroupBarrier();

    // ── q_jl = rht(q_rot, jl_signs) (SIGNED: q * polar_signs) ──
    if in_dim {
        buf[tid] = q_rot * signs[sign_off + head_dim + tid];
    }
    // #include "butterfly.wgsl" ARR=buf
    var q_jl = 0.0;
    if in_dim {
        q_jl = buf[tid] * inv_sqrt_d;
        if SIGNED != 0u { q_jl = q_signed; }
        q_out[q_region + out_off + tid] = q_jl;
    }

    // ── sums = sum_d q_jl ──
    red[tid] = q_jl;
    // #include "tree_sum_128.wgsl"
    if tid == 0u {
        q_out[q_out_off + 2u * q_region + q_global * n_heads + head] = red[0];
    }
}
