"""``onnx-runtime batch MODEL --input DATA --output OUT``: the command line of :func:`run_job`."""

from __future__ import annotations

import json
import sys


def add_parser(sub) -> None:
    p = sub.add_parser("batch", help="predict every row of a Parquet/NumPy/image data set into Parquet parts")
    p.add_argument("model")
    p.add_argument("--input", required=True, metavar="DATA",
                   help="a .parquet file or folder of them, a .npy/.npz file, or a folder of images")
    p.add_argument("--output", required=True, metavar="OUT", help="folder for part-NNNNNN.parquet and _summary.json")
    p.add_argument("--engine", choices=("local", "ray", "dask"), default="local",
                   help="local: a process pool here (default); ray / dask: their clusters (extras ray, dask)")
    p.add_argument("--address", help="the Ray or Dask cluster to use (default: start one on this machine)")
    p.add_argument("--workers", type=int, help="concurrent sessions (default: CPUs / --threads)")
    p.add_argument("--threads", type=int, help="intra-op threads per session (default: CPUs / --workers)")
    p.add_argument("--shard-rows", type=int, default=1024, help="rows per shard, the unit of resume (default 1024)")
    p.add_argument("--batch-size", type=int,
                   help="rows per model call (default: the model's batch, else a shard's rows in equal calls of at "
                        "most 32 where they split so, else 32)")
    p.add_argument("--id-column", help="a Parquet column holding row ids (default: the row's position)")
    p.add_argument("--outputs", help="comma-separated model outputs to write (default: all)")
    p.add_argument("--providers", help="comma-separated provider names (default: all available)")
    p.add_argument("--retries", type=int, default=3, help="times a dead worker's shards are retried (default 3)")
    p.add_argument("--overwrite", action="store_true", help="discard OUT's parts of a different job")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(func=cmd_batch)


def _names(value: str | None):
    return [v.strip() for v in value.split(",") if v.strip()] if value else None


def cmd_batch(args) -> int:
    from .runner import run_job

    summary = run_job(args.model, args.input, args.output, engine=args.engine, workers=args.workers,
                      threads=args.threads, shard_rows=args.shard_rows, batch_size=args.batch_size,
                      providers=_names(args.providers), id_column=args.id_column, outputs=_names(args.outputs),
                      address=args.address, retries=args.retries, overwrite=args.overwrite,
                      progress=not args.no_progress)
    if args.json:
        print(json.dumps(summary.as_dict(), indent=1, default=str))
    else:
        print(f"rows: {summary.rows} in {summary.shards} shards ({summary.skipped_shards} already written, skipped)")
        print(f"processed: {summary.processed_rows} rows in {summary.seconds:.2f} s, "
              f"{summary.rows_per_second:,.1f} rows/s ({summary.steady_rows_per_second:,.1f} rows/s after the "
              f"first shard, {summary.first_shard_seconds:.2f} s in)")
        print(f"failed rows: {len(summary.failures)}")
        for row_id, message in summary.failures[:20]:
            print(f"  row {row_id}: {message}")
        if len(summary.failures) > 20:
            print(f"  ... {len(summary.failures) - 20} more in {args.output}/_summary.json")
        for index, first, rows, message in summary.failed_shards:
            print(f"failed shard {index} (rows from {first}, {rows} rows, not written; rerun to retry): {message}",
                  file=sys.stderr)
    return 1 if summary.failures or summary.failed_shards else 0
