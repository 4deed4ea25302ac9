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
    for (var t = grp; t < n_t; t += n_grp) {
        let v = cvals((vec4<u32>(v_cache[(slot0 + t) * pw + vw]) >> vsh) & vec4<u32>(3u), c0, c1, c2, c3);
        // #include "accumulate_heads.wgsl" T=t V=v
    }

