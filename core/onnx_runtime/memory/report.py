"""``onnx-runtime info MODEL --memory``: what a model takes, measured by running it once.

Host: the weights (how many bytes are mapped from external data rather than held in memory) and the process's
resident memory before and after the run. Per device: the governor's budget (limit, in use, high-water mark),
the session's weights there (resident, budget, pages and evictions), the run's peak activations, the pools the
provider put under the governor, and the allocation sites that took the most.
"""

from __future__ import annotations

import os
import resource

from ..contract.residency import Tier
from .governor import process_governor
from .mapped import mapped_region

__all__ = ["measure", "render"]


def _rss() -> int:
    try:
        with open("/proc/self/statm") as handle:
            return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def _size(nbytes: int | None) -> str:
    if nbytes is None:
        return "unbounded"
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{nbytes} B"


def measure(session, feeds: dict) -> dict:
    """Run ``session`` once on ``feeds`` and collect the report (see the module docstring)."""
    governor = process_governor()
    weights = session.model.graph.initializers
    mapped = sum(int(a.nbytes) for a in weights.values() if mapped_region(a) is not None)
    total = sum(int(getattr(a, "nbytes", 0)) for a in weights.values())
    for budget in session.memory_report()["budgets"]:
        governor.reset_high_water(budget["device"], Tier(budget["tier"]))
    rss_before = _rss()
    session.run(None, feeds)
    report = session.memory_report()
    report["host"] = {"weights": len(weights), "weight_bytes": total, "mapped_bytes": mapped,
                      "rss_before_run": rss_before, "rss_after_run": _rss(),
                      "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    report["peak_activations"] = {a["device"]: a["peak"] for a in report["activations"]}
    return report


def _host_tier(budget: dict) -> list[str]:
    """A pinned or host tier's line, when anything is charged to it or it is bounded."""
    if not budget["used"] and budget["limit"] is None:
        return []
    return [f"  {budget['tier'].replace('_', ' ')} memory for {budget['device']}: limit {_size(budget['limit'])}, "
            f"in use {_size(budget['used'])}, high-water {_size(budget['high_water'])}"]


def render(report: dict, sites: int = 5) -> list[str]:
    """The report as the lines ``info --memory`` prints."""
    host = report["host"]
    lines = ["memory:",
             f"  host: {host['weights']} weights, {_size(host['weight_bytes'])} "
             f"({_size(host['mapped_bytes'])} mapped from external data, read as touched); "
             f"RSS {_size(host['rss_before_run'])} before the run, {_size(host['rss_after_run'])} after, "
             f"peak {_size(host['peak_rss'])}"]
    weights = {w["device"]: w for w in report["weights"]}
    activations = {a["device"]: a for a in report["activations"]}
    for budget in report["budgets"]:
        if budget["tier"] != "device":
            lines += _host_tier(budget)
            continue
        device = budget["device"]
        lines.append(f"  device {device}: limit {_size(budget['limit'])}, in use {_size(budget['used'])}, "
                     f"high-water {_size(budget['high_water'])}, deferred {_size(budget['deferred'])}")
        w = weights.get(device)
        if w is not None:
            mode = f"paged under a {_size(w['budget'])} budget" if w["paged"] else "resident"
            lines.append(f"    weights: {w['weights']}, {_size(w['weight_bytes'])}, {mode}; reserved "
                         f"{_size(w['reserved'])}, resident now {_size(w['resident_bytes'])}, pages {w['pages']}, "
                         f"evictions {w['evictions']}, prefetches {w['prefetches']}")
        peak = report["peak_activations"].get(device)
        if peak is not None:
            lines.append(f"    peak activations and workspace of the run: {_size(peak)}")
        account = activations.get(device)
        if account is not None:
            for site in account["sites"][:sites]:
                lines.append(f"    allocation site {site['file']}:{site['line']}: {site['requests']} requests, "
                             f"{_size(site['bytes'])}")
    for provider, nbytes in report["pools"].items():
        if nbytes:
            lines.append(f"  {provider} pools under the governor: {_size(nbytes)}")
    lines += [f"  {provider} driver allocations at {site['file']}:{site['line']}: {site['requests']}, "
              f"{_size(site['bytes'])}"
              for provider, found in report.get("provider_sites", {}).items() for site in found[:sites]]
    if not any(budget["tier"] == "device" for budget in report["budgets"]):
        lines.append("  no device provider runs a node: the host's memory is the process's (no device budget)")
    return lines
