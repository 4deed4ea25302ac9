// Split-KV attention over the TurboQuant cache (decode path), second design:
// the same work split, params, bindings and partials as turboquant's shipped split
// kernel (`flash_attention_tqx_split.wgsl`, compiled for turboquant:
// `attention_split_tqx.turboquant`; read its header and docs/turboquant.md), so
// `attention_merge` (ROTATE) finishes it unchanged. (It was designed against the
// turboquant-only `attention_split_tq`, since retired: the same bindings, params
// and partials; the 2-bit codebook, once params c0..c3, is turboquant's TQX_CONSTS.)
// One workgroup of 256 threads per (split, KV head, query row) serves every
// query head of the GQA group. What differs is how codes become numbers and how
// loads are kept in flight:
//
// * QJL term by table lookups: for every head pair and nibble group g (dims
//   4g..4g+3) the prologue tabulates the 16 sums of q_jl over the nibble's set
//   bits (jlut), so a key's sum of q_jl over its set bits is d/4 lookups, each
//   serving two heads (a 64-bit read of a 128-byte table: no bank conflicts),
//   instead of d multiply-adds per head. (JL_LUT = 0: one FMA per bit and head.)
// * Codes by table: a nibble of polar words (two 2-bit codes) indexes a
//   16-entry table of centroid pairs (cdec), for the keys' polar dot and for
//   the values (CODE_LUT = 0: compare/select per code). The polar dot stays one
//   FMA per dim and head, each query read (a broadcast from workgroup memory)
//   serving two keys.
// * Loads in flight: every thread issues its share of the split's value words
//   (STAGE_V: the whole split is staged in workgroup memory), then its two keys'
//   words (vec4 loads: d = 128 takes 2 + 1 for the codes and signs, 2 scalar
//   norm words), all independent, before it waits on any of them.
// * Softmax without per-element passes: each thread keeps its keys' scores in
//   registers; the split max is two levels of a workgroup reduction (3
//   barriers), each thread writes its keys' weights p * value_norm once
//   (vec4 per head quad), and the sums of p are reduced at the end.
// * Values: thread (c, grp) owns dims 4c..4c+3 of every head's accumulator
//   (rotated space) and walks rows grp, grp + 256/(d/4), ...: one staged word,
//   two table reads and one weight vec4 per row for 4 * G FMAs.
//
//   score = norm * (sum_d q_rot[d] c[idx_d] + residual_norm * qjl_scale * signed_sum) * scale
//   signed_sum = 2 * sum_{bit_d = 1} q_jl[d] - sum_d q_jl[d]
//
// Not registered in the service (KERNELS): bench/probes/tq_decode_variants.py adds
// it for its run. Constraints (the host checks them there):
// head_dim in {32, 64, 128}; G in {1, 2, 4, 8}; split_len <= SPLIT in {256, 512}
// (<= 2 keys per thread); page size >= 16; the workgroup memory these sizes take
// fits the device. Vec4 reads need every region start and row the kernel reads
// as vec4 at a multiple of four words: the slab's regions are vecs * words long
// with vecs a multiple of 16 (whole pages), query rows are d long, and the
// rotated-query segment starts at a multiple of four words (arena alignment).
//
// Measured on the H200 (bench/probes/tq_decode_variants.py; step = rotation + split +
// merge, GPU time): 32k 0.084 ms, 128k 0.308 ms against the then shipped
// turboquant-only kernel's 0.097 / 0.344 (against the tqx kernel at a6389aa, v2 with
// STAGE_V = 0: 0.073 / 0.264 against 0.085 / 0.306);
// STAGE_V = 0 (19 KiB of workgroup memory instead of 35) 0.073 / 0.265: the staging's
// workgroup memory costs more occupancy than its single round trip saves. The
// table lookups pay: all-ALU (JL_LUT = CODE_LUT = 0) is slower. v3 continues from
// here (flash_attention_tq_split_v3.wgsl).
//
// Bind group 0: as attention_split_tqx (include/split_tq_v2_decls.wgsl).
// Dispatch: (the batch's largest n_splits, n_kv_heads, query rows of the batch)
// workgroups of 256 threads; a workgroup past its item's n_splits returns.

{TQX_CONSTS}

// #include "split_tq_v2_decls.wgsl"

