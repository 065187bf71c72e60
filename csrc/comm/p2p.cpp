#include "comm/p2p.h"

#include <ATen/ATen.h>
#include <c10/util/irange.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <numeric>
#include <sstream>

#include "comm/coalescing.h"

namespace tpcore {
namespace {

using WorkPtr = c10::intrusive_ptr<c10d::Work>;

constexpr int64_t kMaxTag = 1 << 16;
// Headers travel on their own tags so that, on gloo, they can never be matched with a payload.
constexpr int64_t kHeaderTagOffset = kMaxTag;
constexpr int64_t kMaxDims = 8;
// magic, dtype, ndim, dims...
constexpr int64_t kHeaderLen = 3 + kMaxDims;
constexpr int64_t kMagic = 0x7470636f726570;  // "tpcorep"

std::string shape_str(at::IntArrayRef shape) {
  std::ostringstream out;
  out << "[";
  for (const auto i : c10::irange(shape.size())) out << (i ? ", " : "") << shape[i];
  out << "]";
  return out.str();
}

// Names as Python spells them (torch.float32), for the common activation dtypes.
std::string dtype_str(at::ScalarType dtype) {
  switch (dtype) {
    case at::kFloat:
      return "float32";
    case at::kDouble:
      return "float64";
    case at::kHalf:
      return "float16";
    case at::kBFloat16:
      return "bfloat16";
    default:
      return c10::toString(dtype);
  }
}

std::string describe(at::IntArrayRef shape, at::ScalarType dtype) {
  return shape_str(shape) + " " + dtype_str(dtype);
}

// Issue order: by (peer, tag), the same on both ends of every link.
template <typename Op>
std::vector<size_t> issue_order(const std::vector<Op>& ops) {
  std::vector<size_t> order(ops.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return std::tie(ops[a].peer, ops[a].tag) < std::tie(ops[b].peer, ops[b].tag);
  });
  return order;
}

void check_peer(const Group& group, int64_t peer, int64_t tag, const std::string& what) {
  const int size = group->getSize(), rank = group->getRank();
  TORCH_CHECK_VALUE(peer >= 0 && peer < size && peer != rank, "tpcore: pipeline: ", what, ": peer ",
                    peer, " is not another rank of the pipeline group of size ", size,
                    " (this rank is ", rank, ")");
  TORCH_CHECK_VALUE(tag >= 0 && tag < kMaxTag, "tpcore: pipeline: ", what, ": tag ", tag,
                    " is outside [0, ", kMaxTag, ")");
}

// Messages posted and not yet waited on, each with what it is for errors (a dead peer
// surfaces as a failed wait). With `coalesce_on` (NCCL: CUDA) they form one group and one
// work; the group is closed even when posting a message throws (CoalescingGuard).
class InFlight {
 public:
  InFlight(const Group& group, std::optional<c10::DeviceType> coalesce_on) : group_(group) {
    if (coalesce_on) coalescing_.emplace(group_, *coalesce_on);
  }

  void send(const at::Tensor& t, int64_t peer, int64_t tag, const std::string& what) {
    std::vector<at::Tensor> one{t};
    add(group_->send(one, static_cast<int>(peer), static_cast<int>(tag)),
        "sending " + what + " to pipeline rank " + std::to_string(peer));
  }

  void recv(const at::Tensor& t, int64_t peer, int64_t tag, const std::string& what) {
    std::vector<at::Tensor> one{t};
    add(group_->recv(one, static_cast<int>(peer), static_cast<int>(tag)),
        "receiving " + what + " from pipeline rank " + std::to_string(peer));
  }

  void wait() {
    if (coalescing_) {
      works_ = {coalescing_->end()};
      whats_ = {"a coalesced batch of pipeline messages"};
      coalescing_.reset();
    }
    for (const auto i : c10::irange(works_.size())) {
      if (!works_[i]) continue;
      try {
        works_[i]->wait();
      } catch (const c10::Error& e) {
        TORCH_CHECK(false, "tpcore: pipeline rank ", group_->getRank(), ": ", whats_[i],
                    " failed: ", e.what_without_backtrace());
      } catch (const std::exception& e) {  // gloo's I/O errors (a dead peer) are not c10 errors
        TORCH_CHECK(false, "tpcore: pipeline rank ", group_->getRank(), ": ", whats_[i],
                    " failed: ", e.what());
      }
    }
    works_.clear();
    whats_.clear();
  }

