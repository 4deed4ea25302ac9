    // (shaders/include/tqx_outlier_correct.wgsl, tqx.wgsl's encoders: after the codes
    // are in code[], out_val[j] -= H (c[idx] * f16(norm)) / sqrt(d) at out_ch[j], the
    // codes' reconstruction there times the polar sign; the butterfly runs for every
    // format, its result is used by those with outliers. Barriers included.)
    // f16(norm), the value the norm word holds, decoded from pack2x16float's bits by
    // hand: NVIDIA's Vulkan compiler folds unpack2x16float(pack2x16float(x)) to x, no
    // rounding (bench/probes/f16_pack_probe.py), which corrected the outliers against
    // a norm that no decoder reads. norm >= 0: no sign bit.
    var n16 = 0.0;
    if live {
        let h = pack2x16float(vec2<f32>(norm, 0.0)) & 0xFFFFu;
        let e = h >> 10u;
        let m = h & 0x3FFu;
        if e == 0u {
            n16 = f32(m) * 5.9604644775390625e-8;  // subnormal: m * 2^-24
        } else if e == 31u {
            n16 = bitcast<f32>(0x7F800000u);  // past float16's range: inf, as stored
        } else {
            n16 = bitcast<f32>(((e + 112u) << 23u) | (m << 13u));  // rebias 15 -> 127
        }
    }
    if in_dim {
        buf[tid] = {CENT}[code[tid]] * n16;
    }
    // #include "butterfly.wgsl" ARR=buf
    if tid < {NOUT} {
        out_val[tid] = out_val[tid] - buf[out_ch[tid]] * inv_sqrt_d;
    }
    workgroupBarrier();
