"""A Horovod training script with gradient accumulation and fp16 compression (the loop of
Horovod's pytorch_imagenet_resnet50.py on an MNIST-shaped task); only the import is changed.

Run:  torsh-dist horovodrun -np 2 python examples/horovod/pytorch_mnist_accumulate.py \\
          --batches-per-allreduce 2 --fp16-allreduce

Each rank loads ``batch_size * batches_per_allreduce`` samples per step, runs backward on
``batches_per_allreduce`` sub-batches (the loss divided by their number, so the accumulated
gradient is their mean) and DistributedOptimizer(backward_passes_per_step=...) all-reduces once,
in fp16, before the step.
"""

# Kept in the style of Horovod's examples (super(Net, self), str.format), as a user's script would be.
# ruff: noqa: UP004, UP008, UP032

import argparse
import math

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
import torch.utils.data.distributed

import torsh_distributed.compat.horovod.torch as hvd  # was: import horovod.torch as hvd

parser = argparse.ArgumentParser(description="PyTorch MNIST with gradient accumulation")
parser.add_argument("--batch-size", type=int, default=16,
                    help="input batch size for one backward pass")
parser.add_argument("--batches-per-allreduce", type=int, default=2,
                    help="number of batches processed locally before executing allreduce "
                         "across workers; it multiplies the total batch size")
parser.add_argument("--fp16-allreduce", action="store_true", default=False,
                    help="use fp16 compression during allreduce")
parser.add_argument("--epochs", type=int, default=2, help="number of epochs to train")
parser.add_argument("--base-lr", type=float, default=0.025, help="learning rate for a single GPU")
parser.add_argument("--momentum", type=float, default=0.5, help="SGD momentum")
parser.add_argument("--wd", type=float, default=1e-5, help="weight decay")
parser.add_argument("--seed", type=int, default=42, help="random seed")
parser.add_argument("--train-samples", type=int, default=1024,
                    help="size of the synthetic training set")


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
        return self.fc2(x)


class Metric(object):
    def __init__(self, name):
        self.name = name
        self.sum = torch.tensor(0.)
        self.n = torch.tensor(0.)

    def update(self, val):
        self.sum += hvd.allreduce(val.detach().cpu(), name=self.name)
        self.n += 1

    @property
    def avg(self):
        return self.sum / self.n


def accuracy(output, target):
    pred = output.max(1, keepdim=True)[1]
    return pred.eq(target.view_as(pred)).cpu().float().mean()


def train(epoch):
    model.train()
    train_sampler.set_epoch(epoch)
    train_loss = Metric("train_loss")
    train_accuracy = Metric("train_accuracy")
    for data, target in train_loader:
        optimizer.zero_grad()
        # Split data into sub-batches of size batch_size
        for i in range(0, len(data), args.batch_size):
            data_batch = data[i:i + args.batch_size]
            target_batch = target[i:i + args.batch_size]
            output = model(data_batch)
            train_accuracy.update(accuracy(output, target_batch))
            loss = F.cross_entropy(output, target_batch)
            train_loss.update(loss)
            # Average gradients among sub-batches
            loss.div_(math.ceil(float(len(data)) / args.batch_size))
            loss.backward()
        # Gradient is applied across all ranks
        optimizer.step()
    if hvd.rank() == 0:
        print("epoch {}: train loss {:.6f}, train accuracy {:.2f}%".format(
            epoch, train_loss.avg.item(), 100. * train_accuracy.avg.item()))


if __name__ == "__main__":
    args = parser.parse_args()
    allreduce_batch_size = args.batch_size * args.batches_per_allreduce

    hvd.init()
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)

    train_dataset = synthetic_mnist(args.train_samples, seed=0)
    # Horovod: use DistributedSampler to partition data among workers.
    train_sampler = torch.utils.data.distributed.DistributedSampler(
        train_dataset, num_replicas=hvd.size(), rank=hvd.rank())
    train_loader = torch.utils.data.DataLoader(
        train_dataset, batch_size=allreduce_batch_size, sampler=train_sampler)

    model = Net()

    # Horovod: scale learning rate by the number of workers and by batches_per_allreduce.
    optimizer = optim.SGD(model.parameters(),
                          lr=(args.base_lr * args.batches_per_allreduce * hvd.size()),
                          momentum=args.momentum, weight_decay=args.wd)

    # Horovod: (optional) compression algorithm.
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none

    # Horovod: wrap optimizer with DistributedOptimizer.
    optimizer = hvd.DistributedOptimizer(
        optimizer, named_parameters=model.named_parameters(),
        compression=compression,
        backward_passes_per_step=args.batches_per_allreduce)

    # Horovod: broadcast parameters & optimizer state.
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    for epoch in range(args.epochs):
        train(epoch)

    # Every rank must hold the same weights after the last synchronized step.
    checksum = sum(float(p.detach().double().sum()) for p in model.parameters())
    checksums = hvd.allgather_object(round(checksum, 9))
    if hvd.rank() == 0:
        print("final weights identical on all ranks: {} (checksum {:.9f})".format(
            len(set(checksums)) == 1, checksum))
