"""How much memory an engine's model runner takes to build and load a model, against the weights'
own bytes: the first GPU run's question of whether a model that fits the card can be loaded.

Anonymous memory only (resident less file-backed pages, sampled every millisecond): the
checkpoint's mapped pages are page cache, which the kernel reclaims and a GPU never holds. On the
split platform (the CPU's stand-in for a GPU: no oneDNN packing) by default; ``--platform cpu``
adds the CPU path's packed layout. Prints one JSON line.

    python bench/weights_memory.py MODEL_DIR [--dtype bfloat16] [--platform split|cpu]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import resource
import sys
import threading
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))  # the checkout, uninstalled

from pdserve.engine.config import EngineConfig, ModelConfig  # noqa: E402
from pdserve.engine.executor.model_runner import ModelRunner  # noqa: E402
from pdserve.engine.executor.platform import Platform, SplitPlatform  # noqa: E402


def anon_bytes() -> int:
    with open("/proc/self/statm") as f:
        _, resident, shared = map(int, f.read().split()[:3])
    return (resident - shared) * resource.getpagesize()


def measure(model_dir: str, dtype: str, platform: Platform) -> dict:
    peak, done = [0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], anon_bytes())
            time.sleep(0.001)

    model = ModelConfig.from_path(model_dir)
    config = EngineConfig(model=model_dir, dtype=dtype)
    before = anon_bytes()
    sampler = threading.Thread(target=sample)
    sampler.start()
    runner = ModelRunner(model, config, platform=platform)
    done.set()
    sampler.join()
    grew = peak[0] - before
    return {
        "grew": grew,
        "weights": runner.weight_bytes,
        "ratio": round(grew / runner.weight_bytes, 3),
        "dtypes": sorted({str(p.dtype) for p in runner.model.parameters()}),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--platform", choices=("split", "cpu"), default="split")
    args = parser.parse_args(argv)
    platform = SplitPlatform() if args.platform == "split" else Platform()
    print(json.dumps(measure(args.model_dir, args.dtype, platform)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
