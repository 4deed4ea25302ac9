// Query-block flash attention over the TurboQuant cache: the prefill path.
//
// `attention_prefill_tiled.wgsl`'s scheme on compressed keys and values (read
// it, and `flash_attention_tq.wgsl` for the estimator). One workgroup takes
// R = 16 rows (a block of BQ = R / G query positions times the G heads of one
// KV head's GQA group) and walks the cache in tiles of TK = 16 timesteps. Each
// tile is decoded ONCE into workgroup memory for all R rows:
//   keys:   the 2-bit codes to their centroids (rotated space, norm not folded),
//           the JL sign words and the packed (norm, residual_norm) words;
//   values: norm * centroid, rotated space.
// Thread (row r, key j) forms
//   score = norm * (q_rot . c[idx] + residual_norm * qjl_scale * (2 * sum_{bit} q_jl - sum q_jl)) * scale
// and the online softmax and accumulation follow the f32 kernel; the rotated
// accumulator of every row gets one inverse RHT (a Walsh-Hadamard butterfly in
// workgroup memory, then the polar signs and 1/sqrt(d)) at the end.
//
// Every workgroupBarrier() sits at entry-point scope in uniform control flow.
//
// Constraints (checked host-side): head_dim in {32, 64, 128};
// G = n_heads / n_kv_heads in {1, 2, 4, 8}.
//
// Bind group 0 (as flash_attention_tq.wgsl):
// @binding(0) qrot:    array<f32>  [q_rot | q_jl | sums] of q_cap rows (tq_rotate_q)
// @binding(1) k_cache: array<u32>  [polar | jl | norms]
// @binding(2) v_cache: array<u32>  [polar | norms]
// @binding(3) out_batch: array<f32> q_cap x out_stride floats (rw)
// @binding(4) params:  array<u32, 20>  (flash_attention_tq.wgsl's layout; q_cap is
//   the number of query rows, block x covers rows q_base + x * BQ ..)
// @binding(5) signs:   array<f32>
//
// Dispatch: (ceil(rows / BQ), n_kv_heads, 1) workgroups of 256 threads.

@group(0) @binding(0) var<storage, read> qrot: array<f32>;
@group(0) @binding(1) var<storage, read> k_cache: array<u32>;
@group(0) @binding(2) var<storage, read> v_cache: array<u32>;
@group(0) @binding(3) var<storage, read_write> out_batch: array<f32>;
@group(0) @binding(4) var<storage, read> params: array<u32, 20>;
@group(0) @binding(5) var<storage, read> signs: array<f32>;

const WG: u32 = 256u;
const R: u32 = 16u;                  // rows (query position x head) per workgroup
const TK: u32 = 16u;                 // timesteps per tile
const ROW4: u32 = 33u;               // padded decoded row, in vec4 (head_dim/4 <= 32)
const JROW: u32 = 5u;                // padded JL words per key (head_dim/32 <= 4)
const NEG_INF: f32 = -3.402823e+38;
const FLAG_NON_CAUSAL: u32 = 1u;

var<workgroup> qr_sh: array<vec4<f32>, 512>;    // R * head_dim/4: q_rot, then the output rows
var<workgroup> qj_sh: array<vec4<f32>, 512>;    // R * head_dim/4: q_jl
var<workgroup> qsum_sh: array<f32, R>;
var<workgroup> dec: array<vec4<f32>, 528>;       // TK * ROW4 decoded centroids (K, then V)
var<workgroup> kj: array<u32, 80>;               // TK * JROW JL sign words
var<workgroup> kn: array<u32, TK>;               // packed (norm, residual_norm)
var<workgroup> p_sh: array<f32, 256>;            // R * TK scores, then probabilities
var<workgroup> m_sh: array<f32, R>;
var<workgroup> l_sh: array<f32, R>;
var<workgroup> c_sh: array<f32, R>;

// Centroids of four 2-bit codes.
fn cvals(codes: vec4<u32>, c0: f32, c1: f32, c2: f32, c3: f32) -> vec4<f32> {
    let lo = select(vec4<f32>(c0), vec4<f32>(c1), codes == vec4<u32>(1u));
    let hi = select(vec4<f32>(c2), vec4<f32>(c3), codes == vec4<u32>(3u));
    return select(lo, hi, codes >= vec4<u32>(2u));
}

