// C-ABI wrapper around FlashMLA's SM90 FP8 sparse decode (DeepSeek-V3.2 rows), for benchmarks only.
//
// FlashMLA's sources are not part of shardattn: build_flashmla_peer.sh (target "fp8_decode")
// compiles this file with FlashMLA's split-KV kernel (the persistent V3.2 instantiations at 64 and
// 128 heads), its scheduler-metadata kernel and its combine kernel, against a FlashMLA checkout and
// the CUTLASS it pins, into a shared library that benchmarks/peer/flashmla_fp8_decode.py loads
// with ctypes. No torch headers are involved; the host logic of FlashMLA's torch binding
// (csrc/api/sparse_decode.h, sparse_attn_decode_interface on sm_90) is written out below.
//
// Conventions (FlashMLA's): q [b, s_q, h_q, 576] bf16; kv [num_blocks, page_block_size, 656]
// uint8 rows in the fp8_ds_mla format, each page's rows contiguous (row stride 656 bytes), the
// page stride free; indices [b, s_q, topk] int32 rows (page * page_block_size + offset): only -1
// is masked (other out-of-range values are read: map them to -1 first), topk a multiple of 64;
// out [b, s_q, h_q, 512] bf16 and lse [b, s_q, h_q] fp32 natural log, +inf for a row with no
// valid index (out 0). h_q must be 64 or 128. Work space: sched_meta [num_sm_parts, 8] int32,
// num_splits [b + 1] int32, lse_accum [b + num_sm_parts, s_q, h_q] fp32 and o_accum
// [b + num_sm_parts, s_q, h_q, 512] fp32, all contiguous. The metadata depends on b, s_q, topk
// and the SM count only: compute it once per shape (as FlashMLA's FlashMLASchedMeta does).
#include <cuda_runtime_api.h>

#include <cstdio>
#include <exception>

#include "params.h"
#include "sm90/decode/sparse_fp8/splitkv_mla.h"
#include "smxx/decode/combine/combine.h"
#include "smxx/decode/get_decoding_sched_meta/get_decoding_sched_meta.h"

namespace {

constexpr int kTopkBlock = 64;           // Decode_Sm90_Impl::get_meta: block_size_topk
constexpr int kFixedOverheadBlocks = 5;  // Decode_Sm90_Impl::get_meta: fixed_overhead_num_blocks
constexpr int kBytesPerToken = 656;      // 512 fp8 + 4 fp32 scales + 64 bf16
constexpr int kDqk = 576, kDv = 512;
constexpr float kLog2e = 1.4426950408889634f;

}  // namespace

// Ints of one DecodingSchedMeta entry (the second dim of sched_meta).
extern "C" int flashmla_sparse_fp8_decode_sched_meta_ints() {
    return static_cast<int>(sizeof(DecodingSchedMeta) / sizeof(int));
}

// Decode_Sm90_Impl::get_meta: SM partitions of the persistent kernel (one per CTA pair at 128 heads).
extern "C" int flashmla_sparse_fp8_decode_num_sm_parts(int num_sm, int s_q, int h_q) {
    int parts = num_sm / s_q / (h_q / 64);
    return parts > 1 ? parts : 1;
}

// get_decoding_sched_meta on the stream: fills sched_meta and num_splits for (b, s_q, topk).
extern "C" int flashmla_sparse_fp8_decode_metadata(
    int b, int s_q, int topk, int num_sm_parts, void* sched_meta, void* num_splits, void* stream) {
    if (b <= 0 || s_q <= 0 || topk <= 0 || topk % kTopkBlock) {
        std::fprintf(stderr, "flashmla_sparse_fp8_decode_metadata: b %d, s_q %d, topk %d (a multiple of 64)\n", b, s_q,
                     topk);
        return 1;
    }
    GetDecodeSchedMetaParams params{};
    params.b = b;
    params.s_q = s_q;
    params.block_size_n = kTopkBlock;
    params.fixed_overhead_num_blocks = kFixedOverheadBlocks;
    params.topk = topk;
    params.extra_topk = 0;  // no extra KV cache (as the torch binding passes without one)
    params.topk_length = nullptr;
    params.extra_topk_length = nullptr;
    params.seqlens_k_ptr = nullptr;
    params.tile_scheduler_metadata_ptr = static_cast<DecodingSchedMeta*>(sched_meta);
    params.num_splits_ptr = static_cast<int*>(num_splits);
    params.num_sm_parts = num_sm_parts;
    params.stream = static_cast<cudaStream_t>(stream);
    smxx::decode::run_get_decoding_sched_meta_kernel(params);
    return cudaGetLastError() == cudaSuccess ? 0 : 2;
}

