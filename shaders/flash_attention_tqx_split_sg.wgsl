// Split-KV attention over a TurboQuant cache (every format of formats.TQ_SPECS),
// subgroup variant (decode path). Same work split, partial layout, params and
// bindings as `flash_attention_tqx_split.wgsl` (read its header). Opt-in
// (KernelPolicy.subgroups, and the device needs the `subgroup` feature): on the
// H200 turboquant's subgroup kernel measured 2-2.7x slower than the plain one,
// which scores one key per thread (docs/benchmarks.md, bench/probes/decode_sweep.py).
// One subgroup scores one compressed key at a time: lane c decodes vec4 column c
// (low-field word c/4, plane words c/8, JL word c/8 where QJL is set) and forms
// its share of the code dot and of the signed JL sum with every query head of the
// group; subgroupAdd finishes them. The value phase is the plain split kernel's
// (split_tqx_values.wgsl). Calls to subgroupAdd sit in control flow uniform
// across the workgroup: every subgroup runs the same number of key steps; lanes
// past the end add zeros.
// The placeholder line TQX_CONSTS is replaced by the format's constants (tqx.wgsl).

{TQX_CONSTS}

// #include "split_tqx_decls.wgsl"


@compute @workgroup_size(256, 1, 1)
fn attention_split_tqx_sg(
    @builtin(local_invocation_id) lid: vec3<u32>,
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(subgroup_invocation_id) lane_id: u32,
    @builtin(subgroup_size) sg_size: u32,
) {
    // #include "split_tqx_prologue.wgsl"

    // ── 1. scores: one subgroup per compressed key ──
    let n_sg = WG / sg_size;
    let sg = tid / sg_size;
    let d_sh1 = vec4<u32>(0u, 1u, 2u, 3u);
    for (var tb = 0u; tb < n_t; tb += n_sg) {
        let t = tb + sg;
        let live = t < n_t;
        var pa = vec4<f32>(0.0);   // polar, heads 0..3
        var pb = vec4<f32>(0.0);   // polar, heads 4..7
        var ja = vec4<f32>(0.0);   // positive JL sums, heads 0..3
        var jb = vec4<f32>(0.0);   // positive JL sums, heads 4..7
        if live {
            let slot = hslot + split_row(page0, page_shift, t0 + t);
            for (var c = lane_id; c < d4; c += sg_size) {
                let o = slot * kcw;
                var p2 = 0u;
                var p3 = 0u;
                if KB > 2u { p2 = k_cache[o + lw + c / 8u]; }
                if KB > 3u { p3 = k_cache[o + lw + pwd + c / 8u]; }
                let cv = kvals(codes4(k_cache[o + c / 4u], p2, p3, c, KB));
                var bits = vec4<f32>(0.0);
                if QJL {
                    let jword = k_cache[k_jl_off + slot * jw + c / 8u];
                    bits = vec4<f32>((vec4<u32>(jword) >> (d_sh1 + vec4<u32>(4u * (c % 8u)))) & vec4<u32>(1u));
                }
                pa.x += dot(qbuf[c], cv);
                ja.x += dot(qbuf[256u + c], bits);
                if group > 1u {
                    pa.y += dot(qbuf[d4 + c], cv);
                    ja.y += dot(qbuf[256u + d4 + c], bits);
                }
                if group > 2u {
                    pa.z += dot(qbuf[2u * d4 + c], cv);
                    ja.z += dot(qbuf[256u + 2u * d4 + c], bits);
                    pa.w += dot(qbuf[3u * d4 + c], cv);
                    ja.w += dot(qbuf[256u + 3u * d4 + c], bits);
                }
                if group > 4u {
                    pb.x += dot(qbuf[4u * d4 + c], cv);
                    jb.x += dot(qbuf[256u + 4u * d4 + c], bits);
                    pb.y += dot(qbuf[5u * d4 + c], cv);
                    jb.y += dot(qbuf[256u + 5u * d4 + c], bits);
                    pb.z += dot(qbuf[6u * d4 + c], cv);
                    jb.z += dot(qbuf[256u + 6u * d4 + c], bits);
                    pb.w += dot(qbuf[7u * d4 + c], cv);
                    jb.w += dot(qbuf[256u + 7u * d4 + c], bits);
                }
            }
        }
        let sp_a = subgroupAdd(pa);
        var sj_a = subgroupAdd(ja);
        var sp_b = vec4<f32>(0.0);
        var sj_b = vec4<f32>(0.0);
        if group > 4u {
            sp_b = subgroupAdd(pb);
            sj_b = subgroupAdd(jb);
        }
        if live && lane_id == 0u {
            let slot = hslot + split_row(page0, page_shift, t0 + t);
            let nr = unpack2x16float(k_cache[k_norm_off + slot]);
            if KO > 0u {                         // the key outliers' part, into the "JL" sums
                let o = k_outliers_heads(k_out_off + slot * kow, nr.y, d4, group);
                sj_a += o.lo;
                sj_b += o.hi;
            }
            vn_sh[t] = unpack2x16float(v_cache[v_norm_off + slot]).x;
            scores[t] = tq_score(sp_a.x, sj_a.x, qsum_sh[0], nr, qjl_scale, scale);
            if group > 1u { scores[split_len + t] = tq_score(sp_a.y, sj_a.y, qsum_sh[1], nr, qjl_scale, scale); }
            if group > 2u {
                scores[2u * split_len + t] = tq_score(sp_a.z, sj_a.z, qsum_sh[2], nr, qjl_scale, scale);
                scores[3u * split_len + t] = tq_score(sp_a.w, sj_a.w, qsum_sh[3], nr, qjl_scale, scale);
            }
            if group > 4u {
                scores[4u * split_len + t] = tq_score(sp_b.x, sj_b.x, qsum_sh[4], nr, qjl_scale, scale);
                scores[5u * split_len + t] = tq_score(sp_b.y, sj_b.y, qsum_sh[5], nr, qjl_scale, scale);
                scores[6u * split_len + t] = tq_score(sp_b.z, sj_b.z, qsum_sh[6], nr, qjl_scale, scale);
                scores[7u * split_len + t] = tq_score(sp_b.w, sj_b.w, qsum_sh[7], nr, qjl_scale, scale);
            }
        }
    }
    workgroupBarrier();

    // #include "split_softmax.wgsl" WEIGHT="p * vweight(t)"

    // #include "split_tqx_values.wgsl"

    // #include "split_tq_epilogue.wgsl"
}
