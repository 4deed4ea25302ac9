// TurboQuant writer side: the encoders of the compressed caches read by
// `flash_attention_tqx*.wgsl`, for every compressed format (formats.TQ_SPECS:
// `turboquant` = 2-bit keys + QJL, 2-bit values; the variants, formats.TQ_VARIANTS:
// tq4, tq3, tq4v2, tq4v3, tq3q, tq4q, tq4o, tq3o, tq2o), compiled once per format. The queries are
// rotated by `tq_rotate_q` (tq_rotate.wgsl). docs/turboquant.md has the math and
// the bit accounting (TurboQuant arXiv:2504.19874, QJL arXiv:2406.03482):
//
//   rht(x, s) = H (s * x) / sqrt(d)     H: unnormalized Walsh-Hadamard (+-1)
//
// The loader replaces the placeholder line TQX_CONSTS below (gpu/shaders.py
// `tqx_consts`) with the format's constants: KB / VB (Lloyd-Max bits of a key /
// value coordinate, 2..4), QJL (keys carry a 1-bit QJL residual sign per
// coordinate), and per head_dim the float32 codebooks KC_d / VC_d (2^b centroids,
// padded to 16) and their boundaries KCB_d / VCB_d, the values the oracle uses.
//
// Keys, per (timestep, kv head), d = head_dim (32, 64 or 128):
//   norm = ||k||; a vector with norm < 1e-12 is stored as all-zero words.
//   y    = rht(k / norm, polar_signs);  idx_j = #{ i : y_j >= KCB_d[i] }  (0 .. 2^KB - 1)
//   QJL: r = y - KC_d[idx]; bit_j = rht(r / ||r||, jl_signs)_j >= 0;
//        norm word = pack2x16float(norm, ||r||)
//   no QJL: norm word = pack2x16float(norm, 0)
// Values: the same first two steps with VB / VC_d; norm word = pack2x16float(norm, 0).
// Formats with outlier channels (KO / VO > 0, docs/turboquant.md): the n largest-|x|
// channels are taken out first (ties to the lower channel), the steps above code
// the rest, and outlier j is stored as the float16 of
//   (x[ch_j] - rest_hat[ch_j]) * polar_signs[ch_j],   rest_hat = rht_inv(c[idx] * f16(norm))
// (what the codes reconstruct there subtracted: codes plus outliers give x[ch_j]);
// outlier 0 in the norm word's upper half, the others in the outlier region.
//
// Code layout of one slot, b bits per coordinate, b * d / 32 words:
//   words [0, d/16):     the low two bits of every code, element j at bits
//                        2(j % 16) .. 2(j % 16) + 1 of word j / 16 (turboquant's polar words)
//   plane p = 2 .. b-1:  d/32 words at d/16 + (p - 2) * d/32, bit p of element j
//                        at bit j % 32 of word j / 32
// Regions of one pool slab (`vecs = n_kv_heads * cap`, slot(h, r) = h * cap + r):
//   keys:   [ codes: vecs * KB*d/32 | jl: vecs * d/32 (QJL only) | norms: vecs ]
//   values: [ codes: vecs * VB*d/32 | norms: vecs ]
//   (+ [ outliers: vecs * ceil((n-1)/2) + ceil(n/4) ] after the norms where KO / VO = n > 0)
//   jl word w of a slot: vecs * KB*d/32 + slot * (d/32) + w, element j at bit j
// `turboquant` (KB = VB = 2, QJL) is [ polar: vecs * d/16 | jl: vecs * d/32 | norms: vecs ]
// and [ polar: vecs * d/16 | norms: vecs ]: the layout of the turboquant-only kernels
// this family replaced, word for word (a snapshot written by them loads unchanged).
//
// One dispatch encodes the rows of a batch of appends into one pool slab, one
// params block per row (a single append is the batch of one):
// @binding(0) src:    array<f32>  the rows, row i's n_kv_heads x head_dim at word src_off
// @binding(1) cache:  array<u32>  the pool slab's key (or value) words, cache_cap rows (rw)
// @binding(2) eparams: array<TqxEncodeParams> (gpu/params.py TQX_ENCODE_PARAMS), block
//   workgroup_id.y: the row goes to timestep t of the layer whose page table
//   starts at table_off (slab row phys_row(t), include/paging.wgsl)
// @binding(3) signs:  array<f32>  the layer's signs at word sign_off (polar, then JL)
// @binding(7) pages:  array<u32>  page tables
// Dispatch: (n_kv_heads, rows, 1) workgroups of 128 threads.
// The codebooks and boundaries are the TQX_CONSTS constants (the float32 values the
// float64 oracle compares against, boundaries b_i = (c_i + c_{i+1}) / 2 rounded once).
// Every workgroupBarrier() sits in uniform control flow at entry-point scope and the
// reductions / butterflies are inlined: naga's SPIR-V path miscompiles a barrier
// reached through a function call inside a loop (see attention_prefill.wgsl).
// Workgroup memory is not zero-initialized: every slot read is written first.

