"""Helpers of the batch tests: the MLP's weights and float64 reference, and the check of a job's output."""

from __future__ import annotations

import numpy as np

IN, OUT = 16, 4


def weights(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((IN, OUT)).astype(np.float32)


def mlp_reference(x: np.ndarray) -> np.ndarray:
    """relu(x @ w) in float64: what the MLP model computes."""
    return np.maximum(np.asarray(x, np.float64) @ weights().astype(np.float64), 0.0)


def assert_predictions(table, rows: np.ndarray, ids) -> None:
    """Every row exactly once, each with the float64 reference's output (float32 tolerance)."""
    got_ids = table.column("row_id").to_pylist()
    assert sorted(got_ids) == sorted(ids), "rows lost or duplicated"
    assert len(set(got_ids)) == len(got_ids)
    position = {row_id: i for i, row_id in enumerate(ids)}
    order = [position[i] for i in got_ids]
    y = np.array(table.column("y").to_pylist(), np.float64)
    np.testing.assert_allclose(y, mlp_reference(rows[order]), rtol=1e-5, atol=1e-5)
    assert table.column("error").null_count == len(table)
