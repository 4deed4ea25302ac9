    // (shaders/include/prefill_params.wgsl: the PREFILL_PARAMS words, read by the
    // two f32 query-block prefill kernels; inlined by the loader.)
    let n_heads = params[0];
    let n_kv_heads = params[1];
    let head_dim = params[2];
    let kv_dim = params[3];
    let max_seq = params[4];
    let scale = bitcast<f32>(params[5]);
    let start_pos = params[6];
    let n_queries = params[7];
    let q_stride = params[8];
    let out_stride = params[9];
    let q_base = params[10];
    let flags = params[11];
