"""Compatibility layers: run code written for other distributed-training libraries on ours.

* :mod:`torsh_distributed.compat.horovod.torch` - Horovod's PyTorch API
  (``import torsh_distributed.compat.horovod.torch as hvd``) on torch.distributed; see
  docs/horovod.md;
* :mod:`torsh_distributed.compat.deepspeed` - DeepSpeed JSON configs onto the engine's config,
  every key reported as applied, mapped or unsupported; see docs/deepspeed.md;
* :mod:`torsh_distributed.compat.fairscale` - FairScale's OSS / ShardedDataParallel /
  FullyShardedDataParallel set-ups onto the ZeRO stages, with the same report.
"""
