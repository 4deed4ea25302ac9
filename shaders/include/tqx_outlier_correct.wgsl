    // (shaders/include/tqx_outlier_correct.wgsl, tqx.wgsl's encoders: after the codes
    // are in code[], out_val[j] -= H (c[idx] * f16(norm)) / sqrt(d) at out_ch[j], the
    // codes' reconstruction there times the polar sign; the butterfly runs for every
    // format, its result is used by those with outliers. Barriers included.)
    var n16 = 0.0;
    if live { n16 = unpack2x16float(pack2x16float(vec2<f32>(norm, 0.0))).x; }
    if in_dim {
        buf[tid] = {CENT}[code[tid]] * n16;
    }
    // #include "butterfly.wgsl" ARR=buf
    if tid < {NOUT} {
        out_val[tid] = out_val[tid] - buf[out_ch[tid]] * inv_sqrt_d;
    }
    workgroupBarrier();
