// Split-KV attention over the TurboQuant cache (decode path), third design: the
// scoring of flash_attention_tq_split_v2.wgsl (JL nibble tables, codes through
// a 16-entry table, two keys per thread; read its header) with the workgroup
// memory and the latency it measured as its bounds on the H200 taken down:
//
// * Small footprint (more workgroups per SM): the JL tables, the reductions'
//   first level, the weights and the accumulators' row-group sums share one
//   array (jlut), phase after phase; no value staging. G = 4, d = 128: 11 KiB
//   (v2: 19 KiB without staging, 35 KiB with it; 16 KiB more measured 1.4-1.6x
//   slower on the H200).
// * Value words prefetched in registers: a thread's first eight value rows are
//   loaded before its keys, and the value phase loads rows j + 1 (eight words)
//   before it decodes rows j, so its chain of dependent global loads (16 steps
//   at 512-key splits, each a DRAM round trip past the L2) is overlapped.
// * One reduction for max and sum: each thread keeps the local max m_i of its
//   keys and l_i = sum exp(s - m_i); one two-level reduction gives the split's
//   M and L = sum l_i exp(m_i - M); the weights are exp(s - m_i) exp(m_i - M)
//   times the value norm (no reduction of the sums at the end).
//
// Measured on the H200 (bench/probes/tq_decode_variants.py; step = rotation + split +
// merge, GPU time), VPF = 0: 32k 0.073 ms, 128k 0.231 ms against the then shipped
// turboquant-only kernel's 0.097 / 0.345 (1.32x / 1.50x; against the tqx kernel at
// a6389aa: 0.074 / 0.230 against 0.085 / 0.306, 1.15x / 1.33x); torch bf16 SDPA 0.042 / 0.137. Phase cuts at 128k
// (split kernel alone 0.210 ms): scores 0.104 (polar dot ~60%, JL ~25%), softmax
// + weights 0.015, values ~0.06, the row-group sums and partials ~0.02. Deeper
// value prefetch (VPF = 2) and one key per thread (SPLIT 256) measured slower: the
// kernel is bound by registers per thread (occupancy) and by workgroup-memory
// reads (the polar dot's broadcast query reads and table lookups).
//
// Same params, bindings and partials as attention_split_tqx.turboquant (attention_merge
// finishes it). Constraints: as v2 (head_dim 32/64/128, G 1/2/4/8, split_len
// <= SPLIT in {256, 512}, page size >= 16, the workgroup memory fits).
// Dispatch: (the batch's largest n_splits, n_kv_heads, query rows) x 256 threads.

{TQX_CONSTS}

// #include "split_tq_v2_decls.wgsl"

var<workgroup> qv: array<vec4<f32>, GROUP * HEAD_DIM / 4u>;
var<workgroup> qjv: array<vec4<f32>, (1u - JL_LUT) * GROUP * HEAD_DIM / 4u + 1u>;
// JL tables while scoring; then (as vec4 = two entries) the (m, l) pairs of the
// reduction (quad q: m at 2q*WG + tid, l at (2q+1)*WG + tid), the weights (row
// t, quad q at t * nq + q) and the accumulators' row-group sums (WG per head)
var<workgroup> jlut: array<vec2<f32>, max(JL_LUT * ((GROUP + 1u) / 2u) * HEAD_DIM * 4u,
                                         max(4u * WG * ((GROUP + 3u) / 4u), 2u * SPLIT * ((GROUP + 3u) / 4u)))>;
var<workgroup> vstage: array<u32, 1>;           // (no staging; the helpers name it)
var<workgroup> red4: array<vec4<f32>, 64>;
var<workgroup> cdec: array<vec2<f32>, 16>;
var<workgroup> qsum_sh: array<f32, 8>;
var<workgroup> pg_sh: array<u32, SPLIT / 16u + 1u>;
var<workgroup> padbuf: array<u32, PAD + 1u>;

fn wget(i: u32) -> vec4<f32> {
    return vec4<f32>(jlut[2u * i], jlut[2u * i + 1u]);
}

fn wset(i: u32, x: vec4<f32>) {
    jlut[2u * i] = x.xy;
    jlut[2u * i + 1u] = x.zw;
}

fn wrow(t: u32, q: u32) -> vec4<f32> {
    return wget(t * ((GROUP + 3u) / 4u) + q);
}

