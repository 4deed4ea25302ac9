// The start of tq_encode_keys and tq_encode_values (turboquant.wgsl): one workgroup
// per (KV head, row), one thread per dimension. Reads the row x, its norm (tree
// reduction over red[]), and leaves y = rht(x / norm, polar signs) in buf[] with
// inv_sqrt_d (the caller scales by it). Defines tid, ep, n_kv_heads, head_dim, cache_cap,
// slab_row, sign_off, head, in_dim, norm, live.
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
