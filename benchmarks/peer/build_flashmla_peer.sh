#!/usr/bin/env bash
# Builds a FlashMLA peer library (sm_90a only) from a FlashMLA checkout; FlashMLA is not part of shardattn.
#   benchmarks/peer/build_flashmla_peer.sh FLASHMLA_DIR CUTLASS_DIR OUT.so [TARGET]
# FLASHMLA_DIR: a FlashMLA checkout (its csrc/ is used); CUTLASS_DIR: the CUTLASS its csrc/cutlass
# submodule pins. TARGET:
#   prefill     (default) the SM90 sparse prefill, for benchmarks/sparse_prefill.py --peer-lib
#   fp8_decode  the SM90 FP8 sparse decode (V3.2 rows, 64 and 128 heads: split-KV kernel,
#               scheduler metadata, combine), for benchmarks/decode_fp8_peer.py --peer-lib; its
#               sources compile in parallel, then one link
# NVCC_EXTRA: extra nvcc flags (FlashMLA's own build adds
#   --ptxas-options=--register-usage-level=10 where the CUDA toolkit knows it).
set -euo pipefail
flashmla=$1 cutlass=$2 out=$3 target=${4:-prefill}
here=$(cd "$(dirname "$0")" && pwd)
flags=(-O3 -std=c++20 -DNDEBUG -D_USE_MATH_DEFINES --expt-relaxed-constexpr --expt-extended-lambda
  --use_fast_math -Xcompiler -fPIC -gencode arch=compute_90a,code=sm_90a
  -U__CUDA_NO_HALF_OPERATORS__ -U__CUDA_NO_HALF_CONVERSIONS__ -U__CUDA_NO_HALF2_OPERATORS__
  -U__CUDA_NO_BFLOAT16_CONVERSIONS__ --ptxas-options=-v
  -I "$flashmla/csrc" -I "$flashmla/csrc/sm90" -I "$flashmla/csrc/kerutils/include"
  -I "$cutlass/include" -I "$cutlass/tools/util/include")
# shellcheck disable=SC2206 # NVCC_EXTRA is a list of flags
flags+=(${NVCC_EXTRA:-})
case $target in
  prefill)
    nvcc "${flags[@]}" -shared "$here/flashmla_sparse_prefill.cu" \
      "$flashmla/csrc/sm90/prefill/sparse/instantiations/phase1_k576.cu" -o "$out"
    ;;
  fp8_decode)
    sources=("$here/flashmla_sparse_fp8_decode.cu"
      "$flashmla/csrc/sm90/decode/sparse_fp8/instantiations/v32_persistent_h64.cu"
      "$flashmla/csrc/sm90/decode/sparse_fp8/instantiations/v32_persistent_h128.cu"
      "$flashmla/csrc/smxx/decode/get_decoding_sched_meta/get_decoding_sched_meta.cu"
      "$flashmla/csrc/smxx/decode/combine/combine.cu")
    objs=$(mktemp -d)
    trap 'rm -rf "$objs"' EXIT
    pids=()
    for i in "${!sources[@]}"; do
      nvcc "${flags[@]}" -c "${sources[$i]}" -o "$objs/$i.o" &
      pids+=($!)
    done
    for pid in "${pids[@]}"; do wait "$pid"; done  # set -e: a failed compile stops here
    nvcc -shared -Xcompiler -fPIC "$objs"/*.o -o "$out"
    ;;
  *)
    echo "unknown target $target (prefill or fp8_decode)" >&2
    exit 2
    ;;
esac
