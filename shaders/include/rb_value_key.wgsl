                {   // key {K} of the tile (shaders/include/rb_value_key.wgsl): the
                    // probabilities of the thread's 8 rows (2 vec4) and V columns
                    // tc, tc + 16 of the key (2 vec4) -> 16 vec4 FMAs
                    let pa = qk[{K}u][0][{PX}];
                    let pb = qk[{K}u][1][{PX}];
                    let va = vb[{VR}u][0][tc];
                    o0a += pa.x * va;
                    o1a += pa.y * va;
                    o2a += pa.z * va;
                    o3a += pa.w * va;
                    o4a += pb.x * va;
                    o5a += pb.y * va;
                    o6a += pb.z * va;
                    o7a += pb.w * va;
                    if wide {
                        let vw = vb[{VR}u][1][tc];
                        o0b += pa.x * vw;
                        o1b += pa.y * vw;
                        o2b += pa.z * vw;
                        o3b += pa.w * vw;
                        o4b += pb.x * vw;
                        o5b += pb.y * vw;
                        o6b += pb.z * vw;
                        o7b += pb.w * vw;
                    }
                }
