// C-ABI wrapper around FlashMLA's SM90 sparse-prefill kernel, for benchmarks only.
//
// FlashMLA's sources are not part of shardattn: build_flashmla_peer.sh compiles this file against
// a FlashMLA checkout and the CUTLASS it pins, into a shared library that
// benchmarks/sparse_prefill.py loads with ctypes (--peer-lib, through peer/flashmla_prefill.py). No torch
// headers are involved, so the build takes one nvcc call.
//
// Conventions (FlashMLA's): q [s_q, h_q, 576] bf16, kv [s_kv, 1, 576] bf16, indices [s_q, 1, topk]
// int32 (entries < 0 or >= s_kv are masked), out [s_q, h_q, 512] bf16, max_logits and lse
// [s_q, h_q] fp32 (natural log). h_q must be 64 or 128 and topk a multiple of 128.
#include <cuda_runtime_api.h>

#include <exception>
#include <cstdio>

#include "params.h"
#include "sm90/prefill/sparse/phase1.h"

extern "C" int flashmla_sparse_prefill_sm90(
    void* q, void* kv, void* indices, void* out, void* max_logits, void* lse,
    int s_q, int s_kv, int h_q, int topk,
    int stride_q_s_q, int stride_q_h_q, int stride_kv_s_kv, int stride_indices_s_q,
    float sm_scale, int num_sm, void* stream) {
    constexpr float kLog2e = 1.4426950408889634f;
    SparseAttnFwdParams params = {
        s_q, s_kv, h_q, /*h_kv=*/1, /*d_qk=*/576, /*d_v=*/512, topk,
        sm_scale, sm_scale * kLog2e,
        static_cast<cutlass::bfloat16_t*>(q),
        static_cast<cutlass::bfloat16_t*>(kv),
        static_cast<int*>(indices),
        /*attn_sink=*/nullptr,
        /*topk_length=*/nullptr,
        stride_q_s_q, stride_q_h_q,
        stride_kv_s_kv, /*stride_kv_h_kv=*/576,
        stride_indices_s_q, /*stride_indices_h_kv=*/topk,
        static_cast<cutlass::bfloat16_t*>(out),
        static_cast<float*>(max_logits),
        static_cast<float*>(lse),
        num_sm,
        static_cast<cudaStream_t>(stream),
    };
    try {
        sm90::fwd::run_fwd_phase1_kernel<576, false>(params);
    } catch (const std::exception& e) {
        std::fprintf(stderr, "flashmla_sparse_prefill_sm90: %s\n", e.what());
        return 1;
    }
    return cudaGetLastError() == cudaSuccess ? 0 : 2;
}
