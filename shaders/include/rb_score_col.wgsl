            if full_chunks || ch * 8u + {DV}u < d4 {
                // vec4 column {DV} of the chunk (shaders/include/rb_score_col.wgsl):
                // the K^T rows of dims 4*{DV} .. 4*{DV} + 3 (4 keys each), then per
                // row pair one Q vec4 (4 dims); 12 vec4 reads -> 32 vec4 FMAs
                let k0 = qk[{KD}u][tch][tcl];
                let k1 = qk[{KD}u + 1u][tch][tcl];
                let k2 = qk[{KD}u + 2u][tch][tcl];
                let k3 = qk[{KD}u + 3u][tch][tcl];
                var q = qk[{QO}u][0][tr];
                s0 += q.x * k0;
                s0 += q.y * k1;
                s0 += q.z * k2;
                s0 += q.w * k3;
                q = qk[{QO}u][1][tr];
                s1 += q.x * k0;
                s1 += q.y * k1;
                s1 += q.z * k2;
                s1 += q.w * k3;
                q = qk[{QO}u + 1u][0][tr];
                s2 += q.x * k0;
                s2 += q.y * k1;
                s2 += q.z * k2;
                s2 += q.w * k3;
                q = qk[{QO}u + 1u][1][tr];
                s3 += q.x * k0;
                s3 += q.y * k1;
                s3 += q.z * k2;
                s3 += q.w * k3;
                q = qk[{QO}u + 2u][0][tr];
                s4 += q.x * k0;
                s4 += q.y * k1;
                s4 += q.z * k2;
                s4 += q.w * k3;
                q = qk[{QO}u + 2u][1][tr];
                s5 += q.x * k0;
                s5 += q.y * k1;
                s5 += q.z * k2;
                s5 += q.w * k3;
                q = qk[{QO}u + 3u][0][tr];
                s6 += q.x * k0;
                s6 += q.y * k1;
                s6 += q.z * k2;
                s6 += q.w * k3;
                q = qk[{QO}u + 3u][1][tr];
                s7 += q.x * k0;
                s7 += q.y * k1;
                s7 += q.z * k2;
                s7 += q.w * k3;
            }
