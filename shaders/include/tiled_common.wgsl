// Helpers of the two query-block tiled prefill kernels (shaders/include/
// tiled_common.wgsl; no barriers). Needs pm_sh: array<array<vec4<f32>, 4>, R>.

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

// The max over row r's 16 partial maxima in pm_sh.
fn row_max(r: u32) -> f32 {
    return vmax(max(max(pm_sh[r][0], pm_sh[r][1]), max(pm_sh[r][2], pm_sh[r][3])));
}
