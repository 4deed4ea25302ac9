    // (shaders/include/tqx_regions.wgsl: where a layer's compressed regions start in
    // its slab, the layout tqx.wgsl writes; formats.key_words / value_words are the
    // host's count of the same words. Needs `head_dim`, `n_kv_heads`, `cache_cap`.)
    let lw = head_dim / 16u;                     // low 2-bit field words of a slot
    let pwd = head_dim / 32u;                    // words of a bit plane (and of JL signs)
    let kcw = KB * pwd;                          // code words of a key slot
    let vcw = VB * pwd;                          // ... of a value slot
    var jw = 0u;                                 // JL sign words of a key slot
    if QJL { jw = pwd; }
    let vecs = n_kv_heads * cache_cap;
    let k_jl_off = vecs * kcw;
    let k_norm_off = k_jl_off + vecs * jw;
    let v_norm_off = vecs * vcw;
    let kow = KO / 2u + (KO + 3u) / 4u;          // outlier words of a key slot (formats.outlier_words)
    let vow = VO / 2u + (VO + 3u) / 4u;          // ... of a value slot
    let k_out_off = k_norm_off + vecs;
    let v_out_off = v_norm_off + vecs;
