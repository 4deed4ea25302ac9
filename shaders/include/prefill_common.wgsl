// Helpers of the query-block prefill kernels (attention_prefill_tiled,
// attention_prefill_rb, attention_tqx_tiled): shaders/include/prefill_common.wgsl,
// module scope, no barriers, no bindings.

fn hsum(v: vec4<f32>) -> f32 {
    return (v.x + v.y) + (v.z + v.w);
}

fn vmax(v: vec4<f32>) -> f32 {
    return max(max(v.x, v.y), max(v.z, v.w));
}

// The end (exclusive) of row r's window: the block's t_end, or for a causal
// row at query q_first + r % bq its own end, at most t_end.
fn row_end(r: u32, q_first: u32, bq: u32, start_pos: u32, t_end: u32, non_causal: bool) -> u32 {
    if non_causal {
        return t_end;
    }
    return min(start_pos + q_first + r % bq + 1u, t_end);
}