{TQX_CONSTS}

@group(0) @binding(0) var<storage, read> src: array<f32>;
@group(0) @binding(1) var<storage, read_write> cache: array<u32>;
// #struct TqxEncodeParams
@group(0) @binding(2) var<storage, read> eparams: array<TqxEncodeParams>;   // one block per row (wid.y)
@group(0) @binding(3) var<storage, read> signs: array<f32>;
@group(0) @binding(7) var<storage, read> pages: array<u32>;
// #include "paging.wgsl"

const WG: u32 = 128u;
const MAX_HEAD_DIM: u32 = 128u;
const NORM_EPS: f32 = 1e-12;

var<workgroup> buf: array<f32, MAX_HEAD_DIM>;   // butterfly workspace
var<workgroup> red: array<f32, WG>;             // reduction scratch
var<workgroup> code: array<u32, MAX_HEAD_DIM>;  // b-bit indices
var<workgroup> jl_bits: array<u32, MAX_HEAD_DIM>;
var<workgroup> redv: array<f32, WG>;            // outlier selection: |x| ...
var<workgroup> redi: array<u32, WG>;            // ... and its channel
var<workgroup> out_ch: array<u32, 16>;          // the outliers' channels
var<workgroup> out_val: array<f32, 16>;         // ... and values times the polar sign

// The outlier region of a slot (formats with outliers): word i of
// ceil((n-1)/2) words of halves (outliers 1 .. n-1, two a word, the lower first),
// then ceil(n/4) words of channel bytes (outlier j at byte j % 4 of word j / 4).
fn outlier_word(i: u32, n: u32) -> u32 {
    let hw = n / 2u;                             // = ceil((n - 1) / 2)
    if i < hw {
        let a = 2u * i + 1u;
        var hi = 0.0;
        if a + 1u < n { hi = out_val[a + 1u]; }
        return pack2x16float(vec2<f32>(out_val[a], hi));
    }
    let j = 4u * (i - hw);
    var word = 0u;
    for (var b = 0u; b < 4u; b += 1u) {
        if j + b < n { word = word | (out_ch[j + b] << (8u * b)); }
    }
    return word;
}

// #include "tqx_codebooks.wgsl"

// The word `i` (< bits * d / 32) of a slot's codes, from code[0 .. d).
fn pack_word(i: u32, bits: u32, head_dim: u32) -> u32 {
    let lw = head_dim / 16u;
    var word = 0u;
    if i < lw {
        for (var k = 0u; k < 16u; k += 1u) {
            word = word | ((code[i * 16u + k] & 3u) << (2u * k));
        }
    } else {
        let pw = head_dim / 32u;
        let p = 2u + (i - lw) / pw;
        let w = (i - lw) % pw;
        for (var k = 0u; k < 32u; k += 1u) {
            word = word | (((code[w * 32u + k] >> p) & 1u) << k);
        }
    }
    return word;
}