// The split-KV kernel, then the combine kernel (programmatic dependent launch), on the stream.
extern "C" int flashmla_sparse_fp8_decode_sm90(
    void* q, void* kv, void* indices, void* out, void* lse, void* lse_accum, void* o_accum, void* sched_meta,
    void* num_splits, int b, int s_q, int h_q, int topk, int num_blocks, int page_block_size, int stride_q_b,
    int stride_q_s_q, int stride_q_h_q, int stride_kv_block, int stride_indices_b, int stride_indices_s_q,
    float sm_scale, int num_sm_parts, void* stream) {
    if ((h_q != 64 && h_q != 128) || topk <= 0 || topk % kTopkBlock || b <= 0 || s_q <= 0) {
        std::fprintf(stderr, "flashmla_sparse_fp8_decode_sm90: h_q %d (64 or 128), topk %d (a multiple of 64)\n", h_q,
                     topk);
        return 1;
    }
    SparseAttnDecodeParams p{};
    p.b = b;
    p.s_q = s_q;
    p.h_q = h_q;
    p.h_kv = 1;
    p.d_qk = kDqk;
    p.d_v = kDv;
    p.sm_scale = sm_scale;
    p.sm_scale_div_log2 = sm_scale * kLog2e;  // the binding's sm_scale * LOG_2_E
    p.num_blocks = num_blocks;
    p.page_block_size = page_block_size;
    p.topk = topk;
    p.model_type = ModelType::V32;
    p.q = static_cast<cutlass::bfloat16_t*>(q);
    p.kv = static_cast<cutlass::bfloat16_t*>(kv);  // read as bytes by the kernel
    p.indices = static_cast<int*>(indices);
    p.topk_length = nullptr;  // V3.2 on sm_90: not supported
    p.attn_sink = nullptr;
    p.lse = static_cast<float*>(lse);
    p.out = static_cast<cutlass::bfloat16_t*>(out);
    p.extra_num_blocks = p.extra_page_block_size = p.extra_topk = 0;
    p.extra_kv = nullptr;
    p.extra_indices = nullptr;
    p.extra_topk_length = nullptr;
    p.stride_q_b = stride_q_b;
    p.stride_q_s_q = stride_q_s_q;
    p.stride_q_h_q = stride_q_h_q;
    p.stride_kv_block = stride_kv_block;
    p.stride_kv_row = kBytesPerToken;
    p.stride_indices_b = stride_indices_b;
    p.stride_indices_s_q = stride_indices_s_q;
    p.stride_lse_b = s_q * h_q;
    p.stride_lse_s_q = h_q;
    p.stride_o_b = s_q * h_q * kDv;
    p.stride_o_s_q = h_q * kDv;
    p.stride_o_h_q = kDv;
    p.stride_extra_kv_block = p.stride_extra_kv_row = 0;
    p.stride_extra_indices_b = p.stride_extra_indices_s_q = 0;
    p.stream = static_cast<cudaStream_t>(stream);
    p.lse_accum = static_cast<float*>(lse_accum);
    p.o_accum = static_cast<float*>(o_accum);
    p.stride_lse_accum_split = s_q * h_q;
    p.stride_lse_accum_s_q = h_q;
    p.stride_o_accum_split = s_q * h_q * kDv;
    p.stride_o_accum_s_q = h_q * kDv;
    p.stride_o_accum_h_q = kDv;
    p.tile_scheduler_metadata_ptr = static_cast<DecodingSchedMeta*>(sched_meta);
    p.num_splits_ptr = static_cast<int*>(num_splits);
    p.num_sm_parts = num_sm_parts;

    try {
        if (h_q == 64) {
            sm90::decode::sparse_fp8::run_flash_splitkv_mla_fp8_sparse_kernel<ModelType::V32, 64>(p);
        } else {
            sm90::decode::sparse_fp8::run_flash_splitkv_mla_fp8_sparse_kernel<ModelType::V32, 128>(p);
        }
    } catch (const std::exception& e) {
        std::fprintf(stderr, "flashmla_sparse_fp8_decode_sm90: %s\n", e.what());
        return 3;
    }

    CombineParams c{};
    c.b = b;
    c.s_q = s_q;
    c.h_q = h_q;
    c.d_v = kDv;
    c.lse = p.lse;
    c.out = p.out;
    c.stride_lse_b = p.stride_lse_b;
    c.stride_lse_s_q = p.stride_lse_s_q;
    c.stride_o_b = p.stride_o_b;
    c.stride_o_s_q = p.stride_o_s_q;
    c.stride_o_h_q = p.stride_o_h_q;
    c.lse_accum = p.lse_accum;
    c.o_accum = p.o_accum;
    c.stride_lse_accum_split = p.stride_lse_accum_split;
    c.stride_lse_accum_s_q = p.stride_lse_accum_s_q;
    c.stride_o_accum_split = p.stride_o_accum_split;
    c.stride_o_accum_s_q = p.stride_o_accum_s_q;
    c.stride_o_accum_h_q = p.stride_o_accum_h_q;
    c.tile_scheduler_metadata_ptr = p.tile_scheduler_metadata_ptr;
    c.num_splits_ptr = p.num_splits_ptr;
    c.num_sm_parts = num_sm_parts;
    c.attn_sink = nullptr;
    c.stream = p.stream;
    smxx::decode::run_flash_mla_combine_kernel<cutlass::bfloat16_t>(c);
    return cudaGetLastError() == cudaSuccess ? 0 : 2;
}
