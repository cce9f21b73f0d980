"""Greedy generation speed, side by side in one process: this runtime's generate loop (onnx_runtime.generate,
CPU provider) against onnxruntime running the same greedy loop through its IO binding (the KV cache bound as
OrtValues, each step's presents bound as the next step's pasts) and against onnxruntime-genai where it is
installed and can load the export (a genai_config.json is written for it beside a link to the model;
``pip install -e '.[genai]'`` installs the pinned onnxruntime-genai 0.18.0, whose wheel runs on the installed
onnxruntime, 1.31 or later, and loads the zoo's and decoder_export.py's decoders, both exporters).

    .venv/bin/python benchmarks/generate_bench.py [--models 'gpt2.*fp32,llama.*fp32'] [--prompt 16] [--new 64]
        [--threads 1,0] [--rounds 5] [--zoo FOLDER] [--busy N]

For each model and thread count (0: each runtime's default), every engine runs the same prompt; their greedy
tokens are compared (a fast but wrong loop shows as "tokens differ"). Then the engines are timed in interleaved
rounds. Each round runs the whole generation twice per engine: with 1 new token (the time to first token:
prefill + argmax) and with ``--new`` tokens; the decode rate is (new - 1) / (T_new - T_1), T_new - T_1 taken
within each round and its median over the rounds (wall time, and this process's CPU time). With ``--busy N`` each
row is measured again beside N CPU-bound processes the script starts (zoo_bench's competitors), marked "busy".
Kernels load in the
foreground (``ONNX_RUNTIME_COMPILE_IN_BACKGROUND=0`` unless set), so no loader thread's work is counted as a
step's, and every engine generates once before the timed rounds. The table
gives tokens/s for each engine and the ratios ours/onnxruntime and ours/genai of tokens/s (higher is better:
>= 1 meets the target). onnxruntime-genai's loop is C++ around the same onnxruntime session, so its step is about
onnxruntime's run alone, without the 45-60 us per step the IO-binding loop spends in Python (binding calls,
outputs as OrtValues, argmax): genai is the stricter of the two targets.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from zoo_bench import Competitors  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
ZOO = Path(os.environ.get("ONNX_RUNTIME_ZOO") or ROOT / "benchmarks/.models/zoo")
CPU = "CPUExecutionProvider"


def decoders(pattern: str, zoo: Path = ZOO) -> list[tuple[str, int]]:
    """(name, positions) of the decoders in ``zoo``'s manifest that ``pattern`` matches (the zoo's hold 128)."""
    manifest = json.loads((zoo / "manifest.json").read_text())
    entries = manifest if isinstance(manifest, list) else manifest["models"]
    wanted = [re.compile(p.strip()) for p in pattern.split(",") if p.strip()]
    return [(e["name"], e.get("positions", 128)) for e in entries if e.get("architecture") == "decoder"
            and e.get("status", "ok") == "ok" and any(w.fullmatch(e["name"]) for w in wanted)]


# -- the engines: each a callable (prompt, new) -> tokens ---------------------------------------------------


def ours(path: str, threads: int):
    import onnx_runtime
    from onnx_runtime.generate import Generator

    options = onnx_runtime.SessionOptions()
    options.intra_op_num_threads = threads
    generator = Generator(path, [CPU], options)
    return lambda prompt, new: generator.generate(prompt, new).tokens


def onnxruntime_iobinding(path: str, threads: int):
    """onnxruntime's greedy loop as its IO binding is meant to be used on the CPU: inputs bound from numpy,
    outputs left to onnxruntime's allocator, each step's presents bound as the next step's pasts (no copies)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    session = ort.InferenceSession(path, options, providers=[CPU])
    inputs = {i.name: i for i in session.get_inputs()}
    outputs = [o.name for o in session.get_outputs()]
    pasts = [name for name in inputs if "past" in name]
    presents = [next(c for c in (p.replace("past_key_values", "present"), p.replace("past", "present"))
                     if c in outputs) for p in pasts]
    position_ids = "position_ids" in inputs

    def generate(prompt: list[int], new: int) -> list[int]:
        binding = session.io_binding()
        capacity = len(prompt) + new
        mask = np.ones((1, capacity), np.int64)
        for past in pasts:
            shape = inputs[past].shape
            dtype = np.float16 if "float16" in inputs[past].type else np.float32
            binding.bind_ortvalue_input(past, ort.OrtValue.ortvalue_from_numpy(np.zeros((1, shape[1], 0, shape[3]),
                                                                                        dtype)))
        for name in outputs:
            binding.bind_output(name, "cpu")
        ids = np.array([prompt], np.int64)
        positions = np.arange(len(prompt), dtype=np.int64)[None]
        tokens: list[int] = []
        total = len(prompt)
        for _ in range(new):
            binding.bind_cpu_input("input_ids", ids)
            binding.bind_cpu_input("attention_mask", mask[:, :total])
            if position_ids:
                binding.bind_cpu_input("position_ids", positions)
            session.run_with_iobinding(binding)
            values = dict(zip(outputs, binding.get_outputs()))
            tokens.append(int(np.argmax(values["logits"].numpy()[0, -1])))
            for past, present in zip(pasts, presents):
                binding.bind_ortvalue_input(past, values[present])
            for name in outputs:  # fresh outputs each step: the cache grows by a row, the logits shrink to one
                binding.bind_output(name, "cpu")
            ids = np.array([[tokens[-1]]], np.int64)
            positions = np.array([[total]], np.int64)
            total += 1
        return tokens

    return generate


