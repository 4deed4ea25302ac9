// (shaders/include/tqx_encode_rotate.wgsl) The start of tqx_encode_keys and
// tqx_encode_values (tqx.wgsl): one workgroup per (KV head, row), one thread per
// dimension. Reads the row x and takes its {NOUT} outlier channels out first (the
// largest |x|, ties to the lower channel, one tree reduction each; none where
// {NOUT} is 0): their channels in out_ch[0..{NOUT}), their values times the polar
// sign in out_val[], and x = 0 there, so that the norm, rotation and codes are the
// rest's. Then the norm (tree reduction over red[]), and y = rht(x / norm, polar
// signs) left in buf[] with inv_sqrt_d (the caller scales by it). Defines tid, ep,
// n_kv_heads, head_dim, cache_cap, slab_row, sign_off, head, in_dim, norm, live.
    let tid = lid.x;
    let ep = eparams[wid.y];                   // this row's block (rows of many appends)
    let n_kv_heads = ep.n_kv_heads;
    let head_dim = ep.head_dim;
    let cache_cap = ep.cache_cap;
    let t = ep.t;
    let table_off = ep.table_off;
    let page_shift = ep.page_shift;
    let slab_row = phys_row(table_off, page_shift, t);   // where timestep t lives
    let sign_off = ep.sign_off;
    let src_off = ep.src_off;
    let head = wid.x;
    let in_dim = tid < head_dim;

    var x = 0.0;
    if in_dim {
        x = src[src_off + head * head_dim + tid];
    }

    // ── outlier channels: {NOUT} rounds of (max |x|, lowest channel) ──
    var taken = false;
    for (var o = 0u; o < {NOUT}; o += 1u) {
        redv[tid] = select(-1.0, abs(x), in_dim && !taken);
        redi[tid] = tid;
        for (var s = WG / 2u; s > 0u; s = s / 2u) {
            workgroupBarrier();
            if tid < s {
                let b = redv[tid + s];
                let bi = redi[tid + s];
                if b > redv[tid] || (b == redv[tid] && bi < redi[tid]) {
                    redv[tid] = b;
                    redi[tid] = bi;
                }
            }
        }
        workgroupBarrier();
        let ch = redi[0];
        if tid == ch {
            taken = true;
            out_ch[o] = ch;
            out_val[o] = x * signs[sign_off + ch];
        }
        workgroupBarrier();
    }
    if taken { x = 0.0; }

    // ── norm = ||x|| ──
    red[tid] = x * x;
    // #include "tree_sum_128.wgsl"
    let norm = sqrt(red[0]);
    let live = norm >= NORM_EPS;
    var inv_norm = 0.0;
    if live { inv_norm = 1.0 / norm; }

    // ── y = rht(x / norm, polar_signs) ──
    if in_dim {
        buf[tid] = x * inv_norm * signs[sign_off + tid];
    }
    // #include "butterfly.wgsl" ARR=buf
    let inv_sqrt_d = 1.0 / sqrt(f32(head_dim));
