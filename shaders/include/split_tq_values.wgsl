    // (shaders/include/split_tq_values.wgsl, shared by flash_attention_tq_split.wgsl
    // and flash_attention_tq_split_sg.wgsl: the value phase, value words read
    // straight from global memory; inlined by the loader.)
    // ── 3. values: thread (column c, row group grp) accumulates all G heads ──
    let n_grp = WG / d4;
    let c = tid % d4;
    let grp = tid / d4;
    let vw = c / 4u;                             // value word of dims 4c..4c+3
    let vsh = 8u * (c % 4u);                    // its byte in the word
    let vbl = tq_bilinear(c0, c1, c2, c3);
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
        let w0 = v_cache[(slot0 + t) * pw + vw];
        let w1 = v_cache[(slot0 + t1) * pw + vw];
        let w2 = v_cache[(slot0 + t2) * pw + vw];
        let w3 = v_cache[(slot0 + t3) * pw + vw];
        let v0 = tq_codes4(w0 >> vsh, vbl);
        let v1 = tq_codes4(w1 >> vsh, vbl);
        let v2 = tq_codes4(w2 >> vsh, vbl);
        let v3 = tq_codes4(w3 >> vsh, vbl);
        // #include "accumulate_heads.wgsl" T=t V=v0
        // #include "accumulate_heads.wgsl" T=t1 V=v1
        // #include "accumulate_heads.wgsl" T=t2 V=v2
        // #include "accumulate_heads.wgsl" T=t3 V=v3
    }
    for (; t < n_t; t += n_grp) {
        let v = tq_codes4(v_cache[(slot0 + t) * pw + vw] >> vsh, vbl);
        // #include "accumulate_heads.wgsl" T=t V=v
    }
