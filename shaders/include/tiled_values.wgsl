        // ── value phase (shaders/include/tiled_values.wgsl): rescale, then per
        // 4 keys 4 vec4 reads of p_sh (rows r0..r3) and 8 of the V tile in
        // `stage` (columns tc, tc + 16) feed 32 vec4 FMAs, unrolled by
        // includes so every workgroup index is a literal or a per-thread
        // invariant (the bounds clamps fold or hoist); each thread of a row
        // sums the row's l from the same values in the same order. ──
        o00 *= f0;
        o01 *= f0;
        o10 *= f1;
        o11 *= f1;
        o20 *= f2;
        o21 *= f2;
        o30 *= f3;
        o31 *= f3;
        l0 *= f0;
        l1 *= f1;
        l2 *= f2;
        l3 *= f3;
        // #include "tiled_value_keys.wgsl" J=0u K0=0u K1=1u K2=2u K3=3u
        // #include "tiled_value_keys.wgsl" J=1u K0=4u K1=5u K2=6u K3=7u
        // #include "tiled_value_keys.wgsl" J=2u K0=8u K1=9u K2=10u K3=11u
        // #include "tiled_value_keys.wgsl" J=3u K0=12u K1=13u K2=14u K3=15u
        // #include "tiled_value_keys.wgsl" J=4u K0=16u K1=17u K2=18u K3=19u
        // #include "tiled_value_keys.wgsl" J=5u K0=20u K1=21u K2=22u K3=23u
        // #include "tiled_value_keys.wgsl" J=6u K0=24u K1=25u K2=26u K3=27u
        // #include "tiled_value_keys.wgsl" J=7u K0=28u K1=29u K2=30u K3=31u
