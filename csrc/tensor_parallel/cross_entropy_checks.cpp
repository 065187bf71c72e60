// The checks the TP ranks make together through the cross-entropy forward's all-gather:
// an invalid option or target on one rank, or ranks that split the vocabulary differently,
// make every rank raise alike instead of one rank raising while the others wait in the
// collective (or all of them computing a wrong loss).
#include <ATen/ATen.h>

#include <string>
#include <vector>

#include "tensor_parallel/cross_entropy.h"
#include "tensor_parallel/input_checks.h"

namespace tpcore {
namespace {

// Columns of the two rows (flattened to 8): what the ranks must agree on, then flags.
enum Column {
  kLocalVocab,
  kVocabSize,
  kLabelSmoothing,
  kZLoss,
  kIgnoreIndex,
  kChecksOn,
  kBadOption,
  kBadTarget
};
const char* const kAgreed[] = {"the local vocabulary (logits' last dim)",
                               "vocab_size",
                               "label_smoothing",
                               "z_loss",
                               "ignore_index",
                               "input checks (tpcore.set_input_checks / TPCORE_CHECK_INPUTS)"};

std::string option_problem(const char* what, int64_t local_vocab, int64_t world,
                           const CrossEntropyOptions& o) {
  if (!(o.vocab_size >= 1 && o.vocab_size <= local_vocab * world))
    return c10::str("tpcore: ", what, ": vocab_size ", o.vocab_size, " must be in [1, ",
                    local_vocab * world, "] (local vocab ", local_vocab, " x ", world, " ranks)");
  if (!(o.label_smoothing >= 0.0 && o.label_smoothing <= 1.0))
    return c10::str("tpcore: ", what, ": label_smoothing must be in [0, 1], got ",
                    o.label_smoothing);
  if (!(o.z_loss >= 0.0))
    return c10::str("tpcore: ", what, ": z_loss must be >= 0, got ", o.z_loss);
  return "";
}

}  // namespace

RankCheck start_rank_check(const char* what, const at::Tensor& stats, const at::Tensor& target,
                           int64_t local_vocab, int64_t world, const CrossEntropyOptions& o) {
  RankCheck check;
  check.on = should_check_values(stats);
  check.problem = option_problem(what, local_vocab, world, o);
  if (!check.on) {
    TORCH_CHECK_VALUE(check.problem.empty(), check.problem);
    check.rows = at::zeros({2, 4}, stats.options());  // nothing to carry; the shape is what matters
    return check;
  }
  const std::vector<float> values = {float(local_vocab),
                                     float(o.vocab_size),
                                     float(o.label_smoothing),
                                     float(o.z_loss),
                                     float(o.ignore_index),
                                     1.f,
                                     check.problem.empty() ? 0.f : 1.f,
                                     0.f};
  // Pinned and copied without blocking on a GPU: no host sync here.
  const at::Tensor host =
      at::tensor(values, at::TensorOptions().dtype(at::kFloat).pinned_memory(stats.is_cuda()));
  check.rows = host.to(stats.device(), stats.scalar_type(), /*non_blocking=*/true).view({2, 4});
  check.bad = (target != o.ignore_index) & ((target < 0) | (target >= o.vocab_size));
  if (target.numel() > 0) check.rows.view({8})[kBadTarget].copy_(check.bad.any());  // on the device
  return check;
}

void finish_rank_check(const char* what, const RankCheck& check, const at::Tensor& gathered,
                       const at::Tensor& target, const CrossEntropyOptions& o) {
  if (!check.on) return;
  const at::Tensor rows = gathered.reshape({gathered.size(0), 8}).to(at::kDouble).cpu();
  // An invalid option anywhere first: it also explains values that differ.
  if (rows.select(1, kBadOption).ne(0).any().item<bool>()) {
    TORCH_CHECK_VALUE(check.problem.empty(), check.problem);
    TORCH_CHECK_VALUE(false, "tpcore: ", what, ": invalid options on tensor-parallel rank(s) ",
                      ranks_where(rows.select(1, kBadOption)), " (their error names them)");
  }
  if (rows.select(1, kBadTarget).ne(0).any().item<bool>()) {
    if (check.bad.defined() && check.bad.any().item<bool>()) {
      TORCH_CHECK_INDEX(false, "tpcore: ", what, ": target ",
                        target.masked_select(check.bad)[0].item<int64_t>(), " is out of range [0, ",
                        o.vocab_size, ") and is not ignore_index (", o.ignore_index, ")");
    }
    TORCH_CHECK_INDEX(false, "tpcore: ", what, ": tensor-parallel rank(s) ",
                      ranks_where(rows.select(1, kBadTarget)),
                      " have a target out of range (their error names it)");
  }
  // Checks first: a rank that does not check sends zeros for everything.
  for (const int k : {kChecksOn, kLocalVocab, kVocabSize, kLabelSmoothing, kZLoss, kIgnoreIndex}) {
    const at::Tensor col = rows.select(1, k);
    if (col.eq(col[0]).all().item<bool>()) continue;
    std::string values;
    for (int64_t r = 0; r < rows.size(0); ++r)
      values +=
          (r ? ", rank " : "rank ") + std::to_string(r) + ": " + c10::str(col[r].item<double>());
    TORCH_CHECK_VALUE(false, "tpcore: ", what, ": the tensor-parallel ranks disagree on ",
                      kAgreed[k], " (", values,
                      "); every rank must pass its own equal shard and the same options");
  }
}

}  // namespace tpcore