@compute @workgroup_size(128, 1, 1)
fn tqx_encode_keys(
    @builtin(local_invocation_id) lid: vec3<u32>,
    @builtin(workgroup_id) wid: vec3<u32>,
) {
    // #include "tqx_encode_rotate.wgsl" NOUT=KO
    var kc = key_centroids(head_dim);
    var kb = key_bounds(head_dim);
    var r = 0.0;
    if in_dim {
        let y = buf[tid] * inv_sqrt_d;
        var idx = 0u;
        for (var i = 0u; i + 1u < (1u << KB); i += 1u) {
            idx += u32(y >= kb[i]);
        }
        code[tid] = idx;
        r = y - kc[idx];
    }

    // ── residual_norm = ||y - c[idx]|| (written with QJL only) ──
    red[tid] = r * r;
    // #include "tree_sum_128.wgsl"
    let residual_norm = sqrt(red[0]);
    let rlive = live && residual_norm >= NORM_EPS;
    var inv_rn = 0.0;
    if rlive { inv_rn = 1.0 / residual_norm; }

    // ── JL sign bits of rht(r / ||r||, jl_signs) ──
    if in_dim {
        buf[tid] = r * inv_rn * signs[sign_off + head_dim + tid];
    }
    // #include "butterfly.wgsl" ARR=buf
    if in_dim {
        jl_bits[tid] = u32(rlive && buf[tid] >= 0.0);
    }
    workgroupBarrier();

    // ── outliers: minus what the codes reconstruct at their channels ──
    // #include "tqx_outlier_correct.wgsl" CENT=kc NOUT=KO

    // ── pack: code words, JL words (QJL), norm word ──
    let cw = KB * head_dim / 32u;
    var jw = 0u;
    if QJL { jw = head_dim / 32u; }
    let vecs = n_kv_heads * cache_cap;
    let slot = head * cache_cap + slab_row;
    if tid < cw {
        var word = pack_word(tid, KB, head_dim);
        if !live { word = 0u; }
        cache[slot * cw + tid] = word;
    }
    if tid < jw {
        var word = 0u;
        for (var k = 0u; k < 32u; k += 1u) {
            word = word | (jl_bits[tid * 32u + k] << k);
        }
        cache[vecs * cw + slot * jw + tid] = word;
    }
    if tid == 0u {
        var n0 = 0.0;
        var hi = 0.0;
        if QJL { hi = residual_norm; }
        if KO > 0u { hi = out_val[0]; }
        if live { n0 = norm; }
        var nw = pack2x16float(vec2<f32>(n0, hi));
        if !live && KO == 0u { nw = 0u; }
        cache[vecs * (cw + jw) + slot] = nw;
    }
    let ow = KO / 2u + (KO + 3u) / 4u;          // formats.outlier_words
    if tid < ow {
        cache[vecs * (cw + jw + 1u) + slot * ow + tid] = outlier_word(tid, KO);
    }
}

@compute @workgroup_size(128, 1, 1)
fn tqx_encode_values(
    @builtin(local_invocation_id) lid: vec3<u32>,
    @builtin(workgroup_id) wid: vec3<u32>,
) {
    // #include "tqx_encode_rotate.wgsl" NOUT=VO
    var vb = value_bounds(head_dim);
    if in_dim {
        let y = buf[tid] * inv_sqrt_d;
        var idx = 0u;
        for (var i = 0u; i + 1u < (1u << VB); i += 1u) {
            idx += u32(y >= vb[i]);
        }
        code[tid] = idx;
    }
    workgroupBarrier();

    // ── outliers: minus what the codes reconstruct at their channels ──
    var vc = value_centroids(head_dim);
    // #include "tqx_outlier_correct.wgsl" CENT=vc NOUT=VO

    // ── pack: code words, norm word ──
    let cw = VB * head_dim / 32u;
    let vecs = n_kv_heads * cache_cap;
    let slot = head * cache_cap + slab_row;
    if tid < cw {
        var word = pack_word(tid, VB, head_dim);
        if !live { word = 0u; }
        cache[slot * cw + tid] = word;
    }
    if tid == 0u {
        var n0 = 0.0;
        var hi = 0.0;
        if VO > 0u { hi = out_val[0]; }
        if live { n0 = norm; }
        cache[vecs * cw + slot] = pack2x16float(vec2<f32>(n0, hi));
    }
    let ow = VO / 2u + (VO + 3u) / 4u;          // formats.outlier_words
    if tid < ow {
        cache[vecs * (cw + 1u) + slot * ow + tid] = outlier_word(tid, VO);
    }
}