// The value word of row t (of the split) holding this thread's dims.
fn vrow(t: u32, hslot: u32, page0: u32, shift: u32, t0: u32, vw: u32) -> u32 {
    return vword((hslot + split_row(page0, shift, t0 + t)) * (HEAD_DIM / 16u) + vw);
}

// (m, l) of a run of keys merged with (m2, l2), per head.
fn ml_merge(m: vec4<f32>, l: vec4<f32>, m2: vec4<f32>, l2: vec4<f32>) -> array<vec4<f32>, 2> {
    let mx = max(m, m2);
    return array<vec4<f32>, 2>(mx, l * exp(m - mx) + l2 * exp(m2 - mx));
}

@compute @workgroup_size(256, 1, 1)
fn attention_split_tq_v3(
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
    let nq = (GROUP + 3u) / 4u;
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
            let e = u * 16u;
            let v1 = vec2<f32>(x.x, y.x);
            let v2 = vec2<f32>(x.y, y.y);
            let v4 = vec2<f32>(x.z, y.z);
            let v8 = vec2<f32>(x.w, y.w);
            let v3 = v1 + v2;
            let v12 = v4 + v8;
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
            jlut[e + 12u] = v12;
            jlut[e + 13u] = v1 + v12;
            jlut[e + 14u] = v2 + v12;
            jlut[e + 15u] = v3 + v12;
        }
    }
    workgroupBarrier();

    // ── 1. loads: the thread's first eight value rows, then its two keys ──
    // value phase roles: thread (c, grp) owns dims 4c..4c+3, rows grp + n_grp * r
    let n_grp = WG / d4;
    let c = tid % d4;
    let grp = tid / d4;
    let vw = c / 4u;
    let vsh = 8u * (c % 4u);
    var n_my = 0u;                               // rows of this thread
    if grp < n_t {
        n_my = (n_t - grp + n_grp - 1u) / n_grp;
    }
    var c0 = 0u;
    var c1 = 0u;
    var c2 = 0u;
    var c3 = 0u;
    var c4 = 0u;
    var c5 = 0u;
    var c6 = 0u;
    var c7 = 0u;
    var n0 = 0u;
    var n1 = 0u;
    var n2 = 0u;
    var n3 = 0u;
    var n4 = 0u;
    var n5 = 0u;
    var n6 = 0u;
    var n7 = 0u;
    if VPF >= 1u {
        // #include "split_tq_v3_vload.wgsl" DST=c J=0u
    }
    if VPF == 2u {
        // #include "split_tq_v3_vload.wgsl" DST=n J=1u
    }

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

    // ── 2. scores of keys A and B, every head, in registers ──
    var sa_lo = vec4<f32>(NEG_INF);
    var sa_hi = vec4<f32>(NEG_INF);
    var sb_lo = vec4<f32>(NEG_INF);
    var sb_hi = vec4<f32>(NEG_INF);
    if has_a {
        var pa = vec4<f32>(0.0);
        var pb = vec4<f32>(0.0);
        var qa = vec4<f32>(0.0);
        var qb = vec4<f32>(0.0);
        var ja = vec4<f32>(0.0);
        var jb = vec4<f32>(0.0);
        var ra = vec4<f32>(0.0);
        var rb = vec4<f32>(0.0);
        if SKIP != 1u { polar_word(ka.p0.x, kb.p0.x, 0u, cb, &pa, &pb, &qa, &qb); }
        if SKIP != 1u { polar_word(ka.p0.y, kb.p0.y, 1u, cb, &pa, &pb, &qa, &qb); }
        if SKIP != 2u { jl_word(ka.j.x, kb.j.x, 0u, &ja, &jb, &ra, &rb); }
        if HEAD_DIM >= 64u {
            if SKIP != 1u { polar_word(ka.p0.z, kb.p0.z, 2u, cb, &pa, &pb, &qa, &qb); }
            if SKIP != 1u { polar_word(ka.p0.w, kb.p0.w, 3u, cb, &pa, &pb, &qa, &qb); }
            if SKIP != 2u { jl_word(ka.j.y, kb.j.y, 1u, &ja, &jb, &ra, &rb); }
        }
        if HEAD_DIM == 128u {
            if SKIP != 1u { polar_word(ka.p1.x, kb.p1.x, 4u, cb, &pa, &pb, &qa, &qb); }
            if SKIP != 1u { polar_word(ka.p1.y, kb.p1.y, 5u, cb, &pa, &pb, &qa, &qb); }
            if SKIP != 1u { polar_word(ka.p1.z, kb.p1.z, 6u, cb, &pa, &pb, &qa, &qb); }
            if SKIP != 1u { polar_word(ka.p1.w, kb.p1.w, 7u, cb, &pa, &pb, &qa, &qb); }
            if SKIP != 2u { jl_word(ka.j.z, kb.j.z, 2u, &ja, &jb, &ra, &rb); }
            if SKIP != 2u { jl_word(ka.j.w, kb.j.w, 3u, &ja, &jb, &ra, &rb); }
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

    if VPF == 0u {
        // (VPF = 0: the first eight rows are loaded now, in flight during the reductions)
        // #include "split_tq_v3_vload.wgsl" DST=c J=0u
    }

    // ── 3. local (max, sum of exp) of the thread's keys; one reduction for both ──
    var m_lo = sa_lo;
    var m_hi = sa_hi;
    if has_b {
        m_lo = max(m_lo, sb_lo);
        m_hi = max(m_hi, sb_hi);
    }
    var ea_lo = vec4<f32>(0.0);
    var ea_hi = vec4<f32>(0.0);
    var eb_lo = vec4<f32>(0.0);
    var eb_hi = vec4<f32>(0.0);
    if has_a {
        ea_lo = exp(sa_lo - m_lo);
        ea_hi = exp(sa_hi - m_hi);
    }
    if has_b {
        eb_lo = exp(sb_lo - m_lo);
        eb_hi = exp(sb_hi - m_hi);
    }
    let l_lo = ea_lo + eb_lo;
    let l_hi = ea_hi + eb_hi;
    workgroupBarrier();                          // every thread is done with the JL tables
    wset(tid, m_lo);
    wset(WG + tid, l_lo);
    if GROUP > 4u {
        wset(2u * WG + tid, m_hi);
        wset(3u * WG + tid, l_hi);
    }
    if CUT == 1u {
        return;
    }
    workgroupBarrier();
    if tid < 16u * nq {
        let qd = tid / 16u;
        let base = 2u * qd * WG + (tid % 16u) * 16u;
        var m = wget(base);
        var l = wget(base + WG);
        for (var k = 1u; k < 16u; k += 1u) {
            let r = ml_merge(m, l, wget(base + k), wget(base + WG + k));
            m = r[0];
            l = r[1];
        }
        red4[2u * tid] = m;
        red4[2u * tid + 1u] = l;
    }
    workgroupBarrier();
    var mt_lo = red4[0];
    var lt_lo = red4[1];
    for (var k = 1u; k < 16u; k += 1u) {
        let r = ml_merge(mt_lo, lt_lo, red4[2u * k], red4[2u * k + 1u]);
        mt_lo = r[0];
        lt_lo = r[1];
    }
    var mt_hi = vec4<f32>(NEG_INF);
    var lt_hi = vec4<f32>(0.0);
    if GROUP > 4u {
        mt_hi = red4[32];
        lt_hi = red4[33];
        for (var k = 17u; k < 32u; k += 1u) {
            let r = ml_merge(mt_hi, lt_hi, red4[2u * k], red4[2u * k + 1u]);
            mt_hi = r[0];
            lt_hi = r[1];
        }
    }

    // ── 4. weights p * value norm of the thread's keys (vec4 per head quad) ──
    let fa_lo = exp(m_lo - mt_lo);
    let fa_hi = exp(m_hi - mt_hi);
    if has_a {
        wset(ta * nq, ea_lo * fa_lo * vna);
        if GROUP > 4u {
            wset(ta * nq + 1u, ea_hi * fa_hi * vna);
        }
    }
    if has_b {
        wset(tb * nq, eb_lo * fa_lo * vnb);
        if GROUP > 4u {
            wset(tb * nq + 1u, eb_hi * fa_hi * vnb);
        }
    }
    if CUT == 2u {
        return;
    }
    workgroupBarrier();

    // ── 5. values: eight rows a step, the rows VPF steps ahead loaded before these are used ──
    var a0 = vec4<f32>(0.0);
    var a1 = vec4<f32>(0.0);
    var a2 = vec4<f32>(0.0);
    var a3 = vec4<f32>(0.0);
    var a4 = vec4<f32>(0.0);
    var a5 = vec4<f32>(0.0);
    var a6 = vec4<f32>(0.0);
    var a7 = vec4<f32>(0.0);
    let n_chunks = (n_my + 7u) / 8u;
    for (var j = 0u; j < n_chunks; j += 1u) {
        var m0 = 0u;
        var m1 = 0u;
        var m2 = 0u;
        var m3 = 0u;
        var m4 = 0u;
        var m5 = 0u;
        var m6 = 0u;
        var m7 = 0u;
        // #include "split_tq_v3_vload.wgsl" DST=m J="(j + max(VPF, 1u))"
        let r0 = 8u * j;
        let tt = grp + n_grp * r0;
        if r0 < n_my {
            // #include "split_tq_v2_accumulate.wgsl" W=c0 T=tt
        }
        if r0 + 1u < n_my {
            // #include "split_tq_v2_accumulate.wgsl" W=c1 T="(tt + n_grp)"
        }
        if r0 + 2u < n_my {
            // #include "split_tq_v2_accumulate.wgsl" W=c2 T="(tt + 2u * n_grp)"
        }
        if r0 + 3u < n_my {
            // #include "split_tq_v2_accumulate.wgsl" W=c3 T="(tt + 3u * n_grp)"
        }
        if r0 + 4u < n_my {
            // #include "split_tq_v2_accumulate.wgsl" W=c4 T="(tt + 4u * n_grp)"
        }
        if r0 + 5u < n_my {
            // #include "split_tq_v2_accumulate.wgsl" W=c5 T="(tt + 5u * n_grp)"
        }
        if r0 + 6u < n_my {
            // #include "split_tq_v2_accumulate.wgsl" W=c6 T="(tt + 6u * n_grp)"
        }
        if r0 + 7u < n_my {
            // #include "split_tq_v2_accumulate.wgsl" W=c7 T="(tt + 7u * n_grp)"
        }
        if VPF == 2u {
            c0 = n0;
            c1 = n1;
            c2 = n2;
            c3 = n3;
            c4 = n4;
            c5 = n5;
            c6 = n6;
            c7 = n7;
            n0 = m0;
            n1 = m1;
            n2 = m2;
            n3 = m3;
            n4 = m4;
            n5 = m5;
            n6 = m6;
            n7 = m7;
        } else {
            c0 = m0;
            c1 = m1;
            c2 = m2;
            c3 = m3;
            c4 = m4;
            c5 = m5;
            c6 = m6;
            c7 = m7;
        }
    }
    if CUT == 3u {
        red4[tid % 64u] = a0 + a1 + a2 + a3 + a4 + a5 + a6 + a7;
        return;
    }
    workgroupBarrier();

    // ── 6. m and l; the accumulators' row groups summed through jlut ──
    let n_part = q_cap * n_heads * n_splits;
    let pbase = (q_idx * n_heads + kv_head * group) * n_splits + split;
    if tid < group {
        let hi = tid >= 4u;
        let hh = tid % 4u;
        let pi = pbase + tid * n_splits;
        partial[part_off + n_part * head_dim + pi] = select(mt_lo[hh], mt_hi[hh], hi);
        partial[part_off + n_part * (head_dim + 1u) + pi] = select(lt_lo[hh], lt_hi[hh], hi);
    }
    let hpp = (arrayLength_jlut_vec4() / WG);    // heads per pass
    for (var h0 = 0u; h0 < group; h0 += hpp) {
        for (var hh = 0u; hh < hpp; hh += 1u) {
            if h0 + hh < group {
                wset(hh * WG + tid, pick(h0 + hh, a0, a1, a2, a3, a4, a5, a6, a7));
            }
        }
        workgroupBarrier();
        let hh = tid / d4;
        let cc = tid % d4;
        if hh < hpp && h0 + hh < group {
            var sum = vec4<f32>(0.0);
            for (var g = 0u; g < n_grp; g += 1u) {
                sum += wget(hh * WG + g * d4 + cc);
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

// Capacity of jlut in vec4 (its declared length / 2).
fn arrayLength_jlut_vec4() -> u32 {
    return max(JL_LUT * ((GROUP + 1u) / 2u) * HEAD_DIM * 4u,
               max(4u * WG * ((GROUP + 3u) / 4u), 2u * SPLIT * ((GROUP + 3u) / 4u))) / 2u;
}
