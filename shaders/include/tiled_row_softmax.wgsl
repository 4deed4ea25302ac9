        // (3) online softmax, one thread per row: running max m_sh, sum l_sh, this
        // tile's rescale c_sh; scores in p_sh become probabilities. (shaders/include/
        // tiled_row_softmax.wgsl, shared by the two tiled kernels; needs tid, R, TK.)
        if tid < R {
            let m_old = m_sh[tid];
            var mx = m_old;
            for (var j = 0u; j < TK; j += 1u) {
                mx = max(mx, p_sh[tid * TK + j]);
            }
            let corr = exp(m_old - mx);
            var l = l_sh[tid] * corr;
            for (var j = 0u; j < TK; j += 1u) {
                let s = p_sh[tid * TK + j];
                let p = select(0.0, exp(s - mx), s > NEG_INF);
                p_sh[tid * TK + j] = p;
                l += p;
            }
            m_sh[tid] = mx;
            l_sh[tid] = l;
            c_sh[tid] = corr;
        }
