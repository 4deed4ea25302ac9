// Split-KV attention (flash-decoding) over a TurboQuant cache: the decode path of
// every compressed format (formats.TQ_SPECS, `turboquant` included), compiled once
// per format.
//
// The estimator and value path of `flash_attention_tqx.wgsl` (read its header and
// docs/turboquant.md), organized like `attention_split.wgsl`: one workgroup per
// (split, KV head, query row) serves every query head of the GQA group, so each
// compressed key is read once per query row, and thousands of workgroups are in
// flight. Scores: one thread per key, two keys at a time (each query read serves
// both); a key is read 32 dims at a time (two low-field words, one word per bit
// plane, one JL word where QJL is set: `tqx.wgsl` has the layout), its codes
// decoded to the format's centroids (workgroup memory) once for all G heads, the
// rotated queries read from workgroup memory (a broadcast). No staging and no
// barriers in this phase. Values: thread (c, grp) owns the vec4 column c of the
// rotated accumulator of every query head of the group and reads value words
// straight from global memory, four rows per step. The pipeline is specialized
// per (G, head_dim) with override constants. The accumulator stays in rotated
// space; `attention_merge` (ROTATE) merges the splits and applies the inverse RHT.
// (The turboquant-only kernel this replaced decoded 2-bit words 16 dims at a time;
// earlier designs staged tiles or scored one key per subgroup: docs/benchmarks.md.)
//
//   score = norm * (sum_d q_rot[d] KC[idx_d] + [QJL] residual_norm * qjl_scale * signed_sum) * scale
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
// @binding(1) k_cache: array<u32>  the pool slab's key regions (cache_cap rows)
// @binding(2) v_cache: array<u32>  the slab's value regions
// @binding(3) partial: array<f32>  every item's [acc | m | l] (attention_merge.wgsl,
//                      q_total = q_cap), the item's at word part_off
// @binding(4) params:  array<TqSplitParams> (gpu/params.py TQ_SPLIT_PARAMS), block
//                      wid.z for query row q_row of its item
// @binding(5) pages:   array<u32> page tables (include/paging.wgsl)
//   flags bit 0: non-causal.
//
// Dispatch: (the batch's largest n_splits, n_kv_heads, query rows of the batch)
// workgroups of 256 threads; a workgroup past its item's n_splits returns.
//
// The placeholder line TQX_CONSTS is replaced by the format's constants (tqx.wgsl).

{TQX_CONSTS}

// #include "split_tqx_decls.wgsl"

// x (decoded dims of vec4 column i) of keys A and B dotted with every head of the
// group, the queries at qbuf[qo + h * d4 + i]: heads 0..3 into pa / qa, 4..7 into pb / qb.
fn dot_heads(qo: u32, i: u32, d4: u32, group: u32, xa: vec4<f32>, xb: vec4<f32>,
             pa: ptr<function, vec4<f32>>, pb: ptr<function, vec4<f32>>,
             qa: ptr<function, vec4<f32>>, qb: ptr<function, vec4<f32>>) {
    var q = qbuf[qo + i];
    (*pa).x += dot(q, xa);
    (*qa).x += dot(q, xb);
    if group > 1u {
        q = qbuf[qo + d4 + i];
        (*pa).y += dot(q, xa);
        (*qa).y += dot(q, xb);
    }
    if group > 2u {
        q = qbuf[qo + 2u * d4 + i];
        (*pa).z += dot(q, xa);
        (*qa).z += dot(q, xb);
        q = qbuf[qo + 3u * d4 + i];
        (*pa).w += dot(q, xa);
        (*qa).w += dot(q, xb);
    }
    if group > 4u {
        let q4 = qbuf[qo + 4u * d4 + i];
        let q5 = qbuf[qo + 5u * d4 + i];
        let q6 = qbuf[qo + 6u * d4 + i];
        let q7 = qbuf[qo + 7u * d4 + i];
        *pb += vec4<f32>(dot(q4, xa), dot(q5, xa), dot(q6, xa), dot(q7, xa));
        *qb += vec4<f32>(dot(q4, xb), dot(q5, xb), dot(q6, xb), dot(q7, xb));
    }
}

// The words of 32 dims (chunk w) of one key: low fields, planes 2 and 3, JL.
struct Chunk {
    lo0: u32,
    lo1: u32,
    p2: u32,
    p3: u32,
    j: u32,
}

