"""`eager_only`: functions that torch.compile runs eagerly, behind one graph break."""

from __future__ import annotations

import torch

# torch's own lazy form of torch.compiler.disable (dynamo graph-breaks on it the same way),
# which imports torch._dynamo at the first call instead of at import (2 s of CPU a process
# that never compiles would pay); the public decorator where a torch lacks it.
eager_only = getattr(torch, "_disable_dynamo", torch.compiler.disable)
