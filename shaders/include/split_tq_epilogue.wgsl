    // ── sum the row groups (through qbuf, two heads per pass); write partials ──
    // (shaders/include/split_tq_epilogue.wgsl, of flash_attention_tqx_split.wgsl;
    // inlined by the loader, barriers included.)
    let n_part = q_cap * n_heads * split_total;
    let pbase = (q_idx * n_heads + kv_head * group) * split_total + split_at;
    if tid < group {
        let pi = pbase + tid * split_total;
        partial[part_off + n_part * head_dim + pi] = stat[tid];
        partial[part_off + n_part * (head_dim + 1u) + pi] = red[tid * seg];
    }
    for (var h0 = 0u; h0 < group; h0 += 2u) {
        let o = grp * d4 + c;                    // < WG
        if h0 == 0u { qbuf[o] = a0; qbuf[WG + o] = a1; }
        if h0 == 2u { qbuf[o] = a2; qbuf[WG + o] = a3; }
        if h0 == 4u { qbuf[o] = a4; qbuf[WG + o] = a5; }
        if h0 == 6u { qbuf[o] = a6; qbuf[WG + o] = a7; }
        workgroupBarrier();
        let hh = tid / d4;
        let cc = tid % d4;
        if hh < 2u && h0 + hh < group {
            var sum = vec4<f32>(0.0);
            for (var g = 0u; g < n_grp; g += 1u) {
                sum += qbuf[hh * WG + g * d4 + cc];
            }
            let po = part_off + (pbase + (h0 + hh) * split_total) * head_dim + 4u * cc;
            partial[po] = sum.x;
            partial[po + 1u] = sum.y;
            partial[po + 2u] = sum.z;
            partial[po + 3u] = sum.w;
        }
        workgroupBarrier();
    }