// Walsh-Hadamard strides 1 and 2 within one vec4 (elements 4c .. 4c+3).
fn wht4(v: vec4<f32>) -> vec4<f32> {
    let s1 = vec4<f32>(v.x + v.y, v.x - v.y, v.z + v.w, v.z - v.w);
    return vec4<f32>(s1.x + s1.z, s1.y + s1.w, s1.x - s1.z, s1.y - s1.w);
}

@compute @workgroup_size(256, 1, 1)
fn attention_tq_tiled(
    @builtin(local_invocation_id) lid: vec3<u32>,
    @builtin(workgroup_id) wid: vec3<u32>,
) {
    let tid = lid.x;
    let n_heads = params[0];
    let n_kv_heads = params[1];
    let head_dim = params[2];
    let max_seq = params[3];
    let start_pos = params[4];
    let scale = bitcast<f32>(params[5]);
    let q_cap = params[6];
    let out_stride = params[7];
    let qjl_scale = bitcast<f32>(params[8]);
    let sign_off = params[9];
    let c0 = bitcast<f32>(params[10]);
    let c1 = bitcast<f32>(params[11]);
    let c2 = bitcast<f32>(params[12]);
    let c3 = bitcast<f32>(params[13]);
    let q_base = params[14];
    let cache_cap = params[15];
    let flags = params[16];

    let kv_head = wid.y;
    let group = n_heads / n_kv_heads;
    let bq = R / group;
    let d4 = head_dim / 4u;
    let pw = head_dim / 16u;
    let jw = head_dim / 32u;
    let vecs = n_kv_heads * cache_cap;
    let k_jl_off = vecs * pw;
    let k_norm_off = k_jl_off + vecs * jw;
    let v_norm_off = vecs * pw;
    let slot0 = kv_head * cache_cap;
    let q_first = q_base + wid.x * bq;
    let q_last = min(q_first + bq, q_cap) - 1u;      // host guarantees q_first < q_cap
    let non_causal = (flags & FLAG_NON_CAUSAL) != 0u;
    var t_end = max_seq;
    if !non_causal {
        t_end = min(start_pos + q_last + 1u, max_seq);
    }
    let q_region = q_cap * n_heads * head_dim;

    // ── rows: r = g * bq + b is head kv_head*G + g at query q_first + b ──
    for (var e = tid; e < R * d4; e += WG) {
        let r = e / d4;
        let c = e % d4;
        let qi = q_first + r % bq;
        let head = kv_head * group + r / bq;
        var a = vec4<f32>(0.0);
        var b = vec4<f32>(0.0);
        if qi <= q_last {
            let o = (qi * n_heads + head) * head_dim + 4u * c;
            a = vec4<f32>(qrot[o], qrot[o + 1u], qrot[o + 2u], qrot[o + 3u]);
            let oj = q_region + o;
            b = vec4<f32>(qrot[oj], qrot[oj + 1u], qrot[oj + 2u], qrot[oj + 3u]);
        }
        qr_sh[e] = a;
        qj_sh[e] = b;
    }
    if tid < R {
        let qi = q_first + tid % bq;
        var s = 0.0;
        if qi <= q_last {
            s = qrot[2u * q_region + qi * n_heads + kv_head * group + tid / bq];
        }
        qsum_sh[tid] = s;
        m_sh[tid] = NEG_INF;
        l_sh[tid] = 0.0;
    }

    // score phase: thread (row sr, key sj); value phase: thread (row sr, columns sj, sj + 16)
    let sr = tid / 16u;
    let sj = tid % 16u;
    let s_qi = q_first + sr % bq;
    var s_end = t_end;
    if !non_causal {
        s_end = min(start_pos + s_qi + 1u, max_seq);
    }
    let sh2 = vec4<u32>(0u, 2u, 4u, 6u);
    let sh1 = vec4<u32>(0u, 1u, 2u, 3u);
    var acc0 = vec4<f32>(0.0);
    var acc1 = vec4<f32>(0.0);

    for (var tb = 0u; tb < t_end; tb += TK) {
        let nk = min(TK, t_end - tb);
        let s0 = slot0 + tb;
        // (1) decode the key tile
        workgroupBarrier();
        for (var e = tid; e < nk * d4; e += WG) {
            let t = e / d4;
            let c = e % d4;
            let word = k_cache[(s0 + t) * pw + c / 4u];
            dec[t * ROW4 + c] = cvals((vec4<u32>(word) >> (sh2 + vec4<u32>(8u * (c % 4u)))) & vec4<u32>(3u), c0, c1, c2, c3);
        }
        for (var e = tid; e < nk * jw; e += WG) {
            kj[(e / jw) * JROW + e % jw] = k_cache[k_jl_off + s0 * jw + e];
        }
        if tid < nk {
            kn[tid] = k_cache[k_norm_off + s0 + tid];
        }
        workgroupBarrier();
        // (2) score of key sj for row sr
        var polar = 0.0;
        var pos = 0.0;
        let qo = sr * d4;
        for (var c = 0u; c < d4; c += 1u) {
            let qr = qr_sh[qo + c];
            let qj = qj_sh[qo + c];
            polar += dot(qr, dec[sj * ROW4 + c]);
            let bits = (vec4<u32>(kj[sj * JROW + c / 8u]) >> (sh1 + vec4<u32>(4u * (c % 8u)))) & vec4<u32>(1u);
            pos += dot(qj, vec4<f32>(bits));
        }
        let nr = unpack2x16float(kn[sj]);
        let score = (polar * nr.x + nr.x * nr.y * qjl_scale * (2.0 * pos - qsum_sh[sr])) * scale;
        p_sh[sr * TK + sj] = select(NEG_INF, score, sj < nk && tb + sj < s_end);
        workgroupBarrier();
        // #include "tiled_row_softmax.wgsl"
        // (4) decode the value tile: norm * centroid (the keys' tile is no longer read)
        for (var e = tid; e < nk * d4; e += WG) {
            let t = e / d4;
            let c = e % d4;
            let word = v_cache[(s0 + t) * pw + c / 4u];
            let vn = unpack2x16float(v_cache[v_norm_off + s0 + t]).x;
            dec[t * ROW4 + c] = vn * cvals((vec4<u32>(word) >> (sh2 + vec4<u32>(8u * (c % 4u)))) & vec4<u32>(3u), c0, c1, c2, c3);
        }
        workgroupBarrier();
        // (5) rescale and accumulate columns sj, sj + 16 of row sr
        let corr = c_sh[sr];
        acc0 *= corr;
        acc1 *= corr;
        for (var j = 0u; j < nk; j += 1u) {
            let p = p_sh[sr * TK + j];
            acc0 += p * dec[j * ROW4 + sj];
            acc1 += p * dec[j * ROW4 + sj + 16u];
        }
    }

    // ── epilogue: normalize, inverse RHT per row, write ──
    // The butterfly's strides 1 and 2 stay inside one vec4 (done in registers);
    // strides 4 .. head_dim/2 pair whole vec4 columns of a row in qr_sh.
    workgroupBarrier();
    let inv = 1.0 / (l_sh[sr] * sqrt(f32(head_dim)));
    if sj < d4 {
        qr_sh[sr * d4 + sj] = wht4(acc0 * inv);
    }
    if sj + 16u < d4 {
        qr_sh[sr * d4 + sj + 16u] = wht4(acc1 * inv);
    }
    let half4 = d4 / 2u;
    for (var stride = 1u; stride < d4; stride = stride * 2u) {
        workgroupBarrier();
        for (var e = tid; e < R * half4; e += WG) {
            let base = (e / half4) * d4;
            let k = e % half4;
            let i = base + (k / stride) * 2u * stride + (k % stride);
            let a = qr_sh[i];
            let b = qr_sh[i + stride];
            qr_sh[i] = a + b;
            qr_sh[i + stride] = a - b;
        }
    }
    workgroupBarrier();
    for (var e = tid; e < R * d4; e += WG) {
        let r = e / d4;
        let c = e % d4;
        let qi = q_first + r % bq;
        if qi <= q_last {
            let head = kv_head * group + r / bq;
            let v = qr_sh[e];
            let o = qi * out_stride + head * head_dim + 4u * c;
            let sg = sign_off + 4u * c;
            out_batch[o] = v.x * signs[sg];
            out_batch[o + 1u] = v.y * signs[sg + 1u];
            out_batch[o + 2u] = v.z * signs[sg + 2u];
            out_batch[o + 3u] = v.w * signs[sg + 3u];
        }
    }
}
