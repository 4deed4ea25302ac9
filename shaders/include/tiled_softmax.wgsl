        // ── online softmax, part 1 (shaders/include/tiled_softmax.wgsl, shared
        // by the two tiled kernels): the max of this thread's two keys per row
        // goes to pm_sh[row][tc]; needs s00..s31 (masked, scaled scores), r0..r3,
        // pw_a = tc / 4, pw_c = tc % 4. ──
        pm_sh[r0][pw_a][pw_c] = max(s00, s01);
        pm_sh[r1][pw_a][pw_c] = max(s10, s11);
        pm_sh[r2][pw_a][pw_c] = max(s20, s21);
        pm_sh[r3][pw_a][pw_c] = max(s30, s31);
        workgroupBarrier();