var<workgroup> qv: array<vec4<f32>, GROUP * HEAD_DIM / 4u>;
var<workgroup> qjv: array<vec4<f32>, (1u - JL_LUT) * GROUP * HEAD_DIM / 4u + 1u>;
var<workgroup> jlut: array<vec2<f32>, JL_LUT * ((GROUP + 1u) / 2u) * HEAD_DIM * 4u + 1u>;
// the split's value polar words, row t at t * d/16
var<workgroup> vstage: array<u32, STAGE_V * SPLIT * HEAD_DIM / 16u + 1u>;
// weights p * value norm, row t, head quad q at t * nq + q; before the weights,
// the reductions' first level (WG vec4 per quad); after the value phase, the
// row-group sums of the accumulators (WG vec4 per head)
var<workgroup> wts: array<vec4<f32>, SPLIT * ((GROUP + 3u) / 4u)>;
var<workgroup> red4: array<vec4<f32>, 32>;
var<workgroup> cdec: array<vec2<f32>, 16>;
var<workgroup> qsum_sh: array<f32, 8>;
var<workgroup> pg_sh: array<u32, SPLIT / 16u + 1u>;
var<workgroup> padbuf: array<u32, PAD + 1u>;

fn wrow(t: u32, q: u32) -> vec4<f32> {
    return wts[t * ((GROUP + 3u) / 4u) + q];
}

