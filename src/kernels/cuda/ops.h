// Host entry points of the CUDA kernels (plain C++: the backend and the tests include this without CUDA
// headers). All pointers named d_* are device pointers; every call is asynchronous on `stream`.
//
// Quantized matrices are repacked at upload into "fragment order": tiles of 16 rows, and within a tile, for
// each k-step of the tensor-core instruction (mma.sync m16n8k32), the 16 bytes that lane L of a warp needs as
// its A operand lie at offset 16 * L. A warp then streams a weight matrix with one coalesced 16-byte load per
// lane per step, the layout Marlin uses. They keep their integer codes and block scales (no precision is
// lost); activations are quantized the way the CPU backend does (Q8_0 blocks of 32, or Q8_K super-blocks of
// 256), so the integer block sums equal the CPU's exactly. F16/BF16 matrices stay row-major (rows padded to
// 32 columns), which cuBLAS reads in place and the products read with a matching column permutation
// (matrix_layout.cuh). Activations are kept as rows (single-token products, cuBLAS) and, for the batched
// tensor-core products, a second time in their B-operand order (ActBuf's fragment planes).
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

#include "core/dtype.h"
#include "runtime/row_sampling.h"

struct CUstream_st;

namespace merlin::cuda {

using Stream = CUstream_st*;
struct ChainState;       // decode loops, below
struct BatchChainState;  // batched decode loops, below
struct RopeKvArgs;       // model ops, below

// ---- device memory ----
void* dev_alloc(size_t bytes);  // zero-filled; throws merlin::Error when out of memory
void dev_free(void* p);
void copy_to_device(void* d_dst, const void* src, size_t bytes);
void copy_to_host(void* dst, const void* d_src, size_t bytes);
void sync_device();
size_t allocated_bytes();  // bytes currently held through dev_alloc

// ---- activations ----
// The format a matrix reads its input in.
enum class ActKind : int { F32 = 0, Q8_0 = 1, Q8_K = 2, F16 = 3, BF16 = 4 };
ActKind act_kind_for(DType weight_type);

// Activation planes for up to n_cap rows of k elements (only the planes `kind` uses are allocated).
struct ActBuf {
  ActKind kind = ActKind::F32;
  int64_t k = 0;
  int n_cap = 0;
  float* f = nullptr;      // F32: [n][k]
  int8_t* q = nullptr;     // Q8_*: [n][k] int8 codes
  float* scale = nullptr;  // Q8_*: [n][k/32] block scale (Q8_K: the super-block's d, repeated)
  int32_t* sum = nullptr;  // Q8_*: [n][k/32] sum of the block's codes (used by Q4_K's mins)
  uint16_t* hi = nullptr;  // F16/BF16: [n][k] x rounded
  uint16_t* lo = nullptr;  // F16/BF16: [n][k] x - hi rounded (hi + lo carries ~16 significant bits)
  // Q8_*: the codes, scales and sums again in the batched products' operand order (act_impl.cuh,
  // frag_code_index): rows in groups of 8 (n_cap rounded up), so that a warp reads a block of 32 for 8 rows
  // as 256 contiguous bytes. Null in buffers that only single-token products read.
  int8_t* fq = nullptr;
  float* fs = nullptr;
  int32_t* fsum = nullptr;
  // Q8_0: the elements again, rounded to half, in the same groups of 8 rows and blocks of 32 (act_impl.cuh,
  // frag_h_index), for the batched products that read half activations (matmul_half_pays). Every producer of
  // the fragment codes writes them too where the plane exists.
  uint16_t* fh = nullptr;
  // F16/BF16: hi and lo in the m16n8k16 B-operand order (frag_half_index), rows padded to 32 columns.
  uint16_t* fhi = nullptr;
  uint16_t* flo = nullptr;
  // Q8_0 rows written by matvec1_norm (one token: the row planes) or matmul_norm (2 or more: the fragment
  // planes): their block scales still lack each row's RMSNorm factor, which a reader computes from these
  // per-block sums of squares ([n][k / 32]) and rms_eps. Null in buffers prep_act fills; set only on the copy
  // of the ActBuf handed to the reader (single-token products, or batched ones that stage their input:
  // reads_deferred_norm).
  const double* rms_part = nullptr;
  float rms_eps = 0;
  int rms_rows = 0;    // the tokens the producer wrote: a reader must take exactly these (1: row planes)
  int rms_block = 32;  // outputs per sum of squares: 16 from matmul_norm's half-plane mode ([n][k / 16])
  // A single-token Q8_0 row not written at all: its values are silu(glu_src[i]) * glu_src[glu_offset + i] (the
  // gate/up product's output row), which the product computes and quantizes as prep_act(SwiGlu) would while
  // it stages its input (matvec1_glu_fits). Set only on the copy of the ActBuf handed to that product.
  const float* glu_src = nullptr;
  int64_t glu_offset = 0;
  int64_t glu_ld = 0;  // 2-4 tokens (matvec_few): token t's gate/up row at glu_src + t * glu_ld
  // The deferred RMSNorm's codes and scales are in the row planes (written by matvec1_norm or
  // matvec_few_norm), not the fragment planes (matmul_norm): only single- and few-token products read it.
  bool rms_in_rows = false;
};
ActBuf act_alloc(ActKind kind, int64_t k, int n_cap);
void act_free(ActBuf& a);

// What prep_act computes per row t (reading row src_row = rows ? rows[t] : t of x, ld elements apart):
enum class Prep : int {
  Plain = 0,    // v = x
  RmsNorm = 1,  // v = x / rms(x) * w, as the CPU's rmsnorm
  SwiGlu = 2,   // v = silu(x[i]) * x[i + glu_offset]
};
struct PrepArgs {
  Prep mode = Prep::Plain;
  const float* d_x = nullptr;
  int64_t ld = 0;
  const float* d_w = nullptr;  // RmsNorm weights
  float eps = 0;
  int64_t glu_offset = 0;      // SwiGlu: where the up half starts in a row
  const int32_t* d_rows = nullptr;
  // RmsNorm of the first layer (prep_act only): row t of x is token d_tokens[t]'s row of the embedding table,
  // which the kernel reads and also writes to d_embed_x (the residual rows, ld apart) as embed() would, so the
  // step needs no embedding kernel of its own. The same bits as embed() followed by prep_act.
  const int32_t* d_tokens = nullptr;
  const uint8_t* embd = nullptr;
  DType embd_type = DType::F32;
  size_t embd_row_bytes = 0;
  float* d_embed_x = nullptr;
  // With d_tokens: the table's rows. A token outside [0, embd_rows) reads row 0 instead of memory past the
  // table (the host validates tokens; a decode loop's step after a negative id runs on it, and is dropped).
  int64_t embd_rows = 0;
  // With d_tokens (one row): a decode loop's step (ChainState), whose head writes key[chain_slot]; the token
  // comes from the state instead of d_tokens. chain_handle: the while node's cudaGraphConditionalHandle.
  ChainState* chain = nullptr;
  unsigned long long chain_handle = 0;
  int chain_slot = 0;
  // With d_tokens (n rows, d_tokens = bchain->tokens): a batched decode loop's step (BatchChainState), for
  // which every row's first CTA records its previous id and sets its next position; chain_handle and
  // chain_slot as for chain.
  BatchChainState* bchain = nullptr;
};
void prep_act(const PrepArgs& p, int n, ActBuf& out, Stream stream);

// ---- matrices ----
struct Matrix {
  DType type = DType::F32;  // the GGUF type it was made from (TQ1_0 is stored as TQ2_0)
  int fmt = 0;              // internal format id (ops.cu)
  int64_t rows = 0;         // output rows, each part padded to a multiple of 16
  int64_t k = 0;
  uint8_t* q = nullptr;     // fragment-ordered codes (F16/BF16: padded row-major halves; F32: raw rows)
  uint8_t* s = nullptr;     // scales
  size_t bytes = 0;
  ActKind act() const;
};
// One source matrix in GGUF layout (host memory): rows x k elements of `type`, row_bytes apart.
struct MatrixPart {
  DType type;
  const void* data;
  int64_t rows, k;
  size_t row_bytes;
};
// Uploads parts stacked by rows (part i starts at row offset sum of padded rows before it); all parts share
// type and k. `staging` is reused scratch for the raw upload (grown as needed).
Matrix upload_matrix(const MatrixPart* parts, int n_parts, Stream stream);
void free_matrix(Matrix& m);
bool matrix_type_supported(DType t);
int64_t padded_rows(int64_t rows);  // rows rounded up to the tile of 16

// y[t * ldy + r] (= or +=) sum_i W[r][i] x[t][i] for r < n_out_rows, t < n.
void matmul(const Matrix& w, const ActBuf& x, int n, float* d_y, int64_t ldy, int64_t n_out_rows, bool accumulate,
            Stream stream);
// prep_act(prep, n, x) then matmul(w, x, ...), with the same results bit for bit. When prep_fuses(w, n)
// (decode-sized batches of short rows) it is one launch: each CTA of the product prepares its tokens in
// shared memory and x is not written.
bool prep_fuses(const Matrix& w, int n);
void matmul_prep(const Matrix& w, const PrepArgs& prep, ActBuf& x, int n, float* d_y, int64_t ldy, int64_t n_out_rows,
                 bool accumulate, Stream stream);

// One token through a stacked [gate; up] matrix (up's rows from up_row), written as silu(gate) * up in
// out's format (the down product's input, row 0): the bits of matmul() then prep_act(SwiGlu), in one
// kernel. swiglu_fuses says whether it applies (quantized matrices: outputs other than Q8_K, ffn % 32 == 0,
// long rows; F16/BF16 matrices: F16, BF16 or F32 outputs); matvec1_swiglu returns false (nothing queued)
// where it does not.
bool swiglu_fuses(const Matrix& w, int64_t ffn, int64_t up_row, ActKind out);
bool matvec1_swiglu(const Matrix& w, const ActBuf& x, int64_t ffn, int64_t up_row, ActBuf& out, Stream stream);
// One token through w (y (+)= W x, as matmul() with n == 1) whose epilogue also writes the next RMSNorm's
// input for a single-token reader of Q8_0 rows, so that no RMSNorm kernel runs between the two products:
// per block of 32 outputs, out's codes of y * d_norm_w with that block's own scale (amax / 127, unrounded,
// lacking the factor 1 / rms(y) that is not known until every block is done), and the block's sum of y^2 in
// d_part (n_out / 32 doubles). The reader gets a copy of out with rms_part = d_part and rms_eps = the norm's
// epsilon; it scales the staged block scales by 1 / rms(y) and rounds them to half as prep_act does. The
// codes are those of the same values times a common factor, so the reader sees what prep_act(RmsNorm) then
// matmul would up to float rounding (a code differs only at a rounding tie; tested with a bound).
// norm_fold_fits says whether it applies (quantized rows, n_out % 32 == 0); matvec1_norm returns false
// (nothing queued) where it does not.
bool norm_fold_fits(const Matrix& w, int64_t n_out);
bool matvec1_norm(const Matrix& w, const ActBuf& x, float* d_y, int64_t n_out, bool accumulate, const float* d_norm_w,
                  ActBuf& out, double* d_part, Stream stream);
// Steps of 2-4 tokens through the single-token kernels (matvec1.cu with NT = n): each round of weights is
// loaded once and multiplied by every token's staged row, and the step runs the single-token kernels' five
// per layer (the SwiGLU staged by the down product, the RMSNorm folded into Wo and down) where the batched
// products (below) run their 8-token tensor-core tiles and separate RMSNorm and SwiGLU kernels.
// matvec_few_fits: Q8_0, Q4_0 and MXFP4 rows of up to 16,384 columns. matvec_few_pays: where the path is
// taken by default (measured on the H200: 2 tokens, and 3 for Q4_0 / MXFP4, over rows of at least 3,072,
// i.e. the 3.17B-and-larger models; base's short rows run faster batched), MERLIN_CUDA_FEW=0 / 1 never / wherever it fits. Inputs
// are the row planes (prep_act and attention() write them too), outputs token t's row at y + t * ldy.
// matmul(), matmul_rope_kv() and matmul_argmax() take this path by themselves where it pays (and must for
// inputs only it reads: row-plane deferred norms, SwiGLU rows); matvec_few_norm is matvec1_norm for n tokens
// (out's rows t, d_part[t * n_out / 32 + block]; the reader's copy of out says rms_in_rows), and a down
// product may stage SwiGLU rows (ActBuf::glu_src, glu_ld) as at one token. Sums per token are those of
// matvec1 on that token alone at the same split: the same bits.
bool matvec_few_fits(const Matrix& w, int n);
bool matvec_few_pays(const Matrix& w, int n);
bool matvec_few(const Matrix& w, const ActBuf& x, int n, float* d_y, int64_t ldy, int64_t n_out_rows, bool accumulate,
                Stream stream);
bool matvec_few_rope_kv(const Matrix& w, const ActBuf& x, int n, float* d_qkv, int64_t ldy, const RopeKvArgs& r,
                        Stream stream);
bool matvec_few_norm(const Matrix& w, const ActBuf& x, int n, float* d_y, int64_t ldy, int64_t n_out, bool accumulate,
                     const float* d_norm_w, ActBuf& out, double* d_part, Stream stream);
bool matvec_few_argmax(const Matrix& w, const ActBuf& x, int n, int64_t n_out, unsigned long long* d_keys,
                       Stream stream);
// Tests: 0 sends 2-4-token steps to the batched products (as MERLIN_CUDA_FEW=0), 1 to the multi-token
// instances wherever they fit (MERLIN_CUDA_FEW=1), 2 the rule (matvec_few_pays); -1 restores the environment's.
void set_matvec_few(int mode);
// The same for decode-sized steps of n >= 2 tokens through the batched products: y (+)= W x for n tokens, and
// per token and block of 32 outputs out's fragment-ordered codes and unnormalised scales (fq, fs, fsum) and
// d_part[t * n_out / 32 + block]. The products' sums are those of matmul() with at most 4 warps per tile
// (a tile set then holds whole blocks), so y equals matmul()'s up to the order of each row's partial sums.
// A batched reader takes the copy of out with rms_part = d_part where reads_deferred_norm(reader, n): its
// CTAs stage their tokens in shared memory and complete the scales there. matmul_norm_fits says whether the
// producer applies (not F32, n >= 2, n_out % 32 == 0); matmul_norm returns false (nothing queued) where not.
bool matmul_norm_fits(const Matrix& w, int64_t n_out, int n);
bool matmul_norm(const Matrix& w, const ActBuf& x, int n, float* d_y, int64_t ldy, int64_t n_out, bool accumulate,
                 const float* d_norm_w, ActBuf& out, double* d_part, Stream stream, bool half_only = false);
bool reads_deferred_norm(const Matrix& w, int n);
// The half-plane mode of matmul_norm (half_only): only y, out's half plane fh (y * w, unnormalised) and the
// sums of squares per 16 outputs, d_part[t * n_out / 16 + tile], for readers that take the half plane
// (reads_half_norm: the H kernels, which scale their sums by 1 / rms). Any warps per tile, so the product
// keeps matmul()'s shape (the same y bits); n_out % 16 == 0. The reader's copy of out says rms_block = 16.
// Its codes and block scales are not written: no other reader may take that copy.
bool matmul_norm_half_fits(const Matrix& w, int64_t n_out, int n);
bool reads_half_norm(const Matrix& w, int n);
// Whether the backend folds that way: rows of up to 64 chunks (base's down product). H200, base tg128 x32 against
// the previous choice (the separate RMSNorm kernel for Q4_0, the Q8_0 rows at 4 warps per tile for Q8_0): q4_0
// +0.2 %, q8_0 +2.4 %; iphone q4_0 x32 (k = 12,288) -0.4 % (docs/BENCHMARKS.md, twenty-ninth session).
bool matmul_norm_half_pays(const Matrix& w, int n);
// Whether the backend folds with matmul_norm, per format and row length (chunks of 512 bytes per tile), as
// measured on the H200. Its at most 4 warps per tile cover a row of up to 16 chunks (1,024 columns of Q4_0 /
// MXFP4) in one round each; longer rows get twice the rounds per warp or more (macbook q4_0 x8 lost 6 %).
// Fifteenth session (base x2 .. x32, fold / not): Q4_0 +2 to +6 % at every size, MXFP4 +7 to +8 % at 2 and 4
// tokens and -1 to -2.5 % from 8 on. Twenty-sixth session (base tg128, after the batched SwiGLU epilogue;
// folding also the down product's 32 (Q4_0 / MXFP4) and 64 (Q8_0) chunks, and Q8_0's Wo at 24): Q8_0 x8 /
// x16 / x32 +6.4 / +5.5 / +3.4 %, MXFP4 -1 / 0 / +4.6 %, Q4_0's down +2 / -2 / 0 %. So: Q4_0 rows of up to 16
// chunks, MXFP4 up to 16 chunks at 2-4 tokens and up to 32 from 17 tokens on, Q8_0 up to 64 chunks (base's
// rows; the 3.17B and 7.19B models' are longer and keep the separate kernel). Q4_K and TQ2_0 readers take
// Q8_K rows and never fold. Thirty-ninth session (base, every fold that fits / the rule): Q4_0's down (32
// chunks) x2 +4.1 %, x3 +3.9 %, x4 / x8 +0.2-0.3 %, x16 -4 %, so Q4_0 folds rows of up to 32 chunks at 2-3
// tokens too; MXFP4 -2 to -3 % at 2-4 tokens, +3 % at 8; Q8_0 and the default model +-0.3 %.
bool matmul_norm_pays(const Matrix& w, int n);
// n >= 2 tokens through a stacked [gate; up] matrix (up's rows from up_row), written as silu(gate) * up in
// out's format (the down product's input): what matmul() then prep_act(SwiGlu) give when both run the
// same warps per tile (set_matmul_shape), in one kernel and without the gate/up rows in memory. Its tile
// sets pair 2 gate tiles (a block of 32 outputs) with the same up tiles, so it runs 2 (or 1) warps per
// tile where matmul() may take 8: the sums' order, hence float rounding, can differ from matmul()'s.
// matmul_swiglu_fits says whether it applies (not F32 rows, Q8_0 / F16 / BF16 / F32 outputs, ffn % 32 == 0);
// matmul_swiglu returns false (nothing queued) where it does not.
bool matmul_swiglu_fits(const Matrix& w, int n, int64_t ffn, int64_t up_row, ActKind out);
bool matmul_swiglu(const Matrix& w, const ActBuf& x, int n, int64_t ffn, int64_t up_row, ActBuf& out, Stream stream);
// Whether the decode steps take it for w at n tokens: more than 16 tokens and rows of at most 24 chunks (base's
// k = 768 in the int8 formats), where it was measured faster than the product plus the SwiGLU kernel.
bool matmul_swiglu_pays(const Matrix& w, int n);
// Whether a batched product of w over n tokens may read the activations' half plane (ActBuf::fh) instead of
// their Q8_0 codes (the H kernels): Q8_0 and Q4_0 rows, more than 16 tokens; of those, the launches that run
// 32-token CTAs do. Such a kernel dequantizes each k-step's weights to half once and runs two m16n8k16
// products per 8 tokens (f32 sums; the values are those gemm.cu's cuBLAS path multiplies, so the result is
// within half rounding of the int8 path's, not bit-identical). An input without the plane (fh null) takes
// the int8 kernel.
bool matmul_half_pays(const Matrix& w, int n);
// Tests: false keeps every product on the int8 kernels (matmul_half_pays answers false); true restores the rule.
void set_matmul_half(bool on);
// Tests: false runs every batched product on its kEpAny kernel (all epilogues built in); true restores the
// one-epilogue instances (matmul.cu, pick_epilogue), which must give the same bits.
void set_matmul_epilogues(bool on);
// Tests: forces the warps per tile (1, 2, 4, 8) and the token groups per CTA (1, 2, 4) of every batched
// product (clamped where an epilogue needs fewer warps per tile); 0 restores the choice per matrix.
void set_matmul_shape(int split, int nt);
// Tests: forces log2 of the warps per tile of the single-token products (clamped per variant); -1 restores
// the per-matrix choice.
void set_matvec1_split(int lsplit);
// Tests: the instance family of every single-token product (matvec1.cu, pick_instance: 0 lean, 1 mid,
// 2 general); -1 restores the per-format default. All must give the same bits.
void set_matvec1_instances(int family);

// ---- prefill-sized products through cuBLAS (gemm.cu) ----
// For steps of many tokens quantized weights are expanded chunk by chunk into row-major f16 (F16/BF16
// matrices are used as stored) and multiplied by cuBLAS with f32 accumulation; x is read from the `hi`
// plane of an ActBuf of gemm_act_kind(w), i.e. rounded to that half type (what llama.cpp's and PyTorch's
// half paths do). cuBLAS is loaded with dlopen on first use; gemm_available (cuda_api.h) says whether it
// could be.
bool gemm_supports(const Matrix& w);  // every format but F32
ActKind gemm_act_kind(const Matrix& w);
class GemmRunner {
 public:
  // chunk_bytes: most scratch bytes one expanded chunk of rows may take (0: MERLIN_CUDA_GEMM_CHUNK_MB, else 256 MiB).
  explicit GemmRunner(size_t chunk_bytes = 0) : chunk_bytes_(chunk_bytes) {}
  GemmRunner(const GemmRunner&) = delete;
  GemmRunner& operator=(const GemmRunner&) = delete;
  ~GemmRunner();
  // Same contract as matmul(); x is an ActBuf of gemm_act_kind(w). Never call it inside a graph capture
  // (the first call allocates its scratch and the cuBLAS handle).
  void run(const Matrix& w, const ActBuf& x, int n, float* d_y, int64_t ldy, int64_t n_out_rows, bool accumulate,
           Stream stream);

