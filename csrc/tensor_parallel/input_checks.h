// The switch for the input checks that read values (token ids and targets in range). They
// cost a device-to-host copy and a host wait per call on CUDA, and they cannot run while a
// CUDA graph is captured; the ones that read only shapes, dtypes and devices always run.
#pragma once

#include <string>

namespace at {
class Tensor;
}

namespace tpcore {

// On by default; TPCORE_CHECK_INPUTS=0 in the environment turns them off at import.
void set_input_checks(bool enabled);
bool input_checks_enabled();
// Whether to read `t`'s values for a check now: checks are on, and `t` is not on a CUDA
// device whose current stream is capturing a graph (reading values there would fail).
bool should_check_values(const at::Tensor& t);
// "0, 2": the indices of `column`'s nonzero entries (a rank's flag in a gathered check).
std::string ranks_where(const at::Tensor& column);

}  // namespace tpcore
