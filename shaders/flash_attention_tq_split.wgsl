// Split-KV attention (flash-decoding) over the TurboQuant cache: the decode path.
//
// The same estimator and value path as `flash_attention_tq.wgsl` (see its
// comments and docs/turboquant.md), reorganized like `attention_split.wgsl`:
// one workgroup per (split, KV head, query row) serves every query head of the
// GQA group, so each compressed key is read once per query row, and thousands
// of workgroups are in flight. Scores: one thread per key, two keys at a time
// (each query read serves both). A thread loads its keys' words (d = 128: 8
// polar, 4 JL, 1 norm each) straight from global memory, all independent,
// decodes four 2-bit codes (or four JL bits) per vec4 step once for all G
// heads, and reads the rotated queries from workgroup memory, where every
// thread of a subgroup reads the same address (a broadcast). No staging and no
// barriers in this phase. Values: thread (c, grp) owns the vec4 column c of the
// rotated accumulator of EVERY query head of the group (G vec4 registers) and
// reads value words straight from global memory, four rows per step. The
// pipeline is specialized per (G, head_dim) with override constants.
// The accumulator stays in rotated space; `attention_merge` (ROTATE) merges the
// splits and applies the inverse RHT. (Earlier versions staged tiles in
// workgroup memory, or scored one key per subgroup; docs/benchmarks.md has
// what each measured.)
//
//   score = norm * (sum_d q_rot[d] c[idx_d] + residual_norm * qjl_scale * signed_sum) * scale
//   signed_sum = 2 * sum_{bit_d = 1} q_jl[d] - sum_d q_jl[d]
//
// Constraints (checked host-side): head_dim in {32, 64, 128};
// G = n_heads / n_kv_heads in {1, 2, 4, 8}; G * split_len <= MAX_SCORES and
// split_len <= MAX_SPLIT.
//
// Bind group 0 (one dispatch serves a batch of attends, one params block per
// query row; a single attend is the batch of one):
// @binding(0) qrot:    array<f32>  every item's [q_rot | q_jl | sums] of q_cap rows
//                      (tq_rotate_q), the item's at word q_off
// @binding(1) k_cache: array<u32>  the pool slab's [polar | jl | norms] (cache_cap rows)
// @binding(2) v_cache: array<u32>  the slab's [polar | norms]
// @binding(3) partial: array<f32>  every item's [acc | m | l] (attention_merge.wgsl,
//                      q_total = q_cap), the item's at word part_off
// @binding(4) params:  array<TqSplitParams> (gpu/params.py TQ_SPLIT_PARAMS), block
//                      wid.z for query row q_row of its item
// @binding(5) pages:   array<u32> page tables (include/paging.wgsl)
//   flags bit 0: non-causal.
//
// Dispatch: (the batch's largest n_splits, n_kv_heads, query rows of the batch)
// workgroups of 256 threads; a workgroup past its item's n_splits returns.

// #include "split_tq_decls.wgsl"

// x (four decoded dims at vec4 column i) dotted with heads 0..3 / 4..7 of the
// group, queries at qbuf[base + h * d4 + i].
fn hq_lo(base: u32, i: u32, d4: u32, group: u32, x: vec4<f32>) -> vec4<f32> {
    var s = vec4<f32>(dot(qbuf[base + i], x), 0.0, 0.0, 0.0);
    if group > 1u { s.y = dot(qbuf[base + d4 + i], x); }
    if group > 2u {
        s.z = dot(qbuf[base + 2u * d4 + i], x);
        s.w = dot(qbuf[base + 3u * d4 + i], x);
    }
    return s;
}

fn hq_hi(base: u32, i: u32, d4: u32, x: vec4<f32>) -> vec4<f32> {
    return vec4<f32>(dot(qbuf[base + 4u * d4 + i], x), dot(qbuf[base + 5u * d4 + i], x),
                     dot(qbuf[base + 6u * d4 + i], x), dot(qbuf[base + 7u * d4 + i], x));
}

