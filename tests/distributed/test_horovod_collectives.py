"""Horovod's collectives (``torsh_distributed.compat.horovod.torch``) on real Gloo groups, each
result checked against its closed form.

One launch per world size runs the whole list and returns the failures, so the matrix costs two
process starts. World 2 covers every operation; world 4 (as 2 hosts x 2 processes) covers the
layout functions, Adasum's second doubling level, uneven all-gathers and all-to-all splits.
"""

from __future__ import annotations

import math
import os
import warnings

import torch

import torsh_distributed.compat.horovod.torch as hvd
from torsh_distributed.testing import run_distributed


class _Checks:
    def __init__(self) -> None:
        self.failures: list[str] = []
        self.count = 0

    @staticmethod
    def _same(got: object, want: object) -> bool:
        if isinstance(want, torch.Tensor):
            return (
                isinstance(got, torch.Tensor)
                and got.dtype == want.dtype
                and got.shape == want.shape
                and torch.equal(got, want)
            )
        if isinstance(want, list) and isinstance(got, list):
            return len(got) == len(want) and all(map(_Checks._same, got, want))
        return got == want

    def eq(self, label: str, got: object, want: object) -> None:
        self.count += 1
        if not self._same(got, want):
            self.failures.append(f"rank {hvd.rank()} {label}: got {got!r}, want {want!r}")

    def close(self, label: str, got: torch.Tensor, want: torch.Tensor, tol: float) -> None:
        self.count += 1
        if got.shape != want.shape or not torch.allclose(got.double(), want.double(), atol=tol, rtol=tol):
            self.failures.append(f"rank {hvd.rank()} {label}: got {got!r}, want {want!r}")

    def raises(self, label: str, exc: type[BaseException], fn, match: str) -> None:
        self.count += 1
        try:
            fn()
        except exc as err:
            if match not in str(err):
                self.failures.append(f"rank {hvd.rank()} {label}: message {err!s:.200}")
            return
        except BaseException as err:  # noqa: BLE001 - reported as a failure
            self.failures.append(f"rank {hvd.rank()} {label}: raised {type(err).__name__}: {err}")
            return
        self.failures.append(f"rank {hvd.rank()} {label}: did not raise {exc.__name__}")


