"""Work done once per process is paid by every new process's first session: the convolution modules' import
computes no Winograd transform (numpy-served first runs never take Winograd; the first Winograd convolution makes
it, once), and small convolutions are chosen without probing BLAS."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap


def test_the_winograd_transforms_are_made_at_the_first_winograd_convolution():
    script = textwrap.dedent("""
        import json
        import numpy as np
        calls = []
        kron = np.kron
        np.kron = lambda *args: calls.append(1) or kron(*args)
        from onnx_runtime.ir import Node
        from onnx_runtime_ep_cpu.algorithms import conv_blas, conv_path, window
        at_import = len(calls)
        rng = np.random.default_rng(3)
        x, w, b = rng.standard_normal((2, 8, 9, 10)), rng.standard_normal((6, 8, 3, 3)), rng.standard_normal(6)
        geo = window.Window(Node("Conv", [], [], attrs={"pads": [1, 1, 1, 1]}), [], needs_kernel=False).resolve(
            (9, 10), (3, 3))
        errors = []
        for dtype in (np.float32, np.float64, np.float32):
            y = conv_blas.conv_winograd(x.astype(dtype), conv_blas.winograd_weights(w, dtype), b.astype(dtype), geo)
            padded = np.pad(x, ((0, 0), (0, 0), (1, 1), (1, 1)))
            windows = np.lib.stride_tricks.sliding_window_view(padded, (3, 3), axis=(2, 3))
            expected = np.einsum("ncijkl,mckl->nmij", windows, w) + b.reshape(1, -1, 1, 1)
            errors.append([float(np.abs(y - expected).max()), float(np.abs(expected).max()), str(y.dtype)])
        print(json.dumps({"at_import": at_import, "after": len(calls), "errors": errors}))
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["at_import"] == 0
    assert found["after"] == 2  # B^T d B and A^T m A, once for every call and dtype
    for error, scale, dtype in found["errors"]:
        assert error <= (1e-5 if dtype == "float32" else 1e-12) * scale * 8 * 9, (error, scale, dtype)


def test_a_first_run_of_small_convolutions_never_probes_blas():
    """Whether BLAS accumulates in place (a test product through ctypes, once per process) only matters to a
    convolution whose columns reach taps_column_bytes: a CNN's small convolutions are chosen without asking."""
    script = textwrap.dedent("""
        import json
        import numpy as np
        from onnx import TensorProto, helper, numpy_helper
        import onnx_runtime as rt
        from onnx_runtime_ep_cpu import blas
        rng = np.random.default_rng(5)
        w, x = rng.standard_normal((8, 8, 3, 3)).astype(np.float32), rng.standard_normal((1, 8, 16, 16))
        graph = helper.make_graph(
            [helper.make_node("Conv", ["x", "w"], ["y"], pads=[1, 1, 1, 1])], "g",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, 16, 16])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8, 16, 16])],
            [numpy_helper.from_array(w, "w")])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
        options = rt.SessionOptions()
        options.intra_op_num_threads = 1
        session = rt.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        y = session.run(None, {"x": x.astype(np.float32)})[0]
        windows = np.lib.stride_tricks.sliding_window_view(np.pad(x, ((0, 0), (0, 0), (1, 1), (1, 1))), (3, 3),
                                                           axis=(2, 3))
        expected = np.einsum("ncijkl,mckl->nmij", windows, w.astype(np.float64))
        print(json.dumps({"probed": blas._gemm.cache_info().currsize, "error": float(np.abs(y - expected).max()),
                          "scale": float(np.abs(expected).max())}))
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["probed"] == 0
    assert found["error"] <= 1e-5 * found["scale"] * 72
