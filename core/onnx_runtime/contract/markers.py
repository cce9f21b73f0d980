"""The pluggy markers of the provider contract: ``hookspec`` (core only) and ``hookimpl`` (providers)."""

import pluggy

PROJECT = "onnx_runtime"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)
