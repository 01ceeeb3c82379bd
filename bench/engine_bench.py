"""Engine throughput on CPU (or the default device): quantize 4096×4096 tensors.

Run: python bench/engine_bench.py [--size 4096] [--repeats 5]

Baselines measured in the same process: numpy copy bandwidth (bytes in + out of np.copyto) and
a jitted copy. Throughput of a quantize = (input bytes + qvalue bytes + scale bytes) / time.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np

from qmill.engine import qarray


def _best(fn, repeats: int) -> float:
    fn()  # compile / warm up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def _numpy_copy_gbs(nbytes: int, repeats: int) -> float:
    src = np.ones(nbytes // 4, np.float32)
    dst = np.empty_like(src)
    t = _best(lambda: np.copyto(dst, src), repeats)
    return 2 * nbytes / t / 1e9


def _quantize_fn(how: qarray.HowToQuantize):
    return jax.jit(functools.partial(qarray.quantize, how=how))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    n = args.size
    print(
        f"# {datetime.date.today()} {platform.machine()} {platform.processor() or ''} "
        f"jax {jax.__version__} device {jax.devices()[0].device_kind}"
    )
    cases = {
        "int8 channelwise": qarray.HowToQuantize(qtype="int8", channelwise_axes=(1,)),
        "int4 tile 128": qarray.HowToQuantize(
            qtype="int4", channelwise_axes=(1,), tiled_axes={0: 128}
        ),
        "nf4 channelwise": qarray.HowToQuantize(qtype="nf4", channelwise_axes=(1,)),
        "fp8 channelwise": qarray.HowToQuantize(qtype="float8_e4m3fn", channelwise_axes=(1,)),
    }
    for dtype in (jnp.bfloat16, jnp.float32):
        x = jax.random.normal(jax.random.key(0), (n, n), jnp.float32).astype(dtype)
        x.block_until_ready()
        copy_gbs = _numpy_copy_gbs(x.nbytes, args.repeats)
        jcopy = jax.jit(lambda a: a + 0)
        jcopy_gbs = (
            2 * x.nbytes / _best(lambda c=jcopy, a=x: c(a).block_until_ready(), args.repeats) / 1e9
        )
        print(
            f"\n{jnp.dtype(dtype).name} {n}x{n}: numpy copy {copy_gbs:.2f} GB/s, "
            f"jitted copy {jcopy_gbs:.2f} GB/s"
        )
        seconds = {}
        for name, how in cases.items():
            fn = _quantize_fn(how)
            q = fn(x)
            out_bytes = q.qvalue.size * q.qvalue.dtype.itemsize + q.scale.nbytes
            t = _best(lambda fn=fn, a=x: jax.block_until_ready(fn(a)), args.repeats)
            seconds[name] = t
            gbs = (x.nbytes + out_bytes) / t / 1e9
            print(
                f"  {name:18s} {t * 1e3:8.2f} ms  {gbs:6.2f} GB/s  "
                f"{100 * gbs / copy_gbs:5.1f} % of numpy copy"
            )
        base = seconds["int8 channelwise"]
        print(f"  nf4 / int8 = {seconds['nf4 channelwise'] / base:.2f}  (target <= 3)")
        print(f"  int4 tile 128 / int8 = {seconds['int4 tile 128'] / base:.2f}  (target <= 2)")


if __name__ == "__main__":
    main()
