"""Speed and host memory of one estimate: a 1B model in at most 2 s, a 7B model in under 1 GiB.

Each case runs in a fresh Python process so that its peak resident memory (ru_maxrss) is its
own. "cold" is the first estimate in a process (imports and first-time dispatch included);
"warm" is a second estimate of the same model in that process.

    python benchmarks/estimate_speed.py --quick
"""

from __future__ import annotations

import subprocess
import sys

import _common

CASE = r"""
import json, resource, time, logging
logging.getLogger("transformers").setLevel(logging.ERROR)
import vramctl
t0 = time.perf_counter()
e = vramctl.estimate({model!r}, batch_size={batch}, seq_len={seq}, mode={mode!r},
                     precision={precision!r}, device="A100-80GB")
cold = time.perf_counter() - t0
t1 = time.perf_counter()
vramctl.estimate({model!r}, batch_size={batch}, seq_len={seq}, mode={mode!r},
                 precision={precision!r}, device="A100-80GB")
warm = time.perf_counter() - t1
print(json.dumps({{"cold_s": round(cold, 3), "warm_s": round(warm, 3),
                  "max_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
                  "parameters": e.parameters, "peak_device_gib": round(e.peak_device / 2**30, 2),
                  "ops": e.ops}}))
"""

CASES = [
    ("llama-1b", 4, 512, "train", "amp-bf16"),
    ("llama-7b", 1, 512, "train", "amp-bf16"),
]


def run(model: str, batch: int, seq: int, mode: str, precision: str) -> dict[str, object]:
    code = CASE.format(model=model, batch=batch, seq=seq, mode=mode, precision=precision)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    res: dict[str, object] = _common.last_json(out.stdout)
    res.update(model=model, batch=batch, seq_len=seq, mode=mode, precision=precision)
    return res


def main() -> int:
    _common.parse(_common.parser(__doc__, quick="the same two cases (they take ~30 s)"))
    rows = [run(*c) for c in CASES]
    for r in rows:
        print(
            f"{r['model']:<10} {r['mode']} {r['precision']} batch {r['batch']} x {r['seq_len']}: "
            f"cold {r['cold_s']} s, warm {r['warm_s']} s, max RSS {r['max_rss_mib']} MiB, "
            f"{r['ops']} ops"
        )
    one, seven = rows
    return _common.finish(
        {
            "benchmark": "estimate_speed",
            "llama_1b_cold_s": one["cold_s"],
            "llama_1b_warm_s": one["warm_s"],
            "llama_1b_max_rss_mib": one["max_rss_mib"],
            "llama_7b_cold_s": seven["cold_s"],
            "llama_7b_max_rss_mib": seven["max_rss_mib"],
            "llama_7b_parameters": seven["parameters"],
        }
    )


if __name__ == "__main__":
    sys.exit(main())
