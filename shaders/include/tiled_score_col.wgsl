            {   // one vec4 column of the chunk (shaders/include/tiled_score_col.wgsl):
                // Q rows in stage rows QA (r0, r1) and QB (r2, r3), keys in KR
                let k0 = stage[{KR}][tc];
                let k1 = stage[{KR}][tc + 16u];
                let q0 = stage[{QA}][tr];
                a00 += q0 * k0;
                a01 += q0 * k1;
                let q1 = stage[{QA}][tr + 16u];
                a10 += q1 * k0;
                a11 += q1 * k1;
                let q2 = stage[{QB}][tr];
                a20 += q2 * k0;
                a21 += q2 * k1;
                let q3 = stage[{QB}][tr + 16u];
                a30 += q3 * k0;
                a31 += q3 * k1;
            }
