"""A Horovod elastic training script (hvd.elastic.run, TorchState, ElasticSampler, commits,
reset callbacks), after Horovod's elastic examples; only the import is changed.

Run:  torsh-dist horovodrun -np 2 --reset-limit 2 python examples/horovod/pytorch_mnist_elastic.py

Fault injection for the tests: ``--kill-once FILE --kill-rank R --kill-at-epoch E --kill-at-batch B``
makes rank R kill itself with SIGKILL when it reaches that batch, once (FILE records that it
happened). The launcher then restarts every worker, and training continues from the last
``state.commit()`` instead of from the start. The final line prints a checksum of the weights:
with no dropout and a deterministic sampler, it equals the checksum of a run that was never
interrupted.
"""

# Kept in the style of Horovod's examples (super(Net, self), str.format), as a user's script would be.
# ruff: noqa: UP004, UP008, UP032

import argparse
import os
import signal

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
import torch.utils.data

import torsh_distributed.compat.horovod.torch as hvd  # was: import horovod.torch as hvd

parser = argparse.ArgumentParser(description="PyTorch MNIST elastic example")
parser.add_argument("--batch-size", type=int, default=32, help="input batch size")
parser.add_argument("--epochs", type=int, default=2, help="number of epochs to train")
parser.add_argument("--lr", type=float, default=0.05, help="learning rate for a single worker")
parser.add_argument("--momentum", type=float, default=0.5, help="SGD momentum")
parser.add_argument("--seed", type=int, default=42, help="random seed")
parser.add_argument("--batches-per-commit", type=int, default=4,
                    help="number of batches processed before calling `state.commit()`")
parser.add_argument("--train-samples", type=int, default=1024,
                    help="size of the synthetic training set")
parser.add_argument("--kill-once", default=None, help="fault injection: flag file (see above)")
parser.add_argument("--kill-rank", type=int, default=1)
parser.add_argument("--kill-at-epoch", type=int, default=1)
parser.add_argument("--kill-at-batch", type=int, default=5)


def synthetic_mnist(num_samples, seed):
    """MNIST-shaped tensors: noise plus a bright stripe whose row says the label."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 10, (num_samples,), generator=g)
    images = torch.rand(num_samples, 1, 28, 28, generator=g) * 0.6
    for row in range(10):
        images[labels == row, :, 4 + 2 * row:6 + 2 * row, :] += 0.4
    return torch.utils.data.TensorDataset((images - 0.1307) / 0.3081, labels)


class Net(nn.Module):
    def __init__(self):
        super(Net, self).__init__()
        self.conv1 = nn.Conv2d(1, 10, kernel_size=5)
        self.conv2 = nn.Conv2d(10, 20, kernel_size=5)
        self.fc1 = nn.Linear(320, 50)
        self.fc2 = nn.Linear(50, 10)

    def forward(self, x):
        x = F.relu(F.max_pool2d(self.conv1(x), 2))
        x = F.relu(F.max_pool2d(self.conv2(x), 2))
        x = F.relu(self.fc1(x.view(-1, 320)))
        return F.log_softmax(self.fc2(x), dim=1)


def maybe_kill(epoch, batch):
    """Fault injection: SIGKILL this worker once, at the chosen batch of the chosen rank."""
    if (args.kill_once and hvd.rank() == args.kill_rank and epoch == args.kill_at_epoch
            and batch == args.kill_at_batch and not os.path.exists(args.kill_once)):
        open(args.kill_once, "w").close()
        print("killing rank {} at epoch {} batch {}".format(hvd.rank(), epoch, batch), flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


@hvd.elastic.run
def train(state):
    if hvd.rank() == 0:
        print("training starts at epoch {} batch {}".format(state.epoch, state.batch), flush=True)
    while state.epoch < args.epochs:
        state.model.train()
        batch_offset = state.batch
        epoch_loss = 0.0
        for idx, (data, target) in enumerate(train_loader):
            # Elastic Horovod: update the current batch index this epoch and commit
            state.batch = batch_idx = batch_offset + idx
            if args.batches_per_commit > 0 and state.batch % args.batches_per_commit == 0:
                state.commit()
            maybe_kill(state.epoch, batch_idx)
            state.optimizer.zero_grad()
            output = state.model(data)
            loss = F.nll_loss(output, target)
            loss.backward()
            state.optimizer.step()
            epoch_loss += loss.item()
            # Elastic Horovod: record which samples were processed this batch
            state.train_sampler.record_batch(idx, args.batch_size)
        if hvd.rank() == 0:
            print("epoch {}: last {} batches, mean loss {:.6f}".format(
                state.epoch, len(train_loader), epoch_loss / max(len(train_loader), 1)), flush=True)
        # end of epoch
        state.epoch += 1
        state.batch = 0
        state.train_sampler.set_epoch(state.epoch)
        state.commit()


def on_state_reset():
    # Horovod: scale the learning rate to the (possibly new) number of workers
    for param_group in optimizer.param_groups:
        param_group["lr"] = args.lr * hvd.size()
    if hvd.rank() == 0:
        print("reset: lr = {}".format(args.lr * hvd.size()), flush=True)


if __name__ == "__main__":
    args = parser.parse_args()
    hvd.init()
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)

    train_dataset = synthetic_mnist(args.train_samples, seed=0)
    # Elastic Horovod: the sampler re-partitions the unprocessed samples after a reset
    train_sampler = hvd.elastic.ElasticSampler(train_dataset, shuffle=True, seed=args.seed)
    train_loader = torch.utils.data.DataLoader(
        train_dataset, batch_size=args.batch_size, sampler=train_sampler)

    model = Net()
    optimizer = optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=args.momentum)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())

    state = hvd.elastic.TorchState(model=model, optimizer=optimizer,
                                   train_sampler=train_sampler, epoch=0, batch=0)
    state.register_reset_callbacks([on_state_reset])
    train(state)

    checksum = sum(float(p.detach().double().sum()) for p in model.parameters())
    if hvd.rank() == 0:
        print("finished {} epochs; weights checksum {:.9f}".format(state.epoch, checksum))
