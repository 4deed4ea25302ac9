    // (shaders/include/split_tqx_values.wgsl, of flash_attention_tqx_split.wgsl: the
    // value phase over b-bit value codes
    // (value_col), value words read straight from global memory; inlined by the loader.)
    // ── 3. values: thread (column c, row group grp) accumulates all G heads ──
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
    var t = grp;
    // four rows per step: their loads independent
    for (; t + 3u * n_grp < n_t; t += 4u * n_grp) {
        let t1 = t + n_grp;
        let t2 = t + 2u * n_grp;
        let t3 = t + 3u * n_grp;
        let v0 = value_col(hslot + split_row(page0, page_shift, t0 + t), c, t);
        let v1 = value_col(hslot + split_row(page0, page_shift, t0 + t1), c, t1);
        let v2 = value_col(hslot + split_row(page0, page_shift, t0 + t2), c, t2);
        let v3 = value_col(hslot + split_row(page0, page_shift, t0 + t3), c, t3);
        // #include "accumulate_heads.wgsl" T=t V=v0
        // #include "accumulate_heads.wgsl" T=t1 V=v1
        // #include "accumulate_heads.wgsl" T=t2 V=v2
        // #include "accumulate_heads.wgsl" T=t3 V=v3
    }
    for (; t < n_t; t += n_grp) {
        let v = value_col(hslot + split_row(page0, page_shift, t0 + t), c, t);
        // #include "accumulate_heads.wgsl" T=t V=v
    }