// One polar word (16 dims, vec4 columns 4w..4w+3) of two keys, A and B: the
// PolarQuant dot with every head, added to pa/pb (key A, heads 0..3 / 4..7)
// and qa/qb (key B). Each query load serves both keys.
fn polar_word(wa: u32, wb: u32, w: u32, d4: u32, group: u32, cb: vec4<f32>,
              pa: ptr<function, vec4<f32>>, pb: ptr<function, vec4<f32>>,
              qa: ptr<function, vec4<f32>>, qb: ptr<function, vec4<f32>>) {
    let sh = vec4<u32>(0u, 2u, 4u, 6u);
    for (var k4 = 0u; k4 < 4u; k4 += 1u) {
        let s = sh + vec4<u32>(8u * k4);
        let xa = cvals((vec4<u32>(wa) >> s) & vec4<u32>(3u), cb.x, cb.y, cb.z, cb.w);
        let xb = cvals((vec4<u32>(wb) >> s) & vec4<u32>(3u), cb.x, cb.y, cb.z, cb.w);
        let i = 4u * w + k4;
        var q = qbuf[i];
        (*pa).x += dot(q, xa);
        (*qa).x += dot(q, xb);
        if group > 1u {
            q = qbuf[d4 + i];
            (*pa).y += dot(q, xa);
            (*qa).y += dot(q, xb);
        }
        if group > 2u {
            q = qbuf[2u * d4 + i];
            (*pa).z += dot(q, xa);
            (*qa).z += dot(q, xb);
            q = qbuf[3u * d4 + i];
            (*pa).w += dot(q, xa);
            (*qa).w += dot(q, xb);
        }
        if group > 4u {
            *pb += hq_hi(0u, i, d4, xa);
            *qb += hq_hi(0u, i, d4, xb);
        }
    }
}

// One JL word (32 dims, vec4 columns 8w..8w+7) of keys A and B: the sums of
// q_jl over set bits, into ja/jb (key A) and ka/kb (key B).
fn jl_word(wa: u32, wb: u32, w: u32, d4: u32, group: u32,
           ja: ptr<function, vec4<f32>>, jb: ptr<function, vec4<f32>>,
           ka: ptr<function, vec4<f32>>, kb: ptr<function, vec4<f32>>) {
    let sh = vec4<u32>(0u, 1u, 2u, 3u);
    for (var k8 = 0u; k8 < 8u; k8 += 1u) {
        let s = sh + vec4<u32>(4u * k8);
        let xa = vec4<f32>((vec4<u32>(wa) >> s) & vec4<u32>(1u));
        let xb = vec4<f32>((vec4<u32>(wb) >> s) & vec4<u32>(1u));
        let i = 256u + 8u * w + k8;
        var q = qbuf[i];
        (*ja).x += dot(q, xa);
        (*ka).x += dot(q, xb);
        if group > 1u {
            q = qbuf[d4 + i];
            (*ja).y += dot(q, xa);
            (*ka).y += dot(q, xb);
        }
        if group > 2u {
            q = qbuf[2u * d4 + i];
            (*ja).z += dot(q, xa);
            (*ka).z += dot(q, xb);
            q = qbuf[3u * d4 + i];
            (*ja).w += dot(q, xa);
            (*ka).w += dot(q, xb);
        }
        if group > 4u {
            *jb += hq_hi(0u, i, d4, xa);
            *kb += hq_hi(0u, i, d4, xb);
        }
    }
}

// The words of one key: polar (up to 8), JL (up to 4), and the packed norms.
struct KeyWords {
    p: vec4<u32>,
    p2: vec4<u32>,
    j: vec4<u32>,
    nr: vec2<f32>,
}

fn load_key(slot: u32, pw: u32, jw: u32, k_jl_off: u32, k_norm_off: u32) -> KeyWords {
    var k: KeyWords;
    let po = slot * pw;
    let jo = k_jl_off + slot * jw;
    k.p = vec4<u32>(k_cache[po], k_cache[po + 1u], 0u, 0u);     // pw >= 2
    k.p2 = vec4<u32>(0u);
    k.j = vec4<u32>(k_cache[jo], 0u, 0u, 0u);                   // jw >= 1
    if pw > 2u {
        k.p.z = k_cache[po + 2u];
        k.p.w = k_cache[po + 3u];
        k.j.y = k_cache[jo + 1u];
    }
    if pw > 4u {
        k.p2 = vec4<u32>(k_cache[po + 4u], k_cache[po + 5u], k_cache[po + 6u], k_cache[po + 7u]);
        k.j.z = k_cache[jo + 2u];
        k.j.w = k_cache[jo + 3u];
    }
    k.nr = unpack2x16float(k_cache[k_norm_off + slot]);
    return k;
}


