"""A/B of environment settings on hugehead's forward + backward step at a benchmark shape: the settings
take turns, round after round (so a board that warms up or throttles weighs on each alike), each round a
warm-up step and ``--reps`` timed ones (CUDA events; the host clock with ``--device cpu``); the median and
minimum per setting, and the gradients' norms (a setting that changes the arithmetic shows here). The
knobs are ``hugehead.tuning``'s (``HUGEHEAD_GEMM``, ``HUGEHEAD_ROWS``, ``HUGEHEAD_EAGER_OP``): each setting's
environment becomes the Tuning its steps run under.

    python -m bench.ab_env --shapes xc1M,xc6M --out DIR 'fused={}' 'cublas={"HUGEHEAD_GEMM": "cublas"}'
    python -m bench.ab_env --device cpu --shapes tiny 'on={}' 'off={"HUGEHEAD_ROWS": "0"}'   # a smoke run
    python -m bench.ab_env --shapes xc6M_16k default= cublas=HUGEHEAD_GEMM=cublas
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

from bench import harness  # first: decides which hugehead is imported
from bench.common import find_shape, make_inputs

import torch  # noqa: E402


def _setting(text: str):
    """``NAME={json object}``, or the shell-safe ``NAME=VAR=value,VAR=value`` / ``NAME=`` (no braces or quotes
    for a shell to expand or strip: device_check.sh's EXTRA steps pass through eval)."""
    name, sep, env = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"expected NAME={{json object}} or NAME=VAR=value,..., got {text!r}")
    if env.lstrip().startswith("{"):
        values = json.loads(env)
        if not isinstance(values, dict):
            raise argparse.ArgumentTypeError(f"{name}: the settings must be a JSON object of variables")
        return name, {str(k): str(v) for k, v in values.items()}
    values = {}
    for item in filter(None, env.split(",")):
        var, sep, value = item.partition("=")
        if not sep or not var:
            raise argparse.ArgumentTypeError(f"{name}: expected VAR=value, got {item!r} in {text!r}")
        values[var] = value
    return name, values


def measure(shape_name: str, settings, rounds: int, reps: int, device: torch.device, dtype: torch.dtype):
    import dataclasses

    import hugehead
    from hugehead import tuning

    shape = find_shape(shape_name)
    x, w, t = make_inputs(shape, device, dtype)
    x.requires_grad_()
    w.requires_grad_()
    names = sorted({k for _, env in settings for k in env})
    saved = {k: os.environ.get(k) for k in names}

    def restore():
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v

    tuned = {}  # the setting's Tuning (hugehead reads the environment once, at import)

    def step():
        with tuning.override(**tuned):
            return torch.autograd.grad(hugehead.linear_cross_entropy(x, w, t), (x, w))

    times = {name: [] for name, _ in settings}
    norms = {}
    peaks = {name: 0 for name, _ in settings}  # peak bytes beyond the inputs, the returned gradients included
    try:
        for rnd in range(rounds):
            for name, env in settings:
                restore()
                os.environ.update(env)
                tuned.clear()
                tuned.update(dataclasses.asdict(tuning.from_environment()))
                gx, gw = step()
                norms.setdefault(name, [float(gx.float().norm()), float(gw.float().norm())])
                del gx, gw
                cuda = device.type == "cuda"
                if cuda:
                    torch.cuda.synchronize(device)
                    base = torch.cuda.memory_allocated(device)
                    torch.cuda.reset_peak_memory_stats(device)
                for _ in range(reps):
                    times[name].append(harness.time_call_ms(step, device)[0])
                if cuda:
                    peaks[name] = max(peaks[name], torch.cuda.max_memory_allocated(device) - base)
                print(f"{shape_name} round {rnd} {name}: {statistics.median(times[name][-reps:]):.2f} ms", flush=True)
    finally:
        restore()
    return {name: {"env": env, "median_ms": statistics.median(times[name]), "min_ms": min(times[name]),
                   "ms": times[name], "grad_norms": norms[name], "peak_gib": peaks[name] / 2**30}
            for name, env in settings}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("settings", nargs="+", type=_setting, help='NAME={"VARIABLE": "value", ...}')
    p.add_argument("--shapes", default="xc6M")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--out", default=None)
    p.add_argument("--device", default="cuda", help="cuda (bf16, CUDA events), or cpu (fp32: a smoke run)")
    a = p.parse_args(argv)
    device = torch.device(a.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("bench.ab_env: no CUDA GPU here (--device cpu runs a smoke check)", file=sys.stderr)
        return 2
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    results = {}
    for shape in a.shapes.split(","):
        results[shape] = measure(shape, a.settings, a.rounds, a.reps, device, dtype)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    meta = harness.run_meta("ab_env", device, options=a,
                            command=" ".join(["python", "-m", "bench.ab_env", *sys.argv[1:]]))
    doc = {"meta": meta, "results": results}
    clock = "CUDA events" if device.type == "cuda" else "host clock"
    lines = [harness.header(f"Environment A/B of the fwd+bwd step: {meta.get('machine')} ({str(dtype)[6:]})", meta),
             f"{a.rounds} rounds, the settings taking turns; each round one warm-up step and {a.reps} timed ones "
             f"({clock}).", "",
             "peak GiB: the most memory a step held beyond the inputs (its returned gradients included).", "",
             "| shape | setting | environment | median ms | min ms | peak GiB | grad norms (x, W) |",
             "|---|---|---|--:|--:|--:|---|"]
    for shape, rows in results.items():
        for name, r in rows.items():
            env = ", ".join(f"{k}={v}" for k, v in r["env"].items()) or "-"
            lines.append(f"| {shape} | {name} | {env} | {r['median_ms']:.2f} | {r['min_ms']:.2f} | {r['peak_gib']:.2f} | "
                         f"{r['grad_norms'][0]:.9g}, {r['grad_norms'][1]:.9g} |")
    md = "\n".join(lines) + "\n" + harness.footer(meta)
    if a.out:
        harness.write_report(Path(a.out), "ab_env", doc, md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
