"""Codec time of every gradient compressor, the int8 ZeRO block codec and the 1-bit sign codec on a
GPU tensor, beside the same codec on the host's CPU, in one process.

For each method: compress then decompress one flat fp32 tensor of ``--numel`` entries (a
``--numel``-entry DDP bucket; PowerSGD sees it as a 1024-row matrix), no communication (one
rank). GPU: ``--repeats`` timed round trips after one warm-up, each between two
``torch.cuda.synchronize()``; the median is kept. CPU: one warm-up and one timed round trip at
the same size (``--cpu-numel`` to shrink it, ``--no-cpu`` to skip; ``--threads`` intra-op
threads). The stochastic methods draw on the data's device (CUDA's generator on the GPU).

Two rows replay the code before the twenty-third session's change, side by side in the same run:
``METHOD@cpu-draws`` draws on the CPU generator and copies the draws to the GPU (what
``natural``, ``ternary`` and stochastic ``int8`` did), ``zero-int8@scatter`` takes the blocks'
maxima with the atomic ``scatter_reduce`` instead of reshaped views::

    python benchmarks/bench_gpu_codecs.py --json bench-codecs.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

METHODS = ("fp16,bf16,int8,natural,bimodal,topk:0.01,randomk:0.01,threshold:0.01,sign,ternary,"
           "sketch:0.1,powersgd:4")


def _codec(method: str, numel: int) -> Callable:
    import torch

    if method in ("zero-int8", "zero-int8@scatter"):
        from torsh_distributed.parallel._quantized_zero import (
            block_dequantize,
            block_ids,
            block_quantize,
        )

        ids, num = block_ids([numel], 256)
        cache: dict = {}
        layout = {} if method.endswith("@scatter") else {"sizes": [numel], "block": 256}

        def zero(x: torch.Tensor) -> torch.Tensor:
            if x.device not in cache:  # once: the collectives keep their ids on the device
                cache[x.device] = ids.to(x.device)
            i = cache[x.device]
            codes, scale = block_quantize(x.view(1, -1), i, num, **layout)
            return block_dequantize(codes, scale, i)

        return zero
    if method == "onebit":
        from torsh_distributed.compression._bits import pack, unpack
        from torsh_distributed.compression._onebit import _decode_signs

        def onebit(x: torch.Tensor) -> torch.Tensor:
            scales = x.abs().view(-1, 256).mean(dim=1)
            bits = pack((x >= 0).to(torch.uint8), 1)
            return _decode_signs(unpack(bits, 1, x.numel()).bool(), scales, 256)

        return onebit
    from torsh_distributed.compression.build import build_compressor

    method, _, variant = method.partition("@")
    comp = build_compressor(method, error_feedback=False)
    if variant == "cpu-draws":  # the earlier code: every draw on the CPU, copied to the data
        stream = comp.stream  # type: ignore[attr-defined]
        cpu_next = stream.next
        stream.next = lambda key, device=None: cpu_next(key)
    kwargs = {"shapes": [torch.Size([1024, numel // 1024])]} if method.startswith("powersgd") else {}

    def round_trip(x: torch.Tensor) -> torch.Tensor:
        payload, ctx = comp.compress(x, key=0, **kwargs)
        return comp.decompress(payload, ctx)

    return round_trip


def _time(fn: Callable, x, *, repeats: int, cuda: bool) -> float:  # noqa: ANN001
    import torch

    fn(x)  # warm-up (allocator, kernels, cached hashes)
    times = []
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn(x)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--numel", type=int, default=1 << 24, help="entries (multiple of 1024)")
    parser.add_argument("--cpu-numel", type=int, default=0, help="CPU size (0 = --numel)")
    parser.add_argument(
        "--methods",
        default=METHODS + ",zero-int8,onebit,natural@cpu-draws,ternary@cpu-draws,zero-int8@scatter",
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0, help="CPU intra-op threads (0 = torch's)")
    parser.add_argument("--no-cpu", action="store_true")
    parser.add_argument("--json", default="")
    args = parser.parse_args(argv)
    if args.numel <= 0 or args.numel % 1024:
        parser.error("--numel must be a positive multiple of 1024")
    import torch

    if not torch.cuda.is_available():
        print("bench_gpu_codecs: needs CUDA (none here)", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    host = torch.randn(args.numel, generator=g)
    gpu = host.cuda()
    cpu_n = args.cpu_numel or args.numel
    rows = []
    for method in args.methods.split(","):
        row: dict = {"method": method, "numel": args.numel}
        try:
            row["gpu_s"] = _time(_codec(method, args.numel), gpu, repeats=args.repeats, cuda=True)
            row["gpu_gb_per_s"] = 4 * args.numel / row["gpu_s"] / 1e9
            if not args.no_cpu:
                x = host[:cpu_n].contiguous()
                row["cpu_numel"] = cpu_n
                row["cpu_s"] = _time(_codec(method, cpu_n), x, repeats=1, cuda=False)
                row["cpu_over_gpu"] = row["cpu_s"] * args.numel / cpu_n / row["gpu_s"]
        except Exception as exc:  # noqa: BLE001 - one method's failure is a result to report
            row["error"] = f"{type(exc).__name__}: {exc}"[:300]
        rows.append(row)
        print(json.dumps(row), flush=True)
        if args.json:
            path = Path(args.json)
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text(json.dumps({"device": torch.cuda.get_device_name(0),
                                       "cpu_threads": torch.get_num_threads(),
                                       "torch": torch.__version__, "rows": rows}, indent=1))
            tmp.replace(path)
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