@compute @workgroup_size(256, 1, 1)
fn attention_split_tq(
    @builtin(local_invocation_id) lid: vec3<u32>,
    @builtin(workgroup_id) wid: vec3<u32>,
) {
    // #include "split_tq_prologue.wgsl"

    // ── 1. scores: one thread per compressed key, two keys at a time (each
    // query read from workgroup memory serves both), every head. Rounds of up
    // to 2 WG keys; in a round of m keys thread i takes keys i and i + ceil(m/2). ──
    let cb = vec4<f32>(c0, c1, c2, c3);
    for (var r = 0u; r < n_t; r += 2u * WG) {
        let m = min(2u * WG, n_t - r);
        let half = (m + 1u) / 2u;
        if tid >= half {
            continue;
        }
        let t = r + tid;
        let tb = t + half;
        let has_b = tb < r + m;
        // every word of both keys first: independent loads, all in flight
        let sa = hslot + split_row(page0, page_shift, t0 + t);
        let ka = load_key(sa, pw, jw, k_jl_off, k_norm_off);
        var kb = ka;
        vn_sh[t] = unpack2x16float(v_cache[v_norm_off + sa]).x;
        if has_b {
            let sb = hslot + split_row(page0, page_shift, t0 + tb);
            kb = load_key(sb, pw, jw, k_jl_off, k_norm_off);
            vn_sh[tb] = unpack2x16float(v_cache[v_norm_off + sb]).x;
        }

        var pa = vec4<f32>(0.0);   // key A: polar, heads 0..3
        var pb = vec4<f32>(0.0);   // key A: polar, heads 4..7
        var ja = vec4<f32>(0.0);   // key A: sums of q_jl over set bits, heads 0..3
        var jb = vec4<f32>(0.0);   // key A: heads 4..7
        var qa = vec4<f32>(0.0);   // the same four for key B
        var qb = vec4<f32>(0.0);
        var ra = vec4<f32>(0.0);
        var rb = vec4<f32>(0.0);
        polar_word(ka.p.x, kb.p.x, 0u, d4, group, cb, &pa, &pb, &qa, &qb);
        polar_word(ka.p.y, kb.p.y, 1u, d4, group, cb, &pa, &pb, &qa, &qb);
        jl_word(ka.j.x, kb.j.x, 0u, d4, group, &ja, &jb, &ra, &rb);
        if pw > 2u {
            polar_word(ka.p.z, kb.p.z, 2u, d4, group, cb, &pa, &pb, &qa, &qb);
            polar_word(ka.p.w, kb.p.w, 3u, d4, group, cb, &pa, &pb, &qa, &qb);
            jl_word(ka.j.y, kb.j.y, 1u, d4, group, &ja, &jb, &ra, &rb);
        }
        if pw > 4u {
            polar_word(ka.p2.x, kb.p2.x, 4u, d4, group, cb, &pa, &pb, &qa, &qb);
            polar_word(ka.p2.y, kb.p2.y, 5u, d4, group, cb, &pa, &pb, &qa, &qb);
            polar_word(ka.p2.z, kb.p2.z, 6u, d4, group, cb, &pa, &pb, &qa, &qb);
            polar_word(ka.p2.w, kb.p2.w, 7u, d4, group, cb, &pa, &pb, &qa, &qb);
            jl_word(ka.j.z, kb.j.z, 2u, d4, group, &ja, &jb, &ra, &rb);
            jl_word(ka.j.w, kb.j.w, 3u, d4, group, &ja, &jb, &ra, &rb);
        }
        for (var h = 0u; h < group; h += 1u) {
            let o = h * split_len;
            let lo = h < 4u;
            let hh = h % 4u;
            scores[o + t] = tq_score(select(pb[hh], pa[hh], lo), select(jb[hh], ja[hh], lo),
                                     qsum_sh[h], ka.nr, qjl_scale, scale);
            if has_b {
                scores[o + tb] = tq_score(select(qb[hh], qa[hh], lo), select(rb[hh], ra[hh], lo),
                                          qsum_sh[h], kb.nr, qjl_scale, scale);
            }
        }
    }
    workgroupBarrier();

    // #include "split_softmax.wgsl" WEIGHT="p * vn_sh[t]"

    // #include "split_tq_values.wgsl"

    // #include "split_tq_epilogue.wgsl"
}
