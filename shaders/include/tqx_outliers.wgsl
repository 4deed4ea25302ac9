// (shaders/include/tqx_outliers.wgsl: the outlier channels of a TurboQuant variant
// that has them (formats.TqSpec key_outliers / value_outliers, tqx.wgsl): outlier j
// of a slot whose outlier words start at word `ob`; outlier 0's value is the upper
// half of the norm word (v0). The value is x[ch] times the polar sign of ch, so that
// its part of the rotated vector is val * hsign(i, ch) / sqrt(d) at coordinate i.)
struct Outlier {
    ch: u32,
    val: f32,
}

fn k_outlier(ob: u32, j: u32, v0: f32) -> Outlier {
    var o: Outlier;
    o.ch = (k_cache[ob + KO / 2u + j / 4u] >> (8u * (j % 4u))) & 255u;
    o.val = v0;
    if j > 0u {
        let h = unpack2x16float(k_cache[ob + (j - 1u) / 2u]);
        o.val = select(h.y, h.x, (j - 1u) % 2u == 0u);
    }
    return o;
}

fn v_outlier(ob: u32, j: u32, v0: f32) -> Outlier {
    var o: Outlier;
    o.ch = (v_cache[ob + VO / 2u + j / 4u] >> (8u * (j % 4u))) & 255u;
    o.val = v0;
    if j > 0u {
        let h = unpack2x16float(v_cache[ob + (j - 1u) / 2u]);
        o.val = select(h.y, h.x, (j - 1u) % 2u == 0u);
    }
    return o;
}

// H[i][ch] of the Walsh-Hadamard matrix (Sylvester order): +-1.
fn hsign(i: u32, ch: u32) -> f32 {
    return 1.0 - 2.0 * f32(countOneBits(i & ch) & 1u);
}

// The value outliers' part of rotated coordinates 4c .. 4c+3 (times sqrt(d)) of the
// value slot whose outlier words start at ob.
fn v_outliers4(ob: u32, c: u32, v0: f32) -> vec4<f32> {
    var r = vec4<f32>(0.0);
    for (var j = 0u; j < VO; j += 1u) {
        let o = v_outlier(ob, j, v0);
        let i = 4u * c;
        r += o.val * vec4<f32>(hsign(i, o.ch), hsign(i + 1u, o.ch), hsign(i + 2u, o.ch), hsign(i + 3u, o.ch));
    }
    return r;
}
