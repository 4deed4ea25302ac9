    // (shaders/include/prefill_params.wgsl: the PREFILL_PARAMS words, read by the
    // two f32 query-block prefill kernels; inlined by the loader.)
    let n_heads = params.n_heads;
    let n_kv_heads = params.n_kv_heads;
    let head_dim = params.head_dim;
    let kv_dim = params.kv_dim;
    let max_seq = params.max_seq;
    let scale = params.scale;
    let start_pos = params.start_pos;
    let n_queries = params.n_queries;
    let q_stride = params.q_stride;
    let out_stride = params.out_stride;
    let q_base = params.q_base;
    let flags = params.flags;
    let table_off = params.table_off;
    let page_shift = params.page_shift;
