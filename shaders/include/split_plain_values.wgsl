    // (shaders/include/split_plain_values.wgsl, of attention_split.wgsl: the value
    // phase and the partial write; inlined by
    // the loader, barriers included. Needs the prologue's names and `scores`
    // holding the split's softmax numerators [G][split_len], `stat`, `red`.)
    // ── 3. V: thread (column c, row group grp), all G heads, rows from global ──
    let n_grp = WG / d4;
    let c = tid % d4;
    let grp = tid / d4;
    var a0 = vec4<f32>(0.0);
    var a1 = vec4<f32>(0.0);
    var a2 = vec4<f32>(0.0);
    var a3 = vec4<f32>(0.0);
    var a4 = vec4<f32>(0.0);
    var a5 = vec4<f32>(0.0);
    var a6 = vec4<f32>(0.0);
    var a7 = vec4<f32>(0.0);
    if grp < n_grp {
        var t = grp;
        if KV_NARROW {
            // a narrow slab (f16, bf16): eight rows per step, so that a step moves f32's bytes
            for (; t + 7u * n_grp < n_t; t += 8u * n_grp) {
                let v0 = value4(split_row(page0, page_shift, t0 + t) * kv4 + head4 + c);
                let v1 = value4(split_row(page0, page_shift, t0 + t + n_grp) * kv4 + head4 + c);
                let v2 = value4(split_row(page0, page_shift, t0 + t + 2u * n_grp) * kv4 + head4 + c);
                let v3 = value4(split_row(page0, page_shift, t0 + t + 3u * n_grp) * kv4 + head4 + c);
                let v4 = value4(split_row(page0, page_shift, t0 + t + 4u * n_grp) * kv4 + head4 + c);
                let v5 = value4(split_row(page0, page_shift, t0 + t + 5u * n_grp) * kv4 + head4 + c);
                let v6 = value4(split_row(page0, page_shift, t0 + t + 6u * n_grp) * kv4 + head4 + c);
                let v7 = value4(split_row(page0, page_shift, t0 + t + 7u * n_grp) * kv4 + head4 + c);
                let t1 = t + n_grp;
                let t2 = t + 2u * n_grp;
                let t3 = t + 3u * n_grp;
                let t4 = t + 4u * n_grp;
                let t5 = t + 5u * n_grp;
                let t6 = t + 6u * n_grp;
                let t7 = t + 7u * n_grp;
                // #include "accumulate_heads.wgsl" T=t V=v0
                // #include "accumulate_heads.wgsl" T=t1 V=v1
                // #include "accumulate_heads.wgsl" T=t2 V=v2
                // #include "accumulate_heads.wgsl" T=t3 V=v3
                // #include "accumulate_heads.wgsl" T=t4 V=v4
                // #include "accumulate_heads.wgsl" T=t5 V=v5
                // #include "accumulate_heads.wgsl" T=t6 V=v6
                // #include "accumulate_heads.wgsl" T=t7 V=v7
            }
        }
        // four rows per step: four independent loads in flight
        for (; t + 3u * n_grp < n_t; t += 4u * n_grp) {
            let v0 = value4(split_row(page0, page_shift, t0 + t) * kv4 + head4 + c);
            let v1 = value4(split_row(page0, page_shift, t0 + t + n_grp) * kv4 + head4 + c);
            let v2 = value4(split_row(page0, page_shift, t0 + t + 2u * n_grp) * kv4 + head4 + c);
            let v3 = value4(split_row(page0, page_shift, t0 + t + 3u * n_grp) * kv4 + head4 + c);
            let t1 = t + n_grp;
            let t2 = t + 2u * n_grp;
            let t3 = t + 3u * n_grp;
            // #include "accumulate_heads.wgsl" T=t V=v0
            // #include "accumulate_heads.wgsl" T=t1 V=v1
            // #include "accumulate_heads.wgsl" T=t2 V=v2
            // #include "accumulate_heads.wgsl" T=t3 V=v3
        }
        for (; t < n_t; t += n_grp) {
            let v = value4(split_row(page0, page_shift, t0 + t) * kv4 + head4 + c);
            // #include "accumulate_heads.wgsl" T=t V=v
        }
    }

    // ── sum the row groups (through `scores`, two heads per pass); write partials ──
    let n_part = q_total * n_heads * split_total;
    let pbase = (q_idx * n_heads + kv_head * group) * split_total + split_at;  // head 0 of the group
    if tid < group {
        let pi = pbase + tid * split_total;
        partial[part_off + n_part * head_dim + pi] = stat[tid];                 // m (NEG_INF if empty)
        partial[part_off + n_part * (head_dim + 1u) + pi] = red[tid * seg];     // l (0 if empty)
    }
    for (var h0 = 0u; h0 < group; h0 += 2u) {
        workgroupBarrier();                      // `scores` (and the last pass) read
        if grp < n_grp {
            var x = a0;
            var y = a1;
            if h0 == 2u { x = a2; y = a3; }
            if h0 == 4u { x = a4; y = a5; }
            if h0 == 6u { x = a6; y = a7; }
            let o = 4u * (grp * d4 + c);         // < 4 * WG
            scores[o] = x.x;
            scores[o + 1u] = x.y;
            scores[o + 2u] = x.z;
            scores[o + 3u] = x.w;
            scores[4u * WG + o] = y.x;
            scores[4u * WG + o + 1u] = y.y;
            scores[4u * WG + o + 2u] = y.z;
            scores[4u * WG + o + 3u] = y.w;
        }
        // #include "split_sum_row_groups.wgsl" PASS="4u * WG"
    }
