// The correction and the tally (abft_correct.h's Corrector, abft.h's Tally): a thread a
// matrix, then the counts and the worst matrix into the ledger by one thread block; with the
// fused softmax's P redone for a corrected S; and the bias's terms of the checksums.
#pragma once

#include "kernels/cuda_softmax.cuh"

namespace abft {
namespace {

// The correction of matrix b by one thread (a clean one returns at once).
template <typename Acc>
__device__ __forceinline__ void correct_matrix(const Correct& k, int64_t b) {
  Corrector<Acc>(k, b).run();
}

// correct: one thread per matrix.
template <typename Acc>
__global__ void correct_kernel(Correct k) {
  const int64_t b = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (b < k.screen.batch) correct_matrix<Acc>(k, b);
}

// tally by one thread block: counts in shared memory, the worst matrix by an atomic max of its
// rank.
__device__ void tally_block(const Tally& t) {
  __shared__ int counts[3 * kMaxKinds];
  __shared__ unsigned long long worst;
  for (int i = threadIdx.x; i < 3 * kMaxKinds; i += blockDim.x) counts[i] = 0;
  if (threadIdx.x == 0) worst = 0;
  __syncthreads();
  unsigned long long mine = 0;
  for (int64_t b = threadIdx.x; b < t.batch; b += blockDim.x) {
    const int8_t status = t.status[b], kind = t.kind[b];
    const unsigned long long rank = tally_rank(status, b);
    mine = rank > mine ? rank : mine;
    if (status < 1 || status > 2 || kind < 0 || kind >= t.kinds) continue;
    atomicAdd(counts + kind, 1);
    atomicAdd(counts + status * t.kinds + kind, 1);
  }
  atomicMax(&worst, mine);
  __syncthreads();
  for (int i = threadIdx.x; i < 3 * t.kinds; i += blockDim.x) t.counts[i] += counts[i];
  if (threadIdx.x == 0) tally_event(t, tally_matrix(worst));
}

__global__ void __launch_bounds__(kThreads) tally_kernel(Tally t) { tally_block(t); }

// add_bias: one thread per item; a row item sums its block of the bias itself (a block of a
// vector, from the cache), so that the items are independent.
template <typename Acc>
__global__ void __launch_bounds__(kThreads) bias_terms_kernel(BiasTerms t, int64_t items) {
  const int64_t step = int64_t(gridDim.x) * blockDim.x, columns = bias_column_items(t);
  for (int64_t item = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; item < items; item += step) {
    if (item < columns) {
      bias_column_term<Acc>(t, item);
    } else {
      const int64_t blk = (item - columns) / t.m, i = (item - columns) % t.m;
      bias_row_term<Acc>(t, blk, i, bias_block<Acc>(t, blk));
    }
  }
}

// correct, then tally what it found, in one launch: one thread block, a thread per matrix in
// turn (a clean matrix returns at once); once every matrix is settled, where `redo` is the
// softmax_check that read C as S (its p not null: correct_redo_tally_cuda), the block redoes
// P for each matrix corrected; then the tally. One instance an accumulation type (S's element
// type is read at run time): the correction is slow to compile.
template <typename Acc>
__global__ void __launch_bounds__(kThreads)
    correct_tally_kernel(Correct c, Tally t, SoftmaxCheck redo, RowProducts pr, bool pass) {
  for (int64_t b = threadIdx.x; b < c.screen.batch; b += blockDim.x) correct_matrix<Acc>(c, b);
  __syncthreads();  // every matrix's status written
  for (int64_t b = 0; redo.p != nullptr && b < c.screen.batch; ++b) {
    if (c.status[b] == 1) redo_matrix_of<Acc>(redo, pr, pass, b);  // one branch for all threads
  }
  tally_block(t);
}

}  // namespace
}  // namespace abft
