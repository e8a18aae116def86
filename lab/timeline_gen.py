# Regenerate lab/timeline_lab.cu's copy of linear_wide_impl from kernels/gemm.cu (with stamps).
import re, sys
src = open('kernels/gemm.cu').read()
a = src.index('template <typename OutT, int NT, int STAGE_CH, int STAGES, bool VEC>\nMT_DEVICE void linear_wide_impl')
b = src.index('#define LIN_W_NT 2')
impl = src[a:b].replace('linear_wide_impl(', 'timed_wide_impl(')
impl = impl.replace('uint32_t k, unsigned char* smem) {', 'uint32_t k, unsigned char* smem, unsigned long long* ts) {\n    STAMP(0);', 1)
impl = impl.replace('    pdl_wait();\n    pdl_trigger();\n', '    pdl_wait();\n    pdl_trigger();\n    STAMP(1);\n', 1)
impl = impl.replace('    cp_async_wait<0>();\n    __syncthreads();  // the ring is free', '    STAMP(2);\n    cp_async_wait<0>();\n    __syncthreads();  // the ring is free', 1)
impl = impl.replace('    cluster_wait();\n    // This block', '    cluster_wait();\n    STAMP(3);\n    // This block', 1)
impl = impl.replace('    cluster_leave_barrier();  // no block leaves while another still reads its partials\n}', '    cluster_leave_barrier();  // no block leaves while another still reads its partials\n    STAMP(4);\n}', 1)
assert impl.count('STAMP(') == 5
lab = open('lab/timeline_lab.cu').read()
s = lab.index('template <typename OutT, int NT, int STAGE_CH, int STAGES, bool VEC>')
e = lab.index('extern "C" __global__ void __cluster_dims__')
open('lab/timeline_lab.cu', 'w').write(lab[:s] + impl + lab[e:])
