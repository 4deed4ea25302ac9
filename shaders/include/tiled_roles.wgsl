    // (shaders/include/tiled_roles.wgsl, shared by the two tiled prefill kernels:
    // each thread's rows and keys/columns, its rows' window ends, and its running
    // max, sum and output registers; inlined by the loader.)
    // ── compute roles: rows tr + 16i (i < 4), keys / columns tc and tc + 16 ──
    let lane = tid % 32u;
    let warp = tid / 32u;
    let tc = lane % 8u + 8u * (warp % 2u);
    let tr = lane / 8u + 4u * (warp / 2u);
    let r0 = tr;
    let r1 = tr + 16u;
    let r2 = tr + 32u;
    let r3 = tr + 48u;
    let e0 = row_end(r0, q_first, bq, start_pos, t_end, non_causal);
    let e1 = row_end(r1, q_first, bq, start_pos, t_end, non_causal);
    let e2 = row_end(r2, q_first, bq, start_pos, t_end, non_causal);
    let e3 = row_end(r3, q_first, bq, start_pos, t_end, non_causal);
    let pw_a = tc / 4u;                          // p_sh / pm_sh vec4 of key tc (key tc + 16: + 4)
    let pw_c = tc % 4u;

    var m0 = NEG_INF;
    var m1 = NEG_INF;
    var m2 = NEG_INF;
    var m3 = NEG_INF;
    var l0 = 0.0;
    var l1 = 0.0;
    var l2 = 0.0;
    var l3 = 0.0;
    var o00 = vec4<f32>(0.0);
    var o01 = vec4<f32>(0.0);
    var o10 = vec4<f32>(0.0);
    var o11 = vec4<f32>(0.0);
    var o20 = vec4<f32>(0.0);
    var o21 = vec4<f32>(0.0);
    var o30 = vec4<f32>(0.0);
    var o31 = vec4<f32>(0.0);
