    // (shaders/include/split_tq_values.wgsl, shared by flash_attention_tq_split.wgsl
    // and flash_attention_tq_split_sg.wgsl: the value phase, value words read
    // straight from global memory; inlined by the loader.)
    // ── 3. values: thread (column c, row group grp) accumulates all G heads ──
    let n_grp = WG / d4;
    let c = tid % d4;
    let grp = tid / d4;
    let vw = c / 4u;                             // value word of dims 4c..4c+3
    let vsh = vec4<u32>(0u, 2u, 4u, 6u) + vec4<u32>(8u * (c % 4u));
    var a0 = vec4<f32>(0.0);
    var a1 = vec4<f32>(0.0);
    var a2 = vec4<f32>(0.0);
    var a3 = vec4<f32>(0.0);
    var a4 = vec4<f32>(0.0);
    var a5 = vec4<f32>(0.0);
    var a6 = vec4<f32>(0.0);
    var a7 = vec4<f32>(0.0);
    var t = grp;
    // four rows per step: four independent loads in flight
    for (; t + 3u * n_grp < n_t; t += 4u * n_grp) {
        let t1 = t + n_grp;
        let t2 = t + 2u * n_grp;
        let t3 = t + 3u * n_grp;
        let w0 = v_cache[(hslot + split_row(page0, page_shift, t0 + t)) * pw + vw];
        let w1 = v_cache[(hslot + split_row(page0, page_shift, t0 + t1)) * pw + vw];
        let w2 = v_cache[(hslot + split_row(page0, page_shift, t0 + t2)) * pw + vw];
        let w3 = v_cache[(hslot + split_row(page0, page_shift, t0 + t3)) * pw + vw];
        let v0 = cvals((vec4<u32>(w0) >> vsh) & vec4<u32>(3u), c0, c1, c2, c3);
        let v1 = cvals((vec4<u32>(w1) >> vsh) & vec4<u32>(3u), c0, c1, c2, c3);
        let v2 = cvals((vec4<u32>(w2) >> vsh) & vec4<u32>(3u), c0, c1, c2, c3);
        let v3 = cvals((vec4<u32>(w3) >> vsh) & vec4<u32>(3u), c0, c1, c2, c3);
        // #include "accumulate_heads.wgsl" T=t V=v0
        // #include "accumulate_heads.wgsl" T=t1 V=v1
        // #include "accumulate_heads.wgsl" T=t2 V=v2
        // #include "accumulate_heads.wgsl" T=t3 V=v3
    }
    for (; t < n_t; t += n_grp) {
        let v = cvals((vec4<u32>(v_cache[(hslot + split_row(page0, page_shift, t0 + t)) * pw + vw]) >> vsh) & vec4<u32>(3u), c0, c1, c2, c3);
        // #include "accumulate_heads.wgsl" T=t V=v
    }