def hidden_size(model, vocab: int) -> int:
    """The model's hidden size, from its constant 2-D tables with one side the vocabulary: the token embedding
    (vocabulary, hidden) and the output projection (hidden, vocabulary), or its transpose, float or quantized; the
    width most of them agree on. Raises ValueError where there is none (the engine is then left out, saying why)."""
    widths = Counter(dims[1 - dims.index(vocab)] for dims in (tuple(t.dims) for t in model.graph.initializer)
                     if len(dims) == 2 and dims.count(vocab) == 1)
    if not widths:
        raise ValueError(f"no constant (vocabulary, hidden) table with vocabulary {vocab} to read the hidden size from")
    return widths.most_common(1)[0][0]


def genai_folder(path: str, threads: int, max_length: int) -> str:
    """A folder onnxruntime-genai can load: a link to the export and a genai_config.json read from its inputs."""
    import onnx

    model = onnx.load(path, load_external_data=False)
    inputs = {i.name: i for i in model.graph.input}
    keys = sorted(n for n in inputs if re.fullmatch(r"past_key_values\.\d+\.key", n))
    dims = inputs[keys[0]].type.tensor_type.shape.dim
    kv_heads, head_size = dims[1].dim_value, dims[3].dim_value
    vocab = next(o for o in model.graph.output if o.name == "logits").type.tensor_type.shape.dim[2].dim_value
    kind = "llama"  # genai's decoder with separate key and value caches and position ids (its "gpt2" stacks them)
    hidden = hidden_size(model, vocab)
    if hidden % head_size:
        raise ValueError(f"{path}: hidden size {hidden} is not a multiple of the cache's head size {head_size}")
    heads = hidden // head_size  # query heads: a grouped-query export's cache has fewer (kv_heads)
    folder = tempfile.mkdtemp(prefix="generate_bench_genai_")
    os.symlink(os.path.abspath(path), os.path.join(folder, "model.onnx"))
    decoder_inputs = {"input_ids": "input_ids", "attention_mask": "attention_mask",
                      "past_key_names": "past_key_values.%d.key", "past_value_names": "past_key_values.%d.value"}
    if "position_ids" in inputs:
        decoder_inputs["position_ids"] = "position_ids"
    config = {
        "model": {
            "type": kind, "vocab_size": vocab, "context_length": max_length, "bos_token_id": 0,
            "eos_token_id": vocab - 1,
            "pad_token_id": 0,
            "decoder": {
                "filename": "model.onnx", "head_size": head_size, "hidden_size": hidden,
                "num_attention_heads": heads, "num_key_value_heads": kv_heads, "num_hidden_layers": len(keys),
                "session_options": {"intra_op_num_threads": threads, "provider_options": []},
                "inputs": decoder_inputs,
                "outputs": {"logits": "logits", "present_key_names": "present.%d.key",
                            "present_value_names": "present.%d.value"},
            },
        },
        "search": {"do_sample": False, "num_beams": 1, "max_length": max_length, "min_length": 0,
                   "past_present_share_buffer": False, "early_stopping": True},
    }
    Path(folder, "genai_config.json").write_text(json.dumps(config, indent=1))
    return folder