 private:
  size_t chunk_bytes_ = 0;
  void* handle_ = nullptr;
  uint16_t* scratch_ = nullptr;
  size_t scratch_bytes_ = 0;
};

// ---- model ops ----
// x[t][:] = dequantized row tokens[t] of a raw GGUF matrix (d_table, row_bytes apart).
void embed(DType type, const void* d_table, size_t row_bytes, int64_t dim, const int32_t* d_tokens, int n, float* d_x,
           Stream stream);

// matmul's product of n >= 2 tokens, but instead of writing y each token's largest output among the first
// n_out rows goes to d_keys[t] (an argmax key, argmax_key_row; raised with atomicMax, so zero before the
// launch): a batched greedy head without its logits' round trip through memory. F32 rows: no (fits false).
bool matmul_argmax_fits(const Matrix& w, int n);
void matmul_argmax(const Matrix& w, const ActBuf& x, int n, int64_t n_out, unsigned long long* d_keys,
                   Stream stream);

// K/V cache geometry shared by rope_kv and attention.
struct KvArgs {
  void* d_k = nullptr;             // [n_blocks * block_size][kv_dim], F16 or F32, or Q8_0 codes (int8)
  void* d_v = nullptr;
  bool f16 = true;                 // false: F32 (or Q8_0 when q8)
  int block_size = 16;
  int max_blocks = 0;              // table row length per sequence
  const int32_t* d_table = nullptr;  // [n_seq][max_blocks]
  bool q8 = false;                 // Q8_0: int8 codes in d_k / d_v, an f16 scale per 32 in d_ks / d_vs
  void* d_ks = nullptr;            // [n_blocks * block_size][kv_dim / 32] halves
  void* d_vs = nullptr;
};
// The rope_kv step done by a QKV product's epilogue (matmul_rope_kv): q_dim = n_heads * hd rows
// of Q from row 0, kv_dim rows of K from k_off and of V from v_off in the stacked matrix.
struct RopeKvArgs {
  const int32_t* d_pos = nullptr;
  const int32_t* d_seq = nullptr;
  const float* d_cos_sin = nullptr;
  int64_t q_dim = 0, kv_dim = 0, k_off = 0, v_off = 0;
  int hd = 0, n_rot = 0;
  KvArgs kv;
  int l2_positions = 0;  // single-token products: K/V rows of up to this many earlier positions asked into L2
};
// y = W x for n tokens (W the stacked QKV matrix, token t's row at d_qkv + t * ldy), then RoPE on Q and K and
// the K/V cache write, all in the product's epilogue, with the bits matmul() followed by rope_kv() would
// give: Q rows land in d_qkv (rotated), K and V rows only in the cache. False (nothing queued) for F32
// weights (the plain kernel has no such epilogue) and a Q8_0 cache (its blocks of 32 are quantized by
// rope_kv); the caller then runs the two separately. *context_l2 (when given) tells whether the product
// also asked the context's K/V rows into L2 (prefetch_kv_context: one token, r.l2_positions > 0).
bool matmul_rope_kv(const Matrix& w, const ActBuf& x, int n, float* d_qkv, int64_t ldy, const RopeKvArgs& r,
                    Stream stream, bool* context_l2 = nullptr);

// Applies RoPE to q and k of each row of qkv (q at column 0, k at k_off, v at v_off, ld apart) with the
// host-built cos/sin table ([n_ctx][n_rot/2] pairs), and writes k and v to the cache at (seq[t], pos[t]).
void rope_kv(float* d_qkv, int64_t ld, int64_t k_off, int64_t v_off, int n, const int32_t* d_pos,
             const int32_t* d_seq, const float* d_cos_sin, int n_heads, int n_kv_heads, int head_dim, int n_rot,
             const KvArgs& kv, Stream stream);
// Split-K ("flash-decoding") scratch for attention(): the positions of a long context are cut into n_split
// chunks of `chunk` positions, one CTA each, whose partial softmax sums meet in `partial` and are combined by
// the last CTA to finish (counted in `counter`, which that CTA resets to 0). Sized from n_ctx alone, so a
// graph captured once stays valid while positions grow. Allocate before any graph capture.
struct AttnScratch {
  float* partial = nullptr;  // [max_tokens][n_heads][n_split][head_dim + 2]: max, sum of exp, unnormalised V sum
  int* counter = nullptr;    // [max_tokens][n_heads], zero between calls
  int n_split = 1;           // 1: nothing allocated, attention runs unsplit
  int chunk = 0;             // positions per split
  int max_tokens = 0, n_heads = 0, head_dim = 0, n_ctx = 0;
};
AttnScratch attention_scratch_alloc(int max_tokens, int n_heads, int head_dim, int n_ctx);
void attention_scratch_free(AttnScratch& s);
// out[t][h * hd ..] = softmax(q_h . K^T / sqrt(hd)) V over positions 0..pos[t] of seq[t]. With a scratch of
// several splits and n <= scratch->max_tokens the positions are split; a token with pos[t] < chunk still gets
// the unsplit result bit for bit. Without (null, or a larger batch) every (head, token) is one CTA.
// context_l2: the QKV product already asked the K/V rows into L2 (matmul_rope_kv's *context_l2), so the
// kernel does not prefetch them itself. one_pass: every token's pos[t] < attention_one_pass_positions (the
// caller knows; a graph captured with it is valid only while that holds), the same bits from shorter code.
void attention(const float* d_qkv, int64_t ld, int64_t k_off, int n, const int32_t* d_pos, const int32_t* d_seq,
               int n_heads, int n_kv_heads, int head_dim, int n_ctx, const KvArgs& kv, float* d_out, Stream stream,
               const AttnScratch* scratch = nullptr, ActBuf* out_act = nullptr, bool context_l2 = false,
               bool one_pass = false);
// Positions (from 0) whose attention the kernel's plain instance does in one pass of its loads.
int attention_one_pass_positions(int head_dim, const KvArgs& kv);
// Whether attention() can also write its output as the next product's input (out_act, row length
// n_heads * head_dim, the codes a Plain prep_act would write): Q8_0 blocks (head_dim % 32 == 0), F16, BF16.
bool attention_emits(ActKind kind, int head_dim);
void attention_prepare(int n_ctx);  // raises the kernel's shared-memory limit for n_ctx positions

// Tiled tensor-core attention for prefill-sized steps (flash_attention.cu): a tile is up to 64 batch tokens
// first .. first + count - 1 of one sequence at positions pos0 .. pos0 + count - 1. Same result as attention()
// up to f16 rounding of the softmax weights (and, with a Q8_0 cache, of the dequantized K/V); needs an f16
// or Q8_0 cache and a head size of 32, 64 or 128.
struct AttnTile {
  int32_t first, count, seq, pos0;
};
// Cuts a batch into tiles (runs of one sequence at consecutive positions); out needs room for n tiles.
int make_attention_tiles(const int32_t* pos, const int32_t* seq, int n, AttnTile* out);
bool flash_attention_supported(int head_dim, const KvArgs& kv);
void flash_attention(const float* d_qkv, int64_t ld, const AttnTile* d_tiles, int n_tiles, int n_heads, int n_kv_heads,
                     int head_dim, const KvArgs& kv, float* d_out, Stream stream);

// ---- sampling ----
// d_out[r] = index of the largest of the n values of row r (rows ld floats apart), the lowest index on ties:
// what argmax() in runtime/sampler.h returns for the same row.
void argmax_rows(const float* d_logits, int64_t ld, int n_rows, int64_t n, int32_t* d_out, Stream stream);
// sample_row (runtime/row_sampling.h) for each of n_rows rows (ld floats apart, n values) with d_rows[r] and
// its entries of d_adjust: d_out[r] = the token. The adjustments are applied to the rows in place. Its first
// kernel is launched without programmatic dependent launch (it follows a graph replay). With d_work
// (sample_rows_work_bytes(n_rows, n) bytes) each row is cut into slices on many CTAs; without, one CTA per
// row does it all (slower: tens of microseconds a row).
// With d_work, a row whose filters keep more tokens than the device's merged candidates and no top-k (top-p
// alone on a flat row, min-p keeping thousands) is left as kSampleMore: once the ids are read back, call
// sample_rows_more with the same arguments for those rows (a few more passes over their logits). -1: the
// host must finish the row (sample_row on its adjusted logits).
constexpr int32_t kSampleMore = -2;
size_t sample_rows_work_bytes(int n_rows, int64_t n);
// d_ids[t] = argmax_key_row(d_keys[t]) for n keys (matmul_argmax's), which are zeroed for the next use.
void argmax_keys_to_ids(unsigned long long* d_keys, int n, int32_t* d_ids, Stream stream);
void sample_rows(float* d_logits, int64_t ld, int n_rows, int64_t n, const RowSampling* d_rows,
                 const LogitAdjust* d_adjust, int32_t* d_out, Stream stream, void* d_work = nullptr);
void sample_rows_more(const float* d_logits, int64_t ld, int n_rows, int64_t n, const RowSampling* d_rows,
                      int32_t* d_out, Stream stream, void* d_work);

// ---- decode loops ----
// A run of one-token steps of one sequence replayed on the device without the host (CudaBackend's decode
// loops, a graph while node over an even number of steps): every step reads its token, position, sequence
// and logits row here. The first layer's preparation (PrepArgs::chain) takes the step's token from the
// previous step's result (its fused argmax key, or the token slot argmax_rows / sample_rows wrote) and, in
// one thread, records that id, moves to the next position and sets the loop's condition. Step i's fused
// argmax goes to key[i & 1], so the preparation of step i + 1 reads key[i & 1] in all its CTAs while one of
// them zeroes key[(i + 1) & 1] for its own head; positions alternate the same way.
constexpr int kChainMax = 64;  // most steps per loop launch
struct ChainState {
  int32_t token, seq, row;       // the step's input (token: the host's first, or argmax_rows' / sample_rows' id)
  int32_t pos[2];                // step i's position is pos[i & 1]: kernels read it before their pdl_wait, so
                                 // step i's preparation writes step i + 1's, never the one its step reads
  unsigned long long key[2];     // fused argmax keys by step parity; the host puts its first token in key[1]
  int32_t i, k;                  // steps begun, steps to run (even, 2 .. kChainMax)
  int32_t fused;                 // ids come from key[], else from token
  int32_t stopped;               // a step's id was negative (a draw left to the host): no further iteration
  int32_t ids[kChainMax];        // ids[i] of step i, written by step i + 1 (the last one stays in key / token)
  RowSampling cur;               // the running step's draw (sampled loops: sample_rows reads it)
  RowSampling rows[kChainMax];   // every step's draw
};
// A batched decode loop's state (CudaBackend::run_batch_loop): n rows (sequences) decoding together, each
// step's ids the next step's tokens (the head's argmax writes tokens[], which the next step's preparation
// reads after its wait). As in ChainState, what a step's kernels read before pdl_wait alternates by step
// parity: step i reads pos[i & 1] and i_[i & 1]; its preparation writes pos[(i + 1) & 1], i_[(i + 1) & 1] and
// ids[i - 1] (the step's own tokens, step i - 1's ids), so the last step's ids stay in tokens[].
constexpr int kBatchChainRows = 32;
struct BatchChainState {
  int32_t tokens[kBatchChainRows];
  int32_t pos[2][kBatchChainRows];
  int32_t seq[kBatchChainRows];
  int32_t rows[kBatchChainRows];  // the logits rows: 0 .. n - 1
  int32_t i_[2];                  // steps begun, by parity
  int32_t k;                      // steps to run (a multiple of the unroll, 2 .. kChainMax)
  int32_t ids[kChainMax][kBatchChainRows];
};

// The key whose argmax_key_row is `token` (a loop's first token, seeded into key[1]).
inline unsigned long long chain_token_key(int32_t token) {
  return (1ull << 32) | (0xFFFFFFFFu - (uint32_t)token);
}

void check_launch(const char* what);  // throws merlin::Error if the last launch failed

}  // namespace merlin::cuda
