// The float32 CPU decode kernels of mcserve, one file per kind of op; ops.cpp binds them into
// the extension (with lowp.h's and sampling.h's). Each op has a torch twin with the same
// signature in twins.py; the comment above each definition says what it computes. Only
// torch/types.h here (no pybind11, no torch/all.h): the op files compile in a fraction of the
// time torch/extension.h takes; ops.cpp, which binds, includes that.
#pragma once

#include <torch/types.h>

#include <cstdint>
#include <vector>

namespace mcserve_ops {

// gemv.cpp: the float32 matrix-vector product, y (B, O) = x (B, I) · W (O, I)ᵀ + bias
torch::Tensor gemv(const torch::Tensor& x, const torch::Tensor& W,
                   const c10::optional<torch::Tensor>& bias);

// scan.cpp: gated linear attention, one token in place and a span token by token
torch::Tensor linear_step_(torch::Tensor S, const torch::Tensor& q, const torch::Tensor& k,
                           const torch::Tensor& v, const c10::optional<torch::Tensor>& log_a,
                           const c10::optional<torch::Tensor>& b);
std::vector<torch::Tensor> linear_scan(const torch::Tensor& q, const torch::Tensor& k,
                                       const torch::Tensor& v,
                                       const c10::optional<torch::Tensor>& log_a,
                                       const c10::optional<torch::Tensor>& b,
                                       const torch::Tensor& S0, int64_t every, bool restart);

// steps.cpp: one token of the delta rule, RWKV-7 and vector-gated linear attention, in place
torch::Tensor delta_step_(torch::Tensor S, const torch::Tensor& q, const torch::Tensor& k,
                          const torch::Tensor& v, const c10::optional<torch::Tensor>& log_a,
                          const c10::optional<torch::Tensor>& beta);
torch::Tensor rwkv7_step_(torch::Tensor S, const torch::Tensor& r, const torch::Tensor& k,
                          const torch::Tensor& v, const torch::Tensor& a, const torch::Tensor& b,
                          const torch::Tensor& log_w);
torch::Tensor gla_vec_step_(torch::Tensor S, const torch::Tensor& q, const torch::Tensor& k,
                            const torch::Tensor& v, const c10::optional<torch::Tensor>& log_a,
                            const c10::optional<torch::Tensor>& b);

// readout.cpp: reads of the paged pools (state blocks, attention keys and values), MC routing
torch::Tensor readout_paged(const torch::Tensor& pool, const torch::Tensor& ids,
                            const torch::Tensor& q, const torch::Tensor& w);
torch::Tensor paged_attention_decode(const torch::Tensor& q, const torch::Tensor& k_pool,
                                     const torch::Tensor& v_pool, const torch::Tensor& tables,
                                     const torch::Tensor& lengths, double scale);
torch::Tensor topk_later(const torch::Tensor& r, int64_t k);
std::vector<torch::Tensor> select_softmax(const torch::Tensor& r, const torch::Tensor& visible,
                                          const torch::Tensor& r_on, int64_t k);
torch::Tensor dense_softmax_(torch::Tensor r, const torch::Tensor& visible,
                             const torch::Tensor& r_on);
torch::Tensor readout_picks(const torch::Tensor& S, const torch::Tensor& q,
                            const torch::Tensor& idx, const torch::Tensor& w);
torch::Tensor mc_scores_(torch::Tensor seg_ksum, const torch::Tensor& k, const torch::Tensor& u,
                         const torch::Tensor& seg_len, const torch::Tensor& ksum_pool,
                         const torch::Tensor& table, int64_t segment_len);
torch::Tensor mc_step_readout_(torch::Tensor S, const torch::Tensor& q, const torch::Tensor& k,
                               const torch::Tensor& v, const c10::optional<torch::Tensor>& log_a,
                               const c10::optional<torch::Tensor>& b, const torch::Tensor& w_on,
                               const torch::Tensor& pool, const torch::Tensor& ids,
                               const torch::Tensor& w_c);

// blocks.cpp: whole blocks of a decode step, and the conv and norm they share
torch::Tensor conv_span(const torch::Tensor& tail, const torch::Tensor& x,
                        const torch::Tensor& weight, const c10::optional<torch::Tensor>& bias,
                        bool silu);
torch::Tensor conv_step_(torch::Tensor tail, const torch::Tensor& x, const torch::Tensor& weight,
                         const c10::optional<torch::Tensor>& bias, bool apply_silu);
torch::Tensor rms_norm(const torch::Tensor& x, const c10::optional<torch::Tensor>& weight,
                       double eps, int64_t group, const c10::optional<torch::Tensor>& z,
                       bool norm_before_gate);
torch::Tensor silu_mul(const torch::Tensor& gate, const torch::Tensor& up);
torch::Tensor l2norm_(torch::Tensor x, int64_t group);
torch::Tensor native_block_decode_(
    const torch::Tensor& x, double eps, const torch::Tensor& norm1_w, const torch::Tensor& W_in,
    const c10::optional<torch::Tensor>& s_in, const c10::optional<torch::Tensor>& b_in,
    const c10::optional<torch::Tensor>& conv_w, const torch::Tensor& out_norm_w, double out_eps,
    const torch::Tensor& W_o, const c10::optional<torch::Tensor>& s_o,
    const torch::Tensor& norm2_w, const torch::Tensor& W_up,
    const c10::optional<torch::Tensor>& s_up, const torch::Tensor& W_down,
    const c10::optional<torch::Tensor>& s_down, int64_t H, int64_t K, bool use_u,
    bool has_decay, bool has_write, torch::Tensor S, c10::optional<torch::Tensor> conv_tail,
    torch::Tensor seg_ksum, const torch::Tensor& seg_len, const torch::Tensor& table,
    const torch::Tensor& pool, const torch::Tensor& ksum_pool, int64_t segment_len,
    int64_t variant, int64_t top_k, const c10::optional<torch::Tensor>& top_k_rows,
    const c10::optional<torch::Tensor>& host_pool, int64_t host_base);
torch::Tensor mamba2_block_decode_(
    const torch::Tensor& x, const torch::Tensor& norm_w, double eps, const torch::Tensor& W_in,
    const c10::optional<torch::Tensor>& s_in, const c10::optional<torch::Tensor>& b_in,
    const torch::Tensor& conv_w, const c10::optional<torch::Tensor>& conv_b,
    const torch::Tensor& dt_bias, const torch::Tensor& A_log, double dt_min, double dt_max,
    const torch::Tensor& Dskip, const c10::optional<torch::Tensor>& gnorm_w, double gnorm_eps,
    bool norm_before_gate, const torch::Tensor& W_out, const c10::optional<torch::Tensor>& s_out,
    const c10::optional<torch::Tensor>& b_out, int64_t H, int64_t P, int64_t N, int64_t G,
    torch::Tensor S, torch::Tensor conv_tail);

}  // namespace mcserve_ops
