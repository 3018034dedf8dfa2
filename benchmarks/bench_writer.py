"""The writer's sustained rate on a recording bound by I/O, against a raw sequential write of
the same bytes to the same disk (fsync'd), and the recording process's peak memory.

The recorded model is cheap (Identity modules) and its tensors are large, so the run is
bound by writing full tensors. Both sides end with everything on disk (os.sync / fsync). Each
case runs in a fresh process; the order alternates over repetitions.

    python benchmarks/bench_writer.py [--mb-per-step 128] [--steps 12] [--reps 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_diff import measure  # noqa: E402

RAW = """
import os
import numpy as np
import time
data = np.random.default_rng(0).standard_normal({numel}, dtype=np.float32)
t_start = time.perf_counter()
with open("{out}/raw.bin", "wb") as f:
    for _ in range({tensors}):
        f.write(data.tobytes())
    f.flush()
    os.fsync(f.fileno())
result = f"{{{tensors} * data.nbytes}} {{time.perf_counter() - t_start}}"
"""

RECORD = """
import os, time, torch, hooktrace
from torch import nn
model = nn.Sequential(*[nn.Identity() for _ in range({modules})])
x = torch.randn({numel})
t_start = time.perf_counter()
with hooktrace.record(model, "{out}/run", full_every=1, params=False, buffer_mb={buffer_mb}) as rec:
    for _ in range({steps}):
        model(x)
        rec.step()
os.sync()
elapsed = time.perf_counter() - t_start
result = f"{{hooktrace.load('{out}/run').steps['full_tensors'].sum() * x.numel() * 4}} {{elapsed}}"
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb-per-step", type=int, default=128)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument(
        "--modules", type=int, default=8, help="Identity modules: full tensors per step"
    )
    parser.add_argument("--buffer-mb", type=float, default=256)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args(argv)

    # the Sequential's own output is one more full tensor per step
    tensors_per_step = args.modules + 1
    numel = args.mb_per_step * (1 << 20) // 4 // tensors_per_step
    tensor_mb = numel * 4 / (1 << 20)
    rates: dict[str, list[float]] = {"raw": [], "hooktrace": []}
    peaks: list[float] = []
    with tempfile.TemporaryDirectory(dir=Path.cwd()) as tmp:  # the disk the user works on
        for rep in range(args.reps):
            order = ["raw", "hooktrace"] if rep % 2 == 0 else ["hooktrace", "raw"]
            for case in order:
                out = Path(tmp) / f"{case}-{rep}"
                out.mkdir()
                if case == "raw":
                    m = measure(
                        RAW,
                        numel=str(numel),
                        tensors=str(tensors_per_step * args.steps),
                        out=str(out),
                    )
                else:
                    m = measure(
                        RECORD, numel=str(numel), modules=str(args.modules), steps=str(args.steps),
                        buffer_mb=str(args.buffer_mb), out=str(out),
                    )  # fmt: skip
                    peaks.append(float(str(m["peak_mb"])))
                written, seconds = str(m["result"]).split()  # timed inside: imports excluded
                rates[case].append(int(written) / (1 << 20) / float(seconds))

    raw, ours = statistics.median(rates["raw"]), statistics.median(rates["hooktrace"])
    print(
        f"{args.steps} steps x {tensors_per_step} full tensors of {tensor_mb:.1f} MB "
        f"({args.steps * tensors_per_step * tensor_mb:.0f} MB), buffer {args.buffer_mb:.0f} MB, "
        f"{args.reps} repetitions, medians"
    )
    print(f"  raw sequential write + fsync   {raw:8.0f} MB/s")
    print(f"  hooktrace recording + sync     {ours:8.0f} MB/s   {ours / raw:.2f} of raw")
    print(
        f"  recording process peak RSS     {statistics.median(peaks):8.0f} MB   (torch and the model included)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