def onnxruntime_genai(path: str, threads: int, max_length: int):
    import onnxruntime_genai as og

    model = og.Model(genai_folder(path, threads, max_length))

    def generate(prompt: list[int], new: int) -> list[int]:
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=len(prompt) + new, min_length=len(prompt) + new, do_sample=False)
        generator = og.Generator(model, params)
        generator.append_tokens(np.array(prompt, np.int32))
        tokens: list[int] = []
        while len(tokens) < new:
            generator.generate_next_token()
            tokens.append(int(generator.get_next_tokens()[0]))
        return tokens

    return generate


# -- timing ---------------------------------------------------------------------------------------------------


def clocks(run) -> tuple[float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    run()
    return time.perf_counter() - wall, time.process_time() - cpu


def bench(engines: dict, prompt: list[int], new: int, rounds: int) -> dict[str, dict[str, float]]:
    for generate in engines.values():  # warm: each engine's first pass through these lengths is not timed
        generate(prompt, new)
    samples: dict[str, dict[str, list[float]]] = {n: {"w1": [], "c1": [], "dw": [], "dc": []} for n in engines}
    for _ in range(rounds):  # interleaved: load changes hit every engine alike
        for name, generate in engines.items():
            w1, c1 = clocks(lambda g=generate: g(prompt, 1))
            wn, cn = clocks(lambda g=generate: g(prompt, new))
            # The decode time as a difference within one round: the medians of two separate minima or medians
            # would pair a quiet first-token run with a busy whole one.
            for key, value in (("w1", w1), ("c1", c1), ("dw", wn - w1), ("dc", cn - c1)):
                samples[name][key].append(value)
    table = {}
    for name, s in samples.items():
        m = {k: statistics.median(v) for k, v in s.items()}
        # A decode that measured no time (noise larger than the work) gives nan, never an absurd rate.
        table[name] = {"ttft_ms": m["w1"] * 1e3, "ttft_cpu_ms": m["c1"] * 1e3,
                       "tps": (new - 1) / m["dw"] if m["dw"] > 0 else float("nan"),
                       "tps_cpu": (new - 1) / m["dc"] if m["dc"] > 0 else float("nan")}
    return table


def make_engines(path: str, threads: int, max_length: int, genai: bool) -> tuple[dict, list[str]]:
    """The engines that load this export, and why the others do not."""
    makers = {"ours": lambda: ours(path, threads), "ort": lambda: onnxruntime_iobinding(path, threads)}
    if genai:
        makers["genai"] = lambda: onnxruntime_genai(path, threads, max_length)
    engines, notes = {}, []
    for label, make in makers.items():
        try:
            engines[label] = make()
        except ImportError as error:
            notes.append(f"{label}: not installed ({error.name})")
        except Exception as error:  # an engine that cannot load this export: say why, time the others
            notes.append(f"{label}: {type(error).__name__}: {str(error).splitlines()[0][:120]}")
    return engines, notes


def compare_tokens(engines: dict, prompt: list[int], new: int, notes: list[str]) -> None:
    """Run each engine once; drop those that fail and note those whose greedy tokens differ from the first's."""
    reference: list[int] | None = None
    first = ""
    for label, generate in list(engines.items()):
        try:
            tokens = generate(prompt, new)
        except Exception as error:
            notes.append(f"{label} failed: {type(error).__name__}: {str(error).splitlines()[0][:120]}")
            del engines[label]
            continue
        if reference is None:
            reference, first = tokens, label
        elif tokens != reference:
            same = next((i for i, (a, b) in enumerate(zip(tokens, reference)) if a != b), len(tokens))
            notes.append(f"{label} tokens differ from {first}'s from token {same}")


def row(name: str, threads: int, table: dict, notes: list[str]) -> str:
    def cell(label: str) -> str:
        return f"{table[label]['tps']:7.0f} | {table[label]['tps_cpu']:5.0f}" if label in table else "-"

    def ratio(label: str) -> str:
        if "ours" not in table or label not in table:
            return "-"
        wall = table["ours"]["tps"] / table[label]["tps"]
        cpu = table["ours"]["tps_cpu"] / table[label]["tps_cpu"]
        return f"{wall:4.2f}|{cpu:4.2f}"

    ttft = "/".join(f"{table[k]['ttft_ms']:.1f}" if k in table else "-" for k in ("ours", "ort", "genai"))
    return (f"{name:28} {threads:>3}  {cell('ours'):>15}  {cell('ort'):>15}  {cell('genai'):>15}  "
            f"{ratio('ort'):>11}  {ratio('genai'):>11}  {ttft:>20}  {'; '.join(notes)}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=r"gpt2\..*\.fp32,llama\..*\.fp32",
                        help="comma-separated regular expressions over the zoo's decoder names")
    parser.add_argument("--prompt", type=int, default=16, help="prompt tokens")
    parser.add_argument("--new", type=int, default=64, help="new tokens per generation")
    parser.add_argument("--threads", default="1,0", help="intra-op thread counts to run (0: the default)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--no-genai", action="store_true", help="leave onnxruntime-genai out")
    parser.add_argument("--busy", type=int, default=0, help="also time each row beside this many CPU-bound processes")
    parser.add_argument("--zoo", type=Path, default=ZOO,
                        help="a folder of exports with a manifest.json (benchmarks/decoder_export.py writes one)")
    args = parser.parse_args(argv)
    # Steady state: numba kernels load before the first run returns, not in a thread whose CPU time process_time
    # would count into the timed steps (read as each session opens; set here, not at import, so that importing
    # this module, as a test does, leaves the importer's environment alone).
    os.environ.setdefault("ONNX_RUNTIME_COMPILE_IN_BACKGROUND", "0")
    found = decoders(args.models, args.zoo)
    if not found:
        print(f"no decoder in {args.zoo / 'manifest.json'} matches {args.models!r} (build the zoo: "
              f"scripts/build_zoo.sh)")
        return 1
    names = [name for name, positions in found if args.prompt + args.new <= positions]
    if not names:
        parser.error(f"--prompt + --new must stay within the decoders' positions ({min(p for _n, p in found)})")
    rng = np.random.default_rng(0)
    print(f"host: {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}; prompt {args.prompt}, new {args.new}, "
          f"{args.rounds} interleaved rounds; tokens/s after the first token (wall | CPU), TTFT wall ms")
    print(f"{'model':28} {'thr':>3}  {'ours tok/s':>15}  {'ort+iobind':>15}  {'genai':>15}  "
          f"{'ours/ort':>11}  {'ours/genai':>11}  {'TTFT ours/ort/genai':>20}  notes")
    for name in names:
        path = str(args.zoo / f"{name}.onnx")
        prompt = [int(t) for t in rng.integers(1, 1000, args.prompt)]
        for threads in (int(t) for t in args.threads.split(",")):
            engines, notes = make_engines(path, threads, args.prompt + args.new, not args.no_genai)
            compare_tokens(engines, prompt, args.new, notes)
            print(row(name, threads, bench(engines, prompt, args.new, args.rounds), notes))
            sys.stdout.flush()
            if args.busy:
                with Competitors(args.busy):
                    table = bench(engines, prompt, args.new, args.rounds)
                print(row(f"{name} busy {args.busy}", threads, table, []))
                sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