@compute @workgroup_size(256, 1, 1)
fn attention_split_tq_v2(
    @builtin(local_invocation_id) lid: vec3<u32>,
    @builtin(workgroup_id) wid: vec3<u32>,
) {
    let tid = lid.x;
    let prm = params[wid.z];
    let n_heads = prm.n_heads;
    let n_kv_heads = prm.n_kv_heads;
    let max_seq = prm.max_seq;
    let start_pos = prm.start_pos;
    let scale = prm.scale;
    let q_cap = prm.q_cap;
    let split_len = prm.split_len;
    let qjl_scale = prm.qjl_scale;
    let n_splits = prm.n_splits;
    let kc = key_centroids(HEAD_DIM);          // turboquant's 2-bit codebook (TQX_CONSTS)
    let cb = vec4<f32>(kc[0], kc[1], kc[2], kc[3]);
    let q_row = prm.q_row;
    let q_idx = q_row;
    let q_off = prm.q_off;
    let part_off = prm.part_off;
    let table_off = prm.table_off;
    let page_shift = prm.page_shift;
    let cache_cap = prm.cache_cap;
    let flags = prm.flags;

    let split = wid.x;
    let kv_head = wid.y;
    if split >= n_splits {
        return;                                // a shorter item of the batch
    }
    let group = GROUP;                         // = n_heads / n_kv_heads, fixed per pipeline
    let head_dim = HEAD_DIM;                   // = prm.head_dim, fixed per pipeline
    let d4 = HEAD_DIM / 4u;
    let pw = HEAD_DIM / 16u;
    let nq = (GROUP + 3u) / 4u;                // head quads
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

    let vecs = n_kv_heads * cache_cap;
    let k_jl_off = vecs * pw;
    let k_norm_off = k_jl_off + vecs * (HEAD_DIM / 32u);
    let v_norm_off = vecs * pw;
    let hslot = kv_head * cache_cap;
    let page0 = t0 >> page_shift;
    let n_pg = select(0u, ((t0 + n_t - 1u) >> page_shift) - page0 + 1u, n_t > 0u);
    for (var i = tid; i < n_pg; i += WG) {
        pg_sh[i] = pages[table_off + page0 + i];
    }
    if PAD > 0u && n_t == 0xFFFFFFFFu {
        padbuf[tid] = n_pg;                      // keeps the padding (never runs)
    }

    // ── prologue: queries, the JL tables, the code table ──
    let q_region = q_cap * n_heads * head_dim;
    let q_first = q_off + (q_idx * n_heads + kv_head * group) * head_dim;   // a multiple of 4
    let qv_first = q_first >> 2u;
    let qj_first = (q_region + q_first) >> 2u;
    for (var e = tid; e < group * d4; e += WG) {
        qv[e] = qrot[qv_first + e];
        if JL_LUT == 0u {
            qjv[e] = qrot[qj_first + e];
        }
    }
    if tid < group {
        qsum_sh[tid] = qf(q_off + 2u * q_region + q_idx * n_heads + kv_head * group + tid);
    }
    if tid < 16u {
        cdec[tid] = vec2<f32>(cb[tid & 3u], cb[tid >> 2u]);
    }
    if JL_LUT == 1u {
        let units = ((group + 1u) / 2u) * d4;
        for (var u = tid; u < units; u += WG) {
            let p = u / d4;
            let g = u % d4;
            let x = qrot[qj_first + 2u * p * d4 + g];
            var y = vec4<f32>(0.0);
            if 2u * p + 1u < group {
                y = qrot[qj_first + (2u * p + 1u) * d4 + g];
            }
            let e = u * 16u;                     // = (p * d4 + g) * 16
            let v1 = vec2<f32>(x.x, y.x);
            let v2 = vec2<f32>(x.y, y.y);
            let v4 = vec2<f32>(x.z, y.z);
            let v8 = vec2<f32>(x.w, y.w);
            let v3 = v1 + v2;
            jlut[e] = vec2<f32>(0.0);
            jlut[e + 1u] = v1;
            jlut[e + 2u] = v2;
            jlut[e + 3u] = v3;
            jlut[e + 4u] = v4;
            jlut[e + 5u] = v1 + v4;
            jlut[e + 6u] = v2 + v4;
            jlut[e + 7u] = v3 + v4;
            jlut[e + 8u] = v8;
            jlut[e + 9u] = v1 + v8;
            jlut[e + 10u] = v2 + v8;
            jlut[e + 11u] = v3 + v8;
            let v12 = v4 + v8;
            jlut[e + 12u] = v12;
            jlut[e + 13u] = v1 + v12;
            jlut[e + 14u] = v2 + v12;
            jlut[e + 15u] = v3 + v12;
        }
    }
    workgroupBarrier();

    // ── 1. loads: the split's value words (staged), then each thread's two keys ──
    let upr = max(pw / 4u, 1u);                  // staging units per row
    let n_units = n_t * upr;
    var sv0 = vec4<u32>(0u);
    var sv1 = vec4<u32>(0u);
    var sv2 = vec4<u32>(0u);
    var sv3 = vec4<u32>(0u);
    if STAGE_V == 1u {
        if tid < n_units { sv0 = load_vunit(tid, hslot, page0, page_shift, t0); }
        if tid + WG < n_units { sv1 = load_vunit(tid + WG, hslot, page0, page_shift, t0); }
        if tid + 2u * WG < n_units { sv2 = load_vunit(tid + 2u * WG, hslot, page0, page_shift, t0); }
        if tid + 3u * WG < n_units { sv3 = load_vunit(tid + 3u * WG, hslot, page0, page_shift, t0); }
    }
    // keys: thread i takes keys i and i + ceil(n_t / 2) (SPLIT <= WG: key i alone)
    let half = select((n_t + 1u) / 2u, n_t, SPLIT <= WG);
    let ta = tid;
    let tb = tid + half;
    let has_a = tid < half;
    let has_b = tb < n_t;
    var ka: Key;
    var kb: Key;
    var vna = 0.0;
    var vnb = 0.0;
    if has_a {
        let sa = hslot + split_row(page0, page_shift, t0 + ta);
        ka = load_key(sa, k_jl_off, k_norm_off);
        vna = unpack2x16float(vword(v_norm_off + sa)).x;
        kb = ka;
        if has_b {
            let sb = hslot + split_row(page0, page_shift, t0 + tb);
            kb = load_key(sb, k_jl_off, k_norm_off);
            vnb = unpack2x16float(vword(v_norm_off + sb)).x;
        }
    }
    if STAGE_V == 1u {
        if tid < n_units { stage_vunit(tid, sv0); }
        if tid + WG < n_units { stage_vunit(tid + WG, sv1); }
        if tid + 2u * WG < n_units { stage_vunit(tid + 2u * WG, sv2); }
        if tid + 3u * WG < n_units { stage_vunit(tid + 3u * WG, sv3); }
    }

    // ── 2. scores of keys A and B, every head, in registers ──
    var sa_lo = vec4<f32>(NEG_INF);
    var sa_hi = vec4<f32>(NEG_INF);
    var sb_lo = vec4<f32>(NEG_INF);
    var sb_hi = vec4<f32>(NEG_INF);
    if has_a {
        var pa = vec4<f32>(0.0);   // key A: polar, heads 0..3
        var pb = vec4<f32>(0.0);   // key A: polar, heads 4..7
        var qa = vec4<f32>(0.0);   // key B: polar
        var qb = vec4<f32>(0.0);
        var ja = vec4<f32>(0.0);   // key A: sums of q_jl over set bits
        var jb = vec4<f32>(0.0);
        var ra = vec4<f32>(0.0);   // key B
        var rb = vec4<f32>(0.0);
        polar_word(ka.p0.x, kb.p0.x, 0u, cb, &pa, &pb, &qa, &qb);
        polar_word(ka.p0.y, kb.p0.y, 1u, cb, &pa, &pb, &qa, &qb);
        jl_word(ka.j.x, kb.j.x, 0u, &ja, &jb, &ra, &rb);
        if HEAD_DIM >= 64u {
            polar_word(ka.p0.z, kb.p0.z, 2u, cb, &pa, &pb, &qa, &qb);
            polar_word(ka.p0.w, kb.p0.w, 3u, cb, &pa, &pb, &qa, &qb);
            jl_word(ka.j.y, kb.j.y, 1u, &ja, &jb, &ra, &rb);
        }
        if HEAD_DIM == 128u {
            polar_word(ka.p1.x, kb.p1.x, 4u, cb, &pa, &pb, &qa, &qb);
            polar_word(ka.p1.y, kb.p1.y, 5u, cb, &pa, &pb, &qa, &qb);
            polar_word(ka.p1.z, kb.p1.z, 6u, cb, &pa, &pb, &qa, &qb);
            polar_word(ka.p1.w, kb.p1.w, 7u, cb, &pa, &pb, &qa, &qb);
            jl_word(ka.j.z, kb.j.z, 2u, &ja, &jb, &ra, &rb);
            jl_word(ka.j.w, kb.j.w, 3u, &ja, &jb, &ra, &rb);
        }
        let qs_lo = vec4<f32>(qsum_sh[0], qsum_sh[1], qsum_sh[2], qsum_sh[3]);
        sa_lo = tq_scores4(pa, ja, qs_lo, ka.nr, qjl_scale, scale, 0u);
        sb_lo = tq_scores4(qa, ra, qs_lo, kb.nr, qjl_scale, scale, 0u);
        if GROUP > 4u {
            let qs_hi = vec4<f32>(qsum_sh[4], qsum_sh[5], qsum_sh[6], qsum_sh[7]);
            sa_hi = tq_scores4(pb, jb, qs_hi, ka.nr, qjl_scale, scale, 4u);
            sb_hi = tq_scores4(qb, rb, qs_hi, kb.nr, qjl_scale, scale, 4u);
        }
    }

    // ── 3. split max per head: per thread, then 16 groups of 16, then all ──
    var m_lo = sa_lo;
    var m_hi = sa_hi;
    if has_b {
        m_lo = max(m_lo, sb_lo);
        m_hi = max(m_hi, sb_hi);
    }
    wts[tid] = m_lo;
    if GROUP > 4u {
        wts[WG + tid] = m_hi;
    }
    if CUT == 1u {
        return;
    }
    workgroupBarrier();
    if tid < 16u * nq {
        let base = (tid / 16u) * WG + (tid % 16u) * 16u;
        var mx = wts[base];
        for (var k = 1u; k < 16u; k += 1u) {
            mx = max(mx, wts[base + k]);
        }
        red4[tid] = mx;
    }
    workgroupBarrier();
    var mt_lo = red4[0];
    var mt_hi = vec4<f32>(NEG_INF);
    for (var k = 1u; k < 16u; k += 1u) {
        mt_lo = max(mt_lo, red4[k]);
    }
    if GROUP > 4u {
        mt_hi = red4[16];
        for (var k = 17u; k < 32u; k += 1u) {
            mt_hi = max(mt_hi, red4[k]);
        }
    }

    // ── 4. weights p * value norm of the thread's keys (vec4 per head quad) ──
    var l_lo = vec4<f32>(0.0);
    var l_hi = vec4<f32>(0.0);
    if has_a {
        let e = exp(sa_lo - mt_lo);
        l_lo += e;
        wts[ta * nq] = e * vna;
        if GROUP > 4u {
            let f = exp(sa_hi - mt_hi);
            l_hi += f;
            wts[ta * nq + 1u] = f * vna;
        }
    }
    if has_b {
        let e = exp(sb_lo - mt_lo);
        l_lo += e;
        wts[tb * nq] = e * vnb;
        if GROUP > 4u {
            let f = exp(sb_hi - mt_hi);
            l_hi += f;
            wts[tb * nq + 1u] = f * vnb;
        }
    }
    if CUT == 2u {
        return;
    }
    workgroupBarrier();

    // ── 5. values: thread (c, grp) owns dims 4c..4c+3 of every head ──
    let n_grp = WG / d4;
    let c = tid % d4;
    let grp = tid / d4;
    let vw = c / 4u;                             // value word of dims 4c..4c+3
    let vsh = 8u * (c % 4u);
    var a0 = vec4<f32>(0.0);
    var a1 = vec4<f32>(0.0);
    var a2 = vec4<f32>(0.0);
    var a3 = vec4<f32>(0.0);
    var a4 = vec4<f32>(0.0);
    var a5 = vec4<f32>(0.0);
    var a6 = vec4<f32>(0.0);
    var a7 = vec4<f32>(0.0);
    var t = grp;
    for (; t + 3u * n_grp < n_t; t += 4u * n_grp) {
        var w0: u32;
        var w1: u32;
        var w2: u32;
        var w3: u32;
        if STAGE_V == 1u {
            w0 = vstage[t * pw + vw];
            w1 = vstage[(t + n_grp) * pw + vw];
            w2 = vstage[(t + 2u * n_grp) * pw + vw];
            w3 = vstage[(t + 3u * n_grp) * pw + vw];
        } else {
            w0 = vword((hslot + split_row(page0, page_shift, t0 + t)) * pw + vw);
            w1 = vword((hslot + split_row(page0, page_shift, t0 + t + n_grp)) * pw + vw);
            w2 = vword((hslot + split_row(page0, page_shift, t0 + t + 2u * n_grp)) * pw + vw);
            w3 = vword((hslot + split_row(page0, page_shift, t0 + t + 3u * n_grp)) * pw + vw);
        }
        // #include "split_tq_v2_accumulate.wgsl" W=w0 T=t
        // #include "split_tq_v2_accumulate.wgsl" W=w1 T="(t + n_grp)"
        // #include "split_tq_v2_accumulate.wgsl" W=w2 T="(t + 2u * n_grp)"
        // #include "split_tq_v2_accumulate.wgsl" W=w3 T="(t + 3u * n_grp)"
    }
    for (; t < n_t; t += n_grp) {
        var w0: u32;
        if STAGE_V == 1u {
            w0 = vstage[t * pw + vw];
        } else {
            w0 = vword((hslot + split_row(page0, page_shift, t0 + t)) * pw + vw);
        }
        // #include "split_tq_v2_accumulate.wgsl" W=w0 T=t
    }
    if CUT == 3u {
        red4[tid % 32u] = a0 + a1 + a2 + a3 + a4 + a5 + a6 + a7;
        return;
    }
    workgroupBarrier();

    // ── 6. sums of p: per thread, 16 groups of 16, then heads; write m and l ──
    wts[tid] = l_lo;
    if GROUP > 4u {
        wts[WG + tid] = l_hi;
    }
    workgroupBarrier();
    if tid < 16u * nq {
        let base = (tid / 16u) * WG + (tid % 16u) * 16u;
        var sum = wts[base];
        for (var k = 1u; k < 16u; k += 1u) {
            sum += wts[base + k];
        }
        red4[tid] = sum;
    }
    workgroupBarrier();
    let n_part = q_cap * n_heads * n_splits;
    let pbase = (q_idx * n_heads + kv_head * group) * n_splits + split;
    if tid < group {
        let qd = tid / 4u;
        let hh = tid % 4u;
        var l = 0.0;
        for (var k = 0u; k < 16u; k += 1u) {
            l += red4[qd * 16u + k][hh];
        }
        let pi = pbase + tid * n_splits;
        partial[part_off + n_part * head_dim + pi] = select(mt_lo[hh], mt_hi[hh], qd == 1u);
        partial[part_off + n_part * (head_dim + 1u) + pi] = l;
    }

    // ── 7. sum the accumulators' row groups (through wts), write them ──
    let hpp = (SPLIT * nq) / WG;                 // heads per pass (wts holds WG vec4 per head)
    for (var h0 = 0u; h0 < group; h0 += hpp) {
        for (var hh = 0u; hh < hpp; hh += 1u) {
            if h0 + hh < group {
                wts[hh * WG + tid] = pick(h0 + hh, a0, a1, a2, a3, a4, a5, a6, a7);
            }
        }
        workgroupBarrier();
        let hh = tid / d4;
        let cc = tid % d4;
        if hh < hpp && h0 + hh < group {
            var sum = vec4<f32>(0.0);
            for (var g = 0u; g < n_grp; g += 1u) {
                sum += wts[hh * WG + g * d4 + cc];
            }
            let po = part_off + (pbase + (h0 + hh) * n_splits) * head_dim + 4u * cc;
            partial[po] = sum.x;
            partial[po + 1u] = sum.y;
            partial[po + 2u] = sum.z;
            partial[po + 3u] = sum.w;
        }
        workgroupBarrier();
    }
}