 private:
  void add(WorkPtr work, std::string what) {
    works_.push_back(std::move(work));
    whats_.push_back(std::move(what));
  }

  Group group_;
  std::optional<CoalescingGuard> coalescing_;
  std::vector<WorkPtr> works_;
  std::vector<std::string> whats_;
};

// The headers of `sends` [k, kHeaderLen], on `device`: filled on the host (in pinned memory
// for a GPU) and copied in one non-blocking copy, so the host does not wait for the stream.
at::Tensor make_headers(const std::vector<P2PSend>& sends, at::Device device) {
  at::Tensor h = at::zeros({static_cast<int64_t>(sends.size()), kHeaderLen},
                           at::TensorOptions().dtype(at::kLong).pinned_memory(device.is_cuda()));
  int64_t* v = h.data_ptr<int64_t>();
  for (const auto& s : sends) {
    v[0] = kMagic;
    v[1] = static_cast<int64_t>(s.tensor.scalar_type());
    v[2] = s.tensor.dim();
    for (const auto d : c10::irange(s.tensor.dim())) v[3 + d] = s.tensor.size(d);
    v += kHeaderLen;
  }
  return device.is_cpu() ? h : h.to(device, /*non_blocking=*/true);
}

// Raises unless the header received for `recv` announces exactly the expected tensor.
// `v`: the header's kHeaderLen values on the host.
void check_header(const int64_t* v, const P2PRecv& recv, at::ScalarType dtype, int rank) {
  TORCH_CHECK_VALUE(v[0] == kMagic, "tpcore: pipeline rank ", rank, ": ", recv.what,
                    ": pipeline rank ", recv.peer,
                    " sent something that is not a tpcore pipeline header (do all ranks run "
                    "the same schedule with shape checks on?)");
  const int64_t ndim = v[2];
  TORCH_CHECK_VALUE(ndim >= 0 && ndim <= kMaxDims, "tpcore: pipeline rank ", rank, ": ", recv.what,
                    ": corrupt header from pipeline rank ", recv.peer);
  std::vector<int64_t> got(v + 3, v + 3 + ndim);
  const auto got_dtype = static_cast<at::ScalarType>(v[1]);
  TORCH_CHECK_VALUE(got == recv.shape && got_dtype == dtype, "tpcore: pipeline rank ", rank, ": ",
                    recv.what, ": expected ", describe(recv.shape, dtype), " but pipeline rank ",
                    recv.peer, " sent ", describe(got, got_dtype));
}

}  // namespace

