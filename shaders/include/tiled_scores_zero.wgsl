// The tiled kernels' score accumulators for one key tile, zeroed: 4 rows x 2
// vec4s of keys per thread (attention_prefill_tiled.wgsl, flash_attention_tqx_tiled.wgsl).
        var a00 = vec4<f32>(0.0);
        var a01 = vec4<f32>(0.0);
        var a10 = vec4<f32>(0.0);
        var a11 = vec4<f32>(0.0);
        var a20 = vec4<f32>(0.0);
        var a21 = vec4<f32>(0.0);
        var a30 = vec4<f32>(0.0);
        var a31 = vec4<f32>(0.0);