fn load_chunk(slot: u32, w: u32, kcw: u32, lw: u32, pwd: u32, k_jl_off: u32, jw: u32) -> Chunk {
    var c: Chunk;
    let o = slot * kcw;
    c.lo0 = k_cache[o + 2u * w];
    c.lo1 = k_cache[o + 2u * w + 1u];
    c.p2 = 0u;
    c.p3 = 0u;
    c.j = 0u;
    if KB > 2u { c.p2 = k_cache[o + lw + w]; }
    if KB > 3u { c.p3 = k_cache[o + lw + pwd + w]; }
    if QJL { c.j = k_cache[k_jl_off + slot * jw + w]; }
    return c;
}



@compute @workgroup_size(256, 1, 1)
fn attention_split_tqx(
    @builtin(local_invocation_id) lid: vec3<u32>,
    @builtin(workgroup_id) wid: vec3<u32>,
) {
    // #include "split_tqx_prologue.wgsl"

    // ── 1. scores: one thread per compressed key, two keys at a time ──
    for (var r = 0u; r < n_t; r += 2u * WG) {
        let m = min(2u * WG, n_t - r);
        let half = (m + 1u) / 2u;
        if tid >= half {
            continue;
        }
        let t = r + tid;
        let tb = t + half;
        let has_b = tb < r + m;
        let sa = hslot + split_row(page0, page_shift, t0 + t);
        var sb = sa;
        vn_sh[t] = unpack2x16float(v_cache[v_norm_off + sa]).x;
        if has_b {
            sb = hslot + split_row(page0, page_shift, t0 + tb);
            vn_sh[tb] = unpack2x16float(v_cache[v_norm_off + sb]).x;
        }
        let nra = unpack2x16float(k_cache[k_norm_off + sa]);
        let nrb = unpack2x16float(k_cache[k_norm_off + sb]);

        var pa = vec4<f32>(0.0);   // key A: polar, heads 0..3
        var pb = vec4<f32>(0.0);   // key A: polar, heads 4..7
        var ja = vec4<f32>(0.0);   // key A: sums of q_jl over set bits, heads 0..3
        var jb = vec4<f32>(0.0);   // key A: heads 4..7
        var qa = vec4<f32>(0.0);   // the same four for key B
        var qb = vec4<f32>(0.0);
        var ra = vec4<f32>(0.0);
        var rb = vec4<f32>(0.0);
        for (var w = 0u; w < pwd; w += 1u) {
            let ca = load_chunk(sa, w, kcw, lw, pwd, k_jl_off, jw);
            let cb = load_chunk(sb, w, kcw, lw, pwd, k_jl_off, jw);
            for (var k8 = 0u; k8 < 8u; k8 += 1u) {
                let i = 8u * w + k8;
                let xa = kvals(codes4(select(ca.lo0, ca.lo1, k8 >= 4u), ca.p2, ca.p3, i, KB));
                let xb = kvals(codes4(select(cb.lo0, cb.lo1, k8 >= 4u), cb.p2, cb.p3, i, KB));
                dot_heads(0u, i, d4, group, xa, xb, &pa, &pb, &qa, &qb);
                if QJL {
                    let sh = vec4<u32>(0u, 1u, 2u, 3u) + vec4<u32>(4u * k8);
                    let ba = vec4<f32>((vec4<u32>(ca.j) >> sh) & vec4<u32>(1u));
                    let bb = vec4<f32>((vec4<u32>(cb.j) >> sh) & vec4<u32>(1u));
                    dot_heads(256u, i, d4, group, ba, bb, &ja, &jb, &ra, &rb);
                }
            }
        }
        if KO > 0u {                             // the key outliers' part, into the "JL" sums
            let oa = k_outliers_heads(k_out_off + sa * kow, nra.y, d4, group);
            ja += oa.lo;
            jb += oa.hi;
            if has_b {
                let ob = k_outliers_heads(k_out_off + sb * kow, nrb.y, d4, group);
                ra += ob.lo;
                rb += ob.hi;
            }
        }
        for (var h = 0u; h < group; h += 1u) {
            let o = h * split_len;
            let lo = h < 4u;
            let hh = h % 4u;
            scores[o + t] = tq_score(select(pb[hh], pa[hh], lo), select(jb[hh], ja[hh], lo),
                                     qsum_sh[h], nra, qjl_scale, scale);
            if has_b {
                scores[o + tb] = tq_score(select(qb[hh], qa[hh], lo), select(rb[hh], ra[hh], lo),
                                          qsum_sh[h], nrb, qjl_scale, scale);
            }
        }
    }
    workgroupBarrier();

    // #include "split_softmax.wgsl" WEIGHT="p * vweight(t)"

    // #include "split_tqx_values.wgsl"

    // #include "split_tq_epilogue.wgsl"
}
