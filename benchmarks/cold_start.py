"""Cold start against onnxruntime: import, session creation, first run and peak memory of a fresh process.

    .venv/bin/python benchmarks/cold_start.py [--models bert.torchscript.fp32,resnet50,...] [--repeat 5]

Each sample is a new interpreter (this script again, ``--worker``) that builds its feeds with numpy, then
imports the runtime, creates a session (one intra-op thread, CPU provider) and runs every call of the model
once; ours and onnxruntime's processes alternate, and the table shows medians. By default our first runs
are served by numpy while numba loads in the background (the CPU provider's default; a worker usually exits
before that loader starts); ``--no-background`` measures loading numba inside the first run instead. Times
are CPU time of the process (``time.process_time``: all threads, so a compiling or spinning helper counts),
which a loaded host disturbs far less than wall time; the wall time of creation + first run is shown beside.
Our packages' bytecode caches are written before the first sample, as an install has them (``compile_packages``).
Peak RSS is ``ru_maxrss``. The last column lists the heavy packages the process had loaded at the end (numba, llvmlite,
cuda-python, ml_dtypes), which is what most of our cold cost is.

Models are zoo models (benchmarks/.models/zoo, scripts/build_zoo.sh; a decoder's calls run in the manifest's
order) or onnx's shipped light CNNs by name (``resnet50``, ...). numba's disk cache is as earlier runs left it:
run ``onnx-runtime compile`` (and a warm-up run of the zoo models) first to measure a warm cache. zoo_bench.py
measures the same creation + first run inside its full run; this script is the quick check of that column.

The plan cache (docs/cold-start.md) is a folder of this run's own (never the user's). ``--plans warm`` (the
default): a first, unmeasured process of ours per model writes the plans that the measured ones read, as any
later process of a deployment does. ``--plans miss``: the model's plans are removed before each process of
ours, which plans anew and writes them (a model's first process; the folder's other files, such as the
provider list, stay). ``--plans off`` (or ``--no-plan-cache``): the cache is turned off.

``--phases`` adds, per model, the main thread's CPU time in each step of our creation and first run (the providers'
handles, the plan cache's key and read, placement, the specializations planned at the first run, the executor's
runs; placement nests in the specialized plans, and a session whose specializing graph came from the plan cache
places only there), medians over the processes: where a warm start's time goes; and the CPU time the main thread
spent importing modules and in the cyclic collector meanwhile (nested in those steps).

``--main-job`` times the README's main job instead (``onnx-runtime run`` on its embedded default model) as the
first process after an install runs it: an empty numba cache, the whole process's wall and CPU time.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ZOO = HERE / ".models" / "zoo"
DEFAULT_MODELS = ("bert.torchscript.fp32", "gpt2.dynamo.fp32", "resnet.torchscript.fp32",
                  "whisper_encoder.torchscript.fp32", "resnet50", "squeezenet")
HEAVY = ("numba", "llvmlite", "cuda", "ml_dtypes", "scipy", "onnx")
# --phases: (module, class or None, function, label) of each step timed in our processes
PHASES = (("onnx_runtime.session.inference_session", None, "create_handles", "providers"),
          ("onnx_runtime.session.inference_session", None, "open_plans", "plan key"),
          ("onnx_runtime.session.inference_session", None, "read_creation", "plan read"),
          ("onnx_runtime.session.inference_session", None, "place", "placement"),
          ("onnx_runtime.session.inference_session", "InferenceSession", "_plan_specialized", "specialized plans"),
          ("onnx_runtime.session.executor", "Executor", "run", "executor runs"))
IMPORTS, COLLECTOR = "imports", "collector"  # --phases: CPU in module imports and in the cyclic collector


def spec_of(name: str) -> tuple[str, list[dict]]:
    """The model's path and its calls, each a list of zoo_feeds feed specs (computed in the parent process)."""
    manifest = ZOO / "manifest.json"
    if manifest.is_file():
        for model in json.loads(manifest.read_text())["models"]:
            if model["name"] == name:
                return str(ZOO / model["file"]), [call["feeds"] for call in model["calls"].values()]
    import onnx
    from bench_models import LIGHT_DIR

    path = os.path.join(LIGHT_DIR, f"light_{name}.onnx")
    if not os.path.isfile(path):
        raise SystemExit(f"{name}: neither a zoo model (scripts/build_zoo.sh) nor one of onnx's light CNNs")
    graph = onnx.load(path, load_external_data=False).graph
    inits = {i.name for i in graph.initializer}
    feeds = [{"name": i.name, "dtype": "float32", "fill": "normal",
              "shape": [d.dim_value or 1 for d in i.type.tensor_type.shape.dim]}
             for i in graph.input if i.name not in inits]
    return path, [feeds]