def _adasum(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The paper's formula, written out independently of the implementation."""
    a64, b64 = a.double(), b.double()
    dot = float((a64 * b64).sum())
    na, nb = float((a64 * a64).sum()), float((b64 * b64).sum())
    return ((1 - dot / (2 * na)) * a64 + (1 - dot / (2 * nb)) * b64).to(a.dtype)


def _adasum_input(r: int) -> torch.Tensor:
    return torch.tensor([1.0 + r, -2.0 * r, 0.5, 3.0 - r * r], dtype=torch.float32)


def _allreduce_checks(c: _Checks, r: int, w: int) -> None:
    base = torch.arange(6, dtype=torch.float32)
    x = base * (r + 1)
    before = x.clone()
    c.close("average", hvd.allreduce(x), base * (w + 1) / 2, 1e-6)
    c.eq("allreduce leaves the input", x, before)
    c.close("sum", hvd.allreduce(x, op=hvd.Sum), base * w * (w + 1) / 2, 1e-6)
    c.eq("min", hvd.allreduce(x, op=hvd.Min), base)
    c.eq("max", hvd.allreduce(x, op=hvd.Max), base * w)
    c.eq("product", hvd.allreduce(torch.full((3,), r + 2.0), op=hvd.Product),
         torch.full((3,), float(math.factorial(w + 1))))
    c.close("sum prescale/postscale", hvd.allreduce(x, op=hvd.Sum, prescale_factor=0.5, postscale_factor=3.0),
            3.0 * 0.5 * base * w * (w + 1) / 2, 1e-6)
    c.close("average prescale/postscale",
            hvd.allreduce(x, prescale_factor=0.25, postscale_factor=2.0),
            2.0 * 0.25 * base * (w + 1) / 2, 1e-6)
    ints = torch.tensor([3 * r + 1, -(3 * r + 1), 7], dtype=torch.int64)
    total = sum(torch.tensor([3 * k + 1, -(3 * k + 1), 7]) for k in range(w))
    c.eq("int average truncates like Horovod", hvd.allreduce(ints), torch.trunc(total / w).to(torch.int64))
    c.eq("int prescale in fp64", hvd.allreduce(ints, op=hvd.Sum, prescale_factor=0.5),
         sum(torch.trunc(torch.tensor([3 * k + 1, -(3 * k + 1), 7]) * 0.5) for k in range(w)).to(torch.int64))
    y = x.clone()
    out = hvd.allreduce_(y, op=hvd.Sum)
    c.eq("allreduce_ is in place", out is y, True)
    c.close("allreduce_ value", y, base * w * (w + 1) / 2, 1e-6)
    # asynchronous forms, several in flight
    z = x.clone()
    h1 = hvd.allreduce_async(x, op=hvd.Max, name="a")
    h2 = hvd.allreduce_async_(z, op=hvd.Sum, name="b")
    h3 = hvd.allreduce_async(x.double())
    c.eq("poll is a bool", isinstance(hvd.poll(h1), bool), True)
    c.eq("async max", hvd.synchronize(h1), base * w)
    c.eq("async in place returns the tensor", hvd.synchronize(h2) is z, True)
    c.close("async in place value", z, base * w * (w + 1) / 2, 1e-6)
    c.close("async fp64 average", hvd.synchronize(h3), (base * (w + 1) / 2).double(), 1e-12)
    c.eq("poll after synchronize", hvd.poll(h3), True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        c.close("average=False is Sum", hvd.allreduce(x, average=False), base * w * (w + 1) / 2, 1e-6)
    c.eq("average= warns", any(issubclass(w_.category, DeprecationWarning) for w_ in caught), True)
    c.raises("op and average", ValueError, lambda: hvd.allreduce(x, average=True, op=hvd.Sum),
             "supersedes average")
    # fp16 compression: sent as fp16, returned in fp32
    half = hvd.allreduce(x, compression=hvd.Compression.fp16)
    c.eq("fp16 compression keeps the dtype", half.dtype, torch.float32)
    c.close("fp16 compression value", half, base * (w + 1) / 2, 1e-3)
    # one of our compressors through Compression.torsh (fp16 is summable: an all-reduce)
    ours = hvd.allreduce(x, compression=hvd.Compression.torsh("fp16"), op=hvd.Sum, name="g")
    c.close("Compression.torsh('fp16') sum", ours, base * w * (w + 1) / 2, 1e-2)
    c.raises("torsh compression with Max", ValueError,
             lambda: hvd.allreduce(x, compression=hvd.Compression.torsh("int8"), op=hvd.Max),
             "op must be hvd.Average or hvd.Sum")
    # Adasum: recursive doubling over the pairs, against the formula
    inputs = [_adasum_input(k) for k in range(w)]
    level = inputs
    while len(level) > 1:
        level = [_adasum(level[i], level[i + 1]) for i in range(0, len(level), 2)]
    c.close("adasum", hvd.allreduce(_adasum_input(r), op=hvd.Adasum), level[0], 1e-6)
    c.raises("adasum on ints", TypeError,
             lambda: hvd.allreduce(torch.ones(2, dtype=torch.int32), op=hvd.Adasum), "floating-point")
    # grouped
    g = hvd.grouped_allreduce([x, x.double() * 2], op=hvd.Sum)
    c.close("grouped 0", g[0], base * w * (w + 1) / 2, 1e-6)
    c.close("grouped 1", g[1], (base * w * (w + 1)).double(), 1e-12)
    pair = [x.clone(), x.clone() * 2]
    hvd.grouped_allreduce_(pair, op=hvd.Max)
    c.eq("grouped in place", pair, [base * w, base * 2 * w])
    h = hvd.grouped_allreduce_async([x, x], op=hvd.Min)
    c.eq("grouped async", hvd.synchronize(h), [base, base])
    # autograd: Sum's backward is a Sum of the gradients, Average's an average
    leaf = x.clone().requires_grad_(True)
    hvd.allreduce(leaf, op=hvd.Sum).sum().backward()
    c.eq("allreduce Sum backward", leaf.grad, torch.full_like(x, float(w)))
    leaf = x.clone().requires_grad_(True)
    (hvd.allreduce(leaf) * (r + 1)).sum().backward()
    c.close("allreduce Average backward", leaf.grad, torch.full_like(x, (w + 1) / 2), 1e-6)
    # reducescatter: Horovod's split gives the first (rows % w) ranks one more row
    rows = 2 * w + 1
    t = torch.arange(rows * 2, dtype=torch.float32).reshape(rows, 2) * (r + 1)
    full = torch.arange(rows * 2, dtype=torch.float32).reshape(rows, 2) * (w * (w + 1) / 2)
    counts = [rows // w + (1 if k < rows % w else 0) for k in range(w)]
    start = sum(counts[:r])
    c.close("reducescatter sum", hvd.reducescatter(t, op=hvd.Sum), full[start : start + counts[r]], 1e-6)
    c.close("reducescatter average", hvd.reducescatter(t), full[start : start + counts[r]] / w, 1e-6)
    both = hvd.grouped_reducescatter([t, t.double()], op=hvd.Sum)
    c.close("grouped reducescatter", both[1], full[start : start + counts[r]].double(), 1e-12)
    h = hvd.reducescatter_async(t, op=hvd.Max)
    c.eq("reducescatter async max", hvd.synchronize(h), (t / (r + 1) * w)[start : start + counts[r]])


def _movement_checks(c: _Checks, r: int, w: int) -> None:
    # allgather with uneven first dimensions
    mine = torch.full((r + 1, 2), float(r))
    want = torch.cat([torch.full((k + 1, 2), float(k)) for k in range(w)])
    c.eq("allgather uneven", hvd.allgather(mine), want)
    c.eq("allgather int", hvd.allgather(torch.arange(r + 1)), torch.cat([torch.arange(k + 1) for k in range(w)]))
    h = hvd.allgather_async(mine.double(), name="ag")
    c.eq("allgather async", hvd.synchronize(h), want.double())
    c.eq("grouped allgather", hvd.grouped_allgather([mine, mine[:, :1]])[1], want[:, :1])
    bad = torch.zeros(1, 2 + (r % 2))
    c.raises("allgather trailing mismatch", ValueError, lambda: hvd.allgather(bad), "beyond the first")
    c.raises("allgather scalar", ValueError, lambda: hvd.allgather(torch.tensor(1.0)), "at least one dimension")
    leaf = mine.clone().requires_grad_(True)
    weights = torch.arange(want.shape[0], dtype=torch.float32).unsqueeze(1)
    (hvd.allgather(leaf) * weights).sum().backward()
    offset = sum(k + 1 for k in range(r))
    c.eq("allgather backward", leaf.grad, weights[offset : offset + r + 1].expand(r + 1, 2))
    # broadcast
    v = torch.full((4,), float(r))
    c.eq("broadcast", hvd.broadcast(v, root_rank=w - 1), torch.full((4,), float(w - 1)))
    c.eq("broadcast leaves the input", v, torch.full((4,), float(r)))
    out = hvd.broadcast_(v, root_rank=0)
    c.eq("broadcast_ in place", out is v, True)
    c.eq("broadcast_ value", v, torch.zeros(4))
    u = torch.full((2, 3), r + 1, dtype=torch.int32)
    c.eq("broadcast async", hvd.synchronize(hvd.broadcast_async(u, 1)), torch.full((2, 3), 2, dtype=torch.int32))
    hvd.synchronize(hvd.broadcast_async_(u, 0))
    c.eq("broadcast async in place", u, torch.full((2, 3), 1, dtype=torch.int32))
    c.raises("broadcast root out of range", ValueError, lambda: hvd.broadcast(v, root_rank=w), "root_rank")
    leaf = torch.ones(3, requires_grad=True)
    (hvd.broadcast(leaf, root_rank=0) * (r + 1)).sum().backward()
    c.close("broadcast backward", leaf.grad,
            torch.full((3,), (w + 1) / 2 if r == 0 else 0.0), 1e-6)
    # alltoall with splits: rank r sends r + j + 1 rows, valued 10 r + j, to rank j
    splits = [r + j + 1 for j in range(w)]
    send = torch.cat([torch.full((r + j + 1, 2), 10.0 * r + j) for j in range(w)])
    received, got_splits = hvd.alltoall(send, splits=splits)
    c.eq("alltoall splits", received, torch.cat([torch.full((j + r + 1, 2), 10.0 * j + r) for j in range(w)]))
    c.eq("alltoall received splits", got_splits, torch.tensor([j + r + 1 for j in range(w)], dtype=torch.int32))
    even = torch.arange(2 * w, dtype=torch.float32) + 100 * r
    c.eq("alltoall even", hvd.alltoall(even),
         torch.cat([torch.arange(2 * r, 2 * r + 2, dtype=torch.float32) + 100 * j for j in range(w)]))
    c.eq("alltoall async", hvd.synchronize(hvd.alltoall_async(even))[0], hvd.alltoall(even))
    c.raises("alltoall bad splits", ValueError, lambda: hvd.alltoall(send, splits=[1] * w), "splits sum")
    c.raises("alltoall uneven without splits", ValueError,
             lambda: hvd.alltoall(torch.zeros(2 * w + 1)), "does not divide")
    leaf = send.clone().requires_grad_(True)
    out_rows, _ = hvd.alltoall(leaf, splits=splits)
    (out_rows * (r + 1)).sum().backward()  # each row goes back to its sender, scaled by receiver
    c.eq("alltoall backward", leaf.grad,
         torch.cat([torch.full((r + j + 1, 2), float(j + 1)) for j in range(w)]))
    # objects
    c.eq("broadcast_object", hvd.broadcast_object({"from": r, "list": [r] * 3}, root_rank=w - 1),
         {"from": w - 1, "list": [w - 1] * 3})
    c.eq("allgather_object", hvd.allgather_object(("rank", r, "x" * r)),
         [("rank", k, "x" * k) for k in range(w)])
    hvd.barrier()
    c.raises("join", NotImplementedError, hvd.join, "hvd.join() is not supported")
    c.raises("process set", NotImplementedError,
             lambda: hvd.allreduce(v, process_set=object()), "global_process_set")
    c.eq("global process set", (hvd.global_process_set.size(), hvd.global_process_set.rank()), (w, r))


def _all_checks(layout: dict[str, str] | None) -> tuple[list[str], int, dict[str, object]]:
    if layout:  # pretend to be hosts x processes before hvd.init reads the environment
        os.environ.update(layout)
    hvd.init()
    c = _Checks()
    r, w = hvd.rank(), hvd.size()
    _allreduce_checks(c, r, w)
    _movement_checks(c, r, w)
    info = {
        "rank": r,
        "size": w,
        "local": (hvd.local_rank(), hvd.local_size()),
        "cross": (hvd.cross_rank(), hvd.cross_size()),
        "homogeneous": hvd.is_homogeneous(),
        "built": (hvd.mpi_built(), hvd.gloo_built(), hvd.gloo_enabled(), hvd.is_initialized()),
    }
    return c.failures, c.count, info


def _four_as_two_hosts() -> tuple[list[str], int, dict[str, object]]:
    r = int(os.environ["RANK"])
    return _all_checks(
        {"LOCAL_RANK": str(r % 2), "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": str(r // 2)}
    )


def test_every_collective_matches_its_closed_form_on_two_ranks():
    results = run_distributed(_all_checks, 2, args=(None,), timeout=90)
    for failures, count, _ in results:
        assert not failures, "\n".join(failures)
        assert count >= 60
    infos = [info for *_, info in results]
    assert [i["local"] for i in infos] == [(0, 2), (1, 2)]
    assert [i["cross"] for i in infos] == [(0, 1), (0, 1)]
    assert all(i["built"] == (False, True, True, True) and i["homogeneous"] for i in infos)


def test_four_ranks_on_two_hosts_layout_adasum_and_uneven_shapes():
    results = run_distributed(_four_as_two_hosts, 4, timeout=150, init=False)
    for failures, _, _ in results:
        assert not failures, "\n".join(failures)
    assert [info["local"] for *_, info in results] == [(0, 2), (1, 2), (0, 2), (1, 2)]
    assert [info["cross"] for *_, info in results] == [(0, 2), (0, 2), (1, 2), (1, 2)]
