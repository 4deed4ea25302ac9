// Helpers of the two query-block tiled prefill kernels (shaders/include/
// tiled_common.wgsl; no barriers). Needs pm_sh: array<array<vec4<f32>, 4>, R>.

// #include "prefill_common.wgsl"

// The max over row r's 16 partial maxima in pm_sh.
fn row_max(r: u32) -> f32 {
    return vmax(max(max(pm_sh[r][0], pm_sh[r][1]), max(pm_sh[r][2], pm_sh[r][3])));
}