def timed_phases() -> dict[str, float]:
    """Wrap each of PHASES to add its main-thread CPU seconds to the returned dict (filled as the steps run)."""
    import importlib

    spent: dict[str, float] = {}
    for module, owner, name, label in PHASES:
        holder = importlib.import_module(module)
        holder = getattr(holder, owner) if owner else holder
        original = getattr(holder, name)

        def timed(*args, _original=original, _label=label, **kwargs):
            began = time.thread_time()
            try:
                return _original(*args, **kwargs)
            finally:
                spent[_label] = spent.get(_label, 0.0) + time.thread_time() - began

        setattr(holder, name, timed)
    _time_imports_and_collections(spent)
    return spent


def _time_imports_and_collections(spent: dict[str, float]) -> None:
    """Add the main thread's CPU seconds in module imports (outermost ones: a module's own imports count in it) and
    in the cyclic collector's runs to ``spent`` (labels IMPORTS and COLLECTOR). Both nest in the phases above: a
    kernel family imported at placement counts in placement as well. Imports are timed around importlib's loader
    step (``_load_unlocked``, found at each import by name), which only a diagnostic may patch."""
    import gc
    import importlib._bootstrap as bootstrap

    load, depth, main = bootstrap._load_unlocked, [0], threading.get_ident()  # noqa: SLF001  (see above)

    def timed_load(spec):
        if depth[0] or threading.get_ident() != main:
            return load(spec)
        depth[0] += 1
        began = time.thread_time()
        try:
            return load(spec)
        finally:
            depth[0] -= 1
            spent[IMPORTS] = spent.get(IMPORTS, 0.0) + time.thread_time() - began

    began = [0.0]

    def collection(phase: str, info: dict) -> None:
        if threading.get_ident() != main:
            return
        if phase == "start":
            began[0] = time.thread_time()
        else:
            spent[COLLECTOR] = spent.get(COLLECTOR, 0.0) + time.thread_time() - began[0]

    bootstrap._load_unlocked = timed_load  # noqa: SLF001
    gc.callbacks.append(collection)


