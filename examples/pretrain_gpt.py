"""GPT pretraining with tensor and data parallelism; launch with torchrun.

    torchrun --nproc_per_node 2 examples/pretrain_gpt.py --tensor-parallel-size 2 \
        --data-path data/fortunes_text_document --save checkpoints/gpt [--config gpt.yaml]

`--help` lists every flag (Megatron-style names); `tpcore.train` holds the loop.
"""

import sys

from tpcore.train import main

if __name__ == "__main__":
    sys.exit(main())
