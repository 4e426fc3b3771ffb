"""torchrun's script in the distributed fault test: `cifarkit ARGS`, in which rank 1 sends itself SIGABRT (as a C++
std::terminate would) at the third step of its second epoch, on the group's first attempt only (the attempt torchrun
restarts runs unharmed).

    python -m torch.distributed.run --nproc-per-node 2 --max-restarts 1 dist_fault_child.py train ... --out RUN
"""
import os
import signal
import sys

from cifarkit.cli import main
from cifarkit.training import train

real_train_one_epoch, epochs_started = train.train_one_epoch, [0]


def train_one_epoch(state, batches, *args, **kwargs):
    epochs_started[0] += 1

    def killing(batches):
        for step, batch in enumerate(batches, 1):
            if step == 3 and epochs_started[0] == 2:
                os.kill(os.getpid(), signal.SIGABRT)
            yield batch
    return real_train_one_epoch(state, killing(batches), *args, **kwargs)


if os.environ["RANK"] == "1" and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
    train.train_one_epoch = train_one_epoch
sys.exit(main(sys.argv[1:]))
