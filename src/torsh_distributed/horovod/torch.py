"""Alias of :mod:`torsh_distributed.compat.horovod.torch`: this module replaces itself by it in
``sys.modules``, so both import names give the same module object (one state, one ``elastic``)."""

from __future__ import annotations

import sys

from torsh_distributed.compat.horovod import torch as _hvd

sys.modules[__name__] = _hvd
sys.modules[f"{__name__}.elastic"] = _hvd.elastic
