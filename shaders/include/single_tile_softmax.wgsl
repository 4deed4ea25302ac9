        // ── one tile of the online softmax (shaders/include/single_tile_softmax.wgsl,
        // shared by the two single-pass kernels, attention_prefill and
        // flash_attention_tqx; inlined by the loader, so its barriers stay at
        // entry-point scope). Needs `tid`, `t`, `seq_len`, this thread's `score`,
        // `tile_scores`, a 256-wide `red` and `st`; leaves tile_scores[tid] = p,
        // `nm` and `corr` (the new running max and the rescale of the old
        // state) and `tsum` (this tile's sum of p). ──
        tile_scores[tid] = score;
        // ── tile max over `red`, 256 wide: the first halving, then the shared tree ──
        red[tid] = score;
        workgroupBarrier();
        if tid < 128u { red[tid] = max(red[tid], red[tid + 128u]); }
        // #include "tree_max_128.wgsl"
        let tmax = red[0];
        // new running max + correction factor (published by thread 0)
        if tid == 0u {
            let nm = max(st[0], tmax);
            st[2] = nm;
            st[3] = exp(st[0] - nm); // first tile: exp(-inf) = 0
        }
        workgroupBarrier();
        let nm = st[2];
        let corr = st[3];
        // p = exp(score - nm); reuse tile_scores to hold the exponentials.
        var p = 0.0;
        if t < seq_len {
            p = exp(tile_scores[tid] - nm);
        }
        tile_scores[tid] = p;
        // ── tile sum over `red`, 256 wide: the first halving, then the shared tree ──
        red[tid] = p;
        workgroupBarrier();
        if tid < 128u { red[tid] += red[tid + 128u]; }
        // #include "tree_sum_128.wgsl"
        let tsum = red[0];
