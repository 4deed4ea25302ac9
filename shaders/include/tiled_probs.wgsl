        // ── online softmax, part 2 (shaders/include/tiled_probs.wgsl): every
        // thread of a row reads the row's 16 partial maxima and updates the
        // running max m in registers (all get the same value); f is this tile's
        // rescale exp(m_old - m_new); the thread's 8 probabilities go to p_sh.
        // A masked score (NEG_INF) weighs exactly 0. ──
        let n0 = max(m0, row_max(r0));
        let n1 = max(m1, row_max(r1));
        let n2 = max(m2, row_max(r2));
        let n3 = max(m3, row_max(r3));
        let f0 = exp(m0 - n0);
        let f1 = exp(m1 - n1);
        let f2 = exp(m2 - n2);
        let f3 = exp(m3 - n3);
        m0 = n0;
        m1 = n1;
        m2 = n2;
        m3 = n3;
        p_sh[r0][pw_a][pw_c] = select(0.0, exp(s00 - n0), s00 > NEG_INF);
        p_sh[r0][pw_a + 4u][pw_c] = select(0.0, exp(s01 - n0), s01 > NEG_INF);
        p_sh[r1][pw_a][pw_c] = select(0.0, exp(s10 - n1), s10 > NEG_INF);
        p_sh[r1][pw_a + 4u][pw_c] = select(0.0, exp(s11 - n1), s11 > NEG_INF);
        p_sh[r2][pw_a][pw_c] = select(0.0, exp(s20 - n2), s20 > NEG_INF);
        p_sh[r2][pw_a + 4u][pw_c] = select(0.0, exp(s21 - n2), s21 > NEG_INF);
        p_sh[r3][pw_a][pw_c] = select(0.0, exp(s30 - n3), s30 > NEG_INF);
        p_sh[r3][pw_a + 4u][pw_c] = select(0.0, exp(s31 - n3), s31 > NEG_INF);
        workgroupBarrier();
