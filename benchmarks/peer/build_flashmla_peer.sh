#!/usr/bin/env bash
# Builds the FlashMLA peer for benchmarks/sparse_prefill.py --peer-lib (sm_90a only).
#   benchmarks/peer/build_flashmla_peer.sh FLASHMLA_DIR CUTLASS_DIR OUT.so
# FLASHMLA_DIR: a FlashMLA checkout (its csrc/ is used); CUTLASS_DIR: the CUTLASS its csrc/cutlass
# submodule pins. Neither is part of shardattn.
set -euo pipefail
flashmla=$1 cutlass=$2 out=$3
here=$(cd "$(dirname "$0")" && pwd)
nvcc -O3 -std=c++20 -DNDEBUG -D_USE_MATH_DEFINES --expt-relaxed-constexpr --expt-extended-lambda \
  --use_fast_math -Xcompiler -fPIC -shared -gencode arch=compute_90a,code=sm_90a \
  -U__CUDA_NO_HALF_OPERATORS__ -U__CUDA_NO_HALF_CONVERSIONS__ -U__CUDA_NO_BFLOAT16_CONVERSIONS__ \
  --ptxas-options=-v -I "$flashmla/csrc" -I "$flashmla/csrc/sm90" -I "$flashmla/csrc/kerutils/include" \
  -I "$cutlass/include" -I "$cutlass/tools/util/include" \
  "$here/flashmla_sparse_prefill.cu" "$flashmla/csrc/sm90/prefill/sparse/instantiations/phase1_k576.cu" \
  -o "$out"
