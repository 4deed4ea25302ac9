    // ── 2. per-head max and sum of exp over this split ──
    // (shaders/include/split_softmax.wgsl, shared by the four split kernels:
    // inlined by the loader, so its barriers stay at entry-point scope.) Needs
    // `tid`, `group`, `seg = WG / group`, `n_t`, `split_len`, `scores`, `red`,
    // `stat`. Leaves stat[h] = the split's max of head h, red[h * seg] = its sum
    // of exp, and scores[h][t] = {WEIGHT} (the softmax numerator `p`, times
    // whatever the including kernel folds in).
    let rh = tid / seg;                          // query head ...
    let lane = tid % seg;                        // ... and lane within its segment
    var m = NEG_INF;
    if rh < group {
        for (var t = lane; t < n_t; t += seg) {
            m = max(m, scores[rh * split_len + t]);
        }
    }
    red[tid] = m;
    for (var s = seg / 2u; s > 0u; s = s / 2u) {
        workgroupBarrier();
        if lane < s {
            red[tid] = max(red[tid], red[tid + s]);
        }
    }
    workgroupBarrier();
    if lane == 0u && rh < group {
        stat[rh] = red[tid];
    }
    workgroupBarrier();
    var l = 0.0;
    if rh < group {
        let mx = stat[rh];
        for (var t = lane; t < n_t; t += seg) {
            let p = exp(scores[rh * split_len + t] - mx);
            scores[rh * split_len + t] = {WEIGHT};
            l += p;
        }
    }
    red[tid] = l;
    for (var s = seg / 2u; s > 0u; s = s / 2u) {
        workgroupBarrier();
        if lane < s {
            red[tid] += red[tid + s];
        }
    }
    workgroupBarrier();
