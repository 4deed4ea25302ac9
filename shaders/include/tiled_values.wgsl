        // ── value phase (shaders/include/tiled_values.wgsl): rescale, then per
        // 4 keys 4 vec4 reads of p_sh (rows r0..r3) and 8 of the V tile in
        // `stage` (columns tc, tc + 16) feed 32 vec4 FMAs; each thread of a row
        // sums the row's l from the same values in the same order. ──
        o00 *= f0;
        o01 *= f0;
        o10 *= f1;
        o11 *= f1;
        o20 *= f2;
        o21 *= f2;
        o30 *= f3;
        o31 *= f3;
        l0 *= f0;
        l1 *= f1;
        l2 *= f2;
        l3 *= f3;
        for (var j4 = 0u; j4 < TK / 4u; j4 += 1u) {
            let w0 = p_sh[r0 * PROW4 + j4];
            let w1 = p_sh[r1 * PROW4 + j4];
            let w2 = p_sh[r2 * PROW4 + j4];
            let w3 = p_sh[r3 * PROW4 + j4];
            l0 += hsum(w0);
            l1 += hsum(w1);
            l2 += hsum(w2);
            l3 += hsum(w3);
            let j = 4u * j4 * VROW + tc;
            var va = stage[j];
            var vb = stage[j + 16u];
            o00 += w0.x * va;
            o01 += w0.x * vb;
            o10 += w1.x * va;
            o11 += w1.x * vb;
            o20 += w2.x * va;
            o21 += w2.x * vb;
            o30 += w3.x * va;
            o31 += w3.x * vb;
            va = stage[j + VROW];
            vb = stage[j + VROW + 16u];
            o00 += w0.y * va;
            o01 += w0.y * vb;
            o10 += w1.y * va;
            o11 += w1.y * vb;
            o20 += w2.y * va;
            o21 += w2.y * vb;
            o30 += w3.y * va;
            o31 += w3.y * vb;
            va = stage[j + 2u * VROW];
            vb = stage[j + 2u * VROW + 16u];
            o00 += w0.z * va;
            o01 += w0.z * vb;
            o10 += w1.z * va;
            o11 += w1.z * vb;
            o20 += w2.z * va;
            o21 += w2.z * vb;
            o30 += w3.z * va;
            o31 += w3.z * vb;
            va = stage[j + 3u * VROW];
            vb = stage[j + 3u * VROW + 16u];
            o00 += w0.w * va;
            o01 += w0.w * vb;
            o10 += w1.w * va;
            o11 += w1.w * vb;
            o20 += w2.w * va;
            o21 += w2.w * vb;
            o30 += w3.w * va;
            o31 += w3.w * vb;
        }