std::vector<at::Tensor> batch_isend_irecv_on(const Group& group, const std::vector<P2PSend>& sends,
                                             const std::vector<P2PRecv>& recvs,
                                             at::ScalarType dtype, at::Device device,
                                             bool check_shapes,
                                             std::optional<c10::DeviceType> coalesce_on) {
  TORCH_CHECK_VALUE(group, "tpcore: pipeline: process group is null");
  // Validate everything before the first message, so bad input raises without a peer waiting.
  for (const auto& s : sends) {
    check_peer(group, s.peer, s.tag, s.what);
    TORCH_CHECK_VALUE(s.tensor.defined(), "tpcore: pipeline: ", s.what, ": tensor is undefined");
    TORCH_CHECK_VALUE(s.tensor.device().type() == device.type(), "tpcore: pipeline: ", s.what,
                      ": tensor is on ", s.tensor.device(), ", the batch is on ", device);
    TORCH_CHECK_VALUE(!check_shapes || s.tensor.dim() <= kMaxDims, "tpcore: pipeline: ", s.what,
                      ": at most ", kMaxDims, " dims are supported, got ", s.tensor.dim());
  }
  for (const auto& r : recvs) {
    check_peer(group, r.peer, r.tag, r.what);
    TORCH_CHECK_VALUE(static_cast<int64_t>(r.shape.size()) <= kMaxDims,
                      "tpcore: pipeline: ", r.what, ": at most ", kMaxDims, " dims are supported");
    for (const auto d : r.shape)
      TORCH_CHECK_VALUE(d >= 0, "tpcore: pipeline: ", r.what, ": bad shape ", shape_str(r.shape));
  }
  const auto send_order = issue_order(sends);
  const auto recv_order = issue_order(recvs);
  const int rank = group->getRank();
  std::vector<at::Tensor> out(recvs.size());
  auto payload_buffer = [&](size_t i) {
    out[i] = at::empty(recvs[i].shape, at::TensorOptions().device(device).dtype(dtype));
    return out[i];
  };
  // Received headers land in one tensor, read back to the host in one copy.
  const at::Tensor headers = at::empty({static_cast<int64_t>(recvs.size()), kHeaderLen},
                                       at::TensorOptions().device(device).dtype(at::kLong));
  auto header_buffer = [&](size_t i) { return headers[static_cast<int64_t>(i)]; };
  auto check_headers = [&] {
    const at::Tensor host = headers.to(at::kCPU);  // waits for the receives, once per batch
    for (const auto i : recv_order)
      check_header(host.data_ptr<int64_t>() + i * kHeaderLen, recvs[i], dtype, rank);
  };

  // Sends first: they never wait for anything of this rank, so a peer that needs them to
  // make progress gets them (the property that keeps the fused exchanges deadlock-free).
  const at::Tensor sent_headers = check_shapes ? make_headers(sends, device) : at::Tensor();
  InFlight sent(group, coalesce_on);
  for (const auto i : send_order) {
    const auto& s = sends[i];
    if (check_shapes)
      sent.send(sent_headers[static_cast<int64_t>(i)], s.peer, s.tag + kHeaderTagOffset,
                "the header of " + s.what);
    sent.send(s.tensor.contiguous(), s.peer, s.tag, s.what);
  }
  if (coalesce_on) {
    // NCCL: everything in one group. A header is checked once the group is done, which
    // catches a wrong shape or dtype of the same byte size; a wrong size is NCCL's to report.
    for (const auto i : recv_order) {
      const auto& r = recvs[i];
      if (check_shapes)
        sent.recv(header_buffer(i), r.peer, r.tag + kHeaderTagOffset, "the header of " + r.what);
      sent.recv(payload_buffer(i), r.peer, r.tag, r.what);
    }
    sent.wait();
    if (check_shapes && !recvs.empty()) check_headers();
    return out;
  }
  // gloo: a payload is received only after its header matched, so a wrong size raises
  // here instead of aborting the process inside gloo.
  if (check_shapes) {
    InFlight announced(group, std::nullopt);
    for (const auto i : recv_order)
      announced.recv(header_buffer(i), recvs[i].peer, recvs[i].tag + kHeaderTagOffset,
                     "the header of " + recvs[i].what);
    announced.wait();
    if (!recvs.empty()) check_headers();
  }
  InFlight received(group, std::nullopt);
  for (const auto i : recv_order)
    received.recv(payload_buffer(i), recvs[i].peer, recvs[i].tag, recvs[i].what);
  received.wait();
  sent.wait();
  return out;
}

std::vector<at::Tensor> batch_isend_irecv(const Group& group, const std::vector<P2PSend>& sends,
                                          const std::vector<P2PRecv>& recvs, at::ScalarType dtype,
                                          at::Device device, bool check_shapes) {
  // NCCL matches a pair's messages in issue order within one group; gloo by tag.
  return batch_isend_irecv_on(
      group, sends, recvs, dtype, device, check_shapes,
      device.is_cuda() ? std::optional(c10::DeviceType::CUDA) : std::nullopt);
}

bool release_storage(const at::Tensor& tensor) {
  if (!tensor.defined() || tensor.is_view() || tensor.numel() <= 1) return false;
  tensor.set_data(at::empty({1}, tensor.options()));
  return true;
}

void backward_from(const at::Tensor& output, const std::optional<at::Tensor>& grad) {
  TORCH_CHECK_VALUE(output.requires_grad(),
                    "tpcore: pipeline backward: the stage output does not require grad");
  torch::autograd::Edge root = torch::autograd::impl::gradient_edge(output);
  at::Tensor g = grad.has_value() ? *grad : at::ones_like(output);
  torch::autograd::Engine::get_default_engine().execute({root}, {g}, /*keep_graph=*/false,
                                                        /*create_graph=*/false,
                                                        /*accumulate_grad=*/true);
}

}  // namespace tpcore