def worker(runtime: str, path: str, calls: list[list[dict]]) -> dict:
    import resource

    from zoo_feeds import make_feeds

    feeds = [make_feeds({"feeds": call}) for call in calls]
    cpu0 = time.process_time()
    if runtime == "ours":
        import onnx_runtime as rt
    else:
        import onnxruntime as rt
    phases = timed_phases() if runtime == "ours" and os.environ.get("COLD_START_PHASES") == "1" else {}
    cpu1, wall1 = time.process_time(), time.perf_counter()
    options = rt.SessionOptions()
    options.intra_op_num_threads = 1
    sess = rt.InferenceSession(path, options, providers=["CPUExecutionProvider"])
    cpu2 = time.process_time()
    for feed in feeds:
        sess.run(None, feed)
    cpu3, wall3 = time.process_time(), time.perf_counter()
    return {"import": cpu1 - cpu0, "create": cpu2 - cpu1, "first": cpu3 - cpu2, "wall": wall3 - wall1,
            "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "loaded": [m for m in HEAVY if m in sys.modules], "phases": phases}


def sample(runtime: str, path: str, calls: list[list[dict]], background: bool = True, plans: str = "warm",
           plan_dir: str | None = None, phases: bool = False) -> dict:
    argv = [sys.executable, str(Path(__file__).resolve()), "--worker", runtime, path, json.dumps(calls)]
    env = dict(os.environ, COLD_START_PHASES="1" if phases else "0")
    if not background:
        env["ONNX_RUNTIME_COMPILE_IN_BACKGROUND"] = "0"
    if plans == "off":
        env["ONNX_RUNTIME_PLAN_CACHE"] = "0"
    elif plan_dir is not None:
        env["ONNX_RUNTIME_PLAN_CACHE_DIR"] = plan_dir
        if plans == "miss" and runtime == "ours":
            for entry in os.listdir(plan_dir):
                if entry.endswith(".plan"):
                    os.remove(os.path.join(plan_dir, entry))
    done = subprocess.run(argv, capture_output=True, text=True, timeout=900, cwd=HERE, env=env)
    if done.returncode:
        raise SystemExit(f"{runtime} on {path} failed: {done.stderr.strip()[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def phase_table(everything: dict) -> None:
    labels = [label for *_, label in PHASES] + [IMPORTS, COLLECTOR]
    print("\nMain-thread CPU ms per step of ours' creation and first run (medians; placement nests in the "
          "specialized plans; imports and collector runs nest in the steps they happen in):\n")
    print("| model | " + " | ".join(labels) + " |")
    print("|---|" + "---|" * len(labels))
    for name, runs in everything.items():
        cells = [statistics.median(r["phases"].get(label, 0.0) for r in runs["ours"]) * 1e3 for label in labels]
        print(f"| {name} | " + " | ".join(f"{cell:.1f}" for cell in cells) + " |")


def main_job(repeat: int) -> None:
    """The README's main job as a fresh install runs it: ``onnx-runtime run`` (the embedded default model) in a
    new process with an empty numba cache and plan cache (both in an empty folder, emptied again after each run); wall
    and CPU time of the whole process (children included) and its peak RSS."""
    import resource
    import shutil
    import tempfile

    command = [sys.executable, "-m", "onnx_runtime.cli", "run"]
    print("| main job (`onnx-runtime run`) | wall s | CPU s | peak RSS MB |")
    print("|---|---|---|---|")
    with tempfile.TemporaryDirectory(prefix="cold_start_numba_") as cache:
        env = dict(os.environ, NUMBA_CACHE_DIR=cache, ONNX_RUNTIME_PLAN_CACHE_DIR=os.path.join(cache, "plans"))
        for _ in range(repeat):
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            began = time.perf_counter()
            done = subprocess.run(command, capture_output=True, text=True, timeout=900, env=env)
            wall = time.perf_counter() - began
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            if done.returncode or "MATCH" not in done.stdout:
                raise SystemExit(f"onnx-runtime run failed: {done.stdout[-1000:]} {done.stderr[-2000:]}")
            cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
            print(f"| empty numba cache | {wall:.1f} | {cpu:.1f} | {after.ru_maxrss / 1024:.0f} |", flush=True)
            for entry in os.listdir(cache):  # whatever the run compiled: the next one starts empty again
                shutil.rmtree(os.path.join(cache, entry), ignore_errors=True)


def compile_packages() -> None:
    """Write our packages' bytecode caches where missing or stale, as a wheel install does at install time: with
    PYTHONDONTWRITEBYTECODE set (or a fresh ``git archive`` copy on PYTHONPATH) every measured process would
    otherwise compile each such module from source, several times the import itself."""
    import compileall
    import importlib.util

    for package in ("onnx_runtime", "onnx_runtime_ep_cpu"):
        spec = importlib.util.find_spec(package)
        for location in (spec.submodule_search_locations or []) if spec is not None else []:
            compileall.compile_dir(location, quiet=1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(DEFAULT_MODELS), help="comma-separated zoo or light CNN names")
    parser.add_argument("--repeat", type=int, default=5, help="fresh processes per runtime and model (default 5)")
    parser.add_argument("--json", type=Path, help="write every sample here")
    parser.add_argument("--no-background", action="store_true",
                        help="load numba inside the first run, as before (ONNX_RUNTIME_COMPILE_IN_BACKGROUND=0)")
    parser.add_argument("--plans", choices=("warm", "miss", "off"), default="warm",
                        help="warm: a first, unmeasured process per model writes the plans the measured ones read; "
                             "miss: every process of ours starts without the model's plans and writes them; "
                             "off: ONNX_RUNTIME_PLAN_CACHE=0")
    parser.add_argument("--no-plan-cache", action="store_true", help="the same as --plans off")
    parser.add_argument("--main-job", action="store_true",
                        help="time the README's main job (onnx-runtime run) on an empty numba cache instead")
    parser.add_argument("--phases", action="store_true",
                        help="also show the main thread's CPU ms per step of our creation and first run")
    parser.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        runtime, path, calls = args.worker
        print(json.dumps(worker(runtime, path, json.loads(calls))))
        return 0
    if args.main_job:
        print(f"# cold_start --main-job {time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC, "
              f"load {os.getloadavg()[0]:.2f}")
        main_job(args.repeat)
        return 0
    sys.path.insert(0, str(HERE))
    compile_packages()
    plans = "off" if args.no_plan_cache else args.plans
    described = {"warm": "warm (written by an unmeasured first process)", "off": "off",
                 "miss": "missed (the model's plans removed before each process of ours)"}
    print(f"# cold_start {time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC, load {os.getloadavg()[0]:.2f}, "
          f"{args.repeat} fresh processes each; CPU ms (wall ms for creation + first run), medians; compiled loops "
          f"{'loaded inside the first run' if args.no_background else 'loaded in the background (numpy first)'}; "
          f"plan cache {described[plans]}")
    print("| model | import ours / ort | create ours / ort | first run ours / ort | create + first ours / ort "
          "(ratio) | wall ours / ort (ratio) | peak RSS MB ours / ort (ratio) | loaded (ours) |")
    print("|---|---|---|---|---|---|---|---|")
    everything = {}
    ratios: dict[str, list[float]] = {"import": [], "cpu": [], "wall": []}
    with tempfile.TemporaryDirectory(prefix="cold_start_plans_") as plan_dir:
        for name in args.models.split(","):
            path, calls = spec_of(name)
            runs: dict[str, list[dict]] = {"ours": [], "ort": []}
            # The first process writes the plans (warm) and the provider list (every mode): not measured.
            sample("ours", path, calls, not args.no_background, plans, plan_dir)
            for i in range(args.repeat):
                for runtime in (("ours", "ort") if i % 2 == 0 else ("ort", "ours")):
                    runs[runtime].append(sample(runtime, path, calls, not args.no_background, plans, plan_dir,
                                                args.phases))
            everything[name] = runs

            def med(runtime: str, *keys: str, scale: float = 1e3, runs: dict = runs) -> float:
                return statistics.median(sum(r[k] for k in keys) for r in runs[runtime]) * scale

            cf = {rt: med(rt, "create", "first") for rt in runs}
            wall = {rt: med(rt, "wall") for rt in runs}
            rss = {rt: med(rt, "rss_mb", scale=1) for rt in runs}
            ratios["import"].append(med("ours", "import") / med("ort", "import"))
            ratios["cpu"].append(cf["ours"] / cf["ort"])
            ratios["wall"].append(wall["ours"] / wall["ort"])
            print(f"| {name} | {med('ours', 'import'):.0f} / {med('ort', 'import'):.0f} | "
                  f"{med('ours', 'create'):.0f} / {med('ort', 'create'):.0f} | "
                  f"{med('ours', 'first'):.0f} / {med('ort', 'first'):.0f} | "
                  f"{cf['ours']:.0f} / {cf['ort']:.0f} ({cf['ours'] / cf['ort']:.2f}x) | "
                  f"{wall['ours']:.0f} / {wall['ort']:.0f} ({wall['ours'] / wall['ort']:.2f}x) | "
                  f"{rss['ours']:.0f} / {rss['ort']:.0f} ({rss['ours'] / rss['ort']:.2f}x) | "
                  f"{', '.join(runs['ours'][-1]['loaded'])} |", flush=True)

    def geomean(values: list[float]) -> float:
        return math.exp(sum(map(math.log, values)) / len(values))

    if args.phases:
        phase_table(everything)
    print(f"geomean ours / ort: import {geomean(ratios['import']):.2f}x; create + first CPU "
          f"{geomean(ratios['cpu']):.2f}x ({sum(r <= 2 for r in ratios['cpu'])} of {len(ratios['cpu'])} within 2x), "
          f"wall {geomean(ratios['wall']):.2f}x ({sum(r <= 2 for r in ratios['wall'])} of {len(ratios['wall'])} "
          f"within 2x); load {os.getloadavg()[0]:.2f}")
    if args.json:
        args.json.write_text(json.dumps(everything, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
