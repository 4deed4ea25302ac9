// The start of tq_encode_keys and tq_encode_values (turboquant.wgsl): one workgroup
// per (KV head, row), one thread per dimension. Reads the row x, its norm (tree
// reduction over red[]), and leaves y = rht(x / norm, polar signs) in buf[] with
// inv_sqrt_d (the caller scales by it). Defines tid, n_kv_heads, head_dim, cache_cap,
// t0, row, sign_off, b0..b2, head, in_dim, norm, live.
    let tid = lid.x;
    let n_kv_heads = eparams.n_kv_heads;
    let head_dim = eparams.head_dim;
    let cache_cap = eparams.cache_cap;
    let t0 = eparams.t0;
    let row_base = eparams.row_base;
    let row = row_base + wid.y;
    let sign_off = eparams.sign_off;
    let b0 = eparams.b0;
    let b1 = eparams.b1;
    let b2 = eparams.b2;
    let head = wid.x;
    let in_dim = tid < head_dim;

    var x = 0.0;
    if in_dim {
        x = src[(row * n_kv_heads + head) * head_dim + tid];
    }

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
